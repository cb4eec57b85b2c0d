//! After an attempt that did not end its message: a failure tried again
//! after a growing delay (here, in its key's line, or by JetStream's
//! redelivery), a record held by another transaction waited for, or the
//! message given up on, recorded failed and terminated.
//!
//! The records these write are written outside any transaction, each try
//! bounded, and tried again while MongoDB cannot be reached: an outage
//! charges no message.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use bson::DateTime;

use super::held::Held;
use super::settle::{acknowledge, Settled};
use super::shared::Shared;
use crate::error::{brief, is_unreachable};
use crate::inbox::record::{record_failed, record_failing, Entry};
use crate::inbox::HandlerError;
use crate::retry::{self, reconnect_backoff, Outage};

/// The pause before a message whose record another transaction held is
/// tried again: a dead process's transaction holds it until the server
/// ends it (60 s on MongoDB), a live copy's for a moment.
const RECORD_HELD_PAUSE: Duration = Duration::from_secs(1);

/// How long one try of a record write outside a transaction may take.
const RECORD_WRITE_WAIT: Duration = Duration::from_secs(5);

/// How writing a record outside a transaction ended.
enum Written {
    Done,
    /// Refused for what it is (a validator, say): no retry writes it.
    Refused(String),
    /// The consumer stopped while MongoDB could not be reached.
    Stopped,
}

impl Shared {
    /// After a failed attempt (numbered by the inbox record, where the
    /// message has one): the message is tried again, later or here when
    /// `in_place` (None: the caller loops), or given up on after its last
    /// attempt, or when its count cannot be kept (else nothing would bound
    /// its attempts).
    pub(super) async fn after_failure(
        &self,
        held: &mut Held,
        error: HandlerError,
        in_place: bool,
    ) -> Option<Settled> {
        let consumer = self.inbox.name();
        let attempt = held.delivery.attempt;
        let mut reason = error.to_string();
        if attempt < self.settings.max_deliveries {
            match self.count_failure(held, &reason).await {
                Written::Done => return self.try_again(held, &error, in_place).await,
                Written::Stopped => return Some(Settled::Left),
                Written::Refused(refusal) => {
                    reason = format!("{reason}; and counting the attempt was refused: {refusal}");
                }
            }
        }
        if !self.give_up(held, &reason).await {
            return Some(Settled::Left);
        }
        self.inbox.metrics().failed(consumer);
        Some(Settled::Acknowledged)
    }

    /// A message whose record another transaction holds (see
    /// [`Outcome::Busy`](crate::inbox::transaction::Outcome::Busy)) is
    /// tried again after a pause: here when `in_place`, its key's later
    /// messages waiting behind it, else by JetStream's redelivery after
    /// that delay (None: the caller loops).
    pub(super) async fn wait_for_record(&self, held: &Held, in_place: bool) -> Option<Settled> {
        tracing::info!(
            consumer = self.inbox.name(),
            subject = %held.delivery.subject,
            stream_sequence = held.delivery.stream_sequence,
            "the message's inbox record is held by another transaction; trying again later"
        );
        self.later(held, RECORD_HELD_PAUSE, in_place).await
    }

    /// Tries a failed message again after a growing delay: here, or by
    /// JetStream's redelivery.
    async fn try_again(
        &self,
        held: &mut Held,
        error: &HandlerError,
        in_place: bool,
    ) -> Option<Settled> {
        let consumer = self.inbox.name();
        self.inbox.metrics().retried(consumer);
        let attempt = held.delivery.attempt;
        let delay = self.retry_delay(attempt);
        tracing::warn!(
            consumer,
            subject = %held.delivery.subject,
            attempt,
            error = %error,
            ?delay,
            "handling failed; trying again later"
        );
        let settled = self.later(held, delay, in_place).await;
        if settled.is_none() {
            held.delivery.attempt += 1;
        }
        settled
    }

    /// The message is tried again after `delay`: here when `in_place`, its
    /// key's later messages waiting behind it (None: the caller loops;
    /// Left if the consumer stopped meanwhile), else by JetStream's
    /// redelivery after that delay.
    async fn later(&self, held: &Held, delay: Duration, in_place: bool) -> Option<Settled> {
        if !in_place {
            acknowledge(&held.message, AckKind::Nak(Some(delay))).await;
            return Some(Settled::Acknowledged);
        }
        if !self.wait_in_line(held, delay).await {
            return Some(Settled::Left);
        }
        None
    }

    /// Keeps the failed attempt's count in the message's record, for the
    /// next attempt, whoever makes it, to count on.
    async fn count_failure(&self, held: &Held, reason: &str) -> Written {
        let Some(entry) = Entry::of(self.inbox.name(), &held.delivery) else {
            return Written::Done;
        };
        let inbox = self.inbox.collection();
        self.write_record(|| record_failing(inbox, &entry, reason, DateTime::now()))
            .await
    }

    /// Records the message failed and terminates it. False if MongoDB kept
    /// the record from being written before the consumer stopped (the
    /// message is then left for a redelivery).
    pub(super) async fn give_up(&self, held: &Held, reason: &str) -> bool {
        let delivery = &held.delivery;
        tracing::error!(
            consumer = self.inbox.name(),
            subject = %delivery.subject,
            message_id = delivery.message_id.as_deref().unwrap_or(""),
            attempts = delivery.attempt,
            error = reason,
            "handler failed on every attempt: recorded failed in the inbox and terminated"
        );
        if let Some(entry) = Entry::of(self.inbox.name(), delivery) {
            let (inbox, retention) = (self.inbox.collection(), self.inbox.retention);
            let written = self
                .write_record(|| record_failed(inbox, &entry, reason, DateTime::now(), retention))
                .await;
            match written {
                Written::Done => {}
                Written::Stopped => return false,
                // Refused for what it is (a validator on the inbox, say):
                // no retry can write it, and the log above keeps the
                // message's subject and sequence.
                Written::Refused(refusal) => tracing::error!(
                    consumer = self.inbox.name(),
                    stream_sequence = delivery.stream_sequence,
                    error = %refusal,
                    "recording the message failed was refused; terminated unrecorded"
                ),
            }
        }
        acknowledge(&held.message, AckKind::Term).await;
        true
    }

    /// Writes a record outside any transaction, waiting out an outage of
    /// MongoDB (which charges no message), until the consumer stops. Each
    /// try is bounded: a record another transaction holds holds such a
    /// write until that one ends (for ever on some servers), and the try is
    /// made again after a pause. Such a write is not taken back by the
    /// server, and may land later; these writes can (a count only rises,
    /// and a status written twice is the same status).
    async fn write_record<F, Fut>(&self, write: F) -> Written
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = mongodb::error::Result<()>>,
    {
        let mut backoff = reconnect_backoff();
        let mut outage = Outage::new("MongoDB inbox");
        loop {
            let problem = match tokio::time::timeout(RECORD_WRITE_WAIT, write()).await {
                Ok(Ok(())) => return Written::Done,
                Ok(Err(error)) if is_unreachable(&error) => brief(&error),
                Ok(Err(error)) => return Written::Refused(brief(&error)),
                Err(_) => format!(
                    "a record write took longer than {RECORD_WRITE_WAIT:?} (its record held by \
                     another transaction?)"
                ),
            };
            outage.failed(&problem);
            if !retry::back_off(&mut backoff, &self.shutdown).await {
                return Written::Stopped;
            }
        }
    }

    /// The delay after failed attempt `attempt`: doubling from the first,
    /// up to the longest.
    fn retry_delay(&self, attempt: u64) -> Duration {
        let doublings = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(31);
        let delay = self
            .settings
            .retry_initial_delay
            .saturating_mul(1u32 << doublings);
        delay.min(self.settings.retry_max_delay)
    }
}
