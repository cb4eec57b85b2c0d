//! Publishing the missing messages again, as the relay sent them.
//!
//! Each is read from the outbox and decoded with the relay's rules (its
//! subject, template, allow-list and headers), then published with its own
//! `Nats-Msg-Id`, in commit order, one at a time, each after the answer to
//! the one before: a consumer that handled it before the stream lost it
//! knows it by that id and skips it. No document is changed.
//!
//! JetStream drops a message whose id it still remembers (stored within
//! the duplicate window, then deleted): the answer says so. Such a message
//! is published again once the window has passed since it was processed,
//! and so is every later missing message of its key, to keep the key's
//! repaired messages in their order. Before it is, the streams are read
//! again for it: "remembered" may also mean stored, where an audit
//! misjudged it, and a repeat past the window would then be stored twice.
//! The waiting is bounded: what is still remembered at its end is
//! reported, to be repaired by a later run.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_nats::jetstream::Context;
use bson::oid::ObjectId;
use bson::{doc, DateTime, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::compare::Missing;
use super::pace::Pace;
use super::read_again;
use super::stream::CapturingStream;
use crate::contract::{field, DecodeRules, OutboxMessage};
use crate::error::{Error, Result};
use crate::publish::{PublishError, Publisher};
use crate::time::{later, shown, until};

/// Documents read from the outbox at a time.
const READ_BATCH: usize = 256;

/// How often a wait for JetStream to forget ids says how it goes.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// How long after its estimated time a message JetStream still
/// remembered is asked again: the estimate (a window after it was marked
/// processed) is late, never early, unless the server's clock is behind.
const ASKED_AGAIN: Duration = Duration::from_secs(1);

/// What a repair did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Repaired {
    /// How it ended.
    pub ended: RepairEnd,
    /// Published again and stored.
    pub published: u64,
    /// Of those, stored only after waiting for JetStream to forget its id
    /// (or the id of an earlier message of its key).
    pub after_waiting: u64,
    /// Not published: the id is still remembered past the wait allowed.
    pub still_remembered: u64,
    /// Not published: found in a stream after all, when read again.
    pub found_stored: u64,
    /// Not published: the outbox no longer holds it (deleted since).
    pub gone: u64,
    /// Not published: the message cannot be sent now; why, by id.
    pub unsendable: Vec<Unsendable>,
}

/// How a repair ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairEnd {
    /// Every missing message was published, or given up on for a reason
    /// the report gives.
    #[default]
    Done,
    /// Stopped by a signal: what was published is counted, the rest not.
    Stopped,
}

/// A missing message the repair could not send.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unsendable {
    pub id: String,
    pub reason: String,
}

/// Where a repair publishes, and how.
pub struct Repair<'a> {
    pub outbox: &'a Collection<bson::Document>,
    pub rules: &'a DecodeRules,
    pub publisher: &'a dyn Publisher,
    /// Where a message JetStream says it remembers is looked for again.
    pub js: &'a Context,
    pub streams: &'a [CapturingStream],
    /// How fast those reads go.
    pub read_pace: Pace,
    /// Where they begin for a message that says not when it was
    /// processed: the audited window's start (None: the streams' first).
    pub window_from: Option<DateTime>,
    /// The longest duplicate window of the streams.
    pub duplicate_window: Duration,
    /// The least time between two sends (`--rate`).
    pub pace: Option<Duration>,
    /// The longest a repair waits for JetStream to forget ids.
    pub wait: Duration,
}

/// A message to send, and when it may be.
#[derive(Debug, Clone, Copy)]
struct Due {
    missing: Missing,
    waiting: Waiting,
}

/// Why a message is not sent yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// It is not: it goes in its turn.
    No,
    /// JetStream dropped it as a duplicate: until it forgets the id.
    Remembered { until: DateTime },
    /// An earlier message of its key waits: as long as that one.
    BehindKey { until: DateTime },
}

impl Waiting {
    fn until(self) -> Option<DateTime> {
        match self {
            Waiting::No => None,
            Waiting::Remembered { until } | Waiting::BehindKey { until } => Some(until),
        }
    }
}

/// How a wait for the next due message ended.
enum Waited {
    Due,
    /// The next is due past the wait allowed.
    PastLimit,
    Stopped,
}

/// How JetStream answered a publish.
enum Answered {
    Stored,
    /// It remembers the id and dropped the message.
    Duplicate,
}

impl Repair<'_> {
    /// Publishes `missing` (in `_id` order) again.
    pub async fn run(&self, missing: &[Missing], stop: &CancellationToken) -> Result<Repaired> {
        let mut repaired = Repaired::default();
        let mut queue: Vec<Due> = missing
            .iter()
            .map(|&missing| Due {
                missing,
                waiting: Waiting::No,
            })
            .collect();
        let mut waited = Duration::ZERO;
        let mut round = 0;
        while !queue.is_empty() {
            if round > 0 {
                match self.wait_for(&queue, &mut waited, stop).await {
                    Waited::Due => {}
                    Waited::PastLimit => {
                        repaired.still_remembered = queue.len() as u64;
                        break;
                    }
                    Waited::Stopped => {
                        repaired.ended = RepairEnd::Stopped;
                        break;
                    }
                }
            }
            let now = DateTime::now();
            let (mut ready, later): (Vec<Due>, Vec<Due>) = queue
                .into_iter()
                .partition(|due| due.waiting.until().is_none_or(|until| until <= now));
            queue = later;
            if round > 0 {
                ready = self.not_stored(ready, &mut repaired).await?;
            }
            let dropped = self.send(&ready, &mut repaired, stop).await?;
            if stop.is_cancelled() {
                repaired.ended = RepairEnd::Stopped;
                break;
            }
            queue.extend(dropped);
            queue.sort_by_key(|due| due.missing.id);
            round += 1;
        }
        Ok(repaired)
    }

    /// Sends `ready` in order; returns those JetStream dropped as
    /// duplicates, and those of their keys after them, with when to try.
    async fn send(
        &self,
        ready: &[Due],
        repaired: &mut Repaired,
        stop: &CancellationToken,
    ) -> Result<Vec<Due>> {
        let mut dropped = Vec::new();
        let mut held_keys: HashMap<String, DateTime> = HashMap::new();
        for chunk in ready.chunks(READ_BATCH) {
            let documents = self.read(chunk).await?;
            for due in chunk {
                if stop.is_cancelled() {
                    return Ok(dropped);
                }
                let Some(document) = documents.get(&due.missing.id) else {
                    // Deleted since the audit (retention, a discard):
                    // nothing to restore.
                    repaired.gone += 1;
                    continue;
                };
                let decoded = self.rules.decode_raw(document);
                let message = match decoded.message {
                    Ok(message) => message,
                    Err(violation) => {
                        let reason = format!("it breaks the outbox contract now: {violation}");
                        repaired.unsendable.push(unsendable(due, reason));
                        continue;
                    }
                };
                if let Some(until) = decoded.key.as_ref().and_then(|k| held_keys.get(k)) {
                    let waiting = Waiting::BehindKey { until: *until };
                    dropped.push(Due { waiting, ..*due });
                    continue;
                }
                if let Some(pace) = self.pace {
                    tokio::time::sleep(pace).await;
                }
                match self.publish(&message).await {
                    Ok(Answered::Stored) => {
                        repaired.published += 1;
                        if due.waiting != Waiting::No {
                            repaired.after_waiting += 1;
                        }
                    }
                    Ok(Answered::Duplicate) => {
                        let until = self.forgotten_after(due);
                        if let Some(key) = decoded.key {
                            held_keys.insert(key, until);
                        }
                        let waiting = Waiting::Remembered { until };
                        dropped.push(Due { waiting, ..*due });
                    }
                    // This message's own: its subject is taken by no
                    // stream now, or it is refused.
                    Err(PublishError::Invalid(violation)) => {
                        repaired
                            .unsendable
                            .push(unsendable(due, violation.to_string()));
                    }
                    Err(PublishError::Refused(reason) | PublishError::Uncaptured(reason)) => {
                        let reason = format!("JetStream did not take it: {reason}");
                        repaired.unsendable.push(unsendable(due, reason));
                    }
                    Err(error @ PublishError::Unavailable(_)) => {
                        return Err(Error::Nats {
                            context: "publishing a missing message again failed; the repair \
                                      stopped, and a later run goes on"
                                .to_owned(),
                            source: error.to_string().into(),
                        })
                    }
                }
            }
        }
        Ok(dropped)
    }

    /// Publishes `message`, and says how JetStream answered.
    async fn publish(
        &self,
        message: &OutboxMessage,
    ) -> std::result::Result<Answered, PublishError> {
        let ack = self.publisher.send(message).await?.await?;
        Ok(match ack.duplicate {
            true => Answered::Duplicate,
            false => Answered::Stored,
        })
    }

    /// When JetStream forgets a message's id: a duplicate window after it
    /// was stored, which was before it was marked processed. One dropped
    /// again when that came is asked again a moment later.
    fn forgotten_after(&self, due: &Due) -> DateTime {
        let now = DateTime::now();
        let estimate = match (due.waiting, due.missing.processed_at) {
            (Waiting::No | Waiting::BehindKey { .. }, Some(processed)) => {
                later(processed, self.duplicate_window)
            }
            _ => later(now, ASKED_AGAIN),
        };
        estimate.max(later(now, ASKED_AGAIN))
    }

    /// The messages of `ready` no stream holds, read again from just
    /// before the first was processed (without a time, from the window's
    /// start).
    async fn not_stored(&self, ready: Vec<Due>, repaired: &mut Repaired) -> Result<Vec<Due>> {
        if ready.is_empty() {
            return Ok(ready);
        }
        let missing: Vec<Missing> = ready.iter().map(|due| due.missing).collect();
        let found = read_again(
            self.js,
            self.streams,
            &missing,
            self.window_from,
            self.read_pace,
        )
        .await?;
        let found: HashSet<ObjectId> = found.ids.into_iter().collect();
        let before = ready.len();
        let ready: Vec<Due> = ready
            .into_iter()
            .filter(|due| !found.contains(&due.missing.id))
            .collect();
        repaired.found_stored += (before - ready.len()) as u64;
        Ok(ready)
    }

    /// Waits until the first of `queue` is due, adding the time waited to
    /// `waited`.
    async fn wait_for(
        &self,
        queue: &[Due],
        waited: &mut Duration,
        stop: &CancellationToken,
    ) -> Waited {
        let Some(first) = queue.iter().filter_map(|due| due.waiting.until()).min() else {
            return Waited::Due;
        };
        let last = queue
            .iter()
            .filter_map(|due| due.waiting.until())
            .max()
            .unwrap_or(first);
        let first_due_in = until(DateTime::now(), first);
        if first_due_in.saturating_add(*waited) > self.wait {
            tracing::warn!(
                messages = queue.len(),
                until = %shown(last),
                "JetStream remembers the ids of missing messages past --repair-wait; repair them \
                 again after that time"
            );
            return Waited::PastLimit;
        }
        let started = tokio::time::Instant::now();
        loop {
            let left = first_due_in.saturating_sub(started.elapsed());
            if left.is_zero() {
                *waited += started.elapsed();
                return Waited::Due;
            }
            tracing::info!(
                messages = queue.len(),
                until = %shown(last),
                "waiting for JetStream to forget the ids of missing messages it dropped as \
                 duplicates"
            );
            tokio::select! {
                _ = stop.cancelled() => return Waited::Stopped,
                _ = tokio::time::sleep(left.min(PROGRESS_EVERY)) => {}
            }
        }
    }

    /// The documents of `chunk`, by id.
    async fn read(&self, chunk: &[Due]) -> Result<HashMap<ObjectId, RawDocumentBuf>> {
        let ids: HashSet<ObjectId> = chunk.iter().map(|due| due.missing.id).collect();
        let failed = |e| {
            Error::mongo("reading the missing messages failed", e)
                .needing("find", self.outbox.namespace())
        };
        let ids: Vec<ObjectId> = ids.into_iter().collect();
        let mut cursor = self
            .outbox
            .clone_with_type::<RawDocumentBuf>()
            .find(doc! { field::ID: { "$in": ids } })
            .await
            .map_err(failed)?;
        let mut documents = HashMap::with_capacity(chunk.len());
        while let Some(document) = cursor.try_next().await.map_err(failed)? {
            if let Ok(id) = document.get_object_id(field::ID) {
                documents.insert(id, document);
            }
        }
        Ok(documents)
    }
}

fn unsendable(due: &Due, reason: String) -> Unsendable {
    Unsendable {
        id: due.missing.id.to_hex(),
        reason,
    }
}
