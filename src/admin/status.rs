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

use std::collections::BTreeSet;

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

/// The partition count the relays on the outbox run with, as their group
/// stores it: 1 where there is no group, or one of a single partition.
async fn partition_count(database: &Database, config: &RelayConfig) -> Result<u32> {
    let group = Group::stored(database, &config.checkpoint_collection, &config.collection).await?;
    Ok(group.map_or(1, |(count, _)| count))
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
    let failed =
        |e| Error::mongo("grouping failed messages failed", e).needing("find", outbox.namespace());
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
///
/// Where a group of relays shares the outbox in more than one partition,
/// each partition has its own lease and stored position: the figures at
/// the top are then the worst of the partitions' (the oldest checkpoint,
/// the longest lag, the least headroom), and `partitions` has each.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    pub database: String,
    pub collection: String,
    pub counts: Counts,
    pub oldest_pending_age_seconds: Option<f64>,
    pub failed_by_type: Vec<FailedType>,
    /// The partition count the relays run with (1: one relay delivers the
    /// whole outbox, the others stand by).
    pub partition_count: u32,
    /// The outbox's own lease and checkpoint document. With more than one
    /// partition it holds no position: the group keeps it held while it
    /// delivers, so that relays which know only this lease stand by.
    pub checkpoint: Checkpoint,
    /// Whether every partition's lease is held now (with one partition,
    /// whether the outbox's lease is).
    pub leader_active: bool,
    /// The partitions no relay holds now (`index/count`).
    pub unowned_partitions: Vec<String>,
    /// Time since a resume token was last written: the oldest partition's.
    pub checkpoint_age_seconds: Option<f64>,
    /// Now minus the time of the stored position: how far behind the
    /// relay's record of the stream is (an idle stream's position moves
    /// only every idle checkpoint interval); the furthest behind
    /// partition's.
    pub relay_lag_seconds: Option<f64>,
    pub oplog_window_seconds: Option<f64>,
    /// History before the stored position; the partition with the least.
    pub oplog_headroom_seconds: Option<f64>,
    /// Why the oplog figures are missing, where they are.
    pub oplog_note: Option<String>,
    /// How many keys are held.
    pub held_keys_total: usize,
    /// The held keys, oldest first, up to [`HELD_KEYS_SHOWN`].
    pub held_keys: Vec<HeldKeyStatus>,
    /// Each partition, in order (one, `0/1`, for the whole outbox).
    pub partitions: Vec<PartitionStatus>,
}

/// One partition of the outbox: its lease and its stored position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionStatus {
    /// `index/count`.
    pub partition: String,
    /// The relay holding its lease now, if one does.
    pub owner: Option<String>,
    /// Its lease's term, held or last held.
    pub term: Option<i64>,
    /// Seconds until its lease lapses unless renewed; negative: it lapsed
    /// that long ago. By the server's clock.
    pub lease_expires_in_seconds: Option<f64>,
    /// Its pending messages.
    pub pending: u64,
    /// Time since its resume token was last written.
    pub checkpoint_age_seconds: Option<f64>,
    /// Now minus the time of its stored position.
    pub lag_seconds: Option<f64>,
    /// History in the oplog before its stored position.
    pub oplog_headroom_seconds: Option<f64>,
}

impl PartitionStatus {
    /// Reads `partition`'s lease and position from its document in
    /// `store`; its pending messages are counted where `pending` does not
    /// say them already.
    async fn read(
        outbox: &mongodb::Collection<Document>,
        store: &CheckpointStore,
        partition: Partition,
        pending: Option<u64>,
        oplog: Option<&Oplog>,
        now: DateTime,
    ) -> Result<Self> {
        let checkpoint = Checkpoint::read(&store.clone().of_partition(partition)).await?;
        let pending = match pending {
            Some(pending) => pending,
            None => outbox
                .count_documents(partition.scope(doc! { field::STATUS: status::PENDING }))
                .await
                .map_err(|e| {
                    Error::mongo("counting a partition's pending messages failed", e)
                        .needing("find", outbox.namespace())
                })?,
        };
        let live = checkpoint.lease_expires_at.is_some_and(|at| at > now);
        let position_at = checkpoint.position_at.filter(|_| checkpoint.has_token);
        Ok(PartitionStatus {
            partition: partition.to_string(),
            owner: checkpoint.owner.filter(|_| live),
            term: checkpoint.term,
            lease_expires_in_seconds: checkpoint
                .lease_expires_at
                .map(|at| -seconds_between(at, now)),
            pending,
            checkpoint_age_seconds: checkpoint
                .updated_at
                .filter(|_| checkpoint.has_token)
                .map(|t| seconds_between(t, now)),
            lag_seconds: position_at.map(|t| seconds_between(t, now)),
            oplog_headroom_seconds: oplog.zip(position_at).map(|(o, at)| o.headroom_seconds(at)),
        })
    }
}

/// The worst of the partitions' figures, as `status` shows it at the top:
/// the largest of `figure`, or the smallest where `least`, with the
/// partition it is from.
fn worst(
    partitions: &[PartitionStatus],
    figure: impl Fn(&PartitionStatus) -> Option<f64>,
    least: bool,
) -> Option<(f64, &str)> {
    partitions
        .iter()
        .filter_map(|p| Some((figure(p)?, p.partition.as_str())))
        .reduce(|a, b| {
            if (b.0 < a.0) == least && b.0 != a.0 {
                b
            } else {
                a
            }
        })
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
        let now = crate::server_clock::server_time(database.client()).await?;
        let depths = Depths::read(&outbox).await?;
        let processed = outbox
            .count_documents(doc! { field::STATUS: status::PROCESSED })
            .await
            .map_err(|e| {
                Error::mongo("counting processed messages failed", e)
                    .needing("find", outbox.namespace())
            })?;
        let store = CheckpointStore::for_config(database, config);
        let checkpoint = Checkpoint::read(&store).await?;
        let held = held_keys(&outbox, Partition::WHOLE, config.on_dead_letter).await?;
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
        let count = partition_count(database, config).await?;
        // One partition's pending messages are the outbox's, counted above.
        let whole = (count == 1).then_some(depths.pending);
        let mut partitions = Vec::new();
        for partition in Partition::all(count) {
            let read =
                PartitionStatus::read(&outbox, &store, partition, whole, oplog.as_ref(), now);
            partitions.push(read.await?);
        }
        let unowned_partitions: Vec<String> = partitions
            .iter()
            .filter(|p| p.owner.is_none())
            .map(|p| p.partition.clone())
            .collect();
        let held_keys_total = held.len();
        let held_keys = held
            .into_iter()
            .take(HELD_KEYS_SHOWN)
            .map(|held| HeldKeyStatus::new(held, now))
            .collect();
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
            partition_count: count,
            leader_active: unowned_partitions.is_empty(),
            unowned_partitions,
            checkpoint_age_seconds: worst(&partitions, |p| p.checkpoint_age_seconds, false)
                .map(|(age, _)| age),
            relay_lag_seconds: worst(&partitions, |p| p.lag_seconds, false).map(|(lag, _)| lag),
            oplog_window_seconds: oplog.map(|o| o.window_seconds()),
            oplog_headroom_seconds: worst(&partitions, |p| p.oplog_headroom_seconds, true)
                .map(|(headroom, _)| headroom),
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
        if self.partition_count > 1 {
            self.render_group(&mut lines);
        } else {
            self.render_single(&mut lines);
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

    /// The leader and the stored position of an outbox one relay delivers.
    fn render_single(&self, lines: &mut Vec<String>) {
        let lease = &self.checkpoint;
        let expires = self
            .partitions
            .first()
            .and_then(|p| p.lease_expires_in_seconds);
        lines.push(match (&lease.owner, lease.term, expires) {
            (Some(owner), Some(term), Some(left)) if self.leader_active => {
                format!(
                    "  leader: {owner} (term {term}, lease expires in {} unless renewed)",
                    age(left)
                )
            }
            (Some(owner), Some(term), Some(left)) => format!(
                "  leader: none (last: {owner}, term {term}, lease expired {} ago)",
                age(-left)
            ),
            (Some(owner), Some(term), None) => {
                format!("  leader: none (last: {owner}, term {term})")
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
        lines.push(self.oplog_line("the stored position"));
    }

    /// The group's holders, the worst of its partitions, and each.
    fn render_group(&self, lines: &mut Vec<String>) {
        let holders: BTreeSet<&str> = self
            .partitions
            .iter()
            .filter_map(|p| p.owner.as_deref())
            .collect();
        let count = self.partition_count;
        lines.push(if self.unowned_partitions.is_empty() {
            format!(
                "  group: {count} partitions, all held, by {} relay{}",
                holders.len(),
                if holders.len() == 1 { "" } else { "s" }
            )
        } else {
            format!(
                "  group: {count} partitions, {} held, no owner for {}",
                count as usize - self.unowned_partitions.len(),
                self.unowned_partitions.join(", ")
            )
        });
        let unwritten: Vec<&str> = self
            .partitions
            .iter()
            .filter(|p| p.checkpoint_age_seconds.is_none())
            .map(|p| p.partition.as_str())
            .collect();
        let oldest = worst(&self.partitions, |p| p.checkpoint_age_seconds, false);
        lines.push(format!(
            "  checkpoint: {}{}",
            oldest.map_or("none".to_owned(), |(written, of)| format!(
                "oldest written {} ago ({of})",
                age(written)
            )),
            if unwritten.is_empty() {
                String::new()
            } else {
                format!(
                    "; none yet for {} (they start with a catch-up pass)",
                    unwritten.join(", ")
                )
            }
        ));
        lines.push(format!(
            "  relay lag: {}",
            worst(&self.partitions, |p| p.lag_seconds, false).map_or(
                "unknown".to_owned(),
                |(lag, of)| format!("{} at most ({of})", age(lag))
            )
        ));
        lines.push(self.oplog_line("the oldest stored position"));
        lines.push("  partitions:".to_owned());
        for partition in &self.partitions {
            lines.push(format!(
                "    {}: {}, {} pending, checkpoint {}, lag {}",
                partition.partition,
                match (
                    &partition.owner,
                    partition.term,
                    partition.lease_expires_in_seconds
                ) {
                    (Some(owner), Some(term), Some(left)) => {
                        format!("{owner} (term {term}, lease expires in {})", age(left))
                    }
                    _ => "no owner".to_owned(),
                },
                partition.pending,
                partition
                    .checkpoint_age_seconds
                    .map_or("none".to_owned(), |a| format!("{} ago", age(a))),
                partition.lag_seconds.map_or("unknown".to_owned(), age),
            ));
        }
    }

    /// The oplog's span, and how much of it lies before `position`.
    fn oplog_line(&self, position: &str) -> String {
        match (self.oplog_window_seconds, &self.oplog_note) {
            (Some(window), _) => format!(
                "  oplog: {} of history{}",
                age(window),
                self.oplog_headroom_seconds
                    .map(|h| format!(", {} of it before {position}", age(h)))
                    .unwrap_or_default()
            ),
            (None, Some(note)) => format!("  oplog: {note}"),
            (None, None) => "  oplog: unknown".to_owned(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn partition(
        name: &str,
        owner: Option<&str>,
        checkpoint_age: Option<f64>,
        lag: Option<f64>,
        headroom: Option<f64>,
    ) -> PartitionStatus {
        PartitionStatus {
            partition: name.to_owned(),
            owner: owner.map(str::to_owned),
            term: owner.map(|_| 3),
            lease_expires_in_seconds: owner.map(|_| 7.5),
            pending: 0,
            checkpoint_age_seconds: checkpoint_age,
            lag_seconds: lag,
            oplog_headroom_seconds: headroom,
        }
    }

    fn group(partitions: Vec<PartitionStatus>) -> Status {
        let unowned_partitions: Vec<String> = partitions
            .iter()
            .filter(|p| p.owner.is_none())
            .map(|p| p.partition.clone())
            .collect();
        Status {
            database: "shop".to_owned(),
            collection: "outbox".to_owned(),
            counts: Counts {
                pending: 0,
                processed: 10,
                failed: 0,
            },
            oldest_pending_age_seconds: None,
            failed_by_type: Vec::new(),
            partition_count: u32::try_from(partitions.len()).unwrap(),
            checkpoint: Checkpoint::default(),
            leader_active: unowned_partitions.is_empty(),
            unowned_partitions,
            checkpoint_age_seconds: worst(&partitions, |p| p.checkpoint_age_seconds, false)
                .map(|(a, _)| a),
            relay_lag_seconds: worst(&partitions, |p| p.lag_seconds, false).map(|(a, _)| a),
            oplog_window_seconds: Some(7200.0),
            oplog_headroom_seconds: worst(&partitions, |p| p.oplog_headroom_seconds, true)
                .map(|(a, _)| a),
            oplog_note: None,
            held_keys_total: 0,
            held_keys: Vec::new(),
            partitions,
        }
    }

    #[test]
    fn a_group_shows_its_holders_and_the_worst_partition_at_the_top() {
        let status = group(vec![
            partition("0/3", Some("relay-a"), Some(1.0), Some(0.5), Some(7000.0)),
            partition("1/3", Some("relay-b"), Some(95.0), Some(94.0), Some(6900.0)),
            partition("2/3", Some("relay-a"), Some(2.0), Some(1.5), Some(6999.0)),
        ]);
        let shown = status.render();
        for said in [
            "group: 3 partitions, all held, by 2 relays",
            "checkpoint: oldest written 1m 35s ago (1/3)",
            "relay lag: 1m 34s at most (1/3)",
            "1h 55m of it before the oldest stored position",
            "1/3: relay-b (term 3, lease expires in 7.5s), 0 pending, checkpoint 1m 35s ago, \
             lag 1m 34s",
        ] {
            assert!(shown.contains(said), "{said:?} in {shown}");
        }
        assert!(!shown.contains("leader: none"), "{shown}");
        let json = serde_json::to_value(&status).expect("serializes");
        assert_eq!(json["leader_active"], true);
        assert_eq!(json["partition_count"], 3);
        assert_eq!(json["checkpoint_age_seconds"], 95.0);
        assert_eq!(json["oplog_headroom_seconds"], 6900.0);
        assert_eq!(json["partitions"][1]["owner"], "relay-b");
    }

    #[test]
    fn a_group_names_a_partition_without_an_owner_or_a_position() {
        let status = group(vec![
            partition("0/2", Some("relay-a"), Some(1.0), Some(0.5), None),
            partition("1/2", None, None, None, None),
        ]);
        let shown = status.render();
        for said in [
            "group: 2 partitions, 1 held, no owner for 1/2",
            "none yet for 1/2",
            "1/2: no owner, 0 pending, checkpoint none, lag unknown",
        ] {
            assert!(shown.contains(said), "{said:?} in {shown}");
        }
        let json = serde_json::to_value(&status).expect("serializes");
        assert_eq!(json["leader_active"], false);
        assert_eq!(json["unowned_partitions"], serde_json::json!(["1/2"]));
    }

    #[test]
    fn one_partition_shows_when_its_lease_expires() {
        let mut status = group(vec![partition(
            "0/1",
            Some("relay-a"),
            Some(1.0),
            None,
            None,
        )]);
        status.checkpoint.owner = Some("relay-a".to_owned());
        status.checkpoint.term = Some(3);
        let shown = status.render();
        assert!(
            shown.contains("leader: relay-a (term 3, lease expires in 7.5s unless renewed)"),
            "{shown}"
        );
        status.leader_active = false;
        status.partitions[0].lease_expires_in_seconds = Some(-42.0);
        let shown = status.render();
        assert!(
            shown.contains("leader: none (last: relay-a, term 3, lease expired 42s ago)"),
            "{shown}"
        );
    }

    /// The `status` samples of docs/operating.md, after their command line.
    fn documented_samples() -> Vec<String> {
        include_str!("../../docs/operating.md")
            .split("```text\n$ outbox-relay status")
            .skip(1)
            .filter_map(|block| {
                let sample = block.split("\n```").next()?;
                Some(sample.split_once('\n')?.1.to_owned())
            })
            .collect()
    }

    #[test]
    fn the_operating_docs_status_samples_are_what_the_code_renders() {
        let mut single = group(vec![PartitionStatus {
            lease_expires_in_seconds: Some(7.4),
            ..partition(
                "0/1",
                Some("vm/2072/6b0cca6ca900f13ead6484a6"),
                Some(3.2),
                Some(3.1),
                Some(3689.0),
            )
        }]);
        single.counts = Counts {
            pending: 0,
            processed: 40,
            failed: 2,
        };
        single.oplog_window_seconds = Some(3690.0);
        single.checkpoint = Checkpoint {
            has_token: true,
            owner: Some("vm/2072/6b0cca6ca900f13ead6484a6".to_owned()),
            term: Some(1),
            ..Checkpoint::default()
        };
        single.held_keys_total = 1;
        single.held_keys = vec![HeldKeyStatus {
            key: "order-1041".to_owned(),
            holder: Some("6b0cd0a1e4b0c3d2a1f00e77".to_owned()),
            state: "dead letter",
            parked: 3,
            age_seconds: 725.0,
        }];
        let failed = |message_type: &str, last_error: &str| FailedType {
            message_type: message_type.to_owned(),
            count: 1,
            last_error: Some(last_error.to_owned()),
            last_failed_at: None,
        };
        single.failed_by_type = vec![
            failed(
                "invoice.sent",
                "refused by the broker: maximum messages exceeded (gave up after 10 attempts)",
            ),
            failed(
                "order placed",
                "invalid subject \"shop.order placed\": it contains whitespace or a control \
                 character",
            ),
        ];
        let relay = |name: &str, term, pending, checkpoint, lag, expires| PartitionStatus {
            term: Some(term),
            pending,
            lease_expires_in_seconds: Some(expires),
            ..partition(
                name.split(' ').next().unwrap_or_default(),
                name.split(' ').nth(1),
                Some(checkpoint),
                Some(lag),
                Some(3688.0),
            )
        };
        let mut four = group(vec![
            relay("0/4 web-1/7/6b0cca6ca900f13ead6484a6", 12, 1, 0.3, 0.2, 8.1),
            relay("1/4 web-1/7/6b0cca6ca900f13ead6484a6", 9, 0, 0.4, 0.4, 8.1),
            relay("2/4 web-2/7/6b0cca71c4e2ab5a1d0f9913", 10, 2, 0.2, 0.1, 9.6),
            relay("3/4 web-2/7/6b0cca71c4e2ab5a1d0f9913", 11, 0, 2.1, 2.0, 9.6),
        ]);
        four.counts = Counts {
            pending: 3,
            processed: 18240,
            failed: 0,
        };
        four.oldest_pending_age_seconds = Some(0.4);
        four.oplog_window_seconds = Some(3690.0);
        assert_eq!(
            documented_samples(),
            vec![single.render(), four.render()],
            "docs/operating.md's status samples (left) and the code's (right)"
        );
    }
}
