//! Looking at an outbox, and acting on its dead letters, from outside the
//! relay: what `outbox-relay status` and `outbox-relay dlq` run.
//!
//! Everything here reads or changes the collection itself, so it works
//! whether or not a relay is running, and the relay's own collector
//! ([`crate::observe`]) reads its depths with the same queries.

pub mod dlq;
pub mod status;
