//! Replay: sends delivered messages again, chosen by time, type, subject
//! or key, to their own subjects or under a new prefix, while the relay
//! keeps running.
//!
//! The outbox keeps every delivered message until `--retention` removes
//! it, so a consumer that lost its state, or a new one that needs the
//! history, can be sent it again. A replay reads the collection and
//! publishes; it changes no message (a replay is not a redelivery), and
//! writes only its own record.
//!
//! On the wire a replayed message is its first delivery, with a
//! `Nats-Msg-Id` of its own (`<id>:<replay id>`, so JetStream stores it
//! although the first is within the duplicate window, and drops the
//! repeats of one replay), `Outbox-Replay: <replay id>`, and
//! `Outbox-Replay-Of: <id>`, the first delivery's id, by which an inbox
//! knows it (see `crate::inbox`: a consumer that handled the message skips
//! it; one that is to apply the history again uses a new consumer name).
//!
//! Layout:
//! - `selection`: which messages, as a MongoDB filter and an exact match;
//! - `record`: the replay's record, which lets it resume and keeps two
//!   runs of one replay apart;
//! - `send`: reading, pacing and publishing, each key in order.

mod record;
mod selection;
mod send;

use std::time::{Duration, Instant};

use bson::{doc, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::{Collection, Database};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

pub use record::{Progress, Record, State, TypeCount, DEFAULT_COLLECTION, OTHER_TYPES};
pub use selection::{parse_moment, Selection};

use crate::config::RelayConfig;
use crate::contract::{DecodeRules, SubjectRules};
use crate::error::{Error, Result};
use crate::observe::Metrics;
use crate::publish::{NatsPublisher, Publisher, StreamSetup};
use crate::setup::collection_exists;
use record::Records;
use send::{Ended, Outgoing, Sender};

/// The longest the server may take to count a replay's messages for the
/// progress bar; past it the bar goes without a total.
const COUNT_TIME: Duration = Duration::from_secs(30);

/// What to replay: a new selection, or one recorded before.
#[derive(Debug, Clone)]
pub enum Request {
    /// A new replay of `selection`, sent under `replay_prefix` (else to
    /// the messages' own subjects).
    New {
        selection: Selection,
        replay_prefix: Option<String>,
    },
    /// The rest of replay `id`, as recorded.
    Resume(String),
}

/// How a replay runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The collection of replay records, beside the outbox.
    pub records_collection: String,
    /// Most messages a second.
    pub rate: Option<f64>,
    /// Count what would be sent, by type, and send nothing.
    pub dry_run: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            records_collection: DEFAULT_COLLECTION.to_owned(),
            rate: None,
            dry_run: false,
        }
    }
}

/// How far a replay has got, for a progress bar or a log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    /// Documents read so far.
    pub scanned: u64,
    /// Documents the selection's filter matches, if they could be counted.
    pub total: Option<u64>,
    pub sent: u64,
    pub skipped: u64,
    pub elapsed: Duration,
}

/// What a replay did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// The replay's id (none for a dry run of a new selection).
    pub replay_id: Option<String>,
    pub dry_run: bool,
    /// `done`, or `stopped` (resumable); a dry run says `done`.
    pub state: State,
    /// Sent (for a dry run: would be sent), in all and by type.
    pub sent: u64,
    pub by_type: Vec<TypeCount>,
    /// Selected but not sendable (see `send`).
    pub skipped: u64,
    pub seconds: f64,
    /// The process's peak resident memory, where Linux says it.
    pub peak_memory_mib: Option<f64>,
}

/// Runs a replay over the outbox `config` names, until it is done or
/// `shutdown` fires; `report` hears of its progress a few times a second.
pub async fn run(
    config: &RelayConfig,
    request: Request,
    options: &Options,
    shutdown: CancellationToken,
    report: &(dyn Fn(&Report) + Sync),
) -> Result<Summary> {
    config.validate()?;
    let pace = pace(options.rate)?;
    let rules = config.subject_rules()?;
    let request = match request {
        Request::New {
            selection,
            replay_prefix,
        } => {
            // The range ends when the replay starts, at the latest: a
            // resumed replay sends what was there, not what came since.
            let selection = selection
                .ending_by(bson::DateTime::now())
                .map_err(Error::Config)?;
            check_prefix(&rules, replay_prefix.as_deref())?;
            Request::New {
                selection,
                replay_prefix,
            }
        }
        resume => resume,
    };
    let client = crate::connect::connect_mongodb(&config.mongodb_uri).await?;
    let database = client.database(&config.database);
    let outbox = existing_outbox(&database, config).await?;
    let records = Records::new(&database, &options.records_collection);
    let outbox_name = format!("{}.{}", config.database, config.collection);
    let started = Instant::now();
    if options.dry_run {
        let (replay_id, selection, progress, prefix) = match request {
            Request::New {
                selection,
                replay_prefix,
            } => (None, selection, Progress::default(), replay_prefix),
            Request::Resume(id) => {
                let record = checked_record(&records, &rules, &id, &outbox_name).await?;
                (
                    Some(record.id),
                    record.selection,
                    record.progress,
                    record.replay_prefix,
                )
            }
        };
        let decode = DecodeRules::new(rules, usize::MAX).with_cloudevents(config.cloudevents()?);
        let counted = count(&outbox, &decode, &selection, prefix.as_deref(), &progress).await?;
        return Ok(Summary::of(replay_id, true, State::Done, &counted, started));
    }
    let record = match request {
        Request::New {
            selection,
            replay_prefix,
        } => {
            records
                .create(outbox_name, selection, replay_prefix)
                .await?
        }
        Request::Resume(id) => {
            checked_record(&records, &rules, &id, &outbox_name).await?;
            records.resume(&id, &outbox_name).await?
        }
    };
    tracing::info!(replay = %record.id, "replay started");
    let stop = shutdown.child_token();
    let holding = records.hold(&record.id, stop.clone());
    let mut progress = record.progress.clone();
    let sent = async {
        let publisher = connect_nats(config, &record).await?;
        let decode = config.decode_rules(publisher.max_payload())?;
        let total = total(&outbox, &record, &progress).await;
        let sender = Sender {
            outbox: &outbox,
            rules: &decode,
            selection: &record.selection,
            replay_prefix: record.replay_prefix.as_deref(),
            replay_id: &record.id,
            publisher: &publisher,
            pace,
            records: &records,
            max_in_flight: config.max_in_flight,
            max_bytes: usize::try_from(config.max_buffered_bytes.0).unwrap_or(usize::MAX),
            report,
            total,
        };
        sender.run(&mut progress, &stop).await
    }
    .await;
    let lost = holding.lost();
    drop(holding);
    let state = match &sent {
        Ok(Ended::Finished) => State::Done,
        Ok(Ended::Interrupted) | Err(_) => State::Stopped,
    };
    if lost {
        return Err(records.taken_over(&record.id).await);
    }
    let saved = records.save(&record.id, &progress, state).await;
    let ended = match (sent, saved) {
        // Not this run's to resume: the error says what the other does.
        (Err(taken @ Error::TakenOver(_)), _) | (_, Err(taken @ Error::TakenOver(_))) => {
            return Err(taken)
        }
        (Err(error), _) => {
            tracing::error!(
                replay = %record.id,
                "the replay stopped ({error}); resume it with outbox-relay replay --resume {}",
                record.id
            );
            return Err(error);
        }
        (Ok(ended), saved) => {
            saved?;
            ended
        }
    };
    // A new replay that found nothing to send leaves no record behind.
    let nothing = progress.sent == 0 && progress.skipped == 0;
    if ended == Ended::Finished && record.progress == Progress::default() && nothing {
        records.forget(&record.id).await?;
        return Err(nothing_selected());
    }
    Ok(Summary::of(
        Some(record.id),
        false,
        state,
        &progress,
        started,
    ))
}

/// The least time between two sends at `rate` messages a second.
pub(crate) fn pace(rate: Option<f64>) -> Result<Option<Duration>> {
    let Some(rate) = rate else {
        return Ok(None);
    };
    // At least one a minute: a cursor read less often than every ten
    // minutes is dropped by the server.
    if !(rate.is_finite() && rate >= 1.0 / 60.0) {
        return Err(Error::Config(format!(
            "--rate {rate}: a rate is a number of messages a second, at least one a minute \
             (0.0167)"
        )));
    }
    Ok(Some(Duration::from_secs_f64(1.0 / rate)))
}

/// Connects to NATS, and creates the replay's stream if asked.
async fn connect_nats(config: &RelayConfig, record: &Record) -> Result<NatsPublisher> {
    let publisher = NatsPublisher::connect(config, &Metrics::new()).await?;
    if let Some(name) = &config.create_stream {
        let setup = match record.replay_prefix.as_deref() {
            Some(prefix) => StreamSetup::for_prefix(name, prefix),
            None => StreamSetup::for_relay(name, config),
        };
        setup.ensure(&publisher.client()).await?;
    }
    Ok(publisher)
}

/// How many documents are left to read, for the progress bar; `None` if
/// the server does not say within [`COUNT_TIME`].
async fn total(outbox: &Collection<Document>, record: &Record, progress: &Progress) -> Option<u64> {
    let counting = outbox
        .count_documents(record.selection.filter(progress.after))
        .max_time(COUNT_TIME);
    let counted = tokio::time::timeout(COUNT_TIME, counting).await;
    counted.ok().and_then(|counted| counted.ok())
}

impl Summary {
    fn of(
        replay_id: Option<String>,
        dry_run: bool,
        state: State,
        progress: &Progress,
        started: Instant,
    ) -> Self {
        Summary {
            replay_id,
            dry_run,
            state,
            sent: u64::try_from(progress.sent).unwrap_or(0),
            by_type: progress.by_type.clone(),
            skipped: u64::try_from(progress.skipped).unwrap_or(0),
            seconds: started.elapsed().as_secs_f64(),
            peak_memory_mib: crate::usage::peak_memory_mib("self"),
        }
    }
}

fn nothing_selected() -> Error {
    Error::Config(
        "the selection matches no delivered message (check --since/--until, --type, --subject \
         and --key; add --include-failed for failed ones): nothing was sent"
            .to_owned(),
    )
}

/// Replay `id` of `outbox` as recorded, its prefix checked against the
/// relay's subject rules of today, before it is counted or taken up.
async fn checked_record(
    records: &Records,
    rules: &SubjectRules,
    id: &str,
    outbox: &str,
) -> Result<Record> {
    let record = records.peek(id, outbox).await?;
    check_prefix(rules, record.replay_prefix.as_deref())?;
    Ok(record)
}

/// Checks a replay's prefix against the relay's subject rules.
fn check_prefix(rules: &SubjectRules, prefix: Option<&str>) -> Result<()> {
    match prefix {
        Some(prefix) => rules
            .check_prefix(prefix)
            .map_err(|e| Error::Config(format!("--replay-prefix: {e}"))),
        None => Ok(()),
    }
}

/// The outbox collection, if it exists: a replay of a mistyped name must
/// not report that it found nothing to send.
pub(crate) async fn existing_outbox(
    database: &Database,
    config: &RelayConfig,
) -> Result<Collection<Document>> {
    let exists = collection_exists(database, &config.collection)
        .await
        .map_err(|e| {
            Error::mongo("listing the database's collections failed", e)
                .needing("listCollections", format!("database {}", database.name()))
        })?;
    if !exists {
        return Err(Error::Config(format!(
            "there is no outbox collection {:?} in database {:?}: give the relay's --database \
             and --collection",
            config.collection, config.database
        )));
    }
    Ok(database.collection(&config.collection))
}

/// What a replay of `selection` after `progress` would send, by type, and
/// skip: each document judged as a run judges it, but for the size NATS
/// takes, which a dry run does not ask NATS for.
async fn count(
    outbox: &Collection<Document>,
    rules: &DecodeRules,
    selection: &Selection,
    prefix: Option<&str>,
    progress: &Progress,
) -> Result<Progress> {
    let failed = |e| {
        Error::mongo("reading the messages to replay failed", e).needing("find", outbox.namespace())
    };
    let mut cursor = outbox
        .clone_with_type::<RawDocumentBuf>()
        .find(selection.filter(progress.after))
        .await
        .map_err(failed)?;
    let mut counted = Progress::default();
    while let Some(document) = cursor.try_next().await.map_err(failed)? {
        match send::outgoing(&document, rules, selection, prefix, "dry-run") {
            Outgoing::Unselected => {}
            Outgoing::Skipped(_) => counted.skipped += 1,
            Outgoing::Send(message) => counted.sent_one(&message.message_type),
        }
    }
    if counted.sent == 0 && counted.skipped == 0 && progress.sent == 0 {
        return Err(nothing_selected());
    }
    Ok(counted)
}
