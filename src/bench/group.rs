//! A group of relays sharing one outbox (`--relays`): the same keyed load
//! delivered by one relay alone and by groups of relays sharing its
//! partitions, each run in a collection of its own.
//!
//! Each size runs twice over: a paced load, timed from commit to the
//! subscriber as the other runs are, and a burst written as fast as the
//! server takes inserts while the group runs, timed until every message is
//! marked (what the group drains at full load). The relays are started
//! together and the load begins once they share every partition, so a
//! hand-over at the start is not measured.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::Document;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::load::{self, Clock, Keys};
use super::process::RelayProcess;
use super::{percentile, report, Bench, Mode, READY_MESSAGES};
use crate::config::NatsMode;
use crate::error::{Error, Result};
use crate::partition::Partition;

/// The keys of a group's load: enough that every partition has many.
const GROUP_KEYS: Keys = Keys::Spread(10_000);

/// One group's figures.
#[derive(Debug, Clone, Serialize)]
pub struct GroupRun {
    pub relays: usize,
    pub partitions: u32,
    /// The paced load: offered rate, messages, and latency percentiles
    /// from commit to the subscriber.
    pub offered_rate: Option<u32>,
    pub messages: usize,
    /// How many of them reached the subscriber.
    pub received: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// The burst: messages, and how fast the group delivered and marked them.
    pub burst_messages: usize,
    pub burst_seconds: f64,
    pub burst_rate: f64,
    /// How long writing the burst took: a drain that ends with it kept up
    /// with the writes.
    pub insert_seconds: f64,
    /// The floor: the same burst read by one bare change stream per
    /// partition with the partition's `$match`, no relay running, and the
    /// rate all of them read it at.
    pub streams_seconds: f64,
    pub streams_rate: f64,
    /// The relays' CPU, summed, over both loads, a message.
    pub cpu_us_per_message: f64,
    /// The largest of the relays' peak memory.
    pub peak_rss_mib: f64,
}

impl Bench<'_> {
    /// Runs `relays` relays on `partitions` partitions: a paced load of
    /// `count` messages at `rate`, then a burst of `burst` messages.
    pub(super) async fn group(
        &self,
        relays: usize,
        partitions: u32,
        rate: Option<u32>,
        count: usize,
        burst: usize,
    ) -> Result<GroupRun> {
        let tag = format!("group{relays}x{partitions}");
        let label = format!("{relays} relays, {partitions} partitions");
        let (prefix, collection) = self.names(&tag);
        let stream = self.stream_for(&prefix).await?;
        let outbox = self.database.collection::<Document>(&collection);
        crate::setup::ensure_sweep_index(&outbox).await?;
        let (started, arrived, stop) =
            (Clock::default(), Clock::default(), CancellationToken::new());
        let _stop_receiver = stop.clone().drop_guard();
        load::subscribe(&self.nats, &prefix, arrived.clone(), stop.clone()).await?;
        let count_flag = partitions.to_string();
        let mut group = Vec::with_capacity(relays);
        for n in 0..relays {
            group.push(self.start_relay_with(
                &format!("{tag}-{n}"),
                &collection,
                &prefix,
                Mode::Push(NatsMode::Jetstream),
                &["--partitions", &count_flag],
            )?);
        }
        self.wait_shared(&collection, &group, partitions).await?;
        self.settle(&collection, GROUP_KEYS, &arrived, &label)
            .await?;
        let ready: f64 = group.iter().map(|r| r.usage().cpu_seconds).sum();

        let progress =
            report::progress(count, &format!("{label} at {}/s", super::rate_label(rate)));
        let offered = load::Load {
            count,
            rate,
            keys: GROUP_KEYS,
        };
        load::produce(
            &self.client,
            &self.database,
            &collection,
            offered,
            &started,
            &progress,
        )
        .await?;
        progress.finish_and_clear();
        load::wait_for(&arrived, count + READY_MESSAGES, Duration::from_secs(120)).await;
        let latencies = load::latencies(&started, &arrived);

        let began = Instant::now();
        self.insert_backlog(&outbox, burst, GROUP_KEYS).await?;
        let insert_seconds = began.elapsed().as_secs_f64();
        let total = count + READY_MESSAGES + burst;
        self.wait_marked(&group, total, &label).await?;
        let burst_seconds = began.elapsed().as_secs_f64();
        let usage: Vec<_> = group.iter().map(RelayProcess::usage).collect();
        for relay in group {
            relay.stop(Duration::from_secs(15)).await;
        }
        let stored = self.stored_messages(&stream).await?;
        if (stored as usize) < total {
            return Err(Error::Bench(format!(
                "{label}: every message was marked, but JetStream stream {stream:?} holds {stored} \
                 of {total} (see the relay-{tag}-*.log files)"
            )));
        }
        let cpu: f64 = usage.iter().map(|u| u.cpu_seconds).sum::<f64>() - ready;
        let streams_seconds = self.streams_floor(&tag, partitions, burst).await?;
        Ok(GroupRun {
            relays,
            partitions,
            offered_rate: rate,
            messages: count,
            received: latencies.len(),
            p50_ms: percentile(&latencies, 0.50),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: percentile(&latencies, 1.0),
            burst_messages: burst,
            burst_seconds,
            burst_rate: burst as f64 / burst_seconds.max(1e-9),
            insert_seconds,
            streams_seconds,
            streams_rate: burst as f64 / streams_seconds.max(1e-9),
            cpu_us_per_message: cpu / (count + burst) as f64 * 1e6,
            peak_rss_mib: usage.iter().map(|u| u.peak_rss_mib).fold(0.0, f64::max),
        })
    }

    /// How long `partitions` bare change streams, one a partition, take to
    /// read a burst of `burst` messages written while they run.
    async fn streams_floor(&self, tag: &str, partitions: u32, burst: usize) -> Result<f64> {
        let (_, collection) = self.names(&format!("{tag}_streams"));
        let outbox = self.database.collection::<Document>(&collection);
        crate::setup::ensure_sweep_index(&outbox).await?;
        let (seen, stop) = (Arc::new(AtomicUsize::new(0)), CancellationToken::new());
        let _stop_streams = stop.clone().drop_guard();
        load::watch_partitions(outbox.clone(), partitions, seen.clone(), stop).await?;
        let began = Instant::now();
        self.insert_backlog(&outbox, burst, GROUP_KEYS).await?;
        let read_all = || seen.load(Ordering::Relaxed);
        if !load::wait_for_count(burst, Duration::from_secs(600), read_all).await {
            return Err(Error::Bench(format!(
                "{partitions} bare change streams read {} of {burst} events within ten minutes",
                read_all()
            )));
        }
        Ok(began.elapsed().as_secs_f64())
    }

    /// Waits until the relays hold every partition between them, each
    /// relay some while there are enough to go round.
    async fn wait_shared(
        &self,
        collection: &str,
        group: &[RelayProcess],
        partitions: u32,
    ) -> Result<()> {
        let checkpoints = self.database.collection::<Document>("outbox_checkpoints");
        let outbox_id = format!("{}.{collection}", self.database.name());
        let wanted = group
            .len()
            .min(usize::try_from(partitions).unwrap_or(usize::MAX));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = crate::server_clock::server_time(&self.client).await?;
            let mut owners = std::collections::HashSet::new();
            let mut held = 0;
            for partition in Partition::all(partitions) {
                let id = partition.document_id(&outbox_id);
                let lease = checkpoints
                    .find_one(bson::doc! { "_id": id })
                    .await
                    .map_err(|e| Error::mongo("reading the partitions' leases failed", e))?;
                let live = lease.as_ref().and_then(|lease| {
                    let expires = lease.get_datetime("expiresAt").ok()?;
                    (*expires > now).then(|| lease.get_str("owner").ok().map(str::to_owned))?
                });
                if let Some(owner) = live {
                    held += 1;
                    owners.insert(owner);
                }
            }
            if held == partitions && owners.len() == wanted {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Bench(format!(
                    "{} relays did not share {partitions} partitions within a minute ({held} held, \
                     by {} relays); see the relay logs",
                    group.len(),
                    owners.len()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the relays together have marked `total` messages, by
    /// their own counts.
    async fn wait_marked(&self, group: &[RelayProcess], total: usize, label: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(3600);
        loop {
            let mut marked = 0;
            for relay in group {
                marked += relay.processed().await.unwrap_or(0);
            }
            if marked >= total as u64 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::Bench(format!(
                    "{label}: {marked} of {total} messages marked within an hour"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
