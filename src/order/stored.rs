//! Held keys as the collection records them: what a new leader starts
//! from, what a leader checks now and then for writes it did not see, and
//! what `status` lists.
//!
//! A key is held by every message of it that is pending with a retry
//! scheduled (`nextAttemptAt` a date other than [`PARKED`]), and, where
//! dead letters hold their keys (`--on-dead-letter hold`), by every one
//! failed and marked `holdsKey`. A key with parked messages and no holder
//! is releasing: its holders went, and the parked messages are next.
//! Only messages whose `_id` is an ObjectId hold or wait: the others break
//! the contract, and `_id` order could not place them.

use std::collections::BTreeMap;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocument, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;

use crate::config::DeadLetters;
use crate::contract::{field, status};
use crate::error::{Error, Result};
use crate::partition::Partition;

/// The `nextAttemptAt` of a parked message: the last millisecond of year
/// 9999, later than any range the sweep reads, and plain to a reader.
pub const PARKED: DateTime = DateTime::from_millis(253_402_300_799_999);

/// A held key as the collection records it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldKey {
    pub key: String,
    /// The messages holding the key, oldest first; none: it is releasing.
    pub holders: Vec<Holder>,
    /// Messages of the key parked behind its holders.
    pub parked: u64,
    /// When the oldest message the key waits on was created.
    pub since: DateTime,
}

/// A message holding its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Holder {
    pub id: ObjectId,
    /// A dead letter (`failed`, marked `holdsKey`), rather than a message
    /// refused and waiting for its retry.
    pub dead_letter: bool,
}

/// Reads the held keys from the outbox collection, oldest first. A dead
/// letter marked `holdsKey` counts only where dead letters hold their keys.
///
/// Read as stored, so that no one document can fail the read: a holder
/// whose key the driver cannot read (a string that is not UTF-8) holds no
/// key the relay can name, and is delivered or failed in its turn like an
/// unkeyed message; parked messages of such a key are reported, since
/// nothing can release them.
pub async fn held_keys(
    outbox: &Collection<Document>,
    partition: Partition,
    dead_letters: DeadLetters,
) -> Result<Vec<HeldKey>> {
    let failed =
        |e| Error::mongo("reading held keys failed", e).needing("find", outbox.namespace());
    let outbox = outbox.clone_with_type::<RawDocumentBuf>();
    let mut keys: BTreeMap<String, HeldKey> = BTreeMap::new();
    let mut holders = outbox
        .find(partition.scope(holders_filter(dead_letters)))
        .projection(doc! { field::KEY: 1, field::STATUS: 1 })
        .await
        .map_err(failed)?;
    while let Some(document) = holders.try_next().await.map_err(failed)? {
        if let Some((key, holder)) = holder(&document) {
            entry(&mut keys, key, holder.id.timestamp())
                .holders
                .push(holder);
        }
    }
    let mut groups = outbox
        .aggregate(parked_groups(partition))
        .allow_disk_use(true)
        .with_type::<RawDocumentBuf>()
        .await
        .map_err(failed)?;
    while let Some(group) = groups.try_next().await.map_err(failed)? {
        match parked_group(&group) {
            Some(Ok((key, first, count))) => {
                entry(&mut keys, key, first.timestamp()).parked += count;
            }
            Some(Err(first)) => tracing::warn!(
                first = %first,
                "messages are parked under a key that is not UTF-8, which nothing releases: \
                 delete them, or set their key and unset nextAttemptAt"
            ),
            None => {}
        }
    }
    let mut held: Vec<HeldKey> = keys.into_values().collect();
    for key in &mut held {
        // Sorted here: a server sort of every holder could outgrow its
        // memory limit.
        key.holders.sort_by_key(|holder| holder.id);
    }
    held.sort_by_key(|h| h.since);
    Ok(held)
}

/// A holder as read: its key, and itself; `None` if its key or `_id`
/// cannot be read as the holders' filter asks.
fn holder(document: &RawDocument) -> Option<(&str, Holder)> {
    let key = document.get_str(field::KEY).ok()?;
    let id = document.get_object_id(field::ID).ok()?;
    let dead_letter = document.get_str(field::STATUS) == Ok(status::FAILED);
    Some((key, Holder { id, dead_letter }))
}

/// A group of parked messages as read: its key, its earliest `_id` and
/// how many; `Err` with the earliest `_id` where the key cannot be read.
fn parked_group(
    group: &RawDocument,
) -> Option<std::result::Result<(&str, ObjectId, u64), ObjectId>> {
    let first = group.get_object_id("first").ok()?;
    let Ok(key) = group.get_str("_id") else {
        return Some(Err(first));
    };
    let count = group.get("count").ok().flatten();
    let count = count.and_then(|c| Bson::try_from(c.to_raw_bson()).ok());
    Some(Ok((key, first, count_of(count.as_ref()))))
}

/// The held key `key` of `keys`, made if new, waiting since `since` at least.
fn entry<'a>(
    keys: &'a mut BTreeMap<String, HeldKey>,
    key: &str,
    since: DateTime,
) -> &'a mut HeldKey {
    let held = keys.entry(key.to_owned()).or_insert_with(|| HeldKey {
        key: key.to_owned(),
        holders: Vec::new(),
        parked: 0,
        since,
    });
    held.since = held.since.min(since);
    held
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

/// Keyed messages that hold their key: pending with a retry scheduled (a
/// range of the sweep index below [`PARKED`]), or held dead letters.
fn holders_filter(dead_letters: DeadLetters) -> Document {
    // `$lt` a date matches dates only (MongoDB compares within a type).
    let retrying = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$lt": PARKED },
    };
    let mut holding = vec![Bson::Document(retrying)];
    if dead_letters == DeadLetters::Hold {
        holding.push(Bson::Document(
            doc! { field::STATUS: status::FAILED, field::HOLDS_KEY: true },
        ));
    }
    doc! {
        field::KEY: { "$type": "string" },
        field::ID: { "$type": "objectId" },
        "$or": holding,
    }
}

/// Parked keyed messages, by key, each group with its earliest `_id` and
/// how many. The index's fields are matched first and alone, so that the
/// read is the sweep index's range of parked messages on any planner.
fn parked_groups(partition: Partition) -> Vec<Document> {
    vec![
        doc! { "$match": partition.scope(doc! {
            field::STATUS: status::PENDING,
            field::NEXT_ATTEMPT_AT: PARKED,
        }) },
        doc! { "$match": {
            field::KEY: { "$type": "string" },
            field::ID: { "$type": "objectId" },
        } },
        doc! { "$group": {
            "_id": "$key",
            "first": { "$min": "$_id" },
            "count": { "$sum": 1 },
        } },
    ]
}

/// A `$sum`'s count, whichever number type the server chose.
pub(crate) fn count_of(value: Option<&Bson>) -> u64 {
    match value {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Double(n)) => *n as u64,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unreadable::tests::with_string;

    #[test]
    fn a_holder_whose_key_is_not_utf8_fails_only_itself() {
        let id = ObjectId::new();
        let bad = with_string("key", b"k\xff", &doc! { "_id": id, "status": "pending" });
        assert!(
            bson::from_slice::<Document>(bad.as_bytes()).is_err(),
            "read as values, it would fail the whole read"
        );
        let read: RawDocumentBuf = bson::from_slice(bad.as_bytes()).expect("read as stored");
        assert!(
            holder(&read).is_none(),
            "it holds no key the relay can name"
        );
        let good = RawDocumentBuf::from_document(&doc! {
            "_id": id, "key": "k", "status": "failed",
        })
        .expect("raw");
        let (key, holder) = holder(&good).expect("a holder");
        assert_eq!((key, holder.id, holder.dead_letter), ("k", id, true));
    }

    #[test]
    fn a_parked_group_whose_key_is_not_utf8_is_told_by_its_first_id() {
        let first = ObjectId::new();
        let bad = with_string("_id", b"k\xff", &doc! { "first": first, "count": 2 });
        assert_eq!(parked_group(&bad), Some(Err(first)));
        let good =
            RawDocumentBuf::from_document(&doc! { "_id": "k", "first": first, "count": 2_i64 })
                .expect("raw");
        assert_eq!(parked_group(&good), Some(Ok(("k", first, 2))));
    }
}
