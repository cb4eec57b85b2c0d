//! Sources: where outbox messages enter the relay.
//!
//! The change stream is the fast path: it hands over each message the moment
//! its transaction commits. The catch-up pass reads the collection itself,
//! for messages the stream cannot replay (those written before the relay's
//! first start). The sweep reads it on a timer, for whatever else is due:
//! retries, and anything the stream missed, keeping out of the way of a
//! stream or pass that is still reading (`progress`). All yield `Work`
//! into the same pipeline, so everything downstream treats them alike.

pub(crate) mod catch_up;
pub(crate) mod change_stream;
pub(crate) mod progress;
pub mod sweep;
