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
//! A key may have several holders (a message older than the holder that
//! turns up later and is refused too, say): it starts releasing only once
//! the last has gone. Only a message whose `_id` is an ObjectId holds a
//! key, since only those can be found again by `_id` order.
//!
//! [`KeyOrder`] is that state for one leader's term, shared by every
//! pipeline of the term (the stream's and the sweep's), so that a key has
//! one queue however its messages were found. The state is a cache: holds
//! are facts in the collection (a retry scheduled, a parked message, a dead
//! letter marked `holdsKey`), read back when a term starts ([`stored`]) and
//! now and then since, so a new leader knows which keys are held.

pub(crate) mod stored;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use bson::{oid::ObjectId, Bson, DateTime};
use tokio::sync::{oneshot, watch, Notify};

use crate::config::DeadLetters;
use crate::observe::{HeldKeysReport, Metrics};

pub(crate) use stored::count_of;
pub use stored::{held_keys, HeldKey, Holder, PARKED};

/// Why a key is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKind {
    /// A holder was refused and waits for another attempt.
    Retrying,
    /// Its holders are dead letters, held by `--on-dead-letter hold` until
    /// they are replayed or discarded.
    DeadLetter,
    /// Its holders were delivered or let go; parked messages remain.
    Releasing,
}

/// One held key.
#[derive(Debug, Clone)]
struct Hold {
    /// The messages that must go before every other of the key, oldest
    /// first; empty once they have gone and the parked ones are being
    /// released.
    holders: Vec<(ObjectId, HoldKind)>,
    /// When the oldest message the key waits on was created.
    since: DateTime,
    /// Counts the holders taken on, so that a check against the collection
    /// lets go of none taken on again since it read.
    version: u64,
}

impl Hold {
    #[cfg(test)]
    fn kind(&self) -> HoldKind {
        let mut kinds = self.holders.iter().map(|(_, kind)| *kind);
        if self.holders.is_empty() {
            HoldKind::Releasing
        } else if kinds.any(|kind| kind == HoldKind::Retrying) {
            HoldKind::Retrying
        } else {
            HoldKind::DeadLetter
        }
    }

    fn position(&self, id: &ObjectId) -> Result<usize, usize> {
        self.holders.binary_search_by(|(held, _)| held.cmp(id))
    }
}

/// Park decisions for one key, and how many of them are written: a key is
/// free only once every parked message is in the collection, where a
/// release can find it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Parks {
    decided: u64,
    written: u64,
}

#[derive(Default)]
struct Keys {
    /// The last turn let in, per key: the one the next must wait for.
    tails: HashMap<String, u64>,
    /// Who waits for a turn to end, by the number of the turn waited for.
    successors: HashMap<u64, oneshot::Sender<()>>,
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
    /// The term's held keys in the relay's gauges, until the term ends.
    held_keys: HeldKeysReport,
    /// Whether the holds the collection recorded at the term's start are
    /// taken on: until then no message may take its turn, as a key the
    /// term has yet to learn is held would let it overtake the holder.
    stored_read: watch::Sender<bool>,
}

impl std::fmt::Debug for KeyOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyOrder").finish_non_exhaustive()
    }
}

/// Whether a message goes out, or is parked behind its key's holder (see
/// [`Turn::admit`]).
pub(crate) enum Admission {
    /// It goes: its turn goes on until its answer ends it.
    Send(Turn),
    /// It is parked: its turn is over (the key is held already, and the
    /// next message of the key may take its own), and what is left of it
    /// is the park, to be settled once written.
    Park(ParkTicket),
}

/// A park decided: counts as settled when dropped with the work that
/// carries it (see [its end](crate::work::Work#its-end)), once the verdict
/// is recorded (the park written, or found impossible) or given up with
/// the relay's stop. Until then its key cannot be freed, since a release
/// might read the collection before the park is in it.
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
    #[cfg(test)]
    pub fn new(
        held: Vec<HeldKey>,
        dead_letters: DeadLetters,
        chained: bool,
        metrics: Metrics,
    ) -> Self {
        let order = KeyOrder::unread(dead_letters, chained, metrics);
        order.adopt_stored(held);
        order
    }

    /// The order of a new term whose stored holds are still being read:
    /// the term's stages wait in [`KeyOrder::stored_holds_before`] until
    /// [`KeyOrder::adopt_stored`] is given them. Reading them beside the
    /// source's own start (its checkpoint, its count, its snapshot's first
    /// batch) spares a new leader a wait for that read before its source
    /// starts, a read of every pending message on a server whose planner
    /// reads the whole pending range for it.
    pub fn unread(dead_letters: DeadLetters, chained: bool, metrics: Metrics) -> Self {
        KeyOrder(Arc::new(Shared {
            keys: Mutex::new(Keys::default()),
            releasing: Notify::new(),
            dead_letters,
            chained,
            held_keys: metrics.held_keys_report(),
            stored_read: watch::Sender::new(false),
        }))
    }

    /// Takes on the holds the collection recorded at the term's start, and
    /// lets messages take their turns.
    pub fn adopt_stored(&self, held: Vec<HeldKey>) {
        self.adopt(held);
        self.0.stored_read.send_replace(true);
    }

    /// Whether the holds the collection recorded at the term's start are
    /// taken on.
    pub fn stored_holds_adopted(&self) -> bool {
        *self.0.stored_read.borrow()
    }

    /// Waits until the holds the collection recorded at the term's start
    /// are taken on, or `stop` comes first; true if they are. Holds known
    /// win over a stop that comes at the same time: a sweep pass that
    /// claimed its messages then delivers them rather than dropping them.
    pub async fn stored_holds_before(&self, stop: impl Future<Output = ()>) -> bool {
        let mut read = self.0.stored_read.subscribe();
        tokio::select! {
            biased;
            // The sender lives as long as `self`, so the wait cannot fail.
            _ = read.wait_for(|read| *read) => true,
            () = stop => false,
        }
    }

    /// Takes on the holds the collection records for keys this order does
    /// not hold: at a term's start, and later for a write that landed after
    /// the term's first read (a former leader's, delayed). Returns how many
    /// keys it took on.
    pub fn adopt(&self, held: Vec<HeldKey>) -> usize {
        let mut keys = self.keys();
        let mut adopted = 0;
        for held in held {
            if keys.holds.contains_key(&held.key) {
                continue;
            }
            let holders = held
                .holders
                .iter()
                .filter(|h| !h.dead_letter || self.0.dead_letters == DeadLetters::Hold)
                .map(|h| match h.dead_letter {
                    true => (h.id, HoldKind::DeadLetter),
                    false => (h.id, HoldKind::Retrying),
                })
                .collect();
            let hold = Hold {
                holders,
                since: held.since,
                version: 0,
            };
            if hold.holders.is_empty() && held.parked == 0 {
                continue;
            }
            if hold.holders.is_empty() {
                self.0.releasing.notify_one();
            }
            keys.holds.insert(held.key, hold);
            adopted += 1;
        }
        self.report(&keys);
        adopted
    }

    fn keys(&self) -> MutexGuard<'_, Keys> {
        // The state is a cache of facts in MongoDB; a panic elsewhere while
        // it was held leaves nothing half-written that matters here.
        self.0.keys.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn report(&self, keys: &Keys) {
        let oldest = keys.holds.values().map(|h| h.since).min();
        self.0.held_keys.set(keys.holds.len(), oldest);
    }

    /// Lets a message of `key` in line: it goes after every message of the
    /// key let in before it. `release` marks a parked message read back to
    /// be released.
    pub fn enter(&self, key: &str, id: &Bson, release: bool) -> Turn {
        let mut keys = self.keys();
        keys.turns += 1;
        let number = keys.turns;
        let before = if self.0.chained {
            let previous = match keys.tails.get_mut(key) {
                Some(tail) => Some(std::mem::replace(tail, number)),
                None => {
                    keys.tails.insert(key.to_owned(), number);
                    None
                }
            };
            previous.map(|previous| {
                let (done, wait) = oneshot::channel();
                keys.successors.insert(previous, done);
                wait
            })
        } else {
            None
        };
        Turn {
            order: self.clone(),
            key: key.to_owned(),
            id: id.clone(),
            release,
            number,
            before,
            ended: false,
        }
    }

    /// Whether a message may go now: the key is free, the message is one
    /// holding it or older than all that do (then it came first, and either
    /// is stored already, a repeat JetStream drops, or must go first), or
    /// the key is releasing and this is a parked message.
    fn admits(keys: &Keys, turn: &Turn) -> bool {
        match keys.holds.get(&turn.key) {
            None => true,
            Some(hold) => match (hold.holders.first(), &turn.id) {
                (None, _) => turn.release,
                (Some((first, _)), Bson::ObjectId(id)) => id < first || hold.position(id).is_ok(),
                (Some(_), _) => false,
            },
        }
    }

    /// Parks the message of `turn` unless [`KeyOrder::admits`] it; `None`
    /// if it goes. Decided and counted under one lock, so that no release
    /// comes between the decision and the park it must wait for. A parked
    /// message's turn ends here: its key is held already.
    fn park_unless_admitted(&self, turn: &Turn) -> Option<ParkTicket> {
        let mut keys = self.keys();
        if Self::admits(&keys, turn) {
            return None;
        }
        keys.parks.entry(turn.key.clone()).or_default().decided += 1;
        Self::pass_on(&mut keys, turn);
        Some(ParkTicket {
            order: self.clone(),
            key: turn.key.clone(),
        })
    }

    /// Ends a turn: records what its message's answer means for its key
    /// (`None`: it has none, and may yet be stored, or was never sent
    /// though its turn had come), and lets the next message of the key go.
    fn end(&self, turn: &Turn, outcome: Option<Outcome>) {
        let mut keys = self.keys();
        let dead_letters = self.0.dead_letters;
        let changed = match outcome {
            Some(Outcome::Delivered) => self.let_go(&mut keys, &turn.key, &turn.id),
            Some(Outcome::Failed) if dead_letters == DeadLetters::Release => {
                self.let_go(&mut keys, &turn.key, &turn.id)
            }
            Some(Outcome::Failed) => {
                self.hold(&mut keys, &turn.key, &turn.id, HoldKind::DeadLetter)
            }
            Some(Outcome::Refused) | None => {
                self.hold(&mut keys, &turn.key, &turn.id, HoldKind::Retrying)
            }
        };
        Self::pass_on(&mut keys, turn);
        if changed {
            self.report(&keys);
        }
    }

    /// Lets the message after `turn` of its key go.
    fn pass_on(keys: &mut Keys, turn: &Turn) {
        if keys.tails.get(&turn.key) == Some(&turn.number) {
            keys.tails.remove(&turn.key);
        }
        if let Some(next) = keys.successors.remove(&turn.number) {
            let _ = next.send(());
        }
    }

    /// Holds `key` by `id` as `kind` (a holder's kind is replaced). Only an
    /// ObjectId holds a key. Returns whether anything changed.
    fn hold(&self, keys: &mut Keys, key: &str, id: &Bson, kind: HoldKind) -> bool {
        let Bson::ObjectId(id) = id else {
            return false;
        };
        let hold = keys.holds.entry(key.to_owned()).or_insert_with(|| Hold {
            holders: Vec::new(),
            since: id.timestamp(),
            version: 0,
        });
        hold.since = hold.since.min(id.timestamp());
        hold.version += 1;
        match hold.position(id) {
            Ok(at) => hold.holders[at].1 = kind,
            Err(at) => hold.holders.insert(at, (*id, kind)),
        }
        true
    }

    /// `id` no longer holds `key`; once none does, the key starts
    /// releasing. Returns whether anything changed.
    fn let_go(&self, keys: &mut Keys, key: &str, id: &Bson) -> bool {
        let (Some(hold), Bson::ObjectId(id)) = (keys.holds.get_mut(key), id) else {
            return false;
        };
        let Ok(at) = hold.position(id) else {
            return false;
        };
        hold.holders.remove(at);
        if hold.holders.is_empty() {
            self.0.releasing.notify_one();
        }
        true
    }

    /// A dead letter, decided where the verdict was recorded: holds its
    /// key where its document says so (`holdsKey`, written under
    /// `--on-dead-letter hold`), and lets go of it otherwise, so that a new
    /// leader, which reads the holds from the collection, holds the same.
    pub fn dead_letter(&self, key: &str, id: &Bson, holds: bool) {
        let mut keys = self.keys();
        let changed = if holds {
            self.hold(&mut keys, key, id, HoldKind::DeadLetter)
        } else {
            self.let_go(&mut keys, key, id)
        };
        if changed {
            self.report(&keys);
        }
    }

    /// Whether a dead letter holds its key (`--on-dead-letter hold`).
    pub fn dead_letters_hold(&self) -> bool {
        self.0.dead_letters == DeadLetters::Hold
    }

    /// Releases `key` from `id`: it was settled out of this relay's sight
    /// (delivered, replayed, discarded, or found to take no write at all),
    /// as a read found when the key's hold was at `version` (see
    /// [`KeyOrder::holders`]). A holder taken on since (a copy of the
    /// message refused meanwhile) is kept.
    pub fn let_go_of(&self, key: &str, id: &Bson, version: u64) {
        let mut keys = self.keys();
        if keys
            .holds
            .get(key)
            .is_some_and(|hold| hold.version != version)
        {
            return;
        }
        if self.let_go(&mut keys, key, id) {
            self.report(&keys);
        }
    }

    /// The messages holding keys, each with its key's hold version, for
    /// checking against the collection.
    pub fn holders(&self) -> Vec<(String, Bson, u64)> {
        let keys = self.keys();
        let holds = keys.holds.iter();
        holds
            .flat_map(|(key, hold)| {
                let ids = hold.holders.iter();
                ids.map(|(id, _)| (key.clone(), Bson::ObjectId(*id), hold.version))
            })
            .collect()
    }

    /// Up to `limit` releasing keys, each with its park decisions so far.
    pub fn releasing(&self, limit: usize) -> Vec<(String, Parks)> {
        let keys = self.keys();
        let releasing = keys.holds.iter().filter(|(_, h)| h.holders.is_empty());
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
        let releasing = keys.holds.get(key).is_some_and(|h| h.holders.is_empty());
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

    /// The held keys now, oldest first, each with its first holder: for
    /// tests.
    #[cfg(test)]
    pub fn held(&self) -> Vec<(String, Option<Bson>, HoldKind)> {
        let keys = self.keys();
        let mut held: Vec<_> = keys
            .holds
            .iter()
            .map(|(k, h)| {
                let first = h.holders.first().map(|(id, _)| Bson::ObjectId(*id));
                (h.since, k.clone(), first, h.kind())
            })
            .collect();
        held.sort_by_key(|(since, key, ..)| (*since, key.clone()));
        held.into_iter()
            .map(|(_, k, h, kind)| (k, h, kind))
            .collect()
    }
}

/// A message's place in its key's line. Ended on purpose in one of two
/// ways, each taking the turn: [`Turn::admit`] parks the message (its key
/// is held already), or [`Turn::finish`] records the message's answer.
/// Dropped without either (the relay stopped at once while the message was
/// in doubt or still waiting, a task was cancelled), it holds its key for
/// the rest of the term, since the message may yet be stored, or must go
/// first: the key is never left free behind a message whose fate is not
/// known.
pub(crate) struct Turn {
    order: KeyOrder,
    key: String,
    id: Bson,
    release: bool,
    number: u64,
    /// Ends when the message before it of its key has its answer.
    before: Option<oneshot::Receiver<()>>,
    /// Set as the turn is ended on purpose, just before it is dropped, so
    /// that the drop has nothing left to do.
    ended: bool,
}

impl Turn {
    /// Whether the message goes at once: nothing of its key is before it.
    pub fn first(&mut self) -> bool {
        match &mut self.before {
            None => true,
            Some(before) => {
                // A sender dropped (the term is over) ends the wait too.
                let done = !matches!(before.try_recv(), Err(oneshot::error::TryRecvError::Empty));
                if done {
                    self.before = None;
                }
                done
            }
        }
    }

    /// Waits until the message before it of its key has had its answer.
    pub async fn wait(&mut self) {
        if let Some(before) = self.before.take() {
            let _ = before.await;
        }
    }

    /// Sends the message or parks it; asked once the wait is over. Sent,
    /// the turn is handed back, for its answer to end; parked, the turn
    /// ends here and becomes the park's ticket (see [`Admission`]).
    pub fn admit(mut self) -> Admission {
        match self.order.park_unless_admitted(&self) {
            None => Admission::Send(self),
            Some(ticket) => {
                self.ended = true;
                Admission::Park(ticket)
            }
        }
    }

    /// The message's answer is final: updates its key and lets the next go.
    pub fn finish(mut self, outcome: Outcome) {
        self.ended = true;
        self.order.end(&self, Some(outcome));
    }
}

/// The safety net for a turn not ended on purpose (see [`Turn`]).
impl Drop for Turn {
    fn drop(&mut self) {
        if !self.ended {
            self.order.end(self, None);
        }
    }
}

#[cfg(test)]
mod tests;
