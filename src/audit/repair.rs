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
//! repaired messages in their order. The wait is bounded: what is still
//! remembered at its end is reported, to be repaired by a later run.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::oid::ObjectId;
use bson::{doc, DateTime, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::compare::Missing;
use crate::contract::{field, DecodeRules};
use crate::error::{Error, Result};
use crate::publish::{PublishError, Publisher};
use crate::time::later;

/// Documents read from the outbox at a time.
const READ_BATCH: usize = 256;

/// How often a wait for JetStream to forget ids says how it goes.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What a repair did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Repaired {
    /// Published again and stored.
    pub published: u64,
    /// Of those, stored only after waiting for JetStream to forget the id.
    pub after_waiting: u64,
    /// Not published: the id is still remembered past the wait allowed.
    pub still_remembered: u64,
    /// Not published: the message cannot be sent now; why, by id.
    pub unsendable: Vec<Unsendable>,
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
    /// Set once JetStream dropped it as a duplicate.
    after: Option<DateTime>,
}

impl Repair<'_> {
    /// Publishes `missing` (in `_id` order) again.
    pub async fn run(&self, missing: &[Missing], stop: &CancellationToken) -> Result<Repaired> {
        let mut repaired = Repaired::default();
        let mut queue: Vec<Due> = missing
            .iter()
            .map(|&missing| Due {
                missing,
                after: None,
            })
            .collect();
        let waited_since = tokio::time::Instant::now();
        let mut round = 0;
        while !queue.is_empty() {
            if round > 0 && !self.wait_for(&queue, waited_since, stop).await {
                repaired.still_remembered = queue.len() as u64;
                break;
            }
            let now = DateTime::now();
            let (ready, later): (Vec<Due>, Vec<Due>) = queue
                .into_iter()
                .partition(|due| due.after.is_none_or(|after| after <= now));
            queue = later;
            let dropped = self.send(&ready, round > 0, &mut repaired).await?;
            queue.extend(dropped);
            queue.sort_by_key(|due| due.missing.id);
            round += 1;
        }
        Ok(repaired)
    }

    /// Sends `ready` in order; returns those JetStream dropped as
    /// duplicates, and those of their keys after them, with when to try.
    async fn send(&self, ready: &[Due], waited: bool, repaired: &mut Repaired) -> Result<Vec<Due>> {
        let mut dropped = Vec::new();
        let mut held_keys: HashMap<String, DateTime> = HashMap::new();
        for chunk in ready.chunks(READ_BATCH) {
            let documents = self.read(chunk).await?;
            for due in chunk {
                let Some(document) = documents.get(&due.missing.id) else {
                    // Deleted since the audit (retention, a discard):
                    // nothing to restore.
                    continue;
                };
                let decoded = self.rules.decode_raw(document);
                let message = match decoded.message {
                    Ok(message) => message,
                    Err(violation) => {
                        repaired.unsendable.push(Unsendable {
                            id: due.missing.id.to_hex(),
                            reason: format!("it breaks the outbox contract now: {violation}"),
                        });
                        continue;
                    }
                };
                if let Some(after) = decoded.key.as_ref().and_then(|k| held_keys.get(k)) {
                    dropped.push(Due {
                        missing: due.missing,
                        after: Some(*after),
                    });
                    continue;
                }
                if let Some(pace) = self.pace {
                    tokio::time::sleep(pace).await;
                }
                match self.publish(&message).await {
                    Ok(false) => {
                        repaired.published += 1;
                        if waited {
                            repaired.after_waiting += 1;
                        }
                    }
                    Ok(true) => {
                        let after = self.forgotten_after(due);
                        if let Some(key) = decoded.key {
                            held_keys.insert(key, after);
                        }
                        dropped.push(Due {
                            missing: due.missing,
                            after: Some(after),
                        });
                    }
                    Err(PublishError::Invalid(violation)) => {
                        repaired.unsendable.push(Unsendable {
                            id: due.missing.id.to_hex(),
                            reason: violation.to_string(),
                        });
                    }
                    Err(PublishError::Refused(reason)) => {
                        repaired.unsendable.push(Unsendable {
                            id: due.missing.id.to_hex(),
                            reason: format!("JetStream refused it: {reason}"),
                        });
                    }
                    Err(error) => {
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

    /// Publishes `message`; whether JetStream dropped it as a duplicate.
    async fn publish(
        &self,
        message: &crate::contract::OutboxMessage,
    ) -> std::result::Result<bool, PublishError> {
        let ack = self.publisher.send(message).await?.await?;
        Ok(ack.duplicate)
    }

    /// When JetStream forgets a message's id: a duplicate window after it
    /// was stored, which was before it was marked processed. Asked again,
    /// a second on.
    fn forgotten_after(&self, due: &Due) -> DateTime {
        let now = DateTime::now();
        let estimate = match (due.after, due.missing.processed_at) {
            (None, Some(processed)) => later(processed, self.duplicate_window),
            _ => later(now, Duration::from_secs(1)),
        };
        if estimate <= now {
            later(now, Duration::from_secs(1))
        } else {
            estimate
        }
    }

    /// Waits until the first of `queue` is due; false if that is past the
    /// wait allowed, or the run is stopped.
    async fn wait_for(
        &self,
        queue: &[Due],
        since: tokio::time::Instant,
        stop: &CancellationToken,
    ) -> bool {
        let Some(first) = queue.iter().filter_map(|due| due.after).min() else {
            return true;
        };
        let last = queue
            .iter()
            .filter_map(|due| due.after)
            .max()
            .unwrap_or(first);
        let until = Duration::from_millis(
            u64::try_from(first.timestamp_millis() - DateTime::now().timestamp_millis())
                .unwrap_or(0),
        );
        if since.elapsed() + until > self.wait {
            tracing::warn!(
                messages = queue.len(),
                until = %shown(last),
                "JetStream remembers the ids of missing messages past --repair-wait; repair them \
                 again after that time"
            );
            return false;
        }
        let deadline = tokio::time::Instant::now() + until;
        loop {
            tracing::info!(
                messages = queue.len(),
                until = %shown(last),
                "waiting for JetStream to forget the ids of missing messages it dropped as \
                 duplicates"
            );
            let step = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .min(PROGRESS_EVERY);
            if step.is_zero() {
                return true;
            }
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = tokio::time::sleep(step) => {}
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

/// A moment as the report writes it.
pub(super) fn shown(at: DateTime) -> String {
    at.try_to_rfc3339_string()
        .unwrap_or_else(|_| at.timestamp_millis().to_string())
}
