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

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
    /// Whence `moved` counts.
    epoch: Instant,
    /// When the source last passed something on, in milliseconds since
    /// `epoch`; negative if it never did.
    moved: AtomicI64,
    /// When the source started without passing anything on since, in
    /// milliseconds since `epoch`; negative if it has read since.
    started: AtomicI64,
    /// `started` is the relay's guess, before the source's own start.
    provisional: AtomicBool,
    /// A catch-up pass is feeding the pipeline.
    passing: AtomicBool,
    /// Every message committed before this (milliseconds since the Unix
    /// epoch) has been passed on; `i64::MIN` if that is not known yet.
    read_up_to: AtomicI64,
    /// How long a source may pass nothing on and still count as moving.
    stall: Duration,
    /// Whether there is a source at all (not in poll mode).
    stream: bool,
    /// The sweep was given a scope to read in this term (anything but
    /// [`SweepScope::Nothing`]).
    swept: AtomicBool,
    /// Held while the sweep's scope, or the source's claim on a snapshot,
    /// is decided: never across an await.
    deciding: Mutex<()>,
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
        Self::with(0, true, stall, true)
    }

    /// Progress for a relay with no stream: the sweep goes by the clock.
    pub fn without_stream() -> Self {
        Self::with(-1, false, Duration::ZERO, false)
    }

    fn with(started: i64, provisional: bool, stall: Duration, stream: bool) -> Self {
        StreamProgress(Arc::new(Progress {
            epoch: Instant::now(),
            moved: AtomicI64::new(-1),
            started: AtomicI64::new(started),
            provisional: AtomicBool::new(provisional),
            passing: AtomicBool::new(provisional),
            read_up_to: AtomicI64::new(i64::MIN),
            stall,
            stream,
            swept: AtomicBool::new(false),
            deciding: Mutex::new(()),
        }))
    }

    /// A catch-up pass starts: it covers every due message, and nothing
    /// is known read until it ends.
    pub fn pass_started(&self) {
        self.0.read_up_to.store(i64::MIN, Ordering::Relaxed);
        self.0.passing.store(true, Ordering::Relaxed);
        self.started();
    }

    /// A catch-up pass queued everything committed before `snapshot`.
    pub fn pass_ended(&self, snapshot: DateTime) {
        self.0
            .read_up_to
            .store(snapshot.timestamp_millis(), Ordering::Relaxed);
        self.0.passing.store(false, Ordering::Relaxed);
        self.moved();
    }

    /// The stream opened from a stored position (the relay's, or where it
    /// broke): how far it reads is known from its first event on, if it was
    /// not known before.
    pub fn resumed(&self) {
        self.0.passing.store(false, Ordering::Relaxed);
        self.started();
    }

    /// The source passed something on; `up_to`, if known, is the commit
    /// time before which it has passed everything on.
    pub fn read(&self, up_to: Option<DateTime>) {
        if let Some(up_to) = up_to {
            self.0
                .read_up_to
                .fetch_max(up_to.timestamp_millis(), Ordering::Relaxed);
        }
        self.moved();
    }

    /// The source was kept waiting by the rest of the relay (a new term's
    /// stored holds being read): a wait that is not its own stall, so it
    /// counts as moving from now, for one window. Only the last move is
    /// set: a start since is timed as before (starting again and again
    /// earns no more). Without a stream, nothing waited, and the sweep
    /// still goes by the clock.
    pub fn waited(&self) {
        if self.0.stream {
            self.0.moved.fetch_max(self.elapsed(), Ordering::Relaxed);
        }
    }

    fn moved(&self) {
        self.0.moved.store(self.elapsed(), Ordering::Relaxed);
        self.0.started.store(-1, Ordering::Relaxed);
        self.0.provisional.store(false, Ordering::Relaxed);
    }

    /// A start counts from the first since the source last read.
    fn started(&self) {
        let now = self.elapsed();
        if self.0.provisional.swap(false, Ordering::Relaxed) {
            self.0.started.store(now, Ordering::Relaxed);
            return;
        }
        let _ = self
            .0
            .started
            .compare_exchange(-1, now, Ordering::Relaxed, Ordering::Relaxed);
    }

    fn elapsed(&self) -> i64 {
        i64::try_from(self.0.epoch.elapsed().as_millis()).unwrap_or(i64::MAX)
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
        let _deciding = self.decide();
        let claimed =
            self.0.passing.load(Ordering::Relaxed) && !self.0.swept.load(Ordering::Relaxed);
        if claimed {
            self.moved();
        }
        claimed
    }

    /// Whether the sweep has been given anything to read in this term: a
    /// snapshot read now could not be claimed.
    pub fn sweep_has_read(&self) -> bool {
        self.0.swept.load(Ordering::Relaxed)
    }

    fn decide(&self) -> std::sync::MutexGuard<'_, ()> {
        // The guarded data is `()`: a panic elsewhere leaves nothing torn.
        self.0
            .deciding
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the source read, or started, within the stall window.
    fn live(&self) -> bool {
        let now = self.elapsed();
        let stall = i64::try_from(self.0.stall.as_millis()).unwrap_or(i64::MAX);
        let within = |at: i64| at >= 0 && now.saturating_sub(at) <= stall;
        within(self.0.moved.load(Ordering::Relaxed))
            || within(self.0.started.load(Ordering::Relaxed))
    }

    /// What a sweep pass at `now` may read, leaving never-tried messages
    /// to the stream for `grace` after it has read up to them.
    pub fn scope(&self, now: DateTime, grace: Duration) -> SweepScope {
        let _deciding = self.decide();
        let scope = self.scope_now(now, grace);
        if scope != SweepScope::Nothing {
            self.0.swept.store(true, Ordering::Relaxed);
        }
        scope
    }

    fn scope_now(&self, now: DateTime, grace: Duration) -> SweepScope {
        if !self.live() {
            return SweepScope::Before(earlier(now, grace));
        }
        if self.0.passing.load(Ordering::Relaxed) {
            return SweepScope::Nothing;
        }
        match self.0.read_up_to.load(Ordering::Relaxed) {
            i64::MIN => SweepScope::RetriesOnly,
            read => {
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
