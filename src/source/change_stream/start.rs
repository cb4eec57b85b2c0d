//! How the change stream starts, and starts again after it broke or ended.
//!
//! The source either replays the stream from a stored position, or catches
//! up: it feeds a snapshot of the pending messages to the pipeline and
//! opens the stream at the snapshot's moment. [`ChangeStreamSource::plan`]
//! decides which, as one [`Plan`], by the rule stated on it;
//! [`ChangeStreamSource::carry_out`] carries it out. The rule stays short
//! apart from the reads, retries and races that carrying it out takes: the
//! reads that decide are made side by side, a snapshot read while deciding
//! is fed only if it fits, and a position the server no longer holds turns
//! a replay into a catch-up.

use std::pin::pin;
use std::time::Duration;

use bson::DateTime;
use futures::future::{self, Either};
use mongodb::change_stream::event::ResumeToken;
use mongodb::options::Hint;
use tokio_util::sync::CancellationToken;

use super::{said, CaughtUp, ChangeStreamSource, Events, Position, Window};
use crate::observe::Role;
use crate::retry::until_ok;
use crate::setup::SWEEP_INDEX;
use crate::source::catch_up;
#[cfg(doc)]
use crate::source::progress::StreamProgress;
use crate::work::{Feed, Work};

/// The longest the server may count pending messages before a resume.
const COUNT_LIMIT: Duration = Duration::from_secs(30);

/// How the stream starts, or starts again: decided by
/// [`ChangeStreamSource::plan`], carried out by
/// [`ChangeStreamSource::carry_out`].
enum Plan {
    /// Open the stream just after a stored position and replay what came
    /// since. No pass runs, unless the server no longer holds that
    /// position (its history is gone): then the source catches up.
    Replay {
        after: ResumeToken,
        /// What this term's catch-up pass read, still to be skipped by a
        /// stream that broke before it passed the pass's snapshot.
        carried: CaughtUp,
        /// Documents a read asks for (see [`catch_up::read_batch`]).
        batch: u32,
    },
    /// Run the catch-up pass over a snapshot of the pending messages, then
    /// open the stream at the snapshot's cluster time.
    CatchUp {
        /// The snapshot, if one was read while deciding and may be fed as
        /// read (see [`ChangeStreamSource::claim_for_pass`]); else the pass
        /// reads it.
        snapshot: Option<Box<catch_up::Snapshot>>,
        batch: u32,
    },
}

/// What a start that may catch up asks the server, side by side (see
/// [`ChangeStreamSource::ask`]).
struct Answers {
    /// More is pending than a replay should read.
    behind: bool,
    batch: u32,
    /// The pass's snapshot, if it may be fed: claimed for the pass
    /// already (see [`ChangeStreamSource::claim_for_pass`]).
    snapshot: Option<catch_up::Snapshot>,
}

/// How a replay's open went.
enum Replayed {
    /// Open, with the server's time just after it opened, where it said it.
    Open(Events, Option<bson::Timestamp>),
    /// The server cannot resume from the position: catch up instead.
    HistoryGone,
    Stopped,
}

/// How a catch-up pass ended (see [`ChangeStreamSource::catch_up`]).
enum PassEnd {
    /// Fed, with the stream open where the snapshot starts.
    Passed(Passed),
    /// The relay stopped first.
    Stopped,
}

/// What a catch-up pass leaves the stream.
struct Passed {
    events: Events,
    /// The snapshot's cluster time, as the server reported it.
    upto: Option<bson::Timestamp>,
    fed: catch_up::Fed,
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

impl ChangeStreamSource {
    /// Starts the stream as [`Self::plan`] decides, then carries the plan
    /// out. Returns the open stream, what its pass read (for a replay,
    /// what an earlier pass of the term read) and whether it replays from
    /// a stored position; `None` if the relay stopped.
    pub(super) async fn start(
        &self,
        token: Option<ResumeToken>,
        carried: Option<CaughtUp>,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Option<(Events, CaughtUp, Window)> {
        let plan = tokio::select! {
            _ = shutdown.cancelled() => return None,
            plan = self.plan(token, carried) => plan,
        };
        self.carry_out(plan, output, shutdown).await
    }

    /// Decides how the stream starts from `token`, the position it is to
    /// go on from, and `carried`, what this term's pass read if the stream
    /// broke after one. The rule:
    ///
    /// - no position (a first start without one, or the collection was
    ///   dropped): catch up;
    /// - a stream that broke: replay from where it broke, its gap is short;
    /// - a first start from a stored position: replay, unless more due
    ///   messages are pending than `--max-replay` (see
    ///   [`Self::too_far_behind`]): then catch up. At its most
    ///   (`u32::MAX`) nothing is counted, and the stream always replays.
    ///
    /// A start that may catch up reads the pass's snapshot at once, beside
    /// the reads that decide, unless the sweep has read in this term: it
    /// may have delivered messages the snapshot would still show pending
    /// (see [`StreamProgress::claim_snapshot`]).
    async fn plan(&self, token: Option<ResumeToken>, carried: Option<CaughtUp>) -> Plan {
        let Some(after) = token else {
            tracing::info!("no resume token: catching up from the collection");
            if self.progress.sweep_has_read() {
                let batch = self.batch().await;
                return Plan::CatchUp {
                    snapshot: None,
                    batch,
                };
            }
            let Answers {
                batch, snapshot, ..
            } = self.ask(false).await;
            let snapshot = snapshot.map(Box::new);
            return Plan::CatchUp { snapshot, batch };
        };
        if carried.is_some() || self.max_replay == u32::MAX {
            let batch = self.batch().await;
            let carried = carried.unwrap_or_else(CaughtUp::none);
            return Plan::Replay {
                after,
                carried,
                batch,
            };
        }
        let answers = self.ask(true).await;
        if answers.behind {
            Plan::CatchUp {
                snapshot: answers.snapshot.map(Box::new),
                batch: answers.batch,
            }
        } else {
            Plan::Replay {
                after,
                carried: CaughtUp::none(),
                batch: answers.batch,
            }
        }
    }

    /// Carries out a start's plan. A replay whose position the server no
    /// longer holds catches up instead; a catch-up pass that fails is run
    /// again on a new snapshot. Returns as [`Self::start`] does.
    async fn carry_out(
        &self,
        plan: Plan,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> Option<(Events, CaughtUp, Window)> {
        let (snapshot, batch) = match plan {
            Plan::Replay {
                after,
                carried,
                batch,
            } => match self.replay(after, batch, shutdown).await {
                Replayed::Open(events, until) => {
                    return Some((events, carried, Window::Replaying { until }))
                }
                Replayed::HistoryGone => (None, batch),
                Replayed::Stopped => return None,
            },
            Plan::CatchUp { snapshot, batch } => (snapshot.map(|snapshot| *snapshot), batch),
        };
        let mut snapshot = snapshot;
        // A stop between tries ends the pass as a stop in it does.
        let end = until_ok("MongoDB catch-up pass", shutdown, || {
            self.catch_up(snapshot.take(), batch, output, shutdown)
        })
        .await
        .unwrap_or(PassEnd::Stopped);
        let PassEnd::Passed(Passed { events, upto, fed }) = end else {
            return None;
        };
        tracing::info!(found = fed.count, "{}", said::PASS_QUEUED);
        // Once the pass's messages are done, the stream's starting position
        // is a safe checkpoint: everything before it was in the pass.
        if let Some(start) = events.resume_token() {
            output
                .send(Work::marker(start, Some(DateTime::now())))
                .await
                .ok()?;
        }
        Some((
            events,
            CaughtUp::new(fed.recent, upto, self.grace_period),
            Window::Live,
        ))
    }

    /// Documents a read asks for: sized from the outbox's documents where
    /// the server says their size, else the most.
    async fn batch(&self) -> u32 {
        catch_up::read_batch(&self.outbox)
            .await
            .unwrap_or(catch_up::READ_BATCH)
    }

    /// What a start that may catch up needs to know, asked side by side:
    /// whether more is pending than a replay should read (if `counting`,
    /// else the pass is certain), the read batch, and the pass's snapshot.
    ///
    /// Asked side by side, a server that reads slowly makes the start wait
    /// for the slowest read, not for all in turn. The snapshot is read at
    /// the most documents a batch, as usual-sized documents are read;
    /// where the size (or, if the server cannot say it, the snapshot's
    /// first documents) says they are larger, it is read again at their
    /// batch. A snapshot the start does not use is dropped, its cursor
    /// killed: one a replay does not need (a replay does not wait for it,
    /// if the count and the size come first), and one
    /// [`Self::claim_for_pass`] does not keep.
    async fn ask(&self, counting: bool) -> Answers {
        let counted = async { counting && self.too_far_behind().await };
        let sizing = catch_up::read_batch(&self.outbox);
        let (outbox, partition) = (self.outbox.clone(), self.partition);
        let mut reading = Box::pin(async move {
            catch_up::Snapshot::read(&outbox, partition, catch_up::READ_BATCH).await
        });
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
            (None, Some(batch)) if counting && !behind => {
                tokio::spawn(async move { drop(tokio::time::timeout(COUNT_LIMIT, reading).await) });
                return Answers {
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
            Ok(snapshot) => self.claim_for_pass(snapshot, behind || !counting, batch),
            Err(error) => {
                tracing::debug!(%error, "reading the catch-up pass's snapshot at the start failed");
                None
            }
        };
        Answers {
            behind,
            batch,
            snapshot,
        }
    }

    /// Keeps a snapshot read at the start for the pass, or drops it (the
    /// pass reads again). First decided, changing nothing: whether the
    /// pass is `needed` and may feed it as read ([`fit`]). Then, for one
    /// that fits, the one step that changes anything: the pass claims it
    /// from the sweep ([`StreamProgress::claim_snapshot`]), which refuses
    /// if the sweep has read in this term.
    fn claim_for_pass(
        &self,
        snapshot: catch_up::Snapshot,
        needed: bool,
        batch: u32,
    ) -> Option<catch_up::Snapshot> {
        let timed = snapshot.start().is_some();
        let again = match fit(needed, timed, snapshot.batch(), batch) {
            Fit::Unneeded => return None,
            Fit::Untimed => "the server did not say when it was taken",
            Fit::BatchTooLarge => "the outbox's documents are large, and read in smaller batches",
            Fit::Fits => {
                if self.progress.claim_snapshot() {
                    return Some(snapshot);
                }
                "the pass could not claim it (the sweep may have read past it)"
            }
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
    /// keys under another name): a planner left to choose may read every
    /// pending message for it. Without that index the count
    /// fails, and the stream replays.
    async fn too_far_behind(&self) -> bool {
        let limit = u64::from(self.max_replay).saturating_add(1);
        let counted = self
            .outbox
            .count_documents(self.partition.scope(catch_up::due_filter(DateTime::now())))
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

    /// Opens the stream just after `after`, retrying passing errors.
    async fn replay(
        &self,
        after: ResumeToken,
        batch: u32,
        shutdown: &CancellationToken,
    ) -> Replayed {
        match self
            .open_retrying(Position::After(after), batch, shutdown)
            .await
        {
            None => Replayed::Stopped,
            Some(Ok(events)) => {
                // Until the stream says how far it read, the sweep leaves
                // the never-tried messages alone. Said only once it is
                // open: a replay that turns into a catch-up must leave the
                // pass its own window (see `progress`).
                self.progress.resumed();
                self.metrics.stream_resumed();
                self.metrics.set_role_unless_stopping(Role::Tailing);
                let opened = tokio::select! {
                    _ = shutdown.cancelled() => return Replayed::Stopped,
                    opened = self.server_time() => opened,
                };
                Replayed::Open(events, opened)
            }
            Some(Err(error)) => {
                self.metrics.history_lost();
                tracing::error!(
                    error = %error,
                    "{} (its history may be gone from the oplog); catching up from the \
                     collection, so no committed message is lost",
                    said::CANNOT_RESUME
                );
                Replayed::HistoryGone
            }
        }
    }

    /// The server's cluster time now (a `ping`'s `operationTime`), where
    /// it says it in time: what a replay committed up to then may have
    /// been delivered before.
    async fn server_time(&self) -> Option<bson::Timestamp> {
        let client = self.outbox.client();
        let mut session = client.start_session().await.ok()?;
        let database = client.database(&self.outbox.namespace().db);
        let ping = database
            .run_command(bson::doc! { "ping": 1 })
            .session(&mut session);
        tokio::time::timeout(super::replayed::READ_LIMIT, ping)
            .await
            .ok()?
            .ok()?;
        session.operation_time()
    }

    /// The catch-up pass: a snapshot of what is pending (`read` already,
    /// or read now), fed to the pipeline, and the stream opened at the
    /// snapshot's time, unless the relay stopped first.
    async fn catch_up(
        &self,
        read: Option<catch_up::Snapshot>,
        batch: u32,
        output: &Feed,
        shutdown: &CancellationToken,
    ) -> crate::error::Result<PassEnd> {
        self.progress.pass_started();
        let snapshot = match read {
            Some(snapshot) => snapshot,
            None => tokio::select! {
                _ = shutdown.cancelled() => return Ok(PassEnd::Stopped),
                snapshot = catch_up::Snapshot::read(&self.outbox, self.partition, batch) => snapshot?,
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
        // snapshot, not by when it opens. A server slow to find that time
        // in its oplog holds up no delivery, and an open that fails for a
        // while is retried beside the feed rather than starting the pass
        // over. A stop ends the feed and is not kept waiting for the open;
        // once the feed is done, the open is awaited, so that the pass
        // hands its stream's start to the checkpoint.
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
        Ok(match fed.zip(events) {
            Some((fed, events)) => PassEnd::Passed(Passed { events, upto, fed }),
            None => PassEnd::Stopped,
        })
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
    ) -> crate::error::Result<Option<Events>> {
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
        let events = opened.map_err(|e| {
            crate::error::Error::mongo("opening the change stream failed", e)
                .needing("changeStream and find", self.outbox.namespace())
        })?;
        self.metrics.set_role_unless_stopping(Role::Tailing);
        Ok(Some(events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
