//! Reading from the durable consumer: each pull no larger than the free
//! places among the held, so that every message JetStream sends is held,
//! and kept alive, from the moment it arrives; and what the handler sees of
//! a message read.
//!
//! A pull that fails is tried again after a pause; one that fails because
//! the consumer or its stream is gone ends the run, since no retry mends
//! that.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::held::{Held, Share};
use super::shared::{pause_unless, Shared};
use crate::contract::cloudevents::Event;
use crate::contract::header;
use crate::error::{Error, Result};
use crate::inbox::Delivery;
use crate::retry::Outage;

/// Reads messages from the durable consumer: pulls no larger than its
/// limit, each with a free place among the held for every message, and
/// room among all those kept.
pub(super) struct Pulling<'a> {
    pub(super) pull: &'a PullConsumer,
    pub(super) limit: usize,
    pub(super) holding: &'a Arc<Semaphore>,
    /// Every message held, with a place or waiting behind a key that waits
    /// without one: as many as a consumer created here lets JetStream
    /// deliver unacknowledged, whatever an existing one lets it.
    pub(super) room: &'a Arc<Semaphore>,
}

impl Pulling<'_> {
    /// Reads messages and hands them out until shutdown, or until the consumer
    /// ends. Each pull asks for as many messages as there are free places
    /// among the held, so every message JetStream sends is held, and kept
    /// alive, from the moment it arrives: none waits unseen in a client buffer
    /// while its ack wait runs out.
    pub(super) async fn until(
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
            // still comes is kept to be handed back. The expiry is judged
            // here too: a server that has sent part of a batch may send no
            // timeout when the pull expires (nats-server 2.9 does not), and
            // the client library then waits five seconds past the expiry
            // before it ends the batch, while nothing is pulled.
            let ends = tokio::time::Instant::now() + PULL_EXPIRES + PULL_EXPIRY_MARGIN;
            loop {
                let next = match tokio::time::timeout_at(ends, batch.next()).await {
                    Ok(Some(next)) => next,
                    Ok(None) | Err(_) => break,
                };
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

/// The most messages one pull may ask for: a place for each among the
/// held, and no more than the consumer's own `max_batch`.
pub(super) fn pull_limit(held_limit: usize, config: &jetstream::consumer::Config) -> usize {
    match usize::try_from(config.max_batch) {
        Ok(max_batch) if max_batch > 0 => held_limit.min(max_batch),
        _ => held_limit,
    }
}

/// How long one pull waits for messages before it is renewed; what the
/// consumer's shutdown may wait for the last pull's messages to come in.
pub(super) const PULL_EXPIRES: Duration = Duration::from_secs(1);

/// How long past its expiry a pull's batch is still read: more than a
/// round trip to the server, which counts the expiry from when the pull
/// reached it. A message sent later than that (over a link slower than
/// this) is not lost: unacknowledged, it comes again after the ack wait.
const PULL_EXPIRY_MARGIN: Duration = Duration::from_millis(250);

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

impl Shared {
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
    let (event, data) = match Event::read(&headers, &message.payload) {
        None => (None, message.payload.clone()),
        Some(Ok(read)) => (Some(read.event), read.data),
        Some(Err(error)) => {
            tracing::warn!(
                subject = %message.subject,
                %error,
                "a message handed over without its CloudEvents attributes"
            );
            (None, message.payload.clone())
        }
    };
    Delivery {
        subject: message.subject.to_string(),
        payload: message.payload.clone(),
        data,
        event,
        // A replayed message is known by its first delivery's id: an
        // inbox applies an outbox message once, whichever delivery brings it.
        message_id: find(header::REPLAY_OF).or_else(|| find(header::MSG_ID)),
        key: find(header::KEY),
        headers,
        stream_sequence,
        attempt: delivered.max(1),
    }
}
