//! A relay's own audit (`--audit-after`): each window of delivered
//! messages, once it is that old, audited and repaired, by one relay of a
//! group at a time, so that a NATS host's crash heals without a person.
//!
//! Which relay audits, and how far the audits have got, is one document
//! in the checkpoint collection (`<db>.<collection>:audit`): a relay takes
//! it when no other holds it (its hold covers a round's longest, so it
//! lapses only when that relay died), audits from where the last audit
//! ended (ten minutes of commits a round at most; a first audit starts an
//! hour back) to `--audit-after` ago, repairs, and moves the end on, no
//! further than the first message not judged yet (pending, or processed
//! within `--audit-after`: a flush may still lose it). A round that fails,
//! or leaves messages JetStream still remembers, is tried again at the
//! next, from the same place: each window is audited at least once. Two
//! relays whose clocks disagree may audit one window twice, which costs a
//! read: a repair reads the streams again before it publishes.

use std::time::Duration;

use bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use tokio_util::sync::CancellationToken;

use super::{Auditor, Pace, Reading, RepairOptions, CLOCK_MARGIN};
use crate::config::RelayConfig;
use crate::error::{is_duplicate_key, Error, Result};
use crate::observe::Metrics;
use crate::replay::Selection;
use crate::time::{earlier, later, made_at, shown};

/// The shortest and the longest time between two rounds.
const ROUNDS: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(300));

/// The longest window one round audits: a relay behind (after a long
/// stop) catches up ten minutes a round, each round's memory bounded by
/// ten minutes of messages (a window may hold 5,000,000: 8,000 a second).
const LONGEST_WINDOW: Duration = Duration::from_secs(600);

/// How far back a relay's first audit of an outbox starts, caught up a
/// window a round.
const FIRST_LOOKBACK: Duration = Duration::from_secs(3600);

/// The longest a round may take, its reads paced; the audit is held for
/// this and a round's pause, so no other relay takes a window being
/// audited, and one whose relay died is taken once it has passed.
const ROUND_LIMIT: Duration = Duration::from_secs(900);

/// The most messages a second a relay's own audit reads: beside the
/// relay's delivery, on the same servers (see BENCHMARKS.md, audit).
const RELAY_PACE: f64 = 10_000.0;

/// What a relay audits with.
pub struct Watch {
    database: Database,
    config: RelayConfig,
    metrics: Metrics,
    /// This relay's name in the audit's record.
    owner: String,
    /// The window this relay last audited without moving on, and the
    /// missing messages it counted there: audited again, it counts only
    /// what it finds beyond them.
    counted: Option<(DateTime, u64)>,
}

impl Watch {
    /// A relay's audit of the outbox `config` names, in `database`.
    pub fn new(database: Database, config: RelayConfig, metrics: Metrics) -> Self {
        Watch {
            database,
            config,
            metrics,
            owner: crate::lease::owner_name(),
            counted: None,
        }
    }

    /// The missing messages already counted in the window from `start`.
    fn counted_in(&self, start: DateTime) -> u64 {
        match self.counted {
            Some((from, count)) if from == start => count,
            _ => 0,
        }
    }

    /// Notes `count` missing messages counted in the window from `start`.
    fn note_counted(&mut self, start: DateTime, count: u64) {
        self.counted = Some((start, count));
    }
}

/// Audits until `shutdown`, a round every half of `--audit-after` (1 s
/// to 5 minutes); returns at once if it is off.
pub async fn watch(mut watch: Watch, shutdown: CancellationToken) {
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
        // A stop does not wait for a round: the window is audited again
        // by whichever relay takes it next.
        let round = tokio::time::timeout(ROUND_LIMIT, watch.round(&mut auditor, after, &shutdown));
        let ended = tokio::select! {
            _ = shutdown.cancelled() => return,
            ended = round => ended,
        };
        let failed = match ended {
            Ok(Ok(())) => continue,
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("it took longer than {ROUND_LIMIT:?}"),
        };
        watch.metrics.audit_round_failed();
        tracing::warn!(error = %failed, "an audit round failed; the next tries the same window");
        // Connected anew next time: the streams may have changed.
        auditor = None;
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
        &mut self,
        auditor: &mut Option<Auditor>,
        after: Duration,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let newest = earlier(DateTime::now(), after);
        let start = match self.take(newest).await? {
            Some(start) if start < newest => start,
            Some(_) => return Ok(()),
            // Another relay audits: this one's count of what is left is
            // not the latest.
            None => {
                self.metrics.audit_left(0);
                return Ok(());
            }
        };
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
        // A message processed in the last `after` is not judged yet (a
        // flush may still lose it): the streams are read to then, and the
        // audit moves on no further than the first such message.
        let reading = Reading {
            stream_until: Some(later(newest, CLOCK_MARGIN)),
            settled_before: Some(newest),
        };
        let repair = RepairOptions {
            rate: None,
            wait: self.every(),
        };
        let audited = auditor
            .audit(&selection, reading, Some(&repair), shutdown)
            .await?;
        let found = &audited.found;
        let (published, left, remembered) = match &audited.repair {
            Some(summary) => (
                summary.repaired.published,
                summary.after.as_ref().map_or(found.missing, |a| a.missing),
                summary.repaired.still_remembered,
            ),
            None => (0, found.missing, 0),
        };
        // Counted once a window: a window audited again counts only what
        // it finds beyond the last count.
        let new = found.missing.saturating_sub(self.counted_in(start));
        self.metrics.audited(new, published);
        self.metrics.audit_left(left);
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
        if shutdown.is_cancelled() || remembered > 0 {
            self.note_counted(start, found.missing);
            return Ok(());
        }
        self.note_counted(start, 0);
        let reached = match audited.first_unsettled {
            Some(first) => made_at(&first).min(end),
            None => end,
        };
        self.advance(reached).await
    }

    /// Takes the audit for this relay, held for a round's longest and two
    /// pauses: where the last audit ended (a first one starts an hour
    /// before `newest`). None if another relay holds it.
    async fn take(&self, newest: DateTime) -> Result<Option<DateTime>> {
        let every = self.every();
        let held = ROUND_LIMIT + every * 2;
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
        let first = earlier(newest, FIRST_LOOKBACK);
        let update = doc! {
            "$set": { "owner": &self.owner, "heldUntil": later(now, held) },
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
