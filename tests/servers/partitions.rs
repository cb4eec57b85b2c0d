//! Two relays sharing an outbox's two partitions in one process: each
//! message once, and what `status`, the metrics and `sweep --once` say of
//! the group. (The faults a group meets are in `tests/faults.rs`.)

use crate::common::{
    count_by_id, wait_until, write_orders, RunningRelay, TestEnv, STANDING_BY, WAIT,
};
use bson::doc;
use outbox_relay::admin::status::Status;
use outbox_relay::{Error, Relay, RelayMode};

/// How many partitions a relay says it holds.
fn partitions_held(relay: &RunningRelay) -> Option<u32> {
    relay
        .metrics
        .render()
        .lines()
        .find_map(|line| line.strip_prefix("outbox_partitions_held "))
        .and_then(|value| value.trim().parse().ok())
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
    wait_until("the relay to hold its three partitions", || async {
        partitions_held(&relay) == Some(3)
    })
    .await;
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
