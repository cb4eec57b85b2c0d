//! Several relays on one outbox: one leads, the others stand by.

use std::collections::HashSet;
use std::time::Duration;

use crate::common::{
    count_by_id, msg_id, wait_until, write_orders, RunningRelay, TestEnv, LEADING, STANDING_BY,
};
use bson::{doc, Bson, DateTime, Document};
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

/// The lease document of the test's outbox, as a relay reads it.
fn lease_id(env: &TestEnv) -> String {
    format!("{}.outbox", env.name)
}

async fn write_lease(env: &TestEnv, fields: Document) {
    let mut lease = doc! { "_id": lease_id(env) };
    lease.extend(fields);
    env.db
        .collection::<Document>("outbox_checkpoints")
        .insert_one(lease)
        .await
        .unwrap();
}

async fn read_lease(env: &TestEnv) -> Document {
    env.db
        .collection::<Document>("outbox_checkpoints")
        .find_one(doc! { "_id": lease_id(env) })
        .await
        .unwrap()
        .expect("the lease")
}

/// A lease some other program wrote, with `fields` of types no relay
/// writes, is taken over by one relay, which delivers, while a second
/// beside it stands by.
async fn taken_over_beside_a_standby(fields: Document) {
    let env = TestEnv::new().await;
    write_lease(&env, fields.clone()).await;
    let mut config = env.replica_config();
    // A standby's wait on an expiry that is not a date is one lease.
    config.lease_duration = Duration::from_secs(3);
    let first = RunningRelay::start(config.clone()).await;
    first.wait_for_role(LEADING).await;
    let second = RunningRelay::start(config).await;
    second.wait_for_role(STANDING_BY).await;
    let ids = write_orders(&env, 5).await;
    env.wait_count(doc! { "status": "processed", "_id": { "$in": &ids } }, 5)
        .await;
    // A 3 s lease may change hands on a loaded machine: what must hold
    // is that the two never lead at once.
    assert!(
        !(first.is(LEADING) && second.is(LEADING)),
        "no two leaders: {fields}"
    );
    let lease = read_lease(&env).await;
    assert!(
        matches!(lease.get("term"), Some(Bson::Int64(_) | Bson::Int32(_))),
        "{lease}"
    );
    assert!(lease.get_datetime("expiresAt").is_ok(), "{lease}");
    first.stop().await.unwrap();
    second.stop().await.unwrap();
    env.drop().await;
}

/// A lapsed expiry, as a crashed holder leaves it.
fn lapsed() -> DateTime {
    DateTime::from_millis(DateTime::now().timestamp_millis() - 60_000)
}

macro_rules! taken_over {
    ($($name:ident: $fields:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            taken_over_beside_a_standby($fields).await;
        }
    )*};
}

taken_over! {
    a_lease_expiring_at_null_is_taken_over: doc! { "owner": "gone", "term": 3_i64, "expiresAt": Bson::Null };
    a_lease_expiring_at_a_number_is_taken_over:
        doc! { "owner": "gone", "term": 3_i64, "expiresAt": DateTime::now().timestamp_millis() };
    a_lease_expiring_at_a_string_is_taken_over:
        doc! { "owner": "gone", "term": 3_i64, "expiresAt": "2030-01-01T00:00:00Z" };
    a_lease_with_a_string_term_is_taken_over: doc! { "owner": "gone", "term": "7", "expiresAt": lapsed() };
    a_lease_with_a_fractional_term_is_taken_over: doc! { "owner": "gone", "term": 7.5, "expiresAt": lapsed() };
    a_lease_with_the_largest_term_is_taken_over:
        doc! { "owner": "gone", "term": i64::MAX, "expiresAt": lapsed() };
    a_lease_with_a_term_past_exact_doubles_is_taken_over:
        doc! { "owner": "gone", "term": 1e20, "expiresAt": lapsed() };
    a_lease_with_a_null_term_and_a_numeric_owner_is_taken_over:
        doc! { "owner": 42, "term": Bson::Null, "expiresAt": lapsed() };
    a_lease_with_no_field_of_the_right_type_is_taken_over:
        doc! { "owner": [1], "term": true, "expiresAt": {} };
    // A query's `$type` and `$lt` match an array's elements.
    a_lease_with_a_term_in_an_array_is_taken_over:
        doc! { "owner": "gone", "term": [5_i64], "expiresAt": lapsed() };
    // No relay writes an expiry more than its lease (an hour at most) ahead.
    a_lease_expiring_far_ahead_with_a_stated_lease_is_taken_over: doc! {
        "owner": "gone", "term": 3_i64, "leaseMillis": 2_000_i64, "leaseOwner": "gone",
        "expiresAt": DateTime::from_millis(253_402_300_000_000),
    };
    a_lease_expiring_at_an_array_of_a_far_date_is_taken_over:
        doc! { "owner": "gone", "term": 3_i64, "expiresAt": [DateTime::from_millis(253_402_300_000_000)] };
}

/// An expiry far ahead with no lease stated (an edit, or a clock set back
/// under a holder that states none) is brought back to the longest lease
/// a relay takes: a live holder could have taken that long.
#[tokio::test]
async fn a_lease_expiring_far_ahead_with_no_lease_stated_ends_within_the_longest_lease() {
    let env = TestEnv::new().await;
    let far = DateTime::from_millis(253_402_300_000_000);
    write_lease(
        &env,
        doc! { "owner": "gone", "term": 3_i64, "expiresAt": far },
    )
    .await;
    let relay = RunningRelay::start(env.replica_config()).await;
    relay.wait_for_role(STANDING_BY).await;
    let expiry = || async {
        read_lease(&env)
            .await
            .get_datetime("expiresAt")
            .ok()
            .copied()
    };
    wait_until("the far expiry to be rewritten", || async {
        expiry().await != Some(far)
    })
    .await;
    let rewritten = expiry().await.expect("a date");
    let ahead = rewritten.timestamp_millis() - DateTime::now().timestamp_millis();
    assert!(
        (3_000_000..=3_600_000).contains(&ahead),
        "an hour at most from now: {ahead} ms"
    );
    assert!(relay.is(STANDING_BY), "not taken before it ends");
    relay.stop().await.unwrap();
    env.drop().await;
}

/// Terms taken over a term that cannot be counted go on growing by one,
/// from above anything read from it; two relays never take one term.
#[tokio::test]
async fn terms_taken_over_an_uncountable_term_grow_above_it() {
    let timing = LeaseTiming {
        duration: Duration::from_secs(30),
        renew_interval: Duration::from_secs(10),
        standby_poll_interval: Duration::from_millis(100),
    };
    for term in [
        Bson::String("7".into()),
        Bson::Double(7.5),
        Bson::Double(1e20),
        Bson::Int64(i64::MAX),
    ] {
        let env = TestEnv::new().await;
        write_lease(
            &env,
            doc! { "owner": "gone", "term": term.clone(), "expiresAt": lapsed() },
        )
        .await;
        let a = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
        let b = Lease::new(&env.db, "outbox_checkpoints", "outbox", timing);
        let held_a = a.try_acquire().await.unwrap().expect("taken over");
        b.try_acquire()
            .await
            .unwrap()
            .expect_err("held by the first");
        assert!(held_a.term.0 > 7, "{term:?}: {:?}", held_a.term);
        assert_eq!(
            read_lease(&env).await.get("term"),
            Some(&Bson::Int64(held_a.term.0))
        );
        a.release(&held_a).await.unwrap();
        let held_b = b.try_acquire().await.unwrap().expect("released");
        assert_eq!(held_b.term.0, held_a.term.0 + 1, "{term:?}");
        env.drop().await;
    }
}
