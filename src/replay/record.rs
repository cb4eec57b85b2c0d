//! A replay's record in MongoDB: what it selects, where it sends, how far
//! it got, and which run holds it.
//!
//! The record is written before the first message goes out, and moved on
//! as acknowledgements come back in order: it says the last message that
//! every message before it was acknowledged with. An interrupted replay
//! (a stop, a failure, a crash) resumes after it; what went out beyond it
//! goes out again with the same `Nats-Msg-Id`, which JetStream drops
//! within its duplicate window.
//!
//! A run holds the record for [`HOLD`], renewed on a timer of its own
//! ([`Holding`]), and a run of the same replay is refused while another
//! holds it, so two never send at once; a crashed run's hold lapses on its
//! own, and a run that finds its hold taken stops. Holds are written and
//! judged on the database server's clock, as leases are
//! (`server_clock::server_time`): runs on hosts whose clocks disagree still agree
//! on when a hold lapses.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::selection::Selection;
use crate::error::{Error, Result};
use crate::server_clock::server_time;
use crate::time::later;

/// The collection replay records are kept in, beside the outbox.
pub const DEFAULT_COLLECTION: &str = "outbox_replays";

/// How long a run holds its record without writing progress.
pub(crate) const HOLD: Duration = Duration::from_secs(30);

/// The most types a record counts by name; the rest are counted together,
/// so that a record (and a run's memory) stays small whatever the types.
const MOST_TYPES: usize = 200;

/// The name the types beyond [`MOST_TYPES`] are counted under.
pub const OTHER_TYPES: &str = "(other types)";

/// Where a replay is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum State {
    /// A run is sending, or crashed while sending (its hold lapses).
    Running,
    /// A run stopped before the end (a stop, or a failure): resumable.
    Stopped,
    /// Every selected message was sent.
    Done,
}

/// How many messages of a type were sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeCount {
    #[serde(rename = "type")]
    pub message_type: String,
    pub sent: i64,
}

/// What a replay has done so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Every selected message up to this `_id` was sent and acknowledged.
    pub after: Option<ObjectId>,
    pub sent: i64,
    /// Selected messages that could not be sent (see `send`).
    pub skipped: i64,
    pub by_type: Vec<TypeCount>,
}

impl Progress {
    /// Counts one message of `message_type` sent.
    pub fn sent_one(&mut self, message_type: &str) {
        self.sent += 1;
        let named = match self
            .by_type
            .iter()
            .position(|t| t.message_type == message_type)
        {
            Some(found) => found,
            None if self.by_type.len() < MOST_TYPES => {
                self.by_type.push(TypeCount {
                    message_type: message_type.to_owned(),
                    sent: 0,
                });
                self.by_type.len() - 1
            }
            None => match self
                .by_type
                .iter()
                .position(|t| t.message_type == OTHER_TYPES)
            {
                Some(other) => other,
                None => {
                    self.by_type.push(TypeCount {
                        message_type: OTHER_TYPES.to_owned(),
                        sent: 0,
                    });
                    self.by_type.len() - 1
                }
            },
        };
        self.by_type[named].sent += 1;
    }
}

/// A replay as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The replay id.
    #[serde(rename = "_id")]
    pub id: String,
    /// The outbox it reads, as `database.collection`.
    pub outbox: String,
    pub selection: Selection,
    /// Sent under this prefix, or to the messages' own subjects.
    pub replay_prefix: Option<String>,
    pub state: State,
    /// The run that holds it.
    pub owner: String,
    pub held_until: DateTime,
    pub progress: Progress,
    pub created_at: DateTime,
    pub updated_at: DateTime,
}

/// A run's hold on its record, renewed every third of [`HOLD`] whatever
/// the run is waiting on (a slow read, an acknowledgement, its pace), until
/// dropped. Should another run take the replay (this one's renewals failed
/// for longer than the hold), `stop` is cancelled and [`Holding::lost`]
/// says so.
pub struct Holding {
    task: tokio::task::JoinHandle<()>,
    lost: Arc<AtomicBool>,
}

impl Holding {
    /// Whether another run took the replay.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The replay records of one database.
#[derive(Debug, Clone)]
pub struct Records {
    collection: Collection<Record>,
    owner: String,
}

impl Records {
    /// The records in `collection` of `database`, written as this run.
    pub fn new(database: &Database, collection: &str) -> Self {
        Records {
            collection: database.collection(collection),
            owner: crate::lease::owner_name(),
        }
    }

    /// A new replay of `outbox`, held by this run.
    pub async fn create(
        &self,
        outbox: String,
        selection: Selection,
        replay_prefix: Option<String>,
    ) -> Result<Record> {
        let now = self.server_time().await?;
        let record = Record {
            id: ObjectId::new().to_hex(),
            outbox,
            selection,
            replay_prefix,
            state: State::Running,
            owner: self.owner.clone(),
            held_until: later(now, HOLD),
            progress: Progress::default(),
            created_at: now,
            updated_at: now,
        };
        self.collection.insert_one(&record).await.map_err(|e| {
            Error::mongo("recording the replay failed", e)
                .needing("insert", self.collection.namespace())
        })?;
        Ok(record)
    }

    /// Takes up replay `id` of `outbox` again, unless it is done or another
    /// run holds it.
    pub async fn resume(&self, id: &str, outbox: &str) -> Result<Record> {
        let now = self.server_time().await?;
        let taken = self
            .collection
            .find_one_and_update(
                doc! {
                    "_id": id,
                    "outbox": outbox,
                    "state": { "$ne": "done" },
                    "$or": [{ "heldUntil": { "$lt": now } }, { "owner": &self.owner }],
                },
                doc! { "$set": {
                    "owner": &self.owner, "heldUntil": later(now, HOLD),
                    "state": "running", "updatedAt": now,
                } },
            )
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| {
                Error::mongo("taking up the replay failed", e)
                    .needing("update", self.collection.namespace())
            })?;
        match taken {
            Some(record) => Ok(record),
            None => Err(self.why_not_resumable(id, outbox).await?),
        }
    }

    /// Why replay `id` of `outbox` cannot be taken up.
    async fn why_not_resumable(&self, id: &str, outbox: &str) -> Result<Error> {
        let found = self
            .collection
            .find_one(doc! { "_id": id })
            .await
            .map_err(|e| {
                Error::mongo("reading the replay failed", e)
                    .needing("find", self.collection.namespace())
            })?;
        let why = match found {
            None => format!(
                "no replay {id:?} is recorded in {}: resume takes the id a replay printed",
                self.collection.name()
            ),
            Some(record) if record.outbox != outbox => format!(
                "replay {id:?} reads {}, not {outbox}: resume it with that outbox's settings",
                record.outbox
            ),
            Some(record) if record.state == State::Done => format!(
                "replay {id:?} is done (sent {}): there is nothing left to send; start a new \
                 replay to send its messages again",
                record.progress.sent
            ),
            Some(record) => format!(
                "replay {id:?} is running in another process ({}) until at least {}: two runs \
                 of one replay never send at once; stop that one, or wait for its hold to lapse \
                 if it crashed",
                record.owner,
                record
                    .held_until
                    .try_to_rfc3339_string()
                    .unwrap_or_default()
            ),
        };
        Ok(Error::Config(why))
    }

    /// Keeps this run's hold on replay `id` until the returned value is
    /// dropped; cancels `stop` if the hold is lost.
    pub fn hold(&self, id: &str, stop: CancellationToken) -> Holding {
        let (collection, owner, id) = (self.collection.clone(), self.owner.clone(), id.to_owned());
        let lost = Arc::new(AtomicBool::new(false));
        let said = lost.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(HOLD / 3);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let now = match server_time(collection.client()).await {
                    Ok(now) => now,
                    Err(error) => {
                        tracing::debug!(%error, "renewing the replay's hold failed");
                        continue;
                    }
                };
                let renewed = collection
                    .update_one(
                        doc! { "_id": &id, "owner": &owner, "state": "running" },
                        doc! { "$set": { "heldUntil": later(now, HOLD) } },
                    )
                    .await;
                match renewed {
                    Ok(renewed) if renewed.matched_count == 0 => {
                        said.store(true, Ordering::Release);
                        stop.cancel();
                        return;
                    }
                    Ok(_) => {}
                    // Tried again at the next tick: the hold lasts three.
                    Err(error) => tracing::debug!(%error, "renewing the replay's hold failed"),
                }
            }
        });
        Holding { task, lost }
    }

    /// Replay `id` of `outbox` as recorded, for a dry run of its rest.
    pub async fn peek(&self, id: &str, outbox: &str) -> Result<Record> {
        let found = self
            .collection
            .find_one(doc! { "_id": id, "outbox": outbox })
            .await
            .map_err(|e| {
                Error::mongo("reading the replay failed", e)
                    .needing("find", self.collection.namespace())
            })?;
        match found {
            Some(record) => Ok(record),
            None => Err(self.why_not_resumable(id, outbox).await?),
        }
    }

    /// Removes the record of a replay that sent nothing.
    pub async fn forget(&self, id: &str) -> Result<()> {
        self.collection
            .delete_one(doc! { "_id": id, "owner": &self.owner })
            .await
            .map_err(|e| {
                Error::mongo("removing the replay's record failed", e)
                    .needing("remove", self.collection.namespace())
            })?;
        Ok(())
    }

    /// Writes `progress`, and for a run that ended (`Stopped`, `Done`)
    /// gives up the hold; an error if another run has taken the replay
    /// meanwhile (this run's hold lapsed).
    pub async fn save(&self, id: &str, progress: &Progress, state: State) -> Result<()> {
        let now = DateTime::now();
        // Given up: before any moment a run will judge it at, on any clock.
        let lapsed = DateTime::from_millis(0);
        let progress = bson::to_bson(progress)
            .map_err(|e| Error::Internal(format!("a replay's progress as BSON: {e}")))?;
        let mut set = doc! {
            "progress": progress, "state": bson::to_bson(&state).unwrap_or_default(),
            "updatedAt": now,
        };
        // A running run's hold is [`Holding`]'s to renew; an ended one
        // gives it up.
        if state != State::Running {
            set.insert("heldUntil", lapsed);
        }
        let saved = self
            .collection
            .update_one(
                doc! { "_id": id, "owner": &self.owner },
                doc! { "$set": set },
            )
            .await
            .map_err(|e| {
                Error::mongo("recording the replay's progress failed", e)
                    .needing("update", self.collection.namespace())
            })?;
        if saved.matched_count == 0 {
            return Err(self.taken_over(id).await);
        }
        Ok(())
    }

    /// The error of a run whose replay `id` another run has taken over
    /// (this run's hold lapsed), saying what became of it and what is left
    /// to do.
    pub async fn taken_over(&self, id: &str) -> Error {
        let found = self.collection.find_one(doc! { "_id": id }).await;
        let now = match found {
            Ok(Some(record)) => match record.state {
                State::Running => format!(
                    "the other run ({}) is sending the rest: there is nothing to resume",
                    record.owner
                ),
                State::Done => format!("the other run ({}) has finished it", record.owner),
                State::Stopped => format!(
                    "the other run ({}) has stopped too: outbox-relay replay --resume {id} \
                     sends the rest",
                    record.owner
                ),
            },
            _ => format!(
                "what the other run does could not be read (its record is in {})",
                self.collection.name()
            ),
        };
        Error::TakenOver(format!(
            "replay {id:?} was taken over by another run, after this one could not renew its \
             hold for {}; this run stopped sending, and {now}",
            humantime::format_duration(HOLD)
        ))
    }

    /// The database server's clock, which judges holds.
    async fn server_time(&self) -> Result<DateTime> {
        server_time(self.collection.client()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_counted_by_name_up_to_a_bound_and_the_rest_together() {
        let mut progress = Progress::default();
        for n in 0..MOST_TYPES + 50 {
            progress.sent_one(&format!("type{n}"));
        }
        progress.sent_one("type0");
        assert_eq!(progress.sent, (MOST_TYPES + 51) as i64);
        assert_eq!(progress.by_type.len(), MOST_TYPES + 1);
        assert_eq!(progress.by_type[0].sent, 2);
        let other = progress.by_type.last().expect("the rest");
        assert_eq!((other.message_type.as_str(), other.sent), (OTHER_TYPES, 50));
    }
}
