//! The NATS publisher: JetStream with acknowledgements, or core NATS.
//!
//! The NATS client queues what it is given while it reconnects, and sends
//! it once it is connected again, however long that takes. What a leader
//! sent in a term that has ended must not reach NATS after the next leader
//! published the same messages (past JetStream's duplicate window, or after
//! later messages of their keys), so a connection is never carried from one
//! term to the next while something sent on it has no answer: at a term's
//! end ([`Publisher::end_term`]) such a connection is retired (it never
//! connects again, so what its client holds is never sent) and a new one
//! is opened. What the operating system had taken for sending before the
//! term ended is beyond reach (see docs/guarantees.md).

use std::collections::HashMap;
use std::error::Error as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishErrorKind, ErrorCode};
use async_nats::HeaderMap;
use futures::future::{BoxFuture, FutureExt};

use super::connection::{NatsConnection, Session};
use super::denials::Denials;
use super::{Ack, AckFuture, Health, PublishError, Publisher};
use crate::config::{NatsMode, RelayConfig};
use crate::contract::{ContractViolation, OutboxMessage, Rule};
use crate::error::{Error, Result};
use crate::observe::Metrics;

/// Publishes to NATS, acknowledged by JetStream or flushed on core NATS.
#[derive(Clone)]
pub struct NatsPublisher {
    /// The connection in use.
    link: Arc<RwLock<Arc<Link>>>,
    /// How to open another, where the relay connected itself; `None` for
    /// a client it was given, which is never retired.
    reopen: Option<Arc<Reopen>>,
    mode: NatsMode,
    ack_timeout: Duration,
    /// Room in the client for unacknowledged JetStream publishes.
    room: usize,
    /// The largest message the server takes, as last told: a connection
    /// still being made knows none yet (it says 0).
    max_payload: Arc<AtomicUsize>,
    denials: Denials,
    /// The relay's own subjects (`<prefix>.>`), whose stream the probe asks after.
    own_subjects: Option<String>,
    /// Recent probe answers by subject, each reused for [`PROBE_REUSE`].
    probed: Arc<Mutex<HashMap<String, (Instant, Health)>>>,
    /// Held while a connection is retired: terms of several partitions
    /// may end at once, and the connection is replaced once.
    retiring: Arc<tokio::sync::Mutex<()>>,
}

impl std::fmt::Debug for NatsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsPublisher")
            .field("mode", &self.mode)
            .field("ack_timeout", &self.ack_timeout)
            .finish_non_exhaustive()
    }
}

/// One connection, and whether anything sent on it may still be queued.
struct Link {
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
    /// A send on it has no answer (dropped unanswered, timed out, cut
    /// off): the client may still hold it, to send when it can.
    unanswered: AtomicBool,
    /// Set when the link is retired: the connection never connects again.
    retired: Arc<AtomicBool>,
}

impl Link {
    /// A link over `client`, with a JetStream context (with `room` for
    /// unacknowledged publishes) in JetStream mode.
    fn new(
        client: async_nats::Client,
        mode: NatsMode,
        ack_timeout: Duration,
        room: usize,
        retired: Arc<AtomicBool>,
    ) -> Self {
        let jetstream = match mode {
            NatsMode::Jetstream => Some(
                jetstream::ContextBuilder::new()
                    .timeout(ack_timeout)
                    .backpressure_on_inflight(true)
                    .max_ack_inflight(room.max(1))
                    .build(client.clone()),
            ),
            NatsMode::Core => None,
        };
        Link {
            client,
            jetstream,
            unanswered: AtomicBool::new(false),
            retired,
        }
    }
}

/// What opens a new connection to replace a retired one.
struct Reopen {
    connection: NatsConnection,
    metrics: Metrics,
    /// Connections opened so far, for their names.
    opened: AtomicU64,
}

/// Marks its link's send unanswered when dropped before its answer is known.
struct Awaited(Option<Arc<Link>>);

impl Awaited {
    /// The broker answered: nothing of this send is left in the client.
    fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        if let Some(link) = self.0.take() {
            link.unanswered.store(true, Ordering::Release);
        }
    }
}

/// Room for unacknowledged publishes in a client the relay did not connect.
const DEFAULT_ROOM: usize = 4096;

/// How long one probe's answer stands, so a run of failing messages costs
/// the broker one API request a second, not one a message.
const PROBE_REUSE: Duration = Duration::from_secs(1);

impl NatsPublisher {
    /// Connects to the configured NATS server. The connection then reconnects
    /// by itself for as long as the relay runs (until a term ends with a send
    /// unanswered, see [`Publisher::end_term`]); only the first connection
    /// must succeed.
    pub async fn connect(config: &RelayConfig, metrics: &Metrics) -> Result<Self> {
        let denials = Denials::default();
        let reopen = Reopen {
            connection: NatsConnection::for_config(config),
            metrics: metrics.clone(),
            opened: AtomicU64::new(0),
        };
        let retired = Arc::new(AtomicBool::new(false));
        let session = reopen.session(&denials, retired.clone());
        let client = reopen.connection.open(&session, false).await?;
        metrics.watch_nats(client.clone());
        // Room in the client for what the relay's stages may await at once:
        // the stream's window and a sweep pass's. A send that finds no room
        // waits in its own future, never in a stage's loop.
        let room = config.max_in_flight.saturating_mul(2);
        let mut publisher =
            Self::with_room(client, config.nats_mode, config.ack_timeout, room, retired);
        publisher.reopen = Some(Arc::new(reopen));
        publisher.denials = denials;
        publisher.own_subjects = Some(format!("{}.>", config.subject_prefix));
        Ok(publisher)
    }

    /// Wraps a connected client. (Publish permission denials are recognised,
    /// and connections retired, only on a connection made by
    /// [`NatsPublisher::connect`].)
    pub fn from_client(client: async_nats::Client, mode: NatsMode, ack_timeout: Duration) -> Self {
        Self::with_room(client, mode, ack_timeout, DEFAULT_ROOM, Arc::default())
    }

    /// A client with room for `room` unacknowledged JetStream publishes:
    /// a publish beyond waits until an acknowledgement gives room back.
    fn with_room(
        client: async_nats::Client,
        mode: NatsMode,
        ack_timeout: Duration,
        room: usize,
        retired: Arc<AtomicBool>,
    ) -> Self {
        let max_payload = Arc::new(AtomicUsize::new(client.server_info().max_payload));
        let link = Link::new(client, mode, ack_timeout, room, retired);
        NatsPublisher {
            link: Arc::new(RwLock::new(Arc::new(link))),
            reopen: None,
            mode,
            ack_timeout,
            room,
            max_payload,
            denials: Denials::default(),
            own_subjects: None,
            probed: Arc::default(),
            retiring: Arc::default(),
        }
    }

    /// The connection in use.
    fn current(&self) -> Arc<Link> {
        match self.link.read() {
            Ok(link) => link.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The client of the connection in use.
    pub fn client(&self) -> async_nats::Client {
        self.current().client.clone()
    }

    /// Retires the connection in use if a send on it has no answer, and
    /// opens a new one in its place (in the background: NATS may be away).
    async fn retire_if_unanswered(&self) {
        let Some(reopen) = &self.reopen else {
            return;
        };
        let _retiring = self.retiring.lock().await;
        let link = self.current();
        if !link.unanswered.load(Ordering::Acquire) {
            return;
        }
        let retired = Arc::new(AtomicBool::new(false));
        let session = reopen.session(&self.denials, retired.clone());
        match reopen.connection.open(&session, true).await {
            Ok(client) => {
                link.retired.store(true, Ordering::Release);
                reopen.metrics.watch_nats(client.clone());
                let replacement =
                    Link::new(client, self.mode, self.ack_timeout, self.room, retired);
                let replacement = Arc::new(replacement);
                match self.link.write() {
                    Ok(mut current) => *current = replacement,
                    Err(poisoned) => *poisoned.into_inner() = replacement,
                }
                tracing::info!(
                    connection = %session.name,
                    "the term ended with publishes unanswered: its NATS connection is retired, \
                     and what it still holds will not be sent; publishing goes on a new one"
                );
            }
            Err(error) => tracing::warn!(
                %error,
                "could not open a new NATS connection; the former term's goes on, and what it \
                 holds may be sent late"
            ),
        }
    }

    async fn send_jetstream(
        &self,
        link: Arc<Link>,
        message: &OutboxMessage,
    ) -> Result<AckFuture, PublishError> {
        let Some(context) = &link.jetstream else {
            return Err(PublishError::Unavailable("no JetStream context".into()));
        };
        let pending = context
            .publish_with_headers(
                message.subject.clone(),
                headers(message),
                message.body.clone(),
            )
            .await
            .map_err(classify_jetstream)?;
        let (denials, subject) = (self.denials.clone(), message.subject.clone());
        let window = self.ack_timeout * 2;
        let awaited = Awaited(Some(link.clone()));
        Ok(async move {
            let answer = match pending.await.map_err(classify_jetstream) {
                Ok(ack) => Ok(Ack {
                    duplicate: ack.duplicate,
                }),
                Err(PublishError::Unavailable(_)) if denials.denied(&subject, window) => {
                    Err(PublishError::Refused(format!(
                        "{PERMISSION_DENIED}: NATS does not let this relay publish to {subject:?}"
                    )))
                }
                Err(error) => Err(error),
            };
            if answered(&answer) {
                awaited.answered();
            }
            answer
        }
        .boxed())
    }

    /// Asks the broker whether it takes messages for `subject`, reusing a
    /// recent answer.
    async fn probe_cached(&self, subject: &str) -> Health {
        if let Ok(probed) = self.probed.lock() {
            if let Some((at, health)) = probed.get(subject) {
                if at.elapsed() < PROBE_REUSE {
                    return health.clone();
                }
            }
        }
        let link = self.current();
        let health = match &link.jetstream {
            Some(context) => {
                let probe = self.probe_jetstream(context, subject);
                tokio::time::timeout(self.ack_timeout, probe)
                    .await
                    .unwrap_or_else(|_| {
                        Health::TakesNone(format!(
                            "JetStream did not answer within {:?}",
                            self.ack_timeout
                        ))
                    })
            }
            None => match link.client.connection_state() {
                async_nats::connection::State::Connected => Health::Takes,
                state => Health::TakesNone(format!("the NATS connection is {state}")),
            },
        };
        if let Ok(mut probed) = self.probed.lock() {
            probed.retain(|_, (at, _)| at.elapsed() < PROBE_REUSE);
            probed.insert(subject.to_owned(), (Instant::now(), health.clone()));
        }
        health
    }
    /// Whether JetStream takes messages for `subject`: the stream capturing
    /// it answers and has room. If no stream captures it, the subject is
    /// the message's fault when the relay's own stream takes messages. If
    /// its stream is full or down while the relay's own stream is not, only
    /// that destination is at fault.
    async fn probe_jetstream(&self, context: &jetstream::Context, subject: &str) -> Health {
        let Ok(name) = context.stream_by_subject(subject).await else {
            return self.own_health(context).await;
        };
        match stream_health(context, &name).await {
            Health::Takes => Health::Takes,
            Health::TakesNone(why) => match self.own_health(context).await {
                Health::Takes => Health::TakesOthers(why),
                own => own,
            },
            other => other,
        }
    }

    /// Whether the relay's own stream (the one capturing `<prefix>.>`)
    /// answers and has room; without a prefix to ask after, whether the
    /// account answers.
    async fn own_health(&self, context: &jetstream::Context) -> Health {
        let Some(subjects) = &self.own_subjects else {
            return match context.query_account().await {
                Ok(_) => Health::Takes,
                Err(e) => Health::TakesNone(format!("JetStream does not answer: {e}")),
            };
        };
        match context.stream_by_subject(subjects.clone()).await {
            Ok(name) => stream_health(context, &name).await,
            Err(e) => Health::TakesNone(format!(
                "no JetStream stream captures the relay's subjects {subjects} ({e})"
            )),
        }
    }

    async fn send_core(
        &self,
        link: Arc<Link>,
        message: &OutboxMessage,
    ) -> Result<AckFuture, PublishError> {
        link.client
            .publish_with_headers(
                message.subject.clone(),
                headers(message),
                message.body.clone(),
            )
            .await
            .map_err(|e| match e.kind() {
                async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                    PublishError::Invalid(ContractViolation::new(Rule::TooLarge, e.to_string()))
                }
                _ => PublishError::Unavailable(e.to_string()),
            })?;
        let client = link.client.clone();
        let timeout = self.ack_timeout;
        let awaited = Awaited(Some(link));
        Ok(async move {
            let answer = match tokio::time::timeout(timeout, client.flush()).await {
                Ok(Ok(())) => Ok(Ack::default()),
                Ok(Err(e)) => Err(PublishError::Unavailable(format!("flush failed: {e}"))),
                Err(_) => Err(PublishError::Unavailable(format!(
                    "flush not done within {timeout:?}"
                ))),
            };
            if answered(&answer) {
                awaited.answered();
            }
            answer
        }
        .boxed())
    }
}

impl Publisher for NatsPublisher {
    fn send<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>> {
        let link = self.current();
        match link.jetstream {
            Some(_) => self.send_jetstream(link, message).boxed(),
            None => self.send_core(link, message).boxed(),
        }
    }

    fn max_payload(&self) -> usize {
        match self.current().client.server_info().max_payload {
            // Not told yet: no limit the relay knows of (the client checks
            // each message against the server's own once connected).
            0 => match self.max_payload.load(Ordering::Relaxed) {
                0 => usize::MAX,
                known => known,
            },
            told => {
                self.max_payload.store(told, Ordering::Relaxed);
                told
            }
        }
    }

    fn acknowledges_storage(&self) -> bool {
        self.mode == NatsMode::Jetstream
    }

    fn probe<'a>(&'a self, subject: &'a str) -> BoxFuture<'a, Health> {
        self.probe_cached(subject).boxed()
    }

    fn end_term(&self) -> BoxFuture<'_, ()> {
        self.retire_if_unanswered().boxed()
    }
}

/// Whether an answer leaves nothing of its send in the client: one came
/// back from the broker. A timeout or a lost connection does not say that
/// the publish is not still queued.
fn answered(answer: &Result<Ack, PublishError>) -> bool {
    !matches!(
        answer,
        Err(PublishError::Unavailable(_) | PublishError::Uncaptured(_))
    )
}

impl Reopen {
    /// The session of the next connection: its name numbers it.
    fn session(&self, denials: &Denials, retired: Arc<AtomicBool>) -> Session {
        let number = self.opened.fetch_add(1, Ordering::Relaxed) + 1;
        Session {
            name: format!("outbox-relay #{number}"),
            denials: denials.clone(),
            metrics: Some(self.metrics.clone()),
            retired,
        }
    }
}

/// Whether a stream answers and has room.
async fn stream_health(context: &jetstream::Context, name: &str) -> Health {
    match context.get_stream(name).await {
        Ok(stream) => match full(stream.cached_info()) {
            Some(limit) => Health::TakesNone(format!(
                "stream {name:?} is full ({limit}) and discards new messages"
            )),
            None => Health::Takes,
        },
        Err(e) => Health::TakesNone(format!("stream {name:?} does not answer: {e}")),
    }
}

/// The limit a stream that discards new messages has reached, if any.
fn full(info: &jetstream::stream::Info) -> Option<String> {
    let (config, state) = (&info.config, &info.state);
    if config.discard != jetstream::stream::DiscardPolicy::New {
        return None;
    }
    let reached = |limit: i64, value: u64| u64::try_from(limit).is_ok_and(|l| l > 0 && value >= l);
    if reached(config.max_messages, state.messages) {
        return Some(format!(
            "{} of {} messages",
            state.messages, config.max_messages
        ));
    }
    if reached(config.max_bytes, state.bytes) {
        return Some(format!("{} of {} bytes", state.bytes, config.max_bytes));
    }
    None
}

fn headers(message: &OutboxMessage) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in &message.headers {
        map.append(name.as_str(), value.as_str());
    }
    map
}

/// How a refusal for want of permission begins: NATS refuses the subject,
/// whatever the message.
pub(crate) const PERMISSION_DENIED: &str = "permission denied";

/// Sorts a JetStream publish error by whose fault it is.
fn classify_jetstream(error: async_nats::jetstream::context::PublishError) -> PublishError {
    let detail = match error.source() {
        Some(source) => format!("{error}: {source}"),
        None => error.to_string(),
    };
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => {
            PublishError::Invalid(ContractViolation::new(Rule::TooLarge, detail))
        }
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            PublishError::Refused(detail)
        }
        PublishErrorKind::StreamNotFound => PublishError::Uncaptured(format!(
            "no JetStream stream captures the subject ({detail})"
        )),
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => PublishError::Unavailable(detail),
        PublishErrorKind::Other => {
            let api_error = error
                .source()
                .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>());
            match api_error {
                Some(api) if broker_side(api.error_code()) || stream_full(api) => {
                    PublishError::Unavailable(detail)
                }
                Some(_) => PublishError::Refused(detail),
                None => PublishError::Unavailable(detail),
            }
        }
    }
}

/// A stream that discards new messages refusing one because it is full: it
/// will refuse every other message too, so the broker is at fault. (A
/// per-subject limit refuses that subject's messages only.)
fn stream_full(error: &async_nats::jetstream::Error) -> bool {
    let text = error.to_string().to_ascii_lowercase();
    (text.contains("maximum messages exceeded") || text.contains("maximum bytes exceeded"))
        && !text.contains("per subject")
}

/// JetStream API errors that mean the service, not the message, is at fault.
fn broker_side(code: ErrorCode) -> bool {
    [
        ErrorCode::CLUSTER_NOT_AVAILABLE,
        ErrorCode::CLUSTER_NOT_ACTIVE,
        ErrorCode::CLUSTER_NOT_LEADER,
        ErrorCode::CLUSTER_NO_PEERS,
        ErrorCode::CLUSTER_INCOMPLETE,
        ErrorCode::JETSTREAM_NOT_ENABLED,
        ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
        ErrorCode::INSUFFICIENT_RESOURCES,
        ErrorCode::STREAM_NOT_FOUND,
        ErrorCode::TEMP_STORAGE_FAILED,
    ]
    .contains(&code)
}

/// Creating the JetStream stream for local use (`--create-stream`).
#[derive(Debug, Clone)]
pub struct StreamSetup {
    /// The stream's name.
    pub name: String,
    /// The subjects it captures.
    pub subjects: Vec<String>,
    /// How long the stream remembers message ids to drop repeats.
    pub duplicate_window: Duration,
}

/// JetStream's default duplicate window.
const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

impl StreamSetup {
    /// A stream named `name` for every subject under `prefix`, with
    /// JetStream's default duplicate window.
    pub fn for_prefix(name: impl Into<String>, prefix: &str) -> Self {
        StreamSetup {
            name: name.into(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
        }
    }

    /// A stream for the relay's subjects whose duplicate window covers the
    /// relay's longest redelivery gap.
    pub fn for_relay(name: impl Into<String>, config: &RelayConfig) -> Self {
        StreamSetup {
            duplicate_window: DEFAULT_DUPLICATE_WINDOW.max(config.redelivery_gap()),
            ..Self::for_prefix(name, &config.subject_prefix)
        }
    }

    /// Creates the stream unless one already captures the subjects. Returns
    /// the name of the stream in use.
    pub async fn ensure(&self, client: &async_nats::Client) -> Result<String> {
        let context = jetstream::new(client.clone());
        let subject = self.subjects.first().cloned().unwrap_or_default();
        if let Ok(existing) = context.stream_by_subject(subject.clone()).await {
            tracing::info!(stream = %existing, %subject, "a JetStream stream already captures the subjects");
            return Ok(existing);
        }
        context
            .get_or_create_stream(jetstream::stream::Config {
                name: self.name.clone(),
                subjects: self.subjects.clone(),
                duplicate_window: self.duplicate_window,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                Error::nats(format!("cannot create JetStream stream {:?}", self.name), e)
            })?;
        tracing::info!(stream = %self.name, %subject, "created JetStream stream");
        Ok(self.name.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publish_denials_are_recognised_by_subject() {
        let denials = Denials::default();
        denials.note("Permissions Violation for Publish to \"orders.secret\"");
        denials.note("Permissions Violation for Subscription to \"other\"");
        let window = Duration::from_secs(1);
        assert!(denials.denied("orders.secret", window));
        assert!(!denials.denied("other", window));
        assert!(!denials.denied("orders.public", window));
        assert!(!denials.denied("orders.secret", Duration::ZERO));
    }
}
