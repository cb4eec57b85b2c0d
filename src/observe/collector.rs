//! The collector: reads what only the database knows, every interval.
//!
//! Pending and failed depths, the oldest pending message, the checkpoint's
//! age (a standby sees the leader's), and the oplog's headroom: how much
//! history lies before the stored position. When that headroom falls under
//! the warning threshold the relay says so once, because a relay that stays
//! down longer than the headroom loses its place in the stream (the sweep
//! and catch-up pass still deliver everything, only later).
//!
//! Monitoring must not become the database's load. Its reads are index
//! ranges and seeks on MongoDB, but counting ten million pending messages
//! takes seconds, and a compatible server may walk its whole oplog to find
//! the first entry (SecantusDB's Rust build takes half a minute at three
//! million entries). So after a slow read (the depths, or the oplog's
//! span) the collector waits [`SLOW_READ_MULTIPLE`] times as long as it
//! took before making that read again, up to [`LONGEST_WAIT`]; quick reads
//! are made every interval. For the same reason the depths are first read
//! an interval after the process starts, not at once: the start-up reads
//! of a relay that leads from its start (its held keys, a resume's count,
//! the catch-up pass's snapshot) and the first of a drain come first, and
//! the depths, a count of every pending entry on any server, would slow
//! them when the server is busiest. (A standby that takes over later has
//! had its first read long before.) So an operator who reads the depths
//! rarely (a long `--collect-interval`, where the server walks the
//! collection to count) is given none in a short drain. The first round's
//! other reads (the checkpoint, the oplog) are made at once.
//!
//! A quiet outbox is read less often: where the last read found nothing
//! pending and this relay has marked nothing since, the next round waits
//! six intervals, a minute with the default (`time::quiet_interval`). A
//! message that starts waiting then shows in
//! `outbox_oldest_pending_age_seconds` within that minute, before it has
//! waited the minute its alert looks for; the oplog's headroom, watched in
//! hours, and the checkpoint's age, alerted on at five minutes, are a
//! minute old at most.
//!
//! Through mongos there is no oplog to read: each shard keeps its own, and
//! mongos refuses the `local` database. The collector asks once, before
//! its first read of the oplog, what the connection reaches
//! ([`Deployment`]), and where it reaches no oplog says so once and never
//! reads it.

use std::time::Duration;

use bson::{DateTime, Document};
use mongodb::{Client, Collection};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use crate::checkpoint::CheckpointStore;
use crate::deployment::Deployment;
use crate::error::{brief, command_code, is_unauthorized, Error, Result};
use crate::outbox_state::{Checkpoint, Depths, Oplog};
use crate::partition::Partition;
use crate::retry::Outage;

/// Reads the outbox's depths and the oplog's headroom into metrics.
pub struct Collector {
    pub(crate) outbox: Collection<Document>,
    /// The outbox's checkpoint store; each partition's is read. `None`
    /// where the relays poll: they keep no stream position.
    pub(crate) checkpoints: Option<CheckpointStore>,
    /// How many partitions the relays share.
    pub(crate) partitions: u32,
    pub(crate) client: Client,
    pub(crate) metrics: Metrics,
    pub(crate) interval: Duration,
    /// `None`: the oplog is not read (`--oplog-headroom-warning off`).
    pub(crate) headroom_warning: Option<Duration>,
    /// When the relay started: the age of a partition's position that was
    /// never written counts from here.
    pub(crate) started: DateTime,
}

/// How many times as long as a slow read took the collector waits before
/// making it again.
const SLOW_READ_MULTIPLE: u32 = 20;

/// The longest a slow read puts the next off: the figures it gives go no
/// staler than this.
const LONGEST_WAIT: Duration = Duration::from_secs(300);

/// What the collector knows of the oplog and has said of it, so that it
/// speaks only on change:
///
/// | from | to | when | said |
/// |---|---|---|---|
/// | `Unasked` | `Unknown` | the connection reaches a replica set | nothing |
/// | `Unasked` | `Unreported` | it reaches no oplog (mongos) | a warning; never read |
/// | a read state | `Unreadable` | a read fails | the first time |
/// | a read state | `Short` | the headroom is under the threshold | the first time |
/// | `Short` | `Ample` | the headroom is over it again | the first time |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OplogState {
    /// What the connection reaches is not known yet: asked before the
    /// first read (again at the next round if the server did not answer).
    Unasked,
    /// The connection reaches no oplog to read (mongos): said once, and
    /// the oplog is never read.
    Unreported,
    /// Readable, and nothing said yet.
    Unknown,
    Unreadable,
    Ample,
    Short,
}

impl OplogState {
    /// Whether the oplog is read in this state.
    fn is_read(self) -> bool {
        !matches!(self, OplogState::Unasked | OplogState::Unreported)
    }
}

/// Collects every interval until `shutdown`. A stop does not wait for a
/// round under way: a slow server can take longer over it than a stop has.
/// The round's reads are dropped unfinished, which leaves nothing of the
/// collector's half-written (its state is set after each read returns).
pub(crate) async fn collect(collector: Collector, shutdown: CancellationToken) {
    let mut state = RoundState::new(collector.interval);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            () = collector.round(&mut state) => {}
        }
        let pause = match state.quiet {
            Quiet::Yes => crate::time::quiet_interval(collector.interval),
            Quiet::No => collector.interval,
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// What the collector carries from one round to the next, so that it
/// speaks only when something changes.
struct RoundState {
    outage: Outage,
    oplog: OplogState,
    depths_pace: Pace,
    oplog_pace: Pace,
    quiet: Quiet,
    /// This relay's count of messages marked as of the last depths read.
    marked: u64,
}

/// Whether the outbox was quiet at the last round: the depths read found
/// nothing pending, and this relay has marked nothing since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quiet {
    Yes,
    No,
}

impl RoundState {
    /// The state of a collector that starts now: the oplog is read in the
    /// first round, the depths an interval later (see the module's doc).
    fn new(interval: Duration) -> Self {
        let now = Instant::now();
        RoundState {
            outage: Outage::new("MongoDB reading the outbox's depths and checkpoint"),
            oplog: OplogState::Unasked,
            depths_pace: Pace::due_at("the outbox's depths", now + interval),
            oplog_pace: Pace::due_at("the oplog's first and last entries", now),
            quiet: Quiet::No,
            marked: 0,
        }
    }
}

/// When a read may be made again: after a slow one, later.
struct Pace {
    what: &'static str,
    due: Instant,
    /// Whether the last read was slow enough to put the next off.
    slow: bool,
}

impl Pace {
    /// A read first due at `due`.
    fn due_at(what: &'static str, due: Instant) -> Self {
        Pace {
            what,
            due,
            slow: false,
        }
    }

    fn is_due(&self) -> bool {
        Instant::now() >= self.due
    }

    /// Sets when the read is due again, after one that began at `began`
    /// and has just ended; says when reads turn slow, or quick again.
    fn read_ended(&mut self, began: Instant, interval: Duration) {
        let took = began.elapsed();
        let wait = wait_before_next(took, interval);
        self.due = began + wait;
        let slow = is_slow(took, interval, self.slow);
        if slow && !self.slow {
            tracing::info!(
                ?took,
                next_in = ?wait,
                "reading {} is slow on this server: it is read less often",
                self.what
            );
        } else if !slow && self.slow {
            tracing::info!(?took, "reading {} is quick again", self.what);
        }
        self.slow = slow;
    }
}

/// How long a read that `took` so long puts the next off, whatever the
/// interval: [`SLOW_READ_MULTIPLE`] times the read, at most [`LONGEST_WAIT`].
fn pause_after(took: Duration) -> Duration {
    took.saturating_mul(SLOW_READ_MULTIPLE).min(LONGEST_WAIT)
}

/// The wait before a read is made again, after one that `took` so long:
/// the interval, or [`pause_after`] the read if that is longer.
fn wait_before_next(took: Duration, interval: Duration) -> Duration {
    interval.max(pause_after(took))
}

/// Whether a read that `took` so long is slow: long enough to put the next
/// off, or, after a slow one (`was_slow`), more than half as long.
fn is_slow(took: Duration, interval: Duration, was_slow: bool) -> bool {
    let quick_below = if was_slow { interval / 2 } else { interval };
    pause_after(took) > quick_below
}

impl Collector {
    /// Reads the depths and the oplog's span when due, and the checkpoint.
    async fn round(&self, state: &mut RoundState) {
        let marked = self.metrics.processed_total();
        if marked != state.marked {
            state.quiet = Quiet::No;
        }
        match self.outbox_state(state).await {
            Ok(position) => {
                state.outage.recovered();
                if let Some(warning) = self.headroom_warning {
                    if state.oplog == OplogState::Unasked {
                        state.oplog = self.ask_deployment().await;
                    }
                    if state.oplog.is_read() && state.oplog_pace.is_due() {
                        let began = Instant::now();
                        state.oplog = self.oplog(state.oplog, position, warning).await;
                        state.oplog_pace.read_ended(began, self.interval);
                    }
                }
            }
            Err(error) => state.outage.failed(&error),
        }
    }

    /// Reads the depths when due and the checkpoint into the metrics (a
    /// standby thereby reports the leader's checkpoint age); returns when
    /// the stored position was reached, if it is known.
    async fn outbox_state(&self, state: &mut RoundState) -> Result<Option<DateTime>> {
        if state.depths_pace.is_due() {
            let began = Instant::now();
            let marked = self.metrics.processed_total();
            // A read that fails is not paced: how long it took says more
            // of the network than of the server; the outage reports it.
            let depths = Depths::read(&self.outbox).await?;
            state.depths_pace.read_ended(began, self.interval);
            state.marked = marked;
            state.quiet = match depths.pending {
                0 => Quiet::Yes,
                _ => Quiet::No,
            };
            self.metrics
                .depths(depths.pending, depths.failed, depths.oldest_pending);
        }
        let Some(checkpoints) = &self.checkpoints else {
            return Ok(None);
        };
        // With partitions, the headroom is the oldest position's: the
        // partition furthest behind is the first to lose its place.
        let mut oldest: Option<DateTime> = None;
        for partition in Partition::all(self.partitions) {
            let store = checkpoints.clone().of_partition(partition);
            let checkpoint = Checkpoint::read(&store).await?;
            // One never written counts from this relay's start: a
            // partition whose stream never stores a position shows too.
            let written = checkpoint.updated_at.unwrap_or(self.started);
            self.metrics.checkpoint_saved(partition, written);
            oldest = match (oldest, checkpoint.position_at) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(oldest)
    }

    /// Whether the oplog is to be read: asks what the connection reaches,
    /// and where it reaches no oplog (mongos) says once what goes
    /// unreported. `Unasked` if the server did not answer, to be asked at
    /// the next round (the depths' reads report an outage).
    async fn ask_deployment(&self) -> OplogState {
        match Deployment::detect(&self.client).await {
            Ok(deployment) => match deployment.oplog_unreadable() {
                None => OplogState::Unknown,
                Some(why) => {
                    tracing::warn!(
                        %deployment,
                        "{why}; so the relay does not report its headroom \
                         (outbox_oplog_window_seconds and outbox_oplog_headroom_seconds stay at \
                         0) and --oplog-headroom-warning warns of nothing: watch each shard's \
                         oplog window instead, and set --oplog-headroom-warning off to leave the \
                         oplog out"
                    );
                    OplogState::Unreported
                }
            },
            Err(error) => {
                tracing::debug!(
                    error = %brief(&error),
                    "could not ask MongoDB what it is before reading the oplog; asking again at \
                     the next round"
                );
                OplogState::Unasked
            }
        }
    }

    /// Reads the oplog's span and the headroom before `position`, and logs
    /// when the headroom state changes.
    async fn oplog(
        &self,
        said: OplogState,
        position: Option<DateTime>,
        warning: Duration,
    ) -> OplogState {
        let oplog = match Oplog::read(&self.client).await {
            Ok(Some(oplog)) => oplog,
            Ok(None) => return said,
            Err(error) => {
                if said != OplogState::Unreadable {
                    tracing::info!(
                        %error,
                        "the oplog cannot be read, so its headroom is not reported: {}",
                        what_to_do_when_unreadable(&error)
                    );
                }
                return OplogState::Unreadable;
            }
        };
        let headroom = position.map(|at| oplog.headroom_seconds(at));
        self.metrics.oplog(
            Duration::from_secs_f64(oplog.window_seconds().max(0.0)),
            headroom,
        );
        let Some(headroom) = headroom else {
            return said;
        };
        let warning = warning.as_secs_f64();
        match (headroom < warning, said) {
            (true, OplogState::Short) => OplogState::Short,
            (true, _) => {
                tracing::warn!(
                    headroom_seconds = headroom,
                    threshold_seconds = warning,
                    "the oplog holds little history before the stored stream position: if the \
                     relay stops for longer, it will lose its place and fall back to a catch-up \
                     pass; enlarge the oplog (replSetResizeOplog) or keep the relay running"
                );
                OplogState::Short
            }
            (false, OplogState::Short) => {
                tracing::info!(
                    headroom_seconds = headroom,
                    "the oplog's headroom is ample again"
                );
                OplogState::Ample
            }
            (false, _) => OplogState::Ample,
        }
    }
}

/// What an operator can do about an oplog read that failed: the user's
/// permission, a server that refuses the `local` database as mongos does
/// (one that does not say it is mongos: a proxy in front of one), or a
/// passing failure.
fn what_to_do_when_unreadable(error: &Error) -> &'static str {
    /// IllegalOperation: mongos's answer to any command on `local`.
    const ILLEGAL_OPERATION: i32 = 20;
    let Error::Mongo { source, .. } = error else {
        return "it is read again at each interval";
    };
    if is_unauthorized(source) {
        "the relay's user may not read local.oplog.rs; grant it the clusterMonitor role, or set \
         --oplog-headroom-warning off"
    } else if command_code(source) == Some(ILLEGAL_OPERATION) {
        "the server refuses the local database, as mongos does; watch each shard's oplog window \
         instead, and set --oplog-headroom-warning off"
    } else {
        "it is read again at each interval"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use mongodb::options::ClientOptions;

    /// A round that cannot finish (no server answers, and the driver waits
    /// a minute to say so) does not hold up a stop.
    #[tokio::test]
    async fn a_stop_does_not_wait_for_a_round_under_way() {
        let options = ClientOptions::builder()
            .hosts(vec![mongodb::options::ServerAddress::Tcp {
                host: "127.0.0.1".into(),
                port: Some(9),
            }])
            .server_selection_timeout(Duration::from_secs(60))
            .build();
        let client = Client::with_options(options).expect("a client");
        let database = client.database("outbox_relay_collector_test");
        let collector = Collector {
            outbox: database.collection("outbox"),
            checkpoints: Some(CheckpointStore::new(
                &database,
                "outbox_checkpoints",
                "outbox",
            )),
            started: DateTime::now(),
            partitions: 1,
            client,
            metrics: Metrics::new(),
            interval: Duration::from_secs(10),
            headroom_warning: Some(Duration::from_secs(3600)),
        };
        let read = tokio::time::timeout(Duration::from_secs(1), Depths::read(&collector.outbox));
        assert!(read.await.is_err(), "a round's read waits for a server");
        let shutdown = CancellationToken::new();
        let collecting = tokio::spawn(collect(collector, shutdown.clone()));
        // Lets the collector start its round before the stop.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!collecting.is_finished(), "the round waits for a server");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), collecting)
            .await
            .expect("the collector stops before its round could end")
            .expect("the collector does not panic");
    }

    #[test]
    fn reads_near_the_threshold_do_not_flip_between_slow_and_quick() {
        let interval = Duration::from_secs(10);
        let (quick, near, slow) = (
            Duration::from_millis(200),
            Duration::from_millis(400),
            Duration::from_millis(600),
        );
        assert!(!is_slow(near, interval, false));
        assert!(is_slow(slow, interval, false));
        assert!(is_slow(near, interval, true), "stays slow");
        assert!(!is_slow(quick, interval, true), "quick again");
        let hour = Duration::from_secs(3600);
        assert!(
            !is_slow(Duration::from_secs(60), hour, false),
            "no read is put off past an interval longer than the longest wait"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_pace_is_due_at_once_and_again_after_twenty_times_a_slow_read() {
        let interval = Duration::from_secs(10);
        let mut pace = Pace::due_at("a test read", Instant::now());
        assert!(pace.is_due());
        let began = Instant::now();
        tokio::time::advance(Duration::from_secs(2)).await;
        pace.read_ended(began, interval);
        tokio::time::advance(Duration::from_secs(37)).await;
        assert!(!pace.is_due(), "40 s after the read began, not 39");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(pace.is_due());
        let began = Instant::now();
        pace.read_ended(began, interval);
        tokio::time::advance(interval).await;
        assert!(
            pace.is_due(),
            "a quick read is due again after the interval"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_depths_are_first_read_an_interval_after_the_start_and_the_oplog_at_once() {
        let interval = Duration::from_secs(300);
        let state = RoundState::new(interval);
        assert!(state.oplog_pace.is_due());
        assert!(!state.depths_pace.is_due(), "not in the first round");
        tokio::time::advance(interval - Duration::from_millis(1)).await;
        assert!(!state.depths_pace.is_due(), "not before the interval");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(state.depths_pace.is_due());
    }

    /// An oplog read the server refused with `code`.
    fn refused(code: i32, name: &str) -> Error {
        let command: mongodb::error::CommandError = bson::from_document(bson::doc! {
            "code": code, "codeName": name, "errmsg": "refused",
        })
        .expect("a command error");
        Error::mongo(
            "reading local.oplog.rs failed",
            mongodb::error::ErrorKind::Command(command).into(),
        )
    }

    #[test]
    fn an_unreadable_oplog_is_said_with_what_to_do() {
        let unauthorized = what_to_do_when_unreadable(&refused(13, "Unauthorized"));
        assert!(unauthorized.contains("clusterMonitor"), "{unauthorized}");
        // As mongos answers a command on `local`.
        let refused_here = what_to_do_when_unreadable(&refused(20, "IllegalOperation"));
        assert!(refused_here.contains("as mongos does"), "{refused_here}");
        assert!(refused_here.contains("--oplog-headroom-warning off"));
        let passing = what_to_do_when_unreadable(&refused(91, "ShutdownInProgress"));
        assert!(passing.contains("read again"), "{passing}");
    }

    #[test]
    fn the_oplog_is_read_only_once_known_to_be_there() {
        assert!(!OplogState::Unasked.is_read(), "asked first");
        assert!(!OplogState::Unreported.is_read(), "through mongos: never");
        for read in [
            OplogState::Unknown,
            OplogState::Unreadable,
            OplogState::Ample,
            OplogState::Short,
        ] {
            assert!(read.is_read(), "{read:?}");
        }
    }

    #[test]
    fn a_slow_read_spaces_the_next_out() {
        let interval = Duration::from_secs(10);
        assert_eq!(
            wait_before_next(Duration::from_millis(5), interval),
            interval
        );
        assert_eq!(
            wait_before_next(Duration::from_secs(2), interval),
            Duration::from_secs(40)
        );
        assert_eq!(
            wait_before_next(Duration::from_secs(30), interval),
            LONGEST_WAIT
        );
        assert_eq!(wait_before_next(Duration::MAX, interval), LONGEST_WAIT);
        let day = Duration::from_secs(86_400);
        assert_eq!(wait_before_next(Duration::from_secs(30), day), day);
    }
}
