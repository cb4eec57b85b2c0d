//! Relay settings: each declared once, with its type, default, help and
//! range, and read the same way from every source.
//!
//! Settings come from three places, strongest first: command-line flags
//! (or their `OUTBOX_*` environment variables), a `--config` TOML file
//! ([`SettingsFile`]), and the defaults declared here. [`RelayConfig`] is the
//! checked result the relay runs with; [`RelayConfig::SETTINGS`] describes
//! each of its fields, and the command line is built from that table.

mod file;
mod setting;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use file::SettingsFile;
use setting::{required, settings, within, Named};
pub use setting::{Bytes, Given, Origin, Problem, Setting, Shape, Value};

use crate::contract::{CloudEvents, ContentMode, DecodeRules, SubjectRules, SubjectTemplate};
use crate::error::{Error, Result};

/// How messages are published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NatsMode {
    /// JetStream: each publish is acknowledged by the stream, and repeats of
    /// a message id inside the stream's duplicate window are dropped.
    #[default]
    Jetstream,
    /// Core NATS: fire and forget; at most once per attempt.
    Core,
}

impl Named for NatsMode {
    const NAMES: &'static [(&'static str, Self)] =
        &[("jetstream", NatsMode::Jetstream), ("core", NatsMode::Core)];
}

/// Whether messages go out as CloudEvents, and in which of the NATS
/// binding's content modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CloudEventsMode {
    /// The relay's own headers and the payload as the body.
    #[default]
    Off,
    /// Each attribute in a `ce-` header, the payload as the body.
    Binary,
    /// The JSON event format in the body.
    Structured,
}

impl Named for CloudEventsMode {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("off", CloudEventsMode::Off),
        ("binary", CloudEventsMode::Binary),
        ("structured", CloudEventsMode::Structured),
    ];
}

/// Where messages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RelayMode {
    /// The change stream delivers at once; a slow sweep catches what it misses.
    #[default]
    Push,
    /// The sweep alone, every poll interval: for deployments without change
    /// streams, and as the baseline push is measured against.
    Poll,
}

impl Named for RelayMode {
    const NAMES: &'static [(&'static str, Self)] =
        &[("push", RelayMode::Push), ("poll", RelayMode::Poll)];
}

/// What a dead letter does to the later messages of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeadLetters {
    /// The key goes on: the next message of the key is delivered.
    #[default]
    Release,
    /// The key waits until the dead letter is replayed or discarded.
    Hold,
}

impl Named for DeadLetters {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("release", DeadLetters::Release),
        ("hold", DeadLetters::Hold),
    ];
}

/// What a relay asks of the outbox's retention (its TTL indexes). Unset,
/// it leaves them as it finds them: retention is shared by every process
/// of the outbox, and one started without the setting (a cron job's
/// `sweep --once`, a debugging run) must not turn it off for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// No TTL indexes: processed and failed messages are kept.
    Off,
    /// Processed and failed messages are deleted this long after.
    Keep(Duration),
}

const MS: Duration = Duration::from_millis(1);
const SECOND: Duration = Duration::from_secs(1);
const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86_400);

settings! {
    /// Everything the relay runs with. Each field is a setting: the flag is
    /// its name with `-` for `_`, the environment variable `OUTBOX_` and its
    /// name in capitals, the config-file key its name.
    ///
    /// Durations are bounded long enough to mean something and short enough
    /// that no deadline computed from them overflows; the batch size keeps a
    /// mark's `$in` list far under 16 MiB; the lease lasts long enough that
    /// leadership does not flap.
    pub struct RelayConfig {
        /// MongoDB connection string (a replica set or sharded cluster);
        /// TLS and authentication are options in it.
        mongodb_uri: String [secret] = String::new(), required;
        /// File holding the MongoDB connection string, e.g. a mounted
        /// secret (instead of --mongodb-uri).
        mongodb_uri_file: Option<PathBuf> = None;
        /// Database holding the outbox collection.
        database: String = String::new(), required;
        /// The outbox collection.
        collection: String = crate::writer::DEFAULT_COLLECTION.to_owned(), required;
        /// Collection, in the same database, where resume tokens are kept.
        checkpoint_collection: String = "outbox_checkpoints".to_owned(), required;
        /// NATS server URL(s), comma-separated; tls:// for TLS.
        nats_url: String [secret] = "nats://127.0.0.1:4222".to_owned(), required;
        /// NATS credentials file (user JWT and nkey seed, as nsc writes it).
        nats_creds: Option<PathBuf> = None;
        /// File holding an nkey seed to authenticate to NATS with.
        nats_nkey: Option<PathBuf> = None;
        /// NATS user name (with --nats-password-file).
        nats_user: Option<String> = None;
        /// File holding the NATS user's password.
        nats_password_file: Option<PathBuf> = None;
        /// File holding a NATS authentication token.
        nats_token_file: Option<PathBuf> = None;
        /// PEM file of the certificate authority NATS's certificate is checked
        /// against (a private CA).
        nats_tls_ca: Option<PathBuf> = None;
        /// PEM file of the client certificate, for servers that verify clients
        /// (with --nats-tls-key).
        nats_tls_cert: Option<PathBuf> = None;
        /// PEM file of the client certificate's private key.
        nats_tls_key: Option<PathBuf> = None;
        /// Refuse to talk to NATS without TLS.
        nats_tls_required: bool = false;
        /// Subject prefix: messages without a subject go to <prefix>.<type>,
        /// and explicit subjects under it are allowed.
        subject_prefix: String = crate::contract::DEFAULT_SUBJECT_PREFIX.to_owned();
        /// Also publish explicit subjects matching this NATS pattern, e.g.
        /// 'billing.>' (repeatable, or comma-separated); '$...' and
        /// '_INBOX...' subjects never.
        allow_subject: Vec<String> = Vec::new();
        /// Subject of a message that names none, from {prefix}, {type},
        /// {key} and {header.NAME}, each a whole token, e.g.
        /// '{prefix}.{type}.{key}'; a key or header value is escaped into one
        /// token (see docs/outbox-document.md).
        subject_template: String = crate::contract::DEFAULT_SUBJECT_TEMPLATE.to_owned();
        /// off: the relay's headers and the payload; binary or structured:
        /// each message as a CloudEvent in that mode of the NATS binding
        /// (see docs/outbox-document.md).
        cloudevents: CloudEventsMode = CloudEventsMode::Off;
        /// The CloudEvents source of messages that name none, a
        /// URI-reference; unset: /<database>/<collection>.
        cloudevents_source: Option<String> = None;
        /// jetstream (acknowledged, deduplicated) or core (at most once per attempt).
        nats_mode: NatsMode = NatsMode::Jetstream;
        /// Create a JetStream stream of this name for <prefix>.> if no
        /// stream captures it (for local use).
        create_stream: Option<String> = None;
        /// Publishes awaiting their acknowledgement at once; with
        /// --batch-size, the most sent and not yet marked (what a crash may
        /// publish again).
        max_in_flight: usize = 256, within(1..=65_536);
        /// Most messages marked processed with one update.
        batch_size: usize = 500, within(1..=10_000);
        /// How long a delivery's mark waits for others to share its update,
        /// before it goes with the next delivery (at most twice this): a
        /// mark delays no delivery, and one update for several messages
        /// costs each a fraction of one (0: marks are written at once).
        mark_delay: Duration = 20 * MS, within(Duration::ZERO..=SECOND);
        /// Most bytes of messages read and not yet recorded, across the
        /// stages; sources wait for room beyond it.
        max_buffered_bytes: Bytes = Bytes::mib(64), within(Bytes::mib(1)..=Bytes::mib(4096));
        /// How often the resume token is written while messages flow.
        checkpoint_interval: Duration = 500 * MS, within(MS..=HOUR);
        /// How often an idle stream's newest position is written.
        idle_checkpoint_interval: Duration = MINUTE, within(MS..=DAY);
        /// How long the server holds an empty change-stream read open (it
        /// answers at once when a change commits).
        max_await_time: Duration = 5 * SECOND, within(MS..=10 * MINUTE);
        /// How long the change stream may lag a commit: passes over the
        /// collection leave younger messages to it.
        grace_period: Duration = 5 * SECOND, within(Duration::ZERO..=DAY);
        /// Most due messages a relay starting a term from a stored
        /// position replays from the change stream; with more pending, a
        /// catch-up pass reads them from the collection instead (4294967295:
        /// always replay).
        max_replay: u32 = 10_000, within(1..=u32::MAX);
        /// How long a publish waits for its acknowledgement.
        ack_timeout: Duration = 5 * SECOND, within(MS..=10 * MINUTE);
        /// How long a graceful stop may take.
        shutdown_timeout: Duration = 10 * SECOND, within(Duration::ZERO..=HOUR);
        /// push: change stream plus a slow sweep; poll: the sweep alone.
        mode: RelayMode = RelayMode::Push;
        /// Time between sweeps in push mode.
        sweep_interval: Duration = 10 * SECOND, within(MS..=DAY);
        /// Time between sweeps in poll mode.
        poll_interval: Duration = SECOND, within(MS..=DAY);
        /// Age at which another processor's claim on a message is stale and
        /// may be taken over.
        lock_timeout: Duration = MINUTE, within(MS..=DAY);
        /// Refused attempts after which a message is marked failed.
        max_attempts: u32 = 10, within(1..=1_000);
        /// release: a failed message lets the later messages of its key go
        /// on; hold: they wait until it is replayed or discarded.
        on_dead_letter: DeadLetters = DeadLetters::Release;
        /// Delay after the first refused attempt, doubling each time.
        retry_initial_delay: Duration = SECOND, within(MS..=DAY);
        /// Longest delay between refused attempts.
        retry_max_delay: Duration = 5 * MINUTE, within(MS..=30 * DAY);
        /// How long the leader's lease lasts without renewal.
        lease_duration: Duration = 10 * SECOND, within(SECOND..=crate::lease::LONGEST_LEASE);
        /// How often the leader renews its lease.
        lease_renew_interval: Duration = 3 * SECOND, within(10 * MS..=30 * MINUTE);
        /// Partitions the relays on one outbox share, each delivered by one
        /// relay at a time with its own change stream and lease; every relay
        /// of a group is started with the same number. 1: one relay
        /// delivers, the others stand by.
        partitions: u32 = 1, within(1..=crate::partition::MOST_PARTITIONS);
        /// How often a relay reads its group while partitions are still to
        /// be taken, or where it cannot watch the group.
        standby_poll_interval: Duration = 500 * MS, within(MS..=MINUTE);
        /// Keep processed and failed messages this long, e.g. 7d (TTL
        /// indexes; a TTL counts seconds in 32 bits); "off" keeps them;
        /// unset leaves the outbox's retention as it is.
        retention: Option<Retention> = None, within(SECOND..=3650 * DAY);
        /// Install a $jsonSchema validator enforcing the document contract
        /// on the outbox collection.
        install_validator: bool = false;
        /// Address serving /metrics, /healthz and /readyz, or "off".
        metrics_addr: Option<SocketAddr> = Some(SocketAddr::from(([127, 0, 0, 1], 9464)));
        /// How often pending and failed depths, the oplog's headroom and the
        /// held keys are read (a slow read of the depths or the oplog waits
        /// 20 times as long as it took if that is longer, at most 5 minutes).
        collect_interval: Duration = 10 * SECOND, within(MS..=DAY);
        /// Warn when the oplog holds less history than this before the
        /// stored position; "off" does not read the oplog at all (no
        /// headroom or window metric).
        oplog_headroom_warning: Option<Duration> = Some(HOUR), within(Duration::ZERO..=365 * DAY);
        /// Audit each window of delivered messages once it is this old
        /// (JetStream's flush interval and a margin, e.g. 5m), and publish
        /// again what no stream holds; "off" does not (see outbox-relay
        /// audit).
        audit_after: Option<Duration> = None, within(SECOND..=7 * DAY);
    }
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
            ..RelayConfig::default()
        }
    }

    /// Builds a checked configuration from what the sources give: for each
    /// setting, `given` returns its value from the strongest source that
    /// has one, or `None` to keep the default. Errors name the setting as
    /// it was given (`--ack-timeout "soon"`, or the file and key).
    pub fn resolve(mut given: impl FnMut(&Setting) -> Option<Given>) -> Result<RelayConfig> {
        let mut config = RelayConfig::default();
        let mut origins = Vec::with_capacity(Self::SETTINGS.len());
        for setting in Self::SETTINGS {
            let value = given(setting);
            if let Some(value) = &value {
                setting.apply(&mut config, value).map_err(Error::Config)?;
            }
            origins.push(value);
        }
        if let Some(path) = &config.mongodb_uri_file {
            let uri_given = Self::SETTINGS
                .iter()
                .zip(&origins)
                .any(|(setting, given)| setting.key == "mongodb_uri" && given.is_some());
            if uri_given {
                return Err(Error::Config(
                    "give mongodb-uri or mongodb-uri-file, not both".into(),
                ));
            }
            config.mongodb_uri = read_secret("mongodb-uri-file", path)?;
        }
        for (setting, given) in Self::SETTINGS.iter().zip(&origins) {
            setting
                .check(&config, given.as_ref())
                .map_err(Error::Config)?;
        }
        config.check_together()?;
        Ok(config)
    }

    /// Checks the settings that do not need a server to check.
    pub fn validate(&self) -> Result<()> {
        for setting in Self::SETTINGS {
            setting.check(self, None).map_err(Error::Config)?;
        }
        self.check_together()
    }

    /// The rules that relate one setting to another.
    fn check_together(&self) -> Result<()> {
        let nats_auth = [
            ("nats-creds", self.nats_creds.is_some()),
            ("nats-nkey", self.nats_nkey.is_some()),
            ("nats-user", self.nats_user.is_some()),
            ("nats-token-file", self.nats_token_file.is_some()),
        ];
        let chosen: Vec<&str> = nats_auth
            .iter()
            .filter(|(_, on)| *on)
            .map(|(n, _)| *n)
            .collect();
        if chosen.len() > 1 {
            return Err(Error::Config(format!(
                "{} are different ways to authenticate to NATS: give one",
                chosen.join(" and ")
            )));
        }
        if self.audit_after.is_some() && self.nats_mode == NatsMode::Core {
            return Err(Error::Config(
                "audit-after audits what JetStream stores, and core NATS stores nothing: leave \
                 it off with --nats-mode core"
                    .into(),
            ));
        }
        if self.nats_user.is_some() != self.nats_password_file.is_some() {
            return Err(Error::Config(
                "nats-user and nats-password-file go together: give both or neither".into(),
            ));
        }
        if self.nats_tls_cert.is_some() != self.nats_tls_key.is_some() {
            return Err(Error::Config(
                "nats-tls-cert and nats-tls-key go together: give both or neither".into(),
            ));
        }
        if self.collection == self.checkpoint_collection {
            return Err(Error::Config(
                "checkpoint-collection must differ from collection".into(),
            ));
        }
        let subjects = self.subject_rules()?;
        if let Some(source) = &self.cloudevents_source {
            if self.cloudevents == CloudEventsMode::Off {
                return Err(Error::Config(
                    "cloudevents-source names the source of CloudEvents, and cloudevents is off: \
                     give --cloudevents binary or structured, or no source"
                        .into(),
                ));
            }
            crate::contract::cloudevents::check_source(source)
                .map_err(|why| Error::Config(format!("cloudevents-source: {why}")))?;
        }
        if self.cloudevents != CloudEventsMode::Off {
            let reserved = subjects
                .template()
                .headers()
                .find(|name| crate::contract::cloudevents::reserved_header(name).is_some());
            if let Some(name) = reserved {
                return Err(Error::Config(format!(
                    "subject-template reads header {name:?}, which no document may set while \
                     messages go out as CloudEvents (a receiver would read it as an attribute): \
                     name another header"
                )));
            }
        }
        if self.lease_renew_interval * 2 > self.lease_duration {
            return Err(Error::Config(
                "lease-renew-interval must be at most half of lease-duration, so a renewal \
                 can fail once and still land in time"
                    .into(),
            ));
        }
        if self.standby_poll_interval * 2 > self.lease_duration {
            return Err(Error::Config(format!(
                "standby-poll-interval ({}) must be at most half of lease-duration ({}): the \
                 relays of a group share the partitions in rounds that long, and a round must \
                 come within a lease to count a relay that joins and to keep one that has just \
                 handed a partition over from taking it back",
                humantime::format_duration(self.standby_poll_interval),
                humantime::format_duration(self.lease_duration),
            )));
        }
        if self.retry_initial_delay > self.retry_max_delay {
            return Err(Error::Config(
                "retry-initial-delay must not exceed retry-max-delay".into(),
            ));
        }
        Ok(())
    }

    /// The most messages a term has sent and not yet recorded at once:
    /// what a crash may publish again. Those awaiting their acknowledgement
    /// (`--max-in-flight`) and a batch of marks being written
    /// (`--batch-size`), so that publishing and marking overlap.
    pub fn most_unrecorded(&self) -> usize {
        self.max_in_flight.saturating_add(self.batch_size)
    }

    /// When a refused message is tried again, and when it is given up.
    pub fn retry(&self) -> RetryPolicy {
        RetryPolicy {
            initial_delay: self.retry_initial_delay,
            max_delay: self.retry_max_delay,
            max_attempts: self.max_attempts,
        }
    }

    /// The timing of leadership among several relays.
    pub fn lease_timing(&self) -> crate::lease::LeaseTiming {
        crate::lease::LeaseTiming {
            duration: self.lease_duration,
            renew_interval: self.lease_renew_interval,
            standby_poll_interval: self.standby_poll_interval,
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
        self.lease_duration.max(self.lock_timeout + sweep_interval) + self.ack_timeout
    }

    /// How documents become messages, for a broker that takes messages of
    /// up to `max_payload` bytes: the subjects, and the CloudEvents mode.
    /// What `run`, `sweep --once`, `replay` and `audit` all decode with, so
    /// a message replayed or repaired is the event first sent.
    pub fn decode_rules(&self, max_payload: usize) -> Result<DecodeRules> {
        Ok(DecodeRules::new(self.subject_rules()?, max_payload)
            .with_cloudevents(self.cloudevents()?))
    }

    /// Each message as a CloudEvent, or none.
    pub fn cloudevents(&self) -> Result<Option<CloudEvents>> {
        let mode = match self.cloudevents {
            CloudEventsMode::Off => return Ok(None),
            CloudEventsMode::Binary => ContentMode::Binary,
            CloudEventsMode::Structured => ContentMode::Structured,
        };
        let source = self.cloudevents_source.clone().unwrap_or_else(|| {
            crate::contract::cloudevents::default_source(&self.database, &self.collection)
        });
        CloudEvents::new(mode, source)
            .map(Some)
            .map_err(|why| Error::Config(format!("cloudevents-source: {why}")))
    }

    /// Where the relay may publish: under the prefix, and the allow-list.
    pub fn subject_rules(&self) -> Result<SubjectRules> {
        let mut rules = SubjectRules::under(&self.subject_prefix)
            .map_err(|e| Error::Config(format!("subject-prefix cannot be used: {e}")))?;
        for pattern in &self.allow_subject {
            rules = rules
                .allow(pattern.trim())
                .map_err(|e| Error::Config(format!("allow-subject: {e}")))?;
        }
        let template = SubjectTemplate::parse(&self.subject_template)
            .map_err(|e| Error::Config(format!("subject-template: {e}")))?;
        rules
            .with_template(template)
            .map_err(|e| Error::Config(format!("subject-template: {e}")))
    }
}

/// Reads a secret from the file a setting names (a mounted secret, say),
/// without the line break editors add.
pub fn read_secret(setting: &str, path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Config(format!("{setting}: cannot read {}: {e}", path.display())))?;
    Ok(text.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_shows_its_secrets_masked() {
        let mut config = RelayConfig::new("mongodb://app:s3cret@h/?w=1", "db");
        config.nats_url = "nats://T0KEN@n1,nats://u:pw@n2".into();
        let shown = format!("{config:?}");
        assert!(shown.contains("mongodb://app:***@h/?w=1"), "{shown}");
        for secret in ["s3cret", "T0KEN", ":pw@"] {
            assert!(!shown.contains(secret), "{shown}");
        }
        let secret: Vec<&str> = RelayConfig::SETTINGS
            .iter()
            .filter(|s| s.secret)
            .map(|s| s.key)
            .collect();
        assert_eq!(secret, ["mongodb_uri", "nats_url"]);
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
        assert!(error.contains("max-in-flight = 0"), "{error}");

        let error = RelayConfig::default().validate().unwrap_err().to_string();
        assert!(error.contains("OUTBOX_MONGODB_URI"), "{error}");

        assert!(RelayConfig::new("mongodb://h", "db").validate().is_ok());
    }

    #[test]
    fn cloudevents_settings_are_checked() {
        let mut config = RelayConfig::new("mongodb://h", "db");
        config.cloudevents = CloudEventsMode::Binary;
        let events = config.cloudevents().expect("valid").expect("on");
        assert_eq!(events.source(), "/db/outbox");
        config.cloudevents_source = Some("not a uri".into());
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("cloudevents-source"), "{error}");
        config.cloudevents_source = Some("urn:shop".into());
        config.subject_template = "{prefix}.{type}.{header.source}".into();
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("\"source\""), "{error}");
        config.cloudevents = CloudEventsMode::Off;
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("cloudevents is off"), "{error}");
        config.cloudevents_source = None;
        assert!(config.validate().is_ok(), "off reads any header");
        assert_eq!(config.cloudevents().expect("valid"), None);
    }

    #[test]
    fn a_standby_poll_longer_than_half_the_lease_is_refused_naming_both() {
        let mut config = RelayConfig::new("mongodb://h", "db");
        config.standby_poll_interval = Duration::from_secs(60);
        let error = config.validate().unwrap_err().to_string();
        for said in ["standby-poll-interval (1m)", "lease-duration (10s)"] {
            assert!(error.contains(said), "{error}");
        }
        config.standby_poll_interval = Duration::from_secs(5);
        assert!(config.validate().is_ok(), "half the lease is the most");
    }

    #[test]
    fn retry_delays_double_up_to_the_cap() {
        let policy = RelayConfig::default().retry();
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

    fn flag(value: &str) -> Given {
        Given {
            values: vec![value.to_owned()],
            origin: Origin::Flag,
        }
    }

    /// Resolves a configuration with the connection given and one more setting.
    fn resolve_with(key: &str, value: Given) -> Result<RelayConfig> {
        RelayConfig::resolve(|setting| match setting.key {
            "mongodb_uri" => Some(flag("mongodb://h")),
            "database" => Some(flag("db")),
            other if other == key => Some(value.clone()),
            _ => None,
        })
    }

    #[test]
    fn errors_name_the_setting_as_it_was_given() {
        let error = resolve_with("ack_timeout", flag("soon"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--ack-timeout \"soon\" is not a duration") && error.contains("10s"),
            "{error}"
        );
        let from_env = Given {
            origin: Origin::Environment,
            ..flag("0")
        };
        let error = resolve_with("batch_size", from_env)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("OUTBOX_BATCH_SIZE=\"0\" is out of range: it must be from 1 to 10000"),
            "{error}"
        );
        let from_file = Given {
            origin: Origin::File("relay.toml".into()),
            ..flag("fast")
        };
        let error = resolve_with("nats_mode", from_file)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("nats_mode = \"fast\" in relay.toml is not one of jetstream, core"),
            "{error}"
        );
    }

    #[test]
    fn every_default_is_read_back_as_itself_and_in_range() {
        let defaults = RelayConfig::new("mongodb://h", "db");
        defaults.validate().expect("the defaults are valid");
        for setting in RelayConfig::SETTINGS {
            let Some(text) = setting.default_text() else {
                continue;
            };
            let mut config = RelayConfig::new("mongodb://h", "db");
            setting
                .apply(&mut config, &flag(&text))
                .unwrap_or_else(|e| panic!("{}: {e}", setting.key));
            assert_eq!(config, defaults, "{} reads {text:?} back", setting.key);
        }
    }

    #[test]
    fn sizes_and_switches_read_as_written() {
        let read = |key, text| {
            resolve_with(key, flag(text))
                .map(|c| (c.max_buffered_bytes, c.install_validator))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            read("max_buffered_bytes", "2MiB"),
            Ok((Bytes(2 << 20), false))
        );
        assert_eq!(
            read("max_buffered_bytes", "4GiB"),
            Ok((Bytes(4 << 30), false))
        );
        assert!(read("max_buffered_bytes", "lots").is_err());
        assert_eq!(
            read("install_validator", "true"),
            Ok((Bytes::mib(64), true))
        );
        assert!(read("install_validator", "maybe").is_err());
        assert_eq!(Bytes::mib(64).show().as_deref(), Some("64MiB"));
    }

    #[test]
    fn a_duration_that_may_be_off_reads_off_and_durations() {
        let read = |text| {
            resolve_with("oplog_headroom_warning", flag(text))
                .map(|c| c.oplog_headroom_warning)
                .map_err(|e| e.to_string())
        };
        assert_eq!(read("off"), Ok(None));
        assert_eq!(read("Off"), Ok(None));
        assert_eq!(read("2h"), Ok(Some(2 * HOUR)));
        let error = read("soon").unwrap_err();
        assert!(
            error.contains("--oplog-headroom-warning \"soon\" is not a duration"),
            "{error}"
        );
    }

    #[test]
    fn a_list_reads_alike_from_every_source() {
        let from_file = Given {
            values: vec!["billing.>, shipping.>".to_owned()],
            origin: Origin::File("relay.toml".into()),
        };
        let config = resolve_with("allow_subject", from_file).expect("a list");
        assert_eq!(config.allow_subject, ["billing.>", "shipping.>"]);
        let error = resolve_with("allow_subject", flag("a.>,,b.>"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--allow-subject \"a.>,,b.>\" has an empty item"),
            "{error}"
        );
        let error = resolve_with("collection", flag(" "))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--collection \" \" must not be empty"),
            "{error}"
        );
    }

    /// README's settings table, and the full one in docs/configuration.md,
    /// list every setting, in order, with its real default.
    #[test]
    fn the_settings_tables_list_every_setting_with_its_default() {
        let tables = [
            ("README.md", include_str!("../../README.md")),
            (
                "docs/configuration.md",
                include_str!("../../docs/configuration.md"),
            ),
        ];
        for (name, text) in tables {
            settings_table_matches(name, text);
        }
    }

    fn settings_table_matches(name: &str, text: &str) {
        let rows: Vec<(String, String)> = text
            .lines()
            .filter_map(|line| line.strip_prefix("| `--"))
            .map(|row| {
                let cells: Vec<&str> = row.split(" | ").collect();
                let flag = cells[0].split([' ', '`']).next().unwrap_or_default();
                let default = cells.get(1).copied().unwrap_or_default();
                (flag.to_owned(), default.trim_matches('`').to_owned())
            })
            .filter(|(flag, _)| flag != "log-format")
            .collect();
        let flags: Vec<String> = RelayConfig::SETTINGS.iter().map(Setting::flag).collect();
        let listed: Vec<String> = rows.iter().map(|(flag, _)| flag.clone()).collect();
        assert_eq!(listed, flags, "{name}'s table lists the settings in order");
        for ((_, default), setting) in rows.iter().zip(RelayConfig::SETTINGS) {
            let expected = setting.default_text();
            match default.as_str() {
                "(required)" => assert!(setting.required(), "{name}: {} is required", setting.key),
                "none" => assert_eq!(expected, None, "{name}: {} has no default", setting.key),
                text => {
                    let mut config = RelayConfig::default();
                    setting
                        .apply(&mut config, &flag(text))
                        .unwrap_or_else(|e| panic!("{name}'s default of {e}"));
                    assert_eq!(setting.shown(&config), expected, "{name}: {}", setting.key);
                }
            }
        }
    }
}
