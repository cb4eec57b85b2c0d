//! Command-line flags, and how they combine with the config file.
//!
//! Every relay setting can come from a flag, its `OUTBOX_*` environment
//! variable, or the `--config` TOML file, in that order of strength. The
//! flags are built from the settings' declarations in the library
//! ([`RelayConfig::SETTINGS`]), so names, help and defaults are written once.

use std::path::PathBuf;

use std::collections::HashMap;
use std::time::Duration;

use bson::oid::ObjectId;
use clap::builder::PossibleValuesParser;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches, Parser, Subcommand, ValueEnum};
use outbox_relay::admin::dlq::Selection;
use outbox_relay::config::{Given, Origin, Setting, SettingsFile, Shape, Value};
use outbox_relay::{Error, RelayConfig, Result};

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
    #[arg(long, default_value = "1s,100ms", value_delimiter = ',', value_parser = duration)]
    pub poll_intervals: Vec<Duration>,
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
        if self.count == 0 {
            return Err(Error::Config("--count must be at least 1".into()));
        }
        let relay_binary = std::env::current_exe()
            .map_err(|e| Error::io("cannot find this program's path to start the relay", e))?;
        Ok(outbox_relay::bench::BenchConfig {
            mongodb_uri: self.mongodb_uri,
            nats_url: self.nats_url,
            relay_binary,
            rates,
            count: self.count,
            poll_intervals: self.poll_intervals,
            backlog: self.backlog,
            output: self.output,
            server: self.server.unwrap_or(server),
        })
    }
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

/// The relay's settings on the command line: `--config` and one flag per
/// [`RelayConfig::SETTINGS`] entry, each with its `OUTBOX_*` variable.
///
/// Only values given as flags or in the environment are kept here; the
/// defaults clap shows in `--help` are left out, so that a config file's
/// value beats them when the settings are resolved.
#[derive(Debug, Clone, Default)]
pub struct RunArgs {
    config: Option<PathBuf>,
    given: HashMap<&'static str, Given>,
}

impl RunArgs {
    /// Combines flags, the environment, the config file and the defaults,
    /// strongest first, into a checked configuration.
    pub fn resolve(self) -> Result<RelayConfig> {
        let file = match &self.config {
            Some(path) => SettingsFile::load(path)?,
            None => SettingsFile::default(),
        };
        let mut given = self.given;
        RelayConfig::resolve(|setting| {
            given
                .remove(setting.key)
                .or_else(|| file.get(setting.key).cloned())
        })
    }
}

const CONFIG: &str = "config";

impl Args for RunArgs {
    fn augment_args(command: clap::Command) -> clap::Command {
        let config = Arg::new(CONFIG)
            .long(CONFIG)
            .env("OUTBOX_CONFIG")
            .value_name("FILE")
            .value_parser(clap::value_parser!(PathBuf))
            .help("TOML file with any of these settings (flag names with '_' for '-')");
        RelayConfig::SETTINGS
            .iter()
            .fold(command.arg(config), |command, setting| {
                command.arg(setting_arg(setting))
            })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

/// The flag of one setting, from its declaration.
fn setting_arg(setting: &Setting) -> Arg {
    let mut arg = Arg::new(setting.key)
        .long(setting.flag())
        .env(setting.env())
        .help(setting.help())
        .value_name(setting.key.to_ascii_uppercase());
    arg = match setting.shape {
        Shape::One => arg.action(ArgAction::Set),
        Shape::Many => arg.action(ArgAction::Append).value_delimiter(','),
        Shape::Switch => arg
            .action(ArgAction::Set)
            .num_args(0..=1)
            .default_missing_value("true"),
    };
    let choices = (setting.choices)();
    if !choices.is_empty() {
        arg = arg.value_parser(PossibleValuesParser::new(choices));
    }
    if let Some(default) = setting.default_text() {
        arg = arg.default_value(default);
    }
    arg
}

impl FromArgMatches for RunArgs {
    fn from_arg_matches(matches: &ArgMatches) -> std::result::Result<Self, clap::Error> {
        let mut args = RunArgs::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(
        &mut self,
        matches: &ArgMatches,
    ) -> std::result::Result<(), clap::Error> {
        if let Some(path) = matches.get_one::<PathBuf>(CONFIG) {
            self.config = Some(path.clone());
        }
        for setting in RelayConfig::SETTINGS {
            let origin = match matches.value_source(setting.key) {
                Some(ValueSource::CommandLine) => Origin::Flag,
                Some(ValueSource::EnvVariable) => Origin::Environment,
                _ => continue,
            };
            let values = matches
                .get_many::<String>(setting.key)
                .map(|values| values.cloned().collect())
                .unwrap_or_default();
            self.given.insert(setting.key, Given { values, origin });
        }
        Ok(())
    }
}
