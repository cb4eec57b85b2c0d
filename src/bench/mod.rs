//! The delivery-latency benchmark (`outbox-relay bench`, `cargo bench`,
//! `scripts/bench.sh`).
//!
//! It measures, on one server under one load, how long a committed outbox
//! message takes to reach a NATS subscriber with the relay in push mode,
//! with the relay polling (the way polling outboxes work), and the floor:
//! a bare change stream that sees the same inserts with no NATS and no
//! marking. It also times the drain of a backlog written while the relay
//! was stopped, against the rate at which the same server bulk-updates the
//! same documents, the physical limit when each message needs one write.
//!
//! Everything runs in a database of its own, which is dropped afterwards.

mod audit;
mod group;
mod idle;
mod inbox;
pub mod load;
mod process;
mod report;

use std::path::PathBuf;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use futures::TryStreamExt;
use mongodb::Database;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::NatsMode;
use crate::error::{Error, Result};
use crate::publish::{connect_nats, StreamSetup};
use crate::redact;
use crate::source::change_stream::said;
pub use audit::AuditBench;
pub use group::GroupRun;
pub use idle::{IdleBench, IdleCost};
pub use inbox::{EndToEnd, InboxBench};
use load::Clock;
pub use load::Keys;
pub use process::cpu_seconds;
use process::{RelayProcess, RelayView, Usage};

pub use report::{print_table, write_json, write_plot};

/// How long an idle change-stream read waits, for the floor watcher and
/// the relay alike, so both tail with the same settings. (MongoDB answers
/// an awaiting read as soon as a change commits; some compatible servers
/// poll at a grain that grows with this setting.)
pub const MAX_AWAIT_TIME: Duration = Duration::from_millis(100);

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub mongodb_uri: String,
    pub nats_url: String,
    /// The `outbox-relay` binary to run as the relay under test.
    pub relay_binary: PathBuf,
    /// Offered rates, in messages a second; `None` is as fast as it goes.
    pub rates: Vec<Option<u32>>,
    /// Messages per run.
    pub count: usize,
    /// Poll intervals to compare push against.
    pub poll_intervals: Vec<Duration>,
    /// Sizes of the backlog drain, each drained on a first start and
    /// resumed (empty: skip it).
    pub backlog: Vec<usize>,
    /// Bytes of padding in each backlog message's payload (0: a payload of
    /// a few bytes), for the memory budget under large messages.
    pub payload_bytes: usize,
    /// Messages the inbox handles, timed (0: skip the inbox's runs).
    pub inbox: usize,
    /// Messages in the window an audit checks, timed (0: skip it).
    pub audit: usize,
    /// How long a quiet relay is watched (zero: skip it).
    pub idle: Duration,
    /// How messages are keyed: push over JetStream and the drain run once
    /// for each (the other modes without keys).
    pub keys: Vec<Keys>,
    /// Group sizes to compare (`--relays`): each runs with as many
    /// partitions as the largest, beside one relay with one; `[1]` (or
    /// nothing) runs no group.
    pub relays: Vec<usize>,
    /// The paced rate of the group runs; `None` as fast as the writers go.
    pub group_rate: Option<u32>,
    /// Messages in the group runs' burst.
    pub group_burst: usize,
    /// Where the JSON, the plot and the relay logs go.
    pub output: PathBuf,
    /// A description of the MongoDB server, for the record.
    pub server: String,
}

/// How a run delivers. Each push run measures its own floor alongside.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// A bare change stream on the inserts of the push run with this NATS
    /// mode: what the database itself takes.
    Floor(NatsMode),
    /// The floor's watcher publishing each insert to core NATS as it sees
    /// it, timed at the benchmark's subscriber: what the database and one
    /// NATS hop take, the least any relay can add a publish to.
    Forward(NatsMode),
    /// The relay tailing the change stream, publishing to JetStream or to
    /// core NATS (the difference is what JetStream's acknowledged storage
    /// costs).
    Push(NatsMode),
    /// The relay sweeping every interval.
    Poll(Duration),
}

impl Mode {
    pub fn label(&self) -> String {
        match self {
            Mode::Floor(NatsMode::Jetstream) => "floor (change stream)".into(),
            Mode::Floor(NatsMode::Core) => "floor (beside core push)".into(),
            Mode::Forward(NatsMode::Jetstream) => "floor + NATS hop".into(),
            Mode::Forward(NatsMode::Core) => "floor + NATS hop (core)".into(),
            Mode::Push(NatsMode::Jetstream) => "push".into(),
            Mode::Push(NatsMode::Core) => "push (core NATS)".into(),
            Mode::Poll(every) => format!("poll {}", humantime::format_duration(*every)),
        }
    }

    fn slug(&self) -> String {
        match self {
            Mode::Floor(NatsMode::Jetstream) => "floor".into(),
            Mode::Floor(NatsMode::Core) => "floorcore".into(),
            Mode::Forward(NatsMode::Jetstream) => "forward".into(),
            Mode::Forward(NatsMode::Core) => "forwardcore".into(),
            Mode::Push(NatsMode::Jetstream) => "push".into(),
            Mode::Push(NatsMode::Core) => "pushcore".into(),
            Mode::Poll(every) => format!("poll{}ms", every.as_millis()),
        }
    }
}

/// One mode at one offered rate.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub mode: String,
    pub offered_rate: Option<u32>,
    pub messages: usize,
    pub received: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    /// Seconds into the run the slowest message was written.
    pub max_at_s: Option<f64>,
    /// Messages committed a second.
    pub achieved_rate: f64,
    pub relay: Option<Usage>,
    /// What the relay measured itself, for push runs.
    pub relay_view: Option<RelayView>,
    /// How much later than the floor the relay delivered, for push runs.
    pub over_floor: Option<OverFloor>,
    #[serde(skip)]
    pub latencies: Vec<Duration>,
}

impl RunResult {
    /// The relay's CPU a received message, over the run's load alone.
    pub fn cpu_us_per_message(&self) -> f64 {
        let cpu = self.relay.unwrap_or_default().cpu_seconds;
        cpu / self.received.max(1) as f64 * 1e6
    }
}

/// A push run's latency less its floor's, the same inserts watched by a
/// bare change stream: what the relay adds to what the database takes.
/// Beside it, what a bare forward of the same inserts adds: one NATS hop,
/// which every relay pays.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OverFloor {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub hop_p50_ms: f64,
    pub hop_p99_ms: f64,
}

impl OverFloor {
    fn between(run: &RunResult, floor: &RunResult, forward: &RunResult) -> Self {
        OverFloor {
            p50_ms: run.p50_ms - floor.p50_ms,
            p99_ms: run.p99_ms - floor.p99_ms,
            max_ms: run.max_ms - floor.max_ms,
            hop_p50_ms: forward.p50_ms - floor.p50_ms,
            hop_p99_ms: forward.p99_ms - floor.p99_ms,
        }
    }
}

/// The backlog drain against the server's bulk-update rate.
#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    pub messages: usize,
    /// Padding in each message's payload, in bytes.
    pub payload_bytes: usize,
    /// On a first start: the catch-up pass reads the backlog.
    pub first: DrainRun,
    /// From a position stored before the backlog was written, as the
    /// relay chooses (more pending than `--max-replay`: a catch-up pass).
    pub resumed: DrainRun,
    /// The same, the change stream made to replay it all.
    pub replayed: DrainRun,
    pub bulk_update_seconds: f64,
    pub bulk_update_rate: f64,
    /// The same documents updated by naming them, 500 ids an update (as
    /// marking delivered messages must), one update after another, in a
    /// collection laid out as the relay's (with the sweep index, which
    /// any outbox needs to find its pending messages).
    pub batched_update_rate: f64,
    /// The same, in a collection with no index but `_id`.
    pub bare_batched_update_rate: f64,
    /// The database work of a drain with no broker: the pending documents
    /// read in the sweep index's order, 500 at a time, and each batch
    /// marked by naming its ids, one batch after another.
    pub read_and_mark_rate: f64,
}

/// One drain of a backlog, against the server's rates for the same work.
#[derive(Debug, Clone, Serialize)]
pub struct DrainRun {
    pub seconds: f64,
    /// Seconds from the relay's process starting to its first mark, as
    /// the benchmark reads its count (every 20 ms, over HTTP): the start-up
    /// the rate includes (connecting, the lease, a new term's reads, the
    /// catch-up pass's first batch). `None` if the count was never read
    /// between nothing and the whole backlog.
    pub first_mark_seconds: Option<f64>,
    pub rate: f64,
    /// Rate as a share of the bulk-update rate.
    pub share_of_bulk: f64,
    /// Rate as a share of the batched-update rate (the sweep index kept).
    pub share_of_batched: f64,
    /// Rate as a share of the bare batched-update rate.
    pub share_of_bare_batched: f64,
    /// Rate as a share of the read-and-mark rate.
    pub share_of_read_and_mark: f64,
    /// What the relay used over its whole life, start-up included.
    pub relay: Usage,
    /// Relay CPU time a message, in microseconds.
    pub cpu_us_per_message: f64,
}

/// How one drain went.
struct Drained {
    seconds: f64,
    first_mark_seconds: Option<f64>,
    relay: Usage,
}

/// How a drained relay starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// With no stored position: the catch-up pass reads the backlog.
    First,
    /// From a position stored before the backlog was written, as the
    /// relay decides.
    Resumed,
    /// The same, with the change stream made to replay the backlog.
    Replayed,
}

impl Start {
    fn slug(self) -> &'static str {
        match self {
            Start::First => "",
            Start::Resumed => "_resumed",
            Start::Replayed => "_replayed",
        }
    }
}

/// The same backlog drained with its messages keyed.
#[derive(Debug, Clone, Serialize)]
pub struct KeyedDrain {
    pub keys: String,
    pub messages: usize,
    pub seconds: f64,
    pub rate: f64,
    /// Drain rate as a share of the drain without keys.
    pub share_of_unkeyed: f64,
    pub relay: Usage,
}

/// Everything a benchmark measured, with what it was run with.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub version: &'static str,
    pub server: String,
    pub mongodb_uri: String,
    pub nats_url: String,
    /// `--count`: a run at a low rate writes fewer (its `messages`).
    pub count: usize,
    pub rates: Vec<Option<u32>>,
    pub started_at: String,
    pub runs: Vec<RunResult>,
    pub drains: Vec<Drain>,
    pub keyed_drains: Vec<KeyedDrain>,
    pub inbox: Option<InboxBench>,
    /// An audit of a window of delivered messages (`--audit`).
    pub audit: Option<AuditBench>,
    /// A quiet leader and a standby (`--idle`).
    pub idle: Option<IdleBench>,
    /// One relay against groups on the same load (`--relays`).
    pub groups: Vec<GroupRun>,
}

/// A description of the server at `uri` for the record: its buildInfo version.
pub async fn describe_server(uri: &str) -> String {
    let Ok(client) = crate::connect::connect_mongodb(uri).await else {
        return "unknown server".into();
    };
    let info = client
        .database("admin")
        .run_command(doc! { "buildInfo": 1 })
        .await;
    match info {
        Ok(info) => format!(
            "MongoDB-compatible server {}",
            info.get_str("version").unwrap_or("?")
        ),
        Err(_) => "unknown server".into(),
    }
}

/// Runs the benchmark.
pub async fn run(config: &BenchConfig) -> Result<Report> {
    std::fs::create_dir_all(&config.output)
        .map_err(|e| Error::io(format!("cannot create {}", config.output.display()), e))?;
    let client = crate::connect::connect_mongodb(&config.mongodb_uri).await?;
    let nats = connect_nats(&config.nats_url, Duration::from_secs(5)).await?;
    let forwarder = connect_nats(&config.nats_url, Duration::from_secs(5)).await?;
    let bench = Bench {
        config,
        database: client.database(&format!("outbox_bench_{}", ObjectId::new().to_hex())),
        client,
        nats,
        forwarder,
    };
    let mut report = Report {
        version: env!("CARGO_PKG_VERSION"),
        server: config.server.clone(),
        mongodb_uri: redact::uri(&config.mongodb_uri),
        nats_url: redact::uri(&config.nats_url),
        count: config.count,
        rates: config.rates.clone(),
        started_at: DateTime::now().try_to_rfc3339_string().unwrap_or_default(),
        runs: Vec::new(),
        drains: Vec::new(),
        keyed_drains: Vec::new(),
        inbox: None,
        idle: None,
        audit: None,
        groups: Vec::new(),
    };
    let outcome = bench.all(&mut report).await;
    bench.clean_up().await;
    outcome.map(|()| report)
}

struct Bench<'a> {
    config: &'a BenchConfig,
    client: mongodb::Client,
    database: Database,
    nats: async_nats::Client,
    /// The floor's own connection for its forward, apart from the
    /// subscriber's as the relay's is.
    forwarder: async_nats::Client,
}

impl Bench<'_> {
    async fn all(&self, report: &mut Report) -> Result<()> {
        let mut modes = vec![Mode::Push(NatsMode::Jetstream), Mode::Push(NatsMode::Core)];
        modes.extend(
            self.config
                .poll_intervals
                .iter()
                .map(|&every| Mode::Poll(every)),
        );
        // A first run on a cold server (empty caches, a fresh process) is
        // slower across the board; it is run once and thrown away, at the
        // highest rate, so that it is short.
        let highest = self
            .config
            .rates
            .iter()
            .max_by_key(|rate| rate.unwrap_or(u32::MAX));
        if let Some(&rate) = highest {
            tracing::info!("warm-up run, not reported");
            self.run_one(Mode::Push(NatsMode::Jetstream), rate, Keys::None, "_warmup")
                .await?;
        }
        for &rate in &self.config.rates {
            for &mode in &modes {
                let keyed = mode == Mode::Push(NatsMode::Jetstream);
                for &keys in self.keys_for(keyed) {
                    report
                        .runs
                        .extend(self.run_one(mode, rate, keys, "").await?);
                }
            }
        }
        for &n in &self.config.backlog {
            report.drains.push(self.drain(n).await?);
        }
        // Keys are drained at the first size alone: their cost is the
        // order kept, not the size.
        if let Some(drain) = report.drains.first() {
            let n = drain.messages;
            for &keys in self.keys_for(true).iter().filter(|k| **k != Keys::None) {
                let Drained { seconds, relay, .. } =
                    self.drain_keyed(keys, Start::First, n).await?;
                let rate = n as f64 / seconds;
                report.keyed_drains.push(KeyedDrain {
                    keys: keys.label().trim_start_matches(", ").to_owned(),
                    messages: n,
                    seconds,
                    rate,
                    share_of_unkeyed: rate / drain.first.rate,
                    relay,
                });
            }
        }
        if self.config.inbox > 0 {
            report.inbox = Some(self.inbox(self.config.inbox).await?);
        }
        if self.config.audit > 0 {
            report.audit = Some(self.audit(self.config.audit).await?);
        }
        if !self.config.idle.is_zero() {
            report.idle = Some(self.idle(self.config.idle).await?);
        }
        report.groups = self.groups().await?;
        Ok(())
    }

    /// One relay with one partition, then each group size on as many
    /// partitions as the largest group has relays (one relay of them
    /// running every partition), on the same load.
    async fn groups(&self) -> Result<Vec<GroupRun>> {
        let config = self.config;
        let Some(&largest) = config.relays.iter().max().filter(|n| **n > 1) else {
            return Ok(Vec::new());
        };
        let partitions = u32::try_from(largest).unwrap_or(u32::MAX);
        let (rate, count, burst) = (config.group_rate, config.count, config.group_burst);
        let mut runs = vec![self.group(1, 1, rate, count, burst).await?];
        for &relays in &config.relays {
            runs.push(self.group(relays, partitions, rate, count, burst).await?);
        }
        Ok(runs)
    }

    /// The key spreads a run of a mode measures: all of them for push over
    /// JetStream, none for the rest.
    fn keys_for(&self, keyed: bool) -> &[Keys] {
        if keyed {
            &self.config.keys
        } else {
            &[Keys::None]
        }
    }

    /// The subject prefix and collection of one run.
    fn names(&self, tag: &str) -> (String, String) {
        (
            format!("{}_{tag}", self.database.name()),
            format!("outbox_{tag}"),
        )
    }

    /// The JetStream stream capturing `prefix`'s subjects, made if missing;
    /// returns its name.
    async fn stream_for(&self, prefix: &str) -> Result<String> {
        let ours = prefix.to_uppercase();
        let name = StreamSetup::for_prefix(ours.clone(), prefix)
            .ensure(&self.nats)
            .await?;
        // Another stream's messages would count as the run's.
        if name != ours {
            return Err(Error::Bench(format!(
                "JetStream stream {name:?} already captures {prefix}.>; remove it or run the \
                 benchmark against another NATS server"
            )));
        }
        Ok(name)
    }

    /// How many messages the JetStream stream `name` holds: what a drain
    /// delivered, read from the broker's own count rather than by
    /// receiving each message, which would load the machine it measures.
    async fn stored_messages(&self, name: &str) -> Result<u64> {
        let what = || format!("reading JetStream stream {name:?} failed");
        let mut stream = async_nats::jetstream::new(self.nats.clone())
            .get_stream(name)
            .await
            .map_err(|e| Error::nats(what(), e))?;
        let info = stream.info().await.map_err(|e| Error::nats(what(), e))?;
        Ok(info.state.messages)
    }

    fn start_relay(
        &self,
        tag: &str,
        collection: &str,
        prefix: &str,
        mode: Mode,
    ) -> Result<RelayProcess> {
        self.start_relay_with(tag, collection, prefix, mode, &[])
    }

    /// The flags that point a relay at the run's servers, outbox and subjects.
    fn relay_args(&self, collection: &str, prefix: &str) -> Vec<String> {
        [
            "--mongodb-uri",
            &self.config.mongodb_uri,
            "--database",
            self.database.name(),
            "--collection",
            collection,
            "--nats-url",
            &self.config.nats_url,
            "--subject-prefix",
            prefix,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// [`Bench::start_relay`] with more flags.
    fn start_relay_with(
        &self,
        tag: &str,
        collection: &str,
        prefix: &str,
        mode: Mode,
        extra: &[&str],
    ) -> Result<RelayProcess> {
        let mut args = self.relay_args(collection, prefix);
        let tuned: Vec<String> = [
            "--max-await-time",
            &format!("{}ms", MAX_AWAIT_TIME.as_millis()),
            // Finding the oplog's first and last entries is a seek on
            // MongoDB; SecantusDB walks its whole oplog for each, up to
            // half a minute of its CPU in a round (docs/developing.md).
            "--oplog-headroom-warning",
            "off",
            // So are the collector's depths (an index count and seeks) and
            // the sweep's re-read of the held keys (an index range), where
            // SecantusDB walks every pending message for each: in a drain
            // of a million the depths' first read took 15 to 19 s and
            // halved the relay's pace meanwhile, and the held keys' read
            // came every 11 to 12 s. Read every five minutes, as where
            // counting is dear, they leave a shorter drain alone.
            "--collect-interval",
            "5m",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(tuned);
        match mode {
            Mode::Poll(every) => {
                args.extend(["--mode".into(), "poll".into(), "--poll-interval".into()]);
                args.push(format!("{}ms", every.as_millis()));
            }
            Mode::Push(NatsMode::Core) => args.extend(["--nats-mode".into(), "core".into()]),
            _ => {}
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        RelayProcess::start(
            &self.config.relay_binary,
            &args,
            &self.config.output.join(format!("relay-{tag}.log")),
        )
    }

    /// One run of the relay in `mode`. A push run also measures the floor:
    /// a bare change stream on the very same inserts, under the same load,
    /// which forwards each to NATS for the floor with a hop.
    /// `suffix` keeps a run's collection and subjects apart from another
    /// run of the same mode and rate.
    async fn run_one(
        &self,
        mode: Mode,
        rate: Option<u32>,
        keys: Keys,
        suffix: &str,
    ) -> Result<Vec<RunResult>> {
        let rate_tag = rate_label(rate);
        let count = messages_at(rate, self.config.count);
        let tag = format!("{}{}_{rate_tag}{suffix}", mode.slug(), keys.slug());
        let (prefix, collection) = self.names(&tag);
        let (started, arrived, stop) =
            (Clock::default(), Clock::default(), CancellationToken::new());
        let _stop_receivers = stop.clone().drop_guard();
        let floor = match mode {
            Mode::Push(nats_mode) => Some((nats_mode, Clock::default(), Clock::default())),
            _ => None,
        };
        if let Some((_, floor, forwarded)) = &floor {
            // Outside the stream's subjects: core NATS, stored nowhere.
            let hop = format!("{prefix}hop");
            load::subscribe(&self.nats, &hop, forwarded.clone(), stop.clone()).await?;
            let forward = load::Forward {
                nats: self.forwarder.clone(),
                subject: format!("{hop}.m"),
            };
            load::watch_inserts(
                self.database.collection(&collection),
                floor.clone(),
                forward,
                stop.clone(),
            )
            .await?;
        }
        self.stream_for(&prefix).await?;
        load::subscribe(&self.nats, &prefix, arrived.clone(), stop.clone()).await?;
        let relay = self.start_relay(&tag, &collection, &prefix, mode)?;
        self.settle(&collection, keys, &arrived, &mode.label())
            .await?;
        // The relay's CPU under the load alone, its start-up left out.
        let ready = relay.usage();
        let progress = report::progress(
            count,
            &format!("{}{} at {rate_tag}/s", mode.label(), keys.label()),
        );
        let took = load::produce(
            &self.client,
            &self.database,
            &collection,
            load::Load { count, rate, keys },
            &started,
            &progress,
        )
        .await?;
        progress.finish_and_clear();
        let limit = Duration::from_secs(60) + mode_wait(mode);
        load::wait_for(&arrived, count + READY_MESSAGES, limit).await;
        let done = relay.usage();
        let usage = Usage {
            cpu_seconds: done.cpu_seconds - ready.cpu_seconds,
            ..done
        };
        let view = match mode {
            Mode::Push(_) => relay.view().await,
            _ => None,
        };
        relay.stop(Duration::from_secs(15)).await;
        let achieved_rate = count as f64 / took.as_secs_f64().max(1e-9);
        let result = |mode: Mode, arrived: &Clock, relay: Option<Usage>, relay_view| {
            let latencies = load::latencies(&started, arrived);
            RunResult {
                mode: format!("{}{}", mode.label(), keys.label()),
                offered_rate: rate,
                messages: count,
                received: latencies.len(),
                p50_ms: percentile(&latencies, 0.50),
                p90_ms: percentile(&latencies, 0.90),
                p99_ms: percentile(&latencies, 0.99),
                p999_ms: percentile(&latencies, 0.999),
                max_ms: percentile(&latencies, 1.0),
                max_at_s: load::slowest_at(&started, arrived).map(|at| at.as_secs_f64()),
                achieved_rate,
                relay,
                relay_view,
                over_floor: None,
                latencies,
            }
        };
        let mut run = result(mode, &arrived, Some(usage), view);
        let Some((nats_mode, floor, forwarded)) = &floor else {
            return Ok(vec![run]);
        };
        let floor = result(Mode::Floor(*nats_mode), floor, None, None);
        let forward = result(Mode::Forward(*nats_mode), forwarded, None, None);
        run.over_floor = Some(OverFloor::between(&run, &floor, &forward));
        Ok(vec![floor, forward, run])
    }

    /// Sends [`READY_MESSAGES`] one at a time, each waited for in
    /// `arrived`, so that a run starts with the relay settled: the first
    /// is found by the start's catch-up pass, the next come on the stream
    /// it opened. The first of those would otherwise be the run's slowest,
    /// the price of a start (and on SecantusDB's Rust build, a message
    /// committed while that stream opens can wait for the sweep: see
    /// docs/developing.md).
    async fn settle(
        &self,
        collection: &str,
        keys: Keys,
        arrived: &Clock,
        label: &str,
    ) -> Result<()> {
        let hidden = indicatif::ProgressBar::hidden();
        let ready_within = Duration::from_secs(60);
        // Its own messages, told apart from anything else `arrived` notes.
        let sent = Clock::default();
        for number in 1..=READY_MESSAGES {
            let one = load::Load {
                count: 1,
                rate: None,
                keys,
            };
            load::produce(
                &self.client,
                &self.database,
                collection,
                one,
                &sent,
                &hidden,
            )
            .await?;
            let arrived_of_sent = || arrived.count_of(&sent);
            if !load::wait_for_count(number, ready_within, arrived_of_sent).await {
                return Err(Error::Bench(format!(
                    "{label}: message {number} of the start did not arrive within \
                     {ready_within:?}; see the relay log in {}",
                    self.config.output.display()
                )));
            }
        }
        Ok(())
    }

    /// A backlog of `n` written with the relay stopped, then drained (on a
    /// first start, then resumed); and the server's own rates for updating
    /// the same documents.
    async fn drain(&self, n: usize) -> Result<Drain> {
        let first = self.drain_keyed(Keys::None, Start::First, n).await?;
        let resumed = self.drain_keyed(Keys::None, Start::Resumed, n).await?;
        let replayed = self.drain_keyed(Keys::None, Start::Replayed, n).await?;
        let bulk = self
            .database
            .collection::<Document>(&format!("outbox_bulk_{n}"));
        self.insert_backlog(&bulk, n, Keys::None).await?;
        let began = Instant::now();
        bulk.update_many(
            doc! { "status": "pending" },
            doc! { "$set": { "status": "processed", "processedAt": DateTime::now() } },
        )
        .await
        .map_err(|e| Error::mongo("bulk update failed", e))?;
        let bulk_update_seconds = began.elapsed().as_secs_f64();
        let bulk_update_rate = n as f64 / bulk_update_seconds;
        let batched_update_rate = self.batched_update_rate(n, true).await?;
        let bare_batched_update_rate = self.batched_update_rate(n, false).await?;
        let read_and_mark_rate = self.read_and_mark_rate(n).await?;
        let run = |Drained {
                       seconds,
                       first_mark_seconds,
                       relay,
                   }| {
            let rate = n as f64 / seconds;
            DrainRun {
                seconds,
                first_mark_seconds,
                rate,
                share_of_bulk: rate / bulk_update_rate,
                share_of_batched: rate / batched_update_rate,
                share_of_bare_batched: rate / bare_batched_update_rate,
                share_of_read_and_mark: rate / read_and_mark_rate,
                cpu_us_per_message: relay.cpu_seconds / n as f64 * 1e6,
                relay,
            }
        };
        Ok(Drain {
            messages: n,
            payload_bytes: self.config.payload_bytes,
            first: run(first),
            resumed: run(resumed),
            replayed: run(replayed),
            bulk_update_seconds,
            bulk_update_rate,
            batched_update_rate,
            bare_batched_update_rate,
            read_and_mark_rate,
        })
    }

    /// How fast the server marks `n` documents named 500 at a time, in a
    /// collection with the relay's indexes (`indexed`) or with none.
    async fn batched_update_rate(&self, n: usize, indexed: bool) -> Result<f64> {
        let name = format!(
            "outbox_batched_{}{n}",
            if indexed { "indexed_" } else { "" }
        );
        let batched = self.database.collection::<Document>(&name);
        if indexed {
            crate::setup::ensure_sweep_index(&batched).await?;
        }
        self.insert_backlog(&batched, n, Keys::None).await?;
        let ids: Vec<ObjectId> = batched
            .find(doc! {})
            .projection(doc! { "_id": 1 })
            .await
            .map_err(|e| Error::mongo("reading ids failed", e))?
            .try_collect::<Vec<Document>>()
            .await
            .map_err(|e| Error::mongo("reading ids failed", e))?
            .iter()
            .filter_map(|d| d.get_object_id("_id").ok())
            .collect();
        let began = Instant::now();
        for chunk in ids.chunks(500) {
            mark_named(&batched, chunk).await?;
        }
        Ok(n as f64 / began.elapsed().as_secs_f64())
    }

    /// How fast the server gives up `n` pending documents in full, with the
    /// catch-up pass's query, while each 500 read are marked by their ids.
    async fn read_and_mark_rate(&self, n: usize) -> Result<f64> {
        let outbox = self
            .database
            .collection::<Document>(&format!("outbox_read_and_mark_{n}"));
        crate::setup::ensure_sweep_index(&outbox).await?;
        self.insert_backlog(&outbox, n, Keys::None).await?;
        let failed = |e| Error::mongo("reading pending documents failed", e);
        let began = Instant::now();
        let mut cursor = outbox
            .find(crate::source::catch_up::due_filter(DateTime::now()))
            .sort(doc! { "_id": 1 })
            .await
            .map_err(failed)?;
        let mut ids = Vec::with_capacity(500);
        while let Some(document) = cursor.try_next().await.map_err(failed)? {
            ids.extend(document.get_object_id("_id").ok());
            if ids.len() == 500 {
                mark_named(&outbox, &ids).await?;
                ids.clear();
            }
        }
        mark_named(&outbox, &ids).await?;
        Ok(n as f64 / began.elapsed().as_secs_f64())
    }

    /// A backlog of `n` messages keyed by `keys`, written with the relay
    /// stopped, then drained by a relay in push mode, started as `start`
    /// says. Returns how long the drain took, when its first mark came,
    /// and what the relay used.
    async fn drain_keyed(&self, keys: Keys, start: Start, n: usize) -> Result<Drained> {
        self.drain_named("", keys, start, n).await
    }

    /// [`Bench::drain_keyed`] into an outbox and a stream whose names
    /// carry `name` too, to drain the same backlog again beside something.
    async fn drain_named(&self, name: &str, keys: Keys, start: Start, n: usize) -> Result<Drained> {
        let tag = format!("drain{name}{}{}_{n}", keys.slug(), start.slug());
        let (prefix, collection) = self.names(&tag);
        let stream = self.stream_for(&prefix).await?;
        let outbox = self.database.collection::<Document>(&collection);
        let before = match start {
            Start::First => 0,
            Start::Resumed | Start::Replayed => {
                self.store_a_position(&tag, &outbox, &prefix, &stream)
                    .await?
            }
        };
        // The collection is laid out as a relay that ran before left it:
        // an index built over a large backlog could outlast the relay's
        // set-up limit.
        crate::setup::ensure_sweep_index(&outbox).await?;
        self.insert_backlog(&outbox, n, keys).await?;
        let total = n + before;
        let push = Mode::Push(NatsMode::Jetstream);
        let mut relay = match start {
            Start::Replayed => {
                let always = u32::MAX.to_string();
                self.start_relay_with(&tag, &collection, &prefix, push, &["--max-replay", &always])?
            }
            _ => self.start_relay(&tag, &collection, &prefix, push)?,
        };
        let began = Instant::now();
        let progress = report::progress(n, &format!("backlog drain{}", keys.label()));
        let limit = Duration::from_secs(3600);
        // Drained once the relay has marked every message, which it does
        // only once JetStream has stored it: its own count of its marks
        // costs the server nothing while the last marks are made. A count
        // that stops short (a mark applied whose reply was lost, and so not
        // counted) is settled by asking the collection, and timed to its
        // answer. The collection and the JetStream stream are counted in
        // full after.
        let mut marks = MarkCount::default();
        let ended = loop {
            if let Some(ended) = marks.all_marked(&relay, &outbox, n).await? {
                break ended;
            }
            if began.elapsed() > limit {
                return Err(Error::Bench(
                    "the backlog was not delivered and marked within an hour".into(),
                ));
            }
            if relay.exited() {
                return Err(Error::Bench(format!(
                    "the relay of the drain exited; see {}",
                    self.config
                        .output
                        .join(format!("relay-{tag}.log"))
                        .display()
                )));
            }
            progress.set_position(marks.counted());
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let seconds = ended.duration_since(began).as_secs_f64();
        let first_mark_seconds = marks
            .first_at
            .map(|at| at.duration_since(began).as_secs_f64());
        progress.finish_and_clear();
        let usage = relay.usage();
        relay.stop(Duration::from_secs(15)).await;
        let failed = |e| Error::mongo("counting the marked messages failed", e);
        let marked = outbox
            .count_documents(doc! { "status": "processed" })
            .await
            .map_err(failed)?;
        if (marked as usize) < total {
            return Err(Error::Bench(format!(
                "the drain marked {marked} of {total} messages processed (see relay-{tag}.log)"
            )));
        }
        let stored = self.stored_messages(&stream).await?;
        if (stored as usize) < total {
            return Err(Error::Bench(format!(
                "the drain marked every message, but JetStream stream {stream:?} holds {stored} \
                 of {total} (see relay-{tag}.log)"
            )));
        }
        if start != Start::First {
            self.check_resumed(&tag, n, start)?;
        }
        Ok(Drained {
            seconds,
            first_mark_seconds,
            relay: usage,
        })
    }

    /// A resumed drain that lost its place (the server's oplog too short to
    /// hold the backlog) measured a catch-up pass it did not choose, one
    /// that could not count its backlog measured a replay it did not
    /// choose, and a replay that caught up measured no replay: refused.
    fn check_resumed(&self, tag: &str, n: usize, start: Start) -> Result<()> {
        let log = self.config.output.join(format!("relay-{tag}.log"));
        let text = std::fs::read_to_string(&log)
            .map_err(|e| Error::io(format!("cannot read {}", log.display()), e))?;
        if start == Start::Replayed && text.contains(said::PASS_QUEUED) {
            return Err(Error::Bench(format!(
                "the replayed drain caught up from the collection instead (see {})",
                log.display()
            )));
        }
        if text.contains(said::NOT_COUNTED) {
            return Err(Error::Bench(format!(
                "the resumed drain could not count its backlog, and replayed it (see {})",
                log.display()
            )));
        }
        if text.contains(said::CANNOT_RESUME) {
            return Err(Error::Bench(format!(
                "the resumed drain could not resume (see {}): the server's oplog does not hold \
                 the backlog; give it room for {} more entries",
                log.display(),
                n
            )));
        }
        Ok(())
    }

    /// Runs a relay on the empty collection, writing a message every 200 ms
    /// until it has stored a stream position, then stops it once all are
    /// delivered and marked. Returns how many messages it wrote.
    async fn store_a_position(
        &self,
        tag: &str,
        outbox: &mongodb::Collection<Document>,
        prefix: &str,
        stream: &str,
    ) -> Result<usize> {
        crate::setup::ensure_sweep_index(outbox).await?;
        let first = format!("{tag}_first");
        let relay = self.start_relay(
            &first,
            outbox.name(),
            prefix,
            Mode::Push(NatsMode::Jetstream),
        )?;
        let checkpoints = self.database.collection::<Document>("outbox_checkpoints");
        let stored = doc! {
            "_id": format!("{}.{}", self.database.name(), outbox.name()),
            "token": { "$exists": true },
        };
        let failed = |e| Error::mongo("waiting for the first relay failed", e);
        let within = Duration::from_secs(60);
        let began = Instant::now();
        let mut written = 0;
        loop {
            if began.elapsed() > within {
                return Err(Error::Bench(format!(
                    "the first relay of the resumed drain stored no position within {within:?}"
                )));
            }
            let has_position = checkpoints
                .count_documents(stored.clone())
                .await
                .map_err(failed)?;
            let marked = outbox
                .count_documents(doc! { "status": "processed" })
                .await
                .map_err(failed)?;
            if has_position > 0
                && marked as usize == written
                && self.stored_messages(stream).await? as usize >= written
            {
                break;
            }
            if has_position == 0 {
                self.insert_backlog(outbox, 1, Keys::None).await?;
                written += 1;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        relay.stop(Duration::from_secs(15)).await;
        Ok(written)
    }

    async fn insert_backlog(
        &self,
        outbox: &mongodb::Collection<Document>,
        n: usize,
        keys: Keys,
    ) -> Result<()> {
        let progress = report::progress(n, "writing the backlog");
        let padding = "x".repeat(self.config.payload_bytes);
        for start in (0..n).step_by(1000) {
            let batch = (start..n.min(start + 1000)).map(|i| {
                let mut payload = doc! { "n": i as i64 };
                if !padding.is_empty() {
                    payload.insert("padding", padding.as_str());
                }
                let key = keys.of(i);
                // As the writers store it: a group of relays partitions by it.
                let mut message = doc! {
                    "_id": ObjectId::new(), "type": "order.placed", "payload": payload,
                    "status": "pending", "keyHash": crate::contract::stored_key_hash(key.as_deref()),
                };
                if let Some(key) = key {
                    message.insert("key", key);
                }
                message
            });
            outbox
                .insert_many(batch)
                .await
                .map_err(|e| Error::mongo("writing the backlog failed", e))?;
            progress.set_position(n.min(start + 1000) as u64);
        }
        progress.finish_and_clear();
        Ok(())
    }

    async fn clean_up(&self) {
        if let Err(error) = self.database.drop().await {
            tracing::warn!(%error, "could not drop the benchmark database");
        }
        let jetstream = async_nats::jetstream::new(self.nats.clone());
        let prefix = self.database.name().to_uppercase();
        let mut names = jetstream.stream_names();
        let mut ours = Vec::new();
        while let Some(Ok(name)) = futures::StreamExt::next(&mut names).await {
            if name.starts_with(&prefix) {
                ours.push(name);
            }
        }
        for name in ours {
            let _ = jetstream.delete_stream(&name).await;
        }
    }
}

/// A drain relay's count of its marks: when it last moved, and when the
/// collection was last asked.
#[derive(Default)]
struct MarkCount {
    last: u64,
    /// When the relay's count was first seen above nothing.
    first_at: Option<Instant>,
    /// `None` until the relay's metrics answer.
    moved_at: Option<Instant>,
    asked_at: Option<Instant>,
}

impl MarkCount {
    /// How long a count may stand still short of the backlog before the
    /// collection is asked, and how often it is asked.
    const STILL: Duration = Duration::from_secs(2);

    /// How long a count may stand still at nothing before the collection
    /// is asked: longer than a relay's start over a large backlog.
    const STARTING: Duration = Duration::from_secs(60);

    /// When the relay had marked all `n`: now, by its own count; or, where
    /// that has stood still short of it, when the collection was found to
    /// hold nothing pending (an end no earlier than the last mark's).
    /// `None` while marks remain, or while the count cannot be read.
    async fn all_marked(
        &mut self,
        relay: &RelayProcess,
        outbox: &mongodb::Collection<Document>,
        n: usize,
    ) -> Result<Option<Instant>> {
        let Some(count) = relay.processed().await else {
            return Ok(None);
        };
        if count > 0 && count < n as u64 && self.first_at.is_none() {
            self.first_at = Some(Instant::now());
        }
        if count >= n as u64 {
            return Ok(Some(Instant::now()));
        }
        if count != self.last || self.moved_at.is_none() {
            (self.last, self.moved_at) = (count, Some(Instant::now()));
            return Ok(None);
        }
        // A count still at nothing is most likely a relay still starting:
        // the question below is for a count that stopped short at the end,
        // and asked now it would load the server the relay's start is
        // reading (a server that reads every pending message to answer it
        // takes seconds over a million).
        let still = if count == 0 {
            Self::STARTING
        } else {
            Self::STILL
        };
        if self.moved_at.is_some_and(|at| at.elapsed() < still)
            || self.asked_at.is_some_and(|at| at.elapsed() < Self::STILL)
        {
            return Ok(None);
        }
        let asked_at = Instant::now();
        self.asked_at = Some(asked_at);
        let pending = outbox
            .find_one(doc! { "status": "pending" })
            .projection(doc! { "_id": 1 })
            .await
            .map_err(|e| Error::mongo("asking for pending messages failed", e))?;
        if pending.is_some() {
            return Ok(None);
        }
        tracing::warn!(
            counted = count,
            backlog = n,
            "the relay counted fewer marks than the backlog, and none is pending: the drain is \
             timed to when the collection said so"
        );
        Ok(Some(asked_at))
    }

    /// The relay's count as last read.
    fn counted(&self) -> u64 {
        self.last
    }
}

/// Marks the named documents processed, as the relay's completion does.
async fn mark_named(outbox: &mongodb::Collection<Document>, ids: &[ObjectId]) -> Result<()> {
    outbox
        .update_many(
            doc! { "_id": { "$in": ids }, "status": "pending" },
            doc! { "$set": { "status": "processed", "processedAt": DateTime::now() } },
        )
        .await
        .map_err(|e| Error::mongo("marking documents failed", e))?;
    Ok(())
}

/// An offered rate as the results name it: its number, or "max".
pub(crate) fn rate_label(rate: Option<u32>) -> String {
    rate.map_or("max".into(), |rate| rate.to_string())
}

/// Messages a run sends one at a time before its load (see `Bench::settle`).
const READY_MESSAGES: usize = 3;

/// The longest a run at an offered rate lasts: at 20 a second, the
/// default count would take a hundred seconds a mode.
const LONGEST_RUN: Duration = Duration::from_secs(60);

/// How many messages a run at `rate` writes: `count`, or as many as the
/// rate offers in [`LONGEST_RUN`] if that is fewer.
fn messages_at(rate: Option<u32>, count: usize) -> usize {
    let in_longest_run = |rate: u32| (rate as u64 * LONGEST_RUN.as_secs()) as usize;
    rate.map_or(count, |rate| count.min(in_longest_run(rate)))
}

/// How long a mode may take beyond the load itself.
fn mode_wait(mode: Mode) -> Duration {
    match mode {
        Mode::Poll(every) => every * 3,
        _ => Duration::ZERO,
    }
}

/// The nearest-rank percentile, in milliseconds.
fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_low_rate_writes_a_minutes_worth_at_most() {
        assert_eq!(messages_at(Some(20), 2000), 1200);
        assert_eq!(messages_at(Some(100), 2000), 2000);
        assert_eq!(messages_at(None, 2000), 2000);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let sorted: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&sorted, 0.5), 50.0);
        assert_eq!(percentile(&sorted, 0.99), 99.0);
        assert_eq!(percentile(&sorted, 1.0), 100.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
