//! An inbox consumer as a process of its own, for the tests that kill it
//! with SIGKILL mid-handling (`tests/servers/inbox/crash.rs`): 16
//! transactions at once, an ack wait of 5 s, and a handler that applies one
//! effect per message in the message's transaction. SIGTERM stops it
//! gracefully; it exits 0 once `Consumer::run` has returned cleanly.
//!
//! Each message's payload is `{"id", "key", "seq"}` (`key` and `seq` only
//! for keyed messages). The handler notes each run it begins, one line of
//! the message id, in the file `INBOX_RUNS`, before any write (so a run cut
//! short by a kill is noted too); in the transaction it adds 1 to the
//! effect document `{_id: id}` in `effects`, and appends `seq` to the key's
//! document `{_id: key}` in `key_order`, which so lists each key's effects
//! in the order they were applied.
//!
//! Settings (environment): MONGODB_URI, NATS_URL, INBOX_DATABASE,
//! INBOX_STREAM, INBOX_RUNS, INBOX_ROUND (noted with each keyed effect);
//! RUST_LOG for its log (to standard error).

use std::error::Error;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use bson::{doc, Document};
use mongodb::{ClientSession, Collection};
use outbox_relay::inbox::{Delivery, Handler, HandlerError, Inbox};
use serde::Deserialize;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
struct Payload {
    id: String,
    key: Option<String>,
    seq: Option<i64>,
}

struct Effects {
    effects: Collection<Document>,
    key_order: Collection<Document>,
    runs: Mutex<File>,
    /// This process's number among those a test starts (`INBOX_ROUND`).
    round: String,
}

impl Handler for Effects {
    async fn handle(
        &self,
        session: &mut ClientSession,
        message: &Delivery,
    ) -> Result<(), HandlerError> {
        let payload: Payload = message.json()?;
        {
            let mut runs = self.runs.lock().unwrap_or_else(|e| e.into_inner());
            // One write of one line to a file opened for appending: a kill
            // leaves whole lines.
            runs.write_all(format!("{}\n", payload.id).as_bytes())?;
        }
        self.effects
            .update_one(doc! { "_id": &payload.id }, doc! { "$inc": { "n": 1 } })
            .upsert(true)
            .session(&mut *session)
            .await?;
        if let (Some(key), Some(seq)) = (&payload.key, payload.seq) {
            // Which process applied it, from which stream position: what
            // a test shows when a key's order is broken.
            let applied = format!("{seq} by {} from {}", self.round, message.stream_sequence);
            self.key_order
                .update_one(
                    doc! { "_id": key },
                    doc! { "$push": { "seqs": seq, "applied": applied } },
                )
                .upsert(true)
                .session(&mut *session)
                .await?;
        }
        Ok(())
    }
}

fn setting(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("set {name}"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // Heard from the first moment: a SIGTERM that came while connecting
    // would otherwise end the process by the signal's default action.
    let shutdown = CancellationToken::new();
    let mut terminate = signal(SignalKind::terminate())?;
    let stop = shutdown.clone();
    tokio::spawn(async move {
        terminate.recv().await;
        stop.cancel();
    });
    let client = outbox_relay::connect::connect_mongodb(&setting("MONGODB_URI")?).await?;
    let db = client.database(&setting("INBOX_DATABASE")?);
    let nats = async_nats::connect(setting("NATS_URL")?).await?;
    let runs = OpenOptions::new()
        .create(true)
        .append(true)
        .open(setting("INBOX_RUNS")?)?;
    let inbox = Inbox::builder(&db, "crash").build().await?;
    let consumer = inbox
        .consumer(async_nats::jetstream::new(nats), &setting("INBOX_STREAM")?)
        .concurrency(16)
        .ack_wait(Duration::from_secs(5))
        .bind()
        .await?;
    let handler = Effects {
        effects: db.collection("effects"),
        key_order: db.collection("key_order"),
        runs: Mutex::new(runs),
        round: std::env::var("INBOX_ROUND").unwrap_or_default(),
    };
    tracing::info!(stop_bound = ?consumer.stop_bound(), "consuming");
    consumer.run(handler, shutdown).await?;
    tracing::info!("stopped");
    // At once: the runtime's teardown waits for nothing the test asks for.
    std::process::exit(0);
}
