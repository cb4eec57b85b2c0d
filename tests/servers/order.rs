//! Per-key order against the real servers: messages sharing a key are
//! stored into the stream in commit order through refusals, dead letters,
//! broker restarts, leader kills and a sweep racing the stream, while other
//! keys flow.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, Document};
use outbox_relay::admin::dlq::{self, Selection};
use outbox_relay::order::PARKED;
use outbox_relay::DeadLetters;

use crate::common::{
    assert_order_per_key, mongodb_uri, wait_until, NatsProcess, RelayProcess, RunningRelay,
    TestEnv, QUICK_TAKEOVER,
};

/// Payload size of a message the test streams refuse (over 1000 bytes).
const BIG: usize = 2000;

/// Limits the test's stream to messages of `bytes` at most.
async fn limit_message_size(env: &TestEnv, bytes: i32) {
    let mut stream = env.jetstream.get_stream(&env.stream).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_message_size = bytes;
    env.jetstream.update_stream(config).await.unwrap();
}

async fn document(env: &TestEnv, id: ObjectId) -> Document {
    env.outbox()
        .find_one(doc! { "_id": id })
        .await
        .unwrap()
        .expect("the message exists")
}

/// Messages written in order per key, recorded as they commit.
#[derive(Clone, Default)]
struct Committed(Arc<Mutex<HashMap<String, Vec<ObjectId>>>>);

impl Committed {
    async fn write(&self, env: &TestEnv, key: &str, size: usize) -> ObjectId {
        let id = env.insert_keyed(key, size).await;
        self.record(key, id);
        id
    }

    fn record(&self, key: &str, id: ObjectId) {
        self.0
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .push(id);
    }

    /// Forgets a message that will not be in the stream (a dead letter).
    fn forget(&self, id: ObjectId) {
        for ids in self.0.lock().unwrap().values_mut() {
            ids.retain(|i| *i != id);
        }
    }

    fn all(&self) -> HashMap<String, Vec<ObjectId>> {
        self.0.lock().unwrap().clone()
    }

    fn count(&self) -> u64 {
        self.0
            .lock()
            .unwrap()
            .values()
            .map(|ids| ids.len() as u64)
            .sum()
    }
}

#[tokio::test]
async fn a_refused_message_holds_its_key_until_it_is_dead_lettered() {
    let env = TestEnv::new().await;
    limit_message_size(&env, 1000).await;
    let mut config = env.quick_config(2);
    // Long enough that other keys visibly flow while the key is held.
    config.retry_initial_delay = Duration::from_secs(1);
    config.retry_max_delay = Duration::from_secs(1);
    let relay = RunningRelay::start_tailing(config).await;
    let committed = Committed::default();

    committed.write(&env, "k", 10).await;
    let big = committed.write(&env, "k", BIG).await;
    let mut others = Vec::new();
    for n in 0..5 {
        committed.write(&env, "k", 10).await;
        others.push(committed.write(&env, &format!("other{n}"), 10).await);
    }
    env.wait_count(doc! { "status": "failed" }, 1).await;
    env.wait_count(doc! { "status": "processed" }, committed.count() - 1)
        .await;

    let failed = document(&env, big).await;
    let failed_at = *failed.get_datetime("failedAt").unwrap();
    assert_eq!(failed.get_i32("attempts").unwrap(), 2, "{failed}");
    let processed_at = |d: &Document| *d.get_datetime("processedAt").unwrap();
    let outbox = env.outbox();
    let later_of_k = outbox
        .find(doc! { "key": "k", "_id": { "$gt": big } })
        .await
        .unwrap();
    let later_of_k: Vec<Document> = futures::TryStreamExt::try_collect(later_of_k)
        .await
        .unwrap();
    assert_eq!(later_of_k.len(), 5);
    assert!(
        later_of_k.iter().all(|d| processed_at(d) >= failed_at),
        "later messages of k were delivered only once it was dead-lettered"
    );
    let first_other = document(&env, others[0]).await;
    assert!(
        processed_at(&first_other) < failed_at,
        "other keys flowed while k was held"
    );
    committed.forget(big);
    assert_order_per_key(&env.stored().await, &committed.all());
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn with_on_dead_letter_hold_a_key_waits_for_replay_or_discard() {
    let env = TestEnv::new().await;
    limit_message_size(&env, 1000).await;
    let mut config = env.quick_config(1);
    config.on_dead_letter = DeadLetters::Hold;
    let relay = RunningRelay::start(config.clone()).await;
    let committed = Committed::default();

    // A delivery first: the evidence that lets a refusal dead-letter.
    committed.write(&env, "warm", 10).await;
    env.wait_count(doc! { "status": "processed" }, 1).await;
    let mut big = HashMap::new();
    let mut after = HashMap::new();
    for key in ["replayed", "discarded"] {
        committed.write(&env, key, 10).await;
        big.insert(key, committed.write(&env, key, BIG).await);
        after.insert(key, committed.write(&env, key, 10).await);
    }
    env.wait_count(doc! { "status": "failed", "holdsKey": true }, 2)
        .await;
    let unheld = committed.write(&env, "unheld", 10).await;
    env.wait_count(doc! { "nextAttemptAt": PARKED }, 2).await;
    env.wait_count(doc! { "_id": unheld, "status": "processed" }, 1)
        .await;

    let status = outbox_relay::admin::status::Status::read(&env.db, &config)
        .await
        .unwrap();
    let mut held: Vec<(String, Option<String>, &str)> = status
        .held_keys
        .iter()
        .map(|h| (h.key.clone(), h.holder.clone(), h.state))
        .collect();
    held.sort();
    assert_eq!(
        held,
        [
            (
                "discarded".into(),
                Some(big["discarded"].to_hex()),
                "dead letter"
            ),
            (
                "replayed".into(),
                Some(big["replayed"].to_hex()),
                "dead letter"
            ),
        ]
    );
    assert!(
        status.render().contains("held keys: 2"),
        "{}",
        status.render()
    );

    dlq::discard(&env.outbox(), &Selection::Ids(vec![big["discarded"]]))
        .await
        .unwrap();
    committed.forget(big["discarded"]);
    env.wait_count(doc! { "_id": after["discarded"], "status": "processed" }, 1)
        .await;
    assert_eq!(
        document(&env, after["replayed"])
            .await
            .get_datetime("nextAttemptAt")
            .ok(),
        Some(&PARKED),
        "a discard releases only its own key"
    );

    limit_message_size(&env, 100_000).await;
    dlq::replay(&env.outbox(), &Selection::Ids(vec![big["replayed"]]))
        .await
        .unwrap();
    env.wait_count(doc! { "_id": after["replayed"], "status": "processed" }, 1)
        .await;
    assert!(
        document(&env, big["replayed"])
            .await
            .get("holdsKey")
            .is_none(),
        "a replay clears the hold"
    );
    assert_order_per_key(&env.stored().await, &committed.all());
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_nats_restart_keeps_the_order_of_fifty_keys_written_at_once() {
    let mut nats = NatsProcess::start().await;
    let env = TestEnv::on(&mongodb_uri(), &nats.url()).await;
    let mut config = env.quick_config(10);
    config.grace_period = Duration::from_secs(1);
    let relay = RunningRelay::start_tailing(config).await;
    let committed = Committed::default();

    let writers: Vec<_> = (0..50)
        .map(|n| {
            let (env, committed) = (env.clone_handles(), committed.clone());
            tokio::spawn(async move {
                for _ in 0..20 {
                    committed.write(&env, &format!("key{n}"), 10).await;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        })
        .collect();
    wait_until("a third of the messages to be delivered", || async {
        env.count(doc! { "status": "processed" }).await > 300
    })
    .await;
    nats.stop();
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.restart().await;
    for writer in writers {
        writer.await.unwrap();
    }
    env.wait_count(doc! { "status": "processed" }, 1000).await;
    assert_order_per_key(&env.stored().await, &committed.all());
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_new_leader_keeps_a_held_key_held_and_each_key_in_order() {
    let env = TestEnv::new().await;
    limit_message_size(&env, 1000).await;
    let settings = [
        ("OUTBOX_MAX_ATTEMPTS", "1000"),
        ("OUTBOX_RETRY_INITIAL_DELAY", "100ms"),
        ("OUTBOX_RETRY_MAX_DELAY", "200ms"),
        ("OUTBOX_SWEEP_INTERVAL", "100ms"),
        QUICK_TAKEOVER[0],
        QUICK_TAKEOVER[1],
    ];
    let mut first = RelayProcess::start_with(&env, "first", &settings);
    let committed = Committed::default();
    committed.write(&env, "k", 10).await;
    let big = committed.write(&env, "k", BIG).await;
    committed.write(&env, "k", 10).await;
    for n in 0..10 {
        committed.write(&env, &format!("other{n}"), 10).await;
    }
    env.wait_count(doc! { "nextAttemptAt": PARKED }, 1).await;
    let mut second = RelayProcess::start_with(&env, "second", &settings);
    first.kill9();

    // The new leader learns the hold from the collection: a message of k
    // written now is parked, while other keys flow.
    let after = committed.write(&env, "k", 10).await;
    let other = committed.write(&env, "other0", 10).await;
    env.wait_count(doc! { "_id": other, "status": "processed" }, 1)
        .await;
    env.wait_count(doc! { "_id": after, "nextAttemptAt": PARKED }, 1)
        .await;
    assert_eq!(
        document(&env, big).await.get_str("status").unwrap(),
        "pending"
    );

    limit_message_size(&env, 100_000).await;
    env.wait_count(doc! { "status": "processed" }, committed.count())
        .await;
    assert_order_per_key(&env.stored().await, &committed.all());
    assert!(second.running(), "log {}", second.log.display());
    env.drop().await;
}

#[tokio::test]
async fn the_sweep_racing_the_stream_on_a_backlog_keeps_each_key_in_order() {
    let env = TestEnv::new().await;
    limit_message_size(&env, 1000).await;
    let mut config = env.quick_config(1000);
    // The sweep takes messages as soon as they are committed, as the
    // stream does, and reads in small batches.
    config.grace_period = Duration::ZERO;
    config.sweep_interval = Duration::from_millis(5);
    config.batch_size = 7;
    let relay = RunningRelay::start(config.clone()).await;
    let committed = Committed::default();
    committed.write(&env, "warm", 10).await;
    env.wait_count(doc! { "status": "processed" }, 1).await;
    relay.stop().await.unwrap();

    // A backlog written while the relay is down: the stream replays it
    // from the stored position while the sweep claims it too. In five
    // keys one early message is refused until the stream takes it.
    let writers: Vec<_> = (0..20)
        .map(|n| {
            let (env, committed) = (env.clone_handles(), committed.clone());
            tokio::spawn(async move {
                for i in 0..25 {
                    let size = if n < 5 && i == 3 { BIG } else { 10 };
                    committed.write(&env, &format!("key{n}"), size).await;
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }
    let relay = RunningRelay::start(config).await;
    // And more while both race.
    for n in 0..20 {
        for _ in 0..5 {
            committed.write(&env, &format!("key{n}"), 10).await;
        }
    }
    env.wait_count(doc! { "nextAttemptAt": PARKED }, 5 * 26)
        .await;
    limit_message_size(&env, 100_000).await;
    env.wait_count(doc! { "status": "processed" }, committed.count())
        .await;
    assert_order_per_key(&env.stored().await, &committed.all());
    let parked = env
        .count(doc! { "status": "pending", "nextAttemptAt": { "$gte": DateTime::now() } })
        .await;
    assert_eq!(parked, 0, "nothing is left parked");
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn sweep_once_gives_up_where_a_relay_leads() {
    let env = TestEnv::new().await;
    let config = env.quick_config(3);
    let relay = RunningRelay::start(config.clone()).await;
    env.insert_keyed("k", 10).await;
    env.wait_count(doc! { "status": "processed" }, 1).await;
    let mut once = config;
    once.mode = outbox_relay::RelayMode::Poll; // no grace period
    let sweeper = outbox_relay::Relay::connect(once).await.unwrap();
    let outcome = sweeper.sweep_once(crate::common::WAIT).await;
    match outcome {
        Err(outbox_relay::Error::GaveUp(why)) => {
            assert!(why.contains("leads this outbox"), "{why}")
        }
        other => panic!("expected to give up, got {other:?}"),
    }
    relay.stop().await.unwrap();
    // With the leader gone, the sweep runs.
    env.insert_keyed("k", 10).await;
    let tally = sweeper.sweep_once(crate::common::WAIT).await.unwrap();
    assert_eq!(tally.delivered, 1);
    env.drop().await;
}

#[tokio::test]
async fn a_first_start_catching_up_while_keys_are_written_keeps_each_key_in_order() {
    let env = TestEnv::new().await;
    let mut config = env.quick_config(10);
    // The sweep leaves the start to the catch-up pass and the stream.
    config.grace_period = Duration::from_secs(3600);
    config.batch_size = 10;
    let committed = Committed::default();
    for n in 0..20 {
        for _ in 0..10 {
            committed.write(&env, &format!("key{n}"), 10).await;
        }
    }
    // Writers go on while the pass reads, in small batches, what is pending.
    let writers: Vec<_> = (0..20)
        .map(|n| {
            let (env, committed) = (env.clone_handles(), committed.clone());
            tokio::spawn(async move {
                for _ in 0..10 {
                    committed.write(&env, &format!("key{n}"), 10).await;
                }
            })
        })
        .collect();
    let relay = RunningRelay::start(config).await;
    for writer in writers {
        writer.await.unwrap();
    }
    env.wait_count(doc! { "status": "processed" }, committed.count())
        .await;
    assert_order_per_key(&env.stored().await, &committed.all());
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_hold_written_out_of_the_leaders_sight_is_taken_on_and_released() {
    let env = TestEnv::new().await;
    let mut config = env.quick_config(3);
    // The holds are read back every collect interval, however seldom the
    // sweep passes.
    config.collect_interval = Duration::from_millis(100);
    config.sweep_interval = Duration::from_secs(3600);
    let relay = RunningRelay::start(config).await;
    let committed = Committed::default();
    committed.write(&env, "warm", 10).await;
    env.wait_count(doc! { "status": "processed" }, 1).await;

    // A former leader's park that landed after this leader read the holds:
    // no relay knows the key is held, and no sweep range reads the message.
    let stranded = ObjectId::new();
    env.outbox()
        .insert_one(doc! {
            "_id": stranded, "type": "keyed", "key": "k", "payload": "x",
            "status": "processed", "processedAt": DateTime::now(),
        })
        .await
        .unwrap();
    env.outbox()
        .update_one(
            doc! { "_id": stranded },
            doc! { "$set": { "status": "pending", "nextAttemptAt": PARKED } },
        )
        .await
        .unwrap();
    committed.record("k", stranded);
    env.wait_count(doc! { "_id": stranded, "status": "processed" }, 1)
        .await;
    // The key is free again: its next message goes at once.
    committed.write(&env, "k", 10).await;
    env.wait_count(doc! { "status": "processed" }, committed.count())
        .await;
    assert_order_per_key(&env.stored().await, &committed.all());
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_message_too_large_for_its_change_event_takes_its_turn_in_its_key() {
    // A server that takes messages of 20 MB, so the large one is delivered.
    let nats = NatsProcess::start_with("max_payload: 20971520", None).await;
    let env = TestEnv::on(&mongodb_uri(), &nats.url()).await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start_tailing(env.config()).await;
    // Past what a change event carries whole (16 MiB less 64 KiB), so the
    // stream brings a stub of its `_id`.
    let large = ObjectId::new();
    let small = ObjectId::new();
    let mut session = env.client.start_session().await.unwrap();
    session.start_transaction().await.unwrap();
    for (id, size) in [(large, 16 * 1024 * 1024 - 32 * 1024), (small, 10)] {
        env.outbox()
            .insert_one(doc! {
                "_id": id, "type": "order.placed", "payload": "x".repeat(size),
                "key": "k", "status": "pending",
            })
            .session(&mut session)
            .await
            .unwrap();
    }
    session.commit_transaction().await.unwrap();
    let received = receiver.until_id(small).await;
    let order: Vec<String> = received.iter().filter_map(crate::common::msg_id).collect();
    assert_eq!(
        order,
        [large.to_hex(), small.to_hex()],
        "the large message first, as committed"
    );
    relay.stop().await.unwrap();
    env.drop().await;
}
