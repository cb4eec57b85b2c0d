//! Two relays sharing an outbox's two partitions in one process: each
//! message once, and what `status`, the metrics and `sweep --once` say of
//! the group. (The faults a group meets are in `tests/faults.rs`.)

use crate::common::{
    count_by_id, wait_until, write_orders, RunningRelay, TestEnv, LEADING, STANDING_BY, WAIT,
};
use std::time::Duration;

use bson::doc;
use outbox_relay::admin::status::Status;
use outbox_relay::lease::Lease;
use outbox_relay::{Error, Relay, RelayMode};

/// The value of a relay's unlabelled metric `name`, if it reports one.
fn metric<T: std::str::FromStr>(relay: &RunningRelay, name: &str) -> Option<T> {
    let prefix = format!("{name} ");
    relay
        .metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()).map(str::to_owned))
        .and_then(|value| value.trim().parse().ok())
}

/// How many partitions a relay says it holds.
fn partitions_held(relay: &RunningRelay) -> Option<u32> {
    metric(relay, "outbox_partitions_held")
}

/// How many times a relay has read its group.
fn group_reads(relay: &RunningRelay) -> u64 {
    metric(relay, "outbox_group_reads_total").unwrap_or(0)
}

/// Waits until `relay` holds `count` partitions.
async fn wait_holding(relay: &RunningRelay, count: u32) {
    wait_until(&format!("the relay to hold {count} partitions"), || async {
        partitions_held(relay) == Some(count)
    })
    .await;
}

/// Writes ten orders and waits until each is delivered and marked.
async fn delivers_what_is_written(env: &TestEnv) {
    let ids = write_orders(env, 10).await;
    env.wait_count(doc! { "status": "processed", "_id": { "$in": &ids } }, 10)
        .await;
}

/// Runs a relay with `config` and holds it to a refusal at start: a
/// configuration error (exit code 2) naming the group's `count`.
async fn refused_naming(config: outbox_relay::RelayConfig, count: u32) {
    let refused = Relay::connect(config).await.unwrap();
    let ran = tokio::time::timeout(
        WAIT,
        refused.run(tokio_util::sync::CancellationToken::new()),
    )
    .await
    .expect("a refused relay returns");
    match ran {
        Err(error @ Error::Config(_)) => {
            let named = format!("--partitions {count}");
            assert!(error.to_string().contains(&named), "{error}");
            assert_eq!(error.exit_code(), 2);
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[tokio::test]
async fn two_relays_share_two_partitions_and_report_them() {
    let env = TestEnv::new().await;
    let mut config = env.replica_config();
    config.partitions = 2;
    // A lease a loaded machine keeps: one lost hands a partition over and
    // back, which this test does not count on.
    config.lease_duration = std::time::Duration::from_secs(6);
    config.lease_renew_interval = std::time::Duration::from_secs(1);
    let mut receiver = env.subscribe().await;
    let relays = [
        RunningRelay::start(config.clone()).await,
        RunningRelay::start(config.clone()).await,
    ];
    wait_until("each relay to hold one partition", || async {
        relays.iter().all(|r| partitions_held(r) == Some(1))
    })
    .await;
    // Keyless: their random hashes spread them over both partitions.
    let ids = write_orders(&env, 40).await;
    let seen = receiver.take(40).await;
    env.wait_count(doc! { "status": "processed" }, 40).await;
    let counts = count_by_id(&seen);
    assert_eq!(counts.len(), 40);
    assert!(ids.iter().all(|id| counts.contains_key(&id.to_hex())));
    wait_until("each relay to hold one partition still", || async {
        relays.iter().all(|r| partitions_held(r) == Some(1))
    })
    .await;
    for relay in &relays {
        let text = relay.metrics.render();
        assert!(text.contains("outbox_leader 1"), "{text}");
        let held: Vec<&str> = text
            .lines()
            .filter(|line| line.starts_with("outbox_partition_held{") && line.ends_with(" 1"))
            .collect();
        assert_eq!(held.len(), 1, "{text}");
    }

    // Each partition's stream stores its position as it goes idle.
    wait_until("both partitions to store a position", || async {
        let status = Status::read(&env.db, &config).await.unwrap();
        status.partitions.iter().all(|p| p.lag_seconds.is_some())
    })
    .await;
    let status = Status::read(&env.db, &config).await.unwrap();
    assert_eq!(status.partitions.len(), 2, "{status:?}");
    assert_eq!(status.partition_count, 2);
    assert!(status.leader_active, "every partition is led: {status:?}");
    assert!(status.unowned_partitions.is_empty(), "{status:?}");
    assert!(status.checkpoint_age_seconds.is_some(), "{status:?}");
    assert!(status.relay_lag_seconds.is_some(), "{status:?}");
    let owners: Vec<&str> = status
        .partitions
        .iter()
        .filter_map(|p| p.owner.as_deref())
        .collect();
    assert_eq!(owners.len(), 2, "{status:?}");
    assert_ne!(owners[0], owners[1], "one relay holds both: {status:?}");
    assert!(status.partitions.iter().all(|p| p.pending == 0));
    let shown = status.render();
    for said in [
        "group: 2 partitions, all held, by 2 relays",
        "checkpoint: oldest written",
        "0/2: ",
        "1/2: ",
    ] {
        assert!(shown.contains(said), "{said:?} in {shown}");
    }
    assert!(!shown.contains("leader: none"), "{shown}");

    // A third relay finds no partition to take: it stands by, ready.
    let third = RunningRelay::start(config.clone()).await;
    third.wait_for_role(STANDING_BY).await;
    assert!(
        third.metrics.readiness().ready,
        "{:?}",
        third.metrics.readiness()
    );
    assert_eq!(partitions_held(&third), Some(0));
    third.stop().await.unwrap();

    // Beside a running group, sweep --once would publish its keys too.
    let mut once = config.clone();
    once.partitions = 1;
    once.mode = RelayMode::Poll;
    let sweeper = Relay::connect(once).await.unwrap();
    match sweeper.sweep_once(WAIT).await {
        Err(Error::GaveUp(why)) => assert!(why.contains("--partitions 2"), "{why}"),
        other => panic!("expected to give up, got {other:?}"),
    }
    for relay in relays {
        relay.stop().await.unwrap();
    }
    assert_eq!(env.stream_count().await, 40);
    env.drop().await;
}

#[tokio::test]
async fn a_relay_with_another_count_is_refused_while_the_group_runs() {
    let env = TestEnv::new().await;
    let mut config = env.replica_config();
    config.partitions = 3;
    let relay = RunningRelay::start(config.clone()).await;
    wait_holding(&relay, 3).await;
    let mut other = config.clone();
    other.partitions = 1;
    refused_naming(other, 3).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_group_is_refused_beside_a_relay_leading_the_whole_outbox_without_a_group() {
    // A relay from before groups keeps the outbox's own lease and writes
    // no group document.
    let env = TestEnv::new().await;
    let expires = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + 60_000);
    env.db
        .collection::<bson::Document>("outbox_checkpoints")
        .insert_one(doc! {
            "_id": format!("{}.outbox", env.name),
            "owner": "an-older-relay", "term": 3_i64, "expiresAt": expires,
        })
        .await
        .unwrap();
    let mut config = env.replica_config();
    config.partitions = 2;
    refused_naming(config, 1).await;
    env.drop().await;
}

/// The terms of the partitions a relay holds, as its metrics say.
fn terms_held(relay: &RunningRelay) -> Vec<String> {
    let text = relay.metrics.render();
    let held: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("outbox_partition_held{") && line.ends_with(" 1"))
        .filter_map(|line| line.split('"').nth(1))
        .collect();
    text.lines()
        .filter(|line| line.starts_with("outbox_partition_term{"))
        .filter(|line| line.split('"').nth(1).is_some_and(|p| held.contains(&p)))
        .map(str::to_owned)
        .collect()
}

/// A relay of a group of `partitions` whose leases a loaded machine keeps:
/// these tests count on no partition changing hands.
fn steady_group(env: &TestEnv, partitions: u32) -> outbox_relay::RelayConfig {
    let mut config = env.replica_config();
    config.partitions = partitions;
    config.lease_duration = Duration::from_secs(10);
    config.lease_renew_interval = Duration::from_millis(500);
    config
}

fn checkpoints(env: &TestEnv) -> mongodb::Collection<bson::Document> {
    env.db.collection("outbox_checkpoints")
}

/// A date `by` from the server's clock (this host's: the test servers
/// share it).
fn from_now(by: Duration) -> bson::DateTime {
    bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() + by.as_millis() as i64)
}

#[tokio::test]
async fn a_relay_from_before_groups_stands_by_while_a_group_delivers() {
    // A relay from before groups knows only the outbox's own lease, and
    // takes it as `Lease::try_acquire` does: a group holds it while it
    // delivers, and it lapses a lease after the group stops.
    let env = TestEnv::new().await;
    let config = steady_group(&env, 2);
    let relay = RunningRelay::start(config.clone()).await;
    wait_holding(&relay, 2).await;
    let timing = config.lease_timing();
    let before_groups = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
    match before_groups.try_acquire().await.unwrap() {
        Err(_left) => {}
        Ok(held) => panic!(
            "a relay from before groups took the outbox at term {:?}",
            held.term
        ),
    }
    // Nor does it take it between the group's renewals.
    tokio::time::sleep(config.lease_renew_interval * 4).await;
    assert!(before_groups.try_acquire().await.unwrap().is_err());
    relay.stop().await.unwrap();
    wait_until("the group's hold to lapse", || async {
        before_groups
            .try_acquire()
            .await
            .is_ok_and(|taken| taken.is_ok())
    })
    .await;
    env.drop().await;
}

#[tokio::test]
async fn a_clock_set_back_keeps_a_new_count_out_for_two_leases_not_for_the_step() {
    // The state a group of four leaves when the server's clock is set back
    // by half an hour after its last renewal: its lease and its group's
    // document expire half an hour ahead.
    let env = TestEnv::new().await;
    let ahead = from_now(Duration::from_secs(1800));
    let outbox = format!("{}.outbox", env.name);
    checkpoints(&env)
        .insert_many([
            doc! {
                "_id": format!("{outbox}:1/4"), "owner": "gone", "leaseOwner": "gone",
                "leaseMillis": 1500_i64, "term": 5_i64, "expiresAt": ahead,
            },
            doc! {
                "_id": format!("{outbox}/group"), "partitions": 4_i64,
                "leaseMillis": 1500_i64, "leaseFor": ahead, "expiresAt": ahead,
            },
        ])
        .await
        .unwrap();
    let config = steady_group(&env, 2);
    let relay = RunningRelay::start(config.clone()).await;
    wait_holding(&relay, 2).await;
    delivers_what_is_written(&env).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_deleted_group_document_is_written_anew_and_the_group_runs_on() {
    let env = TestEnv::new().await;
    let config = steady_group(&env, 2);
    let mut receiver = env.subscribe().await;
    let relays = [
        RunningRelay::start(config.clone()).await,
        RunningRelay::start(config.clone()).await,
    ];
    wait_until("each relay to hold one partition", || async {
        relays.iter().all(|r| partitions_held(r) == Some(1))
    })
    .await;
    let terms: Vec<Vec<String>> = relays.iter().map(terms_held).collect();
    let group = doc! { "_id": format!("{}.outbox/group", env.name) };
    let deleted = checkpoints(&env).delete_one(group.clone()).await.unwrap();
    assert_eq!(deleted.deleted_count, 1);
    wait_until("the group's document to be written again", || async {
        checkpoints(&env)
            .find_one(group.clone())
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let ids = write_orders(&env, 20).await;
    let seen = receiver.take(20).await;
    env.wait_count(doc! { "status": "processed", "_id": { "$in": &ids } }, 20)
        .await;
    assert!(count_by_id(&seen).values().all(|n| *n == 1), "a repeat");
    let after: Vec<Vec<String>> = relays.iter().map(terms_held).collect();
    assert_eq!(
        terms, after,
        "a relay stopped delivering and took a new term"
    );
    for relay in relays {
        relay.stop().await.unwrap();
    }
    env.drop().await;
}

#[tokio::test]
async fn a_group_starts_at_once_after_sweep_once_and_waits_out_one_running() {
    let env = TestEnv::new().await;
    let mut once = env.replica_config();
    once.mode = RelayMode::Poll;
    // A lease long enough that waiting for one would fail the test.
    once.lease_duration = Duration::from_secs(120);
    let ids = write_orders(&env, 5).await;
    let sweeper = Relay::connect(once.clone()).await.unwrap();
    assert_eq!(sweeper.sweep_once(WAIT).await.unwrap().delivered, 5);
    let mut config = env.replica_config();
    config.partitions = 2;
    config.lease_duration = once.lease_duration;
    let relay = RunningRelay::start(config.clone()).await;
    wait_holding(&relay, 2).await;
    relay.stop().await.unwrap();

    // A sweep under way holds the outbox's lease: a group starting meanwhile
    // waits for it, rather than refusing to start.
    let outbox = doc! { "_id": format!("{}.outbox", env.name) };
    checkpoints(&env)
        .update_one(
            outbox.clone(),
            doc! { "$set": {
                "owner": "a-sweep", "leaseOwner": "a-sweep", "sweepOnce": "a-sweep",
                "leaseMillis": 120_000_i64, "expiresAt": from_now(Duration::from_secs(60)),
            }, "$inc": { "term": 1_i64 } },
        )
        .await
        .unwrap();
    let relay = RunningRelay::start(config.clone()).await;
    relay.wait_for_role(STANDING_BY).await;
    let more = write_orders(&env, 5).await;
    assert_eq!(partitions_held(&relay), Some(0));
    checkpoints(&env)
        .update_one(
            outbox,
            doc! { "$set": { "expiresAt": bson::DateTime::from_millis(0) } },
        )
        .await
        .unwrap();
    wait_holding(&relay, 2).await;
    env.wait_count(doc! { "status": "processed", "_id": { "$in": &more } }, 5)
        .await;
    relay.stop().await.unwrap();
    assert_eq!(
        env.count(doc! { "_id": { "$in": &ids }, "status": "processed" })
            .await,
        5
    );
    env.drop().await;
}

#[tokio::test]
async fn a_count_change_whose_relay_stopped_before_retiring_is_retired_by_the_next() {
    // A relay took the group for four partitions and stopped before it
    // retired the positions four partitions stored in an earlier period.
    let env = TestEnv::new().await;
    let outbox = format!("{}.outbox", env.name);
    let stale = bson::Bson::Document(doc! { "_data": "8200000001" });
    checkpoints(&env)
        .insert_many([
            doc! { "_id": format!("{outbox}:0/4"), "token": stale.clone(), "term": 3_i64 },
            doc! { "_id": format!("{outbox}:1/2"), "token": stale, "term": 7_i64 },
            doc! {
                "_id": format!("{outbox}/group"), "partitions": 4_i64, "retiring": "all",
                "expiresAt": bson::DateTime::from_millis(0),
            },
        ])
        .await
        .unwrap();
    let config = steady_group(&env, 4);
    let relay = RunningRelay::start(config.clone()).await;
    wait_holding(&relay, 4).await;
    let group = checkpoints(&env)
        .find_one(doc! { "_id": format!("{outbox}/group") })
        .await
        .unwrap()
        .unwrap();
    assert!(!group.contains_key("retiring"), "{group}");
    let old = checkpoints(&env)
        .find_one(doc! { "_id": format!("{outbox}:1/2") })
        .await
        .unwrap()
        .unwrap();
    assert!(
        !old.contains_key("token"),
        "another count's position kept: {old}"
    );
    assert_eq!(old.get_i64("term"), Ok(8), "its term moved on");
    // Its own old position is gone too: the partition caught up instead
    // (it may have stored a new one since).
    delivers_what_is_written(&env).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_group_back_after_a_relay_of_one_partition_led_retires_its_positions() {
    // A group of four ran and stopped; then a relay from before groups led
    // the outbox alone (a rollback), which leaves the group's document as
    // it was; now the group of four is back.
    let env = TestEnv::new().await;
    let outbox = format!("{}.outbox", env.name);
    let stale = bson::Bson::Document(doc! { "_data": "8200000001" });
    let lapsed = bson::DateTime::from_millis(0);
    checkpoints(&env)
        .insert_many([
            doc! {
                "_id": format!("{outbox}:0/4"), "token": stale, "term": 3_i64,
                "owner": "web-1", "expiresAt": lapsed,
            },
            doc! { "_id": format!("{outbox}/group"), "partitions": 4_i64, "expiresAt": lapsed },
            doc! {
                "_id": &outbox, "owner": "before-groups/1", "term": 9_i64,
                "token": { "_data": "8200000002" }, "expiresAt": lapsed,
            },
        ])
        .await
        .unwrap();
    let relay = RunningRelay::start(steady_group(&env, 4)).await;
    wait_holding(&relay, 4).await;
    let partition = checkpoints(&env)
        .find_one(doc! { "_id": format!("{outbox}:0/4") })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        partition.get_i64("term"),
        Ok(5),
        "retired (its term moved on) before the group took it: {partition}"
    );
    delivers_what_is_written(&env).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

/// A standby beside a live leader reads the group as the leader's lease
/// would lapse, not every poll: over five of the leader's renewals it reads
/// it fewer than five times, where polling every 100 ms it would read it
/// every renewal several times over. A graceful stop's release wakes it
/// through its watch, and it takes over.
#[tokio::test]
async fn a_standby_reads_its_group_as_the_lease_would_lapse_not_every_poll() {
    let env = TestEnv::new().await;
    let mut config = env.replica_config();
    config.lease_duration = Duration::from_secs(2);
    config.lease_renew_interval = Duration::from_millis(500);
    config.standby_poll_interval = Duration::from_millis(100);
    let leader = RunningRelay::start_tailing(config.clone()).await;
    let standby = RunningRelay::start(config.clone()).await;
    standby.wait_for_role(STANDING_BY).await;
    let leases = env
        .db
        .collection::<bson::Document>(&config.checkpoint_collection);
    let lease_id = format!("{}.{}", env.db.name(), config.collection);
    let expiry = || async {
        leases
            .find_one(doc! { "_id": &lease_id })
            .await
            .unwrap()
            .and_then(|lease| lease.get_datetime("expiresAt").ok().copied())
    };
    // Renewals observed one after another: each a new expiry.
    let renewals = |count: usize| async move {
        let mut seen = expiry().await;
        for _ in 0..count {
            let renewed = async {
                loop {
                    let now = expiry().await;
                    if now != seen {
                        seen = now;
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::time::timeout(WAIT, renewed)
                .await
                .expect("the leader renews its lease");
        }
    };
    // The standby's first rounds (its join, the watch opening) come first.
    renewals(3).await;
    let before = group_reads(&standby);
    renewals(5).await;
    let read = group_reads(&standby) - before;
    assert!(
        read < 5,
        "the standby read its group {read} times over five of the leader's renewals"
    );
    assert!(standby.is(STANDING_BY));
    leader.stop().await.unwrap();
    standby.wait_for_role(LEADING).await;
    delivers_what_is_written(&env).await;
    standby.stop().await.unwrap();
}
