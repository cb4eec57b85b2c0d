//! Dead letters: messages marked `failed`, listed, replayed or discarded.
//!
//! A replay puts a message back to `pending` with its attempts reset and its
//! last error moved into `errorHistory`, so what went wrong before is kept.
//! The next sweep pass delivers it. A dead letter that holds its key
//! (`holdsKey`, under `--on-dead-letter hold`) is released by either: a
//! replay clears the mark and the message goes before the key's parked
//! ones, a discard removes it, and the leader's next sweep notices. Each change matches `status: "failed"`,
//! so a message replayed or discarded twice at once is changed only once.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocument, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::Serialize;

use crate::contract::{field, status};
use crate::error::{Error, Result};
use crate::unreadable::RawField;

/// The field a replay moves the last error into.
pub const ERROR_HISTORY: &str = "errorHistory";

/// Replays in flight at once.
const REPLAY_CONCURRENCY: usize = 16;

/// Which failed messages a command acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    Ids(Vec<ObjectId>),
    Type(String),
    All,
}

impl Selection {
    fn filter(&self) -> Document {
        let mut filter = doc! { field::STATUS: status::FAILED };
        match self {
            Selection::Ids(ids) => {
                filter.insert(field::ID, doc! { "$in": ids });
            }
            Selection::Type(message_type) => {
                filter.insert(field::TYPE, message_type);
            }
            Selection::All => {}
        }
        filter
    }
}

/// One failed message, as `dlq list` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    pub id: String,
    #[serde(rename = "type")]
    pub message_type: Option<String>,
    pub failed_at: Option<String>,
    pub attempts: i64,
    pub last_error: Option<String>,
}

impl DeadLetter {
    /// One failed message as stored: what the driver cannot read of it (a
    /// string that is not UTF-8) is shown as near as can be, not an error.
    fn from_raw(document: &RawDocument) -> Self {
        let value = |name: &str| RawField::of(document, name).and_then(|f| f.as_bson());
        DeadLetter {
            id: match RawField::of(document, field::ID) {
                Some(id) => match id.as_bson() {
                    Some(Bson::ObjectId(id)) => id.to_hex(),
                    Some(other) => other.to_string(),
                    None => id.lossy(),
                },
                None => "(no _id)".to_owned(),
            },
            message_type: RawField::of(document, field::TYPE).map(|t| match t.as_bson() {
                Some(Bson::String(name)) => name,
                Some(other) => other.to_string(),
                None => t.lossy(),
            }),
            failed_at: match value(field::FAILED_AT) {
                Some(Bson::DateTime(at)) => at.try_to_rfc3339_string().ok(),
                _ => None,
            },
            attempts: match value(field::ATTEMPTS) {
                Some(Bson::Int32(n)) => i64::from(n),
                Some(Bson::Int64(n)) => n,
                _ => 0,
            },
            last_error: match value(field::LAST_ERROR) {
                Some(Bson::String(error)) => Some(error),
                _ => None,
            },
        }
    }
}

/// How many failed messages `selection` matches.
pub async fn count(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    outbox
        .count_documents(selection.filter())
        .await
        .map_err(|e| {
            Error::mongo("counting failed messages failed", e).needing("find", outbox.namespace())
        })
}

/// The newest failed messages matching `selection`, at most `limit`.
pub async fn list(
    outbox: &Collection<Document>,
    selection: &Selection,
    limit: u32,
) -> Result<Vec<DeadLetter>> {
    let failed =
        |e| Error::mongo("listing failed messages failed", e).needing("find", outbox.namespace());
    let documents: Vec<RawDocumentBuf> = outbox
        .clone_with_type::<RawDocumentBuf>()
        .find(selection.filter())
        .sort(doc! { field::FAILED_AT: -1, field::ID: -1 })
        .limit(i64::from(limit))
        .projection(doc! { field::PAYLOAD: 0, field::HEADERS: 0 })
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    Ok(documents
        .iter()
        .map(|document| DeadLetter::from_raw(document))
        .collect())
}

/// Puts the selected failed messages back to `pending`; returns how many.
pub async fn replay(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    let failed =
        |e| Error::mongo("replaying failed messages failed", e).needing("find", outbox.namespace());
    let now = DateTime::now();
    let found = outbox
        .clone_with_type::<RawDocumentBuf>()
        .find(selection.filter())
        .projection(doc! {
            field::ID: 1, field::LAST_ERROR: 1, field::FAILED_AT: 1, field::ATTEMPTS: 1,
        })
        .await
        .map_err(failed)?;
    found
        .map_err(failed)
        .map_ok(|document| replay_one(outbox, document, now))
        .try_buffer_unordered(REPLAY_CONCURRENCY)
        .try_fold(0, |replayed, changed| async move { Ok(replayed + changed) })
        .await
}

/// Replays one failed message as stored. One whose `_id` the driver
/// cannot read is left failed, with a warning: it would fail again at once,
/// and a replay of the rest must not stop at it.
async fn replay_one(
    outbox: &Collection<Document>,
    document: RawDocumentBuf,
    now: DateTime,
) -> Result<u64> {
    let value = |name: &str| RawField::of(&document, name).and_then(|f| f.as_bson());
    let Some(id) = RawField::of(&document, field::ID) else {
        return Ok(0);
    };
    let Some(id) = id.as_bson() else {
        tracing::warn!(
            id = %id.lossy(),
            "not replayed: the message's _id is not UTF-8, so it would fail again at once; \
             correct it, or remove it with dlq discard"
        );
        return Ok(0);
    };
    let history = doc! {
        "error": value(field::LAST_ERROR).unwrap_or(Bson::Null),
        "failedAt": value(field::FAILED_AT).unwrap_or(Bson::Null),
        "attempts": value(field::ATTEMPTS).unwrap_or(Bson::Int32(0)),
        "replayedAt": now,
    };
    let update = doc! {
        "$set": { field::STATUS: status::PENDING, field::ATTEMPTS: 0, field::NEXT_ATTEMPT_AT: now },
        "$unset": {
            field::FAILED_AT: "", field::LAST_ERROR: "", field::LOCK_ID: "", field::LOCKED_AT: "",
            field::HOLDS_KEY: "",
        },
        "$push": { ERROR_HISTORY: history },
    };
    let result = outbox
        .update_one(
            doc! { field::ID: id, field::STATUS: status::FAILED },
            update,
        )
        .await
        .map_err(|e| {
            Error::mongo("replaying a failed message failed", e)
                .needing("update", outbox.namespace())
        })?;
    Ok(result.modified_count)
}

/// Deletes the selected failed messages; returns how many.
pub async fn discard(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    outbox
        .delete_many(selection.filter())
        .await
        .map(|result| result.deleted_count)
        .map_err(|e| {
            Error::mongo("discarding failed messages failed", e)
                .needing("remove", outbox.namespace())
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unreadable::tests::with_string;

    #[test]
    fn a_dead_letter_whose_fields_are_not_utf8_is_listed_as_near_as_can_be() {
        let at = DateTime::from_millis(1_700_000_000_000);
        let rest =
            doc! { "type": "order.placed", "attempts": 3, "failedAt": at, "lastError": "no" };
        let listed = DeadLetter::from_raw(&with_string("_id", b"ab\xff", &rest));
        assert_eq!(listed.id, "\"ab\u{fffd}\"");
        assert_eq!(listed.message_type.as_deref(), Some("order.placed"));
        assert_eq!(listed.attempts, 3);
        assert_eq!(listed.last_error.as_deref(), Some("no"));
        assert!(listed.failed_at.is_some());
        let id = ObjectId::new();
        let odd_type = with_string("type", b"t\xfe", &doc! { "_id": id });
        let listed = DeadLetter::from_raw(&odd_type);
        assert_eq!(listed.id, id.to_hex());
        assert_eq!(listed.message_type.as_deref(), Some("\"t\u{fffd}\""));
    }
}
