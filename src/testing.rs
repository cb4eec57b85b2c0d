//! What the library's own tests share: a database of a test's own on the
//! server `scripts/services.sh` starts, a publisher that takes every
//! message at once, a message of a key that is never sent, and a term.

use std::time::Duration;

use bson::{oid::ObjectId, Bson};
use futures::future::{self, BoxFuture, FutureExt};
use mongodb::Database;

use crate::config::DeadLetters;
use crate::contract::{ContractViolation, Decoded, OutboxMessage, Rule};
use crate::lease::Term;
use crate::observe::Metrics;
use crate::order::KeyOrder;
use crate::publish::{Ack, AckFuture, PublishError, Publisher};
use crate::work::Tenure;

/// A database of the test's own, with the relay's read and write concerns.
pub(crate) async fn database() -> Database {
    let uri = std::env::var("MONGODB_URI").unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
    let client = crate::connect::connect_mongodb(&uri)
        .await
        .unwrap_or_else(|e| panic!("this test needs a MongoDB replica set: {e}"));
    let name = format!("t{}", ObjectId::new().to_hex());
    crate::connect::coordinated(&client.database(&name), Duration::from_secs(10))
}

/// A broker that takes every message at once.
pub(crate) struct TakesAll;

impl Publisher for TakesAll {
    fn send<'a>(
        &'a self,
        _message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>> {
        let ack: AckFuture = future::ready(Ok(Ack::default())).boxed();
        future::ready(Ok(ack)).boxed()
    }

    fn max_payload(&self) -> usize {
        usize::MAX
    }
}

/// A term for a stage under test: `term` (the first if none is named)
/// with `order` (one with no key held if none is given).
pub(crate) fn tenure(term: Option<Term>, order: Option<KeyOrder>) -> Tenure {
    let order = order
        .unwrap_or_else(|| KeyOrder::new(Vec::new(), DeadLetters::Release, true, Metrics::new()));
    Tenure::begun(term.unwrap_or(Term(1)), order, 65_536)
}

/// A decoded message of `key`, for the tests of what is under way.
pub(crate) fn keyed(id: ObjectId, key: &str) -> Decoded {
    Decoded {
        id: Bson::ObjectId(id),
        message: Err(ContractViolation::new(Rule::Document, "not sent")),
        attempts: None,
        key: Some(key.to_owned()),
        stored: None,
    }
}
