//! The change-stream source: the fast path from commit to publish.
//!
//! It tails inserts of pending messages on the outbox collection, with the
//! document taken from the insert event itself, so a message reaches the
//! publisher with no further database round trip. It resumes from the
//! stored token; when there is none, or the server can no longer resume
//! from it (the history is gone, or the token is not one it accepts), or
//! more is pending than a replay should read (`--max-replay`), it
//! says so and runs the catch-up pass over a snapshot of the collection,
//! then tails from the snapshot's moment, so nothing committed in the gap
//! is lost and no key's messages are read out of order. On idle streams it
//! still passes on the server's newest position now and then, so the stored
//! token does not fall behind the oplog's history.
//!
//! A stream can also end: dropping or renaming the collection or its
//! database invalidates it, and the server closes its cursor. The source
//! notices at once, says so, waits (with backoff, idle) until the collection
//! exists again, prepares it again (its indexes went with it), and reopens
//! from that moment with a catch-up pass, so what was written since is
//! delivered. Readiness is down meanwhile.

use std::collections::HashSet;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document, RawDocumentBuf};
use futures::future::{self, BoxFuture, Either};
use mongodb::change_stream::event::{OperationType, ResumeToken};
use mongodb::change_stream::ChangeStream;
use mongodb::error::ErrorKind;
use mongodb::options::Hint;
use mongodb::Collection;
use serde::Deserialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::catch_up;
use super::progress::StreamProgress;
use crate::contract::{field, status, DecodeRules};
use crate::observe::{Metrics, Role};
use crate::retry::{pause, reconnect_backoff, until_ok, Outage};
use crate::setup::SWEEP_INDEX;
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
/// The longest the server may count pending messages before a resume.
const COUNT_LIMIT: Duration = Duration::from_secs(30);

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

/// How a start goes on (see [`ChangeStreamSource::starting`]).
struct Starting {
    /// More is pending than a replay should read: run the catch-up pass.
    behind: bool,
    /// Documents a read asks for (see [`catch_up::read_batch`]).
    batch: u32,
    /// A snapshot read for the pass, if the pass is to run (`behind`, or
    /// no stored position) and the read can be fed.
    snapshot: Option<catch_up::Snapshot>,
}

/// Whether a snapshot read at a start's outset may be fed to the pass
/// (the sweep's claim aside).
#[derive(Debug, PartialEq, Eq)]
enum Fit {
    /// No pass runs: the stream replays.
    Unneeded,
    /// The server did not say when it was taken, so the stream opens from
    /// whenever it is opened: everything committed between the read and
    /// the open would be in neither. The pass reads it again just before.
    Untimed,
    /// It was read in batches of more documents than their size allows.
    BatchTooLarge,
    Fits,
}

/// Whether a snapshot read `read_at` documents a batch, `timed` (the
/// server said when it was taken) or not, fits a start whose reads the
/// outbox's documents size at `sized`, where the pass is `needed` or not.
fn fit(needed: bool, timed: bool, read_at: u32, sized: u32) -> Fit {
    if !needed {
        Fit::Unneeded
    } else if !timed {
        Fit::Untimed
    } else if read_at > sized {
        Fit::BatchTooLarge
    } else {
        Fit::Fits
    }
}

/// Tails the outbox collection's inserts.
pub(crate) struct ChangeStreamSource {
    pub outbox: Collection<Document>,
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
pub(crate) type Prepare = Arc<dyn Fn() -> BoxFuture<'static, crate::Result<()>> + Send + Sync>;

impl ChangeStreamSource {
    /// Feeds the pipeline from the stream, starting after `token` (or from
    /// now), until shutdown. A broken stream is reopened where it stopped.
    pub async fn run(self, token: Option<ResumeToken>, output: Feed, shutdown: CancellationToken) {
        let mut position = token;
        let mut backoff = reconnect_backoff();
        // What a catch-up pass read, still to be skipped by a stream that
        // broke before it passed the pass's snapshot.
        let mut carried = None;
        while let Some((events, caught_up)) = self
            .resume(position.clone(), carried.take(), &output, &shutdown)
            .await
        {
            match self.tail(events, caught_up, &output, &shutdown).await {
                Tail::Stopped => return,
                // A stream that breaks again where it broke before is
                // reopened with backoff, not in a tight loop.
                Tail::Broken(last, caught_up) if last == position => {
                    carried = Some(caught_up);
                    if !pause(&mut backoff, &shutdown).await {
                        return;
                    }
                }
                Tail::Broken(last, caught_up) => {
                    carried = Some(caught_up);
                    backoff = reconnect_backoff();
                    position = last;
                }
                Tail::Ended => {
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
        let filter = doc! { "name": &namespace.coll };
        let database = self.outbox.client().database(&namespace.db);
        let mut backoff = reconnect_backoff();
        loop {
            match database
                .list_collection_names()
                .filter(filter.clone())
                .await
            {
                Ok(names) if !names.is_empty() => break,
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "listing collections failed"),
            }
            if !pause(&mut backoff, shutdown).await {
                return false;
            }
        }
        if let Err(error) = (self.prepare)().await {
            tracing::warn!(%error, "could not prepare the recreated outbox collection");
        }
        tracing::info!(%namespace, "the outbox collection exists again: reopening the change stream");
        true
    }

    /// Opens the stream after `token` or, where the stream cannot replay
    /// what came before (no token, or its history is gone) or should not
    /// (more is pending than `max_replay`), runs the catch-up pass and
    /// opens the stream where the pass's snapshot ends.
    /// Returns the stream and what the pass read (or, resumed, `carried`:
    /// what an earlier pass read); `None` if the relay stopped.
    async fn resume(
        &self,
        token: Option<ResumeToken>,
        carried: Option<CaughtUp>,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Option<(Events, CaughtUp)> {
        // A stream reopened after a break has only its gap to replay.
        let counting = token.is_some() && carried.is_none() && self.max_replay != u32::MAX;
        // With no position to resume from, the pass is certain, and its
        // snapshot is read at once, unless the sweep has read in this term
        // (see below).
        let passing = token.is_none() && !self.progress.sweep_has_read();
        // A start that may read a snapshot at once (a first start, or a
        // resume that counts) opens no window here: the snapshot is read in
        // the window the term's start gives the source, the sweep kept out
        // meanwhile, since what it delivered would still be pending in the
        // snapshot. If the sweep read at all in this term (the window lapsed
        // first), the snapshot is dropped, and the pass's own start opens
        // a window for it to read another.
        if !counting && token.is_some() && carried.is_none() {
            // Until the stream says how far it read, the sweep leaves the
            // never-tried messages alone.
            self.progress.resumed();
        }
        let Starting {
            behind,
            batch,
            snapshot,
        } = tokio::select! {
            _ = shutdown.cancelled() => return None,
            starting = self.starting(counting, passing) => starting,
        };
        if !behind {
            if let Some(events) = self.open_resuming(token, batch, shutdown).await? {
                self.progress.resumed();
                self.metrics.set_role_unless_stopping(Role::Tailing);
                return Some((events, carried.unwrap_or_else(CaughtUp::none)));
            }
        }
        let mut snapshot = snapshot;
        let (events, upto, fed) = until_ok("MongoDB catch-up pass", shutdown, || {
            self.catch_up(snapshot.take(), batch, output, shutdown)
        })
        .await??;
        tracing::info!(found = fed.count, "{}", said::PASS_QUEUED);
        // Once the pass's messages are done, the stream's starting position
        // is a safe checkpoint: everything before it was in the pass.
        if let Some(start) = events.resume_token() {
            output
                .send(Work::marker(start, Some(DateTime::now())))
                .await
                .ok()?;
        }
        Some((events, CaughtUp::new(fed.recent, upto, self.grace_period)))
    }

    /// What a start needs to know: the read batch, sized from the outbox's
    /// documents, and, for a resume (`counting`: with a stored token,
    /// under a `max_replay` that asks), whether more is pending than a
    /// replay should read; with a snapshot for the catch-up pass if one
    /// may be called for (`counting`, or `passing`: no stored token, and
    /// the sweep has not read in the term).
    ///
    /// The size, the count and the snapshot are asked side by side, so that
    /// a server that reads slowly (SecantusDB walks every pending message
    /// for each) makes a start wait for the slowest, not for all in turn;
    /// on MongoDB the size is the collection's metadata and the snapshot's
    /// first batch the first entries of an index range. The snapshot reads
    /// the most documents a batch, as usual-sized documents are read; where
    /// the size (or, if the server cannot say it, the snapshot's first
    /// documents) says they are larger, it is read again at their batch.
    /// A snapshot the start does not use is dropped, its cursor killed: one
    /// a replay does not need (a replay does not wait for it, if the count
    /// and the size come first), one the server did not say the time of,
    /// one of too large a batch, and one the sweep may have overtaken (the
    /// start outlasted the stall window and the sweep, going by the clock,
    /// has read in this term, so it may have delivered messages the
    /// snapshot still shows pending; see [`StreamProgress::claim_snapshot`]).
    async fn starting(&self, counting: bool, passing: bool) -> Starting {
        let sizing = catch_up::read_batch(&self.outbox);
        if !counting && !passing {
            return Starting {
                behind: false,
                batch: sizing.await.unwrap_or(catch_up::READ_BATCH),
                snapshot: None,
            };
        }
        let counted = async { counting && self.too_far_behind().await };
        let outbox = self.outbox.clone();
        let mut reading =
            Box::pin(async move { catch_up::Snapshot::read(&outbox, catch_up::READ_BATCH).await });
        let (behind, sized, read) =
            match future::select(pin!(future::join(counted, sizing)), reading.as_mut()).await {
                Either::Left(((behind, sized), _)) => (behind, sized, None),
                Either::Right((read, asking)) => {
                    let (behind, sized) = asking.await;
                    (behind, sized, Some(read))
                }
            };
        // A replay of a known size has no use for the snapshot: the stream
        // opens without waiting for it. The read is left to end on its own
        // (for at most another `COUNT_LIMIT`) and then dropped, so that the
        // cursor it opened is killed rather than left to the server's idle
        // timeout.
        let snapshot = match (read, sized) {
            (Some(read), _) => read,
            (None, Some(batch)) if !behind && !passing => {
                tokio::spawn(async move { drop(tokio::time::timeout(COUNT_LIMIT, reading).await) });
                return Starting {
                    behind,
                    batch,
                    snapshot: None,
                };
            }
            (None, _) => reading.await,
        };
        // A server that cannot say the size leaves it to the documents read.
        let batch = sized
            .or_else(|| snapshot.as_ref().ok()?.judged_batch())
            .unwrap_or(catch_up::READ_BATCH);
        let snapshot = match snapshot {
            Ok(snapshot) => self.usable(snapshot, behind || passing, batch),
            Err(error) => {
                tracing::debug!(%error, "reading the catch-up pass's snapshot at the start failed");
                None
            }
        };
        Starting {
            behind,
            batch,
            snapshot,
        }
    }

    /// A snapshot read at the start, if the pass is `needed` and may feed
    /// it as read (see [`Fit`]), and the sweep has not overtaken it.
    fn usable(
        &self,
        snapshot: catch_up::Snapshot,
        needed: bool,
        batch: u32,
    ) -> Option<catch_up::Snapshot> {
        let timed = snapshot.start().is_some();
        let again = match fit(needed, timed, snapshot.batch(), batch) {
            Fit::Unneeded => return None,
            Fit::Fits if self.progress.claim_snapshot() => return Some(snapshot),
            Fit::Fits => "the pass could not claim it (the sweep may have read past it)",
            Fit::Untimed => "the server did not say when it was taken",
            Fit::BatchTooLarge => "the outbox's documents are large, and read in smaller batches",
        };
        tracing::debug!(
            batch,
            "the catch-up pass reads its snapshot again, just before it opens the stream: {again}"
        );
        None
    }

    /// Whether more due messages are pending than a resumed stream should
    /// replay. A replay reads every write to the oplog since the stored
    /// position, the outbox's own marks among them, one event at a time,
    /// where the catch-up pass reads the pending messages alone, by index:
    /// a large backlog is delivered faster and at less cost to the server
    /// by the pass, in `_id` order (see README, per-key order). Counting
    /// stops past the limit, so the question costs at most that many index
    /// entries. The count names the sweep index (set-up refuses one of its
    /// keys under another name): a planner left to choose (SecantusDB's)
    /// may read every pending message for it. Without that index the count
    /// fails, and the stream replays.
    async fn too_far_behind(&self) -> bool {
        let limit = u64::from(self.max_replay).saturating_add(1);
        let counted = self
            .outbox
            .count_documents(catch_up::due_filter(DateTime::now()))
            .hint(Hint::Name(SWEEP_INDEX.to_owned()))
            .limit(limit)
            .max_time(COUNT_LIMIT)
            .await;
        match counted {
            Ok(pending) if pending >= limit => {
                tracing::info!(
                    max_replay = self.max_replay,
                    "more messages are pending than the stream replays (--max-replay): \
                     delivering them with a catch-up pass from the collection instead"
                );
                true
            }
            Ok(_) => false,
            Err(error) => {
                tracing::warn!(
                    %error,
                    "{} by the sweep index ({SWEEP_INDEX}; the relay makes it at start); \
                     replaying the change stream from the stored position",
                    said::NOT_COUNTED
                );
                false
            }
        }
    }

    /// The catch-up pass: a snapshot of what is pending (`read` already,
    /// or read now), fed to the pipeline, and the stream opened at the
    /// snapshot's time. `None` if the relay stopped first.
    async fn catch_up(
        &self,
        read: Option<catch_up::Snapshot>,
        batch: u32,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> crate::Result<Option<(Events, Option<bson::Timestamp>, catch_up::Fed)>> {
        self.progress.pass_started();
        let snapshot = match read {
            Some(snapshot) => snapshot,
            None => tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                snapshot = catch_up::Snapshot::read(&self.outbox, batch) => snapshot?,
            },
        };
        let (start, upto, taken) = (snapshot.start(), snapshot.cluster_time(), snapshot.taken());
        if start.is_none() {
            tracing::warn!(
                "the server did not say when the catch-up pass's snapshot was taken; opening \
                 the change stream from now"
            );
        }
        // The stream is opened while the pass is fed: its events are read
        // only once the pass is done, and where it starts is fixed by the
        // snapshot, not by when it opens. A server that must search its
        // oplog for that time (SecantusDB walks all of it) holds up no
        // delivery, and an open that fails for a while is retried beside
        // the feed rather than starting the pass over. A stop ends the
        // feed and is not kept waiting for the open; once the feed is
        // done, the open is awaited, so that the pass hands its stream's
        // start to the checkpoint.
        let opening = self.open_for_pass(start, snapshot.batch(), shutdown);
        let feeding = snapshot.feed(&self.rules, output, &self.progress, shutdown);
        let (fed, events) = match future::select(pin!(feeding), pin!(opening)).await {
            Either::Left((Ok(None), _)) => (None, None),
            Either::Left((fed, opening)) => (fed?, opening.await?),
            Either::Right((events, feeding)) => {
                let events = events?;
                (feeding.await?, events)
            }
        };
        self.progress.pass_ended(taken);
        Ok(fed.zip(events).map(|(fed, events)| (events, upto, fed)))
    }

    /// Opens the stream where a catch-up pass's snapshot starts, retrying
    /// passing errors. From now (the server gave no time) it is tried once:
    /// a retry would open later still, past what the snapshot holds, and
    /// the pass is run again instead. `None` if the relay stopped first.
    async fn open_for_pass(
        &self,
        start: Option<bson::Timestamp>,
        batch: u32,
        shutdown: &CancellationToken,
    ) -> crate::Result<Option<Events>> {
        let opened = match start {
            Some(_) => {
                self.open_retrying(Position::At(start), batch, shutdown)
                    .await
            }
            None => Some(self.open(Position::At(None), batch).await),
        };
        let Some(opened) = opened else {
            return Ok(None);
        };
        let events =
            opened.map_err(|e| crate::Error::mongo("opening the change stream failed", e))?;
        self.metrics.set_role_unless_stopping(Role::Tailing);
        Ok(Some(events))
    }

    /// Opens the stream at `position`, asking for `batch` events at a time
    /// (see [`catch_up::read_batch`]): a replay's events carry whole
    /// messages, as the pass's documents are. The stream keeps its batch
    /// for as long as it stays open, after the backlog that sized it is
    /// gone; the least batch, sixteen events a round trip, still outpaces
    /// what a live stream brings.
    async fn open(&self, position: Position, batch: u32) -> mongodb::error::Result<Events> {
        let watch = self
            .outbox
            .watch()
            .pipeline(new_messages())
            .batch_size(batch)
            .max_await_time(self.max_await_time);
        let events = match position {
            Position::After(token) => watch.start_after(token).await,
            Position::At(Some(time)) => watch.start_at_operation_time(time).await,
            Position::At(None) => watch.await,
        };
        events.map(ChangeStream::with_type)
    }

    /// Opens from `token`, retrying passing errors. Returns the stream, or
    /// `None` inside if a catch-up pass is needed (no token, or its history
    /// is gone); `None` if the relay stopped first.
    async fn open_resuming(
        &self,
        token: Option<ResumeToken>,
        batch: u32,
        shutdown: &CancellationToken,
    ) -> Option<Option<Events>> {
        let Some(token) = token else {
            tracing::info!("no resume token: catching up from the collection");
            return Some(None);
        };
        match self
            .open_retrying(Position::After(token), batch, shutdown)
            .await?
        {
            Ok(events) => {
                self.metrics.stream_resumed();
                Some(Some(events))
            }
            Err(error) => {
                self.metrics.history_lost();
                tracing::error!(
                    error = %error,
                    "{} (its history may be gone from the oplog); catching up from the \
                     collection, so no committed message is lost",
                    said::CANNOT_RESUME
                );
                Some(None)
            }
        }
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
        let mut outage = Outage::new("MongoDB change stream");
        let mut backoff = reconnect_backoff();
        loop {
            match self.open(position.clone(), batch).await {
                Ok(events) => {
                    outage.recovered();
                    return Some(Ok(events));
                }
                Err(error) if is_resumable(&error) => {
                    outage.failed(&error);
                    if !pause(&mut backoff, shutdown).await {
                        return None;
                    }
                }
                Err(error) => return Some(Err(error)),
            }
        }
    }

    /// Passes each insert on, with stream positions in between, until
    /// shutdown or until the stream breaks.
    ///
    /// Messages the catch-up pass already queued are passed on as bare
    /// positions (see [`CaughtUp`]).
    async fn tail(
        &self,
        mut events: Events,
        mut caught_up: CaughtUp,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Tail {
        let mut last = events.resume_token();
        let mut last_sent = Instant::now();
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => {
                    // The newest position the stream reported: every event
                    // before it has been passed on, so it may be recorded.
                    if let Some(token) = events.resume_token().filter(|t| Some(t) != last.as_ref()) {
                        let _ = output.send(Work::marker(token, Some(DateTime::now()))).await;
                    }
                    return Tail::Stopped;
                }
                next = events.next_if_any() => next,
            };
            let work = match next {
                Ok(Some(event)) if event.operation_type == OperationType::Invalidate => {
                    return Tail::Ended;
                }
                Ok(None) if !events.is_alive() => return Tail::Ended,
                Ok(Some(event)) => {
                    let token = event.id;
                    last = Some(token.clone());
                    let at = commit_time(event.wall_time, event.cluster_time);
                    self.progress.read(at);
                    self.metrics.stream_event(at);
                    match event.full_document {
                        // Left to the sweep, which reads the document itself.
                        Some(document) if document.get(OVERSIZED).ok().flatten().is_some() => {
                            Work::marker(token, at)
                        }
                        Some(document) if !caught_up.repeats(&document, event.cluster_time) => {
                            Work::from_stream(self.rules.decode_raw(&document), token, at)
                        }
                        _ => Work::marker(token, at),
                    }
                }
                Ok(None) => {
                    // Nothing more committed: read up to now.
                    self.progress.read(Some(DateTime::now()));
                    self.metrics.stream_idle();
                    match events.resume_token() {
                        Some(token)
                            if Some(&token) != last.as_ref()
                                && last_sent.elapsed() >= self.idle_checkpoint_interval =>
                        {
                            last = Some(token.clone());
                            Work::marker(token, Some(DateTime::now()))
                        }
                        _ => continue,
                    }
                }
                Err(error) => {
                    tracing::warn!(error = %error, "change stream failed; reopening it");
                    return Tail::Broken(last, caught_up);
                }
            };
            if output.send(work).await.is_err() {
                return Tail::Stopped;
            }
            last_sent = Instant::now();
        }
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
pub(crate) fn new_messages() -> [Document; 2] {
    let full = "$fullDocument";
    [
        doc! { "$match": { "$or": [
            { "operationType": "insert", "fullDocument.status": status::PENDING },
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
    fn a_snapshot_read_at_the_outset_is_fed_only_to_a_pass_and_at_its_size() {
        let most = catch_up::READ_BATCH;
        assert_eq!(fit(true, true, most, most), Fit::Fits, "usual documents");
        assert_eq!(
            fit(true, true, most, 41),
            Fit::BatchTooLarge,
            "100 KB documents"
        );
        assert_eq!(fit(false, true, most, most), Fit::Unneeded, "a replay");
        assert_eq!(fit(false, true, most, 41), Fit::Unneeded);
        assert_eq!(
            fit(true, true, 41, most),
            Fit::Fits,
            "smaller batches are no harm"
        );
        assert_eq!(
            fit(true, false, most, most),
            Fit::Untimed,
            "a snapshot with no time is read again just before the stream opens"
        );
        assert_eq!(fit(false, false, most, most), Fit::Unneeded);
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
