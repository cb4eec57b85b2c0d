//! `outbox-relay audit`: what a stream lost of what the relay delivered
//! (deleted messages, a purged subject, a stream created anew), a repeat
//! stored past its window, foreign messages, pending and failed ones, a
//! selection and a rendered subject, each reported as it was done, mended
//! by `--repair`, and clean on a second audit; core NATS and a stream the
//! credentials may not read refused with exit 2.

use std::time::Duration;

use async_nats::jetstream;
use bson::{doc, oid::ObjectId, Document};
use serde_json::Value;

use crate::common::history::delivered;
use crate::common::*;

/// A test's outbox with `messages` delivered by the relay, `keys` keys of
/// `order.placed` and, every third one, `invoice.sent`.
struct Delivered {
    env: TestEnv,
    /// The ids delivered, in commit order.
    ids: Vec<ObjectId>,
}

impl Delivered {
    async fn new(messages: usize, configure: impl FnOnce(&mut outbox_relay::RelayConfig)) -> Self {
        let env = TestEnv::new().await;
        let ids: Vec<ObjectId> = (0..messages).map(|_| ObjectId::new()).collect();
        let pending: Vec<Document> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| {
                let message_type = if n % 3 == 2 {
                    "invoice.sent"
                } else {
                    "order.placed"
                };
                let mut message = delivered(*id, message_type, &format!("k{}", n % 4));
                message.insert("status", "pending");
                message.remove("processedAt");
                message
            })
            .collect();
        env.outbox().insert_many(pending).await.expect("insert");
        let mut config = env.config();
        configure(&mut config);
        let relay = RunningRelay::start(config).await;
        env.wait_count(doc! { "status": "processed" }, messages as u64)
            .await;
        relay.stop().await.expect("the relay stops");
        Delivered { env, ids }
    }

    async fn stream(&self) -> jetstream::stream::Stream {
        self.env
            .jetstream
            .get_stream(&self.env.stream)
            .await
            .expect("the test stream")
    }

    /// How many messages the test stream holds.
    async fn stored(&self) -> u64 {
        self.stream()
            .await
            .info()
            .await
            .expect("info")
            .state
            .messages
    }

    /// The test stream's configuration as it stands.
    async fn stream_config(&self) -> jetstream::stream::Config {
        let info = self.stream().await.info().await.expect("info").clone();
        info.config
    }

    /// Shortens the stream's duplicate window, so that repeats of what is
    /// deleted from it are stored once it passes.
    async fn remember_for(&self, window: Duration) {
        let mut config = self.stream_config().await;
        config.duplicate_window = window;
        self.env
            .jetstream
            .update_stream(config)
            .await
            .expect("update the stream");
    }

    /// The stream sequence of each delivered id.
    async fn sequences(&self) -> Vec<(ObjectId, u64)> {
        let mut stream = self.stream().await;
        stream_messages(&mut stream)
            .await
            .iter()
            .filter_map(|message| {
                let id = message.headers.get("Nats-Msg-Id")?.as_str().parse().ok()?;
                Some((id, message.sequence))
            })
            .collect()
    }

    /// `outbox-relay audit --all --json` with `args` besides; bounded by
    /// the longest a repair here waits for JetStream to forget ids, and
    /// more.
    async fn audit(&self, args: &[&str]) -> (std::process::Output, Value) {
        let mut command = relay_command(&self.env);
        command.args(["audit", "--all", "--json"]).args(args);
        let output = bounded_for(command, Duration::from_secs(180)).await;
        let report = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
        (output, report)
    }
}

/// The ids a report lists as missing.
fn listed_missing(report: &Value) -> Vec<String> {
    report["found"]["missing_listed"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|m| m["id"].as_str().expect("an id").to_owned())
        .collect()
}

/// Audits, repairs, and audits again: the first finds exactly `lost`
/// missing, the repair stores them, and the second audit is clean. The
/// repair's report.
async fn reported_then_repaired(delivered: &Delivered, lost: &[ObjectId], args: &[&str]) -> Value {
    let before = delivered.stored().await;
    let (output, report) = delivered.audit(args).await;
    assert_exit(&output, 1, "");
    assert_eq!(report["found"]["missing"], lost.len(), "{report}");
    let mut expected: Vec<String> = lost.iter().map(|id| id.to_hex()).collect();
    expected.sort();
    assert_eq!(listed_missing(&report), expected, "in commit order");
    let messages = report["found"]["messages"].as_u64().expect("a count");
    assert_eq!(
        report["found"]["delivered"],
        messages - lost.len() as u64,
        "{report}"
    );

    let (output, repaired) = delivered
        .audit(&[args, &["--repair", "--repair-wait", "120s"]].concat())
        .await;
    assert_exit(&output, 0, "");
    assert_eq!(repaired["repair"]["published"], lost.len(), "{repaired}");
    assert_eq!(repaired["repair"]["after"]["missing"], 0, "{repaired}");
    assert_eq!(delivered.stored().await, before + lost.len() as u64);

    let (output, report) = delivered.audit(args).await;
    assert_exit(&output, 0, "");
    assert_eq!(report["found"]["missing"], 0, "{report}");
    assert_eq!(report["found"]["stored_more_than_once"], 0, "{report}");
    repaired
}

#[tokio::test]
async fn messages_deleted_from_the_stream_are_reported_and_repaired_after_the_window() {
    let delivered = Delivered::new(12, |_| {}).await;
    let sequences = delivered.sequences().await;
    let lost: Vec<ObjectId> = sequences.iter().step_by(4).map(|(id, _)| *id).collect();
    // Deleted within the duplicate window: JetStream remembers the ids,
    // and drops a repeat until the window has passed. A minute: longer
    // than a busy machine takes from the delivery to the repair's first
    // publish, which must meet the remembered ids.
    delivered.remember_for(Duration::from_secs(60)).await;
    let stream = delivered.stream().await;
    for (_, sequence) in sequences.iter().step_by(4) {
        stream.delete_message(*sequence).await.expect("delete");
    }
    let (_, report) = delivered.audit(&[]).await;
    assert_eq!(report["found"]["remembered"]["messages"], 3, "{report}");
    let repaired = reported_then_repaired(&delivered, &lost, &[]).await;
    assert_eq!(
        repaired["repair"]["after_waiting"], 3,
        "stored once JetStream forgot them: {repaired}"
    );
    delivered.env.drop().await;
}

#[tokio::test]
async fn a_purged_subject_is_reported_and_repaired() {
    let delivered = Delivered::new(12, |_| {}).await;
    delivered.remember_for(Duration::from_millis(100)).await;
    let subject = format!("{}.invoice.sent", delivered.env.prefix);
    delivered
        .stream()
        .await
        .purge()
        .filter(&subject)
        .await
        .expect("purge");
    let lost: Vec<ObjectId> = delivered.ids.iter().skip(2).step_by(3).copied().collect();
    reported_then_repaired(&delivered, &lost, &[]).await;
    delivered.env.drop().await;
}

#[tokio::test]
async fn a_stream_deleted_and_created_again_empty_is_refilled() {
    let delivered = Delivered::new(9, |_| {}).await;
    let config = delivered.stream_config().await;
    delivered
        .env
        .jetstream
        .delete_stream(&delivered.env.stream)
        .await
        .expect("delete");
    delivered
        .env
        .jetstream
        .create_stream(config)
        .await
        .expect("create anew");
    reported_then_repaired(&delivered, &delivered.ids, &[]).await;
    delivered.env.drop().await;
}

#[tokio::test]
async fn a_selection_by_type_judges_only_its_messages() {
    let delivered = Delivered::new(12, |_| {}).await;
    delivered.remember_for(Duration::from_millis(100)).await;
    let sequences = delivered.sequences().await;
    let stream = delivered.stream().await;
    // Two of each type gone.
    for (_, sequence) in &sequences[..6] {
        if *sequence % 3 != 1 {
            stream.delete_message(*sequence).await.expect("delete");
        }
    }
    let orders: Vec<ObjectId> = sequences[..6]
        .iter()
        .filter(|(_, sequence)| *sequence % 3 == 2)
        .map(|(id, _)| *id)
        .collect();
    let (_, report) = delivered.audit(&["--type", "order.*"]).await;
    assert_eq!(report["found"]["messages"], 8, "{report}");
    reported_then_repaired(&delivered, &orders, &["--type", "order.*"]).await;
    let (output, report) = delivered.audit(&[]).await;
    assert_exit(&output, 1, "");
    assert_eq!(report["found"]["missing"], 2, "the invoices: {report}");
    delivered.env.drop().await;
}

#[tokio::test]
async fn a_template_rendered_subject_is_listed_and_repaired_to_it() {
    let delivered = Delivered::new(6, |config| {
        config.subject_template = "{prefix}.{type}.{key}".to_owned();
    })
    .await;
    delivered.remember_for(Duration::from_millis(100)).await;
    let sequences = delivered.sequences().await;
    let (lost, sequence) = sequences[1];
    delivered
        .stream()
        .await
        .delete_message(sequence)
        .await
        .expect("delete");
    let template = ["--subject-template", "{prefix}.{type}.{key}"];
    let (_, report) = delivered.audit(&template).await;
    let subject = format!("{}.order.placed.k1", delivered.env.prefix);
    assert_eq!(
        report["found"]["missing_listed"][0]["subject"], subject,
        "{report}"
    );
    let mut receiver = delivered.env.subscribe().await;
    reported_then_repaired(&delivered, &[lost], &template).await;
    let repaired = receiver.next().await;
    assert_eq!(repaired.subject.as_str(), subject);
    let headers = repaired.headers.expect("headers");
    assert_eq!(
        headers.get("Nats-Msg-Id").map(|v| v.as_str()),
        Some(&*lost.to_hex())
    );
    assert_eq!(headers.get("Outbox-Key").map(|v| v.as_str()), Some("k1"));
    delivered.env.drop().await;
}

/// A repair sends the event the relay sent: with `--cloudevents` as the
/// relay had it, the same body and the same attributes.
#[tokio::test]
async fn a_repair_publishes_the_same_cloudevent_again() {
    let delivered = Delivered::new(6, |config| {
        config.cloudevents = outbox_relay::config::CloudEventsMode::Structured;
    })
    .await;
    delivered.remember_for(Duration::from_millis(100)).await;
    let mut stream = delivered.stream().await;
    let original = stream_messages(&mut stream)
        .await
        .into_iter()
        .nth(1)
        .expect("a second message");
    let lost: ObjectId = stored_header(&original, "Nats-Msg-Id")
        .and_then(|id| id.parse().ok())
        .expect("an id");
    stream
        .delete_message(original.sequence)
        .await
        .expect("delete");
    let mut receiver = delivered.env.subscribe().await;
    reported_then_repaired(&delivered, &[lost], &["--cloudevents", "structured"]).await;
    let repaired = receiver.next().await;
    assert_eq!(repaired.payload, original.payload, "the same event");
    let headers = repaired.headers.expect("headers");
    assert_eq!(
        headers.get("Content-Type").map(|v| v.as_str()),
        Some("application/cloudevents+json")
    );
    let event: Value = serde_json::from_slice(&repaired.payload).expect("a JSON event");
    assert_eq!(event["id"], lost.to_hex());
    delivered.env.drop().await;
}

#[tokio::test]
async fn a_repeat_stored_past_its_window_is_reported_and_left() {
    let delivered = Delivered::new(4, |_| {}).await;
    delivered.remember_for(Duration::from_millis(100)).await;
    let repeated = delivered.ids[1];
    let subject = format!("{}.order.placed", delivered.env.prefix);
    wait_until("JetStream to store the repeat", || async {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", repeated.to_hex().as_str());
        let ack = delivered
            .env
            .jetstream
            .publish_with_headers(subject.clone(), headers, "again".into())
            .await
            .expect("publish")
            .await
            .expect("stored");
        !ack.duplicate
    })
    .await;
    let (output, report) = delivered.audit(&["--repair"]).await;
    assert_exit(&output, 0, "");
    assert_eq!(report["found"]["stored_more_than_once"], 1, "{report}");
    let listed = &report["found"]["stored_more_than_once_listed"][0];
    assert_eq!(listed["id"], repeated.to_hex(), "{report}");
    assert_eq!(listed["copies"], 2, "{report}");
    assert_eq!(report["found"]["delivered"], 3, "{report}");
    assert!(report["repair"].is_null(), "nothing to repair: {report}");
    delivered.env.drop().await;
}

#[tokio::test]
async fn foreign_and_unrecorded_messages_are_told_apart_by_the_retention() {
    let delivered = Delivered::new(3, |_| {}).await;
    let subject = format!("{}.order.placed", delivered.env.prefix);
    let publish = |id: Option<String>| {
        let (jetstream, subject) = (delivered.env.jetstream.clone(), subject.clone());
        async move {
            let mut headers = async_nats::HeaderMap::new();
            if let Some(id) = id {
                headers.insert("Nats-Msg-Id", id.as_str());
            }
            headers.insert("Outbox-Type", "order.placed");
            let ack = jetstream
                .publish_with_headers(subject, headers, "foreign".into())
                .await
                .expect("publish");
            ack.await.expect("stored");
        }
    };
    publish(None).await;
    publish(Some("not-an-outbox-id".to_owned())).await;
    // An outbox id the outbox does not hold: new, and two hours old.
    publish(Some(ObjectId::new().to_hex())).await;
    let old = ObjectId::from_bytes({
        let mut bytes = ObjectId::new().bytes();
        let seconds = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) - 7200;
        bytes[..4].copy_from_slice(&seconds.to_be_bytes());
        bytes
    });
    publish(Some(old.to_hex())).await;
    let (output, report) = delivered
        .audit(&["--since", "3h", "--retention", "1h"])
        .await;
    assert_exit(&output, 0, "");
    let found = &report["found"];
    assert_eq!(found["foreign"], 2, "{report}");
    assert_eq!(found["unrecorded"]["past_retention"], 1, "{report}");
    assert_eq!(found["unrecorded"]["unexplained"], 1, "{report}");
    assert_eq!(found["delivered"], 3, "{report}");
    let (_, report) = delivered.audit(&["--since", "3h"]).await;
    assert_eq!(
        report["found"]["unrecorded"]["unexplained"], 2,
        "without a retention neither is explained: {report}"
    );
    delivered.env.drop().await;
}

#[tokio::test]
async fn pending_and_failed_messages_are_counted_apart() {
    let delivered = Delivered::new(3, |_| {}).await;
    let mut pending = delivered_document("order.placed");
    pending.insert("status", "pending");
    let mut failed = delivered_document("order.placed");
    failed.insert("status", "failed");
    failed.insert("lastError", "refused");
    delivered
        .env
        .outbox()
        .insert_many([pending, failed])
        .await
        .expect("insert");
    let (output, report) = delivered.audit(&[]).await;
    assert_exit(&output, 0, "");
    let found = &report["found"];
    assert_eq!(found["messages"], 5, "{report}");
    assert_eq!(found["pending"], 1, "{report}");
    assert_eq!(found["failed"], 1, "{report}");
    assert_eq!(found["delivered"], 3, "{report}");
    assert_eq!(found["missing"], 0, "{report}");
    delivered.env.drop().await;
}

/// A message document of `message_type`, without a relay's marks.
fn delivered_document(message_type: &str) -> Document {
    let mut message = delivered(ObjectId::new(), message_type, "k");
    message.remove("processedAt");
    message
}

#[tokio::test]
async fn core_nats_and_bad_flags_are_refused_with_exit_2() {
    let env = TestEnv::new().await;
    let mut command = relay_command(&env);
    command.args(["audit", "--all", "--nats-mode", "core"]);
    assert_exit(&bounded(command).await, 2, "core NATS stores nothing");
    let mut command = relay_command(&env);
    command.arg("audit");
    assert_exit(&bounded(command).await, 2, "--all");
    let mut command = relay_command(&env);
    command.args(["audit", "--since", "tomorrow"]);
    assert_exit(&bounded(command).await, 2, "--since");
    let mut command = relay_command(&env);
    command.args(["audit", "--all", "--read-rate", "0"]);
    assert_exit(&bounded(command).await, 2, "--read-rate");
    // A relay's own audit needs JetStream too.
    let mut command = relay_command(&env);
    command.args(["run", "--audit-after", "5m", "--nats-mode", "core"]);
    assert_exit(&bounded(command).await, 2, "audit-after");
    env.drop().await;
}

#[tokio::test]
async fn a_stream_the_credentials_may_not_read_is_refused_with_exit_2() {
    let env = TestEnv::new().await;
    let prefix = &env.prefix;
    let nats = NatsProcess::start_with(
        "authorization { users: [ { user: relay, password: secret, permissions: \
         { publish: { allow: [\">\"], deny: [\"$JS.API.CONSUMER.>\"] } } } ] }",
        Some("relay"),
    )
    .await;
    let client = connect_nats(&nats.url()).await.expect("connect");
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: prefix.to_uppercase(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .expect("the relay's stream");
    // Something to read: an empty stream is audited without a consumer.
    js.publish(format!("{prefix}.order.placed"), "stored".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let mut command = relay_command(&env);
    command
        .args(["audit", "--all"])
        .env("OUTBOX_NATS_URL", nats.url());
    let output = bounded(command).await;
    assert_exit(&output, 2, "cannot read JetStream stream");
    assert!(
        output_text(&output).contains("$JS.API.CONSUMER.CREATE"),
        "names what it needs: {}",
        output_text(&output)
    );
    env.drop().await;
}

#[tokio::test]
async fn an_audit_beside_a_delivering_relay_finds_nothing_missing() {
    let env = TestEnv::new().await;
    let relay = RunningRelay::start(env.config()).await;
    let writing = tokio_util::sync::CancellationToken::new();
    let writer = {
        let (outbox, writing) = (env.outbox(), writing.clone());
        tokio::spawn(async move {
            let mut written = 0u64;
            while !writing.is_cancelled() {
                let mut message = delivered_document("order.placed");
                message.insert("status", "pending");
                outbox.insert_one(message).await.expect("insert");
                written += 1;
                // Room for the relay on a busy server.
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            written
        })
    };
    // Audited while messages are written and delivered: one processed
    // after the streams were read is looked for again, not reported.
    wait_until("two hundred messages delivered", || async {
        let processed = doc! { "status": "processed" };
        env.outbox().count_documents(processed).await.ok() >= Some(200)
    })
    .await;
    let mut command = relay_command(&env);
    command.args(["audit", "--since", "10m", "--json"]);
    let output = bounded(command).await;
    writing.cancel();
    let written = writer.await.expect("the writer");
    env.wait_count(doc! { "status": "processed" }, written)
        .await;
    relay.stop().await.expect("the relay stops");
    assert_exit(&output, 0, "");
    let report: Value = serde_json::from_slice(&output.stdout).expect("a report");
    assert_eq!(report["found"]["missing"], 0, "{report}");
    assert!(
        report["found"]["delivered"].as_u64() >= Some(200),
        "{report}"
    );
    env.drop().await;
}

#[tokio::test]
async fn what_a_streams_limits_removed_is_not_missing_and_an_interest_stream_is_refused() {
    let delivered = Delivered::new(9, |_| {}).await;
    let mut config = delivered.stream_config().await;
    config.max_messages = 5;
    delivered
        .env
        .jetstream
        .update_stream(config.clone())
        .await
        .expect("limit the stream");
    assert_eq!(delivered.stored().await, 5);
    let (output, report) = delivered.audit(&[]).await;
    assert_exit(&output, 0, "");
    assert_eq!(report["found"]["missing"], 0, "{report}");
    assert_eq!(report["found"]["past_stream_limits"], 4, "{report}");
    assert_eq!(report["found"]["delivered"], 5, "{report}");

    let jetstream = &delivered.env.jetstream;
    jetstream
        .delete_stream(&delivered.env.stream)
        .await
        .expect("delete");
    config.max_messages = -1;
    config.retention = jetstream::stream::RetentionPolicy::Interest;
    jetstream.create_stream(config).await.expect("create anew");
    let (output, _) = delivered.audit(&[]).await;
    assert_exit(&output, 2, "Interest retention");
    delivered.env.drop().await;
}

/// A metric's value in a relay's rendering, where it has one line.
fn metric(rendered: &str, name: &str) -> Option<f64> {
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

#[tokio::test]
async fn a_relay_auditing_on_its_own_publishes_again_what_the_stream_lost() {
    let delivered = Delivered::new(6, |_| {}).await;
    // The stream created anew, as a NATS host that lost its disk comes
    // back: it remembers no id, so the audit's repeats are stored at once.
    let config = delivered.stream_config().await;
    let jetstream = &delivered.env.jetstream;
    jetstream
        .delete_stream(&delivered.env.stream)
        .await
        .expect("delete");
    jetstream.create_stream(config).await.expect("create anew");
    let mut config = delivered.env.config();
    config.audit_after = Some(Duration::from_secs(1));
    let relay = RunningRelay::start(config).await;
    wait_until(
        "the relay's audit to find six missing and publish them",
        || async {
            let rendered = relay.metrics.render();
            metric(&rendered, "outbox_audit_missing_total") == Some(6.0)
                && metric(&rendered, "outbox_audit_repaired_total") == Some(6.0)
        },
    )
    .await;
    assert_eq!(delivered.stored().await, 6);
    let rendered = relay.metrics.render();
    assert_eq!(metric(&rendered, "outbox_audit_unrepaired"), Some(0.0));
    // Audited once: later rounds go on from where it ended.
    let audited = delivered
        .env
        .db
        .collection::<Document>("outbox_checkpoints")
        .find_one(doc! { "_id": { "$regex": ":audit$" } })
        .await
        .expect("read")
        .expect("the audit's record");
    assert!(audited.get_datetime("auditedUntil").is_ok(), "{audited}");
    relay.stop().await.expect("the relay stops");
    let (output, _) = delivered.audit(&[]).await;
    assert_exit(&output, 0, "");
    delivered.env.drop().await;
}
