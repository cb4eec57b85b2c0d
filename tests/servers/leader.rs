//! Several relays on one outbox: one leads, the others stand by.

use std::collections::HashSet;
use std::time::Duration;

use crate::common::{count_by_id, msg_id, write_orders, RunningRelay, TestEnv};
use bson::doc;
use outbox_relay::checkpoint::CheckpointStore;
use outbox_relay::lease::{Lease, LeaseTiming};

#[tokio::test]
async fn with_three_relays_each_message_is_published_once() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relays = [
        RunningRelay::start(env.replica_config()).await,
        RunningRelay::start(env.replica_config()).await,
        RunningRelay::start(env.replica_config()).await,
    ];
    let ids = write_orders(&env, 40).await;
    let seen = receiver.until_id(ids[39]).await;
    env.wait_count(doc! { "status": "processed" }, 40).await;
    for relay in relays {
        relay.stop().await.unwrap();
    }
    let counts = count_by_id(&seen);
    assert_eq!(counts.len(), 40);
    assert!(
        counts.values().all(|&n| n == 1),
        "only the leader publishes: {counts:?}"
    );
    assert_eq!(env.stream_count().await, 40);
    env.drop().await;
}

#[tokio::test]
async fn a_standby_takes_over_when_the_leader_stops_and_loses_nothing() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let first = RunningRelay::start(env.replica_config()).await;
    let second = RunningRelay::start(env.replica_config()).await;
    let before = write_orders(&env, 10).await;
    receiver.until_id(before[9]).await;
    first.stop().await.unwrap();
    let after = write_orders(&env, 10).await;
    let seen = receiver.until_id(after[9]).await;
    let seen: HashSet<String> = seen.iter().filter_map(msg_id).collect();
    let expected: HashSet<String> = after.iter().map(|id| id.to_hex()).collect();
    assert!(expected.is_subset(&seen));
    env.wait_count(doc! { "status": "processed" }, 20).await;
    second.stop().await.unwrap();
    assert_eq!(env.stream_count().await, 20);
    env.drop().await;
}

#[tokio::test]
async fn leadership_terms_grow_and_fence_the_checkpoint() {
    let env = TestEnv::new().await;
    let timing = LeaseTiming {
        duration: Duration::from_secs(30),
        renew_interval: Duration::from_secs(10),
        standby_poll_interval: Duration::from_millis(100),
    };
    let a = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
    let b = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
    let mut held_a = a
        .try_acquire()
        .await
        .unwrap()
        .expect("a free lease is taken");
    let remaining = b
        .try_acquire()
        .await
        .unwrap()
        .expect_err("a held lease is not");
    assert!(
        remaining > Duration::from_secs(20) && remaining <= Duration::from_secs(30),
        "{remaining:?}"
    );
    assert!(a.renew(&mut held_a).await.unwrap());

    a.release(&held_a).await.unwrap();
    let held_b = b
        .try_acquire()
        .await
        .unwrap()
        .expect("a released lease is free");
    assert_eq!(held_b.term.0, held_a.term.0 + 1);
    assert!(
        !a.renew(&mut held_a).await.unwrap(),
        "the old holder has lost it"
    );

    // A real resume token to write.
    let mut stream = env.outbox().watch().await.unwrap();
    let _ = stream.next_if_any().await.unwrap();
    let token = stream.resume_token().expect("a resume token");
    let store = CheckpointStore::new(&env.db, "outbox_checkpoints", "outbox");
    let saves = |owner: &str, term| {
        let (fenced, token) = (store.clone().fenced(owner, term), token.clone());
        async move { fenced.save(&token, None).await.unwrap() }
    };
    assert!(
        !saves(a.owner(), held_a.term).await,
        "the old term may not write"
    );
    // Two relays with one term (a rolled-back acquisition): only the
    // lease's owner writes.
    assert!(
        !saves(a.owner(), held_b.term).await,
        "another owner may not write in the holder's term"
    );
    assert!(saves(b.owner(), held_b.term).await);
    env.drop().await;
}
