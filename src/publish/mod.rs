//! Publishing: the broker interface, its NATS implementation, and the stage
//! that drives it.
//!
//! Publishing is split in two steps, [`Publisher::send`] and the returned
//! [`AckFuture`], so the stage can put many messages on the wire in order and
//! await their acknowledgements together. Errors are sorted by whose fault
//! they are ([`PublishError`]), because each kind is handled differently: a
//! broken message is failed, a refused one is retried later, and a broker
//! fault pauses delivery without charging any message an attempt.

mod nats;
pub(crate) mod stage;

pub use nats::{connect_nats, NatsPublisher, StreamSetup};

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
    /// Calls are made one at a time, in delivery order.
    fn send<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>>;

    /// The largest message, headers included, the broker takes.
    fn max_payload(&self) -> usize;
}
