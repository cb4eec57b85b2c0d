//! Subjects from a template: each key its own subjects, hostile keys
//! escaped or refused alone, and the NATS idioms that rest on them.

use std::collections::HashMap;

use async_nats::jetstream::consumer;
use bson::{doc, oid::ObjectId, Bson};
use futures::StreamExt;

use crate::common::{
    assert_exit, bounded, relay_command, stored_header, stream_messages, wait_until, RunningRelay,
    TestEnv,
};
use outbox_relay::contract::key_hash;

const BY_KEY: &str = "{prefix}.{type}.{key}";

/// Inserts a pending `order.placed` message; `key` as given (absent when
/// None, any BSON otherwise), with its hash where it is a string.
async fn insert(env: &TestEnv, key: Option<Bson>, n: i64) -> ObjectId {
    let id = ObjectId::new();
    let mut message = doc! {
        "_id": id, "type": "order.placed", "payload": { "n": n }, "status": "pending",
    };
    if let Some(key) = key {
        if let Bson::String(key) = &key {
            message.insert("keyHash", i64::from(key_hash(key)));
        }
        message.insert("key", key);
    }
    env.outbox()
        .insert_one(message)
        .await
        .expect("insert a message");
    id
}

/// The stored subject of each message in the test's stream, by message id.
async fn subjects_by_id(env: &TestEnv) -> HashMap<String, String> {
    let mut stream = env.jetstream.get_stream(&env.stream).await.expect("stream");
    stream_messages(&mut stream)
        .await
        .iter()
        .map(|message| {
            let id = stored_header(message, "Nats-Msg-Id").unwrap_or_default();
            (id, message.subject.to_string())
        })
        .collect()
}

#[tokio::test]
async fn a_template_with_the_key_gives_each_key_its_subjects_and_hostile_keys_fail_alone() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.subject_template = BY_KEY.to_owned();
    let relay = RunningRelay::start_tailing(config).await;
    let prefix = &env.prefix;

    // One order's history, through a consumer that filters its subject.
    let one_order = env
        .jetstream
        .get_stream(&env.stream)
        .await
        .expect("stream")
        .create_consumer(consumer::pull::Config {
            durable_name: Some("one-order".into()),
            filter_subject: format!("{prefix}.order.placed.o-2"),
            ..Default::default()
        })
        .await
        .expect("a consumer of one order");

    let mut written: Vec<(ObjectId, String)> = Vec::new();
    for n in 0..4 {
        for key in ["o-1", "o-2", "o-3"] {
            let id = insert(&env, Some(key.into()), n).await;
            written.push((id, format!("{prefix}.order.placed.{key}")));
        }
    }
    // Keys no subject could carry as they are: each becomes one token.
    let long = "k".repeat(600);
    let escaped = [
        ("a.b", "a%2Eb"),
        ("sp ace", "sp%20ace"),
        ("*", "%2A"),
        (">", "%3E"),
        ("$JS.API.STREAM.DELETE", "%24JS%2EAPI%2ESTREAM%2EDELETE"),
        ("_INBOX", "_INBOX"),
        ("tab\t\u{1}", "tab%09%01"),
        ("Zürich 東京", "Z%C3%BCrich%20%E6%9D%B1%E4%BA%AC"),
    ];
    for (key, token) in escaped {
        let id = insert(&env, Some(key.into()), 0).await;
        written.push((id, format!("{prefix}.order.placed.{token}")));
    }
    // Refused, each alone: no key, an empty one, one too long for a
    // subject once escaped, one no header can carry (as without a
    // template), and a key that is no string.
    let refused = [
        (insert(&env, None, 0).await, "subject template", "has none"),
        (
            insert(&env, Some("".into()), 0).await,
            "subject template",
            "an empty one",
        ),
        (
            insert(&env, Some(long.as_str().into()), 0).await,
            "invalid subject",
            "characters long",
        ),
        (
            insert(&env, Some("line\nbreak".into()), 0).await,
            "Outbox-Key",
            "line break",
        ),
        (
            insert(&env, Some(Bson::Int32(7)), 0).await,
            "key",
            "must be a string",
        ),
    ];
    // And what comes after them is delivered.
    for key in ["o-2", "o-1"] {
        let id = insert(&env, Some(key.into()), 9).await;
        written.push((id, format!("{prefix}.order.placed.{key}")));
    }

    env.wait_count(doc! { "status": "processed" }, written.len() as u64)
        .await;
    env.wait_count(doc! { "status": "failed" }, refused.len() as u64)
        .await;
    let subjects = subjects_by_id(&env).await;
    assert_eq!(subjects.len(), written.len(), "{subjects:?}");
    for (id, subject) in &written {
        assert_eq!(subjects.get(&id.to_hex()), Some(subject), "message {id}");
    }
    for (id, first, then) in refused {
        let stored = env
            .outbox()
            .find_one(doc! { "_id": id })
            .await
            .expect("read")
            .expect("the message");
        let error = stored.get_str("lastError").unwrap_or_default();
        assert!(
            error.contains(first) && error.contains(then),
            "message {id}: {error}"
        );
    }

    // The one order's messages, and only those, in the order written.
    let expected: Vec<String> = written
        .iter()
        .filter(|(_, subject)| subject.ends_with(".o-2"))
        .map(|(id, _)| id.to_hex())
        .collect();
    let mut batch = one_order
        .fetch()
        .max_messages(100)
        .expires(std::time::Duration::from_secs(1))
        .messages()
        .await
        .expect("fetch");
    let mut seen = Vec::new();
    while let Some(message) = batch.next().await {
        let message = message.expect("a message");
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        seen.push(id);
    }
    assert_eq!(seen, expected);

    relay.stop().await.expect("the relay stops");

    // A replay under a new prefix keeps each message's rendered subject.
    let again = format!("{prefix}.again");
    let mut replay = relay_command(&env);
    replay
        .args([
            "replay",
            "--key",
            "o-3",
            "--replay-prefix",
            &again,
            "--json",
        ])
        .args(["--subject-template", BY_KEY]);
    let output = bounded(replay).await;
    assert_exit(&output, 0, "");
    let replayed: Vec<String> = subjects_by_id(&env)
        .await
        .into_values()
        .filter(|subject| subject.starts_with(&again))
        .collect();
    assert_eq!(replayed.len(), 4, "{replayed:?}");
    for subject in replayed {
        assert_eq!(subject, format!("{again}.{prefix}.order.placed.o-3"));
    }
    env.drop().await;
}

/// Two relays sharing two partitions: each key's messages are in one
/// partition, so under one subject and in order whoever delivers them.
#[tokio::test]
async fn a_stream_keeping_the_last_message_of_each_subject_holds_each_keys_latest() {
    let env = TestEnv::new().await;
    let mut stream = env.jetstream.get_stream(&env.stream).await.expect("stream");
    let mut kept = stream.cached_info().config.clone();
    kept.max_messages_per_subject = 1;
    env.jetstream
        .update_stream(&kept)
        .await
        .expect("keep one message a subject");
    let mut config = env.replica_config();
    config.subject_template = BY_KEY.to_owned();
    config.partitions = 2;
    // A lease a loaded machine keeps: one lost hands a partition over and
    // back, which this test does not count on.
    config.lease_duration = std::time::Duration::from_secs(6);
    config.lease_renew_interval = std::time::Duration::from_secs(1);
    let relays = [
        RunningRelay::start(config.clone()).await,
        RunningRelay::start(config).await,
    ];
    wait_until("each relay to hold one partition", || async {
        relays.iter().all(|relay| {
            let text = relay.metrics.render();
            text.lines().any(|line| line == "outbox_partitions_held 1")
        })
    })
    .await;
    let mut latest: HashMap<String, String> = HashMap::new();
    for n in 0..3 {
        for order in 0..6 {
            let key = format!("o-{order}");
            let id = insert(&env, Some(key.as_str().into()), n).await;
            latest.insert(key, id.to_hex());
        }
    }
    env.wait_count(doc! { "status": "processed" }, 18).await;
    for relay in relays {
        relay.stop().await.expect("the relay stops");
    }
    let held: Vec<(String, String)> = stream_messages(&mut stream)
        .await
        .iter()
        .map(|message| {
            let key = stored_header(message, "Outbox-Key").unwrap_or_default();
            (
                key,
                stored_header(message, "Nats-Msg-Id").unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(held.len(), 6, "{held:?}");
    for (key, id) in held {
        assert_eq!(latest.get(&key), Some(&id), "the latest of {key}");
    }
    env.drop().await;
}

#[tokio::test]
async fn check_shows_the_template_and_a_bad_one_is_refused_at_start() {
    let env = TestEnv::new().await;
    let mut check = relay_command(&env);
    check.args([
        "check",
        "--subject-template",
        "{prefix}.{type}.{header.X-Tenant}.{key}",
    ]);
    let output = bounded(check).await;
    let example = format!("{}.order.placed.value.o-1001", env.prefix);
    assert_exit(&output, 0, &example);
    for (template, saying) in [
        ("{prefix}.o-{key}", "must be a whole token"),
        ("{prefix}.{id}", "is no placeholder"),
        ("elsewhere.{key}", "--allow-subject"),
        ("$JS.API.{key}", "reserved to NATS"),
    ] {
        let mut run = relay_command(&env);
        run.args(["run", "--subject-template", template]);
        assert_exit(&bounded(run).await, 2, saying);
    }
    // Subjects outside the prefix need a stream of their own.
    let outside = format!("{}x", env.prefix);
    let check_outside = || {
        let mut check = relay_command(&env);
        check
            .args(["check", "--subject-template", &format!("{outside}.{{key}}")])
            .args(["--allow-subject", &format!("{outside}.>")]);
        bounded(check)
    };
    let pattern = format!("no JetStream stream captures {outside}.*");
    assert_exit(&check_outside().await, 7, &pattern);
    let stream = async_nats::jetstream::stream::Config {
        name: outside.to_uppercase(),
        subjects: vec![format!("{outside}.>")],
        duplicate_window: std::time::Duration::from_secs(4 * 3600),
        ..Default::default()
    };
    env.jetstream.create_stream(stream).await.expect("a stream");
    let captured = format!("captures {outside}.*");
    assert_exit(&check_outside().await, 0, &captured);
    env.jetstream
        .delete_stream(outside.to_uppercase())
        .await
        .expect("delete the stream");
    env.drop().await;
}
