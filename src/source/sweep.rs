//! The sweep: the slow path that makes the collection, not the stream, the
//! source of truth.
//!
//! Each pass claims a batch of pending messages that are due and not held
//! by a live claim, publishes them, and completes them matching its claim,
//! so a processor that lost a message to another cannot write over its
//! state. Claims are conditional updates on `lockId`/`lockedAt`; a claim
//! older than the lock timeout is stale and may be taken over. Passes run
//! one after another in a single task, never two at once; a pass that comes
//! back full is followed at once by the next, so a backlog drains without
//! waiting for the interval.
//!
//! A pass looks in two places, each an index range on
//! `{status, nextAttemptAt, _id}` read in the index's order: messages never
//! tried (`nextAttemptAt` missing) that are older than the grace period,
//! which leaves the change stream time to deliver them first; and messages
//! whose retry is due. The read names only indexed fields, so any planner
//! serves it from the index; whether a candidate is free (unclaimed, or
//! claimed longer ago than the lock timeout) is decided by the claim's
//! conditional update, which is the authority anyway.

use std::collections::HashSet;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use futures::TryStreamExt;
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status, DecodeRules};
use crate::error::{Error, Result};
use crate::pipeline::{Pipeline, Tally, Work};
use crate::retry::Outage;

/// Runs sweep passes over one outbox collection.
#[derive(Clone)]
pub struct Sweeper {
    pub(crate) rules: DecodeRules,
    pub(crate) pipeline: Pipeline,
    pub(crate) batch_size: usize,
    pub(crate) lock_timeout: Duration,
    /// Never-tried messages younger than this are left to the change stream.
    pub(crate) grace_period: Duration,
}

/// The result of one pass.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// What became of the claimed messages.
    pub tally: Tally,
    /// How many messages the pass claimed.
    pub claimed: u64,
    /// The pass claimed a whole batch: more may be waiting.
    pub full: bool,
}

impl Sweeper {
    /// Runs passes until shutdown: at once again after a full pass, else
    /// after `interval`.
    pub(crate) async fn run(self, interval: Duration, shutdown: CancellationToken) {
        let mut outage = Outage::new("MongoDB sweep");
        while !shutdown.is_cancelled() {
            let full = match self.pass().await {
                Ok(pass) => {
                    outage.recovered();
                    if pass.claimed > 0 {
                        tracing::debug!(?pass, "sweep pass");
                    }
                    pass.full
                }
                Err(error) => {
                    outage.failed(&error);
                    false
                }
            };
            if !full {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        }
    }

    /// Passes until one comes back short of a full batch: everything due now
    /// is handled. For `outbox-relay sweep --once`.
    pub async fn drain(&self) -> Result<Tally> {
        let mut tally = Tally::default();
        loop {
            let pass = self.pass().await?;
            tally += pass.tally;
            if !pass.full {
                return Ok(tally);
            }
        }
    }

    /// One pass: claim, publish, complete, release what was not completed.
    pub async fn pass(&self) -> Result<Pass> {
        let claim = ObjectId::new();
        let now = DateTime::now();
        let [never_tried, retry_due] = candidate_queries(now, self.grace_period);
        let mut documents = self.claim(never_tried, claim, now, self.batch_size).await?;
        let room = self.batch_size - documents.len();
        if room > 0 {
            documents.extend(self.claim(retry_due, claim, now, room).await?);
        }
        let claimed = documents.len() as u64;
        if claimed == 0 {
            return Ok(Pass::default());
        }
        let running = self.pipeline.start(None);
        for document in &documents {
            let work = Work::from_collection(self.rules.decode(document), Some(claim));
            if running.input.send(work).await.is_err() {
                break;
            }
        }
        drop(running.input);
        let tally = running
            .done
            .await
            .map_err(|e| Error::Config(format!("a sweep pass stopped unexpectedly: {e}")))?;
        if tally.total() < claimed {
            self.release(claim).await?;
        }
        Ok(Pass {
            tally,
            claimed,
            full: documents.len() == self.batch_size,
        })
    }

    /// Claims up to `limit` documents matching `filter` that no live claim
    /// holds, and returns those this claim got.
    async fn claim(
        &self,
        (mut filter, sort): (Document, Document),
        claim: ObjectId,
        now: DateTime,
        limit: usize,
    ) -> Result<Vec<Document>> {
        let candidates: Vec<Document> = self
            .pipeline
            .outbox
            .find(filter.clone())
            .sort(sort)
            .limit(i64::try_from(limit).unwrap_or(i64::MAX))
            .await
            .map_err(|e| Error::mongo("sweep: reading due messages failed", e))?
            .try_collect()
            .await
            .map_err(|e| Error::mongo("sweep: reading due messages failed", e))?;
        if candidates.is_empty() {
            return Ok(candidates);
        }
        let ids: Vec<Bson> = candidates
            .iter()
            .filter_map(|d| d.get(field::ID).cloned())
            .collect();
        filter.insert(field::ID, doc! { "$in": &ids });
        filter.insert(
            field::LOCKED_AT,
            doc! { "$not": { "$gte": before(now, self.lock_timeout) } },
        );
        let claimed = self
            .pipeline
            .outbox
            .update_many(
                filter,
                doc! { "$set": { field::LOCK_ID: claim, field::LOCKED_AT: now } },
            )
            .await
            .map_err(|e| Error::mongo("sweep: claiming messages failed", e))?;
        if claimed.modified_count == candidates.len() as u64 {
            return Ok(candidates);
        }
        self.only_ours(candidates, ids, claim).await
    }

    /// Keeps the candidates this claim holds (others took the rest).
    async fn only_ours(
        &self,
        candidates: Vec<Document>,
        ids: Vec<Bson>,
        claim: ObjectId,
    ) -> Result<Vec<Document>> {
        let ours: HashSet<ObjectId> = self
            .pipeline
            .outbox
            .find(doc! { field::ID: { "$in": ids }, field::LOCK_ID: claim })
            .projection(doc! { field::ID: 1 })
            .await
            .map_err(|e| Error::mongo("sweep: reading claims failed", e))?
            .try_collect::<Vec<Document>>()
            .await
            .map_err(|e| Error::mongo("sweep: reading claims failed", e))?
            .iter()
            .filter_map(|d| d.get_object_id(field::ID).ok())
            .collect();
        Ok(candidates
            .into_iter()
            .filter(|d| {
                d.get_object_id(field::ID)
                    .is_ok_and(|id| ours.contains(&id))
            })
            .collect())
    }

    /// Drops this claim from messages it did not complete (the broker was
    /// down at shutdown), so others need not wait for the lock timeout.
    async fn release(&self, claim: ObjectId) -> Result<()> {
        self.pipeline
            .outbox
            .update_many(
                doc! { field::LOCK_ID: claim, field::STATUS: status::PENDING },
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| Error::mongo("sweep: releasing claims failed", e))?;
        Ok(())
    }
}

/// The sweep's two candidate reads, as `(filter, sort)`: never-tried
/// messages older than `grace_period`, then retries due at `now`. Each is a
/// range of the sweep index, sorted in its order.
pub fn candidate_queries(now: DateTime, grace_period: Duration) -> [(Document, Document); 2] {
    let mut never_tried = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: Bson::Null,
    };
    // ObjectIds count whole seconds, so a bound would hold back the current
    // second's messages even with no grace period at all.
    if !grace_period.is_zero() {
        never_tried.insert(
            field::ID,
            doc! { "$lt": object_id_at(before(now, grace_period)) },
        );
    }
    let retry_due = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$lte": now },
    };
    let order = doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 };
    [(never_tried, order.clone()), (retry_due, order)]
}

fn before(now: DateTime, age: Duration) -> DateTime {
    let millis = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
    DateTime::from_millis(now.timestamp_millis().saturating_sub(millis))
}

/// The smallest ObjectId of the second `time` falls in: every id generated
/// before that second sorts below it.
fn object_id_at(time: DateTime) -> ObjectId {
    let seconds = u32::try_from(time.timestamp_millis().div_euclid(1000)).unwrap_or(0);
    let mut bytes = [0u8; 12];
    bytes[..4].copy_from_slice(&seconds.to_be_bytes());
    ObjectId::from_bytes(bytes)
}
