//! The start-up self-check: whether this deployment can serve the relay.
//!
//! The relay runs these checks before it serves, and `outbox-relay check`
//! runs them alone. Each failure is an [`Error::Check`] whose kind has its
//! own exit code, with a message that says what to change:
//!
//! 1. MongoDB answers and is a replica set or a sharded cluster (change
//!    streams and transactions need one);
//! 2. the outbox collection can be read, and what a relay would change in
//!    it (a missing index, another retention, the validator) is said;
//! 3. NATS answers;
//! 4. in JetStream mode, a stream captures the relay's subjects, and
//! 5. its duplicate window covers the relay's longest redelivery gap
//!    ([`RelayConfig::redelivery_gap`]), so a message published twice
//!    across a takeover reaches subscribers once;
//! 6. its replicas are said: with one, a crash of its host can lose what
//!    JetStream acknowledged (a warning, not a failure).

use std::time::Duration;

use async_nats::jetstream;

use crate::config::{NatsMode, RelayConfig};
use crate::connect::connect_mongodb_observed;
use crate::error::{CheckKind, Error, Result};
use crate::publish::NatsConnection;
use crate::redact;
use crate::setup;

/// One check's outcome: what was found, or why it failed.
#[derive(Debug)]
pub struct Finding {
    pub check: &'static str,
    pub outcome: Outcome,
}

/// How a check ended.
#[derive(Debug)]
pub enum Outcome {
    Passed(String),
    /// Passed, with something the operator should know; exits 0.
    Warned(String),
    Failed(Error),
    /// Not run, because a check it depends on failed.
    Skipped,
}

/// Every check's outcome, in order.
#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
}

impl Report {
    /// The first failure, which decides the exit code.
    pub fn failure(&self) -> Option<&Error> {
        self.findings.iter().find_map(|f| match &f.outcome {
            Outcome::Failed(error) => Some(error),
            _ => None,
        })
    }

    /// One line a check, for a terminal.
    pub fn render(&self) -> String {
        self.findings
            .iter()
            .map(|finding| match &finding.outcome {
                Outcome::Passed(detail) => format!("ok    {}: {detail}", finding.check),
                Outcome::Warned(detail) => format!("warn  {}: {detail}", finding.check),
                Outcome::Failed(error) => format!("FAIL  {}: {error}", finding.check),
                Outcome::Skipped => format!("skip  {}: not checked", finding.check),
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn record<T>(
        &mut self,
        check: &'static str,
        outcome: Result<T>,
        passed: impl FnOnce(&T) -> String,
    ) -> Option<T> {
        let (outcome, value) = match outcome {
            Ok(value) => (Outcome::Passed(passed(&value)), Some(value)),
            Err(error) => (Outcome::Failed(error), None),
        };
        self.findings.push(Finding { check, outcome });
        value
    }

    fn skip(&mut self, check: &'static str) {
        self.findings.push(Finding {
            check,
            outcome: Outcome::Skipped,
        });
    }
}

/// What preparing the outbox would change, read without writing.
async fn outbox_plan(
    database: &mongodb::Database,
    config: &RelayConfig,
) -> Result<Vec<setup::Change>> {
    let found = setup::inspect(database, &config.collection)
        .await
        .map_err(|error| {
            Error::check(
                CheckKind::OutboxSetup,
                format!(
                    "cannot read the outbox collection {}.{}: {error}; give the user the \
                     role docs/configuration.md#permissions gives",
                    config.database, config.collection
                ),
            )
        })?;
    setup::plan(&found, config)
}

/// Runs every check against the deployment `config` names. Nothing is
/// written: what a relay would change in the outbox (a missing index, a
/// different retention) is reported, as `run` would make it.
pub async fn run(config: &RelayConfig) -> Report {
    let mut report = Report::default();
    let rules = config.subject_rules();
    report.record("subjects", rules, |rules| {
        let template = rules.template();
        format!(
            "a message that names no subject goes to {:?}, e.g. {:?}",
            template.as_str(),
            template.example(rules.prefix())
        )
    });
    let mongodb = connect_mongodb_observed(&config.mongodb_uri, None, config.partitions).await;
    let shown = redact::uri(&config.mongodb_uri);
    match report.record("mongodb", mongodb, |(_, deployment)| {
        format!("{shown} is {deployment}")
    }) {
        Some((client, _)) => {
            let planned = outbox_plan(&client.database(&config.database), config).await;
            report.record("outbox collection", planned, |changes| {
                let namespace = format!("{}.{}", config.database, config.collection);
                if changes.is_empty() {
                    format!("{namespace}: its indexes, retention and validator are as configured")
                } else {
                    let said: Vec<String> = changes.iter().map(ToString::to_string).collect();
                    format!("{namespace}: run would {}", said.join("; "))
                }
            });
        }
        None => report.skip("outbox collection"),
    }
    let nats = NatsConnection::for_config(config).connect().await;
    let url = redact::uri(&config.nats_url);
    let Some(client) = report.record("nats", nats, |client| {
        format!(
            "{url} answers (nats-server {})",
            client.server_info().version
        )
    }) else {
        if config.nats_mode == NatsMode::Jetstream {
            report.skip("jetstream stream");
            report.skip("duplicate window");
            report.skip("stream durability");
        }
        return report;
    };
    if config.nats_mode == NatsMode::Jetstream {
        // A stream capturing several of the subjects is said once.
        let mut said: Vec<String> = Vec::new();
        for subjects in captured_subjects(config) {
            let stream = capturing_stream(&client, &subjects).await;
            match report.record("jetstream stream", stream, |(name, ..)| {
                format!("stream {name:?} captures {subjects}")
            }) {
                Some((name, window, durable)) => {
                    let covered = duplicate_window_covers(&name, window, config);
                    report.record("duplicate window", covered, |_| {
                        format!(
                            "{window:?} covers the longest redelivery gap, {:?}",
                            config.redelivery_gap()
                        )
                    });
                    if !said.contains(&name) {
                        report.findings.push(durability(&name, durable));
                        said.push(name);
                    }
                }
                None => {
                    report.skip("duplicate window");
                    report.skip("stream durability");
                }
            }
        }
    }
    report
}

/// The JetStream checks the relay runs on start: a stream captures the
/// subjects, and its duplicate window is long enough.
pub(crate) async fn jetstream(client: &async_nats::Client, config: &RelayConfig) -> Result<()> {
    if config.nats_mode != NatsMode::Jetstream {
        return Ok(());
    }
    for subjects in captured_subjects(config) {
        let (name, window, _) = capturing_stream(client, &subjects).await?;
        duplicate_window_covers(&name, window, config)?;
    }
    Ok(())
}

/// What a stream must capture: `<prefix>.>`, and the subjects the
/// subject template renders where they are outside it.
pub(crate) fn captured_subjects(config: &RelayConfig) -> Vec<String> {
    let under_prefix = format!("{}.>", config.subject_prefix);
    let mut subjects = vec![under_prefix];
    if let Ok(rules) = config.subject_rules() {
        let rendered = rules.template().pattern(rules.prefix());
        if !rendered.starts_with(&format!("{}.", rules.prefix())) {
            subjects.push(rendered);
        }
    }
    subjects
}

/// What keeps a stream's messages: its replicas, and its storage.
#[derive(Debug, Clone, Copy)]
struct Durability {
    replicas: usize,
    storage: jetstream::stream::StorageType,
}

/// The stream that captures `subjects`, with its duplicate window and what
/// keeps its messages.
async fn capturing_stream(
    client: &async_nats::Client,
    subjects: &str,
) -> Result<(String, Duration, Durability)> {
    let context = jetstream::new(client.clone());
    let name = context.stream_by_subject(subjects).await.map_err(|e| {
        Error::check(
            CheckKind::NoStream,
            format!(
                "no JetStream stream captures {subjects} ({e}); create one (nats stream add \
                 --subjects '{subjects}'), start the relay with --create-stream NAME, or use \
                 --nats-mode core"
            ),
        )
    })?;
    let stream = context.get_stream(&name).await.map_err(|e| {
        Error::check(
            CheckKind::NoStream,
            format!("cannot read JetStream stream {name:?}: {e}"),
        )
    })?;
    let config = &stream.cached_info().config;
    let durable = Durability {
        replicas: config.num_replicas.max(1),
        storage: config.storage,
    };
    Ok((name, config.duplicate_window, durable))
}

/// What a stream's replicas mean for what JetStream acknowledged: with
/// one, a crash of its host loses what it stored since its last flush to
/// disk (every two minutes by default), though the relay holds it
/// `processed`. Said, not failed: it is the operator's choice.
fn durability(name: &str, durable: Durability) -> Finding {
    let choices =
        "use 3 replicas on file storage, sync_interval: always, or run outbox-relay audit \
                   (docs/guarantees.md#when-nats-loses-what-it-acknowledged)";
    let outcome = match durable {
        Durability {
            storage: jetstream::stream::StorageType::Memory,
            ..
        } => Outcome::Warned(format!(
            "stream {name:?} keeps its messages in memory: a restart of its servers loses what \
             JetStream acknowledged, which the outbox holds processed; {choices}"
        )),
        Durability { replicas: 1, .. } => Outcome::Warned(format!(
            "stream {name:?} keeps one replica: a crash of its host can lose what JetStream \
             acknowledged since its last flush to disk (2 minutes by default), which the outbox \
             holds processed; {choices}"
        )),
        Durability { replicas, .. } => Outcome::Passed(format!(
            "stream {name:?} keeps {replicas} replicas: an acknowledged message is on a majority \
             of them"
        )),
    };
    Finding {
        check: "stream durability",
        outcome,
    }
}

fn duplicate_window_covers(name: &str, window: Duration, config: &RelayConfig) -> Result<()> {
    let gap = config.redelivery_gap();
    if window >= gap {
        return Ok(());
    }
    Err(Error::check(
        CheckKind::DuplicateWindow,
        format!(
            "JetStream stream {name:?} remembers message ids for {window:?}, but the relay may \
             publish a message again up to {gap:?} later (the longer of --lease-duration and \
             --lock-timeout plus the sweep interval, plus --ack-timeout); raise the stream's \
             duplicate window (nats stream edit {name} --dupe-window {}s) or shorten those \
             settings",
            gap.as_secs() + 1
        ),
    ))
}
