//! What holds the inbox consumer up, and for how long: a record another
//! transaction holds (a process that died mid-run leaves one until the
//! server ends its transaction) holds up only its message, and a stop
//! returns within its bound whatever MongoDB does.

use std::collections::HashMap;

use tokio::sync::{mpsc, Notify};

use super::*;
use crate::common::{nats_url, MongoProcess};

/// A handler that upserts one effect document per message, named by its
/// message id, in the message's transaction.
fn effect_per_message(effects: &Collection<Document>) -> impl Handler {
    let effects = effects.clone();
    handler(move |session, message| {
        let effects = effects.clone();
        let id = message.message_id.clone().unwrap_or_default();
        async move { count(session, &effects, &id).await }.boxed()
    })
}

/// Each effect document's count, by message id.
pub(super) async fn effects_by_id(effects: &Collection<Document>) -> HashMap<String, i64> {
    let mut found = HashMap::new();
    // Counts only: not the keys' lines `recording` keeps beside them.
    let mut cursor = effects
        .find(doc! { "n": { "$exists": true } })
        .await
        .unwrap();
    while let Some(effect) = cursor.next().await {
        let effect = effect.unwrap();
        let n = effect
            .get_i32("n")
            .map(i64::from)
            .or_else(|_| effect.get_i64("n"))
            .unwrap();
        found.insert(effect.get_str("_id").unwrap().to_owned(), n);
    }
    found
}

/// The records of messages a process killed in their transactions left:
/// counted once, as their first run counted them, then held by that
/// process's transaction (returned open), as the server keeps a dead
/// client's until its lifetime ends. A write outside a transaction would
/// wait on them.
async fn hold_records(env: &TestEnv, inbox: &Inbox, ids: &[&str]) -> ClientSession {
    for id in ids {
        inbox
            .collection()
            .insert_one(doc! {
                "consumer": "billing", "messageId": id, "status": "failing", "attempts": 1,
            })
            .await
            .unwrap();
    }
    let mut dead = env.client.start_session().await.unwrap();
    dead.start_transaction().await.unwrap();
    for id in ids {
        inbox
            .collection()
            .update_one(
                doc! { "consumer": "billing", "messageId": id },
                doc! { "$inc": { "attempts": 1 }, "$set": { "status": "handled" } },
            )
            .session(&mut dead)
            .await
            .unwrap();
    }
    dead
}

#[tokio::test]
async fn a_message_whose_record_another_transaction_holds_waits_alone() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    // One transaction at a time: a message waiting on its record in that
    // place would hold every other message up.
    let consumer = quick(&inbox, &env).concurrency(1).bind().await.unwrap();
    let (keyed, unkeyed) = (ObjectId::new().to_hex(), ObjectId::new().to_hex());
    assert!(publish_stored(&env, "order.placed", &keyed, Some("a")).await);
    assert!(publish_stored(&env, "order.placed", &unkeyed, None).await);
    // Delivered once each and never acknowledged, as to a process killed
    // in their transactions: the next deliveries count a run first.
    deliver_unacknowledged(&env).await;
    deliver_unacknowledged(&env).await;
    let mut dead = hold_records(&env, &inbox, &[&keyed, &unkeyed]).await;
    let effects = env.db.collection::<Document>("effects");
    let running = Running::start(consumer, effect_per_message(&effects));
    // Both redelivered to the consumer (JetStream's fourth delivery), once
    // their ack waits ran out: they now wait on their records.
    wait_until("the two to be redelivered to the consumer", || async {
        let mut durable = durable(&env).await;
        durable.info().await.unwrap().delivered.consumer_sequence >= 4
    })
    .await;
    let others: Vec<String> = (0..4).map(|_| ObjectId::new().to_hex()).collect();
    for (n, id) in others.iter().enumerate() {
        let key = ["a2", "b"][n % 2];
        assert!(publish_stored(&env, "order.placed", id, Some(key)).await);
    }
    wait_metric(&metrics, |c| c.handled, others.len() as u64).await;
    let applied = effects_by_id(&effects).await;
    for id in &others {
        assert_eq!(applied.get(id), Some(&1), "handled while the two waited");
    }
    assert!(!applied.contains_key(&keyed) && !applied.contains_key(&unkeyed));
    // The holder dies without a commit: the two are handled, once each.
    dead.abort_transaction().await.unwrap();
    wait_metric(&metrics, |c| c.handled, others.len() as u64 + 2).await;
    let applied = effects_by_id(&effects).await;
    assert_eq!(applied.get(&keyed), Some(&1));
    assert_eq!(applied.get(&unkeyed), Some(&1));
    for id in [&keyed, &unkeyed] {
        let record = record(&inbox, id).await.expect("its record");
        assert_eq!(record.get_str("status").unwrap(), "handled");
        // The first run, and the one that handled it: the tries that
        // found the record held counted nothing.
        assert_eq!(attempts(&record), Some(2), "waiting counted nothing");
    }
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_key_that_waits_on_its_record_holds_up_no_other_key_however_many_it_receives() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    // Sixteen places among the held, one transaction at a time.
    let consumer = quick(&inbox, &env).concurrency(1).bind().await.unwrap();
    let first = ObjectId::new().to_hex();
    assert!(publish_stored(&env, "order.placed", &first, Some("a")).await);
    // Delivered twice and never acknowledged, as to a process killed in
    // its transaction: the next delivery counts a run first, and meets the
    // record that process's transaction still holds.
    deliver_unacknowledged(&env).await;
    deliver_unacknowledged(&env).await;
    let mut dead = hold_records(&env, &inbox, &[&first]).await;
    let effects = env.db.collection::<Document>("effects");
    let running = Running::start(consumer, recording(&effects));
    wait_until("the first to be redelivered to the consumer", || async {
        let mut durable = durable(&env).await;
        durable.info().await.unwrap().delivered.consumer_sequence >= 3
    })
    .await;
    // Three times the places among the held behind it, then the others.
    let mut behind = vec![first.clone()];
    for _ in 0..48 {
        let id = ObjectId::new().to_hex();
        assert!(publish_stored(&env, "order.placed", &id, Some("a")).await);
        behind.push(id);
    }
    let others: Vec<String> = (0..20).map(|_| ObjectId::new().to_hex()).collect();
    for (n, id) in others.iter().enumerate() {
        assert!(publish_stored(&env, "order.placed", id, ["b", "c"].get(n % 4).copied()).await);
    }
    wait_metric(&metrics, |c| c.handled, others.len() as u64).await;
    let applied = effects_by_id(&effects).await;
    for id in &others {
        assert_eq!(applied.get(id), Some(&1), "handled while key a waited");
    }
    assert!(
        behind.iter().all(|id| !applied.contains_key(id)),
        "nothing of key a goes before its first"
    );
    dead.abort_transaction().await.unwrap();
    wait_metric(
        &metrics,
        |c| c.handled,
        (others.len() + behind.len()) as u64,
    )
    .await;
    let applied = effects_by_id(&effects).await;
    for id in &behind {
        assert_eq!(applied.get(id), Some(&1), "each of key a once");
    }
    let line = effects
        .find_one(doc! { "_id": "key-a" })
        .await
        .unwrap()
        .expect("key a's line");
    let order: Vec<&str> = line
        .get_array("ids")
        .unwrap()
        .iter()
        .filter_map(|id| id.as_str())
        .collect();
    assert_eq!(order, behind, "key a in stream order");
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_stop_returns_within_its_bound_while_mongodb_does_not_answer() {
    let mongo = MongoProcess::start().await;
    let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env)
        .shutdown_timeout(Duration::from_secs(1))
        .bind()
        .await
        .unwrap();
    let bound = consumer.stop_bound();
    let (began, mut beginning) = mpsc::unbounded_channel::<()>();
    let go = Arc::new(Notify::new());
    let effects = env.db.collection::<Document>("effects");
    let handler = {
        let go = go.clone();
        handler(move |session, _| {
            let (effects, began, go) = (effects.clone(), began.clone(), go.clone());
            async move {
                let _ = began.send(());
                go.notified().await;
                count(session, &effects, "orders").await
            }
            .boxed()
        })
    };
    let running = Running::start(consumer, handler);
    assert!(publish_stored(&env, "order.placed", &ObjectId::new().to_hex(), None).await);
    tokio::time::timeout(WAIT, beginning.recv())
        .await
        .expect("the handler begins")
        .expect("the handler begins");
    // The handler's write goes to a server that answers nothing.
    mongo.pause();
    go.notify_one();
    running.shutdown.cancel();
    let stopped = tokio::time::timeout(bound, running.task)
        .await
        .expect("the run returns within its documented bound")
        .expect("the consumer did not panic");
    assert!(
        matches!(stopped, Err(outbox_relay::Error::ShutdownTimeout(_))),
        "says it abandoned a transaction: {stopped:?}"
    );
    mongo.resume();
    env.drop().await;
}
