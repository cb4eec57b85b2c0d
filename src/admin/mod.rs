//! Looking at an outbox, and acting on its dead letters, from outside the
//! relay: what `outbox-relay status` and `outbox-relay dlq` run.
//!
//! Everything here reads or changes the collection itself, so it works
//! whether or not a relay is running; the depths, the checkpoint and the
//! oplog's span are read through [`crate::outbox_state`], as the relay's own
//! collector ([`crate::observe`]) reads them.

pub mod dlq;
pub mod status;
