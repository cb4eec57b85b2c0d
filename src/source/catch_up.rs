//! The catch-up pass: delivers what is already pending in the collection.
//!
//! Run at start when there is no resume token, after the change stream is
//! opened: anything committed before the stream opened is found here, and
//! anything after arrives on the stream, so nothing falls between the two.
//! A message committed while the pass runs can be found by both; the pass
//! returns the ids it queued so the stream can skip those (see
//! `change_stream`), and should one slip through anyway, JetStream drops
//! the repeat by its `Nats-Msg-Id` and the second mark matches nothing.

use std::collections::HashSet;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Collection;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status, DecodeRules};
use crate::error::{Error, Result};
use crate::pipeline::Work;

/// The filter for pending messages whose next attempt is due.
pub(crate) fn due_filter(now: DateTime) -> Document {
    doc! {
        field::STATUS: status::PENDING,
        "$or": [
            { field::NEXT_ATTEMPT_AT: { "$exists": false } },
            { field::NEXT_ATTEMPT_AT: { "$lte": now } },
        ],
    }
}

/// Feeds every due pending message, oldest first, into the pipeline.
/// Returns the ids it queued, or `None` if the relay stopped first.
pub(crate) async fn run(
    outbox: &Collection<Document>,
    rules: &DecodeRules,
    output: &mpsc::Sender<Work>,
    shutdown: &CancellationToken,
) -> Result<Option<HashSet<ObjectId>>> {
    let mut cursor = outbox
        .find(due_filter(DateTime::now()))
        .sort(doc! { field::ID: 1 })
        .await
        .map_err(|e| Error::mongo("reading pending messages failed", e))?;
    let mut queued = HashSet::new();
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            next = cursor.try_next() => next,
        };
        let Some(document) =
            next.map_err(|e| Error::mongo("reading pending messages failed", e))?
        else {
            return Ok(Some(queued));
        };
        let decoded = rules.decode(&document);
        if let Bson::ObjectId(id) = decoded.id {
            queued.insert(id);
        }
        if output
            .send(Work::from_collection(decoded, None))
            .await
            .is_err()
        {
            return Ok(None);
        }
    }
}
