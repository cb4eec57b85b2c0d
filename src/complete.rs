//! The completion stage: records verdicts in MongoDB and moves the checkpoint.
//!
//! Verdicts arrive in order. They are recorded in batches: every delivered
//! message of a batch is marked `processed` with one update, so marking costs
//! one round trip per batch, not per message. A resume token is written only
//! after the batch holding it is recorded, and at most once per checkpoint
//! interval, so a restart repeats at most one interval of work and never
//! skips any. Every update matches `status: "pending"` (and the sweep's
//! `lockId` where it claimed the message), so a late or repeated completion
//! cannot overwrite a newer state.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::change_stream::event::ResumeToken;
use mongodb::options::ReturnDocument;
use mongodb::Collection;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointStore;
use crate::config::RetryPolicy;
use crate::contract::{field, status};
use crate::observe::{FailureKind, Metrics};
use crate::pipeline::{Finished, Tally, Verdict};
use crate::retry::until_ok;

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
            let Some(id) = finished.work.id() else {
                continue;
            };
            let claim = finished.work.claim;
            match &finished.verdict {
                Verdict::Delivered => delivered.entry(claim).or_default().push(id.clone()),
                Verdict::Rejected(violation) => {
                    let reason = violation.to_string();
                    self.mark_failed(id, claim, &reason, FailureKind::Rejected, now)
                        .await?;
                    tally.failed += 1;
                }
                Verdict::Refused(reason) => {
                    match self.schedule_retry(id, claim, reason, now).await? {
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

    async fn mark_processed(
        &self,
        ids: Vec<Bson>,
        claim: Option<ObjectId>,
        now: DateTime,
    ) -> Option<()> {
        let filter = still_ours(doc! { "$in": ids }, claim);
        let update = doc! {
            "$set": { field::STATUS: status::PROCESSED, field::PROCESSED_AT: now },
            "$unset": unlock(),
        };
        let marked = self
            .write("MongoDB marking processed", filter, update)
            .await?;
        self.metrics.processed(marked);
        Some(())
    }

    async fn mark_failed(
        &self,
        id: &Bson,
        claim: Option<ObjectId>,
        reason: &str,
        kind: FailureKind,
        now: DateTime,
    ) -> Option<()> {
        tracing::warn!(id = %id, reason, "outbox message failed");
        let filter = still_ours(id.clone(), claim);
        let update = doc! {
            "$set": {
                field::STATUS: status::FAILED,
                field::FAILED_AT: now,
                field::LAST_ERROR: reason,
            },
            "$unset": unlock(),
        };
        if self.write("MongoDB marking failed", filter, update).await? > 0 {
            self.metrics.failed(kind);
        }
        Some(())
    }

    /// Counts an attempt against a refused message and either schedules the
    /// next one or, with none left, fails the message.
    async fn schedule_retry(
        &self,
        id: &Bson,
        claim: Option<ObjectId>,
        reason: &str,
        now: DateTime,
    ) -> Option<Retry> {
        let filter = still_ours(id.clone(), claim);
        let update = doc! {
            "$inc": { field::ATTEMPTS: 1 },
            "$set": { field::LAST_ERROR: reason },
            "$unset": unlock(),
        };
        let counted = until_ok("MongoDB recording an attempt", &self.abandon, || {
            self.outbox
                .find_one_and_update(filter.clone(), update.clone())
                .return_document(ReturnDocument::After)
                .into_future()
        })
        .await?;
        let Some(document) = counted else {
            return Some(Retry::NotOurs);
        };
        let attempts = attempts_of(&document);
        if self.retry.exhausted(attempts) {
            let reason = format!("{reason} (gave up after {attempts} attempts)");
            self.mark_failed(id, None, &reason, FailureKind::Exhausted, now)
                .await?;
            return Some(Retry::GaveUp);
        }
        let delay = self.retry.delay_after(attempts);
        tracing::debug!(id = %id, attempts, ?delay, reason, "outbox message refused; will retry");
        let next = DateTime::from_millis(
            now.timestamp_millis()
                .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
        );
        let filter = doc! { field::ID: id.clone(), field::STATUS: status::PENDING };
        let update = doc! { "$set": { field::NEXT_ATTEMPT_AT: next } };
        self.write("MongoDB scheduling a retry", filter, update)
            .await?;
        Some(Retry::Scheduled)
    }

    /// Applies an update to every match, retrying until MongoDB takes it.
    /// Returns how many documents it changed.
    async fn write(&self, what: &'static str, filter: Document, update: Document) -> Option<u64> {
        until_ok(what, &self.abandon, || {
            self.outbox
                .update_many(filter.clone(), update.clone())
                .into_future()
        })
        .await
        .map(|result| result.modified_count)
    }
}

fn attempts_of(document: &Document) -> u32 {
    let attempts = match document.get(field::ATTEMPTS) {
        Some(Bson::Int32(n)) => i64::from(*n),
        Some(Bson::Int64(n)) => *n,
        _ => 1,
    };
    u32::try_from(attempts).unwrap_or(u32::MAX)
}

/// Matches messages still pending and, if a sweep claimed them, still held
/// by that claim: the fence that stops a processor which lost a message from
/// writing over its state.
pub(crate) fn still_ours(id: impl Into<Bson>, claim: Option<ObjectId>) -> Document {
    let mut filter = doc! { field::ID: id.into(), field::STATUS: status::PENDING };
    if let Some(claim) = claim {
        filter.insert(field::LOCK_ID, claim);
    }
    filter
}

fn unlock() -> Document {
    doc! { field::LOCK_ID: "", field::LOCKED_AT: "" }
}
