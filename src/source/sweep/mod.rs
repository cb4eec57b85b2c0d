//! The sweep: the slow path that makes the collection, not the stream, the
//! source of truth.
//!
//! Each pass claims a batch of pending messages that are due and not held
//! by a live claim, publishes them, and completes them matching its claim,
//! so a processor that lost a message to another cannot write over its
//! state. Claims are conditional updates on `lockId`/`lockedAt`; a claim
//! older than the lock timeout is stale and may be taken over. Passes run
//! one after another in a single task, never two at once; a pass that comes
//! back full is followed at once by the next, so a backlog drains without
//! waiting for the interval.
//!
//! A pass looks in two places, each an index range on
//! `{status, nextAttemptAt, _id}` read in the index's order: messages never
//! tried (`nextAttemptAt` missing) created a grace period before what the
//! change stream has read (see `progress`), which leaves the stream time to
//! deliver them first, however far behind it runs in a drain; and messages
//! whose retry is due. While a catch-up pass is delivering, a pass reads
//! nothing: the catch-up pass has every due message. A pass with room left
//! also looks for misfits, pending documents whose fields put them in
//! neither range, at most once a minute. The read names only indexed
//! fields, so any planner serves it from the index; whether a candidate is
//! free (unclaimed, or claimed longer ago than the lock timeout) is decided
//! by the claim's conditional update, which is the authority anyway.
//!
//! # Layout
//! This file runs the passes; each of a pass's jobs has its own module:
//! - `claim`: reading candidates and claiming them;
//! - `gate`: which keys a pass may still send;
//! - `deliver`: publishing and completing what it claimed;
//! - `unclaim`: giving claims back, its own and a former leader's;
//! - `keys`: after each pass, tending the keys the term's order holds.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocumentBuf};
use tokio_util::sync::CancellationToken;

use crate::config::DeadLetters;
use crate::contract::{field, status, DecodeRules};
use crate::error::Result;
use crate::pipeline::Pipeline;
use crate::retry::Outage;
use crate::time::object_id_at;
use crate::unreadable::RawField;
use crate::work::Tally;

use super::progress::{StreamProgress, SweepScope};
use claim::{Claimed, Query, ReadEnd, Sighted};
use gate::{KeyGate, Kind};

mod claim;
mod deliver;
mod gate;
mod keys;
mod unclaim;

/// Runs sweep passes over one outbox collection.
#[derive(Clone)]
pub struct Sweeper {
    pub(crate) rules: DecodeRules,
    pub(crate) pipeline: Pipeline,
    pub(crate) batch_size: usize,
    pub(crate) lock_timeout: Duration,
    /// Never-tried messages younger than this are left to the change stream.
    pub(crate) grace_period: Duration,
    /// How far the change stream has read: the grace runs from there.
    pub(crate) progress: StreamProgress,
    /// The most bytes of documents one pass reads.
    pub(crate) max_pass_bytes: usize,
    /// When the sweep last looked for misfits.
    pub(crate) misfits_read: Arc<Mutex<Option<Instant>>>,
    /// When the sweep last read the held keys back.
    pub(crate) holds_read: Arc<Mutex<Option<Instant>>>,
    /// How often it reads them back, for a hold written out of the term's
    /// sight (a former leader's write that landed late), while such a
    /// write may still land; a minute apart after (see
    /// [`Sweeper::holds_interval`]).
    pub(crate) holds_interval: Duration,
    /// How long into the term a former leader's write may land: its
    /// writes wait a lease at most, and its lease ended before the term
    /// began.
    pub(crate) late_writes_until: Instant,
    /// Whether dead letters hold their keys, for reading holds back.
    pub(crate) dead_letters: DeadLetters,
    /// Whether a former leader's claims are cleared (see
    /// [`Sweeper::clear_claims`]): done before this term's first claim.
    pub(crate) claims_cleared: Arc<AtomicBool>,
}

/// How often a sweep with room to spare looks for misfits: documents a
/// writer's bug put outside both index ranges are rare, and finding them
/// costs a scan of every pending entry.
pub const MISFIT_INTERVAL: Duration = Duration::from_secs(60);

/// The result of one pass.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// What became of the claimed messages.
    pub tally: Tally,
    /// How many messages the pass claimed.
    pub claimed: u64,
    /// The pass claimed a whole batch (or its bytes' worth): more may be waiting.
    pub full: bool,
}

/// What the sweep's loop does next.
#[derive(Clone, Copy)]
enum Next {
    /// A pass, then the held keys tended.
    Pass,
    /// The held keys alone: their reading back fell due before the pass.
    Tend,
}

/// What one pass did, for its caller and for giving back its claim.
struct Swept {
    pass: Pass,
    /// The pass's claim is left on messages it did not complete.
    left_claimed: bool,
    sighted: Sighted,
}

impl Sweeper {
    /// Runs passes until shutdown: at once again after a full pass, else
    /// after `interval` or as soon as a key starts releasing. After each
    /// pass it tends the held keys (see [`Sweeper::tend_keys`]), and
    /// between passes too when their reading back falls due first: the
    /// holds interval (`--collect-interval`) bounds how late a hold the
    /// term did not write is found, whatever the sweep interval.
    pub(crate) async fn run(self, interval: Duration, shutdown: CancellationToken) {
        let mut outage = Outage::new("MongoDB sweep");
        let mut next = Next::Pass;
        // The next pass is due an interval after the last ended, however
        // often the held keys are read back between.
        let mut pass_due = tokio::time::Instant::now();
        while !shutdown.is_cancelled() {
            let done = match next {
                Next::Pass => {
                    let pass = self.pass_and_tend().await;
                    // An interval after it ends: a slow server gets a pause.
                    pass_due = tokio::time::Instant::now() + interval;
                    pass
                }
                Next::Tend => self.tend_keys().await.map(|(tally, more)| Pass {
                    tally,
                    claimed: 0,
                    full: more,
                }),
            };
            let full = match done {
                Ok(pass) => {
                    outage.recovered();
                    if pass.claimed > 0 {
                        tracing::debug!(?pass, "sweep pass");
                    }
                    pass.full
                }
                Err(error) => {
                    outage.failed(&error);
                    false
                }
            };
            if full {
                next = Next::Pass;
                continue;
            }
            let order = self.pipeline.order().cloned();
            let release_wanted = async move {
                match order {
                    Some(order) => order.release_wanted().await,
                    None => std::future::pending().await,
                }
            };
            // Never sooner than a millisecond from now: no loop spins.
            let holds_due = self
                .until_reconcile()
                .map(|due| tokio::time::Instant::now() + due.max(Duration::from_millis(1)))
                .filter(|due| *due < pass_due);
            next = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(pass_due) => Next::Pass,
                _ = release_wanted => Next::Pass,
                _ = tokio::time::sleep_until(holds_due.unwrap_or(pass_due)), if holds_due.is_some() => Next::Tend,
            };
        }
    }

    /// Passes until one comes back short of a full batch: everything due now
    /// is handled. For `outbox-relay sweep --once`.
    pub async fn drain(&self) -> Result<Tally> {
        let mut tally = Tally::default();
        loop {
            let pass = self.pass_and_tend().await?;
            tally += pass.tally;
            if !pass.full {
                return Ok(tally);
            }
        }
    }

    /// One pass, then the held keys tended; full if either left work for
    /// the next at once.
    async fn pass_and_tend(&self) -> Result<Pass> {
        let mut pass = self.pass().await?;
        let (released, more) = self.tend_keys().await?;
        pass.tally += released;
        pass.full |= more;
        Ok(pass)
    }

    /// One pass: claim, publish, complete, release what was not completed.
    pub async fn pass(&self) -> Result<Pass> {
        let now = DateTime::now();
        let never_tried_before = match self.progress.scope(now, self.grace_period) {
            SweepScope::Nothing => return Ok(Pass::default()),
            SweepScope::RetriesOnly => None,
            SweepScope::Before(before) => Some(before),
        };
        // ObjectIds count whole seconds, so a bound at now would hold back
        // the current second's messages even with no grace at all.
        let bound = never_tried_before.filter(|before| *before < now);
        let [never_tried, retry_due, misfits] = candidate_queries(now, bound);
        let mut reads = vec![(retry_due, true), (misfits, false)];
        if never_tried_before.is_some() {
            reads.insert(0, (never_tried, true));
        }
        Ok(self.pass_over(reads, Kind::Due).await?.pass)
    }

    /// A pass over `reads` (each a query, and whether it is read every
    /// pass rather than when misfits are due), in order, until a batch is
    /// claimed; then delivered, and what it did not complete given back.
    async fn pass_over(
        &self,
        reads: impl IntoIterator<Item = (Query, bool)>,
        kind: Kind,
    ) -> Result<Swept> {
        self.clear_claims_once().await?;
        let claim = ObjectId::new();
        let mut gate = KeyGate::new(kind);
        let swept = self.claim_and_deliver(reads, claim, &mut gate).await;
        // A pass cut short by an error leaves claims that would hide the
        // messages (and hold back the rest of their keys) until they go
        // stale: give them back.
        if swept.as_ref().map_or(true, |swept| swept.left_claimed) {
            self.release(claim).await?;
        }
        swept
    }

    /// Claims from `reads` and delivers what it claimed.
    async fn claim_and_deliver(
        &self,
        reads: impl IntoIterator<Item = (Query, bool)>,
        claim: ObjectId,
        gate: &mut KeyGate,
    ) -> Result<Swept> {
        let Claimed {
            works,
            bytes,
            left_claimed,
            sighted,
        } = self.claim_all(reads, claim, gate).await?;
        // A pass that took a whole batch, its bytes' worth, or all the
        // budget had room for may have left more. Only one that took
        // something and finished it may be followed at once: one that took
        // nothing (another claim holds what it read), or was cut short (a
        // stop, a broker that takes nothing), would otherwise read, claim
        // and give back the same messages in a tight loop.
        let whole = !works.is_empty()
            && (works.len() == self.batch_size
                || bytes >= self.max_pass_bytes
                || sighted.end == ReadEnd::OutOfRoom);
        let delivered = self.deliver(works, gate).await?;
        let pass = Pass {
            tally: delivered.tally,
            claimed: delivered.taken,
            full: whole && delivered.tally.total() == delivered.taken,
        };
        Ok(Swept {
            pass,
            left_claimed: left_claimed || delivered.left_claimed,
            sighted,
        })
    }

    /// The misfit read, if it is due: at most once per [`MISFIT_INTERVAL`],
    /// since no index range can serve it (it scans every pending entry).
    fn misfits_due(&self) -> bool {
        due(&self.misfits_read, MISFIT_INTERVAL)
    }
}

/// The sweep's candidate reads, as `(filter, sort)`, in the order a pass
/// takes them: never-tried messages created before `never_tried_before`
/// (all of them without it), then retries
/// due at `now`, each a range of the sweep index sorted in its order; then,
/// with room left, misfits that neither range can find (an `_id` that is not
/// an ObjectId, a `nextAttemptAt` that is not a date), so that whatever a
/// writer put in a pending document, it is delivered or failed.
pub fn candidate_queries(
    now: DateTime,
    never_tried_before: Option<DateTime>,
) -> [(Document, Document); 3] {
    let mut never_tried = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: Bson::Null,
    };
    if let Some(before) = never_tried_before {
        never_tried.insert(field::ID, doc! { "$lt": object_id_at(before) });
    }
    let retry_due = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$lte": now },
    };
    let order = doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 };
    [
        (never_tried, order.clone()),
        (retry_due, order.clone()),
        (misfits(), order),
    ]
}

/// Pending documents the index ranges cannot find.
pub(crate) fn misfits() -> Document {
    doc! {
        field::STATUS: status::PENDING,
        "$or": [
            { field::ID: { "$not": { "$type": "objectId" } } },
            { field::NEXT_ATTEMPT_AT: { "$exists": true, "$not": { "$type": ["date", "null"] } } },
        ],
    }
}

/// Whether `interval` has passed since `last` (or it never was), which it
/// then sets to now.
fn due(last: &Mutex<Option<Instant>>, interval: Duration) -> bool {
    let Ok(mut last) = last.lock() else {
        return false;
    };
    if last.is_some_and(|at| at.elapsed() < interval) {
        return false;
    }
    *last = Some(Instant::now());
    true
}

/// A document's `_id`, whatever its type; one the driver cannot read (a
/// string that is not UTF-8) as its stand-in (see `unreadable`).
fn raw_id(document: &RawDocumentBuf) -> Option<Bson> {
    let readable = document.get(field::ID).ok().flatten();
    if let Some(id) = readable.and_then(|id| Bson::try_from(id.to_raw_bson()).ok()) {
        return Some(id);
    }
    RawField::of(document, field::ID).map(|id| id.stand_in())
}

#[cfg(test)]
mod tests {
    use bson::Binary;
    use tokio::time::timeout;

    use super::*;
    use crate::config::RelayConfig;
    use crate::contract::SubjectRules;
    use crate::observe::Metrics;
    use crate::partition::Partition;
    use crate::work::{Budget, LastDelivery, Underway, Unmarkable};

    /// A sweeper over `outbox` whose messages go to a broker that takes
    /// them all, sharing `budget` with whatever else holds it.
    fn sweeper(
        outbox: mongodb::Collection<Document>,
        budget: Budget,
        max_pass_bytes: usize,
    ) -> Sweeper {
        let config = RelayConfig::new("mongodb://unused", "unused");
        let pipeline = Pipeline {
            publisher: Arc::new(crate::testing::TakesAll),
            outbox,
            max_in_flight: 16,
            batch_size: 100,
            checkpoint_interval: Duration::from_secs(1),
            mark_delay: Duration::ZERO,
            retry: config.retry(),
            metrics: Metrics::new(),
            unmarkable: Unmarkable::default(),
            budget,
            underway: Underway::default(),
            deliveries: LastDelivery::default(),
            tenure: None,
            partition: crate::partition::Partition::WHOLE,
            acknowledged: Default::default(),
            shutdown: CancellationToken::new(),
            abandon: CancellationToken::new(),
        };
        Sweeper {
            rules: DecodeRules::new(SubjectRules::anything_unreserved(), usize::MAX),
            pipeline,
            batch_size: 100,
            lock_timeout: Duration::from_secs(60),
            grace_period: Duration::ZERO,
            progress: StreamProgress::without_stream(),
            max_pass_bytes,
            misfits_read: Arc::default(),
            holds_read: Arc::default(),
            holds_interval: Duration::from_secs(60),
            late_writes_until: Instant::now(),
            dead_letters: DeadLetters::Release,
            claims_cleared: Arc::default(),
        }
    }

    const KIB: usize = 1024;

    /// `count` pending messages of 200 KiB, with `fields` added, in an
    /// outbox whose relay's budget of 1 MiB something else (the stream's
    /// pipeline, say) holds all but 300 KiB of: room for one.
    async fn large_messages(
        count: usize,
        fields: impl Fn() -> Document,
    ) -> (
        mongodb::Database,
        Sweeper,
        tokio::sync::OwnedSemaphorePermit,
    ) {
        let database = crate::testing::database().await;
        let outbox = database.collection::<Document>("outbox");
        let payload = Binary {
            subtype: bson::spec::BinarySubtype::Generic,
            bytes: vec![7; 200 * KIB],
        };
        let messages: Vec<Document> = (0..count)
            .map(|_| {
                let mut message = doc! { "_id": ObjectId::new(), "type": "t", "status": "pending", "payload": payload.clone() };
                message.extend(fields());
                message
            })
            .collect();
        outbox.insert_many(messages).await.expect("insert");
        let budget = Budget::new(1024 * 1024);
        let elsewhere = budget.reserve(1024 * 1024 - 300 * KIB).await.expect("held");
        (database, sweeper(outbox, budget, 1024 * 1024), elsewhere)
    }

    #[tokio::test]
    async fn a_pass_holds_no_more_than_the_budget_has_room_for() {
        let (database, sweeper, elsewhere) = large_messages(8, Document::new).await;

        let pass = timeout(Duration::from_secs(30), sweeper.pass())
            .await
            .expect("a pass does not wait for room it holds itself")
            .expect("a pass");
        assert_eq!(pass.claimed, 1, "one fits beside what is held elsewhere");
        assert_eq!(pass.tally.delivered, 1);
        assert!(
            pass.full,
            "it took all it could: the next pass comes at once"
        );

        drop(elsewhere);
        let rest = timeout(Duration::from_secs(30), sweeper.drain())
            .await
            .expect("the rest in time")
            .expect("a drain");
        assert_eq!(
            rest.delivered, 7,
            "with room, each pass takes 1 MiB's worth"
        );
        database.drop().await.expect("drop");
    }

    #[tokio::test]
    async fn a_pass_that_takes_nothing_is_not_full_however_its_read_ended() {
        // Another processor's live claim holds both, and the budget has
        // room for one: the read ends for want of room.
        let claimed = || doc! { "lockId": ObjectId::new(), "lockedAt": DateTime::now() };
        let (database, sweeper, _elsewhere) = large_messages(2, claimed).await;
        // A claim of this term's, not a former leader's to clear.
        sweeper
            .claims_cleared
            .store(true, std::sync::atomic::Ordering::Release);

        let pass = timeout(Duration::from_secs(30), sweeper.pass())
            .await
            .expect("a pass in time")
            .expect("a pass");
        assert_eq!(pass.claimed, 0);
        assert!(
            !pass.full,
            "a pass that took nothing is not followed at once: it would read the same again"
        );
        database.drop().await.expect("drop");
    }

    #[tokio::test]
    async fn a_partitions_claim_takes_nothing_marked_while_its_pass_waited_for_room() {
        let database = crate::testing::database().await;
        let outbox = database.collection::<Document>("outbox");
        let payload = Binary {
            subtype: bson::spec::BinarySubtype::Generic,
            bytes: vec![7; 200 * KIB],
        };
        let message = || doc! { "_id": ObjectId::new(), "type": "t", "status": "pending", "keyHash": 1_i64, "payload": payload.clone() };
        outbox
            .insert_many([message(), message()])
            .await
            .expect("insert");
        // The stream's pipeline holds the whole budget: the pass reads a
        // candidate and waits for room to hold it.
        let budget = Budget::new(1024 * 1024);
        let elsewhere = budget.reserve(1024 * 1024).await.expect("held");
        let mut sweeper = sweeper(outbox.clone(), budget.clone(), 1024 * 1024);
        sweeper.pipeline.partition = Partition::new(1, 2).expect("a partition");
        let starved = budget.starved();
        tokio::pin!(starved);
        starved.as_mut().enable();
        let passing = tokio::spawn(async move { sweeper.pass().await });
        timeout(Duration::from_secs(30), starved)
            .await
            .expect("the pass waits for room");
        // Meanwhile the stream delivers them and marks them.
        outbox
            .update_many(doc! {}, doc! { "$set": { "status": "processed" } })
            .await
            .expect("marked");
        drop(elsewhere);
        let pass = timeout(Duration::from_secs(30), passing)
            .await
            .expect("a pass in time")
            .expect("the pass task")
            .expect("a pass");
        assert_eq!(
            pass.claimed, 0,
            "a message no longer pending is not claimed"
        );
        assert_eq!(pass.tally.delivered, 0, "nor published again");
        database.drop().await.expect("drop");
    }

    #[test]
    fn a_pending_document_whose_id_is_not_utf8_is_a_candidate_not_skipped() {
        let document = crate::unreadable::tests::not_utf8(b"ab\xff");
        let id = raw_id(&document).expect("an _id to tell it by");
        let stand_in = RawField::of(&document, "_id").map(|id| id.stand_in());
        assert_eq!(Some(id), stand_in);
        let readable = RawDocumentBuf::from_document(&doc! { "_id": 7 }).expect("raw");
        assert_eq!(raw_id(&readable), Some(Bson::Int32(7)));
    }
}
