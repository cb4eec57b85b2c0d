pub(crate) mod create_collection;
