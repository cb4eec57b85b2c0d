//! The catch-up pass: delivers what is already pending in the collection.
//!
//! Run at start when there is no resume token, after the change stream is
//! opened: anything committed before the stream opened is found here, and
//! anything after arrives on the stream, so nothing falls between the two.
//! A message found by both is published twice and deduplicated by its
//! `Nats-Msg-Id`; marking it twice is harmless because marks match
//! `status: "pending"`.

use bson::{doc, DateTime, Document};
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
/// Returns how many it found, or `None` if the relay stopped first.
pub(crate) async fn run(
    outbox: &Collection<Document>,
    rules: &DecodeRules,
    output: &mpsc::Sender<Work>,
    shutdown: &CancellationToken,
) -> Result<Option<u64>> {
    let mut cursor = outbox
        .find(due_filter(DateTime::now()))
        .sort(doc! { field::ID: 1 })
        .await
        .map_err(|e| Error::mongo("reading pending messages failed", e))?;
    let mut found = 0;
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            next = cursor.try_next() => next,
        };
        let Some(document) =
            next.map_err(|e| Error::mongo("reading pending messages failed", e))?
        else {
            return Ok(Some(found));
        };
        found += 1;
        if output
            .send(Work::from_collection(rules.decode(&document), None))
            .await
            .is_err()
        {
            return Ok(None);
        }
    }
}
