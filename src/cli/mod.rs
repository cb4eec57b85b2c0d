//! The command line: a thin layer over the library. Subcommands and their
//! flags are here; the relay's settings (`settings`) are built from the
//! library's declarations, and the benchmark's flags (`bench`) come with
//! the `bench` feature. A command with more to say than a line (`dlq`,
//! `inbox`, `replay`) has a module of its own, with what it prints.

#[cfg(feature = "bench")]
pub mod bench;
pub mod dlq;
pub mod inbox;
pub mod replay;
mod settings;

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use outbox_relay::config::Value;
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
    /// Look into a consumer's inbox (see outbox_relay::inbox).
    #[command(subcommand)]
    Inbox(inbox::InboxCommand),
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
