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

use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Document};
use common::scenario::*;
use common::{MongoProcess, NatsProcess, RelayProcess, TestEnv, QUICK_TAKEOVER, WAIT};
use futures::TryStreamExt;
use outbox_relay::{NewMessage, Outbox};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn relay_killed_repeatedly_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let mut writer = None;
    for round in 0..4 {
        let mut relay = RelayProcess::start_with(&env, &format!("kill-{round}"), &QUICK_TAKEOVER);
        if writer.is_none() {
            // Each later relay resumes from a stored position under load
            // (see `wait_positions`).
            wait_positions(&env, 1).await;
            writer = Some(Writer::start(&env));
        }
        tokio::time::sleep(Duration::from_millis(rand::random_range(400..1500))).await;
        relay.kill9();
    }
    let writer = writer.expect("the writer started with the first relay");
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
    publishes.assert_repeats_at_most(4 * IN_FLIGHT_AT_MOST, "relay kill -9 x4");
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
    // The counting subscriber of a NATS restart is on the stopped server,
    // and misses publishes around the outage: it cannot count repeats.
    if let Stopped::Mongo = which {
        publishes.assert_repeats_at_most(IN_FLIGHT_AT_MOST, scenario);
    }
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
    // A graceful stop repeats nothing; the kill, what was in flight.
    publishes.assert_repeats_at_most(IN_FLIGHT_AT_MOST, "3 relays");
    for relay in &mut alive {
        if relay.running() {
            relay.terminate().await;
        }
    }
    env.drop().await;
}

#[tokio::test]
async fn a_takeover_after_sigkill_republishes_only_what_was_in_flight() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let ports = [common::free_port(), common::free_port()];
    let mut relays: Vec<RelayProcess> = ports
        .iter()
        .enumerate()
        .map(|(n, port)| {
            let address = format!("127.0.0.1:{port}");
            let mut settings = QUICK_TAKEOVER.to_vec();
            settings.push(("OUTBOX_METRICS_ADDR", &address));
            // A position stored seldom: the new leader's replay then reads
            // seconds of messages the killed one had delivered and marked.
            settings.push(("OUTBOX_CHECKPOINT_INTERVAL", "2s"));
            RelayProcess::start_with(&env, &format!("takeover-{n}"), &settings)
        })
        .collect();
    // Written once the leader tails its stream, so that a first start's
    // catch-up cannot meet the stream on a message and count as a repeat.
    common::wait_until("a relay to lead, tailing its stream", || async {
        for port in ports {
            if let Some((200, body)) = common::get(port, "/readyz").await {
                if body.contains(common::LEADING) {
                    return true;
                }
            }
        }
        false
    })
    .await;
    let writer = Writer::start_every(&env, Duration::from_micros(6_667));
    common::wait_until("the leader to store its position", || async {
        env.checkpoint_token().await.is_some()
    })
    .await;
    publishes.wait_count_after(Instant::now(), 150).await;
    let before_kill = Instant::now();
    leader_of(&env, &mut relays).await.kill9();
    let killed = Instant::now();
    publishes.wait_first_after(killed).await;
    publishes.wait_count_after(Instant::now(), 150).await;
    let paused = publishes.longest_gap(before_kill, Instant::now());
    let aborted = writer.finish().await;
    verify(
        &env,
        "2 relays at 150 msg/s, leader killed",
        &publishes,
        &aborted,
        serde_json::json!({
            "delivery_paused_after_kill_ms": paused.as_millis() as u64,
            "lease_ms": 2000,
        }),
    )
    .await;
    publishes.assert_repeats_at_most(IN_FLIGHT_AT_MOST, "2 relays at 150 msg/s, leader killed");
    for relay in &mut relays {
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
        publishes.assert_repeats_at_most(IN_FLIGHT_AT_MOST, label);
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
    // The process's own timer keeps the bound; a loaded machine may take a
    // moment more to end and reap it, which is not a longer stop.
    let reaped = bound + Duration::from_secs(3);
    servers.mongo.pause();
    relay.signal("TERM");
    let status = relay.exit_within(reaped).await.unwrap_or_else(|| {
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

/// The relays of a group on four partitions, as the test starts them.
const PARTITIONED: [(&str, &str); 3] = [
    ("OUTBOX_LEASE_DURATION", "2s"),
    ("OUTBOX_LEASE_RENEW_INTERVAL", "500ms"),
    ("OUTBOX_PARTITIONS", "4"),
];

#[tokio::test]
async fn four_partitions_shared_by_relays_joining_killed_and_stopped() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let first = RelayProcess::start_with(&env, "partitions-a", &PARTITIONED);
    let second = RelayProcess::start_with(&env, "partitions-b", &PARTITIONED);
    assert_eq!(wait_shared(&env, &[&first, &second], 4).await, [2, 2]);
    let writer = Writer::start(&env);
    // Written without the hash (by hand, or by an older writer), or with
    // one no writer stores: partition 0's, or the one its number names.
    let odd = [
        None,
        Some(bson::Bson::String("7".into())),
        Some(bson::Bson::Array(vec![1.into(), 2.into()])),
        Some(bson::Bson::Int64(-3)),
        Some(bson::Bson::Double(2.5)),
        Some(bson::Bson::Double(f64::NAN)),
        Some(bson::Bson::Int32(5)),
        Some(bson::Bson::Int64(i64::MAX)),
        Some(bson::Bson::Null),
    ];
    let unhashed: Vec<Document> = (0..27)
        .map(|n| {
            let mut message =
                doc! { "type": "order.noted", "payload": { "note": n as i64 }, "status": "pending" };
            if let Some(hash) = &odd[n % odd.len()] {
                message.insert("keyHash", hash.clone());
            }
            message
        })
        .collect();
    env.outbox().insert_many(unhashed).await.unwrap();
    publishes.wait_count_after(Instant::now(), 50).await;

    // A third relay joins: the first two hand a partition over gracefully.
    let third = RelayProcess::start_with(&env, "partitions-c", &PARTITIONED);
    let shares = wait_shared(&env, &[&first, &second, &third], 4).await;
    assert_eq!(shares.iter().sum::<usize>(), 4);
    publishes.wait_count_after(Instant::now(), 50).await;
    let repeats_after_join = publishes.repeats();

    // A relay cut off past its leases (SIGSTOP) loses its partitions to
    // the others; back (SIGCONT), it holds nothing, joins anew and is
    // handed its share again.
    let relays = [first, second, third];
    let least = (0..3).min_by_key(|n| shares[*n]).expect("three relays");
    let others: Vec<&RelayProcess> = (0..3).filter(|n| *n != least).map(|n| &relays[n]).collect();
    relays[least].signal("STOP");
    assert_eq!(wait_shared(&env, &others, 4).await, [2, 2]);
    relays[least].signal("CONT");
    let shares = wait_shared(&env, &[&relays[0], &relays[1], &relays[2]], 4).await;
    publishes.wait_count_after(Instant::now(), 50).await;

    // The relay holding two is killed: the others take them once its leases lapse.
    let mut relays = relays;
    let (killed, _) = relays
        .iter()
        .enumerate()
        .zip(&shares)
        .max_by_key(|(_, share)| **share)
        .map(|((n, _), share)| (n, *share))
        .expect("three relays");
    relays[killed].kill9();
    let killed_at = Instant::now();
    let survivors: Vec<&RelayProcess> = relays
        .iter()
        .enumerate()
        .filter(|(n, _)| *n != killed)
        .map(|(_, r)| r)
        .collect();
    assert_eq!(wait_shared(&env, &survivors, 4).await, [2, 2]);
    let all_held_after_kill = killed_at.elapsed();
    publishes.wait_count_after(Instant::now(), 50).await;

    // One survivor stops gracefully: the last takes its partitions at once.
    let mut alive: Vec<RelayProcess> = relays
        .into_iter()
        .enumerate()
        .filter_map(|(n, r)| (n != killed).then_some(r))
        .collect();
    let mut stopping = alive.remove(0);
    let before_stop = Instant::now();
    stopping.terminate().await;
    assert_eq!(wait_shared(&env, &[&alive[0]], 4).await, [4]);
    publishes.wait_count_after(Instant::now(), 50).await;
    let paused_by_stop = publishes.longest_gap(before_stop, Instant::now());

    // A relay started with another count is refused, naming the group's.
    let mut refused = RelayProcess::start_with(
        &env,
        "partitions-refused",
        &[("OUTBOX_LEASE_DURATION", "2s"), ("OUTBOX_PARTITIONS", "2")],
    );
    let status = refused.exit_within(WAIT).await.expect("the relay exits");
    let log = std::fs::read_to_string(&refused.log).unwrap_or_default();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("--partitions 4"), "{log}");

    let aborted = writer.finish().await;
    verify(
        &env,
        "4 partitions: a relay joins, one is killed, one stops",
        &publishes,
        &aborted,
        serde_json::json!({
            "repeats_after_join": repeats_after_join,
            "all_partitions_held_after_kill_ms": all_held_after_kill.as_millis() as u64,
            "delivery_paused_after_graceful_stop_ms": paused_by_stop.as_millis() as u64,
            "lease_ms": 2000,
        }),
    )
    .await;
    // A hand-over repeats nothing; the kill, what was in flight.
    assert_eq!(
        repeats_after_join, 0,
        "a graceful hand-over published again"
    );
    publishes.assert_repeats_at_most(IN_FLIGHT_AT_MOST, "4 partitions");
    alive[0].terminate().await;
    env.drop().await;
}
