//! Tending the keys the term's order holds back (see `crate::order`).
//!
//! After each pass the sweep takes on holds written out of the term's
//! sight (now and then: a former leader's write that landed late), lets go
//! of keys whose holder was settled out of its sight, and releases the
//! parked messages of releasing keys, one read at a time, in `_id` order.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bson::{doc, Bson, RawDocumentBuf};
use futures::TryStreamExt;
use tokio_util::sync::CancellationToken;

use super::claim::ReadEnd;
use super::gate::Kind;
use super::{due, raw_id, Sweeper};
use crate::contract::{field, status};
use crate::error::{Error, Result};
use crate::order::{held_keys, stored::parked_messages, KeyOrder, Parks, PARKED};
use crate::work::{id_key, Tally};

/// The most keys one release reads, and the most holders one read checks.
const RELEASE_KEYS: usize = 1000;

/// The most bytes of keys one release names, so that its query stays far
/// below MongoDB's 16 MiB, however long the keys.
const RELEASE_KEY_BYTES: usize = 1 << 20;

/// The releasing keys one read names: as many as fit [`RELEASE_KEY_BYTES`],
/// and always the first.
fn release_batch(mut releasing: Vec<(String, Parks)>) -> Vec<(String, Parks)> {
    let mut bytes = 0;
    let fits = releasing
        .iter()
        .take_while(|(key, _)| {
            bytes += key.len();
            bytes <= RELEASE_KEY_BYTES
        })
        .count();
    releasing.truncate(fits.max(1));
    releasing
}

impl Sweeper {
    /// Waits until the term's stored holds are taken on; false if the
    /// term ended first. The next reading of them is then an interval
    /// away. A stream source kept waiting for them until now (its pipeline
    /// sends nothing before) counts as moving from now: the wait is not a
    /// stall of its own, and the sweep must not take the never-tried
    /// messages the source is about to deliver.
    pub(crate) async fn await_stored_holds(&self, shutdown: &CancellationToken) -> bool {
        let Some(order) = self.pipeline.order() else {
            return true;
        };
        let kept_waiting = !order.stored_holds_adopted();
        if !order.stored_holds_before(shutdown.cancelled()).await {
            return false;
        }
        if let Ok(mut read) = self.holds_read.lock() {
            *read = Some(Instant::now());
        }
        if kept_waiting {
            self.progress.waited();
        }
        true
    }

    /// Reading the held keys back, if it is due: once per holds interval
    /// (a term starts having read them).
    fn reconcile_due(&self) -> bool {
        due(&self.holds_read, self.holds_interval())
    }

    /// How often the held keys are read back: every holds interval while
    /// a former leader's write may still land, then as a quiet read is
    /// (`time::quiet_interval`: a minute with the default), for a write
    /// held up in the network or a hold written by hand.
    pub(super) fn holds_interval(&self) -> Duration {
        if Instant::now() < self.late_writes_until {
            self.holds_interval
        } else {
            crate::time::quiet_interval(self.holds_interval)
        }
    }

    /// How long until reading the held keys back falls due; `None` where
    /// the term keeps no order, or has yet to take on its stored holds.
    pub(super) fn until_reconcile(&self) -> Option<Duration> {
        self.pipeline.order()?;
        let read = self.holds_read.lock().ok().and_then(|read| *read)?;
        Some(self.holds_interval().saturating_sub(read.elapsed()))
    }

    /// Tends the keys the term's order holds: takes on holds written out of
    /// its sight (now and then), lets go of keys whose holder was settled
    /// out of its sight, then releases one read's worth of the parked
    /// messages of releasing keys, in `_id` order. Returns what the release
    /// did, and whether another may find more; one read at a time, so that
    /// a long release never keeps the sweep's own passes waiting.
    pub(crate) async fn tend_keys(&self) -> Result<(Tally, bool)> {
        let Some(order) = self.pipeline.order() else {
            return Ok((Tally::default(), false));
        };
        if self.reconcile_due() {
            let held = held_keys(
                &self.pipeline.outbox,
                self.pipeline.partition,
                self.dead_letters,
            )
            .await;
            // The next reading is an interval after this one ends: one
            // slower than the interval is not followed at once by another.
            if let Ok(mut read) = self.holds_read.lock() {
                *read = Some(Instant::now());
            }
            let held = held?;
            let adopted = order.adopt(held);
            if adopted > 0 {
                tracing::warn!(
                    keys = adopted,
                    "found held keys this relay did not know of; holding them"
                );
            }
        }
        self.check_holders(order).await?;
        let releasing = release_batch(order.releasing(RELEASE_KEYS));
        if releasing.is_empty() || self.pipeline.shutdown.is_cancelled() {
            return Ok((Tally::default(), false));
        }
        let names: Vec<String> = releasing.iter().map(|(key, _)| key.clone()).collect();
        let swept = self
            .pass_over([(parked_messages(&names), true)], Kind::Release)
            .await?;
        // A key is free once a read that left nothing unread found no
        // parked message of it.
        let mut freed = false;
        if swept.sighted.end == ReadEnd::Exhausted {
            let sighted = &swept.sighted.keys;
            for (key, before) in releasing.iter().filter(|(key, _)| !sighted.contains(key)) {
                freed |= order.released(key, *before);
            }
        }
        let tally = swept.pass.tally;
        Ok((tally, tally.delivered > 0 || freed))
    }

    /// Lets go of keys whose holder is no longer what holds them: delivered
    /// or failed by another processor, replayed, discarded, or a document no
    /// write can change. A failed holder keeps its key only if it is marked
    /// `holdsKey` and dead letters hold their keys.
    async fn check_holders(&self, order: &KeyOrder) -> Result<()> {
        let failed = |e| {
            Error::mongo("sweep: reading the messages holding keys failed", e)
                .needing("find", self.pipeline.outbox.namespace())
        };
        for holders in order.holders().chunks(RELEASE_KEYS) {
            let ids: Vec<&Bson> = holders.iter().map(|(_, id, _)| id).collect();
            // As stored: a field the driver cannot read fails one holder's
            // check (it no longer holds), not the read.
            let found: Vec<RawDocumentBuf> = self
                .pipeline
                .outbox
                .clone_with_type::<RawDocumentBuf>()
                .find(doc! { field::ID: { "$in": ids } })
                .projection(
                    doc! { field::STATUS: 1, field::HOLDS_KEY: 1, field::NEXT_ATTEMPT_AT: 1 },
                )
                .await
                .map_err(failed)?
                .try_collect()
                .await
                .map_err(failed)?;
            let states: HashMap<String, &RawDocumentBuf> = found
                .iter()
                .filter_map(|d| Some((id_key(&raw_id(d)?), d)))
                .collect();
            for (key, id, version) in holders {
                let holds = states.get(&id_key(id)).is_some_and(|document| {
                    match document.get_str(field::STATUS).unwrap_or_default() {
                        // Parked, it waits behind its key rather than holds it.
                        status::PENDING => {
                            !self.pipeline.unmarkable.contains(id)
                                && document.get_datetime(field::NEXT_ATTEMPT_AT) != Ok(PARKED)
                        }
                        status::FAILED => {
                            order.dead_letters_hold()
                                && document.get_bool(field::HOLDS_KEY).unwrap_or(false)
                        }
                        _ => false,
                    }
                });
                if !holds {
                    order.let_go_of(key, id, *version);
                }
            }
        }
        Ok(())
    }
}
