//! The inbox document: one per message a consumer handled or gave up on,
//! the contract a consumer in any language can follow with its driver.
//!
//! ```text
//! { consumer: "billing", messageId: "<Nats-Msg-Id>", status: "handled",
//!   subject, streamSequence, attempts, handledAt, expireAt }
//! { consumer: "billing", messageId: "<Nats-Msg-Id>", status: "failing",
//!   subject, streamSequence, attempts, lastError, expireAt }
//! { consumer: "billing", messageId: "<Nats-Msg-Id>", status: "failed",
//!   subject, streamSequence, attempts, failedAt, lastError, expireAt }
//! ```
//!
//! `attempts` counts the handler's runs. A message's first run on its
//! first delivery is counted by its transaction's upsert (`$inc`), so the
//! common case writes nothing more; every later run (a retry, a
//! redelivery) is counted before it begins, outside any transaction, so a
//! run that never ends (the process killed in the handler) counts too, and
//! none begins past the limit. A failed run leaves a `failing` record
//! (written outside the transaction, which aborted) with the count and the
//! error. A delivery that runs no handler (a hand-back at shutdown, an ack
//! wait run out) costs nothing, across restarts too. A `failed` record's
//! message that comes again (replayed) gets one more run, whichever write
//! counts it (`Before::allows_a_run`); a count before a run takes the
//! record back to `failing`, so that run is one, not one per redelivery.
//! A `failing`
//! record has no `expireAt`: its count must outlast any retry delay.
//!
//! The unique index `inbox_message` on `{consumer, messageId}` is what makes
//! a repeat harmless. The record of a handled message is written in the same
//! transaction as the handler's effects, by an upsert on `{consumer,
//! messageId}` that returns the record as it was: none, or a `failed` one,
//! and the message is handled; a `handled` one, and the transaction is
//! aborted, the overwrite with it, and the repeat acknowledged unhandled.
//! While another transaction holds an uncommitted record of the message,
//! the upsert fails with a write conflict instead and is tried again, so
//! two copies handled at once commit once. A `failed` record is taken over
//! when the message comes again (replayed, say): it is handled like a new
//! one.
//!
//! The upsert's filter is the index's key alone, by equality: the lookup
//! any server answers from the index.
//!
//! `expireAt` (with the TTL index `inbox_ttl`) is set where a retention is
//! given: a repeat older than the retention is no longer recognised.

use std::time::{Duration, Instant};

use bson::{doc, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::error::TRANSIENT_TRANSACTION_ERROR;
use mongodb::options::{Acknowledgment, IndexOptions, ReturnDocument, WriteConcern};
use mongodb::{ClientSession, Collection, IndexModel};
use serde::Serialize;

use super::commit::commit;
use super::Delivery;
use crate::error::{is_duplicate_key, is_unreachable, Error, Result};
use crate::time::later;

/// The inbox collection, unless the consumer names another.
pub const DEFAULT_COLLECTION: &str = "inbox";

/// Field names of the inbox document.
pub mod field {
    pub const CONSUMER: &str = "consumer";
    pub const MESSAGE_ID: &str = "messageId";
    pub const STATUS: &str = "status";
    pub const SUBJECT: &str = "subject";
    pub const STREAM_SEQUENCE: &str = "streamSequence";
    pub const ATTEMPTS: &str = "attempts";
    pub const HANDLED_AT: &str = "handledAt";
    pub const FAILED_AT: &str = "failedAt";
    pub const LAST_ERROR: &str = "lastError";
    pub const EXPIRE_AT: &str = "expireAt";
}

/// Values of `status`.
pub mod status {
    pub const HANDLED: &str = "handled";
    /// Its handler failed, and it is to be tried again.
    pub const FAILING: &str = "failing";
    pub const FAILED: &str = "failed";
}

/// The unique index on `{consumer, messageId}`.
pub const UNIQUE_INDEX: &str = "inbox_message";
/// The TTL index on `expireAt`.
pub const TTL_INDEX: &str = "inbox_ttl";

/// What the inbox records of one message.
#[derive(Debug, Clone)]
pub(crate) struct Entry<'a> {
    pub consumer: &'a str,
    pub message_id: &'a str,
    pub subject: &'a str,
    pub stream_sequence: u64,
    pub attempts: u64,
}

impl<'a> Entry<'a> {
    /// The entry of `delivery` in `consumer`'s inbox; none for a message
    /// without an id, which is not recorded.
    pub fn of(consumer: &'a str, delivery: &'a Delivery) -> Option<Self> {
        Some(Entry {
            consumer,
            message_id: delivery.message_id.as_deref()?,
            subject: &delivery.subject,
            stream_sequence: delivery.stream_sequence,
            attempts: delivery.attempt,
        })
    }

    fn key(&self) -> Document {
        doc! { field::CONSUMER: self.consumer, field::MESSAGE_ID: self.message_id }
    }

    /// The fields every record sets, but `attempts`, which each write
    /// counts its own way.
    fn described(&self, status: &str, now: DateTime, retention: Option<Duration>) -> Document {
        let mut fields = doc! {
            field::STATUS: status,
            field::SUBJECT: self.subject,
            field::STREAM_SEQUENCE: count(self.stream_sequence),
        };
        match retention {
            Some(retention) if status != status::FAILING => {
                fields.insert(field::EXPIRE_AT, later(now, retention));
            }
            _ => {}
        }
        fields
    }
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// What recording a message handled found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorded {
    /// Not handled before: the handler runs, if the record allows it.
    New(Before),
    /// Handled before: the transaction is to be aborted.
    HandledBefore,
}

/// A message's record as a count of its runs found it, before counting
/// the run about to begin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Before {
    /// The runs counted so far.
    pub runs: u64,
    /// Where the message stood.
    pub standing: Standing,
}

/// Where a message stood when a run of it was about to be counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Not given up on: its runs are bounded by the limit.
    Open,
    /// Given up on (`failed`), and this is a redelivery of the very
    /// message given up on: its termination was lost to a crash or a
    /// dropped connection. It gets no run.
    GivenUp,
    /// Given up on, and come again from another stream position (replayed,
    /// or published again): it gets a run, however many it had before.
    CameAgain,
}

impl Before {
    /// No record yet.
    const NONE: Before = Before {
        runs: 0,
        standing: Standing::Open,
    };

    /// What `record` says of the message delivered at `stream_sequence`.
    fn of(record: &Document, stream_sequence: u64) -> Before {
        let recorded = match record.get(field::STREAM_SEQUENCE) {
            Some(Bson::Int64(n)) => Some(*n),
            Some(Bson::Int32(n)) => Some(i64::from(*n)),
            _ => None,
        };
        let standing = if record.get_str(field::STATUS) != Ok(status::FAILED) {
            Standing::Open
        } else if recorded == Some(count(stream_sequence)) {
            Standing::GivenUp
        } else {
            Standing::CameAgain
        };
        Before {
            runs: attempts_of(record),
            standing,
        }
    }

    /// Whether the run about to begin may: the one rule that bounds a
    /// message's runs, whichever write counts them. Past `max_runs`, the
    /// runs begun include some that never ended (a handler that ends its
    /// process, say), and none begins again; but a message given up on
    /// that comes again gets a run, however many it had before. The count
    /// made before a run takes the record back from `failed` (see
    /// [`record_run`]), so that exception serves one run, not every
    /// redelivery of a handler that never ends.
    pub fn allows_a_run(&self, max_runs: u64) -> bool {
        self.standing == Standing::CameAgain || self.runs < max_runs
    }
}

/// Ensures the unique index that recognises repeats and the TTL index that
/// ends records past their `expireAt`.
pub(crate) async fn ensure_indexes(inbox: &Collection<Document>) -> Result<()> {
    let unique = IndexModel::builder()
        .keys(doc! { field::CONSUMER: 1, field::MESSAGE_ID: 1 })
        .options(
            IndexOptions::builder()
                .name(UNIQUE_INDEX.to_owned())
                .unique(true)
                .build(),
        )
        .build();
    let ttl = IndexModel::builder()
        .keys(doc! { field::EXPIRE_AT: 1 })
        .options(
            IndexOptions::builder()
                .name(TTL_INDEX.to_owned())
                .expire_after(Duration::ZERO)
                .build(),
        )
        .build();
    inbox
        .create_indexes([unique, ttl])
        .await
        .map_err(|e| Error::mongo("creating the inbox's indexes failed", e))?;
    Ok(())
}

/// Records `entry` as handled inside the session's transaction, counting
/// this run unless it was `counted` before it began (then `attempts` is
/// raised to that count). [`Recorded::HandledBefore`]: the message was
/// handled before, and the transaction (which overwrote that record) must
/// be aborted. A duplicate key error (a record inserted outside any
/// transaction meanwhile) is returned as it is: the transaction is to be
/// run again.
pub(crate) async fn record_handled(
    inbox: &Collection<Document>,
    session: &mut ClientSession,
    (entry, counted): (&Entry<'_>, Option<u64>),
    now: DateTime,
    retention: Option<Duration>,
) -> mongodb::error::Result<Recorded> {
    let mut set = entry.described(status::HANDLED, now, retention);
    set.insert(field::HANDLED_AT, now);
    let mut update = doc! {
        "$set": set,
        "$unset": { field::FAILED_AT: "", field::LAST_ERROR: "" },
    };
    match counted {
        Some(runs) => update.insert("$max", doc! { field::ATTEMPTS: count(runs) }),
        None => update.insert("$inc", doc! { field::ATTEMPTS: 1 }),
    };
    let before = inbox
        .find_one_and_update(entry.key(), update)
        .upsert(true)
        .return_document(ReturnDocument::Before)
        .projection(doc! { field::STATUS: 1, field::ATTEMPTS: 1, field::STREAM_SEQUENCE: 1 })
        .session(session)
        .await?;
    Ok(match before {
        Some(record) if is_handled(&record) => Recorded::HandledBefore,
        Some(record) => Recorded::New(Before::of(&record, entry.stream_sequence)),
        None => Recorded::New(Before::NONE),
    })
}

/// What a count made before a run found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    /// Counted: the record as it was before.
    Before(Before),
    /// Not counted: the record, as it stands, allows no run (see
    /// [`Before::allows_a_run`]). A refused delivery changes nothing, so
    /// two copies of a message given up on, delivered at once, are both
    /// refused for what the record says, not one for the other's count.
    Refused(Before),
    /// Handled meanwhile: nothing counted.
    Handled,
    /// Another transaction holds the record (a copy being handled, or one
    /// of a process that died mid-run, which the server ends only at its
    /// lifetime, 60 s on MongoDB): nothing counted, and nothing waits on it.
    Held,
}

/// Counts a run about to begin, apart from the run's own transaction, so
/// that a run that never ends still counts. A `failed` record is taken
/// back to `failing`: the message is being tried again, and the next count
/// finds it so (see [`Before::allows_a_run`]). The record is read first, in
/// the same transaction: a run the record refuses is not counted.
///
/// The count is a transaction of its own: a write outside any transaction
/// would wait for a record another transaction holds until that one ends,
/// for a dead process's a minute on MongoDB and for ever on some servers,
/// while a write in a transaction meets a write conflict at once, and one
/// that is given up on client-side is still applied when the lock goes, a
/// count of a run that never began. So a held record answers
/// [`Counted::Held`] at once, and costs nothing.
pub(crate) async fn record_run(
    inbox: &Collection<Document>,
    entry: &Entry<'_>,
    max_runs: u64,
    now: DateTime,
) -> mongodb::error::Result<Counted> {
    let mut filter = entry.key();
    filter.insert(field::STATUS, doc! { "$ne": status::HANDLED });
    let mut inserted = entry.described(status::FAILING, now, None);
    inserted.remove(field::STATUS);
    let update = doc! {
        "$inc": { field::ATTEMPTS: 1 },
        "$set": { field::STATUS: status::FAILING },
        "$setOnInsert": inserted,
        "$unset": { field::EXPIRE_AT: "", field::FAILED_AT: "" },
    };
    let mut session = inbox.client().start_session().await?;
    let started = Instant::now();
    let majority = WriteConcern::builder().w(Acknowledgment::Majority).build();
    // A duplicate key: a handled record, which the filter missed, or
    // another copy's insert of the first record, racing this one; asked
    // again, the second finds that record.
    for _ in 0..2 {
        session
            .start_transaction()
            .write_concern(majority.clone())
            .await?;
        let found = inbox
            .find_one(entry.key())
            .projection(doc! { field::STATUS: 1, field::ATTEMPTS: 1, field::STREAM_SEQUENCE: 1 })
            .session(&mut session)
            .await;
        let found = match found {
            Ok(found) => found,
            Err(error) => {
                let _ = session.abort_transaction().await;
                match held_or_again(error)? {
                    Some(counted) => return Ok(counted),
                    None => continue,
                }
            }
        };
        let standing = match &found {
            Some(record) if is_handled(record) => None,
            Some(record) => Some(Before::of(record, entry.stream_sequence)),
            None => Some(Before::NONE),
        };
        match standing {
            None => {
                let _ = session.abort_transaction().await;
                return Ok(Counted::Handled);
            }
            Some(before) if !before.allows_a_run(max_runs) => {
                let _ = session.abort_transaction().await;
                return Ok(Counted::Refused(before));
            }
            Some(_) => {}
        }
        let before = inbox
            .find_one_and_update(filter.clone(), update.clone())
            .upsert(true)
            .return_document(ReturnDocument::Before)
            .projection(doc! { field::STATUS: 1, field::ATTEMPTS: 1, field::STREAM_SEQUENCE: 1 })
            .session(&mut session)
            .await;
        let before = match before {
            Ok(before) => before,
            Err(error) => {
                let _ = session.abort_transaction().await;
                match held_or_again(error)? {
                    Some(counted) => return Ok(counted),
                    None => continue,
                }
            }
        };
        if let Err(error) = commit(&mut session, started).await {
            if let Some(counted) = held_or_again(error)? {
                return Ok(counted);
            }
            continue;
        }
        return Ok(Counted::Before(
            before.as_ref().map_or(Before::NONE, |record| {
                Before::of(record, entry.stream_sequence)
            }),
        ));
    }
    Ok(Counted::Handled)
}

/// A failed count's error read: a write conflict is a record held by
/// another transaction; a duplicate key is to be asked again (None); any
/// other error is returned, an unreachable server among them (which a
/// transaction also labels transient).
fn held_or_again(error: mongodb::error::Error) -> mongodb::error::Result<Option<Counted>> {
    if is_duplicate_key(&error) {
        return Ok(None);
    }
    if !is_unreachable(&error) && error.contains_label(TRANSIENT_TRANSACTION_ERROR) {
        return Ok(Some(Counted::Held));
    }
    Err(error)
}

/// Where a double's steps become larger than 1: 2^53.
const UNMOVED: f64 = 9_007_199_254_740_992.0;

/// The count taken for one `$inc` cannot move: past any limit, and one a
/// count written back (an int32 or int64) can still be raised from.
const PAST_EVERY_LIMIT: u64 = i32::MAX as u64;

/// A record's `attempts`; 0 where it holds no count. A double counts (a
/// count set by hand in mongosh is one, and `$inc` keeps it one).
fn attempts_of(record: &Document) -> u64 {
    match record.get(field::ATTEMPTS) {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        // A count `$inc` never moves (NaN, infinite, or too far below 0
        // for a double to add 1 to) would count no run ever: it is taken
        // as past any limit, yet one a count can still be raised from.
        Some(Bson::Double(n)) if !n.is_finite() || *n <= -UNMOVED => PAST_EVERY_LIMIT,
        // Saturating: negatives are 0, the too large the most.
        Some(Bson::Double(n)) => *n as u64,
        _ => 0,
    }
}

/// Records that `entry`'s run (its attempt number `entry.attempts`) failed
/// with `error` and that the message is to be tried again. A settled record
/// is not taken back: a handled one stays as it is, a failed one (a copy
/// given up on) keeps its status and takes the count. A count never goes
/// down: another copy may have counted further.
pub(crate) async fn record_failing(
    inbox: &Collection<Document>,
    entry: &Entry<'_>,
    error: &str,
    now: DateTime,
) -> mongodb::error::Result<()> {
    let mut set = entry.described(status::FAILING, now, None);
    set.insert(field::LAST_ERROR, error);
    let raised = doc! { field::ATTEMPTS: count(entry.attempts) };
    let mut filter = entry.key();
    let settled = [status::HANDLED, status::FAILED];
    filter.insert(field::STATUS, doc! { "$nin": settled.as_slice() });
    let update = doc! {
        "$set": set,
        "$max": raised.clone(),
        "$unset": { field::EXPIRE_AT: "" },
    };
    match inbox.update_one(filter, update).upsert(true).await {
        // A settled record: the filter missed it, and the upsert's insert
        // met the unique index.
        Err(refused) if is_duplicate_key(&refused) => {
            let mut failed = entry.key();
            failed.insert(field::STATUS, status::FAILED);
            let update = doc! { "$max": raised, "$set": { field::LAST_ERROR: error } };
            inbox.update_one(failed, update).await.map(drop)
        }
        other => other.map(drop),
    }
}

/// Records `entry` as failed with `error`, for a person to see, unless a
/// copy of it was handled meanwhile.
pub(crate) async fn record_failed(
    inbox: &Collection<Document>,
    entry: &Entry<'_>,
    error: &str,
    now: DateTime,
    retention: Option<Duration>,
) -> mongodb::error::Result<()> {
    let mut set = entry.described(status::FAILED, now, retention);
    set.insert(field::FAILED_AT, now);
    set.insert(field::LAST_ERROR, error);
    let existing = inbox
        .find_one(entry.key())
        .projection(doc! { field::STATUS: 1 })
        .await?;
    let attempts = count(entry.attempts);
    let written = match existing {
        Some(record) if is_handled(&record) => return Ok(()),
        // Only while it is still what was read, so a copy handled since
        // stays handled; and its count never goes down.
        Some(record) => {
            let mut filter = entry.key();
            filter.insert(field::STATUS, record.get(field::STATUS).cloned());
            let update = doc! { "$set": set, "$max": { field::ATTEMPTS: attempts } };
            inbox.update_one(filter, update).await.map(drop)
        }
        None => {
            let mut record = entry.key();
            record.extend(set);
            record.insert(field::ATTEMPTS, attempts);
            inbox.insert_one(record).await.map(drop)
        }
    };
    match written {
        // Recorded meanwhile by a copy handled or given up on.
        Err(error) if is_duplicate_key(&error) => Ok(()),
        other => other,
    }
}

fn is_handled(record: &Document) -> bool {
    record.get_str(field::STATUS) == Ok(status::HANDLED)
}

/// One message a consumer gave up on, as `outbox-relay inbox list` shows
/// it; in JSON, its fields are named as in the inbox document.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedMessage {
    pub message_id: String,
    pub subject: Option<String>,
    pub stream_sequence: Option<i64>,
    pub attempts: Option<i64>,
    pub failed_at: Option<String>,
    pub last_error: Option<String>,
}

impl FailedMessage {
    fn read(document: &Document) -> Self {
        let number = |name: &str| match document.get(name) {
            Some(Bson::Int64(n)) => Some(*n),
            Some(Bson::Int32(n)) => Some(i64::from(*n)),
            _ => None,
        };
        let text = |name: &str| document.get_str(name).ok().map(str::to_owned);
        FailedMessage {
            message_id: text(field::MESSAGE_ID).unwrap_or_default(),
            subject: text(field::SUBJECT),
            stream_sequence: number(field::STREAM_SEQUENCE),
            attempts: number(field::ATTEMPTS),
            failed_at: document
                .get_datetime(field::FAILED_AT)
                .ok()
                .and_then(|at| at.try_to_rfc3339_string().ok()),
            last_error: text(field::LAST_ERROR),
        }
    }
}

/// The messages `consumer` gave up on, newest first, up to `limit`, and
/// how many there are.
/// Checks that `inbox` exists and holds records of `consumer`, so that a
/// mistyped database, collection or consumer name is told apart from a
/// consumer that has given up on nothing. The error names what is there.
pub async fn check_consumer(inbox: &Collection<Document>, consumer: &str) -> Result<()> {
    let failed = |e| Error::mongo("reading the inbox failed", e);
    let namespace = inbox.namespace();
    let database = inbox.client().database(&namespace.db);
    if !crate::setup::collection_exists(&database, &namespace.coll)
        .await
        .map_err(failed)?
    {
        return Err(Error::Config(format!(
            "database {:?} has no collection {:?}: give the database and collection the \
             consumer's Inbox was built with (--database, --inbox-collection)",
            namespace.db, namespace.coll
        )));
    }
    let known = inbox
        .find_one(doc! { field::CONSUMER: consumer })
        .projection(doc! { "_id": 1 })
        .await
        .map_err(failed)?;
    if known.is_some() {
        return Ok(());
    }
    let consumers: Vec<Document> = inbox
        .aggregate([
            doc! { "$group": { "_id": format!("${}", field::CONSUMER) } },
            doc! { "$sort": { "_id": 1 } },
            doc! { "$limit": 20 },
        ])
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    let names: Vec<String> = consumers
        .iter()
        .filter_map(|group| group.get_str("_id").ok().map(|name| format!("{name:?}")))
        .collect();
    let there = match names.as_slice() {
        [] => "it holds no consumer's records yet".to_owned(),
        names => format!("its consumers include {}", names.join(", ")),
    };
    Err(Error::Config(format!(
        "{}.{} has no records of consumer {consumer:?}: {there}",
        namespace.db, namespace.coll
    )))
}

pub async fn failed_messages(
    inbox: &Collection<Document>,
    consumer: &str,
    limit: i64,
) -> Result<(u64, Vec<FailedMessage>)> {
    let failed = |e| Error::mongo("reading the inbox's failed messages failed", e);
    let filter = doc! { field::CONSUMER: consumer, field::STATUS: status::FAILED };
    let total = inbox
        .count_documents(filter.clone())
        .await
        .map_err(failed)?;
    let newest: Vec<Document> = inbox
        .find(filter)
        .sort(doc! { field::FAILED_AT: -1 })
        .limit(limit)
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    Ok((total, newest.iter().map(FailedMessage::read).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_read_whatever_its_numeric_type_and_nonsense_is_none_or_past_all() {
        let count = |value: Bson| attempts_of(&doc! { field::ATTEMPTS: value });
        assert_eq!(count(Bson::Int32(3)), 3);
        assert_eq!(count(Bson::Int64(4)), 4);
        assert_eq!(count(Bson::Double(5.0)), 5, "set by hand in mongosh");
        assert_eq!(count(Bson::Int32(-2)), 0);
        assert_eq!(
            count(Bson::Double(f64::NAN)),
            PAST_EVERY_LIMIT,
            "no $inc moves it"
        );
        assert_eq!(count(Bson::Double(f64::NEG_INFINITY)), PAST_EVERY_LIMIT);
        assert_eq!(count(Bson::Double(-1e17)), PAST_EVERY_LIMIT);
        assert_eq!(count(Bson::Double(-3.0)), 0, "moved to 1 by a few runs");
        assert_eq!(count(Bson::String("7".into())), 0);
        assert_eq!(attempts_of(&doc! {}), 0);
    }
}
