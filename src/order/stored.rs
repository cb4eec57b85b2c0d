//! Held keys as the collection records them: what a new leader starts
//! from, and what `status` lists.
//!
//! A key is held by its earliest message that is pending with a retry
//! scheduled (`nextAttemptAt` a date other than [`PARKED`]), or failed and
//! marked `holdsKey` (a dead letter under `--on-dead-letter hold`). A key
//! with parked messages and no such holder is releasing: its holder went,
//! and the parked messages are next.

use std::collections::BTreeMap;

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Collection;

use super::earlier;
use crate::contract::{field, status};
use crate::error::{Error, Result};

/// The `nextAttemptAt` of a parked message: the last millisecond of year
/// 9999, later than any range the sweep reads, and plain to a reader.
pub const PARKED: DateTime = DateTime::from_millis(253_402_300_799_999);

/// A held key as the collection records it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldKey {
    pub key: String,
    /// The message holding the key: refused and waiting for its retry, or
    /// a dead letter that holds it. `None`: the key is releasing.
    pub holder: Option<Bson>,
    /// The holder is a dead letter (`failed`, marked `holdsKey`).
    pub dead_letter: bool,
    /// Messages of the key parked behind the holder.
    pub parked: u64,
    /// When the oldest message the key waits on was created.
    pub since: DateTime,
}

/// Reads the held keys from the outbox collection, oldest first.
pub async fn held_keys(outbox: &Collection<Document>) -> Result<Vec<HeldKey>> {
    let failed = |e| Error::mongo("reading held keys failed", e);
    let groups: Vec<Document> = outbox
        .aggregate(held_key_groups())
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    let mut keys: BTreeMap<String, HeldKey> = BTreeMap::new();
    for group in &groups {
        let Some(found) = Group::read(group) else {
            continue;
        };
        let held = keys.entry(found.key.clone()).or_insert_with(|| HeldKey {
            key: found.key.clone(),
            holder: None,
            dead_letter: false,
            parked: 0,
            since: found.since,
        });
        held.since = held.since.min(found.since);
        if found.parked {
            held.parked += found.count;
        } else if held
            .holder
            .as_ref()
            .is_none_or(|h| earlier(&found.first, h))
        {
            held.holder = Some(found.first.clone());
            held.dead_letter = found.failed;
        }
    }
    let mut held: Vec<HeldKey> = keys.into_values().collect();
    held.sort_by_key(|h| h.since);
    Ok(held)
}

/// The parked messages of `keys`, in the sweep index's order (by `_id`
/// within the parked range), for a release to read.
pub(crate) fn parked_messages(keys: &[String]) -> (Document, Document) {
    let filter = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: PARKED,
        // Both, so that a partial index on string keys serves too.
        "$and": [ { field::KEY: { "$type": "string" } }, { field::KEY: { "$in": keys } } ],
    };
    let order = doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 };
    (filter, order)
}

/// Groups of keyed messages that hold or wait: by key, status, and whether
/// parked, each with its earliest `_id` and how many.
fn held_key_groups() -> Vec<Document> {
    vec![
        doc! { "$match": {
            field::KEY: { "$type": "string" },
            // Only an ObjectId can hold a key (others break the contract),
            // and one must not hide an ObjectId's group minimum.
            field::ID: { "$type": "objectId" },
            "$or": [
                { field::STATUS: status::PENDING, field::NEXT_ATTEMPT_AT: { "$type": "date" } },
                { field::STATUS: status::FAILED, field::HOLDS_KEY: true },
            ],
        } },
        doc! { "$group": {
            "_id": {
                "key": "$key",
                "status": "$status",
                "parked": { "$eq": ["$nextAttemptAt", PARKED] },
            },
            "first": { "$min": "$_id" },
            "count": { "$sum": 1 },
        } },
    ]
}

/// One group of [`held_key_groups`].
struct Group {
    key: String,
    failed: bool,
    parked: bool,
    first: Bson,
    count: u64,
    since: DateTime,
}

impl Group {
    fn read(group: &Document) -> Option<Self> {
        let id = group.get_document("_id").ok()?;
        let Bson::ObjectId(first) = group.get("first")? else {
            return None;
        };
        let count = match group.get("count") {
            Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
            Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
            _ => 0,
        };
        Some(Group {
            key: id.get_str("key").ok()?.to_owned(),
            failed: id.get_str("status").ok()? == status::FAILED,
            parked: id.get_bool("parked").unwrap_or(false),
            first: Bson::ObjectId(*first),
            count,
            since: first.timestamp(),
        })
    }
}
