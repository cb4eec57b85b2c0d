//! Command-line flags, and how they combine with the config file.
//!
//! Every setting can come from a flag, its `OUTBOX_*` environment variable,
//! or the `--config` TOML file, in that order of strength. Flags are all
//! optional here so that an unset flag lets the file's value through.

use std::path::PathBuf;

use bson::oid::ObjectId;
use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_relay::admin::dlq::Selection;
use outbox_relay::config::{parse_bytes, parse_duration, parse_metrics_addr, FileConfig};
use outbox_relay::{Error, NatsMode, RelayConfig, RelayMode, Result};

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Delivers MongoDB outbox messages to NATS as they commit"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,

    /// Log format: human-readable text, or JSON lines for collectors.
    #[arg(long, global = true, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Tail the outbox and publish each message as it commits.
    Run(RunArgs),
    /// Deliver what is due now with the sweep, print the counts, and exit.
    Sweep(SweepArgs),
    /// Measure delivery latency: push against poll against the change-stream floor.
    Bench(BenchArgs),
    /// Run the start-up checks alone; exit 0 if all pass, else the failed check's code.
    Check(RunArgs),
    /// Show the outbox: counts, oldest pending, failures by type, leader, lag, oplog.
    Status(StatusArgs),
    /// List, replay or discard failed messages (the dead letters).
    #[command(subcommand)]
    Dlq(DlqCommand),
}

/// `outbox-relay status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON for scripts.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub settings: RunArgs,
}

/// `outbox-relay dlq ...`.
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List the newest failed messages.
    List {
        /// Only messages of this type.
        #[arg(long = "type")]
        message_type: Option<String>,
        /// At most this many (at least 1).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Print JSON for scripts.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
    /// Put failed messages back to pending, attempts reset, last error kept in errorHistory.
    Replay {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Show how many would be replayed, and change nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
    /// Delete failed messages (asks first unless --yes).
    Discard {
        #[command(flatten)]
        selection: SelectionArgs,
        /// Show how many would be deleted, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        settings: RunArgs,
    },
}

/// Which failed messages a dlq command acts on: exactly one of these.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct SelectionArgs {
    /// The message with this _id (repeatable).
    #[arg(long = "id")]
    pub ids: Vec<String>,
    /// Every failed message of this type.
    #[arg(long = "type")]
    pub message_type: Option<String>,
    /// Every failed message.
    #[arg(long)]
    pub all: bool,
}

impl SelectionArgs {
    /// The checked selection.
    pub fn resolve(self) -> Result<Selection> {
        if self.all {
            return Ok(Selection::All);
        }
        if let Some(message_type) = self.message_type {
            return Ok(Selection::Type(message_type));
        }
        self.ids
            .iter()
            .map(|id| {
                ObjectId::parse_str(id.trim()).map_err(|_| {
                    Error::Config(format!(
                        "--id {id:?} is not an ObjectId (24 hexadecimal digits, as dlq list shows)"
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()
            .map(Selection::Ids)
    }
}

/// `outbox-relay bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// MongoDB to measure against (a database of its own is used and dropped).
    #[arg(
        long,
        env = "OUTBOX_MONGODB_URI",
        default_value = "mongodb://127.0.0.1:27017"
    )]
    pub mongodb_uri: String,
    /// NATS to measure against.
    #[arg(long, env = "OUTBOX_NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Offered rates in messages a second, comma-separated; "max" is as fast as it goes.
    #[arg(long, default_value = "100,1000,max", value_delimiter = ',')]
    pub rates: Vec<String>,
    /// Messages per run.
    #[arg(long, default_value_t = 2000)]
    pub count: usize,
    /// Poll intervals to compare against, comma-separated.
    #[arg(long, default_value = "1s,100ms", value_delimiter = ',')]
    pub poll_intervals: Vec<String>,
    /// Messages in the backlog drain; 0 skips it.
    #[arg(long, default_value_t = 100_000)]
    pub backlog: usize,
    /// Folder for bench.json, latency-cdf.svg and the relay logs.
    #[arg(long, default_value = "bench-results")]
    pub output: PathBuf,
    /// How to describe the MongoDB server in the results [default: its buildInfo version].
    #[arg(long)]
    pub server: Option<String>,
}

impl BenchArgs {
    /// The checked benchmark settings.
    pub fn resolve(self, server: String) -> Result<outbox_relay::bench::BenchConfig> {
        let rates = self
            .rates
            .iter()
            .map(|rate| match rate.trim() {
                "max" => Ok(None),
                number => number
                    .parse::<u32>()
                    .ok()
                    .filter(|&r| r > 0)
                    .map(Some)
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "--rates: {number:?} is neither a positive number nor \"max\""
                        ))
                    }),
            })
            .collect::<Result<Vec<_>>>()?;
        let poll_intervals = self
            .poll_intervals
            .iter()
            .map(|every| parse_duration("poll-intervals", every))
            .collect::<Result<Vec<_>>>()?;
        if self.count == 0 {
            return Err(Error::Config("--count must be at least 1".into()));
        }
        let relay_binary = std::env::current_exe().map_err(|e| {
            Error::Config(format!(
                "cannot find this program's path to start the relay: {e}"
            ))
        })?;
        Ok(outbox_relay::bench::BenchConfig {
            mongodb_uri: self.mongodb_uri,
            nats_url: self.nats_url,
            relay_binary,
            rates,
            count: self.count,
            poll_intervals,
            backlog: self.backlog,
            output: self.output,
            server: self.server.unwrap_or(server),
        })
    }
}

/// `outbox-relay sweep --once`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// One pass over everything due, then exit (the only way a sweep runs alone for now).
    #[arg(long, required = true)]
    pub once: bool,
    /// Give up (exit code 9) if the servers keep the sweep from finishing this long, e.g. during an outage [default: 60s].
    #[arg(long, env = "OUTBOX_GIVE_UP_AFTER")]
    pub give_up_after: Option<String>,
    #[command(flatten)]
    pub settings: RunArgs,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ModeArg {
    Jetstream,
    Core,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RelayModeArg {
    Push,
    Poll,
}

/// Settings of the relay.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// TOML file with any of these settings (flag names with '_' for '-').
    #[arg(long, env = "OUTBOX_CONFIG")]
    pub config: Option<PathBuf>,
    /// MongoDB connection string (a replica set or sharded cluster).
    #[arg(long, env = "OUTBOX_MONGODB_URI")]
    pub mongodb_uri: Option<String>,
    /// Database holding the outbox collection.
    #[arg(long, env = "OUTBOX_DATABASE")]
    pub database: Option<String>,
    /// Outbox collection [default: outbox].
    #[arg(long, env = "OUTBOX_COLLECTION")]
    pub collection: Option<String>,
    /// Collection for resume tokens [default: outbox_checkpoints].
    #[arg(long, env = "OUTBOX_CHECKPOINT_COLLECTION")]
    pub checkpoint_collection: Option<String>,
    /// NATS server URL [default: nats://127.0.0.1:4222].
    #[arg(long, env = "OUTBOX_NATS_URL")]
    pub nats_url: Option<String>,
    /// Subject prefix: messages go to <prefix>.<type> [default: outbox].
    #[arg(long, env = "OUTBOX_SUBJECT_PREFIX")]
    pub subject_prefix: Option<String>,
    /// Also publish explicit subjects matching this NATS pattern, e.g. 'billing.>' (repeatable, or comma-separated); '$…' and '_INBOX…' subjects never.
    #[arg(
        long = "allow-subject",
        env = "OUTBOX_ALLOW_SUBJECT",
        value_delimiter = ','
    )]
    pub allow_subject: Vec<String>,
    /// jetstream (acknowledged, deduplicated) or core (at most once per attempt) [default: jetstream].
    #[arg(long, env = "OUTBOX_NATS_MODE", value_enum)]
    pub nats_mode: Option<ModeArg>,
    /// Create a JetStream stream of this name for <prefix>.> if none captures it (for local use).
    #[arg(long, env = "OUTBOX_CREATE_STREAM")]
    pub create_stream: Option<String>,
    /// Publishes awaiting acknowledgement at once [default: 256].
    #[arg(long, env = "OUTBOX_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,
    /// Most messages marked with one update [default: 500].
    #[arg(long, env = "OUTBOX_BATCH_SIZE")]
    pub batch_size: Option<usize>,
    /// Most bytes of messages read and not yet recorded; sources wait beyond it, e.g. 64MiB [default: 64MiB].
    #[arg(long, env = "OUTBOX_MAX_BUFFERED_BYTES")]
    pub max_buffered_bytes: Option<String>,
    /// How often the resume token is written while messages flow [default: 500ms].
    #[arg(long, env = "OUTBOX_CHECKPOINT_INTERVAL")]
    pub checkpoint_interval: Option<String>,
    /// How long the server holds an empty change-stream read [default: 500ms].
    #[arg(long, env = "OUTBOX_MAX_AWAIT_TIME")]
    pub max_await_time: Option<String>,
    /// How often an idle stream's position is written [default: 10s].
    #[arg(long, env = "OUTBOX_IDLE_CHECKPOINT_INTERVAL")]
    pub idle_checkpoint_interval: Option<String>,
    /// How long the change stream may lag a commit; passes over the collection leave younger messages to it [default: 5s].
    #[arg(long, env = "OUTBOX_GRACE_PERIOD")]
    pub grace_period: Option<String>,
    /// How long a publish waits for its acknowledgement [default: 5s].
    #[arg(long, env = "OUTBOX_ACK_TIMEOUT")]
    pub ack_timeout: Option<String>,
    /// How long a graceful stop may take [default: 10s].
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout: Option<String>,
    /// push: change stream plus a slow sweep; poll: the sweep alone [default: push].
    #[arg(long, env = "OUTBOX_MODE", value_enum)]
    pub mode: Option<RelayModeArg>,
    /// Time between sweeps in push mode [default: 10s].
    #[arg(long, env = "OUTBOX_SWEEP_INTERVAL")]
    pub sweep_interval: Option<String>,
    /// Time between sweeps in poll mode [default: 1s].
    #[arg(long, env = "OUTBOX_POLL_INTERVAL")]
    pub poll_interval: Option<String>,
    /// Age at which a processor's claim on a message is stale and may be taken over [default: 60s].
    #[arg(long, env = "OUTBOX_LOCK_TIMEOUT")]
    pub lock_timeout: Option<String>,
    /// Keep processed and failed messages this long, e.g. 7d (TTL indexes); unset keeps them.
    #[arg(long, env = "OUTBOX_RETENTION")]
    pub retention: Option<String>,
    /// Install a $jsonSchema validator enforcing the document contract on the outbox collection.
    #[arg(long, env = "OUTBOX_INSTALL_VALIDATOR")]
    pub install_validator: bool,
    /// Refused attempts after which a message is marked failed [default: 10].
    #[arg(long, env = "OUTBOX_MAX_ATTEMPTS")]
    pub max_attempts: Option<u32>,
    /// Delay after the first refused attempt, doubling each time [default: 1s].
    #[arg(long, env = "OUTBOX_RETRY_INITIAL_DELAY")]
    pub retry_initial_delay: Option<String>,
    /// Longest delay between refused attempts [default: 5m].
    #[arg(long, env = "OUTBOX_RETRY_MAX_DELAY")]
    pub retry_max_delay: Option<String>,
    /// How long the leader's lease lasts without renewal [default: 10s].
    #[arg(long, env = "OUTBOX_LEASE_DURATION")]
    pub lease_duration: Option<String>,
    /// How often the leader renews its lease [default: 3s].
    #[arg(long, env = "OUTBOX_LEASE_RENEW_INTERVAL")]
    pub lease_renew_interval: Option<String>,
    /// How often a standby checks whether the lease is free [default: 500ms].
    #[arg(long, env = "OUTBOX_STANDBY_POLL_INTERVAL")]
    pub standby_poll_interval: Option<String>,
    /// Address serving /metrics, /healthz and /readyz, or "off" [default: 127.0.0.1:9464].
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// How often pending and failed depths and the oplog's headroom are read [default: 10s].
    #[arg(long, env = "OUTBOX_COLLECT_INTERVAL")]
    pub collect_interval: Option<String>,
    /// Warn when the oplog holds less history than this before the stored position [default: 1h].
    #[arg(long, env = "OUTBOX_OPLOG_HEADROOM_WARNING")]
    pub oplog_headroom_warning: Option<String>,
}

/// The metrics address the command line serves when none is given.
const DEFAULT_METRICS_ADDR: &str = "127.0.0.1:9464";

impl RunArgs {
    /// Combines flags, the config file and defaults into a checked configuration.
    pub fn resolve(self) -> Result<RelayConfig> {
        let file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let mongodb_uri = self.mongodb_uri.or(file.mongodb_uri).ok_or_else(|| {
            Error::Config(
                "no MongoDB connection string: pass --mongodb-uri or set OUTBOX_MONGODB_URI".into(),
            )
        })?;
        let database = self.database.or(file.database).ok_or_else(|| {
            Error::Config("no database: pass --database or set OUTBOX_DATABASE".into())
        })?;
        let mut config = RelayConfig::new(mongodb_uri, database);
        set(&mut config.collection, self.collection.or(file.collection));
        set(
            &mut config.checkpoint_collection,
            self.checkpoint_collection.or(file.checkpoint_collection),
        );
        set(&mut config.nats_url, self.nats_url.or(file.nats_url));
        set(
            &mut config.subject_prefix,
            self.subject_prefix.or(file.subject_prefix),
        );
        config.allowed_subjects = if self.allow_subject.is_empty() {
            file.allow_subject.unwrap_or_default()
        } else {
            self.allow_subject
        };
        let mode = self.nats_mode.map(|m| match m {
            ModeArg::Jetstream => NatsMode::Jetstream,
            ModeArg::Core => NatsMode::Core,
        });
        set(&mut config.nats_mode, mode.or(file.nats_mode));
        config.create_stream = self.create_stream.or(file.create_stream);
        set(
            &mut config.max_in_flight,
            self.max_in_flight.or(file.max_in_flight),
        );
        set(&mut config.batch_size, self.batch_size.or(file.batch_size));
        if let Some(bytes) = self.max_buffered_bytes.or(file.max_buffered_bytes) {
            config.max_buffered_bytes = parse_bytes("max-buffered-bytes", &bytes)?;
        }
        let mode = self.mode.map(|m| match m {
            RelayModeArg::Push => RelayMode::Push,
            RelayModeArg::Poll => RelayMode::Poll,
        });
        set(&mut config.mode, mode.or(file.mode));
        config.install_validator =
            self.install_validator || file.install_validator.unwrap_or(false);
        set(
            &mut config.retry.max_attempts,
            self.max_attempts.or(file.max_attempts),
        );
        config.metrics_addr = parse_metrics_addr(
            &self
                .metrics_addr
                .or(file.metrics_addr)
                .unwrap_or_else(|| DEFAULT_METRICS_ADDR.to_owned()),
        )?;
        if let Some(retention) = self.retention.or(file.retention) {
            config.retention = Some(parse_duration("retention", &retention)?);
        }
        let durations = [
            (
                "checkpoint-interval",
                &mut config.checkpoint_interval,
                self.checkpoint_interval.or(file.checkpoint_interval),
            ),
            (
                "max-await-time",
                &mut config.max_await_time,
                self.max_await_time.or(file.max_await_time),
            ),
            (
                "idle-checkpoint-interval",
                &mut config.idle_checkpoint_interval,
                self.idle_checkpoint_interval
                    .or(file.idle_checkpoint_interval),
            ),
            (
                "grace-period",
                &mut config.grace_period,
                self.grace_period.or(file.grace_period),
            ),
            (
                "ack-timeout",
                &mut config.ack_timeout,
                self.ack_timeout.or(file.ack_timeout),
            ),
            (
                "shutdown-timeout",
                &mut config.shutdown_timeout,
                self.shutdown_timeout.or(file.shutdown_timeout),
            ),
            (
                "sweep-interval",
                &mut config.sweep_interval,
                self.sweep_interval.or(file.sweep_interval),
            ),
            (
                "poll-interval",
                &mut config.poll_interval,
                self.poll_interval.or(file.poll_interval),
            ),
            (
                "lock-timeout",
                &mut config.lock_timeout,
                self.lock_timeout.or(file.lock_timeout),
            ),
            (
                "retry-initial-delay",
                &mut config.retry.initial_delay,
                self.retry_initial_delay.or(file.retry_initial_delay),
            ),
            (
                "retry-max-delay",
                &mut config.retry.max_delay,
                self.retry_max_delay.or(file.retry_max_delay),
            ),
            (
                "lease-duration",
                &mut config.lease.duration,
                self.lease_duration.or(file.lease_duration),
            ),
            (
                "lease-renew-interval",
                &mut config.lease.renew_interval,
                self.lease_renew_interval.or(file.lease_renew_interval),
            ),
            (
                "standby-poll-interval",
                &mut config.lease.standby_poll_interval,
                self.standby_poll_interval.or(file.standby_poll_interval),
            ),
            (
                "collect-interval",
                &mut config.collect_interval,
                self.collect_interval.or(file.collect_interval),
            ),
            (
                "oplog-headroom-warning",
                &mut config.oplog_headroom_warning,
                self.oplog_headroom_warning.or(file.oplog_headroom_warning),
            ),
        ];
        for (name, target, value) in durations {
            if let Some(value) = value {
                *target = parse_duration(name, &value)?;
            }
        }
        config.validate()?;
        Ok(config)
    }
}

fn set<T>(target: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *target = value;
    }
}
