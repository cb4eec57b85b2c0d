pub(crate) mod perf;
pub(crate) mod shutdown;
