//! The change-stream source: the fast path from commit to publish.
//!
//! It tails inserts of pending messages on the outbox collection, with the
//! document taken from the insert event itself, so a message reaches the
//! publisher with no further database round trip. How it starts is
//! [`start`]'s decision: it resumes from the stored token, or, when there
//! is none, the server can no longer resume from it (the history is gone,
//! or the token is not one it accepts), or more is pending than a replay
//! should read (`--max-replay`), it says so and runs the catch-up pass over
//! a snapshot of the collection, then tails from the snapshot's moment, so
//! nothing committed in the gap is lost and no key's messages are read out
//! of order. On idle streams it still passes on the server's newest
//! position now and then, so the stored token does not fall behind the
//! oplog's history.
//!
//! A stream can also end: dropping or renaming the collection or its
//! database invalidates it, and the server closes its cursor. The source
//! notices at once, says so, waits (with backoff, idle) until the collection
//! exists again, prepares it again (its indexes went with it), and reopens
//! from that moment with a catch-up pass, so what was written since is
//! delivered. Readiness is down meanwhile.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document, RawDocumentBuf};
use futures::future::BoxFuture;
use mongodb::change_stream::event::{OperationType, ResumeToken};
use mongodb::change_stream::ChangeStream;
use mongodb::error::ErrorKind;
use mongodb::Collection;
use serde::Deserialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::progress::StreamProgress;

mod replayed;
mod start;
use replayed::{Seen, Window};

use crate::contract::{field, status, DecodeRules};
use crate::observe::{Metrics, Role};
use crate::partition::Partition;
use crate::retry::{back_off, reconnect_backoff, until_settled};
use crate::setup::collection_exists;
use crate::work::{Feed, Work};

type Events = ChangeStream<Event>;

/// The fields of a change event the relay keeps. The inserted document,
/// and the document key that repeats its `_id`, are kept as the server
/// sent them, so a document the driver cannot read (a string that is not
/// UTF-8, say) fails alone instead of breaking the stream at its event for
/// good. The namespace is skipped rather than built into a document.
#[derive(Debug, Deserialize)]
struct Event {
    #[serde(rename = "_id")]
    id: ResumeToken,
    #[serde(rename = "operationType")]
    operation_type: OperationType,
    #[serde(rename = "clusterTime")]
    cluster_time: Option<bson::Timestamp>,
    #[serde(rename = "wallTime")]
    wall_time: Option<DateTime>,
    #[serde(rename = "fullDocument")]
    full_document: Option<RawDocumentBuf>,
    /// Never read: named so that it is not walked.
    #[serde(rename = "documentKey")]
    _document_key: Option<RawDocumentBuf>,
}

/// The change-stream label servers put on errors a stream can resume after.
const RESUMABLE_LABEL: &str = "ResumableChangeStreamError";

/// CursorNotFound: resumable by the change streams specification.
const CURSOR_NOT_FOUND: i32 = 43;

/// Where this source logs: the benchmark reads its lines (see [`said`]).
#[cfg(feature = "bench")]
pub(crate) const LOG_TARGET: &str = module_path!();

/// What the source says of how it started, in words the benchmark looks
/// for in a relay's log to refuse a drain of the wrong kind.
pub(crate) mod said {
    /// A catch-up pass read the backlog (info).
    pub(crate) const PASS_QUEUED: &str = "catch-up pass queued the pending messages";
    /// The backlog could not be counted, so the stream replays (warn).
    pub(crate) const NOT_COUNTED: &str = "could not count the pending messages";
    /// The stored position is gone from the oplog (error).
    pub(crate) const CANNOT_RESUME: &str = "the change stream cannot resume from the stored token";
}

/// Tails the outbox collection's inserts.
pub(crate) struct ChangeStreamSource {
    pub outbox: Collection<Document>,
    /// The partition it reads: its stream and its catch-up pass see this
    /// partition's messages alone.
    pub partition: Partition,
    pub rules: DecodeRules,
    pub max_await_time: Duration,
    /// Least time between two idle position updates.
    pub idle_checkpoint_interval: Duration,
    /// How long after a catch-up pass the stream may still repeat its messages.
    pub grace_period: Duration,
    /// Most due messages a first resume replays rather than catches up.
    pub max_replay: u32,
    pub metrics: Metrics,
    /// Prepares the collection again after it was dropped and recreated.
    pub prepare: Prepare,
    /// How far the source has read, for the sweep.
    pub progress: StreamProgress,
}

/// Prepares the outbox collection (indexes, retention, validator).
pub(crate) type Prepare =
    Arc<dyn Fn() -> BoxFuture<'static, crate::error::Result<()>> + Send + Sync>;

impl ChangeStreamSource {
    /// Feeds the pipeline from the stream, starting after `token` (or from
    /// now), until shutdown. A broken stream is reopened where it stopped.
    pub async fn run(self, token: Option<ResumeToken>, output: Feed, shutdown: CancellationToken) {
        let mut position = token;
        let mut backoff = reconnect_backoff();
        // What a catch-up pass read, still to be skipped by a stream that
        // broke before it passed the pass's snapshot.
        let mut carried = None;
        // What the stream passed on, kept over reopenings.
        let mut seen = Seen::default();
        while let Some((events, caught_up, window)) = self
            .start(position.clone(), carried.take(), &output, &shutdown)
            .await
        {
            if window == Window::Live {
                // Opened at a catch-up pass's snapshot, which may hold
                // another history (a restored deployment, say).
                seen = Seen::default();
            }
            match self
                .tail(events, caught_up, window, &mut seen, &output, &shutdown)
                .await
            {
                Tail::Stopped => return,
                // A stream that breaks again where it broke before is
                // reopened with backoff, not in a tight loop.
                Tail::Broken(last, caught_up) if last == position => {
                    carried = Some(caught_up);
                    if !back_off(&mut backoff, &shutdown).await {
                        return;
                    }
                }
                Tail::Broken(last, caught_up) => {
                    carried = Some(caught_up);
                    backoff = reconnect_backoff();
                    position = last;
                }
                Tail::Ended => {
                    // A recreated collection may come with another history.
                    seen = Seen::default();
                    self.metrics.stream_ended();
                    self.metrics.set_role_unless_stopping(Role::Leading);
                    if !self.await_collection(&shutdown).await {
                        return;
                    }
                    position = None;
                }
            }
        }
    }

    /// Waits, with backoff, until the outbox collection exists again, then
    /// prepares it. False if the relay stopped first.
    async fn await_collection(&self, shutdown: &CancellationToken) -> bool {
        let namespace = self.outbox.namespace();
        tracing::error!(
            %namespace,
            "the change stream ended: the outbox collection or its database was dropped or \
             renamed; waiting for it to exist again, then delivering what is pending in it"
        );
        let database = self.outbox.client().database(&namespace.db);
        let mut backoff = reconnect_backoff();
        loop {
            match collection_exists(&database, &namespace.coll).await {
                Ok(true) => break,
                Ok(false) => {}
                Err(error) => tracing::debug!(%error, "listing collections failed"),
            }
            if !back_off(&mut backoff, shutdown).await {
                return false;
            }
        }
        if let Err(error) = (self.prepare)().await {
            tracing::warn!(%error, "could not prepare the recreated outbox collection");
        }
        tracing::info!(%namespace, "the outbox collection exists again: reopening the change stream");
        true
    }

    /// Opens the stream at `position`, asking for `batch` events at a time
    /// (see [`super::catch_up::read_batch`]): a replay's events carry whole
    /// messages, as the pass's documents are. The stream keeps its batch
    /// for as long as it stays open, after the backlog that sized it is
    /// gone; the least batch, sixteen events a round trip, still outpaces
    /// what a live stream brings.
    async fn open(&self, position: Position, batch: u32) -> mongodb::error::Result<Events> {
        let watch = self
            .outbox
            .watch()
            .pipeline(new_messages(self.partition))
            .batch_size(batch)
            .max_await_time(self.max_await_time);
        let events = match position {
            Position::After(token) => watch.start_after(token).await,
            Position::At(Some(time)) => watch.start_at_operation_time(time).await,
            Position::At(None) => watch.await,
        };
        events.map(ChangeStream::with_type)
    }

    /// Opens the stream at `position`, retrying passing errors with
    /// backoff. Returns the stream, or the error no retry mends; `None` if
    /// the relay stopped first.
    async fn open_retrying(
        &self,
        position: Position,
        batch: u32,
        shutdown: &CancellationToken,
    ) -> Option<mongodb::error::Result<Events>> {
        let open = || self.open(position.clone(), batch);
        until_settled("MongoDB change stream", shutdown, open, |error| {
            !is_resumable(error)
        })
        .await
    }

    /// Passes each insert on, with stream positions in between, until
    /// shutdown or until the stream breaks.
    ///
    /// Messages the catch-up pass already queued are passed on as bare
    /// positions (see [`CaughtUp`]), and so are those a replay's `window`
    /// finds delivered already; what `seen` says was passed on is dropped
    /// (see [`replayed`]).
    async fn tail(
        &self,
        mut events: Events,
        mut caught_up: CaughtUp,
        mut window: Window,
        seen: &mut Seen,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Tail {
        let mut last = events.resume_token();
        let mut last_sent = Instant::now();
        // A replay's window, held back for one read of which are delivered.
        let mut held = Held::default();
        // Whether the newest event read repeated one passed on: the driver
        // resumed from an earlier position, and the stream's own position
        // is behind what was passed on until it reads past it again.
        let mut behind = false;
        loop {
            let read = {
                // What a replay's window holds goes on once it has waited
                // `HELD_AT_MOST` for a read: the read that finds nothing
                // more committed (and so ends the window) waits up to
                // `--max-await-time`. The read is kept meanwhile, never
                // dropped: one dropped while the driver resumes the stream
                // loses the stream's position.
                let flush_at = Instant::now() + replayed::HELD_AT_MOST;
                let read = events.next_if_any();
                tokio::pin!(read);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => break None,
                        next = &mut read => break Some(next),
                        _ = tokio::time::sleep_until(flush_at), if !held.is_empty() => {
                            let passed = (&mut caught_up, &mut last);
                            if !self
                                .pass_on_held(&mut held, Check::Delivered, passed, output, shutdown)
                                .await
                            {
                                return Tail::Stopped;
                            }
                            last_sent = Instant::now();
                        }
                    }
                }
            };
            let Some(next) = read else {
                // The newest position the stream reported: every event
                // before it has been passed on, so it may be recorded,
                // unless some are still held back or it is behind.
                if let Some(token) = events
                    .resume_token()
                    .filter(|t| held.is_empty() && !behind && Some(t) != last.as_ref())
                {
                    let _ = output
                        .send(Work::marker(token, Some(DateTime::now())))
                        .await;
                }
                return Tail::Stopped;
            };
            let insert = match next {
                Ok(Some(event)) if event.operation_type == OperationType::Invalidate => {
                    return self
                        .end(Tail::Ended, held, caught_up, last, output, shutdown)
                        .await;
                }
                Ok(None) if !events.is_alive() => {
                    return self
                        .end(Tail::Ended, held, caught_up, last, output, shutdown)
                        .await;
                }
                Err(error) => {
                    tracing::warn!(
                        error = %crate::error::brief(&error),
                        "change stream failed; reopening it"
                    );
                    let broken = Tail::Broken(None, CaughtUp::none());
                    return self
                        .end(broken, held, caught_up, last, output, shutdown)
                        .await;
                }
                Ok(Some(event)) => Insert::from(event),
                Ok(None) => {
                    behind = false;
                    // Caught up with the present: the window is over.
                    window = Window::Live;
                    if !held.is_empty() {
                        let check = Check::Delivered;
                        let passed = (&mut caught_up, &mut last);
                        if !self
                            .pass_on_held(&mut held, check, passed, output, shutdown)
                            .await
                        {
                            return Tail::Stopped;
                        }
                        last_sent = Instant::now();
                    }
                    // Nothing more committed: read up to now.
                    self.progress.read(Some(DateTime::now()));
                    self.metrics.stream_idle(self.partition);
                    match events.resume_token() {
                        Some(token)
                            if Some(&token) != last.as_ref()
                                && last_sent.elapsed() >= self.idle_checkpoint_interval =>
                        {
                            last = Some(token.clone());
                            if output
                                .send(Work::marker(token, Some(DateTime::now())))
                                .await
                                .is_err()
                            {
                                return Tail::Stopped;
                            }
                            last_sent = Instant::now();
                        }
                        _ => {}
                    }
                    continue;
                }
            };
            behind = seen.repeats(insert.cluster_time, insert.id());
            if behind {
                continue;
            }
            if window.ends_before(insert.cluster_time) {
                window = Window::Live;
                let passed = (&mut caught_up, &mut last);
                if !self
                    .pass_on_held(&mut held, Check::Delivered, passed, output, shutdown)
                    .await
                {
                    return Tail::Stopped;
                }
            }
            if window == Window::Live {
                let token = insert.token.clone();
                let Some(work) = self.work(insert, &mut caught_up, shutdown).await else {
                    return Tail::Stopped;
                };
                if output.send(work).await.is_err() {
                    return Tail::Stopped;
                }
                last = Some(token);
            } else if !held.take(insert) {
                let passed = (&mut caught_up, &mut last);
                if !self
                    .pass_on_held(&mut held, Check::Delivered, passed, output, shutdown)
                    .await
                {
                    return Tail::Stopped;
                }
            } else {
                continue;
            }
            last_sent = Instant::now();
        }
    }

    /// Ends tailing as `how` says, once what the window held back is
    /// passed on: a stream that broke reopens after it. Where the stream
    /// ended (the collection dropped or renamed), the held messages are
    /// passed on unchecked: the collection that would say which were
    /// delivered may be gone, and a repeat is allowed where a loss is not.
    async fn end(
        &self,
        how: Tail,
        mut held: Held,
        mut caught_up: CaughtUp,
        mut last: Option<ResumeToken>,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Tail {
        let check = match how {
            Tail::Broken(..) => Check::Delivered,
            Tail::Ended | Tail::Stopped => Check::None,
        };
        let passed = (&mut caught_up, &mut last);
        if !self
            .pass_on_held(&mut held, check, passed, output, shutdown)
            .await
        {
            return Tail::Stopped;
        }
        match how {
            Tail::Broken(..) => Tail::Broken(last, caught_up),
            other => other,
        }
    }

    /// Passes on what a replay's window held back, if anything, in order:
    /// as messages those still pending (or all of them, where `check` says
    /// so), the rest (delivered, or deleted since: see [`replayed`]) as
    /// bare positions; `last` becomes the last position
    /// passed on. False if the pipeline closed or the relay stopped.
    async fn pass_on_held(
        &self,
        held: &mut Held,
        check: Check,
        (caught_up, last): (&mut CaughtUp, &mut Option<ResumeToken>),
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> bool {
        if held.is_empty() {
            return true;
        }
        let settled = match check {
            Check::Delivered => {
                let ids = held.inserts.iter().filter_map(Insert::id).collect();
                // Events come in commit order: the newest commit is the
                // last's, if every event says its own.
                let after = held
                    .inserts
                    .iter()
                    .map(|insert| insert.cluster_time)
                    .collect::<Option<Vec<_>>>()
                    .and_then(|times| times.into_iter().max());
                let settled = replayed::settled(&self.outbox, ids, after, shutdown).await;
                if shutdown.is_cancelled() {
                    return false;
                }
                settled.unwrap_or_default()
            }
            Check::None => HashSet::new(),
        };
        if !settled.is_empty() {
            tracing::debug!(
                count = settled.len(),
                "the replayed stream skips messages delivered already, or deleted since"
            );
        }
        for insert in std::mem::take(held).inserts {
            let token = insert.token.clone();
            let work = match insert.id() {
                Some(id) if settled.contains(&id) => {
                    self.progress.read(insert.at);
                    Work::marker(insert.token, insert.at)
                }
                _ => match self.work(insert, caught_up, shutdown).await {
                    Some(work) => work,
                    None => return false,
                },
            };
            if output.send(work).await.is_err() {
                return false;
            }
            *last = Some(token);
        }
        true
    }

    /// What an insert event becomes, once it is passed on: the message,
    /// or a bare position for a message the catch-up pass queued already.
    /// `None` if the relay stopped first.
    async fn work(
        &self,
        insert: Insert,
        caught_up: &mut CaughtUp,
        shutdown: &CancellationToken,
    ) -> Option<Work> {
        let Insert {
            token,
            at,
            cluster_time,
            document,
        } = insert;
        self.progress.read(at);
        self.metrics.stream_event(self.partition, at);
        let work = match document {
            Some(document) if document.get(OVERSIZED).ok().flatten().is_some() => {
                let whole = tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    whole = self.read_whole(&document) => whole,
                };
                match whole {
                    Some(whole) if !caught_up.repeats(&whole, cluster_time) => {
                        Work::from_stream(self.rules.decode_raw(&whole), token, at)
                    }
                    _ => Work::marker(token, at),
                }
            }
            Some(document) if !caught_up.repeats(&document, cluster_time) => {
                Work::from_stream(self.rules.decode_raw(&document), token, at)
            }
            _ => Work::marker(token, at),
        };
        Some(work)
    }

    /// The whole document of a message too large for its event, read from
    /// the collection while it is pending, so that it takes its turn among
    /// its key's messages. `None` if it is pending no longer (delivered by
    /// the sweep meanwhile), or the read failed or took longer than
    /// [`replayed::READ_LIMIT`]: then the sweep delivers it, possibly after
    /// its key's later messages (docs/guarantees.md).
    async fn read_whole(&self, stub: &RawDocumentBuf) -> Option<RawDocumentBuf> {
        let id = stub.get(field::ID).ok().flatten()?.to_raw_bson();
        let id = bson::Bson::try_from(id).ok()?;
        let outbox = self.outbox.clone_with_type::<RawDocumentBuf>();
        let read = outbox
            .find_one(doc! { field::ID: &id, field::STATUS: status::PENDING })
            .max_time(replayed::READ_LIMIT);
        let read = tokio::time::timeout(replayed::READ_LIMIT * 2, read).await;
        match read {
            Ok(Ok(whole)) => whole,
            Ok(Err(error)) => {
                tracing::warn!(
                    %id,
                    error = %crate::error::brief(&error),
                    "could not read a message too large for its change event; the sweep \
                     delivers it, possibly after its key's later messages"
                );
                None
            }
            Err(_) => {
                tracing::warn!(
                    %id,
                    "reading a message too large for its change event took too long; the \
                     sweep delivers it, possibly after its key's later messages"
                );
                None
            }
        }
    }
}

/// Whether held messages are checked for delivery before they are passed on.
#[derive(Clone, Copy)]
enum Check {
    /// One read says which are delivered already.
    Delivered,
    /// All are passed on as messages.
    None,
}

/// An insert event as the source keeps it until it is passed on.
struct Insert {
    token: ResumeToken,
    at: Option<DateTime>,
    cluster_time: Option<bson::Timestamp>,
    document: Option<RawDocumentBuf>,
}

impl Insert {
    fn id(&self) -> Option<ObjectId> {
        self.document.as_ref().and_then(replayed::id_of)
    }
}

impl From<Event> for Insert {
    fn from(event: Event) -> Self {
        Insert {
            token: event.id,
            at: commit_time(event.wall_time, event.cluster_time),
            cluster_time: event.cluster_time,
            document: event.full_document,
        }
    }
}

/// The inserts a replay's window holds back, bounded by count and bytes.
#[derive(Default)]
struct Held {
    inserts: Vec<Insert>,
    bytes: usize,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.inserts.is_empty()
    }

    /// Holds `insert` back; false once the chunk is full and is to be
    /// passed on.
    fn take(&mut self, insert: Insert) -> bool {
        self.bytes += insert.document.as_ref().map_or(0, |d| d.as_bytes().len());
        self.inserts.push(insert);
        self.inserts.len() < replayed::CHUNK && self.bytes < replayed::CHUNK_BYTES
    }
}

/// The stream's pipeline: inserts of pending messages, and the event that
/// ends the stream. A document inserted in any other state (restored from a
/// backup, copied from another outbox) is history, not news.
///
/// A change event may not exceed 16 MiB, and an event carrying a document
/// near that size would break the stream at its position for good (MongoDB
/// fails the read with `BSONObjectTooLarge`, and resuming meets the same
/// event). So such a document comes as a stub of its `_id`, and the sweep,
/// which reads the document itself, delivers or fails it.
///
/// A partition's stream matches its own inserts alone, by a fixed query,
/// so its resume token serves whoever owns it next.
pub(crate) fn new_messages(partition: Partition) -> [Document; 2] {
    let full = "$fullDocument";
    let mut inserted = doc! { "operationType": "insert", "fullDocument.status": status::PENDING };
    if let Some(selector) = partition.selector("fullDocument.") {
        inserted = doc! { "$and": [inserted, selector] };
    }
    [
        doc! { "$match": { "$or": [
            inserted,
            { "operationType": "invalidate" },
        ] } },
        doc! { "$addFields": { "fullDocument": { "$cond": [
            { "$gt": [{ "$bsonSize": full }, LARGEST_DOCUMENT_IN_AN_EVENT] },
            { field::ID: "$fullDocument._id", OVERSIZED: true },
            full,
        ] } } },
    ]
}

/// The largest document an event carries whole: 16 MiB less room for the
/// event's own fields (resume token, namespace, document key, times).
const LARGEST_DOCUMENT_IN_AN_EVENT: i64 = (16 << 20) - (64 << 10);

/// The field that marks the stub of a document too large for an event.
const OVERSIZED: &str = "outboxRelayOversized";

/// Where a stream opens.
#[derive(Clone)]
enum Position {
    /// Just after a stored token.
    After(ResumeToken),
    /// At a cluster time (a catch-up snapshot's); from now without one.
    At(Option<bson::Timestamp>),
}

/// How tailing ended.
enum Tail {
    /// Shutdown, or the pipeline closed.
    Stopped,
    /// The stream failed; reopen after this position, still skipping what
    /// the catch-up pass read.
    Broken(Option<ResumeToken>, CaughtUp),
    /// The stream ended for good (invalidated, or its cursor closed).
    Ended,
}

/// What a catch-up pass read, for the stream to skip.
///
/// The stream opens at a cluster time no later than the pass's snapshot,
/// so its first events may be of messages the pass read already. Those
/// the pass queued are skipped until the stream passes the snapshot's own
/// time (no event after it can be in the snapshot), or, where the server
/// did not say that time, for the grace period. The set is carried over a
/// stream that breaks and resumes. (A server whose snapshot held commits
/// after the time it reported would see those sent again, and JetStream
/// drop the repeats.)
struct CaughtUp {
    ids: HashSet<ObjectId>,
    /// The snapshot's cluster time, as the server reported it.
    upto: Option<bson::Timestamp>,
    until: Instant,
}

impl CaughtUp {
    fn none() -> Self {
        CaughtUp {
            ids: HashSet::new(),
            upto: None,
            until: Instant::now(),
        }
    }

    fn new(ids: HashSet<ObjectId>, upto: Option<bson::Timestamp>, grace_period: Duration) -> Self {
        CaughtUp {
            ids,
            upto,
            until: Instant::now() + grace_period,
        }
    }

    /// Whether the pass already queued this document, committed at `at`
    /// (each is matched once).
    fn repeats(&mut self, document: &RawDocumentBuf, at: Option<bson::Timestamp>) -> bool {
        if self.ids.is_empty() {
            return false;
        }
        let past = match (self.upto, at) {
            (Some(upto), Some(at)) => at > upto,
            _ => Instant::now() > self.until,
        };
        if past {
            self.ids = HashSet::new();
            return false;
        }
        document
            .get_object_id(field::ID)
            .is_ok_and(|id| self.ids.remove(&id))
    }
}

/// When an event committed: its wall time (MongoDB 6.0 and later), else its
/// cluster time, which counts whole seconds.
fn commit_time(
    wall_time: Option<DateTime>,
    cluster_time: Option<bson::Timestamp>,
) -> Option<DateTime> {
    wall_time.or_else(|| cluster_time.map(|t| DateTime::from_millis(i64::from(t.time) * 1000)))
}

/// Whether a change stream may resume after this error, by the rule of the
/// change streams specification: any error that is not a server's reply,
/// CursorNotFound, or a reply labelled resumable.
fn is_resumable(error: &mongodb::error::Error) -> bool {
    match &*error.kind {
        ErrorKind::Command(command) => {
            command.code == CURSOR_NOT_FOUND || error.contains_label(RESUMABLE_LABEL)
        }
        ErrorKind::Write(_) | ErrorKind::InsertMany(_) | ErrorKind::BulkWrite(_) => false,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use bson::{rawdoc, Timestamp};

    use super::*;

    /// A document whose `_id` is a string of bytes that are not UTF-8, as a
    /// raw writer can make.
    fn not_utf8() -> RawDocumentBuf {
        crate::unreadable::tests::not_utf8(b"bad\xff\xfeid")
    }

    #[test]
    fn an_event_of_a_document_that_is_not_utf8_is_read_and_left_to_decoding() {
        let event = rawdoc! {
            "_id": { "_data": "8263" },
            "operationType": "insert",
            "clusterTime": Timestamp { time: 1_800_000_000, increment: 1 },
            "ns": { "db": "app", "coll": "outbox" },
            "documentKey": not_utf8(),
            "fullDocument": not_utf8(),
        };
        let read: Event = bson::from_slice(event.as_bytes()).expect("the event is read");
        assert_eq!(read.operation_type, OperationType::Insert);
        assert!(read.full_document.is_some());
        // The driver's own event type builds the document key, and fails.
        assert!(
            bson::from_slice::<mongodb::change_stream::event::ChangeStreamEvent<RawDocumentBuf>>(
                event.as_bytes()
            )
            .is_err()
        );
    }

    fn document(id: ObjectId) -> RawDocumentBuf {
        rawdoc! { "_id": id }
    }

    fn at(increment: u32) -> Option<Timestamp> {
        Some(Timestamp {
            time: 1_800_000_000,
            increment,
        })
    }

    #[test]
    fn queued_messages_are_skipped_until_the_stream_passes_the_snapshot() {
        let (queued, other, late) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
        let ids = [queued, late].into_iter().collect();
        let mut caught_up = CaughtUp::new(ids, at(10), Duration::ZERO);
        assert!(!caught_up.repeats(&document(other), at(9)), "not queued");
        assert!(
            caught_up.repeats(&document(queued), at(10)),
            "in the snapshot"
        );
        assert!(
            !caught_up.repeats(&document(queued), at(10)),
            "matched once"
        );
        assert!(
            !caught_up.repeats(&document(late), at(11)),
            "past the snapshot's time nothing repeats"
        );
        assert!(
            !caught_up.repeats(&document(late), at(10)),
            "the set is gone"
        );

        let ids = [queued].into_iter().collect();
        let mut untimed = CaughtUp::new(ids, None, Duration::from_secs(3600));
        assert!(
            untimed.repeats(&document(queued), at(99)),
            "without the snapshot's time, within the grace period"
        );
    }
}
