//! The NATS publisher: JetStream with acknowledgements, or core NATS.

use std::error::Error as _;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, ErrorCode};
use async_nats::{ConnectOptions, Event, HeaderMap};
use futures::future::{BoxFuture, FutureExt};

use super::{Ack, AckFuture, PublishError, Publisher};
use crate::config::{redact_uri, NatsMode, RelayConfig};
use crate::contract::{ContractViolation, OutboxMessage};
use crate::error::{Error, Result};

/// Publishes to NATS, acknowledged by JetStream or flushed on core NATS.
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    jetstream: Option<jetstream::Context>,
    ack_timeout: Duration,
}

impl NatsPublisher {
    /// Connects to the configured NATS server. The connection then reconnects
    /// by itself for as long as the relay runs; only the first connection
    /// must succeed.
    pub async fn connect(config: &RelayConfig) -> Result<Self> {
        let client = connect(&config.nats_url, config.ack_timeout).await?;
        Ok(Self::from_client(
            client,
            config.nats_mode,
            config.ack_timeout,
        ))
    }

    /// Wraps a connected client.
    pub fn from_client(client: async_nats::Client, mode: NatsMode, ack_timeout: Duration) -> Self {
        let jetstream = match mode {
            NatsMode::Jetstream => Some(
                jetstream::ContextBuilder::new()
                    .timeout(ack_timeout)
                    .backpressure_on_inflight(true)
                    .max_ack_inflight(4096)
                    .build(client.clone()),
            ),
            NatsMode::Core => None,
        };
        NatsPublisher {
            client,
            jetstream,
            ack_timeout,
        }
    }

    /// The underlying client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    async fn send_jetstream(
        &self,
        context: &jetstream::Context,
        message: &OutboxMessage,
    ) -> Result<AckFuture, PublishError> {
        let pending = context
            .publish_with_headers(
                message.subject.clone(),
                headers(message),
                message.body.clone(),
            )
            .await
            .map_err(classify_jetstream)?;
        Ok(async move {
            let ack = pending.await.map_err(classify_jetstream)?;
            Ok(Ack {
                duplicate: ack.duplicate,
            })
        }
        .boxed())
    }

    async fn send_core(&self, message: &OutboxMessage) -> Result<AckFuture, PublishError> {
        self.client
            .publish_with_headers(
                message.subject.clone(),
                headers(message),
                message.body.clone(),
            )
            .await
            .map_err(|e| match e.kind() {
                async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                    PublishError::Invalid(ContractViolation::new(e.to_string()))
                }
                _ => PublishError::Unavailable(e.to_string()),
            })?;
        let client = self.client.clone();
        let timeout = self.ack_timeout;
        Ok(async move {
            match tokio::time::timeout(timeout, client.flush()).await {
                Ok(Ok(())) => Ok(Ack::default()),
                Ok(Err(e)) => Err(PublishError::Unavailable(format!("flush failed: {e}"))),
                Err(_) => Err(PublishError::Unavailable(format!(
                    "flush not done within {timeout:?}"
                ))),
            }
        }
        .boxed())
    }
}

impl Publisher for NatsPublisher {
    fn send<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>> {
        match &self.jetstream {
            Some(context) => self.send_jetstream(context, message).boxed(),
            None => self.send_core(message).boxed(),
        }
    }

    fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }
}

/// Connects to NATS, logging connection changes once each.
pub(crate) async fn connect(url: &str, timeout: Duration) -> Result<async_nats::Client> {
    ConnectOptions::new()
        .name("outbox-relay")
        .connection_timeout(timeout)
        .max_reconnects(None)
        .event_callback(|event| async move {
            match event {
                Event::Disconnected => tracing::warn!("disconnected from NATS; reconnecting"),
                Event::Connected => tracing::info!("connected to NATS"),
                other => tracing::debug!(event = %other, "NATS connection event"),
            }
        })
        .connect(url)
        .await
        .map_err(|e| {
            Error::nats(
                format!(
                    "cannot connect to {}; check --nats-url and that nats-server is running",
                    redact_uri(url)
                ),
                e,
            )
        })
}

fn headers(message: &OutboxMessage) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in &message.headers {
        map.append(name.as_str(), value.as_str());
    }
    map
}

/// Sorts a JetStream publish error by whose fault it is.
fn classify_jetstream(error: async_nats::jetstream::context::PublishError) -> PublishError {
    let detail = match error.source() {
        Some(source) => format!("{error}: {source}"),
        None => error.to_string(),
    };
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => {
            PublishError::Invalid(ContractViolation::new(detail))
        }
        PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
            PublishError::Refused(detail)
        }
        PublishErrorKind::StreamNotFound => PublishError::Unavailable(format!(
            "no JetStream stream captures the subject ({detail}); create one, or start the \
             relay with --create-stream NAME"
        )),
        PublishErrorKind::TimedOut
        | PublishErrorKind::BrokenPipe
        | PublishErrorKind::MaxAckPending => PublishError::Unavailable(detail),
        PublishErrorKind::Other => {
            let api_error = error
                .source()
                .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>());
            match api_error {
                Some(api) if broker_side(api.error_code()) => PublishError::Unavailable(detail),
                Some(_) => PublishError::Refused(detail),
                None => PublishError::Unavailable(detail),
            }
        }
    }
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
}

impl StreamSetup {
    /// A stream named `name` for every subject under `prefix`.
    pub fn for_prefix(name: impl Into<String>, prefix: &str) -> Self {
        StreamSetup {
            name: name.into(),
            subjects: vec![format!("{prefix}.>")],
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
