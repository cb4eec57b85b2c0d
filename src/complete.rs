//! The completion stage: records verdicts in MongoDB and moves the checkpoint.
//!
//! Verdicts arrive in order. They are recorded in batches: every delivered
//! message of a batch is marked `processed` with one update, so marking costs
//! one round trip per batch, not per message. A resume token is written only
//! after the batch holding it is recorded, and at most once per checkpoint
//! interval, so a restart repeats at most one interval of work and never
//! skips any. Every update matches `status: "pending"` (and the sweep's
//! `lockId` where it claimed the message), so a late or repeated completion
//! cannot overwrite a newer state; a refusal or a failure also matches the
//! attempts it was read with, and no claim where it holds none.
//!
//! No document can wedge the stage. Writes are retried only while the
//! failure may pass (the network, an election, a conflict); a failure of
//! the document itself (its type, its size, a validator) is not retried: a
//! batch that hits one is marked document by document, and a document that
//! takes no update at all is logged, counted and skipped.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::change_stream::event::ResumeToken;
use mongodb::Collection;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointStore;
use crate::config::RetryPolicy;
use crate::contract::{field, status, Decoded};
use crate::error::{brief, is_document_error};
use crate::observe::{FailureKind, Metrics};
use crate::retry::{until_ok, until_settled};
use crate::work::{Finished, LastDelivery, Tally, Unmarkable, Verdict};

/// Records verdicts and checkpoints.
pub(crate) struct CompletionStage {
    pub outbox: Collection<Document>,
    /// Where resume tokens go; `None` for work that carries none (sweeps).
    pub checkpoints: Option<CheckpointStore>,
    pub batch_size: usize,
    pub checkpoint_interval: Duration,
    pub retry: RetryPolicy,
    /// Fires when the relay stops waiting for MongoDB (the end of a graceful
    /// stop's grace time). Until then, writes are retried.
    pub abandon: CancellationToken,
    pub metrics: Metrics,
    /// Messages no write can change, for the sweep to skip.
    pub unmarkable: Unmarkable,
    /// When the relay last delivered anything: evidence the broker works.
    pub deliveries: LastDelivery,
}

/// A stream position waiting to be written, with the time it was reached.
type Position = (ResumeToken, Option<DateTime>);

/// What became of a refused message.
enum Retry {
    Scheduled,
    GaveUp,
    /// Completed or reclaimed by another processor meanwhile.
    NotOurs,
}

impl CompletionStage {
    /// Records verdicts until the input closes; returns what it recorded.
    pub async fn run(self, mut input: mpsc::Receiver<Finished>) -> Tally {
        let mut tally = Tally::default();
        let mut unsaved: Option<Position> = None;
        let mut saved_at = Instant::now();
        loop {
            let next_save = saved_at + self.checkpoint_interval;
            let first = tokio::select! {
                finished = input.recv() => finished,
                _ = tokio::time::sleep_until(next_save), if unsaved.is_some() => {
                    if self.save(&mut unsaved).await.is_none() {
                        return tally;
                    }
                    saved_at = Instant::now();
                    continue;
                }
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
            while batch.len() < self.batch_size {
                match input.try_recv() {
                    Ok(finished) => batch.push(finished),
                    Err(_) => break,
                }
            }
            match self.record(&batch).await {
                Some(recorded) => tally += recorded,
                None => return tally,
            }
            if let Some(position) = batch
                .iter()
                .rev()
                .find_map(|f| Some((f.work.token.clone()?, f.work.at)))
            {
                unsaved = Some(position);
            }
            if saved_at.elapsed() >= self.checkpoint_interval {
                if self.save(&mut unsaved).await.is_none() {
                    return tally;
                }
                saved_at = Instant::now();
            }
        }
        self.save(&mut unsaved).await;
        tally
    }

    /// Writes the newest recorded token, if one is not yet written.
    /// `None` if the relay gave up waiting for MongoDB.
    async fn save(&self, unsaved: &mut Option<Position>) -> Option<()> {
        let (Some((token, at)), Some(checkpoints)) = (unsaved.take(), &self.checkpoints) else {
            return Some(());
        };
        let saved = until_ok("MongoDB checkpoint write", &self.abandon, || {
            checkpoints.save(&token, at)
        })
        .await?;
        if !saved {
            tracing::warn!("the checkpoint belongs to a newer leader now: not writing it");
            return None;
        }
        self.metrics.checkpoint_saved(DateTime::now());
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
                    let reason = violation.to_string();
                    let failed = fail(&reason, None, now);
                    if self
                        .decide(message, claim, Fate::Failed(&failed), &reason, now)
                        .await?
                    {
                        self.metrics.failed(FailureKind::Rejected);
                        tally.failed += 1;
                    }
                }
                Verdict::Refused { reason, own } => {
                    match self.refuse(message, claim, reason, *own, now).await? {
                        Retry::Scheduled => {
                            self.metrics.retried();
                            tally.retried += 1;
                        }
                        Retry::GaveUp => tally.failed += 1,
                        Retry::NotOurs => {}
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
        let filter = still_ours(doc! { "$in": &ids }, claim);
        match self
            .write("MongoDB marking processed", filter, &update)
            .await?
        {
            Ok(marked) => self.metrics.processed(marked),
            Err(_) => {
                // The smallest change that records the delivery.
                let least = doc! { "$set": { field::STATUS: status::PROCESSED } };
                for id in ids {
                    let filter = still_ours(doc! { "$eq": &id }, claim);
                    if self.write_one(&id, filter, &[&update, &least]).await? {
                        self.metrics.processed(1);
                    }
                }
            }
        }
        Some(())
    }

    /// Records an attempt the broker refused: schedules the next, or with
    /// none left fails the message. One conditional write that matches the
    /// claim and the attempts read with the message, so it cannot change a
    /// message another processor has delivered, claimed or counted meanwhile.
    ///
    /// A message out of attempts is failed only on evidence that the fault
    /// is its own: the broker was found to take other messages when it was
    /// refused (`own`), or the relay delivered something within the evidence
    /// window. Without it, the broker may be refusing everything (a
    /// permission lost for every subject), and failing would dead-letter the
    /// outbox one message at a time; the message is tried again after the
    /// longest retry delay instead.
    async fn refuse(
        &self,
        message: &Decoded,
        claim: Option<ObjectId>,
        reason: &str,
        own: bool,
        now: DateTime,
    ) -> Option<Retry> {
        let attempts = message.attempts_made().saturating_add(1);
        let stored = i32::try_from(attempts).unwrap_or(i32::MAX);
        let exhausted = self.retry.exhausted(attempts);
        if exhausted && (own || self.deliveries.within(self.evidence_window())) {
            let reason = format!("{reason} (gave up after {attempts} attempts)");
            let failed = fail(&reason, Some(stored), now);
            let decided = self
                .decide(message, claim, Fate::Failed(&failed), &reason, now)
                .await?;
            if decided {
                self.metrics.failed(FailureKind::Exhausted);
            }
            return Some(if decided {
                Retry::GaveUp
            } else {
                Retry::NotOurs
            });
        }
        let (delay, reason) = if exhausted {
            self.metrics.dead_letter_held();
            let window = humantime::format_duration(self.evidence_window());
            tracing::warn!(
                id = %message.id,
                attempts,
                reason,
                "outbox message is out of attempts, but the broker took no other message in the \
                 last {window}: not failing it, since the fault may be the broker's"
            );
            let held = format!(
                "{reason} (out of attempts; not failed, as the broker took no other message in \
                 the last {window})"
            );
            (self.retry.max_delay.max(self.evidence_window()), held)
        } else {
            (self.retry.delay_after(attempts), reason.to_owned())
        };
        tracing::debug!(id = %message.id, attempts, ?delay, reason, "outbox message refused; will retry");
        let next = DateTime::from_millis(
            now.timestamp_millis()
                .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
        );
        let schedule = doc! {
            "$set": {
                field::ATTEMPTS: stored,
                field::NEXT_ATTEMPT_AT: next,
                field::LAST_ERROR: &reason,
            },
            "$unset": unlock(),
        };
        let decided = self
            .decide(message, claim, Fate::Retried(&schedule), &reason, now)
            .await?;
        Some(if decided {
            Retry::Scheduled
        } else {
            Retry::NotOurs
        })
    }

    /// How recent a delivery must be to show that the broker takes messages:
    /// the longest retry delay, and at least a minute. A held message waits
    /// as long before it is tried again.
    fn evidence_window(&self) -> Duration {
        self.retry.max_delay.max(Duration::from_secs(60))
    }

    /// Applies a message's fate with the fence of a decision: still
    /// pending, held by this processor's claim or by none, and with the
    /// attempts it was read with. A document that cannot take the update is
    /// failed with the least change that says so. Returns whether the
    /// message was ours to decide.
    async fn decide(
        &self,
        message: &Decoded,
        claim: Option<ObjectId>,
        fate: Fate<'_>,
        reason: &str,
        now: DateTime,
    ) -> Option<bool> {
        if let Fate::Failed(_) = fate {
            tracing::warn!(id = %message.id, reason, "outbox message failed");
        }
        let mut filter = still_ours(doc! { "$eq": &message.id }, claim);
        if claim.is_none() {
            filter.insert(field::LOCK_ID, Bson::Null);
        }
        // `$eq`, so that a value a writer stored (`{"$exists": false}`, say)
        // is compared, never read as an operator.
        match &message.attempts {
            Some(attempts) => filter.insert(field::ATTEMPTS, doc! { "$eq": attempts.clone() }),
            None => filter.insert(field::ATTEMPTS, doc! { "$exists": false }),
        };
        // Should the document not take its fate, fail it with the reason,
        // or else with the least change that takes it out of pending.
        let failed = fail(reason, None, now);
        let least = doc! { "$set": { field::STATUS: status::FAILED } };
        let fallbacks: &[&Document] = match fate {
            Fate::Failed(update) => &[update, &least],
            Fate::Retried(update) => &[update, &failed, &least],
        };
        self.write_one(&message.id, filter, fallbacks).await
    }

    /// Applies the first of `updates` the document takes. A document that
    /// takes none is recorded as unmarkable. Returns whether a document
    /// matched; `None` if the relay gave up waiting for MongoDB.
    async fn write_one(&self, id: &Bson, filter: Document, updates: &[&Document]) -> Option<bool> {
        let mut last_error = None;
        for update in updates {
            match self
                .write("MongoDB recording a verdict", filter.clone(), update)
                .await?
            {
                Ok(changed) => return Some(changed > 0),
                Err(error) => last_error = Some(error),
            }
        }
        let why = last_error.map(|e| brief(&e)).unwrap_or_default();
        self.unmarkable.add(id, &why, &self.metrics);
        Some(false)
    }

    /// Applies an update to every match, retrying what may pass. Returns how
    /// many documents it changed, or the error of a document no retry can
    /// mend; `None` if the relay gave up waiting for MongoDB.
    async fn write(
        &self,
        what: &'static str,
        filter: Document,
        update: &Document,
    ) -> Option<Result<u64, mongodb::error::Error>> {
        let written = until_settled(
            what,
            &self.abandon,
            || {
                self.outbox
                    .update_many(filter.clone(), update.clone())
                    .into_future()
            },
            is_document_error,
        )
        .await?;
        Some(written.map(|result| result.modified_count))
    }
}

/// The update that fails a message, with its reason (and attempts, when
/// the failure used the last one).
fn fail(reason: &str, attempts: Option<i32>, now: DateTime) -> Document {
    let mut fields = doc! {
        field::STATUS: status::FAILED,
        field::FAILED_AT: now,
        field::LAST_ERROR: reason,
    };
    if let Some(attempts) = attempts {
        fields.insert(field::ATTEMPTS, attempts);
    }
    doc! { "$set": fields, "$unset": unlock() }
}

/// What a decision writes: a failure, or another attempt scheduled.
#[derive(Clone, Copy)]
enum Fate<'a> {
    Failed(&'a Document),
    Retried(&'a Document),
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
