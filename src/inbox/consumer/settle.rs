//! Settling a message: its attempts, each a transaction within the
//! concurrency limit, and the acknowledgement that ends it.
//!
//! A run is counted in the inbox record before it begins, where the record
//! does not count it itself, so a delivery that ran no handler costs no
//! attempt, and an outage of MongoDB, which charges none, is waited out
//! here with the message kept alive. What follows a failed attempt is
//! `failure`'s.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use async_nats::jetstream::{self, AckKind};
use bson::DateTime;

use super::held::Held;
use super::settings::AfterCommit;
use super::shared::Shared;
use crate::error::{brief, is_unreachable};
use crate::inbox::record::{record_run, Counted, Entry};
use crate::inbox::transaction::{Outcome, Transaction};
use crate::inbox::HandlerError;
use crate::retry::{self, reconnect_backoff, Outage};

/// How handling a message ended, for its acknowledgement.
pub(super) enum Settled {
    Acknowledged,
    /// Left unacknowledged: the consumer is stopping.
    Left,
}

impl Shared {
    /// Handles one message to its end: acknowledged (handled, a repeat, or
    /// given up on and terminated), negatively acknowledged for a later
    /// attempt, or kept to be handed back as the consumer stops. `in_place`: a
    /// failed attempt is tried again here, not redelivered.
    pub(super) async fn handle(self: Arc<Self>, mut held: Held, in_place: bool) -> Settled {
        let settled = self.settle(&mut held, in_place).await;
        if let Settled::Left = settled {
            self.keep_for_handing_back([held]);
        }
        settled
    }

    async fn settle(&self, held: &mut Held, in_place: bool) -> Settled {
        let consumer = self.inbox.name().to_owned();
        let metrics = self.inbox.metrics().clone();
        let mut outage = Outage::new("MongoDB inbox");
        let mut backoff = reconnect_backoff();
        loop {
            if self.shutdown.is_cancelled() {
                return Settled::Left;
            }
            let Some(outcome) = self.attempt(held).await else {
                return Settled::Left;
            };
            match outcome.charged() {
                Outcome::Committed { handler_time } => {
                    outage.recovered();
                    metrics.handled(&consumer, handler_time);
                    if let Some(hook) = &self.settings.after_commit {
                        let hook =
                            std::panic::catch_unwind(AssertUnwindSafe(|| hook(&held.delivery)));
                        if hook.unwrap_or(AfterCommit::Acknowledge) == AfterCommit::Abandon {
                            return Settled::Acknowledged;
                        }
                    }
                    acknowledge(&held.message, AckKind::Ack).await;
                    return Settled::Acknowledged;
                }
                Outcome::Repeat => {
                    outage.recovered();
                    metrics.repeat(&consumer);
                    acknowledge(&held.message, AckKind::Ack).await;
                    return Settled::Acknowledged;
                }
                Outcome::Failed(error) => {
                    outage.recovered();
                    held.run_ended();
                    if let Some(settled) = self.after_failure(held, error, in_place).await {
                        return settled;
                    }
                }
                // Nothing ran and nothing was counted: the message waits
                // without a transaction's place, so that the others go on.
                Outcome::Busy => {
                    outage.recovered();
                    if let Some(settled) = self.wait_for_record(held, in_place).await {
                        return settled;
                    }
                }
                Outcome::Spent(reason) => {
                    outage.recovered();
                    if !self.give_up(held, &reason).await {
                        return Settled::Left;
                    }
                    metrics.failed(&consumer);
                    return Settled::Acknowledged;
                }
                // MongoDB could not be reached, or started no transaction:
                // no attempt is charged; the message waits here, kept
                // alive, until MongoDB answers.
                Outcome::Mongo(error) | Outcome::Unavailable(error) => {
                    outage.failed(&brief(&error));
                    if !retry::back_off(&mut backoff, &self.shutdown).await {
                        return Settled::Left;
                    }
                }
            }
        }
    }

    /// One transaction for `delivery`, within the concurrency limit.
    /// None if the consumer stops first: a message waiting for its turn
    /// starts no transaction then.
    async fn attempt(&self, held: &mut Held) -> Option<Outcome> {
        let _running = tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => return None,
            running = self.running.acquire() => running.ok()?,
        };
        if self.shutdown.is_cancelled() {
            return None;
        }
        let counted = match self.count_run(held).await {
            Ok(counted) => counted,
            Err(outcome) => return Some(outcome),
        };
        let transaction = Transaction {
            client: &self.client,
            inbox: self.inbox.collection(),
            retention: self.inbox.retention,
            max_runs: self.settings.max_deliveries,
            handler_began: AtomicBool::new(false),
        };
        let outcome = transaction
            .run(
                self.handler.as_ref(),
                &mut held.delivery,
                self.inbox.name(),
                counted,
            )
            .await;
        // A run that began and ended in an outage is counted like any
        // other: the next one is counted anew, so a handler whose writes
        // bring MongoDB down is still bounded.
        if transaction.handler_began.load(Ordering::Relaxed) {
            held.run_ended();
        }
        Some(outcome)
    }

    /// Counts the run about to begin, before it begins, where the record
    /// does not count it itself (see `record`): the run's count, or none
    /// where its transaction counts it. Counted once per run, however
    /// often an outage makes it wait. An outcome instead where no run is
    /// to begin: MongoDB unreachable (which charges nothing), the count
    /// past the limit, or a count the inbox refuses to keep (else nothing
    /// would bound the runs).
    async fn count_run(&self, held: &mut Held) -> std::result::Result<Option<u64>, Outcome> {
        let limit = self.settings.max_deliveries;
        let Some(entry) = Entry::of(self.inbox.name(), &held.delivery) else {
            // No record: JetStream's deliveries bound a handler that ends
            // its process.
            return match held.delivered > limit {
                true => Err(Outcome::Spent(format!(
                    "JetStream delivered it {} times with no result, more than max_deliveries \
                     (without a message id, deliveries are its only count)",
                    held.delivered
                ))),
                false => Ok(None),
            };
        };
        if held.counted.is_none() && (held.delivered > 1 || held.ran) {
            // Not cut short client-side: a count given up on may still
            // commit, and the next would count the same run again. Its
            // commit is sent again while its result is unknown instead,
            // which the server answers once.
            let counted = record_run(self.inbox.collection(), &entry, limit, DateTime::now()).await;
            held.counted = match counted {
                // Handled meanwhile: the transaction finds it a repeat.
                Ok(Counted::Handled) => Some(0),
                Ok(Counted::Held) => return Err(Outcome::Busy),
                Ok(Counted::Refused(before)) => {
                    held.delivery.attempt = before.runs;
                    return Err(Outcome::refused(&before));
                }
                Ok(Counted::Before(before)) => Some(before.runs.saturating_add(1)),
                Err(error) if is_unreachable(&error) => return Err(Outcome::Mongo(error)),
                Err(error) => {
                    return Err(Outcome::Spent(format!(
                        "the inbox refused to count its runs: {}",
                        brief(&error)
                    )))
                }
            };
        }
        match held.counted {
            Some(0) | None => Ok(None),
            Some(runs) => {
                held.delivery.attempt = runs;
                Ok(Some(runs))
            }
        }
    }
}

/// Sends an acknowledgement; one that is lost leads to a redelivery, which
/// the inbox recognises, so a failure is only logged.
pub(super) async fn acknowledge(message: &jetstream::Message, kind: AckKind) {
    if let Err(error) = message.ack_with(kind).await {
        tracing::warn!(error = %error, "acknowledging a message failed; JetStream will redeliver it");
    }
}

impl Outcome {
    /// A MongoDB failure that is the message's to bear, as an attempt
    /// failed: the server answered and refused (the transaction's writes, a
    /// handler that ended the transaction itself or swallowed an error that
    /// aborted it, transient errors past the limit). Only a deployment that
    /// cannot be reached charges no attempt, so no message is tried for
    /// ever, and an outage burns no message's attempts.
    fn charged(self) -> Outcome {
        match self {
            Outcome::Mongo(error) if !is_unreachable(&error) => Outcome::Failed(HandlerError::new(
                crate::Error::mongo("the message's transaction failed", error),
            )),
            other => other,
        }
    }
}
