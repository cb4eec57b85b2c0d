//! The catch-up pass: delivers what is already pending in the collection.
//!
//! Run at start when there is no resume token, after the change stream is
//! opened: anything committed before the stream opened is found here, and
//! anything after arrives on the stream, so nothing falls between the two.
//! A message committed while the pass runs can be found by both; the pass
//! returns the ids it queued so the stream can skip those (see
//! `change_stream`), and should one slip through anyway, JetStream drops
//! the repeat by its `Nats-Msg-Id` and the second mark matches nothing.
//!
//! Only ids that could still appear on the stream are kept: those created
//! within [`REPEAT_WINDOW`] of the stream's opening, at most
//! [`MAX_REMEMBERED`] of them. A backlog of ten million older messages costs
//! no memory here.

use std::collections::HashSet;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status, DecodeRules};
use crate::error::{Error, Result};
use crate::work::{Feed, Work};

/// How long before the stream opened a message the stream may still show
/// can have been created: an ObjectId is made when the writer inserts, and
/// its transaction may commit up to a minute later (MongoDB's default
/// `transactionLifetimeLimitSeconds`), plus clock skew between hosts.
pub(crate) const REPEAT_WINDOW: Duration = Duration::from_secs(300);

/// The most ids a pass remembers; past it, a repeat is dropped by JetStream.
pub(crate) const MAX_REMEMBERED: usize = 100_000;

/// The filter for pending messages whose next attempt is due. Anything
/// but a future date counts as due: a `nextAttemptAt` the relay did not
/// write (a string, say) must not hide a message.
pub(crate) fn due_filter(now: DateTime) -> Document {
    doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$not": { "$gt": now } },
    }
}

/// Feeds every due pending message, oldest first, into the pipeline.
/// Returns the ids it queued that the stream, opened at `opened`, may
/// still show; `None` if the relay stopped first.
pub(crate) async fn run(
    outbox: &Collection<Document>,
    rules: &DecodeRules,
    opened: DateTime,
    output: &Feed,
    shutdown: &CancellationToken,
) -> Result<Option<HashSet<ObjectId>>> {
    let window = i64::try_from(REPEAT_WINDOW.as_millis()).unwrap_or(i64::MAX);
    let recent = opened.timestamp_millis().saturating_sub(window);
    let mut cursor = outbox
        .clone_with_type::<RawDocumentBuf>()
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
        let decoded = rules.decode_raw(&document);
        if let Bson::ObjectId(id) = decoded.id {
            let created = id.timestamp().timestamp_millis();
            if created >= recent && queued.len() < MAX_REMEMBERED {
                queued.insert(id);
            }
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
