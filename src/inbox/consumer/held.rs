//! A held message: read and not yet settled, with its share of the
//! consumer's bounds and its entry among those kept alive; and the line in
//! which a key's held messages wait for the one its task handles.
//!
//! These are what every job of the consumer passes along (pulling makes
//! them, lanes queue them, settling ends them, the stop hands them back),
//! so they stand here, below all of those jobs.

use std::collections::VecDeque;

use async_nats::jetstream;
use tokio::sync::OwnedSemaphorePermit;

use super::keep_alive::KeptEntry;
use crate::inbox::Delivery;

/// A message read and not yet settled.
pub(super) struct Held {
    pub(super) message: jetstream::Message,
    pub(super) delivery: Delivery,
    /// JetStream's deliveries of it, this one included.
    pub(super) delivered: u64,
    /// Whether a run of the handler on it ended while it was held.
    pub(super) ran: bool,
    /// The count of the run about to begin, once the record took it.
    pub(super) counted: Option<u64>,
    pub(super) share: Share,
    pub(super) _kept: KeptEntry,
}

impl Held {
    /// The handler ran: the next run is counted anew.
    pub(super) fn run_ended(&mut self) {
        self.ran = true;
        self.counted = None;
    }
}

/// A held message's share of the consumer's bounds, given back as it is
/// dropped: its place among the held, given up early while it waits
/// behind a key that waits (see [`Line`]), and its room among all the
/// messages kept.
pub(super) struct Share {
    pub(super) place: Option<OwnedSemaphorePermit>,
    pub(super) _room: OwnedSemaphorePermit,
}

impl Share {
    fn give_up_place(&mut self) {
        self.place = None;
    }
}

/// The messages of a key waiting behind the one its task handles.
///
/// While that first message waits (its record held by another
/// transaction, or a retry's delay), the messages behind it give up their
/// places among the held, and so does each that joins them: a key that
/// waits takes at most one place (its first message's, if that one had
/// kept its own), and the other keys go on. They are still kept alive in
/// the order they came, so after a crash they come back in it. What bounds
/// them then is their room among all the messages held (8 places' worth),
/// and JetStream's `max_ack_pending`.
#[derive(Default)]
pub(super) struct Line {
    pub(super) waiting: VecDeque<Held>,
    first: First,
}

/// What the first message of a key's line is doing.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum First {
    /// Being handled: the messages behind keep their places.
    #[default]
    Handled,
    /// Waiting for its record or for a retry: those behind give theirs up.
    Waits,
}

impl Line {
    /// Puts a message at the back of the line.
    pub(super) fn join(&mut self, mut held: Held) {
        if self.first == First::Waits {
            held.share.give_up_place();
        }
        self.waiting.push_back(held);
    }

    pub(super) fn first_now(&mut self, first: First) {
        self.first = first;
        if first == First::Waits {
            for held in &mut self.waiting {
                held.share.give_up_place();
            }
        }
    }
}
