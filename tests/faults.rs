//! Fault injection: messages are written in transactions by a real client
//! while relays are killed, servers stop and tokens are lost. Afterwards the
//! JetStream stream must hold exactly the committed outbox messages: none
//! missing, none extra, none from an aborted transaction, and each key's
//! messages in commit order. Each scenario
//! reports the raw publishes (a core subscriber counts every one) and, for
//! leader changes, how long delivery paused, to `target/fault-report.jsonl`.
//!
//! The scenarios run one at a time: they start and kill processes and
//! servers, and their figures mean more without each other's load.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use common::{
    manifest_dir, MongoProcess, NatsProcess, RelayProcess, TestEnv, QUICK_TAKEOVER, WAIT,
};
use futures::{StreamExt, TryStreamExt};
use outbox_relay::{NewMessage, Outbox};
use tokio_util::sync::CancellationToken;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The longest a scenario waits for everything to be delivered at the end:
/// a bound for a relay that stopped, not a speed to meet. SecantusDB's
/// Python build drains about a hundred messages a second here with the
/// test's reads beside it, so 6,000 take about a minute on an idle machine.
const DRAIN: Duration = Duration::from_secs(240);

/// Every publish seen on the scenario's subjects, with when it arrived.
#[derive(Clone, Default)]
struct Publishes(Arc<Mutex<Vec<(String, Instant)>>>);

impl Publishes {
    async fn watch(env: &TestEnv) -> Self {
        let publishes = Publishes::default();
        let mut subscriber = env
            .nats
            .subscribe(format!("{}.>", env.prefix))
            .await
            .unwrap();
        env.nats.flush().await.unwrap();
        let sink = publishes.clone();
        tokio::spawn(async move {
            while let Some(message) = subscriber.next().await {
                if let Some(id) = common::msg_id(&message) {
                    if let Ok(mut all) = sink.0.lock() {
                        all.push((id, Instant::now()));
                    }
                }
            }
        });
        publishes
    }

    fn count(&self) -> usize {
        self.0.lock().map(|all| all.len()).unwrap_or(0)
    }

    /// The longest time without any publish between `from` and `to`: with
    /// messages committed every 20 ms, the pause a fault caused.
    /// The window starts a second before `from`, so the last publishes
    /// before the fault are in it.
    fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let from = from.checked_sub(Duration::from_secs(1)).unwrap_or(from);
        let Ok(all) = self.0.lock() else {
            return Duration::ZERO;
        };
        let mut times: Vec<Instant> = all
            .iter()
            .map(|(_, at)| *at)
            .filter(|at| *at >= from && *at <= to)
            .collect();
        times.sort();
        times
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }

    /// The first publish arriving after `since`.
    fn first_after(&self, since: Instant) -> Option<Instant> {
        let all = self.0.lock().ok()?;
        all.iter().map(|(_, at)| *at).filter(|at| *at > since).min()
    }

    async fn wait_first_after(&self, since: Instant) -> Duration {
        common::wait_until("a publish after the fault", || async {
            self.first_after(since).is_some()
        })
        .await;
        self.first_after(since)
            .map(|at| at - since)
            .unwrap_or_default()
    }
}

/// Writes orders with their outbox messages in transactions, one every
/// 20 ms, until stopped; every tenth transaction is aborted on purpose.
/// Failed writes (a server is down) are retried. Returns the aborted ids.
struct Writer {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<ObjectId>>,
}

impl Writer {
    fn start(env: &TestEnv) -> Self {
        let stop = CancellationToken::new();
        let (client, db, until) = (env.client.clone(), env.db.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let outbox = Outbox::new(&db);
            let orders = db.collection::<Document>("orders");
            let mut aborted = Vec::new();
            let mut n = 0_i64;
            while !until.is_cancelled() {
                n += 1;
                let abort = n % 10 == 0;
                match write_one(&client, &outbox, &orders, n, abort).await {
                    Ok(id) if abort => aborted.push(id),
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            aborted
        });
        Writer { stop, task }
    }

    async fn finish(self) -> Vec<ObjectId> {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("writer stops")
            .expect("writer task")
    }
}

async fn write_one(
    client: &mongodb::Client,
    outbox: &Outbox,
    orders: &mongodb::Collection<Document>,
    n: i64,
    abort: bool,
) -> outbox_relay::Result<ObjectId> {
    let failed = |e| outbox_relay::Error::Config(format!("write failed: {e}"));
    let mut session = client.start_session().await.map_err(failed)?;
    session.start_transaction().await.map_err(failed)?;
    orders
        .insert_one(doc! { "n": n })
        .session(&mut session)
        .await
        .map_err(failed)?;
    // A few keys, so each scenario checks the order of each key too; one
    // writer writes them in turn, so `n` is commit order.
    let message = NewMessage::serialized("order.placed", &doc! { "n": n })?.key(key_of(n));
    let id = outbox.add(&mut session, message).await?;
    if abort {
        session.abort_transaction().await.map_err(failed)?;
    } else {
        session.commit_transaction().await.map_err(failed)?;
    }
    Ok(id)
}

fn key_of(n: i64) -> String {
    format!("k{}", n % 5)
}

/// Each key's committed messages in commit order (by the writer's `n`).
fn committed_per_key(documents: &[Document]) -> HashMap<String, Vec<ObjectId>> {
    let mut numbered: Vec<(i64, ObjectId)> = documents
        .iter()
        .filter_map(|d| {
            let n = d.get_document("payload").ok()?.get_i64("n").ok()?;
            Some((n, d.get_object_id("_id").ok()?))
        })
        .collect();
    numbered.sort();
    let mut per_key: HashMap<String, Vec<ObjectId>> = HashMap::new();
    for (n, id) in numbered {
        per_key.entry(key_of(n)).or_default().push(id);
    }
    per_key
}

/// Waits until nothing is pending, then checks the stream against the
/// collection (each key in commit order), and writes the scenario's
/// figures to the report.
async fn verify(
    env: &TestEnv,
    scenario: &str,
    publishes: &Publishes,
    aborted: &[ObjectId],
    extra: serde_json::Value,
) {
    let outbox = env.outbox();
    let deadline = Instant::now() + DRAIN;
    loop {
        let pending = outbox
            .count_documents(doc! { "status": "pending" })
            .await
            .unwrap_or(u64::MAX);
        if pending == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{scenario}: {pending} messages still pending"
        );
        // SecantusDB counts a backlog slowly and holds other work meanwhile
        // (README): a tighter poll would slow the relay it waits for.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let documents: Vec<Document> = outbox
        .find(doc! {})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let failed: Vec<&Document> = documents
        .iter()
        .filter(|d| d.get_str("status") != Ok("processed"))
        .collect();
    assert!(failed.is_empty(), "{scenario}: not processed: {failed:?}");
    let committed: HashSet<String> = documents
        .iter()
        .filter_map(|d| d.get_object_id("_id").ok())
        .map(|id| id.to_hex())
        .collect();

    let stored = env.stored().await;
    let mut in_stream: HashMap<String, usize> = HashMap::new();
    for message in &stored {
        *in_stream.entry(message.id.clone()).or_default() += 1;
    }
    let stream_ids: HashSet<String> = in_stream.keys().cloned().collect();
    let missing: Vec<&String> = committed.difference(&stream_ids).collect();
    let phantom: Vec<&String> = stream_ids.difference(&committed).collect();
    assert!(
        missing.is_empty(),
        "{scenario}: {} committed messages never reached the stream: {missing:?}",
        missing.len()
    );
    assert!(
        phantom.is_empty(),
        "{scenario}: {} messages in the stream were never committed: {phantom:?}",
        phantom.len()
    );
    assert!(
        in_stream.values().all(|&n| n == 1),
        "{scenario}: the stream holds a message twice"
    );
    let aborted_seen: Vec<String> = aborted
        .iter()
        .map(|id| id.to_hex())
        .filter(|id| stream_ids.contains(id))
        .collect();
    assert!(
        aborted_seen.is_empty(),
        "{scenario}: aborted transactions published: {aborted_seen:?}"
    );
    assert!(
        committed.len() >= 20,
        "{scenario}: too few messages written to mean anything"
    );
    common::assert_order_per_key(&stored, &committed_per_key(&documents));

    // Let late duplicates land before counting them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let raw = publishes.count();
    let mut report = serde_json::json!({
        "scenario": scenario,
        "committed": committed.len(),
        "aborted": aborted.len(),
        "raw_publishes": raw,
        "duplicate_publishes": raw.saturating_sub(committed.len()),
    });
    if let (Some(report), Some(extra)) = (report.as_object_mut(), extra.as_object()) {
        report.extend(extra.clone());
    }
    append_report(&report);
}

/// Adds a scenario's figures to `target/fault-report.jsonl`.
fn append_report(report: &serde_json::Value) {
    let line = format!("{report}\n");
    let path = manifest_dir().join("target").join("fault-report.jsonl");
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, line.as_bytes()));
    assert!(appended.is_ok(), "write the fault report");
}

/// A scenario's own servers, so its faults cannot touch other tests.
struct Servers {
    mongo: MongoProcess,
    nats: NatsProcess,
}

impl Servers {
    async fn start() -> Self {
        Servers {
            mongo: MongoProcess::start().await,
            nats: NatsProcess::start().await,
        }
    }

    /// A test environment on these servers.
    async fn env(&self) -> TestEnv {
        TestEnv::on(&self.mongo.uri(), &self.nats.url()).await
    }
}

#[tokio::test]
async fn relay_killed_repeatedly_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let writer = Writer::start(&env);
    for round in 0..4 {
        let mut relay = RelayProcess::start_with(&env, &format!("kill-{round}"), &QUICK_TAKEOVER);
        tokio::time::sleep(Duration::from_millis(rand::random_range(400..1500))).await;
        relay.kill9();
    }
    let mut relay = RelayProcess::start_with(&env, "final", &QUICK_TAKEOVER);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let aborted = writer.finish().await;
    verify(
        &env,
        "relay kill -9 x4",
        &publishes,
        &aborted,
        serde_json::json!({}),
    )
    .await;
    relay.terminate().await;
    env.drop().await;
}

/// Which server a restart scenario stops.
#[derive(Clone, Copy)]
enum Stopped {
    Nats,
    Mongo,
}

/// Stops a server for `outage` under load, starts it again (data kept), and
/// checks that everything committed was delivered.
async fn server_restarted_under_load(which: Stopped, outage: Duration, scenario: &str) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let mut servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let label = scenario.split(' ').next().unwrap_or("restart");
    let mut relay = RelayProcess::start_with(&env, label, &QUICK_TAKEOVER);
    let writer = Writer::start(&env);
    tokio::time::sleep(Duration::from_secs(1)).await;
    match which {
        Stopped::Nats => servers.nats.stop(),
        Stopped::Mongo => servers.mongo.stop(),
    }
    tokio::time::sleep(outage).await;
    match which {
        Stopped::Nats => servers.nats.restart().await,
        Stopped::Mongo => servers.mongo.restart().await,
    }
    let resumed = publishes.wait_first_after(Instant::now()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let aborted = writer.finish().await;
    let figures = serde_json::json!({ "resumed_after_restart_ms": resumed.as_millis() as u64 });
    verify(&env, scenario, &publishes, &aborted, figures).await;
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn nats_restarted_under_load() {
    // The counting subscriber is on the stopped server too, so it misses
    // publishes around the outage; the stream check is what matters.
    server_restarted_under_load(
        Stopped::Nats,
        Duration::from_secs(3),
        "nats-server stopped 3 s",
    )
    .await;
}

#[tokio::test]
async fn mongodb_restarted_under_load() {
    server_restarted_under_load(
        Stopped::Mongo,
        Duration::from_secs(2),
        "mongodb stopped 2 s",
    )
    .await;
}

/// The relay process that holds the lease, by the pid in its owner name;
/// waits until one of `relays` holds it.
async fn leader_of<'a>(env: &TestEnv, relays: &'a mut [RelayProcess]) -> &'a mut RelayProcess {
    let checkpoints = env.db.collection::<Document>("outbox_checkpoints");
    let key = doc! { "_id": format!("{}.outbox", env.name) };
    let pids: Vec<u32> = relays.iter().map(RelayProcess::pid).collect();
    let deadline = Instant::now() + WAIT;
    let pid = loop {
        let lease = checkpoints.find_one(key.clone()).await.ok().flatten();
        let owner = lease.and_then(|l| l.get_str("owner").ok().map(str::to_owned));
        let pid = owner.and_then(|o| o.split('/').nth(1).and_then(|p| p.parse::<u32>().ok()));
        if let Some(pid) = pid.filter(|p| pids.contains(p)) {
            break pid;
        }
        assert!(
            Instant::now() < deadline,
            "none of the relays took the lease"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    relays
        .iter_mut()
        .find(|r| r.pid() == pid)
        .expect("the leader is one of ours")
}

#[tokio::test]
async fn three_relays_lose_their_leader_to_kill_and_to_a_graceful_stop() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let mut relays: Vec<RelayProcess> = (0..3)
        .map(|n| RelayProcess::start_with(&env, &format!("r{n}"), &QUICK_TAKEOVER))
        .collect();
    let writer = Writer::start(&env);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let before_kill = Instant::now();
    leader_of(&env, &mut relays).await.kill9();
    let killed = Instant::now();
    publishes.wait_first_after(killed).await;

    let mut alive: Vec<RelayProcess> = relays
        .into_iter()
        .filter_map(|mut r| r.running().then_some(r))
        .collect();
    assert_eq!(alive.len(), 2);
    let leader = leader_of(&env, &mut alive).await;
    // Past the new leader's first publish, so the window holds the whole pause.
    publishes.wait_first_after(Instant::now()).await;
    let after_kill = publishes.longest_gap(before_kill, Instant::now());
    let before_stop = Instant::now();
    leader.terminate().await;
    publishes.wait_first_after(Instant::now()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_stop = publishes.longest_gap(before_stop, Instant::now());
    let aborted = writer.finish().await;
    verify(
        &env,
        "3 relays, leader killed, then leader stopped",
        &publishes,
        &aborted,
        serde_json::json!({
            "delivery_paused_after_kill_ms": after_kill.as_millis() as u64,
            "delivery_paused_after_graceful_stop_ms": after_stop.as_millis() as u64,
            "lease_ms": 2000,
        }),
    )
    .await;
    for relay in &mut alive {
        if relay.running() {
            relay.terminate().await;
        }
    }
    env.drop().await;
}

#[tokio::test]
async fn resume_token_lost_or_corrupted_while_the_relay_is_down() {
    let _serial = ONE_AT_A_TIME.lock().await;
    for (label, damage) in [
        ("lost", doc! { "$unset": { "token": "" } }),
        (
            "corrupted",
            doc! { "$set": { "token": { "_data": "00DEADBEEF" } } },
        ),
    ] {
        let servers = Servers::start().await;
        let env = servers.env().await;
        let publishes = Publishes::watch(&env).await;
        let writer = Writer::start(&env);
        let mut relay = RelayProcess::start_with(&env, label, &QUICK_TAKEOVER);
        tokio::time::sleep(Duration::from_secs(1)).await;
        relay.kill9();
        env.db
            .collection::<Document>("outbox_checkpoints")
            .update_one(doc! { "_id": format!("{}.outbox", env.name) }, damage)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await; // written while down, behind the damaged token
        let after = format!("{label}-after");
        let mut relay = RelayProcess::start_with(&env, &after, &QUICK_TAKEOVER);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let aborted = writer.finish().await;
        verify(
            &env,
            &format!("resume token {label}"),
            &publishes,
            &aborted,
            serde_json::json!({}),
        )
        .await;
        relay.terminate().await;
        env.drop().await;
    }
}

/// How often `text` appears in a relay's log so far.
fn said(relay: &RelayProcess, text: &str) -> usize {
    std::fs::read_to_string(&relay.log)
        .map(|log| log.matches(text).count())
        .unwrap_or(0)
}

/// Waits until `text` appears in a relay's log at least `times` times.
async fn wait_said(relay: &RelayProcess, text: &str, times: usize) {
    common::wait_until(&format!("the relay to say {text:?}"), || async {
        said(relay, text) >= times
    })
    .await;
}

/// Pending messages numbered `from..to`, inserted at once, as a backlog
/// written while no relay runs (each key in commit order, as `verify`
/// checks).
async fn backlog(env: &TestEnv, from: i64, to: i64) {
    let documents: Vec<Document> = (from..to)
        .map(|n| {
            doc! {
                "_id": ObjectId::new(), "type": "order.placed", "payload": { "n": n },
                "key": key_of(n), "status": "pending",
            }
        })
        .collect();
    for chunk in documents.chunks(1000) {
        env.outbox()
            .insert_many(chunk.to_vec())
            .await
            .expect("insert a backlog");
    }
}

#[tokio::test]
async fn a_window_wider_than_the_clients_room_drains_a_backlog_through_a_nats_pause() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    backlog(&env, 1, 6_001).await;
    let settings = [
        ("OUTBOX_MAX_IN_FLIGHT", "8000"),
        // SecantusDB's time to mark a batch grows with its square; on
        // MongoDB a batch of 500 is cheap.
        ("OUTBOX_BATCH_SIZE", "100"),
    ];
    let mut relay = RelayProcess::start_with(&env, "wide", &settings);
    // NATS freezes while the drain has thousands in flight: more than the
    // NATS client's default room (4,096) wait for an answer at once.
    common::wait_until("the drain to be under way", || async {
        publishes.count() > 0
    })
    .await;
    servers.nats.pause();
    tokio::time::sleep(Duration::from_secs(2)).await;
    servers.nats.resume();
    let resumed = publishes.wait_first_after(Instant::now()).await;
    let figures = serde_json::json!({
        "backlog": 6_000,
        "max_in_flight": 8000,
        "resumed_after_pause_ms": resumed.as_millis() as u64,
    });
    verify(
        &env,
        "6,000 in flight past the client's 4,096, NATS paused 2 s",
        &publishes,
        &[],
        figures,
    )
    .await;
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn a_subject_no_one_acknowledges_holds_back_only_its_own_messages() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    // An allowed subject whose stream stores messages without answering.
    env.jetstream
        .create_stream(async_nats::jetstream::stream::Config {
            name: format!("{}_SILENT", env.stream),
            subjects: vec![format!("{}silent.>", env.prefix)],
            no_ack: true,
            ..Default::default()
        })
        .await
        .expect("a stream that does not acknowledge");
    let silent_subject = format!("{}silent.audit", env.prefix);
    let settings = [("OUTBOX_ALLOW_SUBJECT", format!("{}silent.>", env.prefix))];
    let settings: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut relay = RelayProcess::start_with(&env, "silent", &settings);
    let outbox = Outbox::new(&env.db);
    let mut silent = Vec::new();
    let mut good = Vec::new();
    for n in 0..104 {
        let mut session = env.client.start_session().await.unwrap();
        session.start_transaction().await.unwrap();
        let mut message = NewMessage::serialized("order.placed", &doc! { "n": n }).unwrap();
        if n % 26 == 3 {
            message = message.subject(&silent_subject);
        }
        let id = outbox.add(&mut session, message).await.unwrap();
        session.commit_transaction().await.unwrap();
        if n % 26 == 3 {
            silent.push(id)
        } else {
            good.push(id)
        }
    }
    let written = Instant::now();
    env.wait_count(
        doc! { "_id": { "$in": &good }, "status": "processed" },
        good.len() as u64,
    )
    .await;
    let good_delivered = written.elapsed();
    // Each silent message is sent twice, a second late each time, and
    // then refused as its own, to be tried again later.
    env.wait_count(
        doc! { "_id": { "$in": &silent }, "attempts": { "$gte": 1 } },
        silent.len() as u64,
    )
    .await;
    let refused = env
        .outbox()
        .find(doc! { "_id": { "$in": &silent } })
        .await
        .unwrap()
        .try_collect::<Vec<Document>>()
        .await
        .unwrap();
    for message in &refused {
        let error = message.get_str("lastError").unwrap_or_default();
        assert!(
            error.contains("while the broker takes other messages"),
            "{message:?}"
        );
    }
    let report = serde_json::json!({
        "scenario": "4 of 104 messages to a subject no one acknowledges (ack timeout 1 s)",
        "good_delivered_within_ms": good_delivered.as_millis() as u64,
    });
    append_report(&report);
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn nats_paused_past_the_lease_sends_nothing_of_the_lost_term() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let mongo = MongoProcess::start().await;
    let nats = NatsProcess::start_monitored().await;
    let env = TestEnv::on(&mongo.uri(), &nats.url()).await;
    let publishes = Publishes::watch(&env).await;
    let mut relay = RelayProcess::start_with(&env, "paused", &QUICK_TAKEOVER);
    let outbox = Outbox::new(&env.db);
    let orders = env.db.collection::<Document>("orders");
    for n in 1..=3 {
        write_one(&env.client, &outbox, &orders, n, false)
            .await
            .unwrap();
    }
    env.wait_count(doc! { "status": "processed" }, 3).await;

    // NATS freezes; once the relay's client has given its connection up,
    // what the relay sends waits in the client.
    nats.pause();
    wait_said(&relay, "disconnected from NATS", 1).await;
    for n in 4..=23 {
        write_one(&env.client, &outbox, &orders, n, false)
            .await
            .unwrap();
    }
    wait_said(&relay, "NATS publishing: failing", 1).await;
    // MongoDB freezes past the lease: the term ends with those sends queued.
    mongo.pause();
    wait_said(&relay, "could not renew the lease in time", 1).await;
    mongo.resume();
    wait_said(&relay, "resuming where it stopped", 1).await;
    // The lost term's client may have been trying to connect when it was
    // retired; once that try has failed, it tries no more.
    let tries = said(&relay, "client error: nats: timed out");
    wait_said(&relay, "client error: nats: timed out", tries + 1).await;
    nats.resume();

    verify(
        &env,
        "NATS paused past the lease",
        &publishes,
        &[],
        serde_json::json!({}),
    )
    .await;
    let connections = nats.monitoring("/connz?state=all&limit=1024").await;
    let lost_terms = connections["connections"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"] == "outbox-relay #1")
        .count();
    assert_eq!(
        lost_terms, 1,
        "the lost term's connection never connected again, to send what it held: {connections}"
    );
    relay.terminate().await;
    env.drop().await;
}

/// A relay with these settings, once it has delivered a message.
async fn delivering(env: &TestEnv, label: &str, settings: &[(&str, &str)]) -> RelayProcess {
    let relay = RelayProcess::start_with(env, label, settings);
    let outbox = Outbox::new(&env.db);
    let orders = env.db.collection::<Document>("orders");
    write_one(&env.client, &outbox, &orders, 1, false)
        .await
        .unwrap();
    env.wait_count(doc! { "status": "processed" }, 1).await;
    relay
}

#[tokio::test]
async fn a_slow_renewal_is_reported_with_the_setting_to_raise() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    // A renewal every half second of a 6 s lease: one that waits out a 3 s
    // freeze of the server takes more than a third of the lease, and still
    // lands before the relay's deadline.
    let settings = [
        ("OUTBOX_LEASE_DURATION", "6s"),
        ("OUTBOX_LEASE_RENEW_INTERVAL", "500ms"),
    ];
    let mut relay = delivering(&env, "slow-renewal", &settings).await;
    servers.mongo.pause();
    tokio::time::sleep(Duration::from_secs(3)).await;
    servers.mongo.resume();
    wait_said(&relay, "renewing the lease took more than a third of it", 1).await;
    assert!(
        said(&relay, "raise --lease-duration") >= 1,
        "it names the setting"
    );
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn a_relay_stopped_while_mongodb_is_frozen_leaves_the_lease_to_expire_and_exits() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    // A lease longer than any wait here: a stop that waited on a renewal
    // MongoDB leaves unanswered would not end within one.
    let shutdown_timeout = Duration::from_secs(1);
    let shutdown_setting = format!("{}s", shutdown_timeout.as_secs());
    let settings = [
        ("OUTBOX_LEASE_DURATION", "2m"),
        ("OUTBOX_LEASE_RENEW_INTERVAL", "200ms"),
        ("OUTBOX_SHUTDOWN_TIMEOUT", shutdown_setting.as_str()),
    ];
    // docs/operating.md: a stop takes at most --shutdown-timeout plus 7 s
    // (the release's 5 s, then 2 s for whatever still waits on MongoDB),
    // and exits 1 when MongoDB held it up.
    let bound = shutdown_timeout + Duration::from_secs(7);
    let mut relay = delivering(&env, "frozen-stop", &settings).await;
    servers.mongo.pause();
    relay.signal("TERM");
    let status = relay.exit_within(bound).await.unwrap_or_else(|| {
        panic!(
            "the relay still ran {bound:?} after SIGTERM; log {}",
            relay.log.display()
        )
    });
    assert_eq!(status.code(), Some(1), "log {}", relay.log.display());
    servers.mongo.resume();
    // Released in vain, or, with an operation of the term stuck on
    // MongoDB, never tried: either way it says why a standby waits.
    let waits = said(&relay, "could not release the lease")
        + said(&relay, "the lease ends when it expires");
    assert_eq!(waits, 1, "it says why a standby waits");
    env.drop().await;
}
