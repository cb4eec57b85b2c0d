//! The command line: a thin layer over the library. Subcommands and their
//! flags are here; the relay's settings (`settings`) are built from the
//! library's declarations, and the benchmark's flags (`bench`) come with
//! the `bench` feature. A command with more to say than a line (`dlq`,
//! `inbox`, `replay`) has a module of its own, with what it prints.

pub mod audit;
#[cfg(feature = "bench")]
pub mod bench;
pub mod dlq;
pub mod inbox;
pub mod replay;
mod settings;

use std::time::{Duration, SystemTime};

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_relay::config::Value;
use outbox_relay::replay::{parse_moment, Selection};
use outbox_relay::{Error, RelayConfig, Result};

pub use settings::RunArgs;

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
    #[arg(long, global = true, env = "OUTBOX_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, display_order = 1000)]
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
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
    /// Run the start-up checks alone; exit 0 if all pass, else the failed check's code.
    Check(RunArgs),
    /// Show the outbox: counts, oldest pending, failures by type, leader, lag, oplog.
    Status(StatusArgs),
    /// List, replay or discard failed messages (the dead letters).
    #[command(subcommand)]
    Dlq(dlq::DlqCommand),
    /// Send delivered messages again, chosen by time, type, subject or key, to their subjects or a new prefix.
    Replay(Box<replay::ReplayArgs>),
    /// Check that every delivered message is in the stream, and publish again what is missing.
    Audit(Box<audit::AuditArgs>),
    /// Look into a consumer's inbox (see outbox_relay::inbox).
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
}

/// Which messages `replay` and `audit` take: a range of commit time, and
/// types, subjects and keys.
#[derive(Debug, Args)]
pub struct WindowArgs {
    /// Messages created at or after this: an RFC 3339 time, or a duration ago (2h, 7days).
    #[arg(long)]
    pub since: Option<String>,
    /// Messages created before this: an RFC 3339 time, or a duration ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Messages of types matching this NATS-style pattern (order.*, billing.>); repeatable.
    #[arg(long = "type")]
    pub types: Vec<String>,
    /// Messages first delivered to subjects matching this pattern; repeatable.
    #[arg(long = "subject")]
    pub subjects: Vec<String>,
    /// Messages of this key; repeatable.
    #[arg(long = "key")]
    pub keys: Vec<String>,
    /// Every message (needed when no other criterion is given).
    #[arg(long)]
    pub all: bool,
}

impl WindowArgs {
    /// The checked selection; without a criterion, `--all` must say that
    /// `everything` is meant, for `command`.
    pub fn selection(&self, command: &str, everything: &str) -> Result<Selection> {
        let now = SystemTime::now();
        let moment = |flag: &str, text: &Option<String>| {
            text.as_deref()
                .map(|text| parse_moment(text, now))
                .transpose()
                .map_err(|e| Error::Config(format!("{flag} {e}")))
        };
        let selection = Selection {
            since: moment("--since", &self.since)?,
            until: moment("--until", &self.until)?,
            types: self.types.clone(),
            subjects: self.subjects.clone(),
            keys: self.keys.clone(),
            include_failed: false,
        };
        if selection.is_everything() && !self.all {
            return Err(Error::Config(format!(
                "say what to {command} (--since, --until, --type, --subject, --key), or --all for \
                 {everything}"
            )));
        }
        Ok(selection)
    }
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

/// Reads a duration flag as the settings are read.
fn duration(text: &str) -> std::result::Result<Duration, String> {
    Duration::parse(text.trim())
}

/// Reads `--give-up-after`: long enough for a pass, at most a day.
fn give_up_after(text: &str) -> std::result::Result<Duration, String> {
    let range = Duration::from_secs(1)..=Duration::from_secs(86_400);
    let every = duration(text)?;
    if range.contains(&every) {
        Ok(every)
    } else {
        Err("is out of range: it must be from 1s to 1day".to_owned())
    }
}

/// `outbox-relay sweep --once`.
#[derive(Debug, Args)]
pub struct SweepArgs {
    /// One pass over everything due, then exit (the only way a sweep runs alone for now).
    #[arg(long, required = true)]
    pub once: bool,
    /// Give up (exit code 9) if the servers keep the sweep from finishing this long, e.g. during an outage (1s to 1day).
    #[arg(long, env = "OUTBOX_GIVE_UP_AFTER", default_value = "60s", value_parser = give_up_after)]
    pub give_up_after: Duration,
    #[command(flatten)]
    pub settings: RunArgs,
}

/// The database `config` names, connected to as every command connects.
pub async fn open_database(config: &RelayConfig) -> Result<mongodb::Database> {
    let client = outbox_relay::connect::connect_mongodb(&config.mongodb_uri).await?;
    let database = client.database(&config.database);
    Ok(outbox_relay::connect::coordinated(
        &database,
        config.lease_duration,
    ))
}

/// A command's result as JSON, for scripts (`--json`).
pub fn to_json(value: &impl serde::Serialize) -> Result<String> {
    serde_json::to_string_pretty(value)
        .map_err(|e| Error::Internal(format!("cannot write the result as JSON: {e}")))
}
