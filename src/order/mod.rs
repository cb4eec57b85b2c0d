//! Per-key order: messages that share a `key` reach the stream in commit
//! order, whatever fails.
//!
//! Two rules keep it:
//! - **One message of a key on the wire.** The next message of a key is sent
//!   only once the broker has answered for the one before, so a lost
//!   acknowledgement, a reconnect or a resend cannot let a later message
//!   overtake an earlier one. Keys do not wait for each other.
//! - **A refused message holds its key.** Every later message of the key is
//!   parked in MongoDB (`nextAttemptAt` set to [`PARKED`], out of every range
//!   the sweep reads) until the holder is delivered or dead-lettered. Then the
//!   key is *releasing*: its parked messages go out in `_id` order, before any
//!   newer one, and once none is left the key is free. With
//!   `--on-dead-letter hold` a dead letter keeps holding its key until
//!   `dlq replay` or `dlq discard`.
//!
//! [`KeyOrder`] is that state for one leader's term, shared by every
//! pipeline of the term (the stream's and the sweep's), so that a key has
//! one queue however its messages were found. The state is a cache: holds
//! are facts in the collection (a retry scheduled, a parked message, a dead
//! letter marked `holdsKey`), read back when a term starts ([`stored`]), so
//! a new leader knows which keys are held.

pub(crate) mod stored;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use bson::{Bson, DateTime};
use tokio::sync::{watch, Notify};

use crate::config::DeadLetters;
use crate::observe::Metrics;

pub use stored::{held_keys, HeldKey, PARKED};

/// Why a key is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKind {
    /// Its holder was refused and waits for another attempt.
    Retrying,
    /// Its holder is a dead letter, held by `--on-dead-letter hold` until
    /// it is replayed or discarded.
    DeadLetter,
    /// Its holder was delivered or let go; parked messages remain.
    Releasing,
}

/// One held key.
#[derive(Debug, Clone)]
struct Hold {
    /// The message that must go before every other of the key; `None` once
    /// it has gone and the parked ones are being released.
    holder: Option<Bson>,
    kind: HoldKind,
    /// When the oldest message the key waits on was created.
    since: DateTime,
}

/// Park decisions for one key, and how many of them are written: a key is
/// free only once every parked message is in the collection, where a
/// release can find it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parks {
    decided: u64,
    written: u64,
}

/// The last message of a key let into a publish stage.
struct Tail {
    turn: u64,
    done: watch::Receiver<bool>,
}

#[derive(Default)]
struct Keys {
    tails: HashMap<String, Tail>,
    holds: HashMap<String, Hold>,
    parks: HashMap<String, Parks>,
    turns: u64,
}

/// The order of each key's messages for one term; clones share it.
#[derive(Clone)]
pub(crate) struct KeyOrder(Arc<Shared>);

struct Shared {
    keys: Mutex<Keys>,
    /// Woken when a key starts releasing, so its parked messages need not
    /// wait for the next sweep.
    releasing: Notify,
    dead_letters: DeadLetters,
    /// Whether a message is sent only once the one before it is answered:
    /// only where an answer means the message is stored (JetStream).
    chained: bool,
    metrics: Metrics,
}

/// Whether a message goes out, or is parked behind its key's holder.
#[derive(Debug)]
pub(crate) enum Admission {
    Send,
    Park(ParkTicket),
}

/// A park decided: counts as settled when dropped, once the verdict is
/// recorded (the park written, or found impossible) or given up with the
/// relay's stop. Until then its key cannot be freed, since a release might
/// read the collection before the park is in it.
#[derive(Debug)]
pub(crate) struct ParkTicket {
    order: KeyOrder,
    key: String,
}

impl Drop for ParkTicket {
    fn drop(&mut self) {
        if let Some(parks) = self.order.keys().parks.get_mut(&self.key) {
            parks.written += 1;
        }
    }
}

impl std::fmt::Debug for KeyOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyOrder").finish_non_exhaustive()
    }
}

/// How a message's turn ended, as far as its key is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The broker stored it.
    Delivered,
    /// Refused: it holds its key until its retry is delivered.
    Refused,
    /// A dead letter at once: releases its key, or holds it (`hold`).
    Failed,
}

impl KeyOrder {
    /// The order of a new term, starting from the holds found in MongoDB.
    pub fn new(
        held: Vec<HeldKey>,
        dead_letters: DeadLetters,
        chained: bool,
        metrics: Metrics,
    ) -> Self {
        let mut keys = Keys::default();
        for held in held {
            let kind = match (held.holder.is_some(), held.dead_letter, dead_letters) {
                (false, _, _) => HoldKind::Releasing,
                (true, true, DeadLetters::Hold) => HoldKind::DeadLetter,
                (true, true, DeadLetters::Release) => HoldKind::Releasing,
                (true, false, _) => HoldKind::Retrying,
            };
            let holder = held.holder.filter(|_| kind != HoldKind::Releasing);
            let since = held.since;
            keys.holds.insert(
                held.key,
                Hold {
                    holder,
                    kind,
                    since,
                },
            );
        }
        let order = KeyOrder(Arc::new(Shared {
            keys: Mutex::new(keys),
            releasing: Notify::new(),
            dead_letters,
            chained,
            metrics,
        }));
        order.report(&order.keys());
        order
    }

    fn keys(&self) -> MutexGuard<'_, Keys> {
        // The state is a cache of facts in MongoDB; a panic elsewhere while
        // it was held leaves nothing half-written that matters here.
        self.0.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, keys: &Keys) {
        let oldest = keys.holds.values().map(|h| h.since).min();
        self.0.metrics.held_keys(keys.holds.len(), oldest);
    }

    /// Lets a message of `key` in line: it goes after every message of the
    /// key let in before it. `release` marks a parked message read back to
    /// be released.
    pub fn enter(&self, key: &str, id: &Bson, release: bool) -> Turn {
        let (done, receiver) = watch::channel(false);
        let mut keys = self.keys();
        keys.turns += 1;
        let number = keys.turns;
        let before = if self.0.chained {
            let tail = Tail {
                turn: number,
                done: receiver,
            };
            keys.tails.insert(key.to_owned(), tail).map(|t| t.done)
        } else {
            None
        };
        Turn {
            order: self.clone(),
            key: key.to_owned(),
            id: id.clone(),
            release,
            number,
            done,
            before,
            sent: false,
        }
    }

    /// Whether a message may go now: the key is free, the message is the
    /// one holding it or older (then it came first, and either is stored
    /// already, a repeat JetStream drops, or must go first), or the key is
    /// releasing and this is a parked message.
    fn admit(&self, turn: &Turn) -> Admission {
        let mut keys = self.keys();
        let admitted = match keys.holds.get(&turn.key) {
            None => true,
            Some(hold) => match &hold.holder {
                Some(holder) => *holder == turn.id || earlier(&turn.id, holder),
                None => turn.release,
            },
        };
        if admitted {
            return Admission::Send;
        }
        keys.parks.entry(turn.key.clone()).or_default().decided += 1;
        Admission::Park(ParkTicket {
            order: self.clone(),
            key: turn.key.clone(),
        })
    }

    fn finished(&self, turn: &Turn, outcome: Outcome) {
        let mut keys = self.keys();
        let holds_it = |keys: &Keys| {
            keys.holds
                .get(&turn.key)
                .is_some_and(|h| h.holder.as_ref() == Some(&turn.id))
        };
        match outcome {
            Outcome::Delivered => {
                if holds_it(&keys) {
                    self.release(&mut keys, &turn.key);
                }
            }
            Outcome::Refused => self.hold(&mut keys, &turn.key, &turn.id, HoldKind::Retrying),
            Outcome::Failed => match self.0.dead_letters {
                DeadLetters::Hold => {
                    self.hold(&mut keys, &turn.key, &turn.id, HoldKind::DeadLetter)
                }
                DeadLetters::Release if holds_it(&keys) => self.release(&mut keys, &turn.key),
                DeadLetters::Release => {}
            },
        }
        self.report(&keys);
    }

    /// Holds `key` by `id`, unless an older message holds it already
    /// (where messages of a key are not chained, two can be refused).
    fn hold(&self, keys: &mut Keys, key: &str, id: &Bson, kind: HoldKind) {
        let current = keys.holds.get(key);
        if current
            .and_then(|hold| hold.holder.as_ref())
            .is_some_and(|holder| earlier(holder, id))
        {
            return;
        }
        let since = current.map_or_else(|| created(id), |hold| hold.since);
        let holder = Some(id.clone());
        keys.holds.insert(
            key.to_owned(),
            Hold {
                holder,
                kind,
                since,
            },
        );
    }

    /// A message sent whose answer never came (the relay stopped while it
    /// was in doubt): it may yet be stored, so nothing later of its key may
    /// go in this term.
    fn unsettled(&self, key: &str, id: &Bson) {
        let mut keys = self.keys();
        self.hold(&mut keys, key, id, HoldKind::Retrying);
        self.report(&keys);
    }

    fn release(&self, keys: &mut Keys, key: &str) {
        if let Some(hold) = keys.holds.get_mut(key) {
            hold.holder = None;
            hold.kind = HoldKind::Releasing;
            self.0.releasing.notify_one();
        }
    }

    /// A dead letter, decided where the verdict was recorded (out of
    /// attempts): releases its key, or holds it with `hold`.
    pub fn dead_letter(&self, key: &str, id: &Bson) {
        let mut keys = self.keys();
        match self.0.dead_letters {
            DeadLetters::Hold => self.hold(&mut keys, key, id, HoldKind::DeadLetter),
            DeadLetters::Release => self.let_go(&mut keys, key, id),
        }
        self.report(&keys);
    }

    /// Whether a dead letter holds its key (`--on-dead-letter hold`).
    pub fn dead_letters_hold(&self) -> bool {
        self.0.dead_letters == DeadLetters::Hold
    }

    /// Releases `key` if `id` still holds it: its holder was settled out of
    /// this relay's sight (delivered, replayed, discarded, or found to take
    /// no write at all).
    pub fn let_go_of(&self, key: &str, id: &Bson) {
        let mut keys = self.keys();
        self.let_go(&mut keys, key, id);
        self.report(&keys);
    }

    fn let_go(&self, keys: &mut Keys, key: &str, id: &Bson) {
        let held = keys.holds.get(key).and_then(|h| h.holder.as_ref());
        if held == Some(id) {
            self.release(keys, key);
        }
    }

    /// The messages holding keys, for checking against the collection.
    pub fn holders(&self) -> Vec<(String, Bson)> {
        let keys = self.keys();
        let holders = keys.holds.iter();
        holders
            .filter_map(|(key, hold)| Some((key.clone(), hold.holder.clone()?)))
            .collect()
    }

    /// Up to `limit` releasing keys, each with its park decisions so far.
    pub fn releasing(&self, limit: usize) -> Vec<(String, Parks)> {
        let keys = self.keys();
        let releasing = keys.holds.iter().filter(|(_, h)| h.holder.is_none());
        releasing
            .take(limit)
            .map(|(key, _)| {
                (
                    key.clone(),
                    keys.parks.get(key).copied().unwrap_or_default(),
                )
            })
            .collect()
    }

    /// A release found no parked message of `key` left, in a read that
    /// began when its park decisions were `before`: the key is free, unless
    /// a park was decided since or was not yet settled when the read began.
    /// Returns whether it freed the key.
    pub fn released(&self, key: &str, before: Parks) -> bool {
        let mut keys = self.keys();
        let now = keys.parks.get(key).copied().unwrap_or_default();
        let releasing = keys.holds.get(key).is_some_and(|h| h.holder.is_none());
        let free = releasing && before.decided == before.written && now.decided == before.decided;
        if free {
            keys.holds.remove(key);
            keys.parks.remove(key);
            self.report(&keys);
        }
        free
    }

    /// Waits until a key starts releasing.
    pub async fn release_wanted(&self) {
        self.0.releasing.notified().await;
    }

    /// The held keys now, oldest first: for tests and status.
    #[cfg(test)]
    pub fn held(&self) -> Vec<(String, Option<Bson>, HoldKind)> {
        let keys = self.keys();
        let mut held: Vec<_> = keys
            .holds
            .iter()
            .map(|(k, h)| (h.since, k.clone(), h.holder.clone(), h.kind))
            .collect();
        held.sort_by_key(|(since, key, ..)| (*since, key.clone()));
        held.into_iter()
            .map(|(_, k, h, kind)| (k, h, kind))
            .collect()
    }
}

/// A message's place in its key's line. Dropping it (the relay stopped,
/// or the message needs no answer) lets the next message of the key go.
pub(crate) struct Turn {
    order: KeyOrder,
    key: String,
    id: Bson,
    release: bool,
    number: u64,
    done: watch::Sender<bool>,
    before: Option<watch::Receiver<bool>>,
    /// On the wire, with no final answer yet.
    sent: bool,
}

impl Turn {
    /// Whether the message goes at once: nothing of its key is before it.
    pub fn first(&self) -> bool {
        self.before.as_ref().is_none_or(|before| *before.borrow())
    }

    /// Waits until the message before it of its key has had its answer.
    pub async fn wait(&mut self) {
        if let Some(mut before) = self.before.take() {
            // A dropped sender is done too.
            let _ = before.wait_for(|done| *done).await;
        }
    }

    /// Whether the message goes out or is parked; asked once the wait is over.
    pub fn admit(&self) -> Admission {
        self.order.admit(self)
    }

    /// The message is on the wire: dropped before [`Turn::finish`], its
    /// key stays held.
    pub fn sent(&mut self) {
        self.sent = true;
    }

    /// The message's answer is final: updates its key and lets the next go.
    pub fn finish(mut self, outcome: Outcome) {
        self.sent = false;
        self.order.finished(&self, outcome);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if self.sent {
            self.order.unsettled(&self.key, &self.id);
        }
        let _ = self.done.send(true);
        let mut keys = self.order.keys();
        if keys
            .tails
            .get(&self.key)
            .is_some_and(|t| t.turn == self.number)
        {
            keys.tails.remove(&self.key);
        }
    }
}

/// Whether `a` was created before `b`: both ObjectIds, `a` the smaller.
pub(crate) fn earlier(a: &Bson, b: &Bson) -> bool {
    matches!((a, b), (Bson::ObjectId(a), Bson::ObjectId(b)) if a < b)
}

/// When a message was created, from its ObjectId; now for any other id.
fn created(id: &Bson) -> DateTime {
    match id {
        Bson::ObjectId(id) => id.timestamp(),
        _ => DateTime::now(),
    }
}

#[cfg(test)]
mod tests;
