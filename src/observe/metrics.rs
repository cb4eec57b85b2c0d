//! The relay's metrics and readiness, one registry per relay.
//!
//! Every stage records into a [`Metrics`] handle (cheap to clone) rather
//! than a process-wide recorder, so two relays in one process, or a test
//! running several, each report their own. Counters and histograms are
//! recorded as things happen; ages (oldest pending message, checkpoint,
//! stream lag) are kept as the instant they count from and turned into
//! seconds when scraped, so they stay current between collections.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::DateTime;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

use crate::partition::Partition;

/// Declares an enum used as a label value, written in snake case as
/// Prometheus labels are.
macro_rules! label_value {
    ($(#[$meta:meta])* $name:ident { $($(#[$doc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
        pub enum $name {
            $($(#[$doc])* $variant),+
        }

        impl EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
                use std::fmt::Write;
                encoder.write_str(match self {
                    $($name::$variant => $text),+
                })
            }
        }
    };
}

label_value!(
    /// Where a published message was read: the change stream, the catch-up
    /// pass that follows a lost or missing token, or a sweep.
    Origin {
        Stream => "stream",
        CatchUp => "catch_up",
        Sweep => "sweep",
    }
);

label_value!(
    /// Why a message was marked `failed`.
    FailureKind {
        /// It breaks the document contract, is too large for the broker, or
        /// its document refuses the write that schedules another attempt
        /// and takes a failure in its place.
        Rejected => "rejected",
        /// The broker refused it on every allowed attempt.
        Exhausted => "exhausted",
    }
);

label_value!(
    /// The servers the relay depends on.
    Server {
        Mongodb => "mongodb",
        Nats => "nats",
    }
);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OriginLabel {
    origin: Origin,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: FailureKind,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabel {
    partition: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServerLabel {
    server: Server,
}

/// What the relay is doing, for readiness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Connecting and preparing the collection.
    Starting = 0,
    /// Another relay holds the lease; this one is ready to take over.
    Standby = 1,
    /// Holding the lease, opening the change stream.
    Leading = 2,
    /// Holding the lease with the change stream open.
    Tailing = 3,
    /// Poll mode: the sweep alone delivers.
    Polling = 4,
    /// Shutting down.
    Stopping = 5,
}

impl Role {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => Role::Standby,
            2 => Role::Leading,
            3 => Role::Tailing,
            4 => Role::Polling,
            5 => Role::Stopping,
            _ => Role::Starting,
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Role::Starting => "starting",
            Role::Standby => "standing by",
            Role::Leading => "leading, opening the change stream",
            Role::Tailing => "leading, tailing the change stream",
            Role::Polling => "polling",
            Role::Stopping => "stopping",
        }
    }
}

/// Whether the relay is ready, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    /// One line a condition: what holds, or what does not.
    pub conditions: Vec<String>,
}

/// A pause of delivery, reported until dropped.
pub(crate) struct PausedDelivery(Metrics);

impl Drop for PausedDelivery {
    fn drop(&mut self) {
        self.0 .0.exported.delivery_paused.dec();
    }
}

/// A new term's read of the held keys, reported until dropped.
pub(crate) struct ReadingHolds(Metrics);

impl Drop for ReadingHolds {
    fn drop(&mut self) {
        self.0 .0.holds_unread.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Seconds in the histograms' buckets: 100 µs doubling to about 26 s.
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.0, 19)
}

type FloatGauge = Gauge<f64, AtomicU64>;

/// States of the MongoDB connection, as the driver's monitoring reports it.
const NEVER_REACHED: u8 = 0;
const REACHED: u8 = 1;
const LOST: u8 = 2;

/// The relay's metrics. Clones share one registry.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    /// The metrics `registry` renders, clones of which it holds.
    exported: Exported,
    pause_reason: Mutex<Option<String>>,
    /// A new term's stored holds are being read: nothing is delivered yet.
    /// How many terms (one a partition) are reading their held keys.
    holds_unread: AtomicU64,
    /// Milliseconds since the epoch each age counts from; 0 for none.
    oldest_pending_since: AtomicI64,
    /// Each live term's held keys: how many, and when the oldest message
    /// they wait on was created (milliseconds), by the term's report.
    held: Mutex<HeldByTerm>,
    /// When each partition's resume token was last written (milliseconds),
    /// by this relay or, as read from MongoDB, by whichever relay holds it.
    checkpoints: Mutex<BTreeMap<u32, i64>>,
    /// Each held partition's stream: the commit time of its last event
    /// (milliseconds), or `None` while it has read all there is.
    streams: Mutex<BTreeMap<u32, Option<i64>>>,
    role: AtomicU8,
    mongodb: AtomicU8,
    nats: Mutex<Option<async_nats::Client>>,
}

/// Declares the exported metrics, each once: its field, its type (and how
/// it starts, where not from `Default`), its name after the `outbox_`
/// prefix, its unit if it has one, and its help text. A metric is
/// registered, and so rendered, in the order listed.
macro_rules! exported {
    (@start) => { Default::default() };
    (@start $start:expr) => { $start };
    (@register $registry:ident, $name:literal, $help:literal, $metric:expr) => {
        $registry.register($name, $help, $metric)
    };
    (@register $registry:ident, $name:literal, $help:literal, $metric:expr, $unit:ident) => {
        $registry.register_with_unit($name, $help, Unit::$unit, $metric)
    };
    ($(
        $(#[$doc:meta])*
        $field:ident: $kind:ty $(= $start:expr)? => $name:literal $(in $unit:ident)?, $help:literal;
    )+) => {
        /// Every metric `/metrics` renders.
        struct Exported {
            $($(#[$doc])* $field: $kind,)+
        }

        impl Exported {
            /// Fresh metrics, registered in `registry`.
            fn new(registry: &mut Registry) -> Self {
                let exported = Exported {
                    $($field: exported!(@start $($start)?),)+
                };
                $(exported!(@register registry, $name, $help, exported.$field.clone() $(, $unit)?);)+
                exported
            }
        }
    };
}

exported! {
    published: Family<OriginLabel, Counter> =>
        "published", "Messages the broker acknowledged, by where they were read";
    processed: Counter => "processed", "Messages marked processed";
    retries: Counter => "retries", "Refused messages scheduled for another attempt";
    failed: Family<KindLabel, Counter> =>
        "failed", "Messages marked failed (dead letters), by kind of failure";
    duplicates: Counter => "jetstream_duplicates",
        "Publishes JetStream acknowledged as duplicates of a message it already held";
    reconnects: Family<ServerLabel, Counter> =>
        "reconnects", "Connections to a server regained after being lost";
    group_reads: Counter => "group_reads",
        "Times this relay read its group of relays (a round: when the group changed, when a \
         lease it showed lapsed, or a poll)";
    stream_resumes: Counter => "stream_resumes",
        "Times the change stream was reopened from a stored position";
    history_lost: Counter => "history_lost",
        "Times the stored position could not be resumed and a catch-up pass ran";
    stream_ended: Counter => "change_stream_ended",
        "Times the change stream ended (collection or database dropped or renamed, cursor \
         closed) and was reopened";
    unmarkable: Counter => "unmarkable",
        "Messages the relay could not update at all (not even to mark them failed), left \
         pending and skipped";
    republish_avoided: Counter => "republish_avoided",
        "Messages NATS had acknowledged to this relay, read again before their mark was \
         written (a term lost, then led again), marked without being published again";
    republished: Counter => "republished",
        "Messages NATS had acknowledged to this relay, published again because another \
         relay led in between: repeats JetStream stores twice past its duplicate window";
    resent: Counter => "resent",
        "Messages sent again because their first answer was in doubt (a timeout, a lost \
         connection, an outage): JetStream drops the repeat within its duplicate window";
    audit_missing: Counter => "audit_missing",
        "Delivered messages a relay's audit (--audit-after) found in no stream: JetStream lost \
         what it acknowledged, or someone removed them";
    audit_repaired: Counter => "audit_repaired",
        "Missing messages a relay's audit published again";
    audit_unrepaired: Gauge => "audit_unrepaired",
        "Messages this relay's last audit left missing after its repair (0 when all were \
         mended, or another relay audits)";
    audit_rounds_failed: Counter => "audit_rounds_failed",
        "Audit rounds that failed or outlasted their limit; the next audits the same window";
    dead_letters_held: Counter => "dead_letters_held",
        "Messages out of attempts not failed, because the broker took no other message \
         recently (it may be refusing everything); tried again after the longest retry delay";
    delivery_paused: Gauge => "delivery_paused",
        "Publish stages paused because the broker takes no message (0 while delivery flows)";
    publish_ack: Histogram = Histogram::new(latency_buckets()) => "publish_ack" in Seconds,
        "Time from sending a message to the broker's acknowledgement";
    commit_to_publish: Histogram = Histogram::new(latency_buckets()) =>
        "commit_to_publish" in Seconds,
        "Time from a message's commit (the change event's wall time) to its acknowledgement";
    pending: Gauge => "pending_messages", "Messages waiting to be delivered";
    failed_depth: Gauge => "failed_messages",
        "Messages marked failed and still kept (dead-letter depth)";
    oldest_pending_age: FloatGauge => "oldest_pending_age" in Seconds,
        "Age of the oldest pending message (0 when none is pending)";
    /// When the depths were last read, in seconds since the Unix epoch.
    depths_read: FloatGauge => "depths_read_timestamp" in Seconds,
        "When the pending and failed depths were last read, in Unix time (0 before the \
         first read, until which those gauges read 0)";
    held_keys: Gauge => "held_keys",
        "Keys whose messages wait on a refused or held message of the key (on the leader)";
    oldest_held_age: FloatGauge => "oldest_held_age" in Seconds,
        "Age of the oldest message a held key waits on (0 when no key is held)";
    stream_lag: FloatGauge => "change_stream_lag" in Seconds,
        "Now minus the commit time of the last change event read (0 when the stream is caught \
         up); with partitions, the most behind of this relay's";
    /// Each partition's stream lag, as `stream_lag` is the relay's.
    partition_stream_lag: Family<PartitionLabel, FloatGauge> =>
        "partition_change_stream_lag" in Seconds,
        "The change stream lag of each partition this relay holds (0 once handed over)";
    checkpoint_age: FloatGauge => "checkpoint_age" in Seconds,
        "Time since the resume token was last written; with partitions, the oldest of \
         theirs (a partition whose stream is stuck writes none)";
    /// Each partition's checkpoint age, as `checkpoint_age` is the worst.
    partition_checkpoint_age: Family<PartitionLabel, FloatGauge> =>
        "partition_checkpoint_age" in Seconds,
        "Time since each partition's resume token was last written";
    leader: Gauge => "leader",
        "1 while this relay holds a lease (of the outbox, or of any partition), else 0";
    /// Set when scraped, as readiness says.
    ready: Gauge => "ready",
        "1 while /readyz answers 200 (connected, and tailing, polling or standing by, with \
         delivery not paused), else 0";
    /// Set when scraped: MongoDB as the driver's monitoring sees it, NATS
    /// unless the publisher is the application's own.
    connected: Family<ServerLabel, Gauge> => "connected",
        "1 while the relay is connected to the server, else 0";
    term: Gauge => "lease_term", "The lease term this relay last held";
    /// How many partitions this relay holds.
    partitions_held: Gauge => "partitions_held",
        "How many of the outbox's partitions this relay holds";
    /// The count of the partitions this relay held.
    partitions: Gauge => "partitions",
        "How many partitions the outbox has, as of the last this relay held (0 before its \
         first)";
    /// 1 for each partition this relay holds, else 0.
    partition_held: Family<PartitionLabel, Gauge> => "partition_held",
        "1 while this relay holds the partition's lease, else 0";
    /// The term of each partition this relay holds or last held.
    partition_term: Family<PartitionLabel, Gauge> => "partition_term",
        "The lease term of the partition this relay holds or last held";
    oplog_window: FloatGauge => "oplog_window" in Seconds, "Time spanned by the server's oplog";
    oplog_headroom: FloatGauge => "oplog_headroom" in Seconds,
        "How much older than the stored stream position the oplog's first entry is: the time \
         left before resuming from it fails";
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh set of metrics, all names prefixed `outbox_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("outbox");
        let exported = Exported::new(&mut registry);
        // Dead letters count from 0, so a rule on their increase sees the
        // first one (a series born at 1 has no increase to see).
        for kind in [FailureKind::Rejected, FailureKind::Exhausted] {
            drop(exported.failed.get_or_create(&KindLabel { kind }));
        }
        Metrics(Arc::new(Inner {
            registry,
            exported,
            pause_reason: Mutex::new(None),
            holds_unread: AtomicU64::new(0),
            oldest_pending_since: AtomicI64::new(0),
            held: Mutex::default(),
            checkpoints: Mutex::default(),
            streams: Mutex::default(),
            role: AtomicU8::new(Role::Starting as u8),
            mongodb: AtomicU8::new(NEVER_REACHED),
            nats: Mutex::new(None),
        }))
    }

    /// Renders every metric in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        self.refresh_ages(DateTime::now());
        self.refresh_states();
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.0.registry);
        text
    }

    /// A message reached the broker, `waited` after it was sent.
    pub(crate) fn published(&self, origin: Origin, waited: Duration, duplicate: bool) {
        let inner = &self.0;
        inner
            .exported
            .published
            .get_or_create(&OriginLabel { origin })
            .inc();
        inner.exported.publish_ack.observe(waited.as_secs_f64());
        if duplicate {
            inner.exported.duplicates.inc();
        }
    }

    /// A message the stream saw commit at `committed` was acknowledged now.
    pub(crate) fn delivered_since_commit(&self, committed: DateTime) {
        let elapsed = DateTime::now().timestamp_millis() - committed.timestamp_millis();
        self.0
            .exported
            .commit_to_publish
            .observe(elapsed.max(0) as f64 / 1000.0);
    }

    pub(crate) fn processed(&self, count: u64) {
        self.0.exported.processed.inc_by(count);
    }

    /// This relay read its group (a round).
    pub(crate) fn group_read(&self) {
        self.0.exported.group_reads.inc();
    }

    /// How many messages this relay has marked processed since it started.
    pub(crate) fn processed_total(&self) -> u64 {
        self.0.exported.processed.get()
    }

    pub(crate) fn retried(&self) {
        self.0.exported.retries.inc();
    }

    pub(crate) fn failed(&self, kind: FailureKind) {
        self.0
            .exported
            .failed
            .get_or_create(&KindLabel { kind })
            .inc();
    }

    /// A connection to `server` came back after being lost.
    pub(crate) fn reconnected(&self, server: Server) {
        self.0
            .exported
            .reconnects
            .get_or_create(&ServerLabel { server })
            .inc();
    }

    /// The change stream was reopened from a stored position.
    pub(crate) fn stream_resumed(&self) {
        self.0.exported.stream_resumes.inc();
    }

    /// The stored position could not be resumed from: a catch-up pass runs.
    pub(crate) fn history_lost(&self) {
        self.0.exported.history_lost.inc();
    }

    /// The change stream ended (the collection or its database was
    /// dropped or renamed, or the server closed the cursor).
    pub(crate) fn stream_ended(&self) {
        self.0.exported.stream_ended.inc();
    }

    /// A message NATS had acknowledged to this relay, read again before
    /// its mark was written, was marked without being published again.
    pub(crate) fn republish_avoided(&self) {
        self.0.exported.republish_avoided.inc();
    }

    /// A message NATS had acknowledged to this relay was published again
    /// (another leader led since; see `work::Acknowledged`).
    pub(crate) fn republished(&self) {
        self.0.exported.republished.inc();
    }

    /// A message whose answer was in doubt was sent again.
    pub(crate) fn resent(&self) {
        self.0.exported.resent.inc();
    }

    /// An audit round found `missing` more delivered messages in no
    /// stream, and published `repaired` of them again.
    pub(crate) fn audited(&self, missing: u64, repaired: u64) {
        let exported = &self.0.exported;
        exported.audit_missing.inc_by(missing);
        exported.audit_repaired.inc_by(repaired);
    }

    /// What this relay's last audit left missing (0 when another relay
    /// audits).
    pub(crate) fn audit_left(&self, unrepaired: u64) {
        let unrepaired = i64::try_from(unrepaired).unwrap_or(i64::MAX);
        self.0.exported.audit_unrepaired.set(unrepaired);
    }

    /// An audit round failed, or outlasted its limit.
    pub(crate) fn audit_round_failed(&self) {
        self.0.exported.audit_rounds_failed.inc();
    }

    /// A message could not be written at all (not even marked failed).
    pub(crate) fn unmarkable(&self) {
        self.0.exported.unmarkable.inc();
    }

    /// A message out of attempts was not failed for lack of evidence that
    /// the broker takes other messages.
    pub(crate) fn dead_letter_held(&self) {
        self.0.exported.dead_letters_held.inc();
    }

    /// Delivery is paused because the broker takes no message, until the
    /// returned guard is dropped. Readiness reports it.
    pub(crate) fn pause_delivery(&self, why: impl Into<String>) -> PausedDelivery {
        self.0.exported.delivery_paused.inc();
        if let Ok(mut reason) = self.0.pause_reason.lock() {
            *reason = Some(why.into());
        }
        PausedDelivery(self.clone())
    }

    /// A new term is reading the held keys, before which it delivers
    /// nothing, until the returned guard is dropped. Readiness reports it.
    pub(crate) fn reading_holds(&self) -> ReadingHolds {
        self.0.holds_unread.fetch_add(1, Ordering::Relaxed);
        ReadingHolds(self.clone())
    }

    /// `partition`'s stream returned an event that committed at `at`.
    pub(crate) fn stream_event(&self, partition: Partition, at: Option<DateTime>) {
        if let Ok(mut streams) = self.0.streams.lock() {
            let last = streams.entry(partition.index()).or_default();
            // An event without a commit time is as old as the last known.
            *last = at.map(|at| at.timestamp_millis()).or(*last).or(Some(0));
        }
    }

    /// A read of `partition`'s stream came back empty: nothing committed
    /// is unread.
    pub(crate) fn stream_idle(&self, partition: Partition) {
        if let Ok(mut streams) = self.0.streams.lock() {
            streams.insert(partition.index(), None);
        }
    }

    /// `partition`'s checkpoint was written at `at` (by this relay, or as
    /// MongoDB holds it): a later write is kept over an earlier one.
    pub(crate) fn checkpoint_saved(&self, partition: Partition, at: DateTime) {
        if let Ok(mut checkpoints) = self.0.checkpoints.lock() {
            let written = checkpoints.entry(partition.index()).or_default();
            *written = (*written).max(at.timestamp_millis());
        }
    }

    /// This relay took `partition` at `term` (`Some`), or gave it up
    /// (`None`); it leads while it holds any.
    pub(crate) fn partition_held(&self, partition: Partition, term: Option<i64>) {
        let inner = &self.0;
        let label = PartitionLabel {
            partition: partition.index().to_string(),
        };
        if term.is_none() {
            // Another relay reports its stream now.
            if let Ok(mut streams) = inner.streams.lock() {
                streams.remove(&partition.index());
            }
            inner
                .exported
                .partition_stream_lag
                .get_or_create(&label)
                .set(0.0);
        }
        inner
            .exported
            .partition_held
            .get_or_create(&label)
            .set(i64::from(term.is_some()));
        inner.exported.partitions.set(i64::from(partition.count()));
        let held = match term {
            Some(term) => {
                inner.exported.term.set(term);
                inner
                    .exported
                    .partition_term
                    .get_or_create(&label)
                    .set(term);
                inner.exported.partitions_held.inc() + 1
            }
            None => inner.exported.partitions_held.dec() - 1,
        };
        inner.exported.leader.set(i64::from(held > 0));
    }

    /// The outbox's depths, from a collection pass: pending and failed
    /// counts, and when the oldest pending message was created.
    pub(crate) fn depths(&self, pending: u64, failed: u64, oldest_pending: Option<DateTime>) {
        let inner = &self.0;
        inner
            .exported
            .pending
            .set(i64::try_from(pending).unwrap_or(i64::MAX));
        inner
            .exported
            .failed_depth
            .set(i64::try_from(failed).unwrap_or(i64::MAX));
        inner.oldest_pending_since.store(
            oldest_pending.map_or(0, |t| t.timestamp_millis()),
            Ordering::Relaxed,
        );
        inner
            .exported
            .depths_read
            .set(DateTime::now().timestamp_millis() as f64 / 1000.0);
    }

    /// A new term's report of its held keys, counted in the relay's gauges
    /// until it is dropped with the term: a relay that lost its lease
    /// reports none of that term's keys, and one holding several
    /// partitions reports the sum of their keys and the oldest of their
    /// waits.
    pub(crate) fn held_keys_report(&self) -> HeldKeysReport {
        let mut held = self.0.held.lock().unwrap_or_else(|e| e.into_inner());
        held.reports += 1;
        HeldKeysReport {
            metrics: self.clone(),
            id: held.reports,
        }
    }

    fn held_keys_changed(&self, held: &HeldByTerm) {
        let keys: usize = held.terms.values().map(|(keys, _)| keys).sum();
        self.0
            .exported
            .held_keys
            .set(i64::try_from(keys).unwrap_or(i64::MAX));
    }

    /// The oplog's span, and how far its first entry lies before the
    /// stored position in seconds (negative once the position is lost).
    pub(crate) fn oplog(&self, window: Duration, headroom: Option<f64>) {
        self.0.exported.oplog_window.set(window.as_secs_f64());
        if let Some(headroom) = headroom {
            self.0.exported.oplog_headroom.set(headroom);
        }
    }

    pub(crate) fn set_role(&self, role: Role) {
        self.0.role.store(role as u8, Ordering::Relaxed);
    }

    /// The role, unless the relay is already stopping.
    pub(crate) fn set_role_unless_stopping(&self, role: Role) {
        let _ = self
            .0
            .role
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |current| {
                (current != Role::Stopping as u8).then_some(role as u8)
            });
    }

    pub fn role(&self) -> Role {
        Role::from_u8(self.0.role.load(Ordering::Relaxed))
    }

    /// Whether the MongoDB driver currently sees a server it can write to.
    /// Only regaining a server once reached counts as a reconnection: the
    /// driver's first view of the topology has none yet.
    pub(crate) fn mongodb_reachable(&self, reachable: bool) {
        let state = &self.0.mongodb;
        if reachable {
            if state.swap(REACHED, Ordering::Relaxed) == LOST {
                self.reconnected(Server::Mongodb);
            }
        } else {
            let _ = state.compare_exchange(REACHED, LOST, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The NATS connection whose state readiness reports.
    pub(crate) fn watch_nats(&self, client: async_nats::Client) {
        if let Ok(mut nats) = self.0.nats.lock() {
            *nats = Some(client);
        }
    }

    /// Ready: MongoDB and NATS connected, and the relay either tailing as
    /// the leader, polling, or standing by to take over.
    pub fn readiness(&self) -> Readiness {
        let inner = &self.0;
        let (mongodb, nats) = self.connections();
        let role = self.role();
        let role_ready = matches!(role, Role::Standby | Role::Tailing | Role::Polling);
        let paused = (inner.exported.delivery_paused.get() > 0)
            .then(|| inner.pause_reason.lock().ok().and_then(|r| r.clone()))
            .map(|reason| format!("delivery: paused: {}", reason.unwrap_or_default()));
        // Not a pause: no broker fault, and `delivery_paused` stays 0.
        let waiting = inner
            .holds_unread
            .load(Ordering::Relaxed)
            .gt(&0)
            .then(|| "delivery: starting: reading the held keys".to_owned());
        let held_back = waiting.or(paused);
        let conditions = vec![
            format!(
                "mongodb: {}",
                if mongodb { "connected" } else { "unreachable" }
            ),
            format!(
                "nats: {}",
                match nats {
                    Some(true) => "connected",
                    Some(false) => "disconnected",
                    None => "not monitored (a publisher of the application's own)",
                }
            ),
            format!("role: {}", role.describe()),
            held_back
                .clone()
                .unwrap_or_else(|| "delivery: flowing".to_owned()),
        ];
        Readiness {
            ready: mongodb && nats != Some(false) && role_ready && held_back.is_none(),
            conditions,
        }
    }

    /// Whether MongoDB is reachable (a relay built over a handle it did
    /// not connect itself has no monitoring of its own, and counts it as
    /// up), and whether NATS is connected (`None`: not monitored, a
    /// publisher of the application's own).
    fn connections(&self) -> (bool, Option<bool>) {
        let inner = &self.0;
        let mongodb = inner.mongodb.load(Ordering::Relaxed) != LOST;
        let nats = inner.nats.lock().ok().and_then(|nats| {
            nats.as_ref()
                .map(|c| c.connection_state() == async_nats::connection::State::Connected)
        });
        (mongodb, nats)
    }

    /// The gauges that say what readiness says.
    fn refresh_states(&self) {
        let exported = &self.0.exported;
        let (mongodb, nats) = self.connections();
        let servers = [(Server::Mongodb, Some(mongodb)), (Server::Nats, nats)];
        for (server, connected) in servers {
            if let Some(connected) = connected {
                exported
                    .connected
                    .get_or_create(&ServerLabel { server })
                    .set(i64::from(connected));
            }
        }
        exported.ready.set(i64::from(self.readiness().ready));
    }

    fn refresh_ages(&self, now: DateTime) {
        let inner = &self.0;
        let age = |since: &AtomicI64| match since.load(Ordering::Relaxed) {
            0 => 0.0,
            millis => (now.timestamp_millis() - millis).max(0) as f64 / 1000.0,
        };
        inner
            .exported
            .oldest_pending_age
            .set(age(&inner.oldest_pending_since));
        let oldest_held = inner
            .held
            .lock()
            .map(|held| {
                let oldest = held.terms.values().filter_map(|(_, since)| *since).min();
                oldest.map_or(0.0, |millis| {
                    (now.timestamp_millis() - millis).max(0) as f64 / 1000.0
                })
            })
            .unwrap_or(0.0);
        inner.exported.oldest_held_age.set(oldest_held);
        // The outbox's checkpoint age is its oldest partition's.
        let mut oldest_checkpoint: f64 = 0.0;
        if let Ok(checkpoints) = inner.checkpoints.lock() {
            for (index, written) in checkpoints.iter() {
                let since = (now.timestamp_millis() - written).max(0) as f64 / 1000.0;
                let label = PartitionLabel {
                    partition: index.to_string(),
                };
                inner
                    .exported
                    .partition_checkpoint_age
                    .get_or_create(&label)
                    .set(since);
                oldest_checkpoint = oldest_checkpoint.max(since);
            }
        }
        inner.exported.checkpoint_age.set(oldest_checkpoint);
        // The relay's lag is its most behind partition's.
        let mut lag: f64 = 0.0;
        if let Ok(streams) = inner.streams.lock() {
            for (index, last) in streams.iter() {
                let behind = match last {
                    None | Some(0) => 0.0,
                    Some(millis) => (now.timestamp_millis() - millis).max(0) as f64 / 1000.0,
                };
                let label = PartitionLabel {
                    partition: index.to_string(),
                };
                inner
                    .exported
                    .partition_stream_lag
                    .get_or_create(&label)
                    .set(behind);
                lag = lag.max(behind);
            }
        }
        inner.exported.stream_lag.set(lag);
    }
}

/// The held keys of each live term, by its report's number.
#[derive(Default)]
struct HeldByTerm {
    /// Reports handed out so far: the next one's number.
    reports: u64,
    /// Each live report's keys, and when its oldest wait began.
    terms: BTreeMap<u64, (usize, Option<i64>)>,
}

/// One term's held keys in the relay's gauges; dropped with the term,
/// which takes them out.
pub(crate) struct HeldKeysReport {
    metrics: Metrics,
    id: u64,
}

impl HeldKeysReport {
    /// How many keys wait on a refused or held message, and when the oldest
    /// message they wait on was created.
    pub(crate) fn set(&self, keys: usize, oldest: Option<DateTime>) {
        let inner = &self.metrics.0;
        let mut held = inner.held.lock().unwrap_or_else(|e| e.into_inner());
        let since = oldest.map(|t| t.timestamp_millis());
        held.terms.insert(self.id, (keys, since));
        self.metrics.held_keys_changed(&held);
    }
}

impl Drop for HeldKeysReport {
    fn drop(&mut self) {
        let inner = &self.metrics.0;
        let mut held = inner.held.lock().unwrap_or_else(|e| e.into_inner());
        held.terms.remove(&self.id);
        self.metrics.held_keys_changed(&held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value `render` gives `name`, a gauge or counter without labels.
    fn value(metrics: &Metrics, name: &str) -> Option<f64> {
        metrics.render().lines().find_map(|line| {
            let (metric, value) = line.split_once(' ')?;
            (metric == name).then(|| value.parse().ok())?
        })
    }

    #[test]
    fn the_depths_say_when_they_were_read_and_zero_before_the_first_read() {
        let metrics = Metrics::new();
        let read_at = "outbox_depths_read_timestamp_seconds";
        assert_eq!(value(&metrics, read_at), Some(0.0));
        let before = DateTime::now().timestamp_millis() as f64 / 1000.0;
        metrics.depths(7, 2, None);
        assert_eq!(value(&metrics, "outbox_pending_messages"), Some(7.0));
        let read = value(&metrics, read_at).expect("the read time is rendered");
        assert!(read >= before, "{read} is before {before}");
    }

    #[test]
    fn the_checkpoint_age_is_the_oldest_partitions() {
        let metrics = Metrics::new();
        let now = DateTime::now().timestamp_millis();
        let (fresh, stuck) = (
            Partition::new(0, 2).expect("a partition"),
            Partition::new(1, 2).expect("a partition"),
        );
        metrics.checkpoint_saved(stuck, DateTime::from_millis(now - 600_000));
        metrics.checkpoint_saved(fresh, DateTime::from_millis(now - 1_000));
        // Read back from MongoDB later, an older write changes nothing.
        metrics.checkpoint_saved(fresh, DateTime::from_millis(now - 5_000));
        let age = value(&metrics, "outbox_checkpoint_age_seconds").expect("rendered");
        assert!(
            (600.0..610.0).contains(&age),
            "the stuck partition's: {age}"
        );
        let each = |index: u32| {
            let name = format!("outbox_partition_checkpoint_age_seconds{{partition=\"{index}\"}}");
            value(&metrics, &name).expect("rendered")
        };
        assert!(each(0) < 10.0, "{}", each(0));
        assert!(each(1) >= 600.0, "{}", each(1));
    }

    #[test]
    fn a_term_reading_its_held_keys_is_not_ready_to_deliver() {
        let metrics = Metrics::new();
        metrics.set_role(Role::Tailing);
        assert!(metrics.readiness().ready, "{:?}", metrics.readiness());
        let reading = metrics.reading_holds();
        let readiness = metrics.readiness();
        assert!(!readiness.ready);
        assert!(
            readiness
                .conditions
                .contains(&"delivery: starting: reading the held keys".to_owned()),
            "{readiness:?}"
        );
        drop(reading);
        assert!(metrics.readiness().ready);
    }

    #[test]
    fn readiness_connections_and_the_partition_count_are_rendered() {
        let metrics = Metrics::new();
        for kind in ["rejected", "exhausted"] {
            let failed = format!("outbox_failed_total{{kind=\"{kind}\"}}");
            assert_eq!(value(&metrics, &failed), Some(0.0), "{kind} from the start");
        }
        assert_eq!(value(&metrics, "outbox_ready"), Some(0.0));
        assert_eq!(value(&metrics, "outbox_partitions"), Some(0.0));
        let mongodb = "outbox_connected{server=\"mongodb\"}";
        assert_eq!(value(&metrics, mongodb), Some(1.0));
        metrics.set_role(Role::Standby);
        assert_eq!(value(&metrics, "outbox_ready"), Some(1.0));
        metrics.mongodb_reachable(true);
        metrics.mongodb_reachable(false);
        assert_eq!(value(&metrics, mongodb), Some(0.0));
        assert_eq!(value(&metrics, "outbox_ready"), Some(0.0));
        let third = Partition::new(2, 4).expect("a partition");
        metrics.partition_held(third, Some(7));
        assert_eq!(value(&metrics, "outbox_partitions"), Some(4.0));
        // A relay whose NATS client is the application's own says nothing
        // of NATS.
        assert!(!metrics.render().contains("server=\"nats\""));
    }

    #[test]
    fn held_keys_are_each_live_terms_and_go_with_the_term() {
        let metrics = Metrics::new();
        let (keys, age) = ("outbox_held_keys", "outbox_oldest_held_age_seconds");
        let first = metrics.held_keys_report();
        let second = metrics.held_keys_report();
        let minute_ago = DateTime::from_millis(DateTime::now().timestamp_millis() - 60_000);
        first.set(2, Some(minute_ago));
        second.set(3, Some(DateTime::now()));
        assert_eq!(value(&metrics, keys), Some(5.0), "the sum of the terms'");
        assert!(
            value(&metrics, age).is_some_and(|age| age >= 60.0),
            "the oldest wait"
        );
        drop(first);
        assert_eq!(value(&metrics, keys), Some(3.0), "a lost term's keys go");
        assert!(value(&metrics, age).is_some_and(|age| age < 60.0));
        drop(second);
        assert_eq!(value(&metrics, keys), Some(0.0));
        assert_eq!(
            value(&metrics, age),
            Some(0.0),
            "no age grows after the term"
        );
    }

    /// The sample scrape in docs/operating.md says each metric's help and
    /// type as the code does.
    #[test]
    fn the_operating_docs_sample_scrape_is_the_codes() {
        let docs = include_str!("../../docs/operating.md");
        let sample = docs
            .split("A sample scrape")
            .nth(1)
            .and_then(|rest| rest.split("```text").nth(1))
            .and_then(|block| block.split("```").next())
            .expect("docs/operating.md has a sample scrape");
        let metrics = Metrics::new();
        // A family with labels is described once it has a series.
        metrics.published(Origin::Stream, Duration::ZERO, false);
        let rendered = metrics.render();
        let described: Vec<&str> = rendered
            .lines()
            .filter(|line| line.starts_with("# HELP") || line.starts_with("# TYPE"))
            .collect();
        let wrong: Vec<&str> = sample
            .lines()
            .filter(|line| line.starts_with("# HELP") || line.starts_with("# TYPE"))
            .filter(|line| !described.contains(line))
            .collect();
        assert!(
            wrong.is_empty(),
            "not the code's:\n{}\n\nthe code's:\n{}",
            wrong.join("\n"),
            described.join("\n")
        );
    }
}
