//! Key lanes: each key's messages handled one at a time, in stream order.
//!
//! A keyed message joins its key's line, or, when the key has none, opens
//! one and starts the task that works through it; a message without a key
//! takes no line and gets a task of its own. A key's first message that
//! waits (for its record, or a retry) waits in place, its later messages
//! behind it, having given their places up (see [`Line`]).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::held::{First, Held, Line};
use super::settle::Settled;
use super::shared::Shared;

/// A key's line while a task works through it. Dropped however the task
/// ends (a panic included), it removes the line, so the key's next message
/// starts a task of its own rather than waiting behind none.
struct Lane {
    shared: Arc<Shared>,
    key: String,
    /// Removed already: the key may have a new line, not this one's.
    closed: bool,
}

impl Lane {
    /// The line's next message; none closes the line, under the same lock,
    /// so a message dispatched after it starts a new one.
    fn next(&mut self) -> Option<Held> {
        let mut lanes = self.shared.lock_lanes();
        let next = lanes
            .get_mut(&self.key)
            .and_then(|line| line.waiting.pop_front());
        if next.is_none() {
            lanes.remove(&self.key);
            self.closed = true;
        }
        next
    }

    /// Closes the line, returning what waited in it, in order.
    fn close(&mut self) -> VecDeque<Held> {
        if self.closed {
            return VecDeque::new();
        }
        self.closed = true;
        self.shared
            .lock_lanes()
            .remove(&self.key)
            .map(|line| line.waiting)
            .unwrap_or_default()
    }
}

impl Drop for Lane {
    /// Only if its task ended unexpectedly (a panic, or the consumer's
    /// future dropped): what waited goes back to JetStream by its ack wait.
    fn drop(&mut self) {
        drop(self.close());
    }
}

impl Shared {
    /// Puts a message in its key's line, or in a task of its own.
    pub(super) fn dispatch(self: &Arc<Self>, held: Held, tasks: &mut JoinSet<()>) {
        let Some(key) = held.delivery.key.clone() else {
            let shared = self.clone();
            tasks.spawn(async move {
                shared.handle(held, false).await;
            });
            return;
        };
        let mut lanes = self.lock_lanes();
        match lanes.get_mut(&key) {
            Some(line) => line.join(held),
            None => {
                lanes.insert(key.clone(), Line::default());
                tasks.spawn(self.clone().work_through(key, held));
            }
        }
    }

    /// Handles a key's messages one after another, in the order they came,
    /// until its line is empty. Stopping, it hands what waits in the line
    /// back to JetStream in that order, so that a consumer started next
    /// receives them before the key's later messages.
    async fn work_through(self: Arc<Self>, key: String, first: Held) {
        let mut lane = Lane {
            shared: self.clone(),
            key,
            closed: false,
        };
        let mut next = Some(first);
        while let Some(held) = next {
            // Its later messages wait, so a failed attempt is tried again
            // in place.
            if let Settled::Left = self.clone().handle(held, true).await {
                self.keep_for_handing_back(lane.close());
                return;
            }
            next = lane.next();
        }
    }

    /// Waits `delay` before a keyed message is tried again in its line; the
    /// messages behind it give up their places meanwhile (see [`Line`]).
    /// False if the consumer stops first.
    pub(super) async fn wait_in_line(&self, held: &Held, delay: Duration) -> bool {
        self.first_of_line(held, First::Waits);
        let waited = self.pause(delay).await;
        self.first_of_line(held, First::Handled);
        waited
    }

    fn first_of_line(&self, held: &Held, first: First) {
        if let Some(key) = &held.delivery.key {
            if let Some(line) = self.lock_lanes().get_mut(key) {
                line.first_now(first);
            }
        }
    }
}
