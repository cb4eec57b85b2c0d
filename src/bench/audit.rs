//! The audit, measured: how fast `outbox-relay audit` checks a window of
//! delivered messages against their stream, and the memory it holds,
//! beside the floor of reading the same stream's headers alone.
//!
//! The window is made as a relay leaves it, without a relay: the outbox
//! documents marked `processed`, and a message for each in the stream
//! with its `Nats-Msg-Id`, published with a window of acknowledgements.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::DeliverPolicy};
use async_nats::HeaderMap;
use bson::{doc, oid::ObjectId, Document};
use futures::stream::{FuturesOrdered, StreamExt};
use futures::TryStreamExt;
use serde::Serialize;
use tokio::time::Instant;

use super::{Bench, Keys, Start};
use crate::audit::stream::headers_reader;
use crate::error::{Error, Result};

/// Documents inserted at a time, and publishes awaited together.
const FILL_BATCH: usize = 5_000;

/// What an audit of a window costs.
#[derive(Debug, Clone, Serialize)]
pub struct AuditBench {
    pub messages: usize,
    /// The audit's own time, from its summary (connecting included).
    pub seconds: f64,
    /// Messages audited a second.
    pub rate: f64,
    /// The audit process's peak resident memory.
    pub peak_memory_mib: Option<f64>,
    /// Reading the stream's headers alone, with the same consumer
    /// settings: the floor of the stream's half.
    pub stream_floor_seconds: f64,
    /// The same audit at its default pace (`--read-rate`, [`PACED`]).
    pub paced_seconds: f64,
    /// A relay's drain of a backlog of [`BESIDE`] messages, alone before
    /// and after, and while the paced audit runs on the same servers, in
    /// messages a second.
    pub drain_alone_rates: [f64; 2],
    pub drain_beside_audit_rate: f64,
}

/// The backlog a relay drains beside an audit.
const BESIDE: usize = 100_000;

/// The audit's default `--read-rate`, which the drain beside it runs with.
const PACED: &str = "10000";

impl Bench<'_> {
    /// Audits a window of `n` delivered messages.
    pub(super) async fn audit(&self, n: usize) -> Result<AuditBench> {
        let (prefix, collection) = self.names("audit");
        let stream = self.stream_for(&prefix).await?;
        self.fill_window(&collection, &prefix, n).await?;
        let floor = self.read_headers(&stream).await?;
        tracing::info!(messages = n, "auditing the window");
        let mut audit = self.audit_command(&collection, &prefix, "max");
        let output = audit
            .output()
            .await
            .map_err(|e| Error::io("cannot run the audit", e))?;
        let summary: serde_json::Value = serde_json::from_slice(&output.stdout).map_err(|e| {
            Error::Bench(format!(
                "the audit printed no report ({e}): {}",
                String::from_utf8_lossy(&output.stderr)
            ))
        })?;
        let delivered = summary["found"]["delivered"].as_u64();
        if delivered != Some(n as u64) {
            return Err(Error::Bench(format!(
                "the audit found {delivered:?} of {n} delivered messages: {summary}"
            )));
        }
        let seconds = summary["seconds"].as_f64().unwrap_or(f64::NAN);
        // A relay's drain, alone and then beside the same audit, once it
        // is reading.
        let alone = self
            .drain_named("alone", Keys::None, Start::First, BESIDE)
            .await?;
        let mut beside = self
            .audit_command(&collection, &prefix, PACED)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::io("cannot run the audit", e))?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let drained = self
            .drain_named("beside", Keys::None, Start::First, BESIDE)
            .await?;
        if let Ok(Some(_)) = beside.try_wait() {
            return Err(Error::Bench(
                "the audit ended before the drain beside it did: audit a larger window".into(),
            ));
        }
        let paced = beside
            .wait_with_output()
            .await
            .map_err(|e| Error::io("cannot run the audit", e))?;
        let paced: serde_json::Value = serde_json::from_slice(&paced.stdout)
            .map_err(|e| Error::Bench(format!("the paced audit printed no report ({e})")))?;
        // Alone again, after: the servers' pace drifts along a run.
        let after = self
            .drain_named("after", Keys::None, Start::First, BESIDE)
            .await?;
        Ok(AuditBench {
            messages: n,
            seconds,
            rate: n as f64 / seconds,
            peak_memory_mib: summary["peak_memory_mib"].as_f64(),
            stream_floor_seconds: floor.as_secs_f64(),
            paced_seconds: paced["seconds"].as_f64().unwrap_or(f64::NAN),
            drain_alone_rates: [BESIDE as f64 / alone.seconds, BESIDE as f64 / after.seconds],
            drain_beside_audit_rate: BESIDE as f64 / drained.seconds,
        })
    }

    /// `outbox-relay audit --all --json` of the window in `collection`,
    /// reading at most `rate` messages a second.
    fn audit_command(&self, collection: &str, prefix: &str, rate: &str) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&self.config.relay_binary);
        command
            .args([
                "audit",
                "--all",
                "--json",
                "--read-rate",
                rate,
                "--mongodb-uri",
            ])
            .arg(&self.config.mongodb_uri)
            .args([
                "--database",
                self.database.name(),
                "--collection",
                collection,
            ])
            .arg("--nats-url")
            .arg(&self.config.nats_url)
            .args(["--subject-prefix", prefix])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        command
    }

    /// `n` processed documents in `collection`, and a message for each
    /// under `prefix`.
    async fn fill_window(&self, collection: &str, prefix: &str, n: usize) -> Result<()> {
        let outbox = self.database.collection::<Document>(collection);
        let js = jetstream::new(self.nats.clone());
        let subject = format!("{prefix}.order.placed");
        let started = Instant::now();
        let mut left = n;
        while left > 0 {
            let batch = left.min(FILL_BATCH);
            left -= batch;
            let ids: Vec<ObjectId> = (0..batch).map(|_| ObjectId::new()).collect();
            let now = bson::DateTime::now();
            let documents = ids.iter().map(|id| {
                doc! {
                    "_id": id, "type": "order.placed", "payload": { "n": 1 },
                    "status": "processed", "processedAt": now,
                }
            });
            outbox
                .insert_many(documents)
                .await
                .map_err(|e| Error::mongo("filling the audited window failed", e))?;
            let mut acks = FuturesOrdered::new();
            for id in &ids {
                let mut headers = HeaderMap::new();
                headers.insert("Nats-Msg-Id", id.to_hex().as_str());
                headers.insert("Outbox-Type", "order.placed");
                let ack = js
                    .publish_with_headers(subject.clone(), headers, "{\"n\":1}".into())
                    .await
                    .map_err(|e| Error::Bench(format!("publishing the window failed: {e}")))?;
                acks.push_back(std::future::IntoFuture::into_future(ack));
            }
            while let Some(ack) = acks.next().await {
                ack.map_err(|e| Error::Bench(format!("storing the window failed: {e}")))?;
            }
        }
        tracing::info!(
            messages = n,
            seconds = started.elapsed().as_secs_f64(),
            "window written"
        );
        Ok(())
    }

    /// How long reading every header of `stream` takes.
    async fn read_headers(&self, stream: &str) -> Result<Duration> {
        let js = jetstream::new(self.nats.clone());
        let failed = |e: &dyn std::fmt::Display| Error::Bench(format!("reading {stream}: {e}"));
        let stream = js.get_stream(stream).await.map_err(|e| failed(&e))?;
        let started = Instant::now();
        let consumer = stream
            .create_consumer(headers_reader(DeliverPolicy::All))
            .await
            .map_err(|e| failed(&e))?;
        loop {
            let mut batch = consumer
                .fetch()
                .max_messages(1_000)
                .messages()
                .await
                .map_err(|e| failed(&e))?;
            let mut pending = None;
            while let Some(message) = batch.try_next().await.map_err(|e| failed(&e))? {
                pending = message.info().ok().map(|info| info.pending);
            }
            if pending.is_none_or(|left| left == 0) {
                break;
            }
        }
        Ok(started.elapsed())
    }
}
