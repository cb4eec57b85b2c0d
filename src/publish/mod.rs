//! Publishing: the broker interface, its NATS implementation, and the stage
//! that drives it.
//!
//! Publishing is split in two steps, [`Publisher::send`] and the returned
//! [`AckFuture`], so the stage can put many messages on the wire in order and
//! await their acknowledgements together. Errors are sorted by whose fault
//! they are ([`PublishError`]), because each kind is handled differently: a
//! broken message is failed, a refused one is retried later, and a broker
//! fault pauses delivery without charging any message an attempt. Where a
//! failure could be either the broker's or the message's, the stage asks
//! the broker ([`Publisher::probe`]) rather than guess: one message must
//! not stall the rest, and a broker outage must not dead-letter them all.

mod connection;
mod denials;
mod nats;
pub(crate) mod stage;
#[cfg(test)]
mod tests;

pub use connection::{connect_nats, NatsConnection};
pub(crate) use nats::PERMISSION_DENIED;
pub use nats::{NatsPublisher, StreamSetup};

use futures::future::BoxFuture;

use crate::contract::{ContractViolation, OutboxMessage};

/// The broker's acknowledgement of one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ack {
    /// JetStream already held a message with this id (a repeat it dropped).
    pub duplicate: bool,
}

/// Why a publish did not succeed, sorted by what the relay should do about it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PublishError {
    /// The message itself can never be published (for example too large).
    #[error("{0}")]
    Invalid(ContractViolation),
    /// The broker refused this message; another attempt later may succeed.
    #[error("refused by the broker: {0}")]
    Refused(String),
    /// The broker is unreachable or unable to take any message now.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
    /// Nothing took the message's subject (no JetStream stream captures it,
    /// or JetStream did not answer): this message's refusal if the broker
    /// takes other messages, an outage if it does not.
    #[error("nothing takes the subject: {0}")]
    Uncaptured(String),
}

/// What a [`Publisher::probe`] found out about the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// The broker takes messages there (for NATS: the stream capturing the
    /// subject answers and has room, or no stream captures it while the
    /// relay's own stream does), so a failure of one message is its own.
    Takes,
    /// Where the message goes takes nothing now (a stream other than the
    /// relay's own is full or down), but the broker takes the relay's other
    /// messages: the failure is that destination's, so the message is
    /// refused and the rest go on.
    TakesOthers(String),
    /// The broker takes no message now; the text says why.
    TakesNone(String),
    /// The publisher cannot tell; failures count as outages.
    Unknown,
}

/// The acknowledgement of a message already sent.
pub type AckFuture = BoxFuture<'static, Result<Ack, PublishError>>;

/// A destination for outbox messages.
///
/// [`NatsPublisher`] is the one the relay ships; an application embedding the
/// relay may supply its own. Errors it returns as [`PublishError::Refused`]
/// are retried with backoff and count towards the message's attempts.
pub trait Publisher: Send + Sync + 'static {
    /// Puts the message on the wire and returns its acknowledgement to await.
    /// Messages of one key are sent one at a time, in order, each once the
    /// one before has its answer (where [`Publisher::acknowledges_storage`]);
    /// messages without a key are sent in the order they were read.
    fn send<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>>;

    /// The largest message, headers included, the broker takes.
    fn max_payload(&self) -> usize;

    /// Whether an acknowledgement means the broker stored the message.
    /// Where it does, the next message of a key waits for the answer to the
    /// one before, so that no resend can put them out of order; where it
    /// does not (core NATS), they are sent in order without waiting.
    fn acknowledges_storage(&self) -> bool {
        true
    }

    /// Whether the broker takes messages now where a message to `subject`
    /// would go. Asked whenever a publish fails in a way that could be the
    /// broker's fault or the message's: before a message is charged, and
    /// once per backoff step while delivery is paused, so an answer may come
    /// from a short cache. The default cannot tell.
    fn probe<'a>(&'a self, subject: &'a str) -> BoxFuture<'a, Health> {
        let _ = subject;
        Box::pin(std::future::ready(Health::Unknown))
    }

    /// The relay's term as leader ended (it lost the lease, or stops):
    /// nothing sent during it may reach the broker from now on, since the
    /// next leader publishes the same messages. A publisher that holds
    /// sends queued while it reconnects drops or disowns what it still
    /// holds before this returns. The default holds nothing.
    fn end_term(&self) -> BoxFuture<'_, ()> {
        Box::pin(std::future::ready(()))
    }
}
