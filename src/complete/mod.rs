//! The completion stage: records verdicts in MongoDB and moves the checkpoint.
//!
//! Verdicts arrive as the publish stage has them, and a stream position
//! only once every work before it has its verdict. They are recorded in
//! batches: every delivered
//! message of a batch is marked `processed` with one update, so marking costs
//! one round trip per batch, not per message. A resume token is written only
//! after the batch holding it is recorded, and at most once per checkpoint
//! interval, so a restart repeats at most one interval of work and never
//! skips any. Every update matches `status: "pending"` (and the sweep's
//! `lockId` where it claimed the message), so a late or repeated completion
//! cannot overwrite a newer state; a refusal or a failure also matches the
//! attempts it was read with, and no claim of the term where it holds none.
//!
//! No document can wedge the stage. Writes are retried only while the
//! failure may pass (the network, an election, a conflict); a failure of
//! the document itself (its type, its size, a validator) is not retried: a
//! batch that hits one is marked document by document, and a document that
//! takes no update at all is logged, counted and skipped.
//!
//! Marking delivered messages and keeping the checkpoint live here; what
//! becomes of a refused or broken message (another attempt, or a dead
//! letter) is decided in `fate`.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocumentBuf};
use futures::future::{BoxFuture, FutureExt, TryFutureExt};
use mongodb::change_stream::event::ResumeToken;
use mongodb::Collection;
use tokio::sync::mpsc::{self, error::TryRecvError};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointStore;
use crate::config::RetryPolicy;
use crate::contract::{field, status, Decoded};
use crate::error::{brief, is_document_error};
use crate::observe::Metrics;
use crate::retry::{settle, Cut};
use crate::unreadable;
use crate::work::{
    Acknowledged, Budget, Finished, LastDelivery, Tally, Tenure, Unmarkable, Unrecorded, Verdict,
};

mod fate;
#[cfg(test)]
mod tests;

use fate::Retry;

/// Records verdicts and checkpoints.
pub(crate) struct CompletionStage {
    pub outbox: Collection<Document>,
    /// Where resume tokens go; `None` for work that carries none (sweeps).
    pub checkpoints: Option<CheckpointStore>,
    pub batch_size: usize,
    pub checkpoint_interval: Duration,
    /// How long the first verdict of a batch waits for others to share its
    /// update (see `gather`).
    pub mark_delay: Duration,
    /// The relay's budget for work read and not yet recorded: marks do
    /// not wait while it is short (see `gather`).
    pub budget: Budget,
    pub retry: RetryPolicy,
    /// Fires when the relay stops waiting for MongoDB (a graceful stop's
    /// grace time is over, the lease is lost, or a run's time is up; see
    /// [`crate::stop`]). Until then, writes are retried.
    pub abandon: CancellationToken,
    pub metrics: Metrics,
    /// Messages no write can change, for the sweep to skip.
    pub unmarkable: Unmarkable,
    /// When the relay last delivered anything: evidence the broker works.
    pub deliveries: LastDelivery,
    /// Deliveries whose marks a lost term did not write, remembered as it
    /// gives up, and forgotten as marks are written.
    pub acknowledged: Acknowledged,
    /// The term the verdicts come from: its per-key order, told of dead
    /// letters, and when it began (see `CompletionStage::unclaimed`);
    /// `None` outside a term.
    pub tenure: Option<Tenure>,
}

/// A stream position waiting to be written, with the time it was reached.
type Position = (ResumeToken, Option<DateTime>);

impl CompletionStage {
    /// Records verdicts until the input closes; returns what it recorded.
    pub async fn run(self, mut input: mpsc::Receiver<Finished>) -> Tally {
        let mut tally = Tally::default();
        if let Err(unrecorded) = self.record_until_closed(&mut input, &mut tally).await {
            self.give_up(unrecorded, input).await;
        }
        tally
    }

    /// Records verdicts, and writes the stream's position every checkpoint
    /// interval, until the input closes. `Err` with the verdicts it was
    /// recording if it gave up (the term is lost, or the grace time is over).
    async fn record_until_closed(
        &self,
        input: &mut mpsc::Receiver<Finished>,
        tally: &mut Tally,
    ) -> Result<(), Vec<Finished>> {
        let mut unsaved: Option<Position> = None;
        let mut saved_at = Instant::now();
        let mut pace = Pace::new(self.mark_delay);
        loop {
            let next_save = saved_at + self.checkpoint_interval;
            let first = tokio::select! {
                finished = input.recv() => finished,
                _ = tokio::time::sleep_until(next_save), if unsaved.is_some() => {
                    self.save(&mut unsaved).await.ok_or_else(Vec::new)?;
                    saved_at = Instant::now();
                    continue;
                }
            };
            let Some(first) = first else { break };
            let batch = self.gather(first, input, &mut pace).await;
            match self.record(&batch).await {
                Some(recorded) => *tally += recorded,
                None => return Err(batch),
            }
            if let Some(tenure) = &self.tenure {
                let sent = batch.iter().filter(|f| f.work.sent.is_some()).count();
                tenure.unrecorded.recorded(sent);
            }
            if let Some(position) = batch
                .iter()
                .rev()
                .find_map(|f| Some((f.work.token.clone()?, f.work.at)))
            {
                if let Some(checkpoints) = &self.checkpoints {
                    checkpoints.recorded(&position.0);
                }
                unsaved = Some(position);
            }
            if saved_at.elapsed() >= self.checkpoint_interval {
                self.save(&mut unsaved).await.ok_or_else(Vec::new)?;
                saved_at = Instant::now();
            }
            // The batch's messages end here: see `Work`'s end.
            drop(batch);
        }
        self.save(&mut unsaved).await.ok_or_else(Vec::new)?;
        Ok(())
    }

    /// A batch of verdicts: `first`, those that come within the mark delay
    /// after it (stretched where deliveries come far apart: see [`Pace`]),
    /// and the first to come after that (or, if none comes within a second
    /// mark delay, none), up to the batch size; at once if the input
    /// closes, the relay stops at once, a verdict other than a mark comes,
    /// the budget is short or a source waits for room in it (the work
    /// waiting here holds room, and no verdict comes while a source waits),
    /// or every slot of the term's unrecorded messages is taken (a message
    /// waits to be sent until a verdict here is recorded: marks are written
    /// as acknowledgements come, before more of a backlog is published).
    ///
    /// Why wait: a mark follows its publish, so waiting delays no delivery,
    /// while an update costs much the same for one message as for fifty.
    /// At tens or hundreds of messages a second, each would otherwise pay
    /// for an update of its own. Under load a batch fills at once. Other
    /// verdicts (parks, refusals, dead letters) are written without delay:
    /// a key's later messages can wait for them.
    ///
    /// Why end with a verdict rather than on the clock: a verdict comes just
    /// after its message's publish was answered, the moment the next
    /// message is furthest off. A batch written when a timer fires can be
    /// written as a message arrives, and steady traffic meets that timer at
    /// the same point each time.
    async fn gather(
        &self,
        first: Finished,
        input: &mut mpsc::Receiver<Finished>,
        pace: &mut Pace,
    ) -> Vec<Finished> {
        let now = Instant::now();
        pace.came(&first, now);
        let delayed = now + pace.wait();
        let last_call = delayed + self.mark_delay;
        let mut waiting = may_wait(&first) && !self.mark_delay.is_zero();
        let mut batch = vec![first];
        while batch.len() < self.batch_size {
            let next = match input.try_recv() {
                Ok(finished) => Some(finished),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) if !waiting => None,
                Err(TryRecvError::Empty) => self.next_before(last_call, input).await,
            };
            let Some(finished) = next else { break };
            let now = Instant::now();
            pace.came(&finished, now);
            waiting &= may_wait(&finished) && now < delayed;
            batch.push(finished);
        }
        batch
    }

    /// The next verdict, if one comes before `deadline`, the relay stops at
    /// once, and no source is short of budget meanwhile.
    async fn next_before(
        &self,
        deadline: Instant,
        input: &mut mpsc::Receiver<Finished>,
    ) -> Option<Finished> {
        // Listening before looking: a source that starts waiting for room
        // after the look is heard, one that waited before it is seen; and
        // so a message waiting for a slot among the unrecorded.
        let starved = self.budget.starved();
        tokio::pin!(starved);
        starved.as_mut().enable();
        let unrecorded = self.tenure.as_ref().map(|tenure| &tenure.unrecorded);
        let unsent = async {
            match unrecorded {
                Some(unrecorded) => unrecorded.starved().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(unsent);
        // Polled once, so that it listens from here on.
        if futures::FutureExt::now_or_never(&mut unsent).is_some()
            || self.budget.is_short()
            || unrecorded.is_some_and(Unrecorded::is_full)
        {
            return None;
        }
        tokio::select! {
            _ = self.abandon.cancelled() => None,
            _ = starved => None,
            _ = unsent => None,
            next = tokio::time::timeout_at(deadline, input.recv()) => next.ok().flatten(),
        }
    }

    /// Gives up recording: the deliveries in `unrecorded` and still in
    /// `input` are remembered, so that the relay does not publish them
    /// again (see `Acknowledged`). Closed, the input still yields what a
    /// sender had room for before the close, and then ends.
    async fn give_up(&self, unrecorded: Vec<Finished>, mut input: mpsc::Receiver<Finished>) {
        input.close();
        let mut unrecorded = unrecorded;
        while let Some(finished) = input.recv().await {
            unrecorded.push(finished);
        }
        let term = self.tenure.as_ref().map(|tenure| tenure.term);
        self.acknowledged.remember_unmarked(term, unrecorded);
    }

    /// Writes the newest recorded token, if one is not yet written.
    /// `None` if the relay gave up waiting for MongoDB.
    async fn save(&self, unsaved: &mut Option<Position>) -> Option<()> {
        let (Some((token, at)), Some(checkpoints)) = (unsaved.take(), &self.checkpoints) else {
            return Some(());
        };
        let saved = settle(
            "MongoDB checkpoint write",
            (&self.abandon, Cut::AnyTime),
            || checkpoints.save(&token, at),
            |_| false,
        )
        .await?
        .ok()?;
        if !saved {
            tracing::warn!("the checkpoint belongs to a newer leader now: not writing it");
            return None;
        }
        self.metrics
            .checkpoint_saved(checkpoints.partition(), DateTime::now());
        Some(())
    }

    /// Records a batch of verdicts. `None` if the relay gave up (its grace
    /// time ran out, or it lost the lease and must not write).
    async fn record(&self, batch: &[Finished]) -> Option<Tally> {
        if self.abandon.is_cancelled() {
            return None;
        }
        let now = DateTime::now();
        let mut tally = Tally::default();
        let mut delivered: HashMap<Option<ObjectId>, Vec<Bson>> = HashMap::new();
        for finished in batch {
            let (work, claim) = (&finished.work, finished.work.claim);
            let Some(message) = &work.message else {
                continue;
            };
            match &finished.verdict {
                Verdict::Delivered => delivered.entry(claim).or_default().push(message.id.clone()),
                Verdict::Rejected(violation) => {
                    if self.reject(message, claim, violation, now).await? {
                        tally.failed += 1;
                    }
                }
                Verdict::Refused {
                    reason,
                    own,
                    maybe_stored,
                } => {
                    match self.refuse(message, claim, reason, *own, now).await? {
                        Retry::Scheduled => {
                            self.metrics.retried();
                            // Sent again later, perhaps past the window.
                            if *maybe_stored {
                                self.metrics.resent();
                            }
                            tally.retried += 1;
                        }
                        Retry::GaveUp => tally.failed += 1,
                        Retry::NotOurs => {}
                    }
                }
                Verdict::Parked => {
                    if self.park(message, claim).await? {
                        tally.parked += 1;
                    }
                }
                Verdict::Passed => {}
            }
        }
        for (claim, ids) in delivered {
            tally.delivered += ids.len() as u64;
            self.mark_processed(ids, claim, now).await?;
        }
        Some(tally)
    }

    /// Marks delivered messages processed with one update. Should the batch
    /// hold a document no update can change, each is marked on its own, so
    /// that one cannot hold back the rest.
    async fn mark_processed(
        &self,
        ids: Vec<Bson>,
        claim: Option<ObjectId>,
        now: DateTime,
    ) -> Option<()> {
        let update = doc! {
            "$set": { field::STATUS: status::PROCESSED, field::PROCESSED_AT: now },
            "$unset": unlock(),
        };
        let filter = Target::Filter(still_ours(doc! { "$in": &ids }, claim));
        let written = self
            .write("MongoDB marking processed", &filter, &update)
            .await?;
        // Written, or found another's: in either case none is to be
        // published again.
        self.acknowledged.marked(&ids);
        match written {
            Ok(marked) => self.metrics.processed(marked),
            Err(_) => {
                // The smallest change that records the delivery.
                let least = doc! { "$set": { field::STATUS: status::PROCESSED } };
                for id in ids {
                    let filter = Target::Filter(still_ours(doc! { "$eq": &id }, claim));
                    if self
                        .write_one(&id, filter, &[&update, &least])
                        .await?
                        .is_some()
                    {
                        self.metrics.processed(1);
                    }
                }
            }
        }
        Some(())
    }

    /// Applies the first of `updates` the document takes. A document that
    /// takes none is recorded as unmarkable. Returns which one it took;
    /// `None` if the relay gave up waiting for MongoDB.
    async fn write_one(&self, id: &Bson, target: Target, updates: &[&Document]) -> Option<Taken> {
        let mut last_error = None;
        for (place, update) in updates.iter().enumerate() {
            match self
                .write("MongoDB recording a verdict", &target, update)
                .await?
            {
                Ok(changed) => return Some((changed > 0).then_some(place)),
                Err(error) => last_error = Some(error),
            }
        }
        let why = last_error.map(|e| brief(&e)).unwrap_or_default();
        self.unmarkable.add(id, &why, &self.metrics);
        Some(None)
    }

    /// Applies an update to every match, retrying what may pass. Returns how
    /// many documents it changed, or the error of a document no retry can
    /// mend; `None` if the relay gave up waiting for MongoDB.
    async fn write(
        &self,
        what: &'static str,
        target: &Target,
        update: &Document,
    ) -> Option<Result<u64, mongodb::error::Error>> {
        let attempt = || -> BoxFuture<'_, mongodb::error::Result<u64>> {
            match target {
                Target::Filter(filter) => self
                    .outbox
                    .update_many(filter.clone(), update.clone())
                    .into_future()
                    .map_ok(|result| result.modified_count)
                    .boxed(),
                Target::Stored(filter) => {
                    unreadable::update_one(&self.outbox, filter.clone(), update).boxed()
                }
            }
        };
        settle(
            what,
            (&self.abandon, Cut::AnyTime),
            attempt,
            is_document_error,
        )
        .await
    }
}

/// The place, among the writes offered for one document, of the one it
/// took; none if it took none (it was not this processor's to change, or
/// refused them all).
type Taken = Option<usize>;

/// The documents a write changes.
enum Target {
    /// Those a filter matches.
    Filter(Document),
    /// The one document a filter of its `_id` and `attempts` as stored
    /// matches, where the driver cannot read them (see `unreadable`).
    Stored(RawDocumentBuf),
}

impl Target {
    /// `filter`, whose `_id` and `attempts` conditions are replaced by
    /// the values as stored where the message has them.
    fn of(message: &Decoded, mut filter: Document) -> Target {
        let Some(stored) = &message.stored else {
            return Target::Filter(filter);
        };
        filter.remove(field::ID);
        filter.remove(field::ATTEMPTS);
        let fields = [
            (field::ID, stored.id.as_ref()),
            (field::ATTEMPTS, stored.attempts.as_ref()),
        ];
        match unreadable::filter(&fields, &filter) {
            Ok(raw) => Target::Stored(raw),
            // Not to be: the fields came from a document. A filter that
            // matches nothing leaves the document unmarkable.
            Err(error) => {
                tracing::warn!(id = %message.id, %error, "cannot name an unreadable document");
                filter.insert(field::ID, doc! { "$in": [] });
                Target::Filter(filter)
            }
        }
    }
}

/// Whether a verdict's write may wait for others: a mark, or no write.
fn may_wait(finished: &Finished) -> bool {
    matches!(finished.verdict, Verdict::Delivered | Verdict::Passed)
}

/// How far apart deliveries come, by which a mark's wait for company is
/// stretched.
///
/// Why: at tens of messages a second, deliveries come further apart than
/// the mark delay, so each mark would pay for an update of its own, the
/// dearest part of a message at those rates. Stretched to about two
/// deliveries' gap, a mark shares its update with one or two others. The
/// stretch is bounded in time ([`MOST_STRETCH`] times the mark delay, which
/// it never undercuts) and so in what a crash leaves unmarked: about as
/// many messages as a mark delay holds at higher rates, where the gap is
/// shorter than the delay and nothing changes. A pause (a quiet hour, an
/// outage) counts as no longer a gap than the stretch allows, so the
/// burst after it is back at its own pace within a few deliveries.
#[derive(Debug)]
struct Pace {
    mark_delay: Duration,
    /// When the last delivery came.
    last: Option<Instant>,
    /// The gap between deliveries, smoothed over the last few.
    gap: Option<Duration>,
}

/// The most a mark's wait is stretched, as a multiple of the mark delay.
const MOST_STRETCH: u32 = 5;

impl Pace {
    fn new(mark_delay: Duration) -> Self {
        Pace {
            mark_delay,
            last: None,
            gap: None,
        }
    }

    /// The longest wait: [`MOST_STRETCH`] mark delays.
    fn most(&self) -> Duration {
        self.mark_delay.saturating_mul(MOST_STRETCH)
    }

    /// Notes a verdict that came at `at`; only deliveries set the pace.
    fn came(&mut self, finished: &Finished, at: Instant) {
        if !matches!(finished.verdict, Verdict::Delivered) {
            return;
        }
        if let Some(last) = self.last {
            let gap = at.saturating_duration_since(last).min(self.most() / 2);
            self.gap = Some(match self.gap {
                Some(smoothed) => smoothed.saturating_mul(3).saturating_add(gap) / 4,
                None => gap,
            });
        }
        self.last = Some(at);
    }

    /// How long a batch's first mark waits for others: the mark delay, or
    /// two gaps where that is longer, at most [`MOST_STRETCH`] delays.
    fn wait(&self) -> Duration {
        let two_gaps = self.gap.map_or(Duration::ZERO, |gap| gap.saturating_mul(2));
        two_gaps.clamp(self.mark_delay, self.most())
    }
}

/// Matches messages still pending and, if a sweep claimed them, still held
/// by that claim: the fence that stops a processor which lost a message from
/// writing over its state. `ids` is an operator (`$eq`, `$in`), so that an
/// `_id` a writer chose is compared, never read as an operator itself.
fn still_ours(ids: Document, claim: Option<ObjectId>) -> Document {
    let mut filter = doc! { field::ID: ids, field::STATUS: status::PENDING };
    if let Some(claim) = claim {
        filter.insert(field::LOCK_ID, claim);
    }
    filter
}

fn unlock() -> Document {
    doc! { field::LOCK_ID: "", field::LOCKED_AT: "" }
}
