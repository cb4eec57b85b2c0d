//! What the consumer's tasks share while it runs: the inbox and the
//! handler, the bounds on transactions, each key's line, the messages kept
//! alive, and those left to hand back.
//!
//! It lives apart from the jobs that act on it (`pull`, `lanes`, `settle`,
//! `failure`, `stopping`), each of which adds its own methods, so that every
//! job imports it and it imports none of them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::held::{Held, Line};
use super::keep_alive::Keeping;
use super::settings::Settings;
use crate::inbox::{BoxedHandler, Inbox};

/// What the consumer's tasks share.
pub(super) struct Shared {
    pub(super) inbox: Inbox,
    pub(super) client: mongodb::Client,
    pub(super) nats: async_nats::Client,
    pub(super) handler: Box<dyn BoxedHandler>,
    pub(super) settings: Settings,
    /// One permit per transaction running.
    pub(super) running: Semaphore,
    /// Each key's line, while a task works through it.
    pub(super) lanes: Mutex<HashMap<String, Line>>,
    /// The held messages kept from redelivery, shared with the keeper.
    pub(super) keeping: Arc<Keeping>,
    /// Held messages left as the consumer stops, handed back to JetStream
    /// once nothing more can arrive (see [`Shared::hand_back`]).
    pub(super) handed_back: Mutex<Vec<Held>>,
    pub(super) shutdown: CancellationToken,
}

impl Shared {
    pub(super) fn lock_lanes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Line>> {
        // The lines hold messages only; a panic elsewhere leaves them whole.
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits `delay`; false if the consumer stops first.
    pub(super) async fn pause(&self, delay: Duration) -> bool {
        pause_unless(&self.shutdown, delay).await
    }
}

/// Waits `delay`; false if `shutdown` fires first.
pub(super) async fn pause_unless(shutdown: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}
