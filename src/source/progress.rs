//! How far the change-stream source has read, for the sweep to keep out of
//! its way.
//!
//! The sweep is the fallback: it takes a never-tried message only once the
//! stream has had the grace period to deliver it. Measured on the wall
//! clock alone, that grace runs out in the middle of every drain: a backlog
//! older than the grace period would be claimed, read and published by the
//! sweep while the catch-up pass or the stream's replay is delivering the
//! same messages, so the server would do the drain's work twice. So the
//! grace runs from what the stream has read, not from now:
//!
//! - when a term starts, until the source says how it starts, and while a
//!   catch-up pass feeds the pipeline, the pass may have every due message
//!   before it, and the sweep reads none;
//! - after it, the sweep's never-tried range ends a grace period before
//!   the commit time the stream has read up to, so a stream replaying an
//!   hour of backlog is left to replay it.
//!
//! Only a source that moves counts: one that has passed nothing on for the
//! stall window (broken and reopening, or gone) is no reason to wait, and
//! the sweep falls back to the wall clock, so nothing committed waits on a
//! stream that does not deliver. A source that starts (a pass, a resumed
//! stream) has one stall window to pass its first message on; starting
//! again and again without reading earns it no more.
//!
//! A start reads the pass's snapshot at once, beside the reads that say
//! whether it needs one and how to read it, and those may outlast the
//! window. The snapshot is still fed if the sweep has read nothing in the
//! term: the sweep's scope and the pass's claim on its snapshot are decided
//! one at a time (see [`StreamProgress::claim_snapshot`]), so a sweep that
//! read first makes the pass read its snapshot again (in a window its own
//! start opens), and a claim first keeps the sweep out for a window, which
//! the feed renews as it moves.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bson::DateTime;

use crate::time::earlier;

/// What the sweep may read now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SweepScope {
    /// A catch-up pass is delivering every due message: read nothing.
    Nothing,
    /// Never-tried messages created before this time, and due retries.
    Before(DateTime),
    /// Due retries only: the stream has not yet said how far it read.
    RetriesOnly,
}

/// The stream source's progress, shared with the sweep of the same relay.
#[derive(Debug, Clone)]
pub(crate) struct StreamProgress(Arc<Progress>);

#[derive(Debug)]
struct Progress {
    /// How long a source may pass nothing on and still count as moving.
    stall: Duration,
    /// Whether there is a source at all (not in poll mode).
    stream: bool,
    /// One lock, never held across an await: the sweep's scope and the
    /// source's claim on a snapshot are decided against the same state.
    state: Mutex<State>,
}

/// What the source is doing, as the sweep must know it.
///
/// | event | phase | read up to | liveness |
/// |---|---|---|---|
/// | a term starts (`new`) | `Starting` | unknown | started: the term's start, a guess |
/// | `pass_started` | `Passing` | unknown | started, unless it already had |
/// | `pass_ended(snapshot)` | `Streaming` | the snapshot | moved |
/// | `resumed` | `Streaming` | kept | started, unless it already had |
/// | `read(up_to)` | kept | the later of the two | moved |
/// | `claim_snapshot`, granted | kept | kept | moved |
/// | `waited` | kept | kept | moved, its start kept |
///
/// A source that starts counts as started from the first start since it
/// last moved, so starting again and again without reading earns no more
/// time; the term's guessed start gives way to the source's own first.
/// The sweep reads nothing while the phase is `Starting` or `Passing`
/// (the pass covers, or may cover, every due message) unless the source
/// is stalled; `swept` records that it was given anything else to read.
#[derive(Debug)]
struct State {
    phase: Phase,
    /// Every message committed before this (milliseconds since the Unix
    /// epoch) has been passed on; `None` while that is not known.
    read_up_to: Option<i64>,
    /// When the source last passed something on.
    moved: Option<Instant>,
    /// When it started without passing anything on since.
    started: Option<Instant>,
    /// The sweep was given something to read in this term.
    swept: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The term began; the source has not said whether it runs a pass.
    Starting,
    /// A catch-up pass is feeding the pipeline.
    Passing,
    /// The stream is open and the pass, if any, is over.
    Streaming,
}

impl State {
    fn moved(&mut self) {
        self.moved = Some(Instant::now());
        self.started = None;
    }

    fn started(&mut self, phase: Phase) {
        if self.phase == Phase::Starting || self.started.is_none() {
            self.started = Some(Instant::now());
        }
        self.phase = phase;
    }

    /// Whether the source read, or started, within `stall`.
    fn live(&self, stall: Duration) -> bool {
        let within = |at: Option<Instant>| at.is_some_and(|at| at.elapsed() <= stall);
        within(self.moved) || within(self.started)
    }

    fn passing(&self) -> bool {
        matches!(self.phase, Phase::Starting | Phase::Passing)
    }
}

impl StreamProgress {
    /// The progress of a source about to start, which counts as moving
    /// for `stall` after each step. Until it says how it starts, the sweep
    /// reads nothing, for one window: a sweep that won the race to the
    /// first pass would otherwise take a batch the catch-up pass reads
    /// again. The source's own first start (a pass, a resumed stream)
    /// opens a window of its own, so a slow start-up (the reads that
    /// decide how it starts) does not use up the pass's.
    pub fn new(stall: Duration) -> Self {
        Self::with(Phase::Starting, Some(Instant::now()), stall, true)
    }

    /// Progress for a relay with no stream: the sweep goes by the clock.
    pub fn without_stream() -> Self {
        Self::with(Phase::Streaming, None, Duration::ZERO, false)
    }

    fn with(phase: Phase, started: Option<Instant>, stall: Duration, stream: bool) -> Self {
        let state = State {
            phase,
            read_up_to: None,
            moved: None,
            started,
            swept: false,
        };
        StreamProgress(Arc::new(Progress {
            stall,
            stream,
            state: Mutex::new(state),
        }))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every change leaves the state whole: a panic elsewhere while the
        // lock was held tears nothing.
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A catch-up pass starts: it covers every due message, and nothing
    /// is known read until it ends.
    pub fn pass_started(&self) {
        let mut state = self.state();
        state.read_up_to = None;
        state.started(Phase::Passing);
    }

    /// A catch-up pass queued everything committed before `snapshot`.
    pub fn pass_ended(&self, snapshot: DateTime) {
        let mut state = self.state();
        state.read_up_to = Some(snapshot.timestamp_millis());
        state.phase = Phase::Streaming;
        state.moved();
    }

    /// The stream opened from a stored position (the relay's, or where it
    /// broke): how far it reads is known from its first event on, if it was
    /// not known before.
    pub fn resumed(&self) {
        self.state().started(Phase::Streaming);
    }

    /// The source passed something on; `up_to`, if known, is the commit
    /// time before which it has passed everything on.
    pub fn read(&self, up_to: Option<DateTime>) {
        let mut state = self.state();
        if let Some(up_to) = up_to {
            let up_to = up_to.timestamp_millis();
            state.read_up_to = Some(state.read_up_to.map_or(up_to, |read| read.max(up_to)));
        }
        state.moved();
    }

    /// The source was kept waiting by the rest of the relay (a new term's
    /// stored holds being read): a wait that is not its own stall, so it
    /// counts as moving from now, for one window. Only the last move is
    /// set: a start since is timed as before (starting again and again
    /// earns no more). Without a stream, nothing waited, and the sweep
    /// still goes by the clock.
    pub fn waited(&self) {
        if self.0.stream {
            self.state().moved = Some(Instant::now());
        }
    }

    /// Whether the catch-up pass may feed a snapshot read at the source's
    /// start: only if the sweep has read nothing in this term, so that
    /// nothing in the snapshot was claimed, published or marked by it
    /// meanwhile. If so, the pass counts as moving from now (its first
    /// batch is in hand): the sweep reads nothing for a window, which the
    /// feed renews as it moves. Decided under the same lock as the sweep's
    /// scope: a sweep that asks first makes the claim fail, one that asks
    /// after is kept out.
    pub fn claim_snapshot(&self) -> bool {
        let mut state = self.state();
        let claimed = state.passing() && !state.swept;
        if claimed {
            state.moved();
        }
        claimed
    }

    /// Whether the sweep has been given anything to read in this term: a
    /// snapshot read now could not be claimed.
    pub fn sweep_has_read(&self) -> bool {
        self.state().swept
    }

    /// What a sweep pass at `now` may read, leaving never-tried messages
    /// to the stream for `grace` after it has read up to them.
    pub fn scope(&self, now: DateTime, grace: Duration) -> SweepScope {
        let mut state = self.state();
        let scope = self.scope_of(&state, now, grace);
        if scope != SweepScope::Nothing {
            state.swept = true;
        }
        scope
    }

    fn scope_of(&self, state: &State, now: DateTime, grace: Duration) -> SweepScope {
        if !self.0.stream || !state.live(self.0.stall) {
            return SweepScope::Before(earlier(now, grace));
        }
        if state.passing() {
            return SweepScope::Nothing;
        }
        match state.read_up_to {
            None => SweepScope::RetriesOnly,
            Some(read) => {
                let read = DateTime::from_millis(read.min(now.timestamp_millis()));
                SweepScope::Before(earlier(read, grace))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(5);

    fn at(ms: i64) -> DateTime {
        DateTime::from_millis(ms)
    }

    #[test]
    fn a_source_about_to_start_has_one_window_before_the_sweep_goes_by_the_clock() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        let now = at(1_000_000);
        assert_eq!(progress.scope(now, GRACE), SweepScope::Nothing);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(progress.scope(now, GRACE), SweepScope::Before(at(995_000)));
        let clock = StreamProgress::without_stream();
        assert_eq!(clock.scope(now, GRACE), SweepScope::Before(at(995_000)));
    }

    #[test]
    fn a_slow_start_up_leaves_the_source_its_own_window() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(30));
        progress.pass_started();
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
    }

    #[test]
    fn a_snapshot_read_beside_a_slow_count_is_fed_unless_the_sweep_read_meanwhile() {
        let now = at(1_000_000);
        // A window long enough for the claim and the sweep's question to
        // come within it on a busy machine.
        let slow = StreamProgress::new(Duration::from_millis(500));
        slow.pass_started();
        std::thread::sleep(Duration::from_millis(600));
        assert!(
            slow.claim_snapshot(),
            "the window lapsed, but the sweep read nothing"
        );
        assert_eq!(
            slow.scope(now, GRACE),
            SweepScope::Nothing,
            "the claimed snapshot keeps the sweep out"
        );

        let overtaken = StreamProgress::new(Duration::from_millis(20));
        overtaken.pass_started();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!overtaken.sweep_has_read());
        assert_eq!(overtaken.scope(now, GRACE), SweepScope::Before(at(995_000)));
        assert!(overtaken.sweep_has_read());
        assert!(!overtaken.claim_snapshot(), "the sweep read by the clock");

        let kept_out = StreamProgress::new(Duration::from_secs(60));
        kept_out.pass_started();
        assert_eq!(kept_out.scope(now, GRACE), SweepScope::Nothing);
        assert!(
            kept_out.claim_snapshot(),
            "told to read nothing, it read nothing"
        );

        let resumed = StreamProgress::new(Duration::from_secs(60));
        resumed.resumed();
        assert!(!resumed.claim_snapshot(), "no pass: the stream replays");
        let ended = StreamProgress::new(Duration::from_secs(60));
        ended.pass_started();
        ended.pass_ended(now);
        assert!(!ended.claim_snapshot());
    }

    #[test]
    fn a_start_reads_its_snapshot_in_the_terms_window_and_a_second_in_its_own() {
        let now = at(1_000_000);
        let at_once = StreamProgress::new(Duration::from_secs(60));
        assert!(at_once.claim_snapshot(), "read within the term's window");

        let overtaken = StreamProgress::new(Duration::from_millis(500));
        std::thread::sleep(Duration::from_millis(600));
        assert_eq!(overtaken.scope(now, GRACE), SweepScope::Before(at(995_000)));
        assert!(!overtaken.claim_snapshot());
        overtaken.pass_started();
        assert_eq!(
            overtaken.scope(now, GRACE),
            SweepScope::Nothing,
            "the pass's own start gives the second read a window"
        );
    }

    #[test]
    fn a_catch_up_pass_under_way_keeps_the_sweep_out() {
        let progress = StreamProgress::new(Duration::from_secs(60));
        progress.pass_started();
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
        progress.read(None);
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
    }

    #[test]
    fn after_the_pass_the_grace_runs_from_what_the_stream_read() {
        let progress = StreamProgress::new(Duration::from_secs(60));
        progress.pass_started();
        progress.pass_ended(at(400_000));
        let now = at(1_000_000);
        assert_eq!(progress.scope(now, GRACE), SweepScope::Before(at(395_000)));
        progress.read(Some(at(700_000)));
        assert_eq!(progress.scope(now, GRACE), SweepScope::Before(at(695_000)));
        // An event out of order never moves the bound back.
        progress.read(Some(at(600_000)));
        assert_eq!(progress.scope(now, GRACE), SweepScope::Before(at(695_000)));
        // Nor can a clock ahead of the relay's push it past now.
        progress.read(Some(at(2_000_000)));
        assert_eq!(progress.scope(now, GRACE), SweepScope::Before(at(995_000)));
    }

    #[test]
    fn a_resumed_stream_leaves_never_tried_messages_until_its_first_event() {
        let progress = StreamProgress::new(Duration::from_secs(60));
        progress.pass_started();
        progress.resumed();
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::RetriesOnly
        );
        progress.read(Some(at(900_000)));
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(895_000))
        );
    }

    #[test]
    fn a_stalled_source_is_no_reason_to_wait() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        progress.pass_started();
        progress.read(None);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(995_000))
        );
    }

    #[test]
    fn starting_again_and_again_without_reading_earns_no_more_time() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        progress.pass_started();
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
        std::thread::sleep(Duration::from_millis(30));
        progress.pass_started();
        progress.resumed();
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(995_000))
        );
        // A read is movement again.
        progress.read(Some(at(900_000)));
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(895_000))
        );
    }

    #[test]
    fn a_pass_kept_waiting_by_the_relay_is_not_stalled() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        progress.pass_started();
        progress.read(None);
        // The pipeline is full, and sends nothing until the term's holds
        // are known.
        std::thread::sleep(Duration::from_millis(30));
        progress.waited();
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
        let clock = StreamProgress::without_stream();
        clock.waited();
        assert_eq!(
            clock.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(995_000))
        );
    }

    #[test]
    fn waiting_is_one_window_and_not_a_new_start() {
        let progress = StreamProgress::new(Duration::from_millis(20));
        progress.pass_started();
        std::thread::sleep(Duration::from_millis(30));
        progress.waited();
        assert_eq!(progress.scope(at(1_000_000), GRACE), SweepScope::Nothing);
        // Starting again without reading earns no more.
        std::thread::sleep(Duration::from_millis(30));
        progress.pass_started();
        assert_eq!(
            progress.scope(at(1_000_000), GRACE),
            SweepScope::Before(at(995_000))
        );
    }
}
