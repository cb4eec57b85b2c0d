//! Reading back what the streams hold: which streams capture the relay's
//! subjects, and the ids of what they store from a moment on.
//!
//! A stream is read by an ephemeral consumer of its own that asks for
//! headers only (`headers_only`: the payloads never cross the wire), from a
//! start time, acknowledging nothing, in batches fetched without waiting,
//! to the last message it held when the read began (or, where asked, to
//! the first stored after a moment). What is kept of a message is its verdict, and of an
//! outbox message its id alone: 12 bytes a stored copy (see
//! [`MAX_STORED`]).

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::response::Response;
use async_nats::jetstream::stream::RetentionPolicy;
use async_nats::jetstream::{self, Context};
use bson::oid::ObjectId;
use futures::TryStreamExt;

use super::pace::{Pace, Pacer};
use crate::contract::header;
use crate::error::{Error, Result};

/// Messages a fetch asks for at a time.
const BATCH: usize = 1_000;

/// The longest a batch may take: a pull request lost to a reconnect would
/// otherwise be waited on for ever.
const READ_WAIT: Duration = Duration::from_secs(30);

/// Empty batches in a row, with messages pending, before a read gives up,
/// each after a pause longer by this.
const EMPTY_BATCHES: u32 = 10;
const EMPTY_PAUSE: Duration = Duration::from_millis(100);

/// The most stored copies of outbox messages one audit holds: 12 bytes
/// each, 60 MB in all. A window that stores more is refused, to be audited
/// in parts.
pub const MAX_STORED: usize = 5_000_000;

/// A stream capturing some of the relay's subjects.
#[derive(Debug, Clone)]
pub struct CapturingStream {
    pub name: String,
    /// How long it remembers a message id after storing it.
    pub duplicate_window: Duration,
    /// Its replicas: one, and a crash of its host can lose what it
    /// acknowledged since its last flush to disk.
    pub replicas: usize,
}

/// Why a stream cannot be audited: it removes messages by design, so one
/// it does not hold may have been consumed or replaced, not lost.
fn unauditable(name: &str, config: &jetstream::stream::Config) -> Option<String> {
    if config.retention != RetentionPolicy::Limits {
        return Some(format!(
            "stream {name:?} removes what its consumers acknowledge ({:?} retention): a message \
             it no longer holds may have been consumed, not lost, so it cannot be audited, and a \
             repair would deliver consumed messages again",
            config.retention
        ));
    }
    (config.max_messages_per_subject > 0).then(|| {
        format!(
            "stream {name:?} keeps {} message(s) a subject: one it no longer holds may have been \
             replaced by a later one, not lost, so it cannot be audited, and a repair would put \
             an old message back in place of the newest",
            config.max_messages_per_subject
        )
    })
}

/// The moment before which a stream's own limits (`max_age`, `max_msgs`,
/// `max_bytes`) may have removed what it stored, as its state says now;
/// None: it removes nothing by itself.
fn horizon(info: &jetstream::stream::Info) -> Option<bson::DateTime> {
    let config = &info.config;
    let mut horizon = None;
    if !config.max_age.is_zero() {
        horizon = Some(crate::time::earlier(bson::DateTime::now(), config.max_age));
    }
    if config.max_messages > 0 || config.max_bytes > 0 {
        horizon = horizon.max(Some(moment(info.state.first_timestamp)));
    }
    horizon
}

/// The streams that capture any of `subjects`, each once.
pub async fn capturing(js: &Context, subjects: &[String]) -> Result<Vec<CapturingStream>> {
    let mut names: Vec<String> = Vec::new();
    for subject in subjects {
        for name in names_capturing(js, subject).await? {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    let mut streams = Vec::with_capacity(names.len());
    for name in names {
        let stream = js
            .get_stream(&name)
            .await
            .map_err(|e| unreadable(&name, &e))?;
        let info = stream.cached_info();
        if let Some(why) = unauditable(&name, &info.config) {
            return Err(Error::Config(why));
        }
        streams.push(CapturingStream {
            duplicate_window: info.config.duplicate_window,
            replicas: info.config.num_replicas.max(1),
            name,
        });
    }
    Ok(streams)
}

/// A page of `$JS.API.STREAM.NAMES`.
#[derive(Debug, serde::Deserialize)]
struct NamesPage {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    streams: Option<Vec<String>>,
}

/// The names of every stream whose subjects overlap `subject`: the
/// client's own lookup gives only the first.
async fn names_capturing(js: &Context, subject: &str) -> Result<Vec<String>> {
    let mut names = Vec::new();
    loop {
        let request = serde_json::json!({ "subject": subject, "offset": names.len() });
        let page: Response<NamesPage> = js
            .request("STREAM.NAMES", &request)
            .await
            .map_err(|e| listing(subject, &e))?;
        let page = match page {
            Response::Ok(page) => page,
            Response::Err { error } => return Err(listing(subject, &error)),
        };
        let streams = page.streams.unwrap_or_default();
        let fetched = streams.len();
        names.extend(streams);
        if fetched == 0 || names.len() >= page.total {
            return Ok(names);
        }
    }
}

fn listing(subject: &str, error: &dyn std::fmt::Display) -> Error {
    Error::Config(format!(
        "cannot list the JetStream streams that capture {subject} ({error}): the audit needs \
         $JS.API.STREAM.NAMES"
    ))
}

/// What a stored message is to an audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A copy of outbox message `id`, in the audited window and selection.
    Outbox(ObjectId),
    /// A copy sent by a replay (`Outbox-Replay`): not a delivery.
    Replayed,
    /// Under the relay's subjects, in the window, with no outbox id.
    Foreign,
    /// Outside the audit: another subject, another window or selection.
    Outside,
}

/// What a read of the streams found.
#[derive(Debug, Default)]
pub struct Stored {
    /// One entry a stored copy of an outbox message, in no order.
    pub ids: Vec<ObjectId>,
    pub replayed: u64,
    pub foreign: u64,
    /// Messages read, whatever their verdict.
    pub read: u64,
    /// The latest moment before which a stream read may have removed
    /// messages by its limits: a message committed earlier that no stream
    /// holds is not counted missing.
    pub horizon: Option<bson::DateTime>,
}

impl Stored {
    fn take(&mut self, verdict: Verdict) -> Result<()> {
        self.read += 1;
        match verdict {
            Verdict::Outbox(id) => {
                if self.ids.len() >= MAX_STORED {
                    return Err(Error::Config(format!(
                        "the window stores more than {MAX_STORED} messages, more than one audit \
                         holds: audit it in parts (--since and --until)"
                    )));
                }
                self.ids.push(id);
            }
            Verdict::Replayed => self.replayed += 1,
            Verdict::Foreign => self.foreign += 1,
            Verdict::Outside => {}
        }
        Ok(())
    }
}

/// The headers and place of a stored message, as a verdict reads them.
pub struct Seen<'a> {
    pub subject: &'a str,
    pub published: bson::DateTime,
    headers: Option<&'a async_nats::HeaderMap>,
}

impl Seen<'_> {
    /// A header's value, if the message has it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .and_then(|headers| headers.get(name))
            .map(|value| value.as_str())
    }

    /// The outbox id it names, if `Nats-Msg-Id` is one.
    pub fn outbox_id(&self) -> Option<ObjectId> {
        ObjectId::parse_str(self.header(header::MSG_ID)?).ok()
    }
}

/// What of the streams a read covers: from a moment (None: their first
/// message) to where they ended when it began, or to the first message
/// stored after `until`.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub from: Option<bson::DateTime>,
    pub until: Option<bson::DateTime>,
}

/// Reads `streams` over `span`, judging each message.
pub async fn read(
    js: &Context,
    streams: &[CapturingStream],
    span: Span,
    judge: &(dyn Fn(&Seen<'_>) -> Verdict + Sync),
    pace: Pace,
) -> Result<Stored> {
    let mut stored = Stored::default();
    let mut pacer = pace.start();
    for stream in streams {
        read_one(js, &stream.name, span, judge, &mut stored, &mut pacer).await?;
    }
    Ok(stored)
}

async fn read_one(
    js: &Context,
    name: &str,
    span: Span,
    judge: &(dyn Fn(&Seen<'_>) -> Verdict + Sync),
    stored: &mut Stored,
    pacer: &mut Pacer,
) -> Result<()> {
    let stream = js
        .get_stream(name)
        .await
        .map_err(|e| unreadable(name, &e))?;
    // What it held when the read began is what is read: traffic that goes
    // on meanwhile does not keep the read from ending. (Getting the
    // stream asked for its state just now.)
    let info = stream.cached_info();
    let last = info.state.last_sequence;
    stored.horizon = stored.horizon.max(horizon(info));
    if last == 0 {
        return Ok(());
    }
    let deliver_policy = match span.from {
        Some(from) => DeliverPolicy::ByStartTime {
            start_time: time::OffsetDateTime::from_unix_timestamp_nanos(
                i128::from(from.timestamp_millis()) * 1_000_000,
            )
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
        },
        None => DeliverPolicy::All,
    };
    let consumer = stream
        .create_consumer(headers_reader(deliver_policy))
        .await
        .map_err(|e| unreadable(name, &e))?;
    let consumer_name = consumer.cached_info().name.clone();
    let read = async {
        let mut empty = 0;
        loop {
            let read_before = stored.read;
            let fetching = fetch(&consumer, name, judge, stored, pacer.batch(BATCH));
            let batch = tokio::time::timeout(READ_WAIT, fetching)
                .await
                .map_err(|_| {
                    let late = format!("no batch came within {READ_WAIT:?}; run the audit again");
                    reading(name, &late)
                })??;
            pacer.read(stored.read - read_before).await;
            match batch {
                // Read to where it ended, or nothing left after it (what
                // was at the end was deleted).
                Some(At {
                    sequence, pending, ..
                }) if sequence >= last || pending == 0 => return Ok::<_, Error>(()),
                // Stored after the span: what comes later is too.
                Some(At { published, .. }) if span.until.is_some_and(|until| published > until) => {
                    return Ok(())
                }
                Some(_) => {}
                // Nothing now: the end, if the consumer says nothing is
                // left, else asked again.
                None => {
                    let mut consumer = consumer.clone();
                    let info = consumer.info().await.map_err(|e| reading(name, &e))?;
                    if info.num_pending == 0 || info.delivered.stream_sequence >= last {
                        return Ok(());
                    }
                    empty += 1;
                    if empty >= EMPTY_BATCHES {
                        let stuck = "it answers with nothing though messages are pending";
                        return Err(reading(name, &stuck));
                    }
                    tokio::time::sleep(EMPTY_PAUSE * empty).await;
                }
            }
        }
    }
    .await;
    let _ = stream.delete_consumer(&consumer_name).await;
    read
}

/// Where a batch ended: its last message's stream sequence, and how many
/// messages the consumer had left after it.
struct At {
    sequence: u64,
    pending: u64,
    published: bson::DateTime,
}

/// One batch, judged; where it ended, None if it brought nothing.
async fn fetch(
    consumer: &jetstream::consumer::PullConsumer,
    name: &str,
    judge: &(dyn Fn(&Seen<'_>) -> Verdict + Sync),
    stored: &mut Stored,
    batch: usize,
) -> Result<Option<At>> {
    // Without waiting: an empty answer comes at once (the caller bounds
    // the whole batch by `READ_WAIT`).
    let mut batch = consumer
        .fetch()
        .max_messages(batch)
        .messages()
        .await
        .map_err(|e| reading(name, &e))?;
    let mut at = None;
    while let Some(message) = batch.try_next().await.map_err(|e| reading(name, &e))? {
        let info = message.info().map_err(|e| reading(name, &e))?;
        let published = moment(info.published);
        at = Some(At {
            sequence: info.stream_sequence,
            pending: info.pending,
            published,
        });
        let seen = Seen {
            subject: message.subject.as_str(),
            published,
            headers: message.headers.as_ref(),
        };
        stored.take(judge(&seen))?;
    }
    Ok(at)
}

/// A moment as NATS gives it, as MongoDB stores one (milliseconds).
fn moment(at: time::OffsetDateTime) -> bson::DateTime {
    let millis = at.unix_timestamp_nanos() / 1_000_000;
    bson::DateTime::from_millis(i64::try_from(millis).unwrap_or(i64::MAX))
}

/// A consumer that reads a stream's headers from `deliver_policy` on,
/// acknowledging nothing: what an audit reads with.
pub(crate) fn headers_reader(deliver_policy: DeliverPolicy) -> pull::Config {
    pull::Config {
        deliver_policy,
        ack_policy: AckPolicy::None,
        headers_only: true,
        memory_storage: true,
        // Gone on its own if its reader dies: it holds nothing.
        inactive_threshold: Duration::from_secs(60),
        ..Default::default()
    }
}

fn unreadable(name: &str, error: &dyn std::fmt::Display) -> Error {
    Error::Config(format!(
        "cannot read JetStream stream {name:?} ({error}): the audit reads it through a consumer \
         of its own, and needs $JS.API.STREAM.INFO.{name}, $JS.API.CONSUMER.CREATE.{name}, \
         $JS.API.CONSUMER.MSG.NEXT.{name}.> and $JS.API.CONSUMER.DELETE.{name}.>"
    ))
}

fn reading(name: &str, error: &dyn std::fmt::Display) -> Error {
    Error::Nats {
        context: format!("reading JetStream stream {name:?} failed"),
        source: error.to_string().into(),
    }
}
