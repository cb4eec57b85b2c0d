//! The poison suite: documents, events and faults that must not stop the
//! relay, against the real servers.
//!
//! Each test puts poison among good messages and checks the same things:
//! every good message is delivered and marked, the poison ends as the
//! docs/outbox-document.md says (`failed` with a reason, or skipped), nothing reached a
//! subject NATS keeps for itself, and the relay stays alive and answers
//! `/healthz`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{free_port, get, header, wait_until, write_orders, TestEnv, WAIT};
use async_nats::jetstream;
use bson::{doc, oid::ObjectId, Bson, Document};
use futures::StreamExt;
use outbox_relay::{Metrics, Relay, RelayConfig, RelayMode};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A relay in this process, with its metrics and endpoints.
struct Observed {
    metrics: Metrics,
    port: u16,
    shutdown: CancellationToken,
    handle: JoinHandle<outbox_relay::Result<()>>,
}

impl Observed {
    async fn start(mut config: RelayConfig) -> Self {
        let port = free_port();
        config.metrics_addr = Some(([127, 0, 0, 1], port).into());
        let metrics = Metrics::new();
        let relay = Relay::connect_observed(config, metrics.clone())
            .await
            .expect("relay connects");
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(relay.run(shutdown.clone()));
        wait_until("the endpoints to answer", || async {
            get(port, "/healthz").await.is_some()
        })
        .await;
        Observed {
            metrics,
            port,
            shutdown,
            handle,
        }
    }

    /// A sample of the relay's metrics, 0 if it has none yet.
    fn sample(&self, series: &str) -> f64 {
        self.metrics
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    async fn assert_alive(&self) {
        let health = get(self.port, "/healthz").await;
        assert_eq!(health.map(|(status, _)| status), Some(200));
    }

    async fn readiness(&self) -> (u16, String) {
        get(self.port, "/readyz").await.expect("/readyz answers")
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("the relay stops in time")
            .expect("the relay task")
            .expect("the relay stops cleanly");
    }
}

/// Every subject a message carrying one of the watched ids reached.
#[derive(Clone, Default)]
struct Sightings(Arc<Mutex<HashMap<String, Vec<String>>>>);

impl Sightings {
    /// Listens on every subject of the account (`>` covers `$JS.…` and
    /// `_INBOX.…` too).
    async fn watch(env: &TestEnv) -> Self {
        let sightings = Sightings::default();
        let mut all = env.nats.subscribe(">").await.expect("subscribe to >");
        env.nats.flush().await.expect("flush");
        let seen = sightings.clone();
        tokio::spawn(async move {
            while let Some(message) = all.next().await {
                if let Some(id) = header(&message, "Nats-Msg-Id") {
                    if let Ok(mut seen) = seen.0.lock() {
                        seen.entry(id)
                            .or_default()
                            .push(message.subject.to_string());
                    }
                }
            }
        });
        sightings
    }

    fn of(&self, id: &ObjectId) -> Vec<String> {
        self.0
            .lock()
            .map(|seen| seen.get(&id.to_hex()).cloned().unwrap_or_default())
            .unwrap_or_default()
    }
}

/// Settings that make refusals, retries and sweeps quick.
fn quick(env: &TestEnv) -> RelayConfig {
    let mut config = env.quick_config(2);
    config.sweep_interval = Duration::from_millis(100);
    config.grace_period = Duration::from_millis(300);
    config.ack_timeout = Duration::from_millis(500);
    config.collect_interval = Duration::from_millis(100);
    config
}

/// A pending document as a foreign writer would insert it.
fn pending(extra: Document) -> (ObjectId, Document) {
    let id = ObjectId::new();
    let mut document = doc! { "_id": id, "type": "poison", "payload": {}, "status": "pending" };
    document.extend(extra);
    (id, document)
}

async fn find(env: &TestEnv, id: impl Into<Bson>) -> Document {
    env.outbox()
        .find_one(doc! { "_id": id.into() })
        .await
        .expect("read the document")
        .expect("the document exists")
}

/// Waits until the document is `failed` and returns its `lastError`.
async fn failed_with(env: &TestEnv, id: impl Into<Bson>) -> String {
    let id = id.into();
    env.wait_count(doc! { "_id": id.clone(), "status": "failed" }, 1)
        .await;
    find(env, id)
        .await
        .get_str("lastError")
        .map(str::to_owned)
        .unwrap_or_default()
}

async fn stream_exists(env: &TestEnv) -> bool {
    env.jetstream.get_stream(&env.stream).await.is_ok()
}

#[tokio::test]
async fn poison_documents_fail_alone_while_good_messages_flow() {
    let env = TestEnv::new().await;
    let sightings = Sightings::watch(&env).await;
    // An allowed space that no JetStream stream captures.
    let uncaptured = format!("x{}", env.prefix);
    let mut config = quick(&env);
    config.allow_subject = vec![format!("{uncaptured}.>")];
    let relay = Observed::start(config).await;

    let mut good = write_orders(&env, 3).await;
    let long = format!("{}.{}", env.prefix, "a".repeat(600));
    let delete_stream = format!("$JS.API.STREAM.DELETE.{}", env.stream);
    let cases = [
        // No stream captures it; this test's own `>` subscription answers
        // for the subject, so the publish times out instead of finding no
        // responders. Either way the broker takes other messages.
        (
            doc! { "subject": format!("{uncaptured}.invoice") },
            "while the broker takes other messages",
        ),
        (doc! { "subject": &delete_stream }, "reserved to NATS"),
        (doc! { "subject": "$KV.bucket.key" }, "reserved to NATS"),
        (doc! { "subject": "_INBOX.abc.1" }, "reserved to NATS"),
        (
            doc! { "subject": format!("other{}.x", env.prefix) },
            "--allow-subject",
        ),
        (doc! { "subject": &long }, "the limit is 512"),
        (
            doc! { "headers": { "Nats-Expected-Last-Sequence": "1" }, "attempts": "x" },
            "reserved to the relay",
        ),
        (
            doc! { "headers": { "nats-rollup": "all" } },
            "reserved to the relay",
        ),
        (
            doc! { "subject": format!("{uncaptured}.a"), "attempts": "x" },
            "gave up after 2 attempts",
        ),
        (
            doc! { "subject": format!("{uncaptured}.b"), "attempts": 2.5 },
            "gave up after 2 attempts",
        ),
        // Relay fields a writer forged to dodge the relay's fences: an
        // operator where a count belongs, a claim that never goes stale.
        (
            doc! { "type": "a b", "attempts": { "$exists": false } },
            "a space or a control character",
        ),
        (
            doc! {
                "type": "a b",
                "lockId": ObjectId::new(),
                "lockedAt": bson::DateTime::parse_rfc3339_str("2999-01-01T00:00:00Z")
                    .expect("a date"),
            },
            "a space or a control character",
        ),
    ];
    let mut poison = Vec::new();
    for (extra, reason) in cases {
        let (id, document) = pending(extra);
        env.outbox().insert_one(document).await.expect("insert");
        poison.push((id, reason));
        good.extend(write_orders(&env, 1).await);
    }

    // Too large for a change event: the stream passes a stub, and the
    // sweep reads the document and fails it.
    let (huge, document) = at_the_size_limit();
    env.outbox()
        .insert_one(document)
        .await
        .expect("insert at the limit");
    poison.push((huge, ""));
    good.extend(write_orders(&env, 1).await);

    for (id, reason) in &poison {
        let error = failed_with(&env, *id).await;
        assert!(error.contains(reason), "{id}: {error:?} lacks {reason:?}");
        let reached: Vec<String> = sightings
            .of(id)
            .into_iter()
            .filter(|s| s.starts_with('$') || s.starts_with("_INBOX"))
            .collect();
        assert!(reached.is_empty(), "{id} reached {reached:?}");
    }
    for (id, _) in &poison[8..10] {
        let attempts = find(&env, *id).await.get("attempts").cloned();
        assert_eq!(
            attempts,
            Some(Bson::Int32(2)),
            "the relay counts its own attempts"
        );
    }
    env.wait_count(
        doc! { "_id": { "$in": &good }, "status": "processed" },
        good.len() as u64,
    )
    .await;
    assert!(
        stream_exists(&env).await,
        "the relay's stream is still there"
    );
    assert_eq!(env.stream_count().await, good.len() as u64);
    relay.assert_alive().await;
    assert_eq!(relay.readiness().await.0, 200);
    relay.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn misfit_fields_neither_hide_nor_wedge_a_message() {
    let env = TestEnv::new().await;
    let outbox = env.outbox();
    let misfits = [
        doc! { "nextAttemptAt": "soon" },
        doc! { "nextAttemptAt": 5 },
        doc! { "lockedAt": 5 },
        doc! { "lockId": "junk", "attempts": -3 },
    ];
    let mut delivered = Vec::new();
    for extra in misfits {
        let (id, document) = pending(extra);
        outbox.insert_one(document).await.expect("insert");
        delivered.push(id);
    }
    for id in [Bson::Int32(42), Bson::String("order-7".into())] {
        outbox
            .insert_one(doc! { "_id": id, "type": "t", "payload": {}, "status": "pending" })
            .await
            .expect("insert");
    }
    let depths = outbox_relay::outbox_state::Depths::read(&outbox)
        .await
        .expect("depths");
    assert_eq!(depths.pending, 6, "every pending document is counted");
    assert!(depths.oldest_pending.is_some());

    // Poll mode: the sweep alone must find them all.
    let mut config = quick(&env);
    config.mode = RelayMode::Poll;
    config.poll_interval = Duration::from_millis(100);
    let relay = Observed::start(config).await;
    env.wait_count(
        doc! { "_id": { "$in": &delivered }, "status": "processed" },
        delivered.len() as u64,
    )
    .await;
    for id in [Bson::Int32(42), Bson::String("order-7".into())] {
        let error = failed_with(&env, id).await;
        assert!(error.contains("_id must be an ObjectId"), "{error}");
    }
    relay.assert_alive().await;
    relay.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_document_no_update_can_change_is_skipped_not_published_again_and_again() {
    let env = TestEnv::new().await;
    // A validator that lets a `stuck` document be nothing but pending.
    env.db
        .run_command(doc! {
            "collMod": "outbox",
            "validator": { "$or": [ { "stuck": { "$exists": false } }, { "status": "pending" } ] },
        })
        .await
        .expect("give the outbox a validator");
    let sightings = Sightings::watch(&env).await;
    let (stuck, document) = pending(doc! { "stuck": true });
    env.outbox().insert_one(document).await.expect("insert");
    let (huge, document) = at_the_size_limit();
    env.outbox()
        .insert_one(document)
        .await
        .expect("insert at the limit");
    let good = write_orders(&env, 3).await;

    // Poll mode: only the sweep publishes, so every publish is one it chose.
    let mut config = quick(&env);
    config.mode = RelayMode::Poll;
    config.poll_interval = Duration::from_millis(100);
    let relay = Observed::start(config).await;
    env.wait_count(doc! { "_id": huge, "status": "failed" }, 1)
        .await;
    env.wait_count(
        doc! { "_id": { "$in": &good }, "status": "processed" },
        good.len() as u64,
    )
    .await;
    wait_until("the stuck document to be reported", || async {
        relay.sample("outbox_unmarkable_total") >= 1.0
    })
    .await;
    // Ten sweep passes, each of which could publish it again.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let later = write_orders(&env, 1).await;
    env.wait_count(doc! { "_id": later[0], "status": "processed" }, 1)
        .await;
    assert_eq!(
        sightings.of(&stuck).len(),
        1,
        "published once, then skipped"
    );
    assert_eq!(find(&env, stuck).await.get_str("status"), Ok("pending"));
    assert_eq!(relay.sample("outbox_unmarkable_total"), 1.0);
    relay.assert_alive().await;
    relay.stop().await;
    env.drop().await;
}

/// A pending document of exactly 16 MiB: too large for NATS, and too large
/// to take a failure's reason, so it is failed with the least change.
fn at_the_size_limit() -> (ObjectId, Document) {
    let (id, mut document) = pending(doc! { "payload": "" });
    let overhead = bson::to_vec(&document).expect("encode").len();
    document.insert("payload", "x".repeat(16 * 1024 * 1024 - overhead));
    (id, document)
}

#[tokio::test]
async fn a_full_stream_pauses_delivery_instead_of_dead_lettering_everything() {
    let env = TestEnv::new().await;
    let mut stream = env
        .jetstream
        .get_stream(&env.stream)
        .await
        .expect("the stream");
    let mut limited = stream.cached_info().config.clone();
    limited.max_messages = 2;
    limited.discard = jetstream::stream::DiscardPolicy::New;
    env.jetstream
        .update_stream(limited.clone())
        .await
        .expect("limit the stream");
    let relay = Observed::start(quick(&env)).await;
    let ids = write_orders(&env, 6).await;
    wait_until("readiness to report the pause", || async {
        let (status, body) = relay.readiness().await;
        status == 503 && body.contains("delivery: paused")
    })
    .await;
    relay.assert_alive().await;
    assert_eq!(env.count(doc! { "status": "failed" }).await, 0);
    assert_eq!(env.count(doc! { "attempts": { "$exists": true } }).await, 0);

    limited.max_messages = -1;
    env.jetstream
        .update_stream(limited)
        .await
        .expect("lift the limit");
    env.wait_count(
        doc! { "_id": { "$in": &ids }, "status": "processed" },
        ids.len() as u64,
    )
    .await;
    assert_eq!(env.count(doc! { "status": "failed" }).await, 0);
    wait_until("readiness to return", || async {
        relay.readiness().await.0 == 200
    })
    .await;
    assert_eq!(stream.info().await.expect("info").state.messages, 6);
    relay.stop().await;
    env.drop().await;
}

/// Drops what `drop` names under a running relay, checks that the relay
/// stays alive and says it cannot tail, then recreates the collection and
/// checks that what is written afterwards is delivered.
async fn dropped_under_a_running_relay(drop_database: bool) {
    let env = TestEnv::new().await;
    let mut config = quick(&env);
    // Dropping the database drops the checkpoint document, lease and all:
    // a renewal or an idle checkpoint write after the drop would end the
    // term before the stream's end is seen. Neither comes during the test,
    // so what is checked is the stream's own handling of the drop.
    config.idle_checkpoint_interval = Duration::from_secs(3600);
    config.lease_duration = Duration::from_secs(3600);
    config.lease_renew_interval = Duration::from_secs(1800);
    let relay = Observed::start(config).await;
    // Tailing before the writes: a first start's catch-up pass may deliver
    // them before the stream is open, and the relay is ready only after.
    crate::common::ready_as(relay.port, crate::common::LEADING).await;
    let before = write_orders(&env, 2).await;
    env.wait_count(doc! { "status": "processed" }, 2).await;
    let (status, body) = relay.readiness().await;
    assert_eq!(status, 200, "{before:?}: {body}");

    if drop_database {
        env.db.drop().await.expect("drop the database");
    } else {
        env.outbox().drop().await.expect("drop the collection");
    }
    wait_until("the relay to notice the stream ended", || async {
        relay.sample("outbox_change_stream_ended_total") >= 1.0
    })
    .await;
    relay.assert_alive().await;
    assert_eq!(relay.readiness().await.0, 503);

    // Recreated with its indexes before writers return (see docs/developing.md,
    // SecantusDB: an index build can miss concurrent inserts).
    env.db
        .create_collection("outbox")
        .await
        .expect("recreate the outbox");
    outbox_relay::setup::ensure_sweep_index(&env.outbox())
        .await
        .expect("index it");
    let after = write_orders(&env, 3).await;
    env.wait_count(
        doc! { "_id": { "$in": &after }, "status": "processed" },
        after.len() as u64,
    )
    .await;
    wait_until("readiness to return", || async {
        relay.readiness().await.0 == 200
    })
    .await;
    relay.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_dropped_collection_is_waited_for_and_delivery_resumes() {
    dropped_under_a_running_relay(false).await;
}

#[tokio::test]
async fn a_dropped_database_is_waited_for_and_delivery_resumes() {
    dropped_under_a_running_relay(true).await;
}

#[tokio::test]
async fn sweep_once_gives_up_on_a_broker_that_takes_nothing() {
    let env = TestEnv::new().await;
    env.jetstream
        .publish(format!("{}.fill", env.prefix), "x".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let mut config = env
        .jetstream
        .get_stream(&env.stream)
        .await
        .expect("the stream")
        .cached_info()
        .config
        .clone();
    config.max_messages = 1;
    config.discard = jetstream::stream::DiscardPolicy::New;
    env.jetstream
        .update_stream(config)
        .await
        .expect("fill the stream");
    let ids = write_orders(&env, 3).await;

    // One message a pass, so that passes come back full until the end.
    let run = tokio::process::Command::from(crate::common::relay_command(&env))
        .args(["sweep", "--once", "--give-up-after", "1s"])
        .env("OUTBOX_BATCH_SIZE", "1")
        .env("OUTBOX_GRACE_PERIOD", "0s")
        .env("OUTBOX_METRICS_ADDR", "off")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(WAIT, run)
        .await
        .expect("sweep --once ends by itself")
        .expect("run outbox-relay");
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(9), "{said}");
    assert!(said.contains("gave up"), "{said}");
    let untouched = doc! {
        "_id": { "$in": &ids },
        "status": "pending",
        "lockId": { "$exists": false },
        "attempts": { "$exists": false },
    };
    assert_eq!(
        env.count(untouched).await,
        3,
        "uncharged, and the claims released"
    );
    env.drop().await;
}

#[tokio::test]
async fn a_broker_that_refuses_every_message_dead_letters_none() {
    let env = TestEnv::new().await;
    // The relay's user may publish nothing under the prefix any more.
    let nats = crate::common::NatsProcess::start_with(
        &format!(
            "authorization {{ users: [ {{ user: relay, password: secret, permissions: \
             {{ publish: {{ allow: [\">\"], deny: [\"{}.>\"] }} }} }} ] }}",
            env.prefix
        ),
        Some("relay"),
    )
    .await;
    env.create_stream_on(&nats.url()).await;
    let ids = write_orders(&env, 3).await;
    let mut config = quick(&env);
    config.nats_url = nats.url();
    config.mode = RelayMode::Poll;
    config.poll_interval = Duration::from_millis(100);
    let relay = Observed::start(config).await;

    wait_until("every message to run out of attempts", || async {
        relay.sample("outbox_dead_letters_held_total") >= ids.len() as f64
    })
    .await;
    // Counted once its write landed: the documents already say so.
    let held = doc! { "_id": { "$in": &ids }, "lastError": { "$regex": "not failed" } };
    assert_eq!(env.count(held).await, ids.len() as u64);
    assert_eq!(env.count(doc! { "status": "failed" }).await, 0);
    let held = find(&env, ids[0]).await;
    let error = held.get_str("lastError").unwrap_or_default();
    assert!(error.contains("not failed"), "{held}");
    relay.assert_alive().await;
    relay.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_message_its_stream_never_acknowledges_counts_every_send_again() {
    let env = TestEnv::new().await;
    let sightings = Sightings::watch(&env).await;
    // An allowed stream that stores what it is sent and never answers
    // (`no_ack`), its duplicate window shorter than the retry's delay: each
    // publish times out while the broker takes other messages, so the
    // message is refused as its own, and a retry is stored again.
    let silent = format!("s{}", env.prefix);
    let window = Duration::from_secs(1);
    env.jetstream
        .create_stream(jetstream::stream::Config {
            name: silent.to_uppercase(),
            subjects: vec![format!("{silent}.>")],
            no_ack: true,
            duplicate_window: window,
            ..Default::default()
        })
        .await
        .expect("create the silent stream");
    let mut config = quick(&env);
    config.allow_subject = vec![format!("{silent}.>")];
    config.retry_initial_delay = window * 2;
    config.retry_max_delay = window * 2;
    let relay = Observed::start(config).await;
    // Evidence that the broker takes other messages, before and after.
    write_orders(&env, 2).await;
    let (id, document) = pending(doc! { "subject": format!("{silent}.m") });
    env.outbox().insert_one(document).await.expect("insert");
    let reason = failed_with(&env, id).await;
    assert!(reason.contains("gave up after 2 attempts"), "{reason}");
    write_orders(&env, 1).await;

    let sends = sightings.of(&id).len();
    assert_eq!(
        sends, 4,
        "each of two attempts sent once, and once more in doubt"
    );
    let mut stream = env
        .jetstream
        .get_stream(silent.to_uppercase())
        .await
        .expect("the silent stream");
    let stored = stream.info().await.expect("its info").state.messages;
    assert!(
        stored >= 2,
        "a retry past the window is stored again ({stored} stored): the case the docs list"
    );
    assert_eq!(
        relay.sample("outbox_resent_total"),
        (sends - 1) as f64,
        "every send after the first is counted"
    );
    relay.stop().await;
    env.jetstream
        .delete_stream(silent.to_uppercase())
        .await
        .expect("delete the silent stream");
    env.drop().await;
}
