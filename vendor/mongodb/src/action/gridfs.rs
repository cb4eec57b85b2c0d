//! Action builders for gridfs.

mod delete;
mod download;
mod drop;
mod find;
mod rename;
mod upload;

pub use delete::{Delete, DeleteByName};
pub use download::{OpenDownloadStream, OpenDownloadStreamByName};
pub use drop::Drop;
pub use find::{Find, FindOne};
pub use rename::{Rename, RenameByName};
pub use upload::OpenUploadStream;
