//! The inbox against the real servers: each message's effects applied once
//! through repeats beyond JetStream's duplicate window, a crash between
//! commit and acknowledgement, handler failures and write conflicts; each
//! key's messages handled in stream order under concurrency.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use async_nats::HeaderMap;
use bson::{doc, oid::ObjectId, Document};
use futures::{FutureExt, StreamExt};
use mongodb::{ClientSession, Collection};
use outbox_relay::inbox::{
    handler, AfterCommit, Consumer, ConsumerBuilder, Delivery, Handler, HandlerError, Inbox,
    InboxCounts, InboxMetrics,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common::{wait_until, TestEnv, WAIT};

mod crash;
mod failpoints;
mod stops;

/// Publishes `body` to the test's stream as the relay would: with the
/// message id and, if given, the key.
async fn publish(
    env: &TestEnv,
    subject: &str,
    id: &str,
    key: Option<&str>,
) -> jetstream::context::PublishAckFuture {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", id);
    if let Some(key) = key {
        headers.insert("Outbox-Key", key);
    }
    let body = serde_json::to_vec(&serde_json::json!({ "id": id })).unwrap();
    env.jetstream
        .publish_with_headers(format!("{}.{subject}", env.prefix), headers, body.into())
        .await
        .expect("publish")
}

/// Publishes and waits for JetStream to store it (or drop it as a repeat);
/// whether it was stored as new.
async fn publish_stored(env: &TestEnv, subject: &str, id: &str, key: Option<&str>) -> bool {
    let ack = publish(env, subject, id, key).await.await.expect("stored");
    !ack.duplicate
}

/// An inbox for consumer `billing` in the test's database.
async fn inbox(env: &TestEnv, metrics: &InboxMetrics) -> Inbox {
    Inbox::builder(&env.db, "billing")
        .metrics(metrics.clone())
        .build()
        .await
        .expect("an inbox")
}

/// A consumer of the test's stream with quick retries and a short ack wait.
fn quick(inbox: &Inbox, env: &TestEnv) -> ConsumerBuilder {
    inbox
        .consumer(env.jetstream.clone(), &env.stream)
        .retry_delay(Duration::from_millis(20), Duration::from_millis(50))
        .ack_wait(Duration::from_secs(1))
}

/// A running consumer and the way to stop it.
struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<outbox_relay::Result<()>>,
}

impl Running {
    fn start<H: Handler>(consumer: Consumer, handler: H) -> Self {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(consumer.run(handler, shutdown.clone()));
        Running { shutdown, task }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the consumer stops in time")
            .expect("the consumer did not panic")
            .expect("the consumer ran without error");
    }
}

/// A counter a handler adds to, inside the message's transaction.
async fn count(
    session: &mut ClientSession,
    effects: &Collection<Document>,
    name: &str,
) -> Result<(), HandlerError> {
    effects
        .update_one(doc! { "_id": name }, doc! { "$inc": { "n": 1 } })
        .upsert(true)
        .session(session)
        .await?;
    Ok(())
}

/// A handler that adds one to counter `name` for every message.
fn counting(effects: &Collection<Document>, name: &'static str) -> impl Handler {
    let effects = effects.clone();
    handler(move |session, _| {
        let effects = effects.clone();
        async move { count(session, &effects, name).await }.boxed()
    })
}

/// A handler that records each message once per run in its effect, and
/// appends it to its key's list, inside the message's transaction.
fn recording(effects: &Collection<Document>) -> impl Handler {
    let effects = effects.clone();
    handler(move |session, message| {
        let effects = effects.clone();
        let id = message.message_id.clone().unwrap_or_default();
        let key = message.key.clone();
        async move {
            effects
                .update_one(doc! { "_id": &id }, doc! { "$inc": { "n": 1 } })
                .upsert(true)
                .session(&mut *session)
                .await?;
            if let Some(key) = key {
                effects
                    .update_one(
                        doc! { "_id": format!("key-{key}") },
                        doc! { "$push": { "ids": &id } },
                    )
                    .upsert(true)
                    .session(&mut *session)
                    .await?;
            }
            Ok(())
        }
        .boxed()
    })
}

async fn counted(effects: &Collection<Document>, name: &str) -> i64 {
    let found = effects.find_one(doc! { "_id": name }).await.unwrap();
    found.map_or(0, |d| {
        d.get_i32("n")
            .map(i64::from)
            .or_else(|_| d.get_i64("n"))
            .unwrap_or(0)
    })
}

/// The JetStream consumer `billing`, as the inbox bound it.
async fn durable(env: &TestEnv) -> jetstream::consumer::PullConsumer {
    let stream = env.jetstream.get_stream(&env.stream).await.unwrap();
    stream.get_consumer("billing").await.unwrap()
}

/// Waits until one of consumer `billing`'s counts reaches `value`.
async fn wait_metric(metrics: &InboxMetrics, count: fn(InboxCounts) -> u64, value: u64) {
    wait_until(&format!("a count to reach {value}"), || async {
        count(metrics.counts("billing")) >= value
    })
    .await;
}

#[tokio::test]
async fn a_message_published_again_past_the_duplicate_window_is_applied_once() {
    let env = TestEnv::new().await;
    let mut stream = env.jetstream.get_stream(&env.stream).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.duplicate_window = Duration::from_millis(200);
    env.jetstream.update_stream(config).await.unwrap();

    let id = ObjectId::new().to_hex();
    assert!(publish_stored(&env, "order.placed", &id, None).await);
    // Published again until JetStream has forgotten the id and stores it.
    wait_until("JetStream to store the repeat", || async {
        publish_stored(&env, "order.placed", &id, None).await
    })
    .await;

    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    let handler = counting(&effects, "orders");
    let consumer = Running::start(quick(&inbox, &env).bind().await.unwrap(), handler);
    wait_metric(&metrics, |c| c.repeats, 1).await;
    assert_eq!(metrics.counts("billing").handled, 1);
    assert_eq!(counted(&effects, "orders").await, 1, "applied once");
    let record = record(&inbox, &id)
        .await
        .expect("the inbox holds the message");
    assert_eq!(record.get_str("status").unwrap(), "handled");
    consumer.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_crash_between_commit_and_acknowledgement_is_skipped_on_redelivery() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    let abandoned = Arc::new(AtomicU64::new(0));
    let hook = {
        let abandoned = abandoned.clone();
        Arc::new(move |_: &Delivery| {
            // The first commit is left unacknowledged, as by a crash.
            match abandoned.fetch_add(1, Ordering::SeqCst) {
                0 => AfterCommit::Abandon,
                _ => AfterCommit::Acknowledge,
            }
        })
    };
    let consumer = quick(&inbox, &env).after_commit(hook).bind().await.unwrap();
    let handler = counting(&effects, "orders");
    let running = Running::start(consumer, handler);
    assert!(publish_stored(&env, "order.placed", &ObjectId::new().to_hex(), None).await);
    wait_metric(&metrics, |c| c.repeats, 1).await;
    assert_eq!(metrics.counts("billing").handled, 1);
    assert_eq!(counted(&effects, "orders").await, 1, "applied once");
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_failing_handler_is_retried_then_recorded_failed_and_terminated_while_others_go_on() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    // The attempts each subject's handler saw (a transaction run again
    // after a transient error runs its handler again, in the same attempt).
    let attempts: Arc<Mutex<HashMap<String, BTreeSet<u64>>>> = Arc::default();
    let calls: Arc<Mutex<Vec<String>>> = Arc::default();
    let handler = {
        let (effects, attempts, calls) = (effects.clone(), attempts.clone(), calls.clone());
        handler(move |session, message| {
            let (effects, attempts, calls) = (effects.clone(), attempts.clone(), calls.clone());
            let (subject, attempt) = (message.subject.clone(), message.attempt);
            async move {
                attempts
                    .lock()
                    .unwrap()
                    .entry(subject.clone())
                    .or_default()
                    .insert(attempt);
                calls.lock().unwrap().push(subject.clone());
                count(session, &effects, &subject).await?;
                if subject.ends_with("twice") && attempt <= 2 {
                    return Err(HandlerError::new(format!("failing attempt {attempt}")));
                }
                if subject.ends_with("always") {
                    return Err(HandlerError::new("this message cannot be handled"));
                }
                Ok(())
            }
            .boxed()
        })
    };
    let consumer = quick(&inbox, &env).max_deliveries(3).bind().await.unwrap();
    let running = Running::start(consumer, handler);
    // Without a key (redelivered by JetStream) and with one (retried in
    // place); the always failing one holds back its key's next message.
    let always = ObjectId::new().to_hex();
    for (subject, key) in [
        ("unkeyed.twice", None),
        ("keyed.twice", Some("k1")),
        ("keyed.always", Some("k2")),
        ("keyed.after", Some("k2")),
        ("other", Some("k3")),
    ] {
        let id = if subject == "keyed.always" {
            always.clone()
        } else {
            ObjectId::new().to_hex()
        };
        assert!(publish_stored(&env, subject, &id, key).await);
    }
    wait_metric(&metrics, |c| c.failed, 1).await;
    wait_metric(&metrics, |c| c.handled, 4).await;
    let prefix = &env.prefix;
    for subject in ["unkeyed.twice", "keyed.twice", "keyed.after", "other"] {
        assert_eq!(
            counted(&effects, &format!("{prefix}.{subject}")).await,
            1,
            "{subject} applied once, though tried more often"
        );
    }
    assert_eq!(
        counted(&effects, &format!("{prefix}.keyed.always")).await,
        0,
        "a failed attempt's effects are rolled back"
    );
    let tried = attempts.lock().unwrap().clone();
    let three = BTreeSet::from([1, 2, 3]);
    assert_eq!(tried[&format!("{prefix}.unkeyed.twice")], three);
    assert_eq!(tried[&format!("{prefix}.keyed.twice")], three);
    assert_eq!(
        tried[&format!("{prefix}.keyed.always")],
        three,
        "max_deliveries attempts"
    );
    let calls = calls.lock().unwrap().clone();
    let last_always = calls.iter().rposition(|s| s.ends_with("keyed.always"));
    let first_after = calls.iter().position(|s| s.ends_with("keyed.after"));
    assert!(
        first_after > last_always,
        "k2's next message waited until the failing one was given up: {calls:?}"
    );

    let (total, failed) = inbox.failed(10).await.unwrap();
    assert_eq!(total, 1);
    assert_eq!(failed[0].message_id, always);
    assert_eq!(failed[0].attempts, Some(3));
    assert_eq!(
        failed[0].last_error.as_deref(),
        Some("this message cannot be handled")
    );
    // And the command line lists it, its fields named as in the document.
    let list_as = |consumer: &str, collection: &str, format: &[&str]| {
        let mut list = crate::common::relay_command(&env);
        list.args([
            "inbox",
            "list",
            "--database",
            &env.name,
            "--consumer",
            consumer,
        ])
        .args(["--inbox-collection", collection])
        .args(format);
        crate::common::bounded(list)
    };
    let list = |consumer: &str, collection: &str| list_as(consumer, collection, &["--json"]);
    let output = list("billing", "inbox").await;
    assert!(output.status.success(), "{output:?}");
    let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listed["total"], 1);
    let first = &listed["messages"][0];
    assert_eq!(first["messageId"], always.as_str());
    assert_eq!(first["attempts"], 3);
    assert_eq!(first["lastError"], "this message cannot be handled");
    // For people: a line a message, then how many were shown.
    let output = list_as("billing", "inbox", &[]).await;
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].starts_with(always.as_str()), "{text}");
    assert!(
        lines[0].contains("attempts 3  this message cannot be handled"),
        "{text}"
    );
    assert_eq!(
        lines[1],
        "1 of 1 failed messages of consumer \"billing\" shown"
    );
    // A name that is not there is told, not listed as nothing.
    let output = list("biling", "inbox").await;
    crate::common::assert_exit(&output, 2, "its consumers include \"billing\"");
    let output = list("billing", "inbxo").await;
    crate::common::assert_exit(&output, 2, "has no collection \"inbxo\"");
    // Terminated: JetStream holds nothing unacknowledged for the consumer.
    wait_until("no message pending acknowledgement", || async {
        let info = durable(&env).await.info().await.unwrap().clone();
        info.num_ack_pending == 0 && info.num_pending == 0
    })
    .await;
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn with_sixteen_at_once_each_of_fifty_keys_is_handled_in_stream_order() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let seen: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
    let running_now = Arc::new(AtomicU64::new(0));
    let most_at_once = Arc::new(AtomicU64::new(0));
    let handler = {
        let (seen, running_now, most_at_once) =
            (seen.clone(), running_now.clone(), most_at_once.clone());
        handler(move |_, message| {
            let (seen, running_now, most_at_once) =
                (seen.clone(), running_now.clone(), most_at_once.clone());
            let (key, sequence) = (
                message.key.clone().unwrap_or_default(),
                message.stream_sequence,
            );
            async move {
                let now = running_now.fetch_add(1, Ordering::SeqCst) + 1;
                most_at_once.fetch_max(now, Ordering::SeqCst);
                // Long enough for other keys to overlap this one.
                tokio::time::sleep(Duration::from_millis(5)).await;
                seen.lock().unwrap().entry(key).or_default().push(sequence);
                running_now.fetch_sub(1, Ordering::SeqCst);
                Ok(())
            }
            .boxed()
        })
    };
    let consumer = quick(&inbox, &env).concurrency(16).bind().await.unwrap();
    let running = Running::start(consumer, handler);
    let mut published: HashMap<String, Vec<u64>> = HashMap::new();
    let mut acks = Vec::new();
    for round in 0..10 {
        for key in 0..50 {
            let key = format!("key{key}");
            let ack = publish(
                &env,
                &format!("order.r{round}"),
                &ObjectId::new().to_hex(),
                Some(&key),
            )
            .await;
            acks.push((key, ack));
        }
    }
    for (key, ack) in acks {
        let sequence = ack.await.unwrap().sequence;
        published.entry(key).or_default().push(sequence);
    }
    wait_metric(&metrics, |c| c.handled, 500).await;
    let seen = seen.lock().unwrap().clone();
    for (key, mut sequences) in published {
        sequences.sort_unstable();
        assert_eq!(seen[&key], sequences, "{key} in stream order, each once");
    }
    assert!(
        most_at_once.load(Ordering::SeqCst) > 1,
        "keys were handled side by side"
    );
    assert!(
        most_at_once.load(Ordering::SeqCst) <= 16,
        "never more than 16 at once"
    );
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_write_conflict_with_a_concurrent_writer_is_retried_and_applied_once() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    effects
        .insert_one(doc! { "_id": "order", "handled": 0, "other": 0 })
        .await
        .unwrap();
    let attempts = Arc::new(AtomicU64::new(0));
    let handler = {
        let (client, effects, attempts) = (env.client.clone(), effects.clone(), attempts.clone());
        handler(move |session, _| {
            let (client, effects, attempts) = (client.clone(), effects.clone(), attempts.clone());
            async move {
                let attempt = attempts.fetch_add(1, Ordering::SeqCst) + 1;
                // On the first attempt another writer's transaction holds
                // the document: this one's write conflicts.
                let mut other = None;
                if attempt == 1 {
                    let mut writer = client.start_session().await?;
                    writer.start_transaction().await?;
                    effects
                        .update_one(doc! { "_id": "order" }, doc! { "$inc": { "other": 1 } })
                        .session(&mut writer)
                        .await?;
                    other = Some(writer);
                }
                let written = effects
                    .update_one(doc! { "_id": "order" }, doc! { "$inc": { "handled": 1 } })
                    .session(session)
                    .await;
                if let Some(mut writer) = other {
                    writer.commit_transaction().await?;
                }
                written?;
                Ok(())
            }
            .boxed()
        })
    };
    let running = Running::start(quick(&inbox, &env).bind().await.unwrap(), handler);
    assert!(publish_stored(&env, "order.placed", &ObjectId::new().to_hex(), None).await);
    wait_metric(&metrics, |c| c.handled, 1).await;
    let order = effects
        .find_one(doc! { "_id": "order" })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(order.get_i32("handled").unwrap(), 1, "applied once");
    assert_eq!(
        order.get_i32("other").unwrap(),
        1,
        "the other writer's change stands"
    );
    assert!(
        attempts.load(Ordering::SeqCst) >= 2,
        "the transaction ran again"
    );
    assert_eq!(
        metrics.counts("billing").retried,
        0,
        "a conflict is no failed attempt"
    );
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_message_without_an_id_is_handled_every_time_it_comes() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    let handler = counting(&effects, "plain");
    let running = Running::start(quick(&inbox, &env).bind().await.unwrap(), handler);
    for _ in 0..2 {
        env.jetstream
            .publish(format!("{}.plain", env.prefix), "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    wait_metric(&metrics, |c| c.handled, 2).await;
    assert_eq!(
        counted(&effects, "plain").await,
        2,
        "no deduplication without Nats-Msg-Id"
    );
    assert_eq!(
        inbox.collection().count_documents(doc! {}).await.unwrap(),
        0,
        "and no record"
    );
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn bad_settings_and_a_missing_stream_are_explained() {
    let env = TestEnv::new().await;
    let error = Inbox::builder(&env.db, " ").build().await.unwrap_err();
    assert!(error.to_string().contains("consumer name"), "{error}");
    let error = Inbox::builder(&env.db, "billing")
        .retention(Duration::from_secs(5))
        .build()
        .await
        .unwrap_err();
    assert!(error.to_string().contains("at least 1 minute"), "{error}");
    let short = Inbox::builder(&env.db, "billing")
        .retention(Duration::from_secs(60))
        .build()
        .await
        .unwrap();
    let error = short
        .consumer(env.jetstream.clone(), &env.stream)
        .bind()
        .await
        .err()
        .expect("refused");
    assert!(
        error.to_string().contains("must exceed the ack wait"),
        "{error}"
    );
    let inbox = inbox(&env, &InboxMetrics::new()).await;
    let error = inbox
        .consumer(env.jetstream.clone(), &env.stream)
        .concurrency(0)
        .bind()
        .await
        .err()
        .expect("refused");
    assert!(error.to_string().contains("concurrency"), "{error}");
    let error = inbox
        .consumer(env.jetstream.clone(), "NO_SUCH_STREAM")
        .bind()
        .await
        .err()
        .expect("refused");
    assert!(error.to_string().contains("NO_SUCH_STREAM"), "{error}");
    env.drop().await;
}

#[tokio::test]
async fn stopping_hands_waiting_messages_back_so_the_next_consumer_keeps_each_keys_order() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    // The first message blocks until let go, so its key's others wait.
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let first_consumer = {
        let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
        handler(move |_, message| {
            let (seen, started, release) = (seen.clone(), started.clone(), release.clone());
            let subject = message.subject.clone();
            async move {
                if subject.ends_with(".m1") {
                    started.notify_one();
                    release.notified().await;
                }
                seen.lock().unwrap().push(subject);
                Ok(())
            }
            .boxed()
        })
    };
    // An ack wait far longer than the test: only a message handed back at
    // once can reach the next consumer in time.
    let bind = || {
        inbox
            .consumer(env.jetstream.clone(), &env.stream)
            .ack_wait(Duration::from_secs(300))
            .bind()
    };
    let running = Running::start(bind().await.unwrap(), first_consumer);
    for n in 1..=4 {
        publish_stored(&env, &format!("m{n}"), &ObjectId::new().to_hex(), Some("k")).await;
    }
    tokio::time::timeout(WAIT, started.notified())
        .await
        .expect("the first message is being handled");
    // Stopping while m1 is in flight: it finishes; m2..m4 are handed back.
    running.shutdown.cancel();
    release.notify_one();
    running.stop().await;
    publish_stored(&env, "m5", &ObjectId::new().to_hex(), Some("k")).await;

    let running = Running::start(bind().await.unwrap(), {
        let seen = seen.clone();
        handler(move |_, message| {
            let (seen, subject) = (seen.clone(), message.subject.clone());
            async move {
                seen.lock().unwrap().push(subject);
                Ok(())
            }
            .boxed()
        })
    });
    wait_metric(&metrics, |c| c.handled, 5).await;
    let prefix = &env.prefix;
    let expected: Vec<String> = (1..=5).map(|n| format!("{prefix}.m{n}")).collect();
    assert_eq!(
        *seen.lock().unwrap(),
        expected,
        "k's messages in stream order"
    );
    running.stop().await;
    env.drop().await;
}

/// A handler that misbehaves on subject `bad` and counts `good` messages:
/// published in that order (on key `key`, if given), `bad` ends failed after
/// two attempts and `good` is handled. Its failed record.
async fn fails_alone(
    misbehave: impl for<'a> Fn(&'a mut ClientSession) -> outbox_relay::inbox::Handled<'a>
        + Send
        + Sync
        + 'static,
    key: Option<&str>,
) -> outbox_relay::inbox::FailedMessage {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    let handler = {
        let effects = effects.clone();
        handler(move |session, message| {
            if message.subject.ends_with(".bad") {
                return misbehave(session);
            }
            let effects = effects.clone();
            async move { count(session, &effects, "good").await }.boxed()
        })
    };
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let running = Running::start(consumer, handler);
    let bad = ObjectId::new().to_hex();
    publish_stored(&env, "bad", &bad, key).await;
    publish_stored(&env, "good", &ObjectId::new().to_hex(), key).await;
    wait_metric(&metrics, |c| c.failed, 1).await;
    wait_metric(&metrics, |c| c.handled, 1).await;
    assert_eq!(
        counted(&effects, "good").await,
        1,
        "the other message is handled"
    );
    let (total, mut failed) = inbox.failed(10).await.unwrap();
    assert_eq!(total, 1);
    let failed = failed.remove(0);
    assert_eq!(failed.message_id, bad);
    assert_eq!(failed.attempts, Some(2), "max_deliveries attempts, no more");
    running.stop().await;
    env.drop().await;
    failed
}

#[tokio::test]
async fn a_panicking_handler_costs_attempts_and_its_keys_next_message_goes_on() {
    // In the handler's own body, before the future it returns.
    let failed = fails_alone(|_| panic!("a bug in the handler"), Some("k")).await;
    let error = failed.last_error.unwrap_or_default();
    assert!(error.contains("panicked: a bug in the handler"), "{error}");
}

#[tokio::test]
async fn a_transaction_the_handler_ended_itself_costs_attempts_not_a_loop() {
    // A handler bug: the commit that follows cannot succeed.
    let failed = fails_alone(
        |session| {
            async move {
                session.abort_transaction().await?;
                Ok(())
            }
            .boxed()
        },
        None,
    )
    .await;
    assert!(failed.last_error.is_some());
}

#[tokio::test]
async fn an_existing_consumer_it_cannot_work_with_is_refused_and_a_deleted_one_ends_the_run() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let stream = env.jetstream.get_stream(&env.stream).await.unwrap();
    stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("billing".into()),
            ack_policy: jetstream::consumer::AckPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let error = quick(&inbox, &env).bind().await.err().expect("refused");
    assert!(
        matches!(error, outbox_relay::Error::Config(_))
            && error.to_string().contains("nats consumer rm"),
        "{error}"
    );
    stream.delete_consumer("billing").await.unwrap();

    let consumer = quick(&inbox, &env).bind().await.unwrap();
    let running = Running::start(consumer, counting(&env.db.collection("effects"), "n"));
    publish_stored(&env, "order", &ObjectId::new().to_hex(), None).await;
    wait_metric(&metrics, |c| c.handled, 1).await;
    stream.delete_consumer("billing").await.unwrap();
    let ended = tokio::time::timeout(WAIT, running.task)
        .await
        .expect("the run ends once its consumer is gone")
        .expect("no panic");
    let error = ended.expect_err("an error says the consumer is gone");
    assert!(error.to_string().contains("deleted"), "{error}");
    env.drop().await;
}

#[tokio::test]
async fn with_a_retention_each_record_expires_through_the_ttl_index() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = Inbox::builder(&env.db, "billing")
        .retention(Duration::from_secs(3600))
        .metrics(metrics.clone())
        .build()
        .await
        .unwrap();
    let running = Running::start(
        quick(&inbox, &env).bind().await.unwrap(),
        counting(&env.db.collection("effects"), "n"),
    );
    let id = ObjectId::new().to_hex();
    publish_stored(&env, "order", &id, None).await;
    wait_metric(&metrics, |c| c.handled, 1).await;
    let record = inbox
        .collection()
        .find_one(doc! { "messageId": &id })
        .await
        .unwrap()
        .expect("recorded");
    let handled_at = record.get_datetime("handledAt").unwrap().timestamp_millis();
    let expire_at = record.get_datetime("expireAt").unwrap().timestamp_millis();
    assert_eq!(expire_at - handled_at, 3_600_000, "expires an hour after");
    let ttl = inbox
        .collection()
        .list_index_names()
        .await
        .unwrap()
        .contains(&"inbox_ttl".to_owned());
    assert!(ttl, "the TTL index exists");
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn the_backlog_tells_when_the_consumer_has_caught_up() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let effects = env.db.collection::<Document>("effects");
    for n in 0..20 {
        let key = format!("k{}", n % 4);
        assert!(publish_stored(&env, "order.placed", &ObjectId::new().to_hex(), Some(&key)).await);
    }
    let consumer = quick(&inbox, &env).bind().await.unwrap();
    let backlog = consumer.backlog();
    assert_eq!(
        backlog.remaining().await.unwrap(),
        20,
        "nothing handled yet"
    );
    let running = Running::start(consumer, counting(&effects, "orders"));
    tokio::time::timeout(WAIT, backlog.caught_up(Duration::from_millis(20)))
        .await
        .expect("caught up in time");
    assert_eq!(
        metrics.counts("billing").handled,
        20,
        "caught up only once every message is handled"
    );
    assert_eq!(counted(&effects, "orders").await, 20);
    running.stop().await;
    env.drop().await;
}

/// Consumer `billing`'s record of message `id`.
async fn record(inbox: &Inbox, id: &str) -> Option<Document> {
    let key = doc! { "consumer": "billing", "messageId": id };
    inbox.collection().find_one(key).await.unwrap()
}

/// A record's `attempts`, as an int or a long.
fn attempts(record: &Document) -> Option<i64> {
    let int = record.get_i32("attempts").ok().map(i64::from);
    int.or_else(|| record.get_i64("attempts").ok())
}

/// Takes the consumer's next message and leaves it unacknowledged, as a
/// consumer that dies at once: JetStream delivers it again after the ack
/// wait, having counted a delivery that ran no handler.
async fn deliver_unacknowledged(env: &TestEnv) {
    let mut batch = durable(env)
        .await
        .fetch()
        .max_messages(1)
        .expires(WAIT)
        .messages()
        .await
        .unwrap();
    let delivered = tokio::time::timeout(WAIT, batch.next())
        .await
        .expect("delivered, again once its ack wait ran out");
    drop(delivered.expect("a message").expect("a good message"));
}

/// Fails its first `times` runs, and notes the attempt each run saw.
struct Failing {
    times: usize,
    seen: Arc<Mutex<Vec<u64>>>,
}

impl Failing {
    /// A handler failing its first `times` runs, and the attempts it saw.
    fn runs(times: usize) -> (Self, Arc<Mutex<Vec<u64>>>) {
        let seen = Arc::<Mutex<Vec<u64>>>::default();
        let handler = Failing {
            times,
            seen: seen.clone(),
        };
        (handler, seen)
    }
}

impl Handler for Failing {
    async fn handle(&self, _: &mut ClientSession, message: &Delivery) -> Result<(), HandlerError> {
        let runs = {
            let mut seen = self.seen.lock().unwrap();
            seen.push(message.attempt);
            seen.len()
        };
        match runs <= self.times {
            true => Err(HandlerError::new("this run fails")),
            false => Ok(()),
        }
    }
}

#[tokio::test]
async fn deliveries_that_ran_no_handler_cost_no_attempt() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    assert!(publish_stored(&env, "order.placed", &id, None).await);
    // Delivered three times and never acknowledged (a consumer that died
    // at once, thrice): JetStream counts three deliveries, no handler ran.
    for _ in 0..3 {
        deliver_unacknowledged(&env).await;
    }
    let (handler, seen) = Failing::runs(1);
    let running = Running::start(consumer, handler);
    wait_metric(&metrics, |c| c.handled, 1).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [1, 2],
        "attempts counted from the handler's runs, not JetStream's deliveries"
    );
    assert_eq!(metrics.counts("billing").failed, 0);
    let record = record(&inbox, &id).await.expect("its record");
    assert_eq!(record.get_str("status").unwrap(), "handled");
    assert_eq!(attempts(&record), Some(2));
    running.stop().await;
    env.drop().await;
}

/// Records two runs of message `id` begun, neither ended: as a handler
/// that ends its process leaves the record.
async fn two_runs_never_ended(inbox: &Inbox, id: &str) {
    inbox
        .collection()
        .insert_one(doc! {
            "consumer": "billing", "messageId": id, "status": "failing", "attempts": 2,
        })
        .await
        .unwrap();
}

/// Runs `consumer` (at most two runs a message) until it gives message
/// `id` up, and checks that it began no third run.
async fn given_up_without_a_third_run(
    inbox: &Inbox,
    metrics: &InboxMetrics,
    consumer: Consumer,
    id: &str,
) {
    let (handler, seen) = Failing::runs(0);
    let running = Running::start(consumer, handler);
    wait_metric(metrics, |c| c.failed, 1).await;
    assert!(seen.lock().unwrap().is_empty(), "no third run began");
    let record = record(inbox, id).await.expect("its record");
    assert_eq!(record.get_str("status").unwrap(), "failed");
    let error = record.get_str("lastError").unwrap();
    assert!(error.contains("never ended with a result"), "{error}");
    running.stop().await;
}

#[tokio::test]
async fn a_message_whose_runs_never_ended_is_given_up_without_another() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    assert!(publish_stored(&env, "order.placed", &id, None).await);
    two_runs_never_ended(&inbox, &id).await;
    deliver_unacknowledged(&env).await;
    given_up_without_a_third_run(&inbox, &metrics, consumer, &id).await;
    env.drop().await;
}

#[tokio::test]
async fn runs_the_record_holds_bound_a_delivery_jetstream_calls_its_first() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    // Runs JetStream's count does not show: it can fall short, taking back
    // a delivery that reached no client.
    two_runs_never_ended(&inbox, &id).await;
    assert!(publish_stored(&env, "order.placed", &id, None).await);
    given_up_without_a_third_run(&inbox, &metrics, consumer, &id).await;
    env.drop().await;
}

#[tokio::test]
async fn a_message_given_up_on_that_comes_again_keeps_counting_its_runs() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(3).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    // Given up on after one run (when the limit was 1), then replayed with
    // its key: retried in place, each run counted on from the record.
    inbox
        .collection()
        .insert_one(doc! {
            "consumer": "billing", "messageId": &id, "status": "failed", "attempts": 1,
        })
        .await
        .unwrap();
    assert!(publish_stored(&env, "order.placed", &id, Some("k")).await);
    let (handler, seen) = Failing::runs(usize::MAX);
    let running = Running::start(consumer, handler);
    wait_metric(&metrics, |c| c.failed, 1).await;
    assert_eq!(
        *seen.lock().unwrap(),
        [2, 3],
        "two more runs, up to the limit"
    );
    let record = record(&inbox, &id).await.expect("its record");
    assert_eq!(record.get_str("status").unwrap(), "failed");
    assert_eq!(attempts(&record), Some(3));
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_message_given_up_at_the_limit_that_comes_again_gets_a_run_after_a_hand_back() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    // Given up on at the limit, then replayed; its first delivery is
    // handed back unrun, so the next is counted before it runs.
    inbox
        .collection()
        .insert_one(doc! {
            "consumer": "billing", "messageId": &id, "status": "failed", "attempts": 2,
        })
        .await
        .unwrap();
    assert!(publish_stored(&env, "order.placed", &id, None).await);
    deliver_unacknowledged(&env).await;
    let (handler, seen) = Failing::runs(0);
    let running = Running::start(consumer, handler);
    wait_until("the message to be handled or given up on", || async {
        let counts = metrics.counts("billing");
        counts.handled + counts.failed >= 1
    })
    .await;
    let record = record(&inbox, &id).await.expect("its record");
    assert_eq!(
        record.get_str("status").unwrap(),
        "handled",
        "given a run, as the first delivery would have been: {record}"
    );
    assert_eq!(*seen.lock().unwrap(), [3], "one run, the third counted");
    running.stop().await;
    env.drop().await;
}

#[tokio::test]
async fn a_redelivery_of_the_message_given_up_on_gets_no_run() {
    let env = TestEnv::new().await;
    let metrics = InboxMetrics::new();
    let inbox = inbox(&env, &metrics).await;
    let consumer = quick(&inbox, &env).max_deliveries(2).bind().await.unwrap();
    let id = ObjectId::new().to_hex();
    let stored = publish(&env, "order.placed", &id, None)
        .await
        .await
        .expect("stored");
    // Given up on at the limit, from this very stream position, and its
    // termination lost: JetStream delivers the same message again.
    inbox
        .collection()
        .insert_one(doc! {
            "consumer": "billing", "messageId": &id, "status": "failed", "attempts": 2,
            "streamSequence": stored.sequence as i64, "lastError": "the handler's own",
        })
        .await
        .unwrap();
    deliver_unacknowledged(&env).await;
    let (handler, seen) = Failing::runs(0);
    let running = Running::start(consumer, handler);
    wait_metric(&metrics, |c| c.failed, 1).await;
    assert!(seen.lock().unwrap().is_empty(), "no run began");
    let record = record(&inbox, &id).await.expect("its record");
    assert_eq!(record.get_str("status").unwrap(), "failed");
    // Refused, it counts no run: JetStream may hand the consumer two copies
    // of it at once, and each is refused for what the record says.
    assert_eq!(attempts(&record), Some(2), "{record}");
    let error = record.get_str("lastError").unwrap();
    assert!(error.contains("redelivery"), "{error}");
    running.stop().await;
    env.drop().await;
}
