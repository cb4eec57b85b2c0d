//! The outbox's state as MongoDB holds it: how many messages wait and how
//! old the oldest is ([`Depths`]), the checkpoint document as a reader sees
//! it ([`Checkpoint`]: the stored position and the lease), and the span of
//! the server's oplog ([`Oplog`]).
//!
//! Two readers ask the same questions: `outbox-relay status`
//! ([`crate::admin`]) and the relay's collector ([`crate::observe`]), which
//! turns the answers into metrics. The reads live here, below both, so
//! neither command nor metrics imports the other. Each is served by the
//! sweep index or by a small result set, so it stays cheap on large
//! collections.

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::{Client, Collection};
use serde::Serialize;

use crate::checkpoint::{CheckpointStore, POSITION_AT};
use crate::contract::{field, status};
use crate::error::{Error, Result};
use crate::time::{as_rfc3339, seconds_between};

/// Pending and failed depths, and the oldest pending message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depths {
    pub pending: u64,
    pub failed: u64,
    /// When the oldest pending message was created (its ObjectId's time).
    pub oldest_pending: Option<DateTime>,
}

impl Depths {
    /// Reads the depths of `outbox`.
    pub async fn read(outbox: &Collection<Document>) -> Result<Self> {
        let count = |state: &'static str| async move {
            outbox
                .count_documents(doc! { field::STATUS: state })
                .await
                .map_err(|e| {
                    Error::mongo(format!("counting {state} messages failed"), e)
                        .needing("find", outbox.namespace())
                })
        };
        Ok(Depths {
            pending: count(status::PENDING).await?,
            failed: count(status::FAILED).await?,
            oldest_pending: oldest_pending(outbox).await?,
        })
    }
}

/// The creation time of the oldest pending message: the smallest `_id`
/// among those never tried (the first entry of their index range) and
/// among the rest, those awaiting a retry and misfits whose `nextAttemptAt`
/// is not a date (a small set). Only ObjectIds tell a creation time; a
/// pending document with another `_id` breaks the contract and is failed
/// as soon as the relay reads it.
async fn oldest_pending(outbox: &Collection<Document>) -> Result<Option<DateTime>> {
    let failed = |e| {
        Error::mongo("finding the oldest pending message failed", e)
            .needing("find", outbox.namespace())
    };
    let any_object_id = doc! { "$gte": ObjectId::from_bytes([0; 12]) };
    let never_tried = outbox
        .find_one(doc! {
            field::STATUS: status::PENDING,
            field::NEXT_ATTEMPT_AT: Bson::Null,
            field::ID: any_object_id.clone(),
        })
        .sort(doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 })
        .projection(doc! { field::ID: 1 })
        .await
        .map_err(failed)?;
    let others: Vec<Document> = outbox
        .aggregate([
            doc! { "$match": {
                field::STATUS: status::PENDING,
                field::NEXT_ATTEMPT_AT: { "$ne": Bson::Null },
                field::ID: any_object_id,
            } },
            doc! { "$group": { "_id": Bson::Null, "oldest": { "$min": "$_id" } } },
        ])
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    let ids = never_tried
        .iter()
        .filter_map(|d| d.get_object_id(field::ID).ok())
        .chain(others.iter().filter_map(|d| d.get_object_id("oldest").ok()));
    Ok(ids.map(|id: ObjectId| id.timestamp()).min())
}

/// The checkpoint document: the stored position and the lease.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Checkpoint {
    /// Whether a resume token is stored.
    pub has_token: bool,
    /// When the stored position was reached (its event's commit time).
    #[serde(serialize_with = "as_rfc3339")]
    pub position_at: Option<DateTime>,
    /// When the token was last written.
    #[serde(serialize_with = "as_rfc3339")]
    pub updated_at: Option<DateTime>,
    /// The relay holding (or last holding) the lease.
    pub owner: Option<String>,
    pub term: Option<i64>,
    #[serde(serialize_with = "as_rfc3339")]
    pub lease_expires_at: Option<DateTime>,
}

impl Checkpoint {
    /// Reads the checkpoint of `store`'s outbox; the default if none exists.
    pub async fn read(store: &CheckpointStore) -> Result<Self> {
        let Some(document) = store.document().await? else {
            return Ok(Checkpoint::default());
        };
        let time = |name| document.get_datetime(name).ok().copied();
        Ok(Checkpoint {
            has_token: document.contains_key("token"),
            position_at: time(POSITION_AT),
            updated_at: time("updatedAt"),
            owner: document.get_str("owner").ok().map(str::to_owned),
            term: match document.get("term") {
                Some(Bson::Int64(term)) => Some(*term),
                Some(Bson::Int32(term)) => Some(i64::from(*term)),
                _ => None,
            },
            lease_expires_at: time("expiresAt"),
        })
    }
}

/// The span of the server's oplog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oplog {
    /// Wall time of the oldest entry still held.
    pub first: DateTime,
    /// Wall time of the newest entry.
    pub last: DateTime,
}

impl Oplog {
    /// Reads the first and last entries of `local.oplog.rs`. `Ok(None)` if
    /// it is empty; an error where it cannot be read (a user without read
    /// access to `local`; through mongos, which refuses `local`, it is not
    /// asked: see `Deployment::oplog_unreadable`).
    pub async fn read(client: &Client) -> Result<Option<Self>> {
        let oplog = client.database("local").collection::<Document>("oplog.rs");
        let entry = |direction: i32| {
            let oplog = oplog.clone();
            async move {
                oplog
                    .find_one(doc! {})
                    .sort(doc! { "$natural": direction })
                    .projection(doc! { "ts": 1, "wall": 1 })
                    .await
                    .map_err(|e| Error::mongo("reading local.oplog.rs failed", e))
            }
        };
        let (Some(first), Some(last)) = (entry(1).await?, entry(-1).await?) else {
            return Ok(None);
        };
        match (entry_time(&first), entry_time(&last)) {
            (Some(first), Some(last)) => Ok(Some(Oplog { first, last })),
            _ => Ok(None),
        }
    }

    /// The time from the first entry to the last.
    pub fn window_seconds(&self) -> f64 {
        seconds_between(self.first, self.last)
    }

    /// How much history lies before `position`: how long until the oplog
    /// drops it, if it keeps its current span. Negative once it is gone.
    pub fn headroom_seconds(&self, position: DateTime) -> f64 {
        seconds_between(self.first, position)
    }
}

/// An entry's wall time, or its timestamp's seconds on servers before 3.6.
fn entry_time(entry: &Document) -> Option<DateTime> {
    entry.get_datetime("wall").ok().copied().or_else(|| {
        entry
            .get_timestamp("ts")
            .ok()
            .map(|ts| DateTime::from_millis(i64::from(ts.time) * 1000))
    })
}
