//! Operations: what a team does to a group of relays over months, under
//! load, each on servers of its own. The partition count changed and
//! changed back with delivered messages deleted between; a rolling restart;
//! a relay rolled back beside a group; the group scaled out and in;
//! `sweep --once` after a group and a group after it; the group's document
//! deleted; relays killed while a backlog drains. As in `tests/faults.rs`,
//! a core-NATS subscription counts every publish (a repeat JetStream drops
//! still counts), and at the end the stream must hold every committed
//! message once, each key in commit order. Each scenario reports its
//! repeats and pauses to `target/fault-report.jsonl`
//! (docs/guarantees.md, the operations matrix).

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId};
use common::scenario::*;
use common::{assert_exit, bounded, relay_command, RelayProcess, TestEnv, WAIT};
use futures::TryStreamExt;
use outbox_relay::group::Group;
use outbox_relay::lease::{Lease, LeaseTiming};
use outbox_relay::Outbox;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The lease the scenarios' relays keep, so that an operation that waits
/// for one waits seconds.
const LEASE: Duration = Duration::from_secs(2);

/// A graceful stop's limit, as the relays are started with it.
const SHUTDOWN: Duration = Duration::from_secs(10);

/// The settings of a relay of a group of `partitions`.
fn group_of(partitions: &str) -> [(&str, &str); 4] {
    [
        ("OUTBOX_LEASE_DURATION", "2s"),
        ("OUTBOX_LEASE_RENEW_INTERVAL", "500ms"),
        ("OUTBOX_SHUTDOWN_TIMEOUT", "10s"),
        ("OUTBOX_PARTITIONS", partitions),
    ]
}

/// How many keys the scenarios write, so that they spread over six
/// partitions.
const KEYS: i64 = 40;

/// Waits until no relay of the outbox runs: its group's document and every
/// lease of it have lapsed, as an operator waits a lease after stopping
/// every relay to change the count.
async fn wait_group_gone(env: &TestEnv) {
    let checkpoints = env.db.collection::<bson::Document>("outbox_checkpoints");
    common::wait_until("the group's leases to lapse", || async {
        let live = Group::stored(&env.db, "outbox_checkpoints", "outbox")
            .await
            .ok()
            .flatten()
            .is_some_and(|(_, live)| live);
        let leases = checkpoints
            .count_documents(doc! {
                "_id": { "$regex": format!("^{}\\.outbox", env.name) },
                "expiresAt": { "$gt": bson::DateTime::now() },
            })
            .await
            .unwrap_or(u64::MAX);
        !live && leases == 0
    })
    .await;
}

/// Writes `count` orders with their messages over [`KEYS`] keys, numbered
/// from `from`, each in its own transaction; returns their ids.
async fn write_orders(env: &TestEnv, from: i64, count: i64) -> Vec<ObjectId> {
    let outbox = Outbox::new(&env.db);
    let orders = env.db.collection("orders");
    let mut ids = Vec::new();
    for n in from..from + count {
        let key = format!("k{}", n % KEYS);
        let id = write_keyed(&env.client, &outbox, &orders, n, false, &key)
            .await
            .expect("an order and its message commit");
        ids.push(id);
    }
    ids
}

/// Waits until the messages `ids` are all processed.
async fn wait_processed(env: &TestEnv, ids: &[ObjectId]) {
    let expected = ids.len() as u64;
    env.wait_count(
        doc! { "status": "processed", "_id": { "$in": ids } },
        expected,
    )
    .await;
}

#[tokio::test]
async fn the_partition_count_changed_and_changed_back_publishes_nothing_deleted_again() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let mut deleted: Vec<ObjectId> = Vec::new();
    let mut republished: Vec<String> = Vec::new();
    let mut written = 0;
    // Back to four after two, and back to one after a period as a group.
    for (period, count) in ["4", "2", "4", "1"].into_iter().enumerate() {
        wait_group_gone(&env).await;
        let began = Instant::now();
        let settings = group_of(count);
        let mut relays = [
            RelayProcess::start_with(&env, &format!("count-{period}-a"), &settings),
            RelayProcess::start_with(&env, &format!("count-{period}-b"), &settings),
        ];
        wait_positions(&env, count.parse().expect("a count")).await;
        let ids = write_orders(&env, written, 300).await;
        written += 300;
        wait_processed(&env, &ids).await;
        for relay in &mut relays {
            relay.terminate().await;
        }
        // Nothing delivered in an earlier period came back in this one.
        let before: HashSet<String> = deleted.iter().map(|id| id.to_hex()).collect();
        republished.extend(
            publishes
                .published_after(began)
                .intersection(&before)
                .cloned(),
        );
        let documents: Vec<bson::Document> = env
            .outbox()
            .find(doc! { "_id": { "$in": &ids } })
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        assert_order_of(&env.stored().await, &documents);
        // Retention deletes what was delivered.
        env.outbox()
            .delete_many(doc! { "_id": { "$in": &ids } })
            .await
            .unwrap();
        deleted.extend(ids);
    }
    assert!(
        republished.is_empty(),
        "{} messages delivered and deleted in an earlier period were published again",
        republished.len()
    );
    let repeats = publishes.repeats();
    verify_with_deleted(
        &env,
        "operation: partition count 4, 2, 4, 1, delivered messages deleted between",
        &publishes,
        &[],
        &deleted,
        serde_json::json!({ "republished_after_deletion": republished.len() }),
    )
    .await;
    assert_eq!(
        repeats, 0,
        "a count changed with the relays stopped repeats nothing"
    );
    env.drop().await;
}

#[tokio::test]
async fn a_rolling_restart_of_three_relays_loses_and_repeats_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let settings = group_of("6");
    let mut relays: Vec<RelayProcess> = (0..3)
        .map(|n| RelayProcess::start_with(&env, &format!("rolling-{n}"), &settings))
        .collect();
    wait_shared(&env, &relays.iter().collect::<Vec<_>>(), 6).await;
    let writer = Writer::start_keyed(&env, Duration::from_millis(20), KEYS);
    let began = Instant::now();
    for n in 0..3 {
        publishes.wait_count_after(Instant::now(), 20).await;
        relays[n].terminate().await;
        relays[n] = RelayProcess::start_with(&env, &format!("rolling-{n}-new"), &settings);
        wait_shared(&env, &relays.iter().collect::<Vec<_>>(), 6).await;
    }
    publishes.wait_count_after(Instant::now(), 20).await;
    let longest_wait = publishes.longest_gap(began, Instant::now());
    let aborted = writer.finish().await;
    verify(
        &env,
        "operation: rolling restart of three relays on six partitions",
        &publishes,
        &aborted,
        serde_json::json!({ "longest_pause_ms": longest_wait.as_millis() as u64 }),
    )
    .await;
    publishes.assert_repeats_at_most(0, "rolling restart");
    // A hand-over finishes within the stop's limit, and its partition is
    // taken within a poll of its release, or a lease where it was cut short.
    assert!(
        longest_wait < SHUTDOWN + LEASE + Duration::from_secs(1),
        "delivery paused {longest_wait:?}"
    );
    for relay in &mut relays {
        relay.terminate().await;
    }
    env.drop().await;
}

#[tokio::test]
async fn a_relay_of_one_partition_beside_a_group_delivers_nothing_and_a_rollback_loses_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let settings = group_of("4");
    let mut group = [
        RelayProcess::start_with(&env, "group-a", &settings),
        RelayProcess::start_with(&env, "group-b", &settings),
    ];
    wait_shared(&env, &[&group[0], &group[1]], 4).await;
    let writer = Writer::start_keyed(&env, Duration::from_millis(20), KEYS);
    publishes.wait_count_after(Instant::now(), 20).await;

    // A relay from before groups knows only the outbox's own lease, and
    // takes it with the same conditional update as this take (free, or
    // lapsed with a term to count on): it never finds it free while the
    // group delivers.
    let timing = LeaseTiming {
        duration: LEASE,
        renew_interval: Duration::from_millis(500),
        standby_poll_interval: Duration::from_millis(100),
    };
    let before_groups = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
    let watching = Instant::now();
    while watching.elapsed() < 3 * LEASE {
        let taken = before_groups.try_acquire().await.expect("MongoDB answers");
        assert!(taken.is_err(), "a relay from before groups took the outbox");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // This version's relay of one partition is refused, naming the count.
    let mut single = RelayProcess::start_with(&env, "single", &group_of("1"));
    let status = single.exit_within(WAIT).await.expect("the relay exits");
    let log = std::fs::read_to_string(&single.log).unwrap_or_default();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("--partitions 4"), "{log}");

    // The rollback: the group stopped, and a lease later relays of one
    // partition deliver the outbox.
    let stopped = Instant::now();
    for relay in &mut group {
        relay.terminate().await;
    }
    wait_group_gone(&env).await;
    // What was written until now waits for the rolled-back relays, whose
    // first start reads it from a snapshot; the writer waits for their
    // stream (see `wait_positions`).
    let mut aborted = writer.finish().await;
    let mut rolled_back = [
        RelayProcess::start_with(&env, "rolled-back-a", &group_of("1")),
        RelayProcess::start_with(&env, "rolled-back-b", &group_of("1")),
    ];
    wait_positions(&env, 1).await;
    let writer = Writer::start_keyed(&env, Duration::from_millis(20), KEYS);
    publishes.wait_count_after(Instant::now(), 20).await;
    let paused = publishes.longest_gap(stopped, Instant::now());
    aborted.extend(writer.finish().await);
    verify(
        &env,
        "operation: rollback to one partition, a group running, then stopped",
        &publishes,
        &aborted,
        serde_json::json!({ "paused_by_rollback_ms": paused.as_millis() as u64 }),
    )
    .await;
    publishes.assert_repeats_at_most(0, "rollback");
    for relay in &mut rolled_back {
        relay.terminate().await;
    }
    env.drop().await;
}

#[tokio::test]
async fn a_group_scaled_from_one_relay_to_three_and_back_loses_and_repeats_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let settings = group_of("6");
    let mut first = RelayProcess::start_with(&env, "scale-a", &settings);
    assert_eq!(wait_shared(&env, &[&first], 6).await, [6]);
    let writer = Writer::start_keyed(&env, Duration::from_millis(20), KEYS);
    publishes.wait_count_after(Instant::now(), 20).await;
    let began = Instant::now();
    let mut added = [
        RelayProcess::start_with(&env, "scale-b", &settings),
        RelayProcess::start_with(&env, "scale-c", &settings),
    ];
    assert_eq!(
        wait_shared(&env, &[&first, &added[0], &added[1]], 6).await,
        [2, 2, 2]
    );
    publishes.wait_count_after(Instant::now(), 20).await;
    for relay in &mut added {
        relay.terminate().await;
    }
    assert_eq!(wait_shared(&env, &[&first], 6).await, [6]);
    publishes.wait_count_after(Instant::now(), 20).await;
    let paused = publishes.longest_gap(began, Instant::now());
    let aborted = writer.finish().await;
    verify(
        &env,
        "operation: scaled from one relay to three and back, six partitions",
        &publishes,
        &aborted,
        serde_json::json!({ "longest_pause_ms": paused.as_millis() as u64 }),
    )
    .await;
    publishes.assert_repeats_at_most(0, "scaling");
    first.terminate().await;
    env.drop().await;
}

/// Each of `count` partitions' holder (by pid) and term: a relay that
/// stops delivering a partition takes it again, if at all, at a new term.
async fn partition_terms(env: &TestEnv, count: u32) -> Vec<(Option<u32>, Option<i64>)> {
    let checkpoints = env.db.collection::<bson::Document>("outbox_checkpoints");
    let holders = partition_holders(env, count).await;
    let mut terms = Vec::new();
    for (index, holder) in holders.into_iter().enumerate() {
        let id = format!("{}.outbox:{index}/{count}", env.name);
        let lease = checkpoints
            .find_one(doc! { "_id": id })
            .await
            .ok()
            .flatten();
        terms.push((holder, lease.and_then(|lease| lease.get_i64("term").ok())));
    }
    terms
}

/// Runs `sweep --once` as a cron job does; its output.
async fn sweep_once(env: &TestEnv) -> std::process::Output {
    let mut command = relay_command(env);
    command
        .args(["sweep", "--once", "--mode", "poll"])
        .env("OUTBOX_LEASE_DURATION", "2s")
        .env("OUTBOX_LEASE_RENEW_INTERVAL", "500ms")
        .env("OUTBOX_METRICS_ADDR", "off")
        .env("OUTBOX_OPLOG_HEADROOM_WARNING", "off");
    bounded(command).await
}

#[tokio::test]
async fn sweep_once_beside_after_and_before_a_group() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let settings = group_of("4");
    let mut group = [
        RelayProcess::start_with(&env, "beside-a", &settings),
        RelayProcess::start_with(&env, "beside-b", &settings),
    ];
    wait_shared(&env, &[&group[0], &group[1]], 4).await;
    let first = write_orders(&env, 0, 50).await;
    wait_processed(&env, &first).await;
    // A cron job's sweep beside a running group gives up: it sweeps already.
    assert_exit(&sweep_once(&env).await, 9, "sweeps it already");

    // After the group: the sweep delivers what was written meanwhile, once
    // the group's hold on the outbox lapses (a lease at most).
    for relay in &mut group {
        relay.terminate().await;
    }
    let second = write_orders(&env, 50, 50).await;
    let stopped = Instant::now();
    let swept = loop {
        let output = sweep_once(&env).await;
        if output.status.code() == Some(0) {
            break output;
        }
        assert_exit(&output, 9, "sweeps it already");
        assert!(stopped.elapsed() < WAIT, "the group's hold never lapsed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let waited_for_sweep = stopped.elapsed();
    assert_exit(&swept, 0, "delivered 50");
    wait_processed(&env, &second).await;

    // A group right after the sweep starts at once, and delivers.
    let third = write_orders(&env, 100, 50).await;
    let mut after = [
        RelayProcess::start_with(&env, "after-a", &settings),
        RelayProcess::start_with(&env, "after-b", &settings),
    ];
    wait_processed(&env, &third).await;
    for relay in &mut after {
        assert!(relay.running(), "the group refused to start after a sweep");
    }
    verify(
        &env,
        "operation: sweep --once beside a group, after it, and a group after the sweep",
        &publishes,
        &[],
        serde_json::json!({ "sweep_ran_after_the_group_ms": waited_for_sweep.as_millis() as u64 }),
    )
    .await;
    publishes.assert_repeats_at_most(0, "sweep --once and a group");
    for relay in &mut after {
        relay.terminate().await;
    }
    env.drop().await;
}

#[tokio::test]
async fn the_group_document_deleted_under_load_stops_no_relay() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let settings = group_of("4");
    let mut group = [
        RelayProcess::start_with(&env, "deleted-a", &settings),
        RelayProcess::start_with(&env, "deleted-b", &settings),
    ];
    wait_shared(&env, &[&group[0], &group[1]], 4).await;
    let writer = Writer::start_keyed(&env, Duration::from_millis(20), KEYS);
    publishes.wait_count_after(Instant::now(), 20).await;
    let holders = partition_terms(&env, 4).await;
    let checkpoints = env.db.collection::<bson::Document>("outbox_checkpoints");
    let id = doc! { "_id": format!("{}.outbox/group", env.name) };
    let deleted_at = Instant::now();
    assert_eq!(
        checkpoints
            .delete_one(id.clone())
            .await
            .unwrap()
            .deleted_count,
        1
    );
    common::wait_until("the group's document to be written again", || async {
        checkpoints
            .find_one(id.clone())
            .await
            .ok()
            .flatten()
            .is_some()
    })
    .await;
    publishes.wait_count_after(Instant::now(), 20).await;
    let paused = publishes.longest_gap(deleted_at, Instant::now());
    assert_eq!(
        partition_terms(&env, 4).await,
        holders,
        "a relay stopped delivering a partition, or it changed hands"
    );
    let aborted = writer.finish().await;
    verify(
        &env,
        "operation: the group's document deleted under load",
        &publishes,
        &aborted,
        serde_json::json!({ "longest_pause_ms": paused.as_millis() as u64 }),
    )
    .await;
    publishes.assert_repeats_at_most(0, "the group's document deleted");
    for relay in &mut group {
        assert!(relay.running());
        relay.terminate().await;
    }
    env.drop().await;
}

#[tokio::test]
async fn relays_killed_four_times_while_a_backlog_drains_repeat_within_their_room() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::start().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    const BACKLOG: i64 = 1000;
    let ids = write_orders(&env, 0, BACKLOG).await;
    let settings = group_of("1");
    let processed = || env.count(doc! { "status": "processed" });
    // Each relay killed having marked n messages in its term leaves at
    // most 16 + n / 16 to publish again (docs/guarantees.md).
    let mut bound = 0;
    let mut kills = 0;
    for round in 0..4 {
        let before = processed().await;
        if before == BACKLOG as u64 {
            break;
        }
        let published = publishes.count();
        let mut relay = RelayProcess::start_with(&env, &format!("backlog-{round}"), &settings);
        // Killed once it has delivered something (or the backlog is
        // drained), at a random moment after.
        common::wait_until("a publish, or the backlog drained", || async {
            publishes.count() > published || processed().await == BACKLOG as u64
        })
        .await;
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..400))).await;
        relay.kill9();
        kills += 1;
        let marked = processed().await.saturating_sub(before) as usize;
        bound += 16 + marked / 16;
    }
    let mut last = RelayProcess::start_with(&env, "backlog-last", &settings);
    wait_processed(&env, &ids).await;
    verify(
        &env,
        "operation: relay killed four times while a backlog of 1,000 drains",
        &publishes,
        &[],
        serde_json::json!({ "backlog": BACKLOG, "kills": kills, "bound": bound }),
    )
    .await;
    publishes.assert_repeats_at_most(bound, "relays killed over a backlog");
    last.terminate().await;
    env.drop().await;
}
