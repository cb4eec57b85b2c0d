//! The consumer's half of exactly once: an inbox that applies each
//! message's effects once, for services that consume from JetStream and
//! keep their state in MongoDB.
//!
//! The relay delivers at least once: a crash, an outage or a takeover can
//! publish a message again, and JetStream drops repeats only within its
//! duplicate window. A consumer built on [`Inbox`] records each message's
//! `Nats-Msg-Id` in the same MongoDB transaction as the handler's effects,
//! and acknowledges the message only after the commit, so a repeat, however
//! late, finds the record and is acknowledged without running the handler.
//! A crash between the commit and the acknowledgement leads to a
//! redelivery that is skipped the same way.
//!
//! ```no_run
//! # async fn example(db: mongodb::Database, nats: async_nats::Client) -> outbox_relay::Result<()> {
//! use futures::FutureExt;
//! use outbox_relay::inbox::{handler, Inbox};
//!
//! let inbox = Inbox::builder(&db, "billing").build().await?;
//! let consumer = inbox
//!     .consumer(async_nats::jetstream::new(nats), "OUTBOX")
//!     .filter_subject("outbox.order.placed")
//!     .bind()
//!     .await?;
//! let orders = db.collection::<bson::Document>("orders_seen");
//! let shutdown = tokio_util::sync::CancellationToken::new();
//! consumer
//!     .run(
//!         handler(move |session, message| {
//!             let orders = orders.clone();
//!             async move {
//!                 let order: bson::Document = message.json()?;
//!                 orders.insert_one(order).session(session).await?;
//!                 Ok(())
//!             }
//!             .boxed()
//!         }),
//!         shutdown,
//!     )
//!     .await
//! # }
//! ```
//!
//! Layout:
//! - `record`: the inbox document, its indexes, and the writes that record
//!   a message handled or failed;
//! - `transaction`: one message in one transaction, retried as the drivers'
//!   convenient transaction API does;
//! - `consumer`: the JetStream pull consumer, concurrency with each key's
//!   messages one at a time in stream order, retries and dead letters,
//!   graceful shutdown; a module per job inside (see its layout);
//! - `metrics`: what the consumer counts, in the Prometheus text format.
//!
//! A message without `Nats-Msg-Id` (not from the relay) is handled without
//! deduplication: its handler runs for every delivery of it. A replayed
//! message (`outbox-relay replay`) is known by its first delivery's id
//! (`Outbox-Replay-Of`): a consumer that handled it skips it, and one that
//! is to apply the history again is given a new consumer name.

mod commit;
mod consumer;
mod metrics;
mod record;
mod transaction;

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bson::Document;
use bytes::Bytes;
use futures::future::BoxFuture;
use mongodb::{ClientSession, Collection, Database};

pub use consumer::{
    AfterCommit, AfterCommitHook, Backlog, Consumer, ConsumerBuilder, DEFAULT_SHUTDOWN_TIMEOUT,
    LAST_WORDS_WAIT,
};
pub use metrics::{InboxCounts, InboxMetrics};
pub use record::{
    check_consumer, failed_messages, field, status, FailedMessage, DEFAULT_COLLECTION, TTL_INDEX,
    UNIQUE_INDEX,
};

pub use crate::contract::cloudevents::{ContentMode, Event};
use crate::error::{Error, Result};

/// A consumer's inbox: where it records the messages it handled.
#[derive(Clone, Debug)]
pub struct Inbox {
    collection: Collection<Document>,
    consumer: String,
    retention: Option<Duration>,
    metrics: InboxMetrics,
}

/// The shortest retention an inbox takes.
const MIN_RETENTION: Duration = Duration::from_secs(60);

/// Settings of an [`Inbox`]; [`InboxBuilder::build`] checks them and
/// prepares the collection.
#[derive(Debug)]
pub struct InboxBuilder {
    database: Database,
    consumer: String,
    collection: String,
    retention: Option<Duration>,
    metrics: Option<InboxMetrics>,
}

impl Inbox {
    /// An inbox for the consumer named `consumer` (`"billing"`), in the
    /// consumer's own database.
    pub fn builder(database: &Database, consumer: &str) -> InboxBuilder {
        InboxBuilder {
            database: database.clone(),
            consumer: consumer.to_owned(),
            collection: DEFAULT_COLLECTION.to_owned(),
            retention: None,
            metrics: None,
        }
    }

    /// A JetStream pull consumer on `stream` that handles its messages
    /// through this inbox.
    pub fn consumer(
        &self,
        jetstream: async_nats::jetstream::Context,
        stream: &str,
    ) -> ConsumerBuilder {
        ConsumerBuilder::new(self.clone(), jetstream, stream)
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.consumer
    }

    /// The inbox collection.
    pub fn collection(&self) -> &Collection<Document> {
        &self.collection
    }

    /// What this inbox's consumers count.
    pub fn metrics(&self) -> &InboxMetrics {
        &self.metrics
    }

    /// The messages this consumer gave up on, newest first, up to `limit`,
    /// and how many there are.
    pub async fn failed(&self, limit: i64) -> Result<(u64, Vec<FailedMessage>)> {
        record::failed_messages(&self.collection, &self.consumer, limit).await
    }
}

impl InboxBuilder {
    /// The inbox collection (default `inbox`).
    pub fn collection(mut self, name: &str) -> Self {
        self.collection = name.to_owned();
        self
    }

    /// Keep records this long (TTL index on `expireAt`); a repeat older
    /// than this is no longer recognised. Default: for ever.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Count into `metrics` (to serve one registry for several consumers).
    pub fn metrics(mut self, metrics: InboxMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Checks the settings and ensures the inbox's indexes.
    pub async fn build(self) -> Result<Inbox> {
        if self.consumer.trim().is_empty() {
            return Err(Error::Config(
                "the inbox needs a consumer name (\"billing\", say)".into(),
            ));
        }
        if self.collection.trim().is_empty() {
            return Err(Error::Config(
                "the inbox collection's name must not be empty".into(),
            ));
        }
        // Shorter, a redelivery after the ack wait (30 s by default) could
        // find its record gone; and MongoDB's TTL monitor runs once a minute.
        if self.retention.is_some_and(|r| r < MIN_RETENTION) {
            return Err(Error::Config(
                "the inbox's retention must be at least 1 minute; choose one longer than any \
                 redelivery you expect (days, for most consumers)"
                    .into(),
            ));
        }
        let collection = self.database.collection(&self.collection);
        record::ensure_indexes(&collection).await?;
        check_transactions(&collection).await?;
        let metrics = self.metrics.unwrap_or_default();
        metrics.count_from_zero(&self.consumer);
        Ok(Inbox {
            collection,
            consumer: self.consumer,
            retention: self.retention,
            metrics,
        })
    }
}

/// Runs a read in a transaction, so that a deployment that takes none (a
/// standalone server) is refused here, once, rather than by every message.
async fn check_transactions(inbox: &Collection<Document>) -> Result<()> {
    let mut session = inbox
        .client()
        .start_session()
        .await
        .map_err(transaction_check_failed)?;
    session
        .start_transaction()
        .await
        .map_err(transaction_check_failed)?;
    let read = inbox.find_one(bson::doc! {}).session(&mut session).await;
    let _ = session.abort_transaction().await;
    read.map(drop).map_err(transaction_check_failed)
}

fn transaction_check_failed(error: mongodb::error::Error) -> Error {
    use mongodb::error::ErrorKind;
    /// IllegalOperation: "Transaction numbers are only allowed on a
    /// replica set member or mongos".
    const ILLEGAL_OPERATION: i32 = 20;
    let unsupported = match &*error.kind {
        ErrorKind::Transaction { .. } => true,
        ErrorKind::Command(command) => command.code == ILLEGAL_OPERATION,
        _ => false,
    };
    let context = if unsupported {
        "the inbox needs transactions, which MongoDB runs only on a replica set or a sharded \
         cluster (a standalone server can be made a one-member replica set)"
    } else {
        "checking that the inbox can run transactions failed"
    };
    Error::mongo(context, error)
}

/// A message as its handler sees it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The subject it was published to.
    pub subject: String,
    /// Its body, as it came.
    pub payload: Bytes,
    /// The event's data: for a CloudEvent in structured mode, what its
    /// `data` or `data_base64` holds; for any other message, the body. A
    /// handler reading this reads the same bytes whichever mode brought
    /// them.
    pub data: Bytes,
    /// Its CloudEvents attributes, for a message sent as a CloudEvent in
    /// either mode (`--cloudevents`); none for any other. A message that
    /// says it is a CloudEvent but cannot be read as one has none either,
    /// and is handed over as it came.
    pub event: Option<Event>,
    /// Its headers, each name with its first value.
    pub headers: Vec<(String, String)>,
    /// The outbox message's id, what repeats are known by: `Nats-Msg-Id`,
    /// or for a replayed message `Outbox-Replay-Of`, its first delivery's.
    /// So a consumer skips a replay of what it handled; to apply a
    /// history again, replay it to a consumer of a new name.
    pub message_id: Option<String>,
    /// `Outbox-Key`: messages of one key are handled one at a time, in
    /// stream order.
    pub key: Option<String>,
    /// Its sequence in the stream.
    pub stream_sequence: u64,
    /// Which attempt at handling it this is, from 1: the handler's failed
    /// runs before this one, as the inbox record counts them, plus one
    /// (a delivery that ran no handler counts nothing). For a message
    /// without an id, which has no record, JetStream's deliveries.
    pub attempt: u64,
}

impl Delivery {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        let mut headers = self.headers.iter();
        headers
            .find(|(header, _)| header.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// The payload read as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> std::result::Result<T, HandlerError> {
        serde_json::from_slice(&self.payload).map_err(HandlerError::new)
    }

    /// The event's data read as JSON: the payload, or a structured
    /// CloudEvent's data.
    pub fn data_json<T: serde::de::DeserializeOwned>(
        &self,
    ) -> std::result::Result<T, HandlerError> {
        serde_json::from_slice(&self.data).map_err(HandlerError::new)
    }
}

/// Why a handler did not handle a message. Any error converts into it; a
/// MongoDB error labelled `TransientTransactionError` (a write conflict,
/// say), returned as it is or as the `source()` of the handler's own error,
/// runs the transaction again rather than counting as a failure. (An error
/// type that hides its cause from `source()`, as `anyhow::Error` does its
/// outermost one, hides the label too: return the MongoDB error itself.)
pub struct HandlerError(Box<dyn std::error::Error + Send + Sync>);

impl HandlerError {
    /// An error from anything that can be one.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        HandlerError(error.into())
    }

    /// The MongoDB error labelled `TransientTransactionError` that this is
    /// or was caused by (however the handler wrapped it), or else the error.
    fn transient(self) -> std::result::Result<mongodb::error::Error, HandlerError> {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self.0.as_ref());
        while let Some(error) = cause {
            if let Some(mongo) = error.downcast_ref::<mongodb::error::Error>() {
                if mongo.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR) {
                    return Ok(mongo.clone());
                }
            }
            cause = error.source();
        }
        Err(self)
    }
}

impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        HandlerError::new(error)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// What handles messages: its writes go through `session`, which is in the
/// message's transaction, so they commit with the inbox's record or not at
/// all. Effects outside MongoDB are not undone by an abort: a handler may
/// run more than once for one message (a transient error runs the
/// transaction again), so keep them idempotent or leave them out.
///
/// Implement it with an `async fn`; the handler's state is `self`, shared
/// by every message without cloning:
///
/// ```no_run
/// use outbox_relay::inbox::{Delivery, Handler, HandlerError};
/// use outbox_relay::mongodb::{ClientSession, Collection};
///
/// struct Billing {
///     invoices: Collection<bson::Document>,
/// }
///
/// impl Handler for Billing {
///     async fn handle(
///         &self,
///         session: &mut ClientSession,
///         message: &Delivery,
///     ) -> Result<(), HandlerError> {
///         let order: bson::Document = message.json()?;
///         self.invoices.insert_one(order).session(session).await?;
///         Ok(())
///     }
/// }
/// ```
///
/// A short handler may be a closure instead, through [`handler`].
pub trait Handler: Send + Sync + 'static {
    /// Handles one message inside its transaction. An error aborts the
    /// transaction and costs the message an attempt, except a transient
    /// MongoDB error, which runs the transaction again ([`HandlerError`]).
    fn handle<'a>(
        &'a self,
        session: &'a mut ClientSession,
        message: &'a Delivery,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send + 'a;
}

/// What a closure given to [`handler`] returns: a boxed future of its result.
pub type Handled<'a> = BoxFuture<'a, std::result::Result<(), HandlerError>>;

/// A handler from a closure `|session, message| async move { .. }.boxed()`
/// (with `futures::FutureExt`): passed through here, the closure is known
/// to take arguments of any lifetime, which a closure kept in a variable
/// otherwise is not.
pub fn handler<F>(handle: F) -> FnHandler<F>
where
    F: for<'a> Fn(&'a mut ClientSession, &'a Delivery) -> Handled<'a> + Send + Sync + 'static,
{
    FnHandler(handle)
}

/// A closure as a [`Handler`]; made by [`handler`].
pub struct FnHandler<F>(F);

impl<F> Handler for FnHandler<F>
where
    F: for<'a> Fn(&'a mut ClientSession, &'a Delivery) -> Handled<'a> + Send + Sync + 'static,
{
    fn handle<'a>(
        &'a self,
        session: &'a mut ClientSession,
        message: &'a Delivery,
    ) -> impl Future<Output = std::result::Result<(), HandlerError>> + Send + 'a {
        (self.0)(session, message)
    }
}

/// A [`Handler`] behind a pointer: its future boxed, so the consumer keeps
/// one type whatever the handler.
pub(crate) trait BoxedHandler: Send + Sync {
    fn handle_boxed<'a>(
        &'a self,
        session: &'a mut ClientSession,
        message: &'a Delivery,
    ) -> Handled<'a>;
}

impl<H: Handler> BoxedHandler for H {
    fn handle_boxed<'a>(
        &'a self,
        session: &'a mut ClientSession,
        message: &'a Delivery,
    ) -> Handled<'a> {
        Box::pin(self.handle(session, message))
    }
}
