//! The inbox, measured: how many messages a second it handles with a
//! trivial handler (one update each), against the same updates made
//! without it, in the same run; and the latency from an outbox commit to
//! the consumer's commit, with the relay in between.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use bson::{doc, oid::ObjectId, Document};
use futures::FutureExt;
use mongodb::Collection;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::load::{self, Clock, Keys, Load};
use super::process::Usage;
use super::{percentile, report, Bench, Mode};
use crate::config::NatsMode;
use crate::error::{Error, Result};
use crate::inbox::{handler, AfterCommit, Handler, Inbox, InboxMetrics};

/// Transactions at once, for the inbox and for the updates without it.
const CONCURRENCY: usize = 16;

/// Messages the end-to-end runs write a second: one the machine has room
/// for, and one nearer its limit.
const END_TO_END_RATES: [u32; 2] = [100, 500];

/// What the inbox costs.
#[derive(Debug, Clone, Serialize)]
pub struct InboxBench {
    pub messages: usize,
    pub concurrency: usize,
    /// Messages handled a second through the inbox (record and update in
    /// one transaction, acknowledged after the commit).
    pub inbox_rate: f64,
    /// The same, for messages without a `Nats-Msg-Id`: a transaction
    /// each, no record.
    pub transaction_rate: f64,
    /// The same updates, at the same concurrency, with no NATS and no
    /// transaction.
    pub plain_rate: f64,
    /// `inbox_rate` as a share of `plain_rate`.
    pub share_of_plain: f64,
    /// From just before an outbox commit to the consumer's commit, at
    /// each of the offered rates.
    pub end_to_end: Vec<EndToEnd>,
}

/// Outbox commit to consumer commit, through the relay.
#[derive(Debug, Clone, Serialize)]
pub struct EndToEnd {
    pub offered_rate: u32,
    pub messages: usize,
    pub received: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub relay: Usage,
}

impl Bench<'_> {
    /// Measures the inbox with `n` messages.
    pub(super) async fn inbox(&self, n: usize) -> Result<InboxBench> {
        let (prefix, _) = self.names("inbox");
        self.stream_for(&prefix).await?;
        let counters = self.database.collection::<Document>("inbox_counters");
        let inbox_rate = self.handled_rate(&prefix, "recorded", n, true).await?;
        let transaction_rate = self.handled_rate(&prefix, "unrecorded", n, false).await?;
        let plain_rate = plain_updates(&counters, n).await?;
        let mut end_to_end = Vec::with_capacity(END_TO_END_RATES.len());
        for rate in END_TO_END_RATES {
            end_to_end.push(self.end_to_end(rate).await?);
        }
        Ok(InboxBench {
            messages: n,
            concurrency: CONCURRENCY,
            inbox_rate,
            transaction_rate,
            plain_rate,
            share_of_plain: inbox_rate / plain_rate,
            end_to_end,
        })
    }

    /// Publishes `n` messages to `<prefix>.<name>` (with message ids if
    /// `recorded`), then times a consumer handling them all.
    async fn handled_rate(
        &self,
        prefix: &str,
        name: &str,
        n: usize,
        recorded: bool,
    ) -> Result<f64> {
        let subject = format!("{prefix}.{name}");
        let jetstream = jetstream::new(self.nats.clone());
        let progress = report::progress(n, &format!("publishing for the inbox ({name})"));
        for start in (0..n).step_by(1000) {
            let mut acks = Vec::with_capacity(1000);
            for i in start..n.min(start + 1000) {
                let mut headers = HeaderMap::new();
                if recorded {
                    headers.insert("Nats-Msg-Id", ObjectId::new().to_hex().as_str());
                }
                let body = format!("{{\"n\":{i}}}");
                let ack = jetstream
                    .publish_with_headers(subject.clone(), headers, body.into())
                    .await
                    .map_err(|e| Error::nats("publishing for the inbox benchmark failed", e))?;
                acks.push(ack);
            }
            for ack in acks {
                ack.await
                    .map_err(|e| Error::nats("publishing for the inbox benchmark failed", e))?;
            }
            progress.set_position(n.min(start + 1000) as u64);
        }
        progress.finish_and_clear();

        let metrics = InboxMetrics::new();
        let inbox = Inbox::builder(&self.database, name)
            .metrics(metrics.clone())
            .build()
            .await?;
        let consumer = inbox
            .consumer(jetstream, &prefix.to_uppercase())
            .filter_subject(&subject)
            .concurrency(CONCURRENCY)
            .bind()
            .await?;
        let counters = self.database.collection::<Document>("inbox_counters");
        let began = Instant::now();
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(count_into(counters), shutdown.clone()));
        let progress = report::progress(n, &format!("inbox handling ({name})"));
        let done = wait_for(n, Duration::from_secs(600), || {
            let handled = handled(&metrics, name);
            progress.set_position(handled);
            handled
        })
        .await;
        let seconds = began.elapsed().as_secs_f64();
        progress.finish_and_clear();
        shutdown.cancel();
        let _ = running.await;
        done?;
        Ok(n as f64 / seconds)
    }

    /// The relay in push mode between a producer and an inbox consumer:
    /// latency from just before each outbox commit to the consumer's commit.
    async fn end_to_end(&self, rate: u32) -> Result<EndToEnd> {
        let n = self.config.count;
        let tag = format!("inbox_e2e_{rate}");
        let (prefix, collection) = self.names(&tag);
        self.stream_for(&prefix).await?;
        // The collection and its indexes before any writer, as in the other
        // runs (see docs/developing.md on index builds).
        let outbox = self.database.collection::<Document>(&collection);
        crate::setup::ensure_sweep_index(&outbox).await?;
        let relay =
            self.start_relay(&tag, &collection, &prefix, Mode::Push(NatsMode::Jetstream))?;
        let (started, committed) = (Clock::default(), Clock::default());
        let inbox = Inbox::builder(&self.database, &tag).build().await?;
        let noted = committed.clone();
        let consumer = inbox
            .consumer(jetstream::new(self.nats.clone()), &prefix.to_uppercase())
            .concurrency(CONCURRENCY)
            .after_commit(Arc::new(move |delivery| {
                let id = delivery
                    .message_id
                    .as_deref()
                    .and_then(|id| ObjectId::parse_str(id).ok());
                if let Some(id) = id {
                    noted.note(id, Instant::now());
                }
                AfterCommit::Acknowledge
            }))
            .bind()
            .await?;
        let counters = self.database.collection::<Document>("inbox_counters");
        let shutdown = CancellationToken::new();
        let running = tokio::spawn(consumer.run(count_into(counters), shutdown.clone()));
        let outcome = self
            .produce_end_to_end(&collection, n, rate, &started, &committed)
            .await;
        shutdown.cancel();
        let _ = running.await;
        let usage = relay.usage();
        relay.stop(Duration::from_secs(15)).await;
        outcome?;
        let latencies = load::latencies(&started, &committed);
        Ok(EndToEnd {
            offered_rate: rate,
            messages: n,
            received: latencies.len(),
            p50_ms: percentile(&latencies, 0.50),
            p90_ms: percentile(&latencies, 0.90),
            p99_ms: percentile(&latencies, 0.99),
            max_ms: percentile(&latencies, 1.0),
            relay: usage,
        })
    }

    /// Writes `n` orders at the end-to-end rate and waits for the consumer
    /// to have committed them all.
    async fn produce_end_to_end(
        &self,
        collection: &str,
        n: usize,
        rate: u32,
        started: &Clock,
        committed: &Clock,
    ) -> Result<()> {
        // Messages first, one at a time, so the run starts with the relay
        // and the consumer ready.
        self.settle(collection, Keys::None, committed, "outbox to inbox")
            .await?;
        let progress = report::progress(n, "outbox to inbox");
        let load = Load {
            count: n,
            rate: Some(rate),
            keys: Keys::None,
        };
        load::produce(
            &self.client,
            &self.database,
            collection,
            load,
            started,
            &progress,
        )
        .await?;
        progress.finish_and_clear();
        // Counted with the first messages, written before them.
        wait_for(n + super::READY_MESSAGES, Duration::from_secs(120), || {
            committed.len() as u64
        })
        .await
    }
}

/// The trivial handler: one update per message, in its transaction.
fn count_into(counters: Collection<Document>) -> impl Handler {
    handler(move |session, message| {
        let counters = counters.clone();
        let slot = (message.stream_sequence % 1000) as i64;
        async move {
            counters
                .update_one(doc! { "_id": slot }, doc! { "$inc": { "n": 1 } })
                .upsert(true)
                .session(session)
                .await?;
            Ok(())
        }
        .boxed()
    })
}

/// The same updates as the handler's, `n` of them at the same concurrency,
/// with no NATS and no transaction: what the server does for them alone.
async fn plain_updates(counters: &Collection<Document>, n: usize) -> Result<f64> {
    let began = Instant::now();
    let mut workers = Vec::with_capacity(CONCURRENCY);
    for worker in 0..CONCURRENCY {
        let counters = counters.clone();
        workers.push(tokio::spawn(async move {
            for i in (worker..n).step_by(CONCURRENCY) {
                counters
                    .update_one(
                        doc! { "_id": (i % 1000) as i64 },
                        doc! { "$inc": { "n": 1 } },
                    )
                    .upsert(true)
                    .await
                    .map_err(|e| Error::mongo("benchmark update failed", e))?;
            }
            Ok::<(), Error>(())
        }));
    }
    for worker in workers {
        worker
            .await
            .map_err(|e| Error::Internal(format!("a benchmark worker stopped: {e}")))??;
    }
    Ok(n as f64 / began.elapsed().as_secs_f64())
}

/// What the consumer named `name` has handled so far.
fn handled(metrics: &InboxMetrics, name: &str) -> u64 {
    let line = format!("outbox_inbox_handled_total{{consumer=\"{name}\"}} ");
    let text = metrics.render();
    text.lines()
        .find_map(|l| l.strip_prefix(&line))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

/// Waits until `count()` reaches `n`, or gives up after `limit`.
async fn wait_for(n: usize, limit: Duration, mut count: impl FnMut() -> u64) -> Result<()> {
    let counted = |count: u64| usize::try_from(count).unwrap_or(usize::MAX);
    if load::wait_for_count(n, limit, || counted(count())).await {
        return Ok(());
    }
    Err(Error::Bench(format!(
        "the inbox consumer did not handle {n} messages within {}",
        humantime::format_duration(limit)
    )))
}
