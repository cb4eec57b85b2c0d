//! The push path end to end, against a real MongoDB-compatible server and
//! a real nats-server.

use std::collections::HashSet;

use crate::common::{count_by_id, header, msg_id, write_orders, RunningRelay, TestEnv};
use bson::{doc, oid::ObjectId, spec::BinarySubtype, Binary, Bson, Document};
use outbox_relay::{Error, MessageType, NewMessage, Outbox};
use serde::Serialize;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[derive(Serialize)]
struct OrderShipped {
    order: String,
    parcels: u32,
}

impl MessageType for OrderShipped {
    const MESSAGE_TYPE: &'static str = "order.shipped";
}

#[tokio::test]
async fn a_commit_delivers_exactly_its_messages_with_headers() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;

    let outbox = Outbox::new(&env.db);
    let mut session = env.client.start_session().await.unwrap();
    session.start_transaction().await.unwrap();
    env.db
        .collection::<Document>("orders")
        .insert_one(doc! { "_id": "o-1" })
        .session(&mut session)
        .await
        .unwrap();
    let typed = NewMessage::typed(&OrderShipped {
        order: "o-1".into(),
        parcels: 2,
    })
    .unwrap()
    .correlation_id("corr-1")
    .key("o-1")
    .header("traceparent", TRACEPARENT)
    .header("tracestate", "vendor=abc,other=1");
    let explicit = NewMessage::serialized("audit.entry", &doc! { "who": "me" })
        .unwrap()
        .subject(format!("{}.custom.audit", env.prefix));
    let ids = outbox
        .add_many(&mut session, [typed, explicit])
        .await
        .unwrap();
    session.commit_transaction().await.unwrap();

    let messages = receiver.take(2).await;
    assert_eq!(
        messages[0].subject.as_str(),
        format!("{}.order.shipped", env.prefix)
    );
    assert_eq!(msg_id(&messages[0]), Some(ids[0].to_hex()));
    assert_eq!(
        header(&messages[0], "Outbox-Type").as_deref(),
        Some("order.shipped")
    );
    assert_eq!(
        header(&messages[0], "Outbox-Correlation-Id").as_deref(),
        Some("corr-1")
    );
    assert_eq!(header(&messages[0], "Outbox-Key").as_deref(), Some("o-1"));
    assert_eq!(
        header(&messages[0], "Content-Type").as_deref(),
        Some("application/json")
    );
    // W3C trace context crosses the outbox unchanged.
    assert_eq!(
        header(&messages[0], "traceparent").as_deref(),
        Some(TRACEPARENT)
    );
    assert_eq!(
        header(&messages[0], "tracestate").as_deref(),
        Some("vendor=abc,other=1")
    );
    let body: serde_json::Value = serde_json::from_slice(&messages[0].payload).unwrap();
    assert_eq!(body, serde_json::json!({ "order": "o-1", "parcels": 2 }));
    assert_eq!(
        messages[1].subject.as_str(),
        format!("{}.custom.audit", env.prefix)
    );
    assert_eq!(msg_id(&messages[1]), Some(ids[1].to_hex()));

    env.wait_count(
        doc! { "status": "processed", "processedAt": { "$type": "date" } },
        2,
    )
    .await;
    assert_eq!(env.stream_count().await, 2);
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn an_aborted_transaction_delivers_nothing() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;
    let outbox = Outbox::new(&env.db);

    let mut session = env.client.start_session().await.unwrap();
    session.start_transaction().await.unwrap();
    let aborted = outbox
        .add(
            &mut session,
            NewMessage::serialized("order.placed", &doc! { "n": 1 }).unwrap(),
        )
        .await
        .unwrap();
    session.abort_transaction().await.unwrap();
    // A later committed message: once it arrives, anything before it would have too.
    let committed = write_orders(&env, 1).await[0];

    let seen = receiver.until_id(committed).await;
    assert!(seen.iter().all(|m| msg_id(m) != Some(aborted.to_hex())));
    assert_eq!(seen.len(), 1);
    assert_eq!(env.count(doc! {}).await, 1);
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn the_writer_refuses_a_session_without_a_transaction() {
    let env = TestEnv::new().await;
    let outbox = Outbox::new(&env.db);
    let message = || NewMessage::serialized("order.placed", &doc! { "n": 1 }).unwrap();

    let mut session = env.client.start_session().await.unwrap();
    let refused = outbox.add(&mut session, message()).await;
    assert!(matches!(refused, Err(Error::NoTransaction)), "{refused:?}");

    // After a commit, the session has no transaction either.
    session.start_transaction().await.unwrap();
    outbox.add(&mut session, message()).await.unwrap();
    session.commit_transaction().await.unwrap();
    let refused = outbox.add(&mut session, message()).await;
    assert!(matches!(refused, Err(Error::NoTransaction)), "{refused:?}");
    assert_eq!(
        env.count(doc! {}).await,
        1,
        "a refused add must write nothing"
    );

    // The session is still usable for a transaction afterwards.
    session.start_transaction().await.unwrap();
    outbox.add(&mut session, message()).await.unwrap();
    session.commit_transaction().await.unwrap();
    assert_eq!(env.count(doc! {}).await, 2);
    env.drop().await;
}

#[tokio::test]
async fn the_writer_refuses_invalid_messages_and_writes_none() {
    let env = TestEnv::new().await;
    let outbox = Outbox::new(&env.db);
    let mut session = env.client.start_session().await.unwrap();
    session.start_transaction().await.unwrap();
    let good = NewMessage::serialized("order.placed", &doc! {}).unwrap();
    let bad = NewMessage::serialized("order.placed", &doc! {})
        .unwrap()
        .subject("orders.*");
    let refused = outbox.add_many(&mut session, [good, bad]).await;
    assert!(
        matches!(refused, Err(Error::InvalidMessage(_))),
        "{refused:?}"
    );
    let reserved = NewMessage::serialized("order.placed", &doc! {})
        .unwrap()
        .header("Nats-Msg-Id", "mine");
    assert!(matches!(
        outbox.add(&mut session, reserved).await,
        Err(Error::InvalidMessage(_))
    ));
    session.commit_transaction().await.unwrap();
    assert_eq!(env.count(doc! {}).await, 0);

    let not_a_document = NewMessage::serialized("order.placed", &42);
    assert!(matches!(not_a_document, Err(Error::Payload(_))));
    env.drop().await;
}

#[tokio::test]
async fn documents_from_a_foreign_writer_with_only_the_required_fields_arrive() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;

    let documents = [
        doc! { "_id": ObjectId::new(), "type": "json", "payload": { "a": 1_i64, "when": bson::DateTime::from_millis(0) }, "status": "pending" },
        doc! { "_id": ObjectId::new(), "type": "bytes", "payload": Binary { subtype: BinarySubtype::Generic, bytes: vec![0, 159, 255] }, "status": "pending" },
        doc! { "_id": ObjectId::new(), "type": "text", "payload": "héllo", "status": "pending" },
    ];
    env.outbox().insert_many(documents.clone()).await.unwrap();

    let messages = receiver.take(3).await;
    let by_type = |t: &str| {
        messages
            .iter()
            .find(|m| header(m, "Outbox-Type").as_deref() == Some(t))
            .unwrap_or_else(|| panic!("no {t} message"))
    };
    let json: serde_json::Value = serde_json::from_slice(&by_type("json").payload).unwrap();
    assert_eq!(
        json,
        serde_json::json!({ "a": 1, "when": { "$date": "1970-01-01T00:00:00Z" } })
    );
    assert_eq!(
        header(by_type("json"), "Content-Type").as_deref(),
        Some("application/json")
    );
    assert_eq!(by_type("bytes").payload.as_ref(), &[0, 159, 255]);
    assert_eq!(
        header(by_type("bytes"), "Content-Type").as_deref(),
        Some("application/octet-stream")
    );
    assert_eq!(by_type("text").payload.as_ref(), "héllo".as_bytes());
    assert_eq!(
        by_type("text").subject.as_str(),
        format!("{}.text", env.prefix)
    );
    for document in &documents {
        let id = document.get_object_id("_id").unwrap();
        assert!(messages.iter().any(|m| msg_id(m) == Some(id.to_hex())));
    }
    env.wait_count(doc! { "status": "processed" }, 3).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn documents_inserted_in_another_state_are_not_published() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;
    // Once this arrives, the relay is tailing the stream.
    let tailing = write_orders(&env, 1).await;
    receiver.until_id(tailing[0]).await;
    // As a restore from a backup would insert them.
    env.outbox()
        .insert_many([
            doc! { "type": "restored", "payload": {}, "status": "processed" },
            doc! { "type": "restored", "payload": {}, "status": "failed", "lastError": "x" },
        ])
        .await
        .unwrap();
    let ids = write_orders(&env, 1).await;
    // Deliveries keep commit order, so anything published for the
    // restored documents would arrive first.
    let first = receiver.take(1).await;
    assert_eq!(msg_id(&first[0]), Some(ids[0].to_hex()));
    env.wait_count(doc! { "status": "processed" }, 3).await;
    assert_eq!(env.count(doc! { "status": "failed" }).await, 1);
    relay.stop().await.unwrap();
    assert_eq!(env.stream_count().await, 2);
    env.drop().await;
}

#[tokio::test]
async fn malformed_documents_fail_with_a_reason_while_good_ones_flow() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;

    let oversized = "x".repeat(env.nats.server_info().max_payload + 1);
    let bad = [
        (doc! { "payload": {}, "status": "pending" }, "no type"),
        (
            doc! { "type": 7, "payload": {}, "status": "pending" },
            "type must be a string",
        ),
        (
            doc! { "type": "", "payload": {}, "status": "pending" },
            "non-empty",
        ),
        (
            doc! { "type": "a b", "payload": {}, "status": "pending" },
            "a space or a control character",
        ),
        (
            doc! { "type": "ok", "subject": "x.>", "payload": {}, "status": "pending" },
            "wildcard",
        ),
        (
            doc! { "type": "ok", "payload": 3.5, "status": "pending" },
            "payload must be",
        ),
        (doc! { "type": "ok", "status": "pending" }, "no payload"),
        (
            doc! { "type": "ok", "payload": {}, "headers": { "h": 1 }, "status": "pending" },
            "must be a string",
        ),
        (
            doc! { "type": "ok", "payload": oversized, "status": "pending" },
            "max_payload",
        ),
        (
            doc! { "_id": "not-an-objectid", "type": "ok", "payload": {}, "status": "pending" },
            "ObjectId",
        ),
    ];
    let mut expected = Vec::new();
    for (document, reason) in bad {
        let good =
            doc! { "_id": ObjectId::new(), "type": "good", "payload": {}, "status": "pending" };
        let result = env
            .outbox()
            .insert_many([document, good.clone()])
            .await
            .unwrap();
        expected.push((result.inserted_ids[&0].clone(), reason));
        let good_id = good.get_object_id("_id").unwrap();
        receiver.until_id(good_id).await;
    }
    env.wait_count(doc! { "status": "failed" }, expected.len() as u64)
        .await;
    for (id, reason) in expected {
        let document = env
            .outbox()
            .find_one(doc! { "_id": id.clone() })
            .await
            .unwrap()
            .unwrap();
        let last_error = document.get_str("lastError").unwrap_or_default();
        assert!(
            last_error.contains(reason),
            "{id}: {last_error:?} should mention {reason:?}"
        );
        assert!(document.get_datetime("failedAt").is_ok());
    }
    env.wait_count(doc! { "status": "processed", "type": "good" }, 10)
        .await;
    relay.stop().await.unwrap();
    env.drop().await;
}

#[tokio::test]
async fn a_restart_resumes_from_the_token_without_losing_or_remarking() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;

    let relay = RunningRelay::start(env.config()).await;
    let first = write_orders(&env, 5).await;
    receiver.until_id(*first.last().unwrap()).await;
    env.wait_count(doc! { "status": "processed" }, 5).await;
    relay.stop().await.unwrap();
    let late = receiver.drain_delivered(&env.nats).await;
    assert!(
        late.iter()
            .filter_map(msg_id)
            .all(|id| first.iter().any(|f| f.to_hex() == id)),
        "the first run published only its own messages"
    );
    let marked_before: Vec<Document> = env
        .outbox()
        .find(doc! {})
        .await
        .unwrap()
        .try_collect_all()
        .await;

    let second = write_orders(&env, 5).await; // written while the relay is down
    let relay = RunningRelay::start(env.config()).await;
    let seen = receiver.until_id(*second.last().unwrap()).await;
    env.wait_count(doc! { "status": "processed" }, 10).await;
    relay.stop().await.unwrap();

    let seen_ids: HashSet<String> = seen.iter().filter_map(msg_id).collect();
    let expected: HashSet<String> = second.iter().map(|id| id.to_hex()).collect();
    assert_eq!(
        seen_ids, expected,
        "after the restart, exactly the new messages are published"
    );
    assert!(count_by_id(&seen).values().all(|&n| n == 1));
    for before in marked_before {
        let after = env
            .outbox()
            .find_one(doc! { "_id": before.get("_id").unwrap() })
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            after.get("processedAt"),
            before.get("processedAt"),
            "re-marked: {after}"
        );
    }
    assert_eq!(env.stream_count().await, 10);
    env.drop().await;
}

/// A relay resuming from a position stored long ago (a partition count
/// used before, a relay down for longer than the retention) replays
/// messages delivered and deleted since: none is published again, and one
/// still pending is.
#[tokio::test]
async fn a_replay_from_an_old_position_publishes_no_message_deleted_since() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;
    let first = write_orders(&env, 1).await;
    receiver.until_id(first[0]).await;
    env.wait_count(doc! { "status": "processed" }, 1).await;
    relay.stop().await.unwrap();
    let old = env.checkpoint_token().await.expect("a stored position");

    let relay = RunningRelay::start(env.config()).await;
    let delivered = write_orders(&env, 20).await;
    receiver.until_id(*delivered.last().unwrap()).await;
    env.wait_count(doc! { "status": "processed" }, 21).await;
    relay.stop().await.unwrap();
    receiver.drain_delivered(&env.nats).await;
    // Retention, or `dlq discard`, deletes them; one more is left pending,
    // as a message committed while no relay ran is.
    env.outbox()
        .delete_many(doc! { "_id": { "$in": &delivered } })
        .await
        .unwrap();
    let pending = write_orders(&env, 1).await[0];
    env.db
        .collection::<Document>("outbox_checkpoints")
        .update_one(
            doc! { "_id": format!("{}.outbox", env.name) },
            doc! { "$set": { "token": old } },
        )
        .await
        .unwrap();

    let relay = RunningRelay::start(env.config()).await;
    let seen = receiver.until_id(pending).await;
    env.wait_count(doc! { "status": "processed", "_id": pending }, 1)
        .await;
    relay.stop().await.unwrap();
    let seen: HashSet<String> = seen
        .iter()
        .chain(&receiver.drain_delivered(&env.nats).await)
        .filter_map(msg_id)
        .collect();
    assert_eq!(
        seen,
        HashSet::from([pending.to_hex()]),
        "deleted messages came back"
    );
    env.drop().await;
}

#[tokio::test]
async fn the_first_start_delivers_what_was_already_pending() {
    let env = TestEnv::new().await;
    let ids = write_orders(&env, 3).await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;
    let later = write_orders(&env, 1).await[0];

    let seen = receiver.take(4).await;
    let seen_ids: HashSet<String> = seen.iter().filter_map(msg_id).collect();
    let expected: HashSet<String> = ids.iter().chain([&later]).map(|id| id.to_hex()).collect();
    assert_eq!(seen_ids, expected);
    env.wait_count(doc! { "status": "processed" }, 4).await;
    relay.stop().await.unwrap();
    env.drop().await;
}

/// A backlog of large messages, on a first start and on a replay: every
/// one arrives, once, whole. On MongoDB (and the Rust SecantusDB) the reads
/// take them about 4 MiB at a time; the Python SecantusDB the tests run on
/// reports no average document size, so there the relay asks for 1,000 at
/// a time (see docs/developing.md).
#[tokio::test]
async fn a_backlog_of_large_messages_is_read_in_small_batches_and_delivered_whole() {
    const COUNT: usize = 40;
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let large = |n: usize| {
        let body = vec![n as u8; 300_000];
        doc! {
            "_id": ObjectId::new(),
            "type": "order.scanned",
            "payload": Binary { subtype: BinarySubtype::Generic, bytes: body },
            "status": "pending",
        }
    };
    let first: Vec<Document> = (0..COUNT).map(large).collect();
    env.outbox().insert_many(&first).await.unwrap();
    let relay = RunningRelay::start(env.config()).await;
    let mut seen = receiver.take(COUNT).await;
    env.wait_count(doc! { "status": "processed" }, COUNT as u64)
        .await;
    relay.stop().await.unwrap();

    // Written while the relay is down: the restart replays the stream.
    let second: Vec<Document> = (COUNT..2 * COUNT).map(large).collect();
    env.outbox().insert_many(&second).await.unwrap();
    let relay = RunningRelay::start(env.config()).await;
    seen.extend(receiver.take(COUNT).await);
    env.wait_count(doc! { "status": "processed" }, 2 * COUNT as u64)
        .await;
    relay.stop().await.unwrap();

    let written: HashSet<String> = first
        .iter()
        .chain(&second)
        .map(|d| d.get_object_id("_id").unwrap().to_hex())
        .collect();
    let seen_ids: HashSet<String> = seen.iter().filter_map(msg_id).collect();
    assert_eq!(seen_ids, written);
    assert!(count_by_id(&seen).values().all(|&n| n == 1));
    for (n, message) in first.iter().chain(&second).enumerate() {
        let id = message.get_object_id("_id").unwrap().to_hex();
        let delivered = seen
            .iter()
            .find(|m| msg_id(m).as_deref() == Some(&id))
            .unwrap();
        assert_eq!(delivered.payload.len(), 300_000);
        assert!(delivered.payload.iter().all(|&b| b == n as u8));
    }
    env.drop().await;
}

/// A stored token no server can resume from (written by hand, or by an
/// older version) must not keep the stream from starting: the relay starts
/// from what is pending, and its next checkpoint replaces the bad one.
#[tokio::test]
async fn an_unreadable_checkpoint_starts_from_what_is_pending() {
    let env = TestEnv::new().await;
    let ids = write_orders(&env, 3).await;
    let checkpoint_id = format!("{}.outbox", env.name);
    let garbage = Bson::Document(doc! { "_data": 12, "not": "a token" });
    env.db
        .collection::<Document>("outbox_checkpoints")
        .insert_one(doc! { "_id": &checkpoint_id, "token": garbage.clone() })
        .await
        .unwrap();
    let mut receiver = env.subscribe().await;
    let mut config = env.config();
    // Only the change stream's catch-up may deliver them.
    config.sweep_interval = std::time::Duration::from_secs(3600);
    let relay = RunningRelay::start(config).await;
    let later = write_orders(&env, 1).await[0];

    let seen: HashSet<String> = receiver.take(4).await.iter().filter_map(msg_id).collect();
    let expected: HashSet<String> = ids.iter().chain([&later]).map(|id| id.to_hex()).collect();
    assert_eq!(seen, expected);
    env.wait_count(doc! { "status": "processed" }, 4).await;
    relay.stop().await.unwrap();
    let token = env.checkpoint_token().await;
    assert!(
        token.is_some() && token != Some(garbage),
        "the bad token was replaced: {token:?}"
    );
    env.drop().await;
}

#[tokio::test]
async fn core_mode_publishes_without_jetstream() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let mut config = env.config();
    config.nats_mode = outbox_relay::NatsMode::Core;
    config.subject_prefix = format!("{}core", env.prefix);
    let mut core_receiver = {
        let subscriber = env
            .nats
            .subscribe(format!("{}.>", config.subject_prefix))
            .await
            .unwrap();
        env.nats.flush().await.unwrap();
        crate::common::Receiver { subscriber }
    };
    let relay = RunningRelay::start(config).await;
    let ids = write_orders(&env, 3).await;
    // Written as the relay starts, they may come from its catch-up pass
    // or its stream, in either order (and one may come twice).
    let expected: HashSet<String> = ids.iter().map(|id| id.to_hex()).collect();
    let mut seen = HashSet::new();
    while !expected.is_subset(&seen) {
        seen.extend(msg_id(&core_receiver.next().await));
    }
    assert_eq!(seen, expected);
    env.wait_count(doc! { "status": "processed" }, 3).await;
    relay.stop().await.unwrap();
    assert_eq!(
        env.stream_count().await,
        0,
        "core mode must not go through the stream"
    );
    drop(receiver.subscriber.unsubscribe().await);
    env.drop().await;
}

#[tokio::test]
async fn a_graceful_stop_records_in_flight_work_and_the_token() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    // Written once the relay tails its stream: a message committed while a
    // first start reads its snapshot can miss both on SecantusDB, and is
    // then the sweep's, later (docs/developing.md).
    let relay = RunningRelay::start_tailing(env.config()).await;
    let ids = write_orders(&env, 20).await;
    // Stopped as soon as the first arrives, with the rest read or in flight.
    receiver.until_id(ids[0]).await;
    relay.stop().await.unwrap();
    // Every message published is marked, and only those: nothing was left
    // between publish and completion.
    let published: HashSet<String> = receiver
        .drain_delivered(&env.nats)
        .await
        .iter()
        .filter_map(msg_id)
        .chain([ids[0].to_hex()])
        .collect();
    let processed: HashSet<String> = env
        .outbox()
        .find(doc! { "status": "processed" })
        .await
        .unwrap()
        .try_collect_all()
        .await
        .iter()
        .filter_map(|d| d.get_object_id("_id").ok().map(|id| id.to_hex()))
        .collect();
    assert_eq!(processed, published);
    assert!(matches!(
        env.checkpoint_token().await,
        Some(Bson::Document(_))
    ));
    env.drop().await;
}

trait CollectAll {
    async fn try_collect_all(self) -> Vec<Document>;
}

impl CollectAll for mongodb::Cursor<Document> {
    async fn try_collect_all(self) -> Vec<Document> {
        use futures::TryStreamExt;
        self.try_collect().await.unwrap()
    }
}

#[tokio::test]
async fn an_idle_stream_keeps_its_stored_token_moving() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let relay = RunningRelay::start(env.config()).await;
    let id = write_orders(&env, 1).await[0];
    receiver.until_id(id).await;
    crate::common::wait_until("a first checkpoint", || async {
        env.checkpoint_token().await.is_some()
    })
    .await;
    let first = env.checkpoint_token().await;

    // Writes elsewhere move the oplog; the outbox stream sees no event but a newer position.
    let other = env.db.collection::<Document>("unrelated");
    crate::common::wait_until(
        "the stored token to move without outbox messages",
        || async {
            other.insert_one(doc! { "x": 1 }).await.unwrap();
            env.checkpoint_token().await != first
        },
    )
    .await;
    assert_eq!(env.count(doc! {}).await, 1);
    relay.stop().await.unwrap();
    env.drop().await;
}
