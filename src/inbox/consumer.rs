//! The JetStream side of the inbox: a durable pull consumer whose messages
//! are handled through the inbox, many at once, each key's one at a time.
//!
//! - **Concurrency.** Up to `concurrency` transactions run at once. Messages
//!   that share an `Outbox-Key` wait in their key's line and are handled
//!   one at a time in stream order, so the relay's per-key order reaches the
//!   handler; messages without a key take no line.
//! - **Acknowledgement after the commit.** A message is acknowledged only
//!   once its transaction committed (or the inbox showed it handled
//!   before). A crash in between leads to a redelivery the inbox skips.
//! - **Failures.** A handler that returns an error is given another
//!   attempt after a growing delay: a message without a key is negatively
//!   acknowledged with that delay, and JetStream redelivers it; a keyed one
//!   is tried again in place, so the later messages of its key keep waiting
//!   behind it. Attempts are counted in the inbox record (`failing`
//!   between them), so a delivery that ran no handler costs none. After
//!   `max_deliveries` attempts the message is recorded `failed` in the
//!   inbox with the error, for a person to see, and terminated; its key's
//!   next message goes on. A count the inbox refuses to keep ends the
//!   message the same way, since nothing else would bound its attempts.
//! - **Held messages stay ours.** Every message read and not yet settled
//!   is kept from redelivery with in-progress acknowledgements, a third of
//!   the consumer's ack wait apart, however long it waits for its key or
//!   for a retry. How many are held is bounded: 16 places per concurrent
//!   transaction, past which the consumer reads no further. While a key's
//!   first message waits (for its record, or a retry) the messages behind
//!   it give their places up, so the other keys go on; all the messages
//!   held, with a place or without, are bounded at 8 places' worth, as is
//!   JetStream's `max_ack_pending` for a consumer created here.
//! - **A failure is the message's own unless MongoDB is unreachable.** A
//!   transaction the server refused (a validator, a handler that ended the
//!   transaction or swallowed an error that aborted it, transient errors
//!   past the drivers' limit) costs an attempt like a handler's error, and
//!   so does a handler that panics. Only a MongoDB that cannot be reached
//!   (down, electing, refusing this user) or starts no transaction charges
//!   none: the message waits,
//!   kept alive, until it answers, and an outage burns no attempts.
//! - **A held record holds up its message alone.** A record another
//!   transaction holds (a process killed mid-run leaves one until the server
//!   ends its transaction) answers the count before a run with a write
//!   conflict at once; the message waits without a transaction's place and
//!   is tried again, and nothing is counted.
//! - **Graceful shutdown, bounded.** On `shutdown` the consumer reads
//!   nothing more, finishes the transactions in flight and acknowledges
//!   them, and, once its last pull has ended, hands every other message it
//!   holds back to JetStream (a negative acknowledgement without delay, in
//!   stream order), so the consumer started next receives them before their
//!   keys' later messages. Past the shutdown timeout the transactions still
//!   running are abandoned (`stopping`), so `run` returns within
//!   [`Consumer::stop_bound`]. After a crash, the messages held wait out
//!   their ack wait instead (refreshed in the order they came, so they come
//!   back in it): a consumer started sooner may handle a key's later
//!   message first.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use bson::DateTime;
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::keep_alive::{keep_alive, Keeping, KeptEntry};
use super::record::{record_failed, record_failing, record_run, Counted, Entry};
use super::stopping::{self, LastWords, LAST_WORDS_WAIT};
use super::transaction::{Outcome, Transaction};
use super::{BoxedHandler, Delivery, Handler, HandlerError, Inbox};
use crate::contract::header;
use crate::error::{brief, is_unreachable, Error, Result};
use crate::retry::{self, reconnect_backoff, Outage};
use crate::stop::Stop;

/// Settings of a [`Consumer`]; [`ConsumerBuilder::bind`] creates or binds
/// the durable JetStream consumer.
pub struct ConsumerBuilder {
    inbox: Inbox,
    jetstream: jetstream::Context,
    stream: String,
    durable: Option<String>,
    filter_subject: Option<String>,
    settings: Settings,
    ack_wait: Duration,
}

#[derive(Clone)]
struct Settings {
    concurrency: usize,
    max_deliveries: u64,
    retry_initial_delay: Duration,
    retry_max_delay: Duration,
    after_commit: Option<AfterCommitHook>,
    shutdown_timeout: Duration,
}

/// What the consumer does once a message's transaction has committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommit {
    /// Acknowledge it, as always.
    Acknowledge,
    /// Leave it unacknowledged and let it go, as a process that crashed
    /// right after the commit would: JetStream redelivers it after the ack
    /// wait, and the inbox skips it. For fault-injection tests.
    Abandon,
}

/// Decides, per message, what happens after its commit.
pub type AfterCommitHook = Arc<dyn Fn(&Delivery) -> AfterCommit + Send + Sync>;

/// How much a consumer has left to handle, as JetStream counts it: for a
/// batch job that stops once it has caught up, or a test that waits for
/// it. Clones look at the same consumer.
#[derive(Clone)]
pub struct Backlog {
    pull: PullConsumer,
}

impl Backlog {
    /// Messages not yet done with: those JetStream has still to deliver,
    /// and those delivered but not acknowledged (being handled, or waiting
    /// to be tried again). A message handled, skipped as a repeat or given
    /// up on counts no more.
    pub async fn remaining(&self) -> Result<u64> {
        let mut pull = self.pull.clone();
        let name = self.pull.cached_info().name.clone();
        let info = pull
            .info()
            .await
            .map_err(|e| Error::nats(format!("reading consumer {name:?}'s state failed"), e))?;
        let unacknowledged = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
        Ok(info.num_pending.saturating_add(unacknowledged))
    }

    /// Returns once nothing is left ([`Backlog::remaining`] is 0), asking
    /// JetStream every `every`; a question NATS fails to answer (away a
    /// moment) is asked again. It waits as long as that takes: bound it
    /// with `tokio::time::timeout`. Messages published later are not waited
    /// for.
    pub async fn caught_up(&self, every: Duration) {
        loop {
            match self.remaining().await {
                Ok(0) => return,
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(error = %error, "reading the backlog failed; asking again");
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}

/// A bound consumer, ready to [`Consumer::run`].
pub struct Consumer {
    inbox: Inbox,
    nats: async_nats::Client,
    pull: PullConsumer,
    settings: Settings,
    ack_wait: Duration,
    /// The most messages one pull asks for.
    pull_limit: usize,
}

impl ConsumerBuilder {
    pub(super) fn new(inbox: Inbox, jetstream: jetstream::Context, stream: &str) -> Self {
        ConsumerBuilder {
            inbox,
            jetstream,
            stream: stream.to_owned(),
            durable: None,
            filter_subject: None,
            settings: Settings {
                concurrency: 16,
                max_deliveries: 5,
                retry_initial_delay: Duration::from_secs(1),
                retry_max_delay: Duration::from_secs(60),
                after_commit: None,
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            },
            ack_wait: Duration::from_secs(30),
        }
    }

    /// The durable consumer's name (default: the inbox consumer's name).
    pub fn durable(mut self, name: &str) -> Self {
        self.durable = Some(name.to_owned());
        self
    }

    /// Take only messages on subjects matching `subject` (a NATS pattern:
    /// `shop.order.*`, `shop.>`). Default: every subject of the stream.
    pub fn filter_subject(mut self, subject: &str) -> Self {
        self.filter_subject = Some(subject.to_owned());
        self
    }

    /// Transactions run at once (default 16).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// Attempts before a message is recorded failed and terminated
    /// (default 5).
    pub fn max_deliveries(mut self, attempts: u64) -> Self {
        self.settings.max_deliveries = attempts;
        self
    }

    /// Delay after the first failed attempt, doubling up to `max`
    /// (default 1 s, up to 60 s).
    pub fn retry_delay(mut self, initial: Duration, max: Duration) -> Self {
        self.settings.retry_initial_delay = initial;
        self.settings.retry_max_delay = max;
        self
    }

    /// Decide after each commit whether the message is acknowledged (see
    /// [`AfterCommit`]); for fault-injection tests.
    pub fn after_commit(mut self, hook: AfterCommitHook) -> Self {
        self.settings.after_commit = Some(hook);
        self
    }

    /// How long the transactions in flight may take to finish once
    /// `shutdown` fires (default 10 s); past it they are abandoned, and
    /// [`Consumer::run`] returns within [`Consumer::stop_bound`].
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.settings.shutdown_timeout = timeout;
        self
    }

    /// How long JetStream waits for an acknowledgement before it
    /// redelivers, for a consumer this creates (default 30 s).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Checks the settings, then binds the durable consumer, creating it
    /// if it does not exist (an existing one keeps its own settings).
    pub async fn bind(self) -> Result<Consumer> {
        self.check()?;
        // Before a consumer is created with this ack wait.
        self.check_retention(self.ack_wait)?;
        let durable = self
            .durable
            .clone()
            .unwrap_or_else(|| self.inbox.name().to_owned());
        let stream = self.jetstream.get_stream(&self.stream).await.map_err(|e| {
            Error::nats(
                format!(
                    "reading stream {:?} failed (does it exist, and may this user read it?)",
                    self.stream
                ),
                e,
            )
        })?;
        let config = pull::Config {
            durable_name: Some(durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // The inbox counts attempts and records the last one failed;
            // JetStream's own limit would end a message silently.
            max_deliver: -1,
            max_ack_pending: i64::try_from(self.held_limit().saturating_mul(PENDING_PER_PLACE))
                .unwrap_or(i64::MAX),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        let pull: PullConsumer = stream
            .get_or_create_consumer(&durable, config)
            .await
            .map_err(|e| {
                Error::nats(
                    format!(
                        "creating or binding consumer {durable:?} on {:?} failed",
                        self.stream
                    ),
                    e,
                )
            })?;
        self.check_existing(&durable, &pull.cached_info().config)?;
        self.warn_of_fewer_pending(&durable, pull.cached_info().config.max_ack_pending);
        let ack_wait = pull.cached_info().config.ack_wait;
        self.check_retention(ack_wait)?;
        let pull_limit = pull_limit(self.held_limit(), &pull.cached_info().config);
        let nats = self.jetstream.client();
        Ok(Consumer {
            inbox: self.inbox,
            nats,
            pull,
            ack_wait,
            pull_limit,
            settings: self.settings,
        })
    }

    /// A record must outlast any redelivery of its message: one after the
    /// ack wait (a crash between commit and acknowledgement), plus the TTL
    /// monitor's minute.
    fn check_retention(&self, ack_wait: Duration) -> Result<()> {
        match self.inbox.retention {
            Some(retention) if retention < ack_wait + Duration::from_secs(60) => {
                Err(Error::Config(format!(
                    "inbox consumer: the inbox's retention ({}) must exceed the ack wait ({}) by \
                     a minute at least, or a message redelivered after a crash would be handled \
                     again",
                    humantime::format_duration(retention),
                    humantime::format_duration(ack_wait)
                )))
            }
            _ => Ok(()),
        }
    }

    fn check(&self) -> Result<()> {
        let settings = &self.settings;
        let problem = if settings.concurrency == 0 {
            Some("concurrency must be at least 1")
        } else if settings.max_deliveries == 0 {
            Some("max_deliveries must be at least 1")
        } else if settings.retry_initial_delay.is_zero()
            || settings.retry_max_delay < settings.retry_initial_delay
        {
            Some("retry delays must be above zero, the longest no shorter than the first")
        } else if self.ack_wait < Duration::from_secs(1) {
            Some("ack_wait must be at least 1s")
        } else if self.stream.is_empty() {
            Some("the stream's name must not be empty")
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::Config(format!("inbox consumer: {problem}"))),
            None => Ok(()),
        }
    }

    /// A consumer that existed keeps its own settings; refuses those the
    /// inbox cannot work with.
    fn check_existing(&self, durable: &str, config: &jetstream::consumer::Config) -> Result<()> {
        let wanted = self.filter_subject.as_deref().unwrap_or("");
        let problem = if config.ack_policy != AckPolicy::Explicit {
            Some(format!(
                "acknowledges {:?}, not each message explicitly, so a message would count as \
                 handled before its commit",
                config.ack_policy
            ))
        } else if config.filter_subject != wanted || !config.filter_subjects.is_empty() {
            Some(format!(
                "filters subjects {:?}, not {wanted:?}",
                if config.filter_subjects.is_empty() {
                    vec![config.filter_subject.clone()]
                } else {
                    config.filter_subjects.clone()
                }
            ))
        } else if config.max_deliver > 0 {
            // Deliveries are not attempts: a hand-back at shutdown or an
            // ack wait run out takes one too.
            Some(format!(
                "ends a message after {} deliveries itself, silently, where the inbox records \
                 it failed",
                config.max_deliver
            ))
        } else if !config.max_expires.is_zero() && config.max_expires < PULL_EXPIRES {
            Some(format!(
                "refuses pulls that wait longer than {:?}; the inbox's wait {PULL_EXPIRES:?}",
                config.max_expires
            ))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::Config(format!(
                "the existing JetStream consumer {durable:?} on {:?} {problem}; delete it \
                 (nats consumer rm) to have it created anew, or name another with durable()",
                self.stream
            ))),
            None => Ok(()),
        }
    }

    fn held_limit(&self) -> usize {
        self.settings.held_limit()
    }

    /// An existing consumer that lets JetStream deliver fewer messages
    /// unacknowledged than this one may hold stops delivering sooner while
    /// a key waits, and every key waits with it.
    fn warn_of_fewer_pending(&self, durable: &str, max_ack_pending: i64) {
        let room = self.held_limit().saturating_mul(PENDING_PER_PLACE);
        if usize::try_from(max_ack_pending).is_ok_and(|pending| pending > 0 && pending < room) {
            tracing::warn!(
                durable,
                max_ack_pending,
                room,
                "the existing JetStream consumer delivers at most max_ack_pending messages \
                 unacknowledged: a key that waits on its record or a retry holds every other \
                 key up once its messages fill that; raise it (nats consumer edit) to the room \
                 this consumer has"
            );
        }
    }
}

impl Settings {
    /// How many messages may be held (read and not yet settled) at once.
    fn held_limit(&self) -> usize {
        self.concurrency.saturating_mul(HELD_PER_TRANSACTION)
    }
}

/// The most messages one pull may ask for: a place for each among the
/// held, and no more than the consumer's own `max_batch`.
fn pull_limit(held_limit: usize, config: &jetstream::consumer::Config) -> usize {
    match usize::try_from(config.max_batch) {
        Ok(max_batch) if max_batch > 0 => held_limit.min(max_batch),
        _ => held_limit,
    }
}

/// Messages held per concurrent transaction: the look-ahead that lets other
/// keys go on while one key's line is long.
const HELD_PER_TRANSACTION: usize = 16;

/// JetStream's bound on the messages a consumer created here has
/// unacknowledged (`max_ack_pending`), per place among the held: room for
/// the messages behind keys that wait, which hold no place (see [`Line`]).
const PENDING_PER_PLACE: usize = 8;

impl Consumer {
    /// How much this consumer has left: take it before [`Consumer::run`],
    /// to learn while it runs when it has caught up.
    pub fn backlog(&self) -> Backlog {
        Backlog {
            pull: self.pull.clone(),
        }
    }

    /// The longest [`Consumer::run`] takes to return once `shutdown` fires:
    /// the shutdown timeout, then at most [`LAST_WORDS_WAIT`] to hand
    /// messages back and send the last acknowledgements.
    pub fn stop_bound(&self) -> Duration {
        self.settings
            .shutdown_timeout
            .saturating_add(LAST_WORDS_WAIT)
    }

    /// Handles messages until `shutdown` fires, then stops within
    /// [`Consumer::stop_bound`] (the shutdown timeout, 10 s by default,
    /// plus 5 s), whatever MongoDB or NATS do meanwhile: it reads nothing
    /// more, finishes the transactions in flight and acknowledges them,
    /// and hands every other message it holds back to JetStream. Past the
    /// shutdown timeout the transactions still running are abandoned (a
    /// MongoDB that stopped answering, say), nothing is handed back, and
    /// every message held comes back after its ack wait, as after a crash:
    /// it returns [`Error::ShutdownTimeout`] then, and also when NATS did
    /// not take the hand-back and last acknowledgements in 5 s (those
    /// messages come back the same way). Returns an error as well if
    /// JetStream ends the consumer (deleted).
    pub async fn run<H: Handler>(self, handler: H, shutdown: CancellationToken) -> Result<()> {
        let held_limit = self.settings.held_limit();
        let shutdown_timeout = self.settings.shutdown_timeout;
        // Fired by `shutdown`, and also when the consumer ends on its own
        // (deleted), so its tasks stop then too, within the same bound.
        let ending = shutdown.child_token();
        let stop = Stop::after_grace(ending.clone(), shutdown_timeout);
        let shared = Arc::new(Shared {
            client: self.inbox.collection().client().clone(),
            inbox: self.inbox,
            nats: self.nats,
            handler: Box::new(handler),
            running: Semaphore::new(self.settings.concurrency),
            settings: self.settings,
            lanes: Mutex::default(),
            keeping: Arc::new(Keeping::default()),
            handed_back: Mutex::default(),
            shutdown: ending,
        });
        let holding = Arc::new(Semaphore::new(held_limit));
        let room = Arc::new(Semaphore::new(held_limit.saturating_mul(PENDING_PER_PLACE)));
        let keeper_stop = CancellationToken::new();
        let keeper = tokio::spawn(keep_alive(
            shared.keeping.clone(),
            shared.nats.clone(),
            self.ack_wait,
            keeper_stop.clone(),
        ));
        // However `run` ends (its future dropped included), nothing is kept
        // alive after it: what it held goes back to JetStream by ack wait.
        let _release = Release {
            shared: shared.clone(),
            keeper_stop: keeper_stop.clone(),
            abandon: stop.abandon.clone(),
        };
        let mut tasks = JoinSet::new();
        let pulling = Pulling {
            pull: &self.pull,
            limit: self.pull_limit,
            holding: &holding,
            room: &room,
        };
        let outcome = tokio::select! {
            outcome = pulling.until(&shared, &mut tasks, &shutdown) => outcome,
            // A pull NATS never ends.
            _ = stop.abandon.cancelled() => Ok(()),
        };
        shared.shutdown.cancel();
        let finished = stopping::finish(&mut tasks, &stop.abandon).await;
        let said = stopping::last_words(&shared, finished).await;
        keeper_stop.cancel();
        // A keeper stuck in a publish to a NATS that does not take it.
        keeper.abort();
        let _ = keeper.await;
        match (outcome, finished, said) {
            (Err(error), _, _) => Err(error),
            (Ok(()), stopping::Finished::All, LastWords::Said) => Ok(()),
            (Ok(()), stopping::Finished::Abandoned, _) | (Ok(()), _, LastWords::CutShort) => {
                Err(Error::ShutdownTimeout(shutdown_timeout))
            }
        }
    }
}

/// The pause before a message whose record another transaction held is
/// tried again: a dead process's transaction holds it until the server
/// ends it (60 s on MongoDB), a live copy's for a moment.
const RECORD_HELD_PAUSE: Duration = Duration::from_secs(1);

/// How long one try of a record write outside a transaction may take.
const RECORD_WRITE_WAIT: Duration = Duration::from_secs(5);

/// How long the consumer waits for the transactions in flight once
/// `shutdown` fires, unless told otherwise: the relay's default too.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// Ends the keeping alive of a consumer's messages when it is dropped, and
/// lets go of what it still held (the shared state may outlive the run in a
/// task abandoned and not yet dropped, and its held messages with it).
struct Release {
    shared: Arc<Shared>,
    keeper_stop: CancellationToken,
    /// Fired here too, so the timer waiting to fire it ends with the run.
    abandon: CancellationToken,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.keeper_stop.cancel();
        self.abandon.cancel();
        self.shared.shutdown.cancel();
        drop(std::mem::take(
            &mut *self
                .shared
                .handed_back
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        ));
        self.shared.lock_lanes().clear();
    }
}

/// Reads messages from the durable consumer: pulls no larger than its
/// limit, each with a free place among the held for every message, and
/// room among all those kept.
struct Pulling<'a> {
    pull: &'a PullConsumer,
    limit: usize,
    holding: &'a Arc<Semaphore>,
    /// Every message held, with a place or waiting behind a key that waits
    /// without one: as many as a consumer created here lets JetStream
    /// deliver unacknowledged, whatever an existing one lets it.
    room: &'a Arc<Semaphore>,
}

impl Pulling<'_> {
    /// Reads messages and hands them out until shutdown, or until the consumer
    /// ends. Each pull asks for as many messages as there are free places
    /// among the held, so every message JetStream sends is held, and kept
    /// alive, from the moment it arrives: none waits unseen in a client buffer
    /// while its ack wait runs out.
    async fn until(
        &self,
        shared: &Arc<Shared>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) -> Result<()> {
        let mut outage = Outage::new("NATS consumer");
        loop {
            let Some(mut shares) = self.free_places(shutdown).await else {
                return Ok(());
            };
            let batch = self
                .pull
                .batch()
                .max_messages(shares.len())
                .expires(PULL_EXPIRES)
                .messages()
                .await;
            let mut batch = match batch {
                Ok(batch) => batch,
                Err(error) => {
                    outage.failed(&error);
                    drop(shares);
                    if !pause_unless(shutdown, Duration::from_millis(100)).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            // The batch ends when full or when its pull expires; stopping, what
            // still comes is kept to be handed back.
            while let Some(next) = batch.next().await {
                match next {
                    Ok(message) => {
                        outage.recovered();
                        let Some(share) = shares.pop() else {
                            // More than was asked for: JetStream redelivers it.
                            continue;
                        };
                        let held = shared.hold(message, share);
                        if shutdown.is_cancelled() {
                            shared.keep_for_handing_back([held]);
                        } else {
                            shared.dispatch(held, tasks);
                        }
                    }
                    Err(error) => {
                        outage.failed(&error);
                        if !pause_unless(shutdown, Duration::from_millis(100)).await {
                            return Ok(());
                        }
                        check_exists(self.pull).await?;
                        break;
                    }
                }
            }
            // Reap what finished, so the set holds only what runs.
            while tasks.try_join_next().is_some() {}
        }
    }

    /// The free places among the held, each with its room, at least one
    /// (waited for), at most one pull's worth. None once the consumer stops.
    async fn free_places(&self, shutdown: &CancellationToken) -> Option<Vec<Share>> {
        let first = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            share = async {
                let place = self.holding.clone().acquire_owned().await.ok()?;
                let room = self.room.clone().acquire_owned().await.ok()?;
                Some(Share { place: Some(place), _room: room })
            } => share?,
        };
        let mut shares = vec![first];
        while shares.len() < self.limit {
            let (Ok(place), Ok(room)) = (
                self.holding.clone().try_acquire_owned(),
                self.room.clone().try_acquire_owned(),
            ) else {
                break;
            };
            shares.push(Share {
                place: Some(place),
                _room: room,
            });
        }
        Some(shares)
    }
}

/// A held message's share of the consumer's bounds, given back as it is
/// dropped: its place among the held, given up early while it waits
/// behind a key that waits (see [`Line`]), and its room among all the
/// messages kept.
struct Share {
    place: Option<OwnedSemaphorePermit>,
    _room: OwnedSemaphorePermit,
}

impl Share {
    fn give_up_place(&mut self) {
        self.place = None;
    }
}

/// How long one pull waits for messages before it is renewed; what the
/// consumer's shutdown may wait for the last pull's messages to come in.
const PULL_EXPIRES: Duration = Duration::from_secs(1);

/// Waits `delay`; false if `shutdown` fires first.
async fn pause_unless(shutdown: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(delay) => true,
    }
}

/// After a failed pull: an error if the consumer (or its stream) no longer
/// exists, which no retry mends.
async fn check_exists(pull: &PullConsumer) -> Result<()> {
    use async_nats::jetstream::context::ConsumerInfoErrorKind;
    match pull.get_info().await {
        Err(error)
            if matches!(
                error.kind(),
                ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
            ) =>
        {
            Err(Error::nats(
                "the JetStream consumer or its stream was deleted; the consumer stops",
                error,
            ))
        }
        _ => Ok(()),
    }
}

/// What the consumer's tasks share.
pub(super) struct Shared {
    inbox: Inbox,
    client: mongodb::Client,
    pub(super) nats: async_nats::Client,
    handler: Box<dyn BoxedHandler>,
    settings: Settings,
    /// One permit per transaction running.
    running: Semaphore,
    /// Each key's line, while a task works through it.
    lanes: Mutex<HashMap<String, Line>>,
    /// The held messages kept from redelivery, shared with the keeper.
    keeping: Arc<Keeping>,
    /// Held messages left as the consumer stops, handed back to JetStream
    /// once nothing more can arrive (see [`Shared::hand_back`]).
    handed_back: Mutex<Vec<Held>>,
    shutdown: CancellationToken,
}

/// A message read and not yet settled.
struct Held {
    message: jetstream::Message,
    delivery: Delivery,
    /// JetStream's deliveries of it, this one included.
    delivered: u64,
    /// Whether a run of the handler on it ended while it was held.
    ran: bool,
    /// The count of the run about to begin, once the record took it.
    counted: Option<u64>,
    share: Share,
    _kept: KeptEntry,
}

impl Held {
    /// The handler ran: the next run is counted anew.
    fn run_ended(&mut self) {
        self.ran = true;
        self.counted = None;
    }
}

/// The messages of a key waiting behind the one its task handles.
///
/// While that first message waits (its record held by another
/// transaction, or a retry's delay), the messages behind it give up their
/// places among the held, and so does each that joins them: a key that
/// waits takes at most one place (its first message's, if that one had
/// kept its own), and the other keys go on. They are still kept alive in
/// the order they came, so after a crash they come back in it. What bounds
/// them then is their room among all the messages held (8 places' worth),
/// and JetStream's `max_ack_pending`.
#[derive(Default)]
struct Line {
    waiting: VecDeque<Held>,
    first: First,
}

/// What the first message of a key's line is doing.
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum First {
    /// Being handled: the messages behind keep their places.
    #[default]
    Handled,
    /// Waiting for its record or for a retry: those behind give theirs up.
    Waits,
}

impl Line {
    /// Puts a message at the back of the line.
    fn join(&mut self, mut held: Held) {
        if self.first == First::Waits {
            held.share.give_up_place();
        }
        self.waiting.push_back(held);
    }

    fn first_now(&mut self, first: First) {
        self.first = first;
        if first == First::Waits {
            for held in &mut self.waiting {
                held.share.give_up_place();
            }
        }
    }
}

/// A key's line while a task works through it. Dropped however the task
/// ends (a panic included), it removes the line, so the key's next message
/// starts a task of its own rather than waiting behind none.
struct Lane {
    shared: Arc<Shared>,
    key: String,
    /// Removed already: the key may have a new line, not this one's.
    closed: bool,
}

impl Lane {
    /// The line's next message; none closes the line, under the same lock,
    /// so a message dispatched after it starts a new one.
    fn next(&mut self) -> Option<Held> {
        let mut lanes = self.shared.lock_lanes();
        let next = lanes
            .get_mut(&self.key)
            .and_then(|line| line.waiting.pop_front());
        if next.is_none() {
            lanes.remove(&self.key);
            self.closed = true;
        }
        next
    }

    /// Closes the line, returning what waited in it, in order.
    fn close(&mut self) -> VecDeque<Held> {
        if self.closed {
            return VecDeque::new();
        }
        self.closed = true;
        self.shared
            .lock_lanes()
            .remove(&self.key)
            .map(|line| line.waiting)
            .unwrap_or_default()
    }
}

impl Drop for Lane {
    /// Only if its task ended unexpectedly (a panic, or the consumer's
    /// future dropped): what waited goes back to JetStream by its ack wait.
    fn drop(&mut self) {
        drop(self.close());
    }
}

/// How handling a message ended, for its acknowledgement.
enum Settled {
    Acknowledged,
    /// Left unacknowledged: the consumer is stopping.
    Left,
}

/// How writing a record outside a transaction ended.
enum Written {
    Done,
    /// Refused for what it is (a validator, say): no retry writes it.
    Refused(String),
    /// The consumer stopped while MongoDB could not be reached.
    Stopped,
}

impl Shared {
    fn lock_lanes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Line>> {
        // The lines hold messages only; a panic elsewhere leaves them whole.
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A message just read, held: kept alive, in its place among the held.
    fn hold(&self, message: jetstream::Message, share: Share) -> Held {
        let delivery = read_delivery(&message);
        tracing::trace!(
            stream_sequence = delivery.stream_sequence,
            delivered = delivery.attempt,
            key = delivery.key.as_deref().unwrap_or(""),
            "received"
        );
        let kept = self.keeping.keep(&message, delivery.key.is_some());
        Held {
            message,
            delivered: delivery.attempt,
            ran: false,
            counted: None,
            delivery,
            share,
            _kept: kept,
        }
    }

    /// Puts a message in its key's line, or in a task of its own.
    fn dispatch(self: &Arc<Self>, held: Held, tasks: &mut JoinSet<()>) {
        let Some(key) = held.delivery.key.clone() else {
            let shared = self.clone();
            tasks.spawn(async move {
                shared.handle(held, false).await;
            });
            return;
        };
        let mut lanes = self.lock_lanes();
        match lanes.get_mut(&key) {
            Some(line) => line.join(held),
            None => {
                lanes.insert(key.clone(), Line::default());
                tasks.spawn(self.clone().work_through(key, held));
            }
        }
    }

    /// Keeps messages left as the consumer stops, to be handed back.
    fn keep_for_handing_back(&self, held: impl IntoIterator<Item = Held>) {
        let mut handed_back = self.handed_back.lock().unwrap_or_else(|e| e.into_inner());
        handed_back.extend(held);
    }

    /// Hands every message left back to JetStream (a negative
    /// acknowledgement without delay) in stream order, so that each key's
    /// come back in its order, ahead of its later messages. Run once no
    /// pull is open: a pull still open would take a message handed back
    /// ahead of those handed back after it.
    pub(super) async fn hand_back(&self) {
        let mut left =
            std::mem::take(&mut *self.handed_back.lock().unwrap_or_else(|e| e.into_inner()));
        left.sort_by_key(|held| held.delivery.stream_sequence);
        for held in left {
            acknowledge(&held.message, AckKind::Nak(None)).await;
        }
    }

    /// Handles a key's messages one after another, in the order they came,
    /// until its line is empty. Stopping, it hands what waits in the line
    /// back to JetStream in that order, so that a consumer started next
    /// receives them before the key's later messages.
    async fn work_through(self: Arc<Self>, key: String, first: Held) {
        let mut lane = Lane {
            shared: self.clone(),
            key,
            closed: false,
        };
        let mut next = Some(first);
        while let Some(held) = next {
            // Its later messages wait, so a failed attempt is tried again
            // in place.
            if let Settled::Left = self.clone().handle(held, true).await {
                self.keep_for_handing_back(lane.close());
                return;
            }
            next = lane.next();
        }
    }

    /// Handles one message to its end: acknowledged (handled, a repeat, or
    /// given up on and terminated), negatively acknowledged for a later
    /// attempt, or kept to be handed back as the consumer stops. `in_place`: a
    /// failed attempt is tried again here, not redelivered.
    async fn handle(self: Arc<Self>, mut held: Held, in_place: bool) -> Settled {
        let settled = self.settle(&mut held, in_place).await;
        if let Settled::Left = settled {
            self.keep_for_handing_back([held]);
        }
        settled
    }

    async fn settle(&self, held: &mut Held, in_place: bool) -> Settled {
        let consumer = self.inbox.name().to_owned();
        let metrics = self.inbox.metrics().clone();
        let mut outage = Outage::new("MongoDB inbox");
        let mut backoff = reconnect_backoff();
        loop {
            if self.shutdown.is_cancelled() {
                return Settled::Left;
            }
            let Some(outcome) = self.attempt(held).await else {
                return Settled::Left;
            };
            match outcome.charged() {
                Outcome::Committed { handler_time } => {
                    outage.recovered();
                    metrics.handled(&consumer, handler_time);
                    if let Some(hook) = &self.settings.after_commit {
                        let hook =
                            std::panic::catch_unwind(AssertUnwindSafe(|| hook(&held.delivery)));
                        if hook.unwrap_or(AfterCommit::Acknowledge) == AfterCommit::Abandon {
                            return Settled::Acknowledged;
                        }
                    }
                    acknowledge(&held.message, AckKind::Ack).await;
                    return Settled::Acknowledged;
                }
                Outcome::Repeat => {
                    outage.recovered();
                    metrics.repeat(&consumer);
                    acknowledge(&held.message, AckKind::Ack).await;
                    return Settled::Acknowledged;
                }
                Outcome::Failed(error) => {
                    outage.recovered();
                    held.run_ended();
                    if let Some(settled) = self.after_failure(held, error, in_place).await {
                        return settled;
                    }
                }
                // Nothing ran and nothing was counted: the message waits
                // without a transaction's place, so that the others go on.
                Outcome::Busy => {
                    outage.recovered();
                    if let Some(settled) = self.wait_for_record(held, in_place).await {
                        return settled;
                    }
                }
                Outcome::Spent(reason) => {
                    outage.recovered();
                    if !self.give_up(held, &reason).await {
                        return Settled::Left;
                    }
                    metrics.failed(&consumer);
                    return Settled::Acknowledged;
                }
                // MongoDB could not be reached, or started no transaction:
                // no attempt is charged; the message waits here, kept
                // alive, until MongoDB answers.
                Outcome::Mongo(error) | Outcome::Unavailable(error) => {
                    outage.failed(&brief(&error));
                    if !retry::pause(&mut backoff, &self.shutdown).await {
                        return Settled::Left;
                    }
                }
            }
        }
    }

    /// One transaction for `delivery`, within the concurrency limit.
    /// None if the consumer stops first: a message waiting for its turn
    /// starts no transaction then.
    async fn attempt(&self, held: &mut Held) -> Option<Outcome> {
        let _running = tokio::select! {
            biased;
            _ = self.shutdown.cancelled() => return None,
            running = self.running.acquire() => running.ok()?,
        };
        if self.shutdown.is_cancelled() {
            return None;
        }
        let counted = match self.count_run(held).await {
            Ok(counted) => counted,
            Err(outcome) => return Some(outcome),
        };
        let transaction = Transaction {
            client: &self.client,
            inbox: self.inbox.collection(),
            retention: self.inbox.retention,
            max_runs: self.settings.max_deliveries,
            handler_began: AtomicBool::new(false),
        };
        let outcome = transaction
            .run(
                self.handler.as_ref(),
                &mut held.delivery,
                self.inbox.name(),
                counted,
            )
            .await;
        // A run that began and ended in an outage is counted like any
        // other: the next one is counted anew, so a handler whose writes
        // bring MongoDB down is still bounded.
        if transaction.handler_began.load(Ordering::Relaxed) {
            held.run_ended();
        }
        Some(outcome)
    }

    /// Counts the run about to begin, before it begins, where the record
    /// does not count it itself (see `record`): the run's count, or none
    /// where its transaction counts it. Counted once per run, however
    /// often an outage makes it wait. An outcome instead where no run is
    /// to begin: MongoDB unreachable (which charges nothing), the count
    /// past the limit, or a count the inbox refuses to keep (else nothing
    /// would bound the runs).
    async fn count_run(&self, held: &mut Held) -> std::result::Result<Option<u64>, Outcome> {
        let limit = self.settings.max_deliveries;
        let Some(entry) = Entry::of(self.inbox.name(), &held.delivery) else {
            // No record: JetStream's deliveries bound a handler that ends
            // its process.
            return match held.delivered > limit {
                true => Err(Outcome::Spent(format!(
                    "JetStream delivered it {} times with no result, more than max_deliveries \
                     (without a message id, deliveries are its only count)",
                    held.delivered
                ))),
                false => Ok(None),
            };
        };
        if held.counted.is_none() && (held.delivered > 1 || held.ran) {
            // Not cut short client-side: a count given up on may still
            // commit, and the next would count the same run again. Its
            // commit is sent again while its result is unknown instead,
            // which the server answers once.
            let counted = record_run(self.inbox.collection(), &entry, DateTime::now()).await;
            held.counted = match counted {
                // Handled meanwhile: the transaction finds it a repeat.
                Ok(Counted::Handled) => Some(0),
                Ok(Counted::Held) => return Err(Outcome::Busy),
                Ok(Counted::Before(before)) if !before.allows_a_run(limit) => {
                    held.delivery.attempt = before.runs;
                    return Err(Outcome::refused(&before));
                }
                Ok(Counted::Before(before)) => Some(before.runs.saturating_add(1)),
                Err(error) if is_unreachable(&error) => return Err(Outcome::Mongo(error)),
                Err(error) => {
                    return Err(Outcome::Spent(format!(
                        "the inbox refused to count its runs: {}",
                        brief(&error)
                    )))
                }
            };
        }
        match held.counted {
            Some(0) | None => Ok(None),
            Some(runs) => {
                held.delivery.attempt = runs;
                Ok(Some(runs))
            }
        }
    }

    /// After a failed attempt (numbered by the inbox record, where the
    /// message has one): the message is tried again, later or here when
    /// `in_place` (None: the caller loops), or given up on after its last
    /// attempt, or when its count cannot be kept (else nothing would bound
    /// its attempts).
    async fn after_failure(
        &self,
        held: &mut Held,
        error: HandlerError,
        in_place: bool,
    ) -> Option<Settled> {
        let consumer = self.inbox.name();
        let attempt = held.delivery.attempt;
        let mut reason = error.to_string();
        if attempt < self.settings.max_deliveries {
            match self.count_failure(held, &reason).await {
                Written::Done => return self.try_again(held, &error, in_place).await,
                Written::Stopped => return Some(Settled::Left),
                Written::Refused(refusal) => {
                    reason = format!("{reason}; and counting the attempt was refused: {refusal}");
                }
            }
        }
        if !self.give_up(held, &reason).await {
            return Some(Settled::Left);
        }
        self.inbox.metrics().failed(consumer);
        Some(Settled::Acknowledged)
    }

    /// A message whose record another transaction holds (see
    /// [`Outcome::Busy`]) is tried again after a pause: here when
    /// `in_place`, its key's later messages waiting behind it, else by
    /// JetStream's redelivery after that delay (None: the caller loops).
    async fn wait_for_record(&self, held: &Held, in_place: bool) -> Option<Settled> {
        tracing::info!(
            consumer = self.inbox.name(),
            subject = %held.delivery.subject,
            stream_sequence = held.delivery.stream_sequence,
            "the message's inbox record is held by another transaction; trying again later"
        );
        if !in_place {
            acknowledge(&held.message, AckKind::Nak(Some(RECORD_HELD_PAUSE))).await;
            return Some(Settled::Acknowledged);
        }
        if !self.wait_in_line(held, RECORD_HELD_PAUSE).await {
            return Some(Settled::Left);
        }
        None
    }

    /// Tries a failed message again after a growing delay: here, or by
    /// JetStream's redelivery.
    async fn try_again(
        &self,
        held: &mut Held,
        error: &HandlerError,
        in_place: bool,
    ) -> Option<Settled> {
        let consumer = self.inbox.name();
        self.inbox.metrics().retried(consumer);
        let attempt = held.delivery.attempt;
        let delay = self.retry_delay(attempt);
        tracing::warn!(
            consumer,
            subject = %held.delivery.subject,
            attempt,
            error = %error,
            ?delay,
            "handling failed; trying again later"
        );
        if !in_place {
            acknowledge(&held.message, AckKind::Nak(Some(delay))).await;
            return Some(Settled::Acknowledged);
        }
        if !self.wait_in_line(held, delay).await {
            return Some(Settled::Left);
        }
        held.delivery.attempt += 1;
        None
    }

    /// Keeps the failed attempt's count in the message's record, for the
    /// next attempt, whoever makes it, to count on.
    async fn count_failure(&self, held: &Held, reason: &str) -> Written {
        let Some(entry) = Entry::of(self.inbox.name(), &held.delivery) else {
            return Written::Done;
        };
        let inbox = self.inbox.collection();
        self.write_record(|| record_failing(inbox, &entry, reason, DateTime::now()))
            .await
    }

    /// Records the message failed and terminates it. False if MongoDB kept
    /// the record from being written before the consumer stopped (the
    /// message is then left for a redelivery).
    async fn give_up(&self, held: &Held, reason: &str) -> bool {
        let delivery = &held.delivery;
        tracing::error!(
            consumer = self.inbox.name(),
            subject = %delivery.subject,
            message_id = delivery.message_id.as_deref().unwrap_or(""),
            attempts = delivery.attempt,
            error = reason,
            "handler failed on every attempt: recorded failed in the inbox and terminated"
        );
        if let Some(entry) = Entry::of(self.inbox.name(), delivery) {
            let (inbox, retention) = (self.inbox.collection(), self.inbox.retention);
            let written = self
                .write_record(|| record_failed(inbox, &entry, reason, DateTime::now(), retention))
                .await;
            match written {
                Written::Done => {}
                Written::Stopped => return false,
                // Refused for what it is (a validator on the inbox, say):
                // no retry can write it, and the log above keeps the
                // message's subject and sequence.
                Written::Refused(refusal) => tracing::error!(
                    consumer = self.inbox.name(),
                    stream_sequence = delivery.stream_sequence,
                    error = %refusal,
                    "recording the message failed was refused; terminated unrecorded"
                ),
            }
        }
        acknowledge(&held.message, AckKind::Term).await;
        true
    }

    /// Writes a record outside any transaction, waiting out an outage of
    /// MongoDB (which charges no message), until the consumer stops. Each
    /// try is bounded: a record another transaction holds holds such a
    /// write until that one ends (for ever on some servers), and the try is
    /// made again after a pause. Such a write is not taken back by the
    /// server, and may land later; these writes can (a count only rises,
    /// and a status written twice is the same status).
    async fn write_record<F, Fut>(&self, write: F) -> Written
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = mongodb::error::Result<()>>,
    {
        let mut backoff = reconnect_backoff();
        let mut outage = Outage::new("MongoDB inbox");
        loop {
            let problem = match tokio::time::timeout(RECORD_WRITE_WAIT, write()).await {
                Ok(Ok(())) => return Written::Done,
                Ok(Err(error)) if is_unreachable(&error) => brief(&error),
                Ok(Err(error)) => return Written::Refused(brief(&error)),
                Err(_) => format!(
                    "a record write took longer than {RECORD_WRITE_WAIT:?} (its record held by \
                     another transaction?)"
                ),
            };
            outage.failed(&problem);
            if !retry::pause(&mut backoff, &self.shutdown).await {
                return Written::Stopped;
            }
        }
    }

    /// The delay after failed attempt `attempt`: doubling from the first,
    /// up to the longest.
    fn retry_delay(&self, attempt: u64) -> Duration {
        let doublings = u32::try_from(attempt.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .min(31);
        let delay = self
            .settings
            .retry_initial_delay
            .saturating_mul(1u32 << doublings);
        delay.min(self.settings.retry_max_delay)
    }

    /// Waits `delay` before a keyed message is tried again in its line; the
    /// messages behind it give up their places meanwhile (see [`Line`]).
    /// False if the consumer stops first.
    async fn wait_in_line(&self, held: &Held, delay: Duration) -> bool {
        self.first_of_line(held, First::Waits);
        let waited = self.pause(delay).await;
        self.first_of_line(held, First::Handled);
        waited
    }

    fn first_of_line(&self, held: &Held, first: First) {
        if let Some(key) = &held.delivery.key {
            if let Some(line) = self.lock_lanes().get_mut(key) {
                line.first_now(first);
            }
        }
    }

    /// Waits `delay`; false if the consumer stops first.
    async fn pause(&self, delay: Duration) -> bool {
        pause_unless(&self.shutdown, delay).await
    }
}

/// Sends an acknowledgement; one that is lost leads to a redelivery, which
/// the inbox recognises, so a failure is only logged.
async fn acknowledge(message: &jetstream::Message, kind: AckKind) {
    if let Err(error) = message.ack_with(kind).await {
        tracing::warn!(error = %error, "acknowledging a message failed; JetStream will redeliver it");
    }
}

/// What the handler sees of a JetStream message.
fn read_delivery(message: &jetstream::Message) -> Delivery {
    let headers: Vec<(String, String)> = message
        .headers
        .iter()
        .flat_map(|headers| headers.iter())
        .filter_map(|(name, values)| {
            let value = values.first()?;
            Some((name.to_string(), value.as_str().to_owned()))
        })
        .collect();
    let find = |name: &str| {
        headers
            .iter()
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.clone())
    };
    let (stream_sequence, delivered) = match message.info() {
        Ok(info) => (
            info.stream_sequence,
            u64::try_from(info.delivered).unwrap_or(1),
        ),
        Err(_) => (0, 1),
    };
    Delivery {
        subject: message.subject.to_string(),
        payload: message.payload.clone(),
        // A replayed message is known by its first delivery's id: an
        // inbox applies an outbox message once, whichever delivery brings it.
        message_id: find(header::REPLAY_OF).or_else(|| find(header::MSG_ID)),
        key: find(header::KEY),
        headers,
        stream_sequence,
        attempt: delivered.max(1),
    }
}

impl Outcome {
    /// A MongoDB failure that is the message's to bear, as an attempt
    /// failed: the server answered and refused (the transaction's writes, a
    /// handler that ended the transaction itself or swallowed an error that
    /// aborted it, transient errors past the limit). Only a deployment that
    /// cannot be reached charges no attempt, so no message is tried for
    /// ever, and an outage burns no message's attempts.
    fn charged(self) -> Outcome {
        match self {
            Outcome::Mongo(error) if !is_unreachable(&error) => Outcome::Failed(HandlerError::new(
                crate::Error::mongo("the message's transaction failed", error),
            )),
            other => other,
        }
    }
}
