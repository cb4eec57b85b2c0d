//! Dead letters: messages marked `failed`, listed, replayed or discarded.
//!
//! A replay puts a message back to `pending` with its attempts reset and its
//! last error moved into `errorHistory`, so what went wrong before is kept.
//! The next sweep pass delivers it. A dead letter that holds its key
//! (`holdsKey`, under `--on-dead-letter hold`) is released by either: a
//! replay clears the mark and the message goes before the key's parked
//! ones, a discard removes it, and the leader's next sweep notices. Each change matches `status: "failed"`,
//! so a message replayed or discarded twice at once is changed only once.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::Serialize;

use crate::contract::{field, status};
use crate::error::{Error, Result};

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
    fn from_document(document: &Document) -> Self {
        DeadLetter {
            id: match document.get(field::ID) {
                Some(Bson::ObjectId(id)) => id.to_hex(),
                Some(other) => other.to_string(),
                None => "(no _id)".to_owned(),
            },
            message_type: document.get_str(field::TYPE).ok().map(str::to_owned),
            failed_at: document
                .get_datetime(field::FAILED_AT)
                .ok()
                .and_then(|t| t.try_to_rfc3339_string().ok()),
            attempts: match document.get(field::ATTEMPTS) {
                Some(Bson::Int32(n)) => i64::from(*n),
                Some(Bson::Int64(n)) => *n,
                _ => 0,
            },
            last_error: document.get_str(field::LAST_ERROR).ok().map(str::to_owned),
        }
    }
}

/// How many failed messages `selection` matches.
pub async fn count(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    outbox
        .count_documents(selection.filter())
        .await
        .map_err(|e| Error::mongo("counting failed messages failed", e))
}

/// The newest failed messages matching `selection`, at most `limit`.
pub async fn list(
    outbox: &Collection<Document>,
    selection: &Selection,
    limit: u32,
) -> Result<Vec<DeadLetter>> {
    let failed = |e| Error::mongo("listing failed messages failed", e);
    let documents: Vec<Document> = outbox
        .find(selection.filter())
        .sort(doc! { field::FAILED_AT: -1, field::ID: -1 })
        .limit(i64::from(limit))
        .projection(doc! { field::PAYLOAD: 0, field::HEADERS: 0 })
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    Ok(documents.iter().map(DeadLetter::from_document).collect())
}

/// Puts the selected failed messages back to `pending`; returns how many.
pub async fn replay(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    let failed = |e| Error::mongo("replaying failed messages failed", e);
    let now = DateTime::now();
    let found = outbox
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

async fn replay_one(
    outbox: &Collection<Document>,
    document: Document,
    now: DateTime,
) -> Result<u64> {
    let Some(id) = document.get(field::ID).cloned() else {
        return Ok(0);
    };
    let history = doc! {
        "error": document.get(field::LAST_ERROR).cloned().unwrap_or(Bson::Null),
        "failedAt": document.get(field::FAILED_AT).cloned().unwrap_or(Bson::Null),
        "attempts": document.get(field::ATTEMPTS).cloned().unwrap_or(Bson::Int32(0)),
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
        .map_err(|e| Error::mongo("replaying a failed message failed", e))?;
    Ok(result.modified_count)
}

/// Deletes the selected failed messages; returns how many.
pub async fn discard(outbox: &Collection<Document>, selection: &Selection) -> Result<u64> {
    outbox
        .delete_many(selection.filter())
        .await
        .map(|result| result.deleted_count)
        .map_err(|e| Error::mongo("discarding failed messages failed", e))
}
