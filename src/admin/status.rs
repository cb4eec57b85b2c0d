//! The state of an outbox: how many messages wait, how old the oldest is,
//! which failed and why, who leads, and how far the stored position is from
//! the edge of the oplog.
//!
//! The depths, the checkpoint and the oplog's span are read as the relay's
//! collector reads them for its metrics ([`crate::outbox_state`]); the
//! failures by type, the held keys and the partitions are read here. Each
//! is served by the sweep index or by a small result set, so they stay
//! cheap on large collections. Only `status` counts processed messages,
//! which is a scan of their index range.

use bson::{doc, Bson, DateTime, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::{Collection, Database};
use serde::Serialize;

use crate::checkpoint::CheckpointStore;
use crate::config::RelayConfig;
use crate::contract::{field, status};
use crate::deployment::Deployment;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::order::{count_of, held_keys, HeldKey};
use crate::outbox_state::{Checkpoint, Depths, Oplog};
use crate::partition::Partition;
use crate::time::{as_rfc3339, seconds_between};
use crate::unreadable::RawField;

/// The partition count the group of relays on the outbox runs with,
/// where it is more than one.
async fn shared_count(database: &Database, config: &RelayConfig) -> Result<Option<u32>> {
    let group = Group::stored(database, &config.checkpoint_collection, &config.collection).await?;
    Ok(group.map(|(count, _)| count).filter(|count| *count > 1))
}

/// Failed messages of one type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailedType {
    #[serde(rename = "type")]
    pub message_type: String,
    pub count: u64,
    /// The newest failure's error.
    pub last_error: Option<String>,
    #[serde(serialize_with = "as_rfc3339")]
    pub last_failed_at: Option<DateTime>,
}

/// Failed messages grouped by type, most numerous first.
pub async fn failed_by_type(outbox: &Collection<Document>) -> Result<Vec<FailedType>> {
    let failed = |e| Error::mongo("grouping failed messages failed", e);
    // As stored: a type that is not UTF-8 is one group's oddity, not the
    // whole command's failure.
    let groups: Vec<RawDocumentBuf> = outbox
        .aggregate([
            doc! { "$match": { field::STATUS: status::FAILED } },
            doc! { "$sort": { field::FAILED_AT: -1 } },
            doc! { "$group": {
                "_id": format!("${}", field::TYPE),
                "count": { "$sum": 1 },
                "lastError": { "$first": format!("${}", field::LAST_ERROR) },
                "lastFailedAt": { "$first": format!("${}", field::FAILED_AT) },
            } },
            doc! { "$sort": { "count": -1, "_id": 1 } },
        ])
        .with_type::<RawDocumentBuf>()
        .await
        .map_err(failed)?
        .try_collect()
        .await
        .map_err(failed)?;
    Ok(groups
        .iter()
        .map(|group| {
            let value = |name: &str| RawField::of(group, name).and_then(|f| f.as_bson());
            FailedType {
                message_type: match RawField::of(group, "_id") {
                    Some(name) => match name.as_bson() {
                        Some(Bson::String(name)) => name,
                        Some(_) => "(no type)".to_owned(),
                        None => name.lossy(),
                    },
                    None => "(no type)".to_owned(),
                },
                count: count_of(value("count").as_ref()),
                last_error: match value("lastError") {
                    Some(Bson::String(error)) => Some(error),
                    _ => None,
                },
                last_failed_at: match value("lastFailedAt") {
                    Some(Bson::DateTime(at)) => Some(at),
                    _ => None,
                },
            }
        })
        .collect())
}

/// Messages by status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub pending: u64,
    pub processed: u64,
    pub failed: u64,
}

/// Everything `outbox-relay status` shows. Ages are counted on the
/// database server's clock.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    pub database: String,
    pub collection: String,
    pub counts: Counts,
    pub oldest_pending_age_seconds: Option<f64>,
    pub failed_by_type: Vec<FailedType>,
    pub checkpoint: Checkpoint,
    /// Whether the lease is held now (it has not expired).
    pub leader_active: bool,
    /// Time since the resume token was last written.
    pub checkpoint_age_seconds: Option<f64>,
    /// Now minus the time of the stored position: how far behind the
    /// relay's record of the stream is (an idle stream's position moves
    /// only every idle checkpoint interval).
    pub relay_lag_seconds: Option<f64>,
    pub oplog_window_seconds: Option<f64>,
    pub oplog_headroom_seconds: Option<f64>,
    /// Why the oplog figures are missing, where they are.
    pub oplog_note: Option<String>,
    /// How many keys are held.
    pub held_keys_total: usize,
    /// The held keys, oldest first, up to [`HELD_KEYS_SHOWN`].
    pub held_keys: Vec<HeldKeyStatus>,
    /// Each partition, where a group of relays shares the outbox in more
    /// than one (the count its relays run with); empty otherwise.
    pub partitions: Vec<PartitionStatus>,
}

/// One partition of an outbox a group of relays shares.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionStatus {
    /// `index/count`.
    pub partition: String,
    /// The relay holding its lease now, if one does.
    pub owner: Option<String>,
    pub term: Option<i64>,
    /// Its pending messages.
    pub pending: u64,
    /// Now minus the time of its stored position.
    pub lag_seconds: Option<f64>,
}

impl PartitionStatus {
    async fn read(
        outbox: &mongodb::Collection<Document>,
        store: CheckpointStore,
        partition: Partition,
        now: DateTime,
    ) -> Result<Self> {
        let checkpoint = Checkpoint::read(&store.of_partition(partition)).await?;
        let pending = outbox
            .count_documents(partition.scope(doc! { field::STATUS: status::PENDING }))
            .await
            .map_err(|e| Error::mongo("counting a partition's pending messages failed", e))?;
        let live = checkpoint.lease_expires_at.is_some_and(|at| at > now);
        Ok(PartitionStatus {
            partition: partition.to_string(),
            owner: checkpoint.owner.filter(|_| live),
            term: checkpoint.term,
            pending,
            lag_seconds: checkpoint.position_at.map(|t| seconds_between(t, now)),
        })
    }
}

/// The most held keys `status` lists.
pub const HELD_KEYS_SHOWN: usize = 100;

/// One held key and the message holding it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldKeyStatus {
    pub key: String,
    /// The `_id` of the message holding the key; none once it went and the
    /// parked messages are being released.
    pub holder: Option<String>,
    /// `retrying`, `dead letter` or `releasing`.
    pub state: &'static str,
    /// Messages of the key parked behind it.
    pub parked: u64,
    /// Age of the oldest message the key waits on.
    pub age_seconds: f64,
}

impl HeldKeyStatus {
    fn new(held: HeldKey, now: DateTime) -> Self {
        let first = held.holders.first();
        let state = match first {
            None => "releasing",
            Some(_) if held.holders.iter().all(|h| h.dead_letter) => "dead letter",
            Some(_) => "retrying",
        };
        HeldKeyStatus {
            holder: first.map(|holder| holder.id.to_hex()),
            key: held.key,
            state,
            parked: held.parked,
            age_seconds: seconds_between(held.since, now),
        }
    }
}

impl Status {
    /// Reads the status of the outbox `config` names.
    pub async fn read(database: &Database, config: &RelayConfig) -> Result<Self> {
        let outbox = database.collection::<Document>(&config.collection);
        // Lease expiry is judged on the server's clock, as the relays judge it.
        let now = crate::lease::server_time(database.client()).await?;
        let depths = Depths::read(&outbox).await?;
        let processed = outbox
            .count_documents(doc! { field::STATUS: status::PROCESSED })
            .await
            .map_err(|e| Error::mongo("counting processed messages failed", e))?;
        let store = CheckpointStore::for_config(database, config);
        let checkpoint = Checkpoint::read(&store).await?;
        let held = held_keys(&outbox, Partition::WHOLE, config.on_dead_letter).await?;
        let mut partitions = Vec::new();
        if let Some(count) = shared_count(database, config).await? {
            for partition in Partition::all(count) {
                partitions
                    .push(PartitionStatus::read(&outbox, store.clone(), partition, now).await?);
            }
        }
        let held_keys_total = held.len();
        let held_keys = held
            .into_iter()
            .take(HELD_KEYS_SHOWN)
            .map(|held| HeldKeyStatus::new(held, now))
            .collect();
        let deployment = Deployment::detect(database.client())
            .await
            .map_err(|e| Error::mongo("asking MongoDB what it is (hello) failed", e))?;
        let (oplog, oplog_note) = match deployment.oplog_unreadable() {
            Some(why) => (None, Some(why.to_owned())),
            None => match Oplog::read(database.client()).await {
                Ok(Some(oplog)) => (Some(oplog), None),
                Ok(None) => (None, Some("the oplog is empty".to_owned())),
                Err(error) => (None, Some(format!("the oplog is not readable: {error}"))),
            },
        };
        Ok(Status {
            database: config.database.clone(),
            collection: config.collection.clone(),
            counts: Counts {
                pending: depths.pending,
                processed,
                failed: depths.failed,
            },
            oldest_pending_age_seconds: depths.oldest_pending.map(|t| seconds_between(t, now)),
            failed_by_type: failed_by_type(&outbox).await?,
            leader_active: checkpoint
                .lease_expires_at
                .is_some_and(|expires| expires > now),
            checkpoint_age_seconds: checkpoint.updated_at.map(|t| seconds_between(t, now)),
            relay_lag_seconds: checkpoint.position_at.map(|t| seconds_between(t, now)),
            oplog_window_seconds: oplog.map(|o| o.window_seconds()),
            oplog_headroom_seconds: oplog
                .zip(checkpoint.position_at)
                .map(|(o, at)| o.headroom_seconds(at)),
            oplog_note,
            checkpoint,
            held_keys_total,
            held_keys,
            partitions,
        })
    }

    /// The status as lines for a terminal.
    pub fn render(&self) -> String {
        let mut lines = vec![
            format!("outbox {}.{}", self.database, self.collection),
            format!(
                "  messages: {} pending, {} processed, {} failed",
                self.counts.pending, self.counts.processed, self.counts.failed
            ),
            format!(
                "  oldest pending: {}",
                self.oldest_pending_age_seconds
                    .map_or("none".to_owned(), age)
            ),
        ];
        let lease = &self.checkpoint;
        lines.push(match (&lease.owner, lease.term) {
            (Some(owner), Some(term)) if self.leader_active => {
                format!("  leader: {owner} (term {term})")
            }
            (Some(owner), Some(term)) => {
                format!("  leader: none (last: {owner}, term {term}, lease expired)")
            }
            _ => "  leader: none yet".to_owned(),
        });
        lines.push(format!(
            "  checkpoint: {}",
            match (lease.has_token, self.checkpoint_age_seconds) {
                (true, Some(written)) => format!("written {} ago", age(written)),
                _ => "none (the next relay starts with a catch-up pass)".to_owned(),
            }
        ));
        lines.push(format!(
            "  relay lag: {}",
            self.relay_lag_seconds.map_or("unknown".to_owned(), age)
        ));
        lines.push(match (self.oplog_window_seconds, &self.oplog_note) {
            (Some(window), _) => format!(
                "  oplog: {} of history{}",
                age(window),
                self.oplog_headroom_seconds
                    .map(|h| format!(", {} of it before the stored position", age(h)))
                    .unwrap_or_default()
            ),
            (None, Some(note)) => format!("  oplog: {note}"),
            (None, None) => "  oplog: unknown".to_owned(),
        });
        if !self.partitions.is_empty() {
            lines.push(format!("  partitions: {}", self.partitions.len()));
            for partition in &self.partitions {
                lines.push(format!(
                    "    {}: {}, {} pending, lag {}",
                    partition.partition,
                    match (&partition.owner, partition.term) {
                        (Some(owner), Some(term)) => format!("{owner} (term {term})"),
                        _ => "no owner".to_owned(),
                    },
                    partition.pending,
                    partition.lag_seconds.map_or("unknown".to_owned(), age),
                ));
            }
        }
        if !self.held_keys.is_empty() {
            lines.push(format!("  held keys: {}", self.held_keys_total));
            for held in &self.held_keys {
                lines.push(format!(
                    "    {}: {}{}, {} parked, waiting {}",
                    held.key,
                    held.state,
                    held.holder
                        .as_ref()
                        .map(|id| format!(" ({id})"))
                        .unwrap_or_default(),
                    held.parked,
                    age(held.age_seconds)
                ));
            }
            if self.held_keys_total > self.held_keys.len() {
                lines.push(format!(
                    "    … and {} more",
                    self.held_keys_total - self.held_keys.len()
                ));
            }
        }
        if !self.failed_by_type.is_empty() {
            lines.push("  failed by type:".to_owned());
            for failed in &self.failed_by_type {
                lines.push(format!(
                    "    {}: {}, last error: {}",
                    failed.message_type,
                    failed.count,
                    failed.last_error.as_deref().unwrap_or("(none)")
                ));
            }
        }
        lines.join("\n")
    }
}

/// A number of seconds as a short human duration ("3m 20s").
fn age(seconds: f64) -> String {
    if seconds < 0.0 {
        return format!("-{}", age(-seconds));
    }
    if seconds < 10.0 {
        return format!("{seconds:.1}s");
    }
    humantime::format_duration(std::time::Duration::from_secs(seconds as u64)).to_string()
}
