//! Load and measurement: a producer that commits outbox messages at an
//! offered rate, and receivers that note when each one shows up.
//!
//! Producer and receivers share one process and one monotonic clock, so a
//! latency is a difference of two readings of the same clock: no skew.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};
use bytes::Bytes;
use futures::StreamExt;
use mongodb::{Client, Collection, Database};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::writer::{NewMessage, Outbox};

/// When things happened, by message id.
#[derive(Debug, Clone, Default)]
pub struct Clock(Arc<Mutex<HashMap<ObjectId, Instant>>>);

impl Clock {
    pub(crate) fn note(&self, id: ObjectId, at: Instant) {
        if let Ok(mut times) = self.0.lock() {
            times.entry(id).or_insert(at);
        }
    }

    pub fn len(&self) -> usize {
        self.0.lock().map(|t| t.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many of the ids `ids` noted this clock has noted too.
    pub(crate) fn count_of(&self, ids: &Clock) -> usize {
        let ids = ids.snapshot();
        self.0
            .lock()
            .map(|times| ids.keys().filter(|id| times.contains_key(id)).count())
            .unwrap_or(0)
    }

    fn snapshot(&self) -> HashMap<ObjectId, Instant> {
        self.0.lock().map(|t| t.clone()).unwrap_or_default()
    }
}

/// How a run's messages are keyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// No key: no order per key is kept.
    None,
    /// Message `n` has key `n % count`: many keys, each seldom twice in flight.
    Spread(u32),
    /// Every message has the same key: one line, one message on the wire.
    One,
}

impl Keys {
    /// The key of message `n`.
    pub fn of(&self, n: usize) -> Option<String> {
        match self {
            Keys::None => None,
            Keys::Spread(count) => Some(format!("k{}", n % (*count).max(1) as usize)),
            Keys::One => Some("hot".to_owned()),
        }
    }

    /// How results name it: "" for no keys.
    pub fn label(&self) -> String {
        match self {
            Keys::None => String::new(),
            Keys::Spread(count) => format!(", {count} keys"),
            Keys::One => ", one key".to_owned(),
        }
    }

    pub fn slug(&self) -> String {
        match self {
            Keys::None => String::new(),
            Keys::Spread(count) => format!("_k{count}"),
            Keys::One => "_hot".to_owned(),
        }
    }
}

/// What a producer writes: how many messages, how fast, keyed how.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub count: usize,
    /// Messages a second; `None` is as fast as the writers go.
    pub rate: Option<u32>,
    pub keys: Keys,
}

/// Latencies from `started` to `arrived`, for ids in both, sorted.
pub fn latencies(started: &Clock, arrived: &Clock) -> Vec<Duration> {
    let arrived = arrived.snapshot();
    let mut out: Vec<Duration> = started
        .snapshot()
        .into_iter()
        .filter_map(|(id, t0)| arrived.get(&id).map(|t1| t1.saturating_duration_since(t0)))
        .collect();
    out.sort();
    out
}

/// How long after the run's first write the slowest message was written:
/// a stall at the start is the relay warming up, one later is not.
pub fn slowest_at(started: &Clock, arrived: &Clock) -> Option<Duration> {
    let (started, arrived) = (started.snapshot(), arrived.snapshot());
    let first = started.values().min()?;
    started
        .iter()
        .filter_map(|(id, t0)| Some((arrived.get(id)?.saturating_duration_since(*t0), *t0)))
        .max()
        .map(|(_, t0)| t0.saturating_duration_since(*first))
}

/// Writes one order and its outbox message per transaction, paced at
/// `rate` per second (`None`: as fast as `workers` writers go), until
/// `count` are committed. Notes each commit's start in `started`.
pub async fn produce(
    client: &Client,
    database: &Database,
    collection: &str,
    load: Load,
    started: &Clock,
    progress: &indicatif::ProgressBar,
) -> Result<Duration> {
    let Load { count, rate, keys } = load;
    let workers = 8;
    let (tickets, queue) = async_channel::bounded::<usize>(workers * 4);
    let began = Instant::now();
    let mut writers = Vec::with_capacity(workers);
    for _ in 0..workers {
        let (client, queue, started, progress) = (
            client.clone(),
            queue.clone(),
            started.clone(),
            progress.clone(),
        );
        let outbox = Outbox::with_collection(database, collection);
        let orders = database.collection::<Document>("orders");
        writers.push(tokio::spawn(async move {
            while let Ok(n) = queue.recv().await {
                write_order(&client, &outbox, &orders, n, keys.of(n), &started).await?;
                progress.inc(1);
            }
            Ok::<(), Error>(())
        }));
    }
    let mut pace = rate.map(|r| tokio::time::interval(Duration::from_secs(1) / r.max(1)));
    for n in 0..count {
        if let Some(pace) = pace.as_mut() {
            pace.tick().await;
        }
        if tickets.send(n).await.is_err() {
            break;
        }
    }
    drop(tickets);
    for writer in writers {
        writer
            .await
            .map_err(|e| Error::Internal(format!("a benchmark writer stopped: {e}")))??;
    }
    Ok(began.elapsed())
}

/// One order and its message in a transaction, retried whole while the
/// server calls the failure transient (a write conflict, a stepdown), as a
/// MongoDB client must.
async fn write_order(
    client: &Client,
    outbox: &Outbox,
    orders: &Collection<Document>,
    n: usize,
    key: Option<String>,
    started: &Clock,
) -> Result<()> {
    let mut tries = 0;
    loop {
        tries += 1;
        match try_write_order(client, outbox, orders, n, key.clone(), started).await {
            Err(Error::Mongo { source, .. })
                if tries < 20
                    && source.contains_label(mongodb::error::TRANSIENT_TRANSACTION_ERROR) =>
            {
                tokio::time::sleep(Duration::from_millis(5 * tries)).await;
            }
            outcome => return outcome,
        }
    }
}

async fn try_write_order(
    client: &Client,
    outbox: &Outbox,
    orders: &Collection<Document>,
    n: usize,
    key: Option<String>,
    started: &Clock,
) -> Result<()> {
    let failed = |e| Error::mongo("benchmark write failed", e);
    let mut session = client.start_session().await.map_err(failed)?;
    session.start_transaction().await.map_err(failed)?;
    orders
        .insert_one(doc! { "n": n as i64, "total": 4200 })
        .session(&mut session)
        .await
        .map_err(failed)?;
    let mut message = NewMessage::serialized("order.placed", &doc! { "n": n as i64 })?;
    if let Some(key) = key {
        message = message.key(key);
    }
    let id = outbox.add(&mut session, message).await?;
    started.note(id, Instant::now());
    session.commit_transaction().await.map_err(failed)?;
    Ok(())
}

/// Notes when each message arrives on NATS under `prefix`.
pub async fn subscribe(
    nats: &async_nats::Client,
    prefix: &str,
    arrived: Clock,
    stop: CancellationToken,
) -> Result<()> {
    let mut subscriber = nats
        .subscribe(format!("{prefix}.>"))
        .await
        .map_err(|e| Error::nats("benchmark subscription failed", e))?;
    nats.flush()
        .await
        .map_err(|e| Error::nats("benchmark subscription failed", e))?;
    tokio::spawn(async move {
        loop {
            let message = tokio::select! {
                _ = stop.cancelled() => return,
                message = subscriber.next() => message,
            };
            let Some(message) = message else { return };
            let at = Instant::now();
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .and_then(|v| ObjectId::parse_str(v.as_str()).ok());
            if let Some(id) = id {
                arrived.note(id, at);
            }
        }
    });
    Ok(())
}

/// Where the floor's watcher forwards each insert it sees.
pub struct Forward {
    pub nats: async_nats::Client,
    pub subject: String,
}

impl Forward {
    /// Publishes each id sent to the returned channel as the relay would,
    /// named by `Nats-Msg-Id`, from a task of its own, so that the floor's
    /// watcher notes its times without waiting on NATS. A failed publish is
    /// a message the forward's timing misses, nothing more.
    fn start(self, stop: CancellationToken) -> mpsc::UnboundedSender<ObjectId> {
        let (ids, mut forwarding) = mpsc::unbounded_channel::<ObjectId>();
        tokio::spawn(async move {
            loop {
                let id = tokio::select! {
                    _ = stop.cancelled() => return,
                    id = forwarding.recv() => id,
                };
                let Some(id) = id else { return };
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.to_hex().as_str());
                let sent = self
                    .nats
                    .publish_with_headers(self.subject.clone(), headers, Bytes::new())
                    .await;
                if let Err(error) = sent {
                    tracing::warn!("the floor's forward of {id} failed: {error}");
                }
            }
        });
        ids
    }
}

/// The floor: a bare change stream on the collection, with the relay's own
/// pipeline, noting when each insert event arrives. No NATS, no marking:
/// what the database itself takes. It then forwards the insert, for the
/// floor with one NATS hop.
pub async fn watch_inserts(
    outbox: Collection<Document>,
    arrived: Clock,
    forward: Forward,
    stop: CancellationToken,
) -> Result<()> {
    let mut stream = outbox
        .watch()
        .pipeline(crate::source::change_stream::new_messages(
            crate::partition::Partition::WHOLE,
        ))
        .max_await_time(super::MAX_AWAIT_TIME)
        .await
        .map_err(|e| Error::mongo("benchmark change stream failed", e))?;
    let forward = forward.start(stop.clone());
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                _ = stop.cancelled() => return,
                event = stream.next() => event,
            };
            let at = Instant::now();
            match event {
                Some(Ok(event)) => {
                    if let Some(id) = event
                        .document_key
                        .as_ref()
                        .and_then(|k| k.get_object_id("_id").ok())
                    {
                        arrived.note(id, at);
                        let _ = forward.send(id);
                    }
                }
                _ => return,
            }
        }
    });
    Ok(())
}

/// Opens one bare change stream per partition of `partitions` on
/// `outbox`, each with the partition's `$match` as a relay's stream has
/// it, and counts the events all of them read into `seen`, until `stop`:
/// what the server serves a group, with no relay.
pub async fn watch_partitions(
    outbox: Collection<Document>,
    partitions: u32,
    seen: Arc<AtomicUsize>,
    stop: CancellationToken,
) -> Result<()> {
    for partition in crate::partition::Partition::all(partitions) {
        let mut stream = outbox
            .watch()
            .pipeline(crate::source::change_stream::new_messages(partition))
            .max_await_time(super::MAX_AWAIT_TIME)
            .await
            .map_err(|e| Error::mongo("benchmark change stream failed", e))?;
        let (seen, stop) = (seen.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    _ = stop.cancelled() => return,
                    event = stream.next() => event,
                };
                match event {
                    Some(Ok(_)) => {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => return,
                }
            }
        });
    }
    Ok(())
}

/// Waits until `arrived` holds `expected` ids, or `limit` passes.
pub async fn wait_for(arrived: &Clock, expected: usize, limit: Duration) -> bool {
    wait_for_count(expected, limit, || arrived.len()).await
}

/// Waits until `count()` reaches `expected`; false if `limit` passes first.
pub(crate) async fn wait_for_count(
    expected: usize,
    limit: Duration,
    mut count: impl FnMut() -> usize,
) -> bool {
    let deadline = Instant::now() + limit;
    while count() < expected {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}
