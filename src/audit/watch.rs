//! A relay's own audit (`--audit-after`): each window of delivered
//! messages, once it is that old, audited and repaired, by one relay of a
//! group at a time, so that a NATS host's crash heals without a person.
//!
//! Which relay audits, and how far the audits have got, is one document
//! in the checkpoint collection (`<db>.<collection>:audit`): a relay takes
//! it when no other holds it (or its hold lapsed: that relay died
//! mid-round), audits from where the last audit ended (at most an hour
//! a round; a first audit starts an hour back) to `--audit-after` ago,
//! repairs, and moves the end on. A round that fails, or leaves messages
//! JetStream still remembers, is tried again at the next, from the same
//! place: each window is audited at least once. Two relays whose clocks disagree may audit one window twice,
//! which costs a read: a repair publishes nothing a stream holds.

use std::time::Duration;

use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use tokio_util::sync::CancellationToken;

use super::{Auditor, Pace, RepairOptions};
use crate::config::RelayConfig;
use crate::error::{is_duplicate_key, Error, Result};
use crate::observe::Metrics;
use crate::replay::Selection;
use crate::time::{earlier, later, shown};

/// The shortest and the longest time between two rounds.
const ROUNDS: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// The most messages a second a relay's own audit reads: beside the
/// relay's delivery, on the same servers (see BENCHMARKS.md, audit).
const RELAY_PACE: f64 = 10_000.0;

/// The longest window one round audits: a relay far behind (the first
/// start, or after a long stop) catches up an hour a round, each round's
/// memory bounded by an hour's messages.
const LONGEST_WINDOW: Duration = Duration::from_secs(3600);

/// What a relay audits with.
pub struct Watch {
    pub database: Database,
    pub config: RelayConfig,
    pub metrics: Metrics,
    /// This relay's name, as its leases give it.
    pub owner: String,
}

/// Audits until `shutdown`, a round every half of `--audit-after` (1 s
/// to 5 minutes); returns at once if it is off.
pub async fn watch(watch: Watch, shutdown: CancellationToken) {
    let Some(after) = watch.config.audit_after else {
        return;
    };
    let every = watch.every();
    let mut auditor = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(error) = watch.round(&mut auditor, after, &shutdown).await {
            tracing::warn!(error = %error, "an audit round failed; the next tries the same window");
            // Connected anew next time: the streams may have changed.
            auditor = None;
        }
    }
}

impl Watch {
    /// The time between two rounds: half of `--audit-after`, 1 s to 5
    /// minutes.
    fn every(&self) -> Duration {
        let after = self.config.audit_after.unwrap_or(ROUNDS.1);
        (after / 2).clamp(ROUNDS.0, ROUNDS.1)
    }

    fn record(&self) -> (Collection<Document>, String) {
        let collection = self.database.collection(&self.config.checkpoint_collection);
        let id = format!("{}.{}:audit", self.database.name(), self.config.collection);
        (collection, id)
    }

    /// One round: the window since the last audit ended, if this relay may
    /// take it.
    async fn round(
        &self,
        auditor: &mut Option<Auditor>,
        after: Duration,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let every = self.every();
        let newest = earlier(DateTime::now(), after);
        let Some(start) = self.take(newest).await? else {
            return Ok(());
        };
        if start >= newest {
            return Ok(());
        }
        let end = later(start, LONGEST_WINDOW).min(newest);
        let auditor = match auditor {
            Some(auditor) => auditor,
            None => {
                let outbox = self.database.collection(&self.config.collection);
                let pace = Pace(Some(RELAY_PACE));
                auditor.insert(Auditor::connect(outbox, &self.config, pace).await?)
            }
        };
        let selection = Selection {
            since: Some(start),
            until: Some(end),
            ..Selection::default()
        };
        let repair = RepairOptions {
            rate: None,
            wait: every,
        };
        let (found, repaired) = auditor.audit(&selection, Some(&repair), shutdown).await?;
        let (published, left) = match &repaired {
            Some(summary) => (
                summary.repaired.published,
                summary.after.as_ref().map_or(found.missing, |a| a.missing),
            ),
            None => (0, found.missing),
        };
        self.metrics.audited(found.missing, published, left);
        if found.missing > 0 {
            tracing::warn!(
                missing = found.missing,
                published_again = published,
                still_missing = left,
                since = %shown(start),
                until = %shown(end),
                "the audit found delivered messages in no stream (a NATS host's crash, a purge?) \
                 and published them again"
            );
        }
        // Still remembered by JetStream past this round's wait: the same
        // window again next round, until the repeats are stored.
        let remembered = repaired.as_ref().map_or(0, |r| r.repaired.still_remembered);
        if shutdown.is_cancelled() || remembered > 0 {
            return Ok(());
        }
        self.advance(end).await
    }

    /// Takes the audit for this relay, held for two rounds: where the last
    /// audit ended (a first one starts an hour before `newest`). None if
    /// another relay holds it.
    async fn take(&self, newest: DateTime) -> Result<Option<DateTime>> {
        let every = self.every();
        let (collection, id) = self.record();
        let now = DateTime::now();
        let filter = doc! {
            "_id": &id,
            "$or": [
                { "owner": &self.owner },
                { "heldUntil": { "$lt": now } },
                { "heldUntil": { "$exists": false } },
            ],
        };
        let first = earlier(newest, LONGEST_WINDOW);
        let update = doc! {
            "$set": { "owner": &self.owner, "heldUntil": later(now, every * 2) },
            "$setOnInsert": { "auditedUntil": first },
        };
        let taken = collection
            .find_one_and_update(filter, update)
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match taken {
            Ok(record) => Ok(Some(
                record
                    .and_then(|r| r.get_datetime("auditedUntil").ok().copied())
                    .unwrap_or(first),
            )),
            // Another relay holds it: the upsert met its document.
            Err(error) if is_duplicate_key(&error) => Ok(None),
            Err(error) => Err(Error::mongo("taking the audit failed", error)
                .needing("update", collection.namespace())),
        }
    }

    /// Records that the audits reached `end`.
    async fn advance(&self, end: DateTime) -> Result<()> {
        let (collection, id) = self.record();
        collection
            .update_one(
                doc! { "_id": &id, "owner": &self.owner },
                doc! { "$max": { "auditedUntil": end } },
            )
            .await
            .map_err(|e| {
                Error::mongo("recording the audit's end failed", e)
                    .needing("update", collection.namespace())
            })?;
        Ok(())
    }
}
