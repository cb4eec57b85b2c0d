//! What the library's own tests share: a database of a test's own on the
//! server `scripts/services.sh` starts.

use std::time::Duration;

use bson::oid::ObjectId;
use mongodb::Database;

/// A database of the test's own, with the relay's read and write concerns.
pub(crate) async fn database() -> Database {
    let uri = std::env::var("MONGODB_URI").unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
    let client = crate::connect::connect_mongodb(&uri)
        .await
        .unwrap_or_else(|e| panic!("this test needs a MongoDB replica set: {e}"));
    let name = format!("t{}", ObjectId::new().to_hex());
    crate::connect::coordinated(&client.database(&name), Duration::from_secs(10))
}
