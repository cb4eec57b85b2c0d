//! outbox-relay: a transactional outbox for MongoDB, delivered to NATS.
//!
//! Applications write an outbox document in the same transaction as their
//! business change ([`Outbox`]); the relay ([`Relay`]) tails a change stream
//! on the outbox collection and publishes each message to NATS the moment it
//! commits, then marks it processed and records how far it got.
//!
//! # Layout
//!
//! A message's path through the crate, one module per stage:
//! - [`contract`]: the outbox document, the subjects and headers it may
//!   name, its mapping onto a NATS message, and the same rules as a schema;
//! - [`source`]: the change stream with its catch-up pass, and the sweep;
//! - [`publish`]: the broker interface, NATS, and the pipelined publish stage;
//! - `complete` and [`checkpoint`]: marking messages and keeping the resume
//!   token, with `complete::fate` deciding a refused message's next attempt
//!   or dead letter;
//! - [`order`]: per-key order, one message of a key on the wire and held
//!   keys, shared by the pipelines of a term;
//! - `work`: what flows between the stages, and what they share (a leaf:
//!   it imports no stage);
//! - `pipeline`: a publish stage and a completion stage joined by channels;
//! - [`relay`]: the stages wired together, with leadership and the two stop
//!   levels: `shutdown` (graceful: read nothing new, finish and record what
//!   was read) and `abandon` (at once: publish and write nothing more, when
//!   the grace time is over or the lease is lost).
//!
//! Around them:
//! - [`writer`]: adding messages inside an application's transaction;
//! - [`inbox`]: the consumer's half, applying each message's effects once;
//! - [`config`]: the settings, each declared once with its default, range
//!   and help, and the config file;
//! - [`connect`]: connecting to MongoDB as every command does;
//! - [`deployment`]: what kind of deployment a connection reaches (a
//!   replica set, or mongos), from one `hello`;
//! - [`redact`]: the one rule that masks secrets in connection strings;
//! - [`setup`]: indexes, retention and the validator of the outbox collection;
//! - [`lease`]: which of several relays leads, fenced by a term, and a
//!   group's hold on the outbox's own lease while it delivers partitions;
//! - `server_clock`: the database server's clock, which judges leases, read
//!   once and counted on locally for a while (a leaf below `lease`);
//! - [`partition`]: which messages a partition holds, as a query;
//! - [`group`]: the relays sharing one outbox's partitions, the rule that
//!   balances them, and the stored positions a change of count retires;
//! - [`check`]: the start-up checks and their exit codes;
//! - [`observe`]: metrics, health endpoints and the collector;
//! - [`admin`]: the `status` and `dlq` commands;
//! - [`outbox_state`]: the outbox's depths, its checkpoint as a reader sees
//!   it, and the oplog's span, read alike by `status` and the collector (a
//!   leaf below both);
//! - [`replay`]: sending delivered messages again, resumable, beside a
//!   running relay;
//! - [`audit`]: proving that what the outbox says was delivered is in the
//!   stream, and publishing again what is not;
//! - [`bench`](mod@bench): the latency and drain benchmark;
//! - `retry`: waiting out a server, shared by every stage;
//! - `usage`: a process's peak memory, for the benchmark and a replay;
//! - `unreadable`: finding and changing a document whose `_id` or
//!   `attempts` the driver cannot read (a string that is not UTF-8);
//! - [`error`]: the library's error kinds.

pub mod admin;
pub mod audit;
#[cfg(feature = "bench")]
pub mod bench;
pub mod check;
pub mod checkpoint;
mod complete;
pub mod config;
pub mod connect;
pub mod contract;
pub mod deployment;
pub mod error;
pub mod group;
pub mod inbox;
pub mod lease;
pub mod observe;
pub mod order;
pub mod outbox_state;
pub mod partition;
mod pipeline;
pub mod publish;
pub mod redact;
pub mod relay;
pub mod replay;
mod retry;
mod server_clock;
pub mod setup;
pub mod source;
mod stop;
#[cfg(test)]
mod testing;
mod time;
mod unreadable;
mod usage;
mod work;
pub mod writer;

pub use config::{DeadLetters, NatsMode, RelayConfig, RelayMode, Retention, RetryPolicy};
pub use contract::{ContractViolation, OutboxMessage, Rule};
pub use error::{CheckKind, Error, Result};
pub use observe::Metrics;
pub use relay::Relay;
pub use work::Tally;
pub use writer::{MessageType, NewMessage, Outbox, Payload};

/// The MongoDB driver this crate is built with: its `Database`, `Client`
/// and `ClientSession` are the ones [`Outbox`] and [`inbox::Inbox`] take,
/// so depend on this one (or the same version) to avoid a mismatch.
pub use mongodb;

/// The NATS client this crate is built with: its `jetstream::Context` is the
/// one [`inbox::Inbox::consumer`] takes.
pub use async_nats;
