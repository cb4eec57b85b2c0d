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
use crate::pipeline::{Finished, Verdict};
use crate::retry::until_ok;

/// Records verdicts and checkpoints.
pub(crate) struct CompletionStage {
    pub outbox: Collection<Document>,
    pub checkpoints: CheckpointStore,
    pub batch_size: usize,
    pub checkpoint_interval: Duration,
    pub retry: RetryPolicy,
    /// Fires when the relay stops waiting for MongoDB (the end of a graceful
    /// stop's grace time). Until then, writes are retried.
    pub abandon: CancellationToken,
}

impl CompletionStage {
    pub async fn run(self, mut input: mpsc::Receiver<Finished>) {
        let mut unsaved: Option<ResumeToken> = None;
        let mut saved_at = Instant::now();
        loop {
            let next_save = saved_at + self.checkpoint_interval;
            let first = tokio::select! {
                finished = input.recv() => finished,
                _ = tokio::time::sleep_until(next_save), if unsaved.is_some() => {
                    if !self.save(&mut unsaved).await {
                        return;
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
            if !self.record(&batch).await {
                return;
            }
            if let Some(token) = batch.iter().rev().find_map(|f| f.work.token.clone()) {
                unsaved = Some(token);
            }
            if saved_at.elapsed() >= self.checkpoint_interval {
                if !self.save(&mut unsaved).await {
                    return;
                }
                saved_at = Instant::now();
            }
        }
        self.save(&mut unsaved).await;
    }

    /// Writes the newest recorded token, if there is one not yet written.
    async fn save(&self, unsaved: &mut Option<ResumeToken>) -> bool {
        let Some(token) = unsaved.take() else {
            return true;
        };
        let saved = until_ok("MongoDB checkpoint write", &self.abandon, || {
            self.checkpoints.save(&token)
        })
        .await;
        saved.is_some()
    }

    /// Records a batch of verdicts. Returns false if the relay gave up.
    async fn record(&self, batch: &[Finished]) -> bool {
        let now = DateTime::now();
        let mut delivered: HashMap<Option<ObjectId>, Vec<Bson>> = HashMap::new();
        for finished in batch {
            let Some(id) = finished.work.id() else {
                continue;
            };
            let claim = finished.work.claim;
            let recorded = match &finished.verdict {
                Verdict::Delivered => {
                    delivered.entry(claim).or_default().push(id.clone());
                    true
                }
                Verdict::Rejected(violation) => {
                    self.mark_failed(id, claim, &violation.to_string(), now)
                        .await
                }
                Verdict::Refused(reason) => self.schedule_retry(id, claim, reason, now).await,
                Verdict::Passed => true,
            };
            if !recorded {
                return false;
            }
        }
        for (claim, ids) in delivered {
            if !self.mark_processed(ids, claim, now).await {
                return false;
            }
        }
        true
    }

    async fn mark_processed(&self, ids: Vec<Bson>, claim: Option<ObjectId>, now: DateTime) -> bool {
        let filter = still_ours(doc! { "$in": ids }, claim);
        let update = doc! {
            "$set": { field::STATUS: status::PROCESSED, field::PROCESSED_AT: now },
            "$unset": unlock(),
        };
        until_ok("MongoDB marking processed", &self.abandon, || {
            self.outbox
                .update_many(filter.clone(), update.clone())
                .into_future()
        })
        .await
        .is_some()
    }

    async fn mark_failed(
        &self,
        id: &Bson,
        claim: Option<ObjectId>,
        reason: &str,
        now: DateTime,
    ) -> bool {
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
        until_ok("MongoDB marking failed", &self.abandon, || {
            self.outbox
                .update_one(filter.clone(), update.clone())
                .into_future()
        })
        .await
        .is_some()
    }

    /// Counts an attempt against a refused message and either schedules the
    /// next one or, with none left, fails the message.
    async fn schedule_retry(
        &self,
        id: &Bson,
        claim: Option<ObjectId>,
        reason: &str,
        now: DateTime,
    ) -> bool {
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
        .await;
        let Some(counted) = counted else { return false };
        let Some(document) = counted else {
            return true; // completed or reclaimed meanwhile: not ours to schedule
        };
        let attempts = document
            .get(field::ATTEMPTS)
            .and_then(|a| a.as_i32().map(i64::from).or_else(|| a.as_i64()))
            .map_or(1, |a| u32::try_from(a).unwrap_or(u32::MAX));
        if self.retry.exhausted(attempts) {
            let reason = format!("{reason} (gave up after {attempts} attempts)");
            return self.mark_failed(id, None, &reason, now).await;
        }
        let delay = self.retry.delay_after(attempts);
        tracing::debug!(id = %id, attempts, ?delay, reason, "outbox message refused; will retry");
        let next = DateTime::from_millis(
            now.timestamp_millis()
                .saturating_add(delay.as_millis() as i64),
        );
        let filter = doc! { field::ID: id.clone(), field::STATUS: status::PENDING };
        let update = doc! { "$set": { field::NEXT_ATTEMPT_AT: next } };
        until_ok("MongoDB scheduling a retry", &self.abandon, || {
            self.outbox
                .update_one(filter.clone(), update.clone())
                .into_future()
        })
        .await
        .is_some()
    }
}

/// Matches messages still pending and, if a sweep claimed them, still held
/// by that claim: the fence that stops a processor which lost a message from
/// writing over its state.
fn still_ours(id: impl Into<Bson>, claim: Option<ObjectId>) -> Document {
    let mut filter = doc! { field::ID: id.into(), field::STATUS: status::PENDING };
    if let Some(claim) = claim {
        filter.insert(field::LOCK_ID, claim);
    }
    filter
}

fn unlock() -> Document {
    doc! { field::LOCK_ID: "", field::LOCKED_AT: "" }
}
