//! Audit: proves that what the outbox says was delivered is in the stream,
//! and mends what is not.
//!
//! The relay marks a message `processed` once JetStream acknowledges it,
//! and that acknowledgement is not a write to disk: a crash of the
//! server's host loses what it acknowledged since its last flush (every
//! two minutes by default), and an operator may purge a stream, delete
//! messages, or create a stream anew. The outbox is the durable record of
//! what was committed, so an audit reads both over a window of commit time
//! (the `_id`'s second, as a replay selects) and matches them by
//! `Nats-Msg-Id`:
//!
//! - delivered: processed, and stored once;
//! - missing: processed, and in no stream;
//! - stored more than once: a repeat past the duplicate window;
//! - pending and failed: not delivered (yet), counted apart;
//! - unrecorded: stored with an outbox id the outbox does not hold (its
//!   retention deleted it, or something else wrote it), and foreign: under
//!   the relay's subjects with no outbox id at all.
//!
//! The streams are read first, from the window's start less
//! [`CLOCK_MARGIN`] (the writer's clock against the NATS server's), to
//! where they ended when the read began (a relay's own audit, to its
//! window's end); then the outbox. A message processed after the streams'
//! read began may be stored after it too: those found missing are looked
//! for again in a short read from just before they were processed.
//!
//! `--repair` publishes the missing messages again (see `repair`), then
//! audits again. Core NATS keeps nothing to read back: an audit refuses it.
//!
//! Layout:
//! - `stream`: the streams that capture the relay's subjects, read back;
//! - `compare`: the outbox's window against the ids stored;
//! - `repair`: publishing the missing again, as the relay sent them;
//! - `watch`: a relay's own audit of each window once it is old enough.

mod compare;
mod pace;
mod repair;
pub(crate) mod stream;
mod watch;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use bson::oid::ObjectId;
use bson::DateTime;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

pub use pace::Pace;
pub use repair::{RepairEnd, Repaired, Unsendable};
pub use stream::MAX_STORED;
pub use watch::{watch, Watch};

use crate::config::{NatsMode, RelayConfig, Retention};
use crate::contract::{header, DecodeRules};
use crate::error::{Error, Result};
use crate::observe::Metrics;
use crate::publish::{NatsPublisher, Publisher};
use crate::replay::{existing_outbox, Selection};
use crate::time::{earlier, later, made_at, shown};
use compare::{Compared, Described, Missing};
use repair::Repair;
use stream::{CapturingStream, Seen, Verdict};

/// How far the writer's clock (which stamps the `_id`) and the NATS
/// server's (which stamps what it stores) may disagree: a stream is read
/// from this long before the window's start.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(60);

/// How an audit runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// How fast it reads.
    pub pace: Pace,
    /// Publish the missing messages again, then audit again.
    pub repair: Option<RepairOptions>,
}

/// How a repair publishes.
#[derive(Debug, Clone)]
pub struct RepairOptions {
    /// Most messages a second.
    pub rate: Option<f64>,
    /// The longest it waits for JetStream to forget the ids of messages
    /// deleted within its duplicate window.
    pub wait: Duration,
}

/// What an audit found, and a repair did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// The window audited: `_id` seconds from `since` (none: the first)
    /// to before `until`.
    pub since: Option<String>,
    pub until: String,
    /// The streams read, with what each says of durability.
    pub streams: Vec<StreamSummary>,
    /// What the audit found.
    pub found: Findings,
    /// What `--repair` did, and what a second audit found after it.
    pub repair: Option<RepairSummary>,
    pub seconds: f64,
    /// The process's peak resident memory, where Linux says it.
    pub peak_memory_mib: Option<f64>,
}

impl Summary {
    /// What the audit concludes, after the repair where there was one.
    pub fn conclusion(&self) -> Conclusion {
        let left = match &self.repair {
            None => Some(&self.found),
            Some(repair) if repair.repaired.ended == RepairEnd::Stopped => {
                return Conclusion::Stopped
            }
            Some(repair) => repair.after.as_ref(),
        };
        match left.map(|found| found.missing) {
            Some(0) => Conclusion::AllStored,
            _ => Conclusion::Missing,
        }
    }
}

/// What an audit concludes: the exit code's question.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conclusion {
    /// Every processed message of the window is in a stream: exit 0.
    AllStored,
    /// Some are not, or were not mended: exit 1.
    Missing,
    /// A signal stopped the repair before it audited again: exit 130.
    Stopped,
}

/// A stream read.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamSummary {
    pub name: String,
    pub replicas: usize,
    pub duplicate_window_seconds: f64,
}

/// What one audit found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Findings {
    /// Messages of the window in the outbox, in any state.
    pub messages: u64,
    /// Processed and stored once.
    pub delivered: u64,
    /// Processed, and in no stream.
    pub missing: u64,
    /// Processed, and stored more than once.
    pub stored_more_than_once: u64,
    /// Processed, in no stream, and older than what a stream's own limits
    /// (`max_age`, `max_msgs`, `max_bytes`) keep: not counted missing.
    pub past_stream_limits: u64,
    /// Not delivered yet.
    pub pending: u64,
    /// Given up on (dead letters).
    pub failed: u64,
    /// Stored with an outbox id the outbox does not hold.
    pub unrecorded: Unrecorded,
    /// Stored under the relay's subjects with no outbox id.
    pub foreign: u64,
    /// Copies a replay sent (`Outbox-Replay`), not judged.
    pub replayed: u64,
    /// Missing ones whose id JetStream may still remember, so that a
    /// repeat is dropped as a duplicate until `until`.
    pub remembered: Option<Remembered>,
    /// The first missing ones, in commit order.
    pub missing_listed: Vec<Listed>,
    pub stored_more_than_once_listed: Vec<Listed>,
    /// Messages read from the streams.
    pub stream_messages_read: u64,
}

/// Stored ids the outbox does not hold, by the likely reason.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Unrecorded {
    /// Old enough for the outbox's retention to have deleted them.
    pub past_retention: u64,
    /// Within the retention, or none is set: written by something else, or
    /// deleted from the outbox by hand.
    pub unexplained: u64,
}

/// Missing messages a republish would be dropped for until a time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Remembered {
    pub messages: u64,
    pub until: String,
}

/// A message in a list.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Listed {
    pub id: String,
    pub subject: String,
    #[serde(rename = "type")]
    pub message_type: String,
    pub key: Option<String>,
    /// The `_id`'s second.
    pub committed_at: String,
    pub processed_at: Option<String>,
    pub copies: u64,
}

/// What a repair did, and the audit after it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RepairSummary {
    #[serde(flatten)]
    pub repaired: Repaired,
    /// The audit after the repair; none if the repair was stopped.
    pub after: Option<Findings>,
}

/// Audits the window `selection` gives over the outbox and streams
/// `config` names, and repairs if asked.
pub async fn run(
    config: &RelayConfig,
    selection: Selection,
    options: &Options,
    stop: &CancellationToken,
) -> Result<Summary> {
    config.validate()?;
    if let Some(repair) = &options.repair {
        crate::replay::pace(repair.rate)?;
    }
    let selection = selection
        .ending_by(DateTime::now())
        .map_err(Error::Config)?;
    let started = Instant::now();
    let client = crate::connect::connect_mongodb(&config.mongodb_uri).await?;
    let database = client.database(&config.database);
    let outbox = existing_outbox(&database, config).await?;
    let auditor = Auditor::connect(outbox, config, options.pace).await?;
    let Audited { found, repair, .. } = auditor
        .audit(
            &selection,
            Reading::default(),
            options.repair.as_ref(),
            stop,
        )
        .await?;
    let streams = &auditor.streams;
    Ok(Summary {
        since: selection.since.map(shown),
        until: selection.until.map(shown).unwrap_or_default(),
        streams: streams
            .iter()
            .map(|stream| StreamSummary {
                name: stream.name.clone(),
                replicas: stream.replicas,
                duplicate_window_seconds: stream.duplicate_window.as_secs_f64(),
            })
            .collect(),
        found,
        repair,
        seconds: started.elapsed().as_secs_f64(),
        peak_memory_mib: crate::usage::peak_memory_mib("self"),
    })
}

/// What an audit reads and a repair publishes with: the outbox, the
/// streams that capture the relay's subjects, and a connection to NATS of
/// its own. Built once, by the `audit` command or a relay's watch.
pub(crate) struct Auditor {
    outbox: mongodb::Collection<bson::Document>,
    publisher: NatsPublisher,
    js: jetstream::Context,
    streams: Vec<CapturingStream>,
    rules: DecodeRules,
    retention: Option<Retention>,
    pace: Pace,
}

impl Auditor {
    /// Connects to NATS as `config` says, and finds the streams.
    pub(crate) async fn connect(
        outbox: mongodb::Collection<bson::Document>,
        config: &RelayConfig,
        pace: Pace,
    ) -> Result<Self> {
        if config.nats_mode == NatsMode::Core {
            return Err(Error::Config(
                "--nats-mode core: core NATS stores nothing to read back, so there is nothing \
                 to audit; an audit compares the outbox with the JetStream streams a relay \
                 publishes to"
                    .to_owned(),
            ));
        }
        let rules = config.subject_rules()?;
        let publisher = NatsPublisher::connect(config, &Metrics::new()).await?;
        let js = jetstream::new(publisher.client());
        let mut subjects = crate::check::captured_subjects(config);
        subjects.extend(rules.allowed().iter().cloned());
        let streams = stream::capturing(&js, &subjects).await?;
        if streams.is_empty() {
            return Err(Error::Config(format!(
                "no JetStream stream captures the relay's subjects ({}): there is nothing to \
                 audit against; give the relay's --subject-prefix, or create the stream",
                subjects.join(", ")
            )));
        }
        Ok(Auditor {
            outbox,
            rules: config.decode_rules(publisher.max_payload())?,
            publisher,
            js,
            streams,
            retention: config.retention,
            pace,
        })
    }

    /// Audits `selection`'s window; with `repair`, publishes the missing
    /// again and audits again.
    pub(crate) async fn audit(
        &self,
        selection: &Selection,
        reading: Reading,
        repair: Option<&RepairOptions>,
        stop: &CancellationToken,
    ) -> Result<Audited> {
        let audit = Audit {
            js: &self.js,
            streams: &self.streams,
            outbox: &self.outbox,
            selection,
            rules: &self.rules,
            retention: self.retention,
            pace: self.pace,
            stream_until: reading.stream_until,
            settled_before: reading.settled_before,
        };
        let first = audit.once().await?;
        let Some(asked) = repair.filter(|_| !first.missing.is_empty()) else {
            return Ok(Audited {
                found: first.findings,
                repair: None,
                first_unsettled: first.first_unsettled,
            });
        };
        let repair = Repair {
            outbox: &self.outbox,
            rules: &self.rules,
            publisher: &self.publisher,
            js: &self.js,
            streams: &self.streams,
            read_pace: self.pace,
            window_from: selection.since.map(|since| earlier(since, CLOCK_MARGIN)),
            duplicate_window: longest_window(&self.streams),
            pace: crate::replay::pace(asked.rate)?,
            wait: asked.wait,
        };
        let repaired = repair.run(&first.missing, stop).await?;
        let after = match repaired.ended {
            RepairEnd::Done => Some(audit.once().await?),
            RepairEnd::Stopped => None,
        };
        Ok(Audited {
            found: first.findings,
            first_unsettled: after
                .as_ref()
                .map_or(first.first_unsettled, |after| after.first_unsettled),
            repair: Some(RepairSummary {
                repaired,
                after: after.map(|after| after.findings),
            }),
        })
    }
}

/// How an audit reads, beyond its window.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Reading {
    /// Read the streams only to the first message stored after this
    /// (None: to their ends).
    pub stream_until: Option<DateTime>,
    /// A message processed at or after this is not settled yet.
    pub settled_before: Option<DateTime>,
}

/// What an audit found and did.
pub(crate) struct Audited {
    pub found: Findings,
    pub repair: Option<RepairSummary>,
    /// The first message of the window not settled: pending, or processed
    /// at or after [`Reading::settled_before`].
    pub first_unsettled: Option<ObjectId>,
}

/// What the reads of the streams counted, besides the ids.
struct ReadCounts {
    read: u64,
    foreign: u64,
    replayed: u64,
}

/// One audit's parts.
struct Audit<'a> {
    js: &'a jetstream::Context,
    streams: &'a [CapturingStream],
    outbox: &'a mongodb::Collection<bson::Document>,
    selection: &'a Selection,
    rules: &'a DecodeRules,
    retention: Option<Retention>,
    pace: Pace,
    /// The streams are read to the first message stored after this (None:
    /// to their ends).
    stream_until: Option<DateTime>,
    /// A message processed at or after this is not settled yet (see
    /// [`Once::first_unsettled`]).
    settled_before: Option<DateTime>,
}

/// What one audit found, and where it may move on to.
struct Once {
    findings: Findings,
    missing: Vec<Missing>,
    /// The first message of the window not settled (pending, or processed
    /// too recently): an audit moving on stops there.
    first_unsettled: Option<ObjectId>,
}

impl Audit<'_> {
    /// Reads the streams, then the outbox, and compares them.
    async fn once(&self) -> Result<Once> {
        let read_began = DateTime::now();
        let from = self
            .selection
            .since
            .map(|since| earlier(since, CLOCK_MARGIN));
        let judge = |seen: &Seen<'_>| self.judge(seen);
        let span = stream::Span {
            from,
            until: self.stream_until,
        };
        let mut stored = stream::read(self.js, self.streams, span, &judge, self.pace).await?;
        stored.ids.sort_unstable();
        let mut compared = compare::compare(
            self.outbox,
            self.selection,
            self.rules,
            &stored.ids,
            self.pace,
            self.settled_before,
        )
        .await?;
        let mut read = ReadCounts {
            read: stored.read,
            foreign: stored.foreign,
            replayed: stored.replayed,
        };
        let unrecorded = self.unrecorded(&compared.unrecorded);
        let horizon = stored.horizon;
        drop(stored);
        let past_stream_limits = horizon.map_or(0, |at| compared.set_aside_before(at));
        // Processed after the read began (or when, unknown): perhaps stored
        // after it read that far, so looked for again.
        let recheck_from = earlier(read_began, CLOCK_MARGIN);
        let late: Vec<Missing> = compared
            .missing
            .iter()
            .filter(|m| m.processed_at.is_none_or(|at| at >= recheck_from))
            .copied()
            .collect();
        if !late.is_empty() {
            let found = read_again(self.js, self.streams, &late, from, self.pace).await?;
            read.read += found.read;
            compared.found_later(&found.ids);
        }
        let findings = self.findings(&compared, unrecorded, past_stream_limits, &read);
        Ok(Once {
            findings,
            first_unsettled: compared.first_unsettled,
            missing: compared.missing,
        })
    }

    /// What a stored message is to this audit. A copy of an outbox message
    /// is judged by its id, type and key, which its document gave it; its
    /// subject is selected on the outbox's side, as today's rules render
    /// it (what was stored may predate a change of prefix or template).
    fn judge(&self, seen: &Seen<'_>) -> Verdict {
        let message_type = seen.header(header::TYPE).unwrap_or_default();
        let chosen = self.selection.matches_type(message_type)
            && self.selection.has_key(seen.header(header::KEY));
        if let Some(original) = seen.header(header::REPLAY_OF) {
            return match ObjectId::parse_str(original) {
                Ok(id) if chosen && self.selection.in_range(&id) => Verdict::Replayed,
                _ => Verdict::Outside,
            };
        }
        let published = crate::time::object_id_at(seen.published);
        match seen.outbox_id() {
            Some(id) if chosen && self.selection.in_range(&id) => Verdict::Outbox(id),
            Some(_) => Verdict::Outside,
            None if chosen
                && self.rules.subjects.check(seen.subject).is_ok()
                && self.selection.matches(message_type, seen.subject)
                && self.selection.in_range(&published) =>
            {
                Verdict::Foreign
            }
            None => Verdict::Outside,
        }
    }

    /// Stored ids the outbox does not hold, sorted by the likely reason.
    fn unrecorded(&self, ids: &[ObjectId]) -> Unrecorded {
        let now = DateTime::now();
        let mut unrecorded = Unrecorded::default();
        for id in ids {
            let committed = made_at(id);
            match self.retention {
                Some(Retention::Keep(keep)) if later(committed, keep) <= now => {
                    unrecorded.past_retention += 1
                }
                _ => unrecorded.unexplained += 1,
            }
        }
        unrecorded
    }

    fn findings(
        &self,
        compared: &Compared,
        unrecorded: Unrecorded,
        past_stream_limits: u64,
        counts: &ReadCounts,
    ) -> Findings {
        let window = longest_window(self.streams);
        let now = DateTime::now();
        let remembered: Vec<DateTime> = compared
            .missing
            .iter()
            .filter_map(|m| m.processed_at)
            .map(|at| later(at, window))
            .filter(|until| *until > now)
            .collect();
        Findings {
            messages: compared.messages,
            delivered: compared.delivered,
            missing: compared.missing.len() as u64,
            stored_more_than_once: compared.repeated,
            past_stream_limits,
            pending: compared.pending,
            failed: compared.failed,
            unrecorded,
            foreign: counts.foreign,
            replayed: counts.replayed,
            remembered: remembered.iter().max().map(|until| Remembered {
                messages: remembered.len() as u64,
                until: shown(*until),
            }),
            missing_listed: compared.missing_listed.iter().map(listed).collect(),
            stored_more_than_once_listed: compared.repeated_listed.iter().map(listed).collect(),
            stream_messages_read: counts.read,
        }
    }
}

/// Reads `streams` again for copies of `missing` (a replay's are not),
/// from just before the first of them was processed, or from
/// `window_from` where one says not when it was: what a read that ended
/// before they were stored could not see.
async fn read_again(
    js: &jetstream::Context,
    streams: &[CapturingStream],
    missing: &[Missing],
    window_from: Option<DateTime>,
    pace: Pace,
) -> Result<stream::Stored> {
    let times: Option<Vec<DateTime>> = missing.iter().map(|m| m.processed_at).collect();
    let from = match times.and_then(|times| times.into_iter().min()) {
        Some(first) => Some(earlier(first, CLOCK_MARGIN)),
        None => window_from,
    };
    let ids: HashSet<ObjectId> = missing.iter().map(|m| m.id).collect();
    let judge = |seen: &Seen<'_>| match seen.outbox_id() {
        Some(id) if ids.contains(&id) && seen.header(header::REPLAY).is_none() => {
            Verdict::Outbox(id)
        }
        _ => Verdict::Outside,
    };
    let span = stream::Span { from, until: None };
    stream::read(js, streams, span, &judge, pace).await
}

/// The longest duplicate window of `streams`.
fn longest_window(streams: &[CapturingStream]) -> Duration {
    streams
        .iter()
        .map(|stream| stream.duplicate_window)
        .max()
        .unwrap_or_default()
}

fn listed(described: &Described) -> Listed {
    Listed {
        id: described.id.to_hex(),
        subject: described.subject.clone(),
        message_type: described.message_type.clone(),
        key: described.key.clone(),
        committed_at: shown(made_at(&described.id)),
        processed_at: described.processed_at.map(shown),
        copies: described.copies,
    }
}
