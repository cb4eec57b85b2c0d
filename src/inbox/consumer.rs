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
//!   behind it. After `max_deliveries` attempts the message is recorded
//!   `failed` in the inbox with the error, for a person to see, and
//!   terminated; its key's next message goes on. A MongoDB that fails
//!   (down, or transient errors past the limit) charges no attempt: the
//!   message is tried again in place after a pause until it answers.
//! - **Held messages stay ours.** Every message read and not yet settled
//!   is kept from redelivery with in-progress acknowledgements, a third of
//!   the consumer's ack wait apart, however long it waits for its key or
//!   for a retry. How many are held is bounded (16 per concurrent
//!   transaction); past that the consumer reads no further.
//! - **Graceful shutdown.** On `shutdown` the consumer reads nothing more,
//!   finishes the transactions in flight and acknowledges them; messages
//!   still waiting are left unacknowledged, for JetStream to redeliver.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, AckKind};
use async_nats::Subject;
use bson::DateTime;
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::record::{record_failed, Entry};
use super::transaction::{Outcome, Transaction};
use super::{Delivery, Handler, Inbox};
use crate::contract::header;
use crate::error::{brief, Error, Result};
use crate::retry::{reconnect_backoff, Outage};

/// Settings of a [`Consumer`]; [`ConsumerBuilder::bind`] creates or binds
/// the durable JetStream consumer.
pub struct ConsumerBuilder {
    inbox: Inbox,
    jetstream: jetstream::Context,
    stream: String,
    durable: Option<String>,
    filter_subjects: Vec<String>,
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

/// A bound consumer, ready to [`Consumer::run`].
pub struct Consumer {
    inbox: Inbox,
    nats: async_nats::Client,
    pull: PullConsumer,
    settings: Settings,
    ack_wait: Duration,
}

impl ConsumerBuilder {
    pub(super) fn new(inbox: Inbox, jetstream: jetstream::Context, stream: &str) -> Self {
        ConsumerBuilder {
            inbox,
            jetstream,
            stream: stream.to_owned(),
            durable: None,
            filter_subjects: Vec::new(),
            settings: Settings {
                concurrency: 16,
                max_deliveries: 5,
                retry_initial_delay: Duration::from_secs(1),
                retry_max_delay: Duration::from_secs(60),
                after_commit: None,
            },
            ack_wait: Duration::from_secs(30),
        }
    }

    /// The durable consumer's name (default: the inbox consumer's name).
    pub fn durable(mut self, name: &str) -> Self {
        self.durable = Some(name.to_owned());
        self
    }

    /// Take only messages on subjects matching `subject` (repeatable).
    pub fn filter_subject(mut self, subject: &str) -> Self {
        self.filter_subjects.push(subject.to_owned());
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
            max_ack_pending: i64::try_from(self.held_limit() * 2).unwrap_or(i64::MAX),
            filter_subjects: self.filter_subjects.clone(),
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
        let ack_wait = pull.cached_info().config.ack_wait;
        let nats = self.jetstream.client();
        Ok(Consumer {
            inbox: self.inbox,
            nats,
            pull,
            ack_wait,
            settings: self.settings,
        })
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

    fn held_limit(&self) -> usize {
        self.settings
            .concurrency
            .saturating_mul(HELD_PER_TRANSACTION)
    }
}

/// Messages held per concurrent transaction: the look-ahead that lets other
/// keys go on while one key's line is long.
const HELD_PER_TRANSACTION: usize = 16;

impl Consumer {
    /// Handles messages until `shutdown` fires, then finishes what is in
    /// flight. Returns an error if JetStream ends the consumer (deleted).
    pub async fn run<H: Handler>(self, handler: H, shutdown: CancellationToken) -> Result<()> {
        let held_limit = self
            .settings
            .concurrency
            .saturating_mul(HELD_PER_TRANSACTION);
        let shared = Arc::new(Shared {
            client: self.inbox.collection().client().clone(),
            inbox: self.inbox,
            nats: self.nats,
            handler: Box::new(handler),
            running: Semaphore::new(self.settings.concurrency),
            settings: self.settings,
            lanes: Mutex::default(),
            kept: Mutex::default(),
            shutdown: shutdown.clone(),
        });
        let holding = Arc::new(Semaphore::new(held_limit));
        let keeper_stop = CancellationToken::new();
        let keeper = tokio::spawn(keep_alive(
            shared.clone(),
            self.ack_wait,
            keeper_stop.clone(),
        ));
        let mut tasks = JoinSet::new();
        let outcome = pull_until(&self.pull, &shared, &holding, &mut tasks, &shutdown).await;
        while tasks.join_next().await.is_some() {}
        keeper_stop.cancel();
        let _ = keeper.await;
        outcome
    }
}

/// Reads messages and hands them out until shutdown, or until the consumer
/// ends.
async fn pull_until(
    pull: &PullConsumer,
    shared: &Arc<Shared>,
    holding: &Arc<Semaphore>,
    tasks: &mut JoinSet<()>,
    shutdown: &CancellationToken,
) -> Result<()> {
    let mut messages = pull
        .messages()
        .await
        .map_err(|e| Error::nats("reading the consumer's messages failed", e))?;
    let mut outage = Outage::new("NATS consumer");
    loop {
        let slot = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            slot = holding.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return Ok(()),
            },
        };
        let next = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            next = messages.next() => next,
        };
        match next {
            Some(Ok(message)) => {
                outage.recovered();
                shared.dispatch(message, slot, tasks);
            }
            Some(Err(error)) => {
                if error.kind() == pull::MessagesErrorKind::ConsumerDeleted {
                    return Err(Error::nats("the JetStream consumer was deleted", error));
                }
                outage.failed(&error);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => {
                return Err(Error::Protocol(
                    "the JetStream consumer's messages ended".into(),
                ))
            }
        }
        // Reap what finished, so the set holds only what runs.
        while tasks.try_join_next().is_some() {}
    }
}

/// What the consumer's tasks share.
struct Shared {
    inbox: Inbox,
    client: mongodb::Client,
    nats: async_nats::Client,
    handler: Box<dyn Handler>,
    settings: Settings,
    /// One permit per transaction running.
    running: Semaphore,
    /// The messages waiting in each key's line, behind the one being
    /// handled; a key has a line while a task works through it.
    lanes: Mutex<HashMap<String, VecDeque<Held>>>,
    /// The reply subjects of held messages, kept from redelivery.
    kept: Mutex<KeptAlive>,
    shutdown: CancellationToken,
}

#[derive(Default)]
struct KeptAlive {
    next: u64,
    subjects: HashMap<u64, Subject>,
}

/// A message read and not yet settled.
struct Held {
    message: jetstream::Message,
    delivery: Delivery,
    /// Its place among the held, given back when it is dropped.
    _slot: OwnedSemaphorePermit,
    _kept: KeptEntry,
}

/// A held message's entry among those kept alive.
struct KeptEntry {
    shared: Arc<Shared>,
    number: u64,
}

impl Drop for KeptEntry {
    fn drop(&mut self) {
        let mut kept = self.shared.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.subjects.remove(&self.number);
    }
}

/// How handling a message ended, for its acknowledgement.
enum Settled {
    Acknowledged,
    /// Left unacknowledged: the consumer is stopping.
    Left,
}

impl Shared {
    fn lock_lanes(&self) -> std::sync::MutexGuard<'_, HashMap<String, VecDeque<Held>>> {
        // The lines hold messages only; a panic elsewhere leaves them whole.
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts a message in its key's line, or in a task of its own.
    fn dispatch(
        self: &Arc<Self>,
        message: jetstream::Message,
        slot: OwnedSemaphorePermit,
        tasks: &mut JoinSet<()>,
    ) {
        let delivery = read_delivery(&message);
        let kept = self.keep(&message);
        let held = Held {
            message,
            delivery,
            _slot: slot,
            _kept: kept,
        };
        let Some(key) = held.delivery.key.clone() else {
            let shared = self.clone();
            tasks.spawn(async move {
                shared.handle(held, false).await;
            });
            return;
        };
        let mut lanes = self.lock_lanes();
        match lanes.get_mut(&key) {
            Some(line) => line.push_back(held),
            None => {
                lanes.insert(key.clone(), VecDeque::new());
                tasks.spawn(self.clone().work_through(key, held));
            }
        }
    }

    /// Registers a held message to be kept from redelivery.
    fn keep(self: &Arc<Self>, message: &jetstream::Message) -> KeptEntry {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.next += 1;
        let number = kept.next;
        if let Some(reply) = &message.reply {
            kept.subjects.insert(number, reply.clone());
        }
        KeptEntry {
            shared: self.clone(),
            number,
        }
    }

    /// Handles a key's messages one after another, in the order they came,
    /// until its line is empty.
    async fn work_through(self: Arc<Self>, key: String, first: Held) {
        let mut next = Some(first);
        while let Some(held) = next {
            // Its later messages wait, so a failed attempt is tried again
            // in place.
            if let Settled::Left = self.clone().handle(held, true).await {
                break;
            }
            let mut lanes = self.lock_lanes();
            next = lanes.get_mut(&key).and_then(VecDeque::pop_front);
            if next.is_none() {
                lanes.remove(&key);
            }
        }
        // Stopping: what waits in the line stays unacknowledged.
        self.lock_lanes().remove(&key);
    }

    /// Handles one message to its end: acknowledged (handled, a repeat, or
    /// given up on and terminated), negatively acknowledged for a later
    /// attempt, or left as the consumer stops. `in_place`: a failed attempt
    /// is tried again here, not redelivered.
    async fn handle(self: Arc<Self>, mut held: Held, in_place: bool) -> Settled {
        let consumer = self.inbox.name().to_owned();
        let metrics = self.inbox.metrics().clone();
        let mut outage = Outage::new("MongoDB inbox");
        let mut backoff = reconnect_backoff();
        loop {
            if self.shutdown.is_cancelled() {
                return Settled::Left;
            }
            let outcome = self.attempt(&held.delivery).await;
            let attempt = held.delivery.attempt;
            match outcome {
                Outcome::Committed { handler_time } => {
                    outage.recovered();
                    metrics.handled(&consumer, handler_time);
                    if let Some(hook) = &self.settings.after_commit {
                        if hook(&held.delivery) == AfterCommit::Abandon {
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
                Outcome::Failed(error) if attempt >= self.settings.max_deliveries => {
                    outage.recovered();
                    let reason = error.to_string();
                    if self.give_up(&held, &reason).await {
                        metrics.failed(&consumer);
                        return Settled::Acknowledged;
                    }
                    return Settled::Left;
                }
                Outcome::Failed(error) => {
                    outage.recovered();
                    metrics.retried(&consumer);
                    let delay = self.retry_delay(attempt);
                    tracing::warn!(
                        consumer,
                        subject = %held.delivery.subject,
                        attempt,
                        error = %error,
                        ?delay,
                        "handler failed; trying again later"
                    );
                    if !in_place {
                        acknowledge(&held.message, AckKind::Nak(Some(delay))).await;
                        return Settled::Acknowledged;
                    }
                    if !self.pause(delay).await {
                        return Settled::Left;
                    }
                    held.delivery.attempt += 1;
                }
                // MongoDB failed: no attempt is charged; the message waits
                // here, kept alive, until MongoDB answers.
                Outcome::Mongo(error) => {
                    outage.failed(&brief(&error));
                    let delay = backoff.next_backoff_or_max();
                    if !self.pause(delay).await {
                        return Settled::Left;
                    }
                }
            }
        }
    }

    /// One transaction for `delivery`, within the concurrency limit.
    async fn attempt(&self, delivery: &Delivery) -> Outcome {
        let Ok(_running) = self.running.acquire().await else {
            return Outcome::Mongo(mongodb::error::Error::custom("the consumer stopped"));
        };
        let consumer = self.inbox.name();
        let entry = delivery.message_id.as_deref().map(|message_id| Entry {
            consumer,
            message_id,
            subject: &delivery.subject,
            stream_sequence: delivery.stream_sequence,
            attempts: delivery.attempt,
        });
        let transaction = Transaction {
            client: &self.client,
            inbox: self.inbox.collection(),
            retention: self.inbox.retention,
        };
        transaction
            .run(self.handler.as_ref(), delivery, entry.as_ref())
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
        if let Some(message_id) = delivery.message_id.as_deref() {
            let entry = Entry {
                consumer: self.inbox.name(),
                message_id,
                subject: &delivery.subject,
                stream_sequence: delivery.stream_sequence,
                attempts: delivery.attempt,
            };
            let mut backoff = reconnect_backoff();
            let mut outage = Outage::new("MongoDB inbox");
            loop {
                let written = record_failed(
                    self.inbox.collection(),
                    &entry,
                    reason,
                    DateTime::now(),
                    self.inbox.retention,
                )
                .await;
                match written {
                    Ok(()) => break,
                    Err(error) => {
                        outage.failed(&brief(&error));
                        if !self.pause(backoff.next_backoff_or_max()).await {
                            return false;
                        }
                    }
                }
            }
        }
        acknowledge(&held.message, AckKind::Term).await;
        true
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

    /// Waits `delay`; false if the consumer stops first.
    async fn pause(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }
}

/// Sends an acknowledgement; one that is lost leads to a redelivery, which
/// the inbox recognises, so a failure is only logged.
async fn acknowledge(message: &jetstream::Message, kind: AckKind) {
    if let Err(error) = message.ack_with(kind).await {
        tracing::warn!(error = %error, "acknowledging a message failed; JetStream will redeliver it");
    }
}

/// Keeps every held message from redelivery until `stop`: an in-progress
/// acknowledgement for each, a third of the ack wait apart.
async fn keep_alive(shared: Arc<Shared>, ack_wait: Duration, stop: CancellationToken) {
    let every = (ack_wait / 3).max(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let subjects: Vec<Subject> = {
            let kept = shared.kept.lock().unwrap_or_else(|e| e.into_inner());
            kept.subjects.values().cloned().collect()
        };
        for subject in subjects {
            let progress = Bytes::from(AckKind::Progress);
            if let Err(error) = shared.nats.publish(subject, progress).await {
                tracing::debug!(error = %error, "an in-progress acknowledgement failed");
            }
        }
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
        message_id: find(header::MSG_ID),
        key: find(header::KEY),
        headers,
        stream_sequence,
        attempt: delivered.max(1),
    }
}

/// The backoff's next pause, or its longest once it has no more.
trait NextOrMax {
    fn next_backoff_or_max(&mut self) -> Duration;
}

impl NextOrMax for backoff::ExponentialBackoff {
    fn next_backoff_or_max(&mut self) -> Duration {
        use backoff::backoff::Backoff;
        self.next_backoff().unwrap_or(self.max_interval)
    }
}
