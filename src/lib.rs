//! outbox-relay: a transactional outbox for MongoDB, delivered to NATS.
//!
//! Applications write an outbox document in the same transaction as their
//! business change ([`Outbox`]); the relay ([`Relay`]) tails a change stream
//! on the outbox collection and publishes each message to NATS the moment it
//! commits, then marks it processed and records how far it got.
//!
//! A message's path through the crate, one module per stage:
//! - [`contract`]: the outbox document and its mapping onto a NATS message;
//! - [`source`]: the change stream with its catch-up pass, and the sweep;
//! - [`publish`]: the broker interface, NATS, and the pipelined publish stage;
//! - `complete` and [`checkpoint`]: marking messages and keeping the resume token;
//! - [`setup`]: indexes, retention and the validator of the outbox collection;
//! - [`lease`]: which of several relays leads, fenced by a term;
//! - [`relay`]: the stages wired together, with graceful shutdown.

pub mod admin;
pub mod bench;
pub mod check;
pub mod checkpoint;
mod complete;
pub mod config;
pub mod contract;
pub mod error;
pub mod lease;
pub mod observe;
mod pipeline;
pub mod publish;
pub mod relay;
mod retry;
pub mod setup;
pub mod source;
pub mod writer;

pub use config::{NatsMode, RelayConfig, RelayMode, RetryPolicy};
pub use contract::{ContractViolation, OutboxMessage};
pub use error::{CheckKind, Error, Result};
pub use observe::Metrics;
pub use pipeline::Tally;
pub use relay::Relay;
pub use writer::{MessageType, NewMessage, Outbox, Payload};
