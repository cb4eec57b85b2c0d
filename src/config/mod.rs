//! Relay settings: their types, defaults, validation and the TOML file form.
//!
//! Settings come from three places, strongest first: command-line flags
//! (or their `OUTBOX_*` environment variables), a `--config` TOML file, and
//! the defaults here. [`FileConfig`] is the file's shape; [`RelayConfig`] is
//! the checked result the relay runs with.

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use crate::contract::SubjectRules;
use crate::error::{Error, Result};

/// How messages are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NatsMode {
    /// JetStream: each publish is acknowledged by the stream, and repeats of
    /// a message id inside the stream's duplicate window are dropped.
    #[default]
    Jetstream,
    /// Core NATS: fire and forget; at most once per attempt.
    Core,
}

impl FromStr for NatsMode {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self> {
        match value {
            "jetstream" => Ok(NatsMode::Jetstream),
            "core" => Ok(NatsMode::Core),
            other => Err(Error::Config(format!(
                "nats-mode must be \"jetstream\" or \"core\", not {other:?}"
            ))),
        }
    }
}

/// Where messages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RelayMode {
    /// The change stream delivers at once; a slow sweep catches what it misses.
    #[default]
    Push,
    /// The sweep alone, every poll interval: for deployments without change
    /// streams, and as the baseline push is measured against.
    Poll,
}

/// Everything the relay runs with, checked.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// MongoDB connection string; must reach a replica set or sharded cluster.
    pub mongodb_uri: String,
    /// Database holding the outbox collection.
    pub database: String,
    /// The outbox collection.
    pub collection: String,
    /// Collection, in the same database, where resume tokens are kept.
    pub checkpoint_collection: String,
    /// NATS server URL(s), comma-separated.
    pub nats_url: String,
    /// Subject prefix for messages without an explicit `subject`; explicit
    /// subjects under it are allowed too.
    pub subject_prefix: String,
    /// NATS subject patterns (`billing.>`) of explicit subjects allowed
    /// besides the prefix. Subjects beginning with `$` or `_INBOX` never are.
    pub allowed_subjects: Vec<String>,
    /// JetStream or core NATS.
    pub nats_mode: NatsMode,
    /// Create a JetStream stream of this name for `<prefix>.>` if no stream
    /// captures those subjects yet.
    pub create_stream: Option<String>,
    /// Publishes awaiting their acknowledgement at once.
    pub max_in_flight: usize,
    /// Most messages marked processed with one update.
    pub batch_size: usize,
    /// Most bytes of messages read and not yet recorded, across the relay's
    /// stages; sources wait for room beyond it.
    pub max_buffered_bytes: u64,
    /// How often the resume token is written while messages flow.
    pub checkpoint_interval: Duration,
    /// How long the server holds an empty change-stream read open.
    pub max_await_time: Duration,
    /// How often an idle stream's newest position is written as the token.
    pub idle_checkpoint_interval: Duration,
    /// How long the change stream may take to show a committed message. A
    /// pass over the collection leaves younger messages to the stream, and
    /// the stream skips messages a catch-up pass queued for this long after it.
    pub grace_period: Duration,
    /// How long a publish may wait for its acknowledgement.
    pub ack_timeout: Duration,
    /// How long a graceful stop may take before the relay gives up on it.
    pub shutdown_timeout: Duration,
    /// When a message the broker refused is tried again, and when it is given up.
    pub retry: RetryPolicy,
    /// Push (change stream and sweep) or poll (sweep alone).
    pub mode: RelayMode,
    /// Time between sweeps in push mode.
    pub sweep_interval: Duration,
    /// Time between sweeps in poll mode.
    pub poll_interval: Duration,
    /// Age at which another processor's claim on a message is stale.
    pub lock_timeout: Duration,
    /// Keep processed and failed messages this long (TTL indexes); `None` keeps them.
    pub retention: Option<Duration>,
    /// Install a `$jsonSchema` validator enforcing the document contract.
    pub install_validator: bool,
    /// Leadership among several relays (push mode).
    pub lease: crate::lease::LeaseTiming,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None` serves nothing.
    pub metrics_addr: Option<SocketAddr>,
    /// How often the outbox's depths and the oplog's headroom are read.
    pub collect_interval: Duration,
    /// Oplog headroom under which the relay warns that its stored position
    /// is about to fall out of the server's history.
    pub oplog_headroom_warning: Duration,
}

/// Retries of messages the broker refused (not of broker outages, which
/// never count against a message).
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Delay after the first refusal.
    pub initial_delay: Duration,
    /// Longest delay between attempts.
    pub max_delay: Duration,
    /// Attempts after which a message is marked `failed`.
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            max_attempts: 10,
        }
    }
}

impl RetryPolicy {
    /// The delay before attempt `attempts + 1`: the initial delay doubled for
    /// each earlier attempt, capped, with jitter so that messages refused
    /// together are not retried together.
    pub fn delay_after(&self, attempts: u32) -> Duration {
        use backoff::backoff::Backoff;
        let doublings = attempts.saturating_sub(1).min(32);
        let base = self
            .initial_delay
            .saturating_mul(1u32 << doublings.min(31))
            .min(self.max_delay);
        let mut jittered = backoff::ExponentialBackoff {
            current_interval: base,
            initial_interval: base,
            max_interval: self.max_delay,
            randomization_factor: 0.2,
            max_elapsed_time: None,
            ..backoff::ExponentialBackoff::default()
        };
        jittered.next_backoff().unwrap_or(base)
    }

    /// Whether a message with this many attempts has used them all.
    pub fn exhausted(&self, attempts: u32) -> bool {
        attempts >= self.max_attempts
    }
}

impl RelayConfig {
    /// A configuration with every default, for the given server and database.
    pub fn new(mongodb_uri: impl Into<String>, database: impl Into<String>) -> Self {
        RelayConfig {
            mongodb_uri: mongodb_uri.into(),
            database: database.into(),
            collection: crate::writer::DEFAULT_COLLECTION.to_owned(),
            checkpoint_collection: "outbox_checkpoints".to_owned(),
            nats_url: "nats://127.0.0.1:4222".to_owned(),
            subject_prefix: crate::contract::DEFAULT_SUBJECT_PREFIX.to_owned(),
            allowed_subjects: Vec::new(),
            nats_mode: NatsMode::Jetstream,
            create_stream: None,
            max_in_flight: 256,
            batch_size: 500,
            max_buffered_bytes: 64 << 20,
            checkpoint_interval: Duration::from_millis(500),
            max_await_time: Duration::from_millis(500),
            idle_checkpoint_interval: Duration::from_secs(10),
            grace_period: Duration::from_secs(5),
            ack_timeout: Duration::from_secs(5),
            shutdown_timeout: Duration::from_secs(10),
            retry: RetryPolicy::default(),
            mode: RelayMode::Push,
            sweep_interval: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            lock_timeout: Duration::from_secs(60),
            retention: None,
            install_validator: false,
            lease: crate::lease::LeaseTiming::default(),
            metrics_addr: None,
            collect_interval: Duration::from_secs(10),
            oplog_headroom_warning: Duration::from_secs(3600),
        }
    }

    /// The longest time after a message may have reached the broker that
    /// the relay can publish it again: a standby taking over from a leader
    /// that stopped between publishing and recording (the lease), or a sweep
    /// taking over a stale claim (the lock timeout and one sweep interval),
    /// each plus an acknowledgement timeout. A JetStream duplicate window at
    /// least this long drops every such repeat. (A refused message was not
    /// stored, so its retry delays cannot cause a repeat.)
    pub fn redelivery_gap(&self) -> Duration {
        let sweep_interval = match self.mode {
            RelayMode::Push => self.sweep_interval,
            RelayMode::Poll => self.poll_interval,
        };
        self.lease.duration.max(self.lock_timeout + sweep_interval) + self.ack_timeout
    }

    /// Where the relay may publish: under the prefix, and the allow-list.
    pub fn subject_rules(&self) -> Result<SubjectRules> {
        let mut rules = SubjectRules::under(&self.subject_prefix)
            .map_err(|e| Error::Config(format!("subject-prefix cannot be used: {e}")))?;
        for pattern in &self.allowed_subjects {
            rules = rules
                .allow(pattern.trim())
                .map_err(|e| Error::Config(format!("allow-subject: {e}")))?;
        }
        Ok(rules)
    }

    /// Every count setting with its allowed range. The batch size bounds a
    /// mark's `$in` list (10,000 ids stay far under 16 MiB) and a sweep's
    /// reads; the in-flight limit bounds unacknowledged publishes.
    fn counts(&self) -> [(&'static str, u64, RangeInclusive<u64>); 4] {
        [
            (
                "max-buffered-bytes",
                self.max_buffered_bytes,
                1 << 20..=u64::from(u32::MAX),
            ),
            ("max-in-flight", self.max_in_flight as u64, 1..=65_536),
            ("batch-size", self.batch_size as u64, 1..=10_000),
            (
                "max-attempts",
                u64::from(self.retry.max_attempts),
                1..=1_000,
            ),
        ]
    }

    /// Every duration setting with its allowed range: long enough to mean
    /// something, short enough that no deadline computed from it overflows,
    /// and a lease long enough that leadership does not flap.
    fn durations(&self) -> Vec<(&'static str, Duration, RangeInclusive<Duration>)> {
        const MS: Duration = Duration::from_millis(1);
        const MINUTE: Duration = Duration::from_secs(60);
        const HOUR: Duration = Duration::from_secs(3600);
        const DAY: Duration = Duration::from_secs(86_400);
        let mut durations = vec![
            ("checkpoint-interval", self.checkpoint_interval, MS..=HOUR),
            ("max-await-time", self.max_await_time, MS..=10 * MINUTE),
            (
                "idle-checkpoint-interval",
                self.idle_checkpoint_interval,
                MS..=DAY,
            ),
            ("grace-period", self.grace_period, Duration::ZERO..=DAY),
            ("ack-timeout", self.ack_timeout, MS..=10 * MINUTE),
            (
                "shutdown-timeout",
                self.shutdown_timeout,
                Duration::ZERO..=HOUR,
            ),
            ("sweep-interval", self.sweep_interval, MS..=DAY),
            ("poll-interval", self.poll_interval, MS..=DAY),
            ("lock-timeout", self.lock_timeout, MS..=DAY),
            ("retry-initial-delay", self.retry.initial_delay, MS..=DAY),
            ("retry-max-delay", self.retry.max_delay, MS..=30 * DAY),
            (
                "lease-duration",
                self.lease.duration,
                Duration::from_secs(1)..=HOUR,
            ),
            (
                "lease-renew-interval",
                self.lease.renew_interval,
                10 * MS..=30 * MINUTE,
            ),
            (
                "standby-poll-interval",
                self.lease.standby_poll_interval,
                MS..=MINUTE,
            ),
            ("collect-interval", self.collect_interval, MS..=DAY),
            (
                "oplog-headroom-warning",
                self.oplog_headroom_warning,
                Duration::ZERO..=365 * DAY,
            ),
        ];
        if let Some(retention) = self.retention {
            // TTL indexes count seconds in a 32-bit integer.
            durations.push(("retention", retention, Duration::from_secs(1)..=3650 * DAY));
        }
        durations
    }

    /// Checks the settings that do not need a server to check.
    pub fn validate(&self) -> Result<()> {
        let nonempty = [
            ("mongodb-uri", &self.mongodb_uri),
            ("database", &self.database),
            ("collection", &self.collection),
            ("checkpoint-collection", &self.checkpoint_collection),
            ("nats-url", &self.nats_url),
        ];
        for (name, value) in nonempty {
            if value.trim().is_empty() {
                return Err(Error::Config(format!("{name} must not be empty")));
            }
        }
        if self.collection == self.checkpoint_collection {
            return Err(Error::Config(
                "checkpoint-collection must differ from collection".into(),
            ));
        }
        self.subject_rules()?;
        for (name, value, range) in self.counts() {
            if !range.contains(&value) {
                return Err(Error::Config(format!(
                    "{name} = {value} is out of range: it must be from {} to {}",
                    range.start(),
                    range.end()
                )));
            }
        }
        for (name, value, range) in self.durations() {
            if !range.contains(&value) {
                return Err(Error::Config(format!(
                    "{name} = {} is out of range: it must be from {} to {}",
                    humantime::format_duration(value),
                    humantime::format_duration(*range.start()),
                    humantime::format_duration(*range.end())
                )));
            }
        }
        if self.lease.renew_interval * 2 > self.lease.duration {
            return Err(Error::Config(
                "lease-renew-interval must be at most half of lease-duration, so a renewal \
                 can fail once and still land in time"
                    .into(),
            ));
        }
        if self.retry.initial_delay > self.retry.max_delay {
            return Err(Error::Config(
                "retry-initial-delay must not exceed retry-max-delay".into(),
            ));
        }
        Ok(())
    }
}

/// The `--config` file: every setting optional, names as in the flags with
/// `_` for `-`. Durations are written as "500ms", "10s", "2m".
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub mongodb_uri: Option<String>,
    pub database: Option<String>,
    pub collection: Option<String>,
    pub checkpoint_collection: Option<String>,
    pub nats_url: Option<String>,
    pub subject_prefix: Option<String>,
    pub allow_subject: Option<Vec<String>>,
    pub nats_mode: Option<NatsMode>,
    pub create_stream: Option<String>,
    pub max_in_flight: Option<usize>,
    pub batch_size: Option<usize>,
    pub max_buffered_bytes: Option<String>,
    pub checkpoint_interval: Option<String>,
    pub max_await_time: Option<String>,
    pub idle_checkpoint_interval: Option<String>,
    pub grace_period: Option<String>,
    pub ack_timeout: Option<String>,
    pub shutdown_timeout: Option<String>,
    pub mode: Option<RelayMode>,
    pub sweep_interval: Option<String>,
    pub poll_interval: Option<String>,
    pub lock_timeout: Option<String>,
    pub retention: Option<String>,
    pub install_validator: Option<bool>,
    pub max_attempts: Option<u32>,
    pub retry_initial_delay: Option<String>,
    pub retry_max_delay: Option<String>,
    pub lease_duration: Option<String>,
    pub lease_renew_interval: Option<String>,
    pub standby_poll_interval: Option<String>,
    pub metrics_addr: Option<String>,
    pub collect_interval: Option<String>,
    pub oplog_headroom_warning: Option<String>,
}

impl FileConfig {
    /// Reads and parses a TOML file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!("cannot read config file {}: {e}", path.display()))
        })?;
        toml::from_str(&text)
            .map_err(|e| Error::Config(format!("config file {} is not valid: {e}", path.display())))
    }
}

/// Parses a duration such as "500ms", "10s", "5m" or "7d".
pub fn parse_duration(setting: &str, value: &str) -> Result<Duration> {
    humantime::parse_duration(value.trim()).map_err(|e| {
        Error::Config(format!(
            "{setting} = {value:?} is not a duration ({e}); write it like \"500ms\", \"10s\" or \"5m\""
        ))
    })
}

/// Parses a size in bytes: a number, optionally followed by KiB, MiB or GiB
/// (or k, M, G, read the same way).
pub fn parse_bytes(setting: &str, value: &str) -> Result<u64> {
    let text = value.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "k" | "K" | "KiB" | "kB" | "KB" => 1 << 10,
        "M" | "MiB" | "MB" => 1 << 20,
        "G" | "GiB" | "GB" => 1 << 30,
        _ => 0,
    };
    number
        .parse::<u64>()
        .ok()
        .filter(|_| scale > 0)
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| {
            Error::Config(format!(
                "{setting} = {value:?} is not a size; write it like \"67108864\", \"64MiB\" or \
                 \"1GiB\""
            ))
        })
}

/// Parses `--metrics-addr`: a socket address such as "127.0.0.1:9464", or
/// "off" to serve nothing.
pub fn parse_metrics_addr(value: &str) -> Result<Option<SocketAddr>> {
    match value.trim() {
        "off" | "none" | "" => Ok(None),
        addr => addr.parse().map(Some).map_err(|_| {
            Error::Config(format!(
                "metrics-addr = {value:?} is not an address; write it like \"127.0.0.1:9464\" \
                 or \"0.0.0.0:9464\", or \"off\" to serve no metrics"
            ))
        }),
    }
}

/// Shows a connection string without its password, for logs and errors.
pub fn redact_uri(uri: &str) -> String {
    let Some(scheme_end) = uri.find("://") else {
        return uri.to_owned();
    };
    let rest = &uri[scheme_end + 3..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user_info = &rest[..at];
            let user = user_info.split(':').next().unwrap_or_default();
            format!("{}{user}:***{}", &uri[..scheme_end + 3], &rest[at..])
        }
        None => uri.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_only() {
        assert_eq!(
            redact_uri("mongodb://app:s3cret@db1:27017,db2/?replicaSet=rs0"),
            "mongodb://app:***@db1:27017,db2/?replicaSet=rs0"
        );
        assert_eq!(redact_uri("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(
            redact_uri("mongodb://h/?authSource=a@b"),
            "mongodb://h/?authSource=a@b"
        );
    }

    #[test]
    fn rejects_bad_settings_with_their_names() {
        let mut config = RelayConfig::new("mongodb://h", "db");
        config.subject_prefix = "orders.*".into();
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("subject-prefix"), "{error}");

        let mut config = RelayConfig::new("mongodb://h", "db");
        config.max_in_flight = 0;
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("max-in-flight"), "{error}");

        assert!(RelayConfig::new("mongodb://h", "db").validate().is_ok());
    }

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let policy = RetryPolicy::default();
        let within = |attempts, expected: u64| {
            let delay = policy.delay_after(attempts).as_secs_f64();
            let expected = expected as f64;
            assert!(
                delay >= expected * 0.8 && delay <= expected * 1.2,
                "attempt {attempts}: {delay}s, expected about {expected}s"
            );
        };
        within(1, 1);
        within(2, 2);
        within(4, 8);
        within(30, 300);
        assert!(!policy.exhausted(9) && policy.exhausted(10));
    }

    #[test]
    fn parses_durations_and_explains_bad_ones() {
        assert_eq!(
            parse_duration("x", "250ms").unwrap(),
            Duration::from_millis(250)
        );
        let error = parse_duration("ack-timeout", "soon")
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("ack-timeout") && error.contains("10s"),
            "{error}"
        );
    }

    #[test]
    fn file_rejects_unknown_keys() {
        let error = toml::from_str::<FileConfig>("nats_ulr = \"x\"")
            .unwrap_err()
            .to_string();
        assert!(error.contains("nats_ulr"), "{error}");
    }
}
