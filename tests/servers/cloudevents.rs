//! CloudEvents on the real servers: every message of each mode, through
//! `run`, `sweep --once` and `replay`, read back attribute by attribute,
//! then by the CloudEvents Python SDK (`tests/cloudevents/read.py`), which
//! no one here wrote, with each structured body validated against the
//! event format's JSON Schema; and an inbox handler that sees the
//! attributes whichever mode brought them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::message::StreamMessage;
use base64::Engine;
use bson::{doc, oid::ObjectId, spec::BinarySubtype, Binary, Bson, DateTime, Document};
use futures::FutureExt;
use outbox_relay::config::CloudEventsMode;
use outbox_relay::contract::cloudevents::{percent_decode, ContentMode, Event};
use outbox_relay::inbox::{handler, Delivery, Inbox};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::common::history::History;
use crate::common::*;

const SOURCE: &str = "/shop/outbox";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One document, and the event it must arrive as.
struct Case {
    name: &'static str,
    document: Document,
    expected: Expected,
}

/// An event's attributes and data, as the document says them.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    source: String,
    time: Option<String>,
    subject: Option<String>,
    datacontenttype: String,
    data: Vec<u8>,
    extensions: BTreeMap<String, String>,
}

impl Expected {
    fn of(datacontenttype: &str, data: impl Into<Vec<u8>>) -> Self {
        Expected {
            source: SOURCE.to_owned(),
            time: None,
            subject: None,
            datacontenttype: datacontenttype.to_owned(),
            data: data.into(),
            extensions: BTreeMap::new(),
        }
    }

    fn subject(mut self, subject: &str) -> Self {
        self.subject = Some(subject.to_owned());
        self
    }

    fn time(mut self, time: &str) -> Self {
        self.time = Some(time.to_owned());
        self
    }

    fn extension(mut self, name: &str, value: &str) -> Self {
        self.extensions.insert(name.to_owned(), value.to_owned());
        self
    }
}

const JSON: &str = "application/json";
const TEXT: &str = "text/plain; charset=utf-8";

fn json_payload(value: serde_json::Value) -> (Bson, Vec<u8>) {
    let bytes = serde_json::to_vec(&value).expect("JSON");
    (bson::to_bson(&value).expect("BSON"), bytes)
}

/// Every kind of document: keys with spaces, dots, wildcards, `%`, quotes
/// and beyond ASCII; each kind of payload; with and without `createdAt`,
/// `key` and headers.
fn cases() -> Vec<Case> {
    let (order, order_json) = json_payload(json!({ "order": 7, "lines": [{ "sku": "A-1" }] }));
    let (empty, empty_json) = json_payload(json!({}));
    let created = DateTime::from_millis(1_765_000_000_123);
    let mut cases = vec![
        Case {
            name: "every field",
            document: doc! {
                "type": "order.placed", "payload": order.clone(), "key": "order 7",
                "correlationId": "checkout-7", "createdAt": created,
                "headers": {
                    "traceparent": TRACEPARENT, "tracestate": "rojo=00f067aa0ba902b7",
                    "tenant": "acme", "X-Plain": "not an attribute",
                },
            },
            expected: Expected::of(JSON, order_json.clone())
                .subject("order 7")
                .time("2025-12-06T05:46:40.123Z")
                .extension("traceparent", TRACEPARENT)
                .extension("tracestate", "rojo=00f067aa0ba902b7")
                .extension("tenant", "acme"),
        },
        Case {
            name: "no key, no createdAt, no headers",
            document: doc! { "type": "order.noted", "payload": order.clone() },
            expected: Expected::of(JSON, order_json.clone()),
        },
        Case {
            name: "an empty key is no subject",
            document: doc! { "type": "order.noted", "payload": empty, "key": "" },
            expected: Expected::of(JSON, empty_json),
        },
        Case {
            name: "a text payload",
            document: doc! { "type": "note.added", "payload": "héllo, wörld ✓ \"quoted\"" },
            expected: Expected::of(TEXT, "héllo, wörld ✓ \"quoted\""),
        },
        Case {
            name: "a binary payload",
            document: doc! {
                "type": "blob.stored",
                "payload": Binary { subtype: BinarySubtype::Generic, bytes: vec![0, 1, 2, 0xff, 0x80] },
            },
            expected: Expected::of("application/octet-stream", vec![0, 1, 2, 0xff, 0x80]),
        },
        Case {
            name: "JSON text declared as JSON",
            document: doc! {
                "type": "order.exported", "payload": r#"{"a": [1, 2]}"#,
                "headers": { "Content-Type": "application/json" },
            },
            expected: Expected::of(JSON, r#"{"a": [1, 2]}"#),
        },
        Case {
            name: "JSON text declared as JSON that is no object",
            document: doc! {
                "type": "order.exported", "payload": "[1, 2]",
                "headers": { "Content-Type": "application/json" },
            },
            expected: Expected::of(JSON, "[1, 2]"),
        },
        Case {
            name: "text declared as JSON that is none",
            document: doc! {
                "type": "order.exported", "payload": "not json",
                "headers": { "Content-Type": "application/json" },
            },
            expected: Expected::of(JSON, "not json"),
        },
        Case {
            name: "a content type of its own",
            document: doc! {
                "type": "order.exported", "payload": "id,total\no-3,42\n",
                "headers": { "content-type": "text/csv" },
            },
            expected: Expected::of("text/csv", "id,total\no-3,42\n"),
        },
        Case {
            name: "a source of its own",
            document: doc! {
                "type": "order.placed", "payload": order.clone(), "key": "k",
                "source": "urn:shop:orders:eu%20west",
            },
            expected: Expected {
                source: "urn:shop:orders:eu%20west".to_owned(),
                ..Expected::of(JSON, order_json.clone()).subject("k")
            },
        },
        Case {
            name: "an extension of spaces, quotes and beyond ASCII",
            document: doc! {
                "type": "order.placed", "payload": order.clone(),
                "headers": { "region": "eu west \"ü\" 100%" },
            },
            expected: Expected::of(JSON, order_json.clone())
                .extension("region", "eu west \"ü\" 100%"),
        },
        Case {
            name: "the first millisecond",
            document: doc! { "type": "t", "payload": "x", "createdAt": DateTime::from_millis(1) },
            expected: Expected::of(TEXT, "x").time("1970-01-01T00:00:00.001Z"),
        },
        // (A date beyond the year 9999, which has no time, is in the unit
        // tests: SecantusDB, on Python's datetime, refuses to store one.)
        Case {
            name: "a createdAt before 1970",
            document: doc! { "type": "t", "payload": "x", "createdAt": DateTime::from_millis(-2_208_988_799_999) },
            expected: Expected::of(TEXT, "x").time("1900-01-01T00:00:00.001Z"),
        },
        Case {
            name: "a createdAt that is no date",
            document: doc! { "type": "t", "payload": "x", "createdAt": "2026-01-01" },
            expected: Expected::of(TEXT, "x"),
        },
    ];
    let keys = [
        "a.b.*.>",
        "100% \"sure\"",
        "Zürich 🚀 日本",
        " leading and trailing ",
        "%41%",
        "tab-free\u{a0}nbsp",
    ];
    for key in keys {
        cases.push(Case {
            name: "a key NATS and CloudEvents must both carry",
            document: doc! { "type": "order.placed", "payload": order.clone(), "key": key },
            expected: Expected::of(JSON, order_json.clone()).subject(key),
        });
    }
    for case in &mut cases {
        case.document.insert("_id", ObjectId::new());
        case.document.insert("status", "pending");
    }
    cases
}

/// What the binding asks of a header value, written here apart from the
/// relay's encoder: each UTF-8 byte outside U+0021..U+007E, and space,
/// `"` and `%`, as `%XY`.
fn binding_encoded(value: &str) -> String {
    value
        .bytes()
        .map(|byte| match byte {
            b'"' | b'%' => format!("%{byte:02X}"),
            0x21..=0x7e => char::from(byte).to_string(),
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

fn headers_of(message: &StreamMessage) -> Vec<(String, String)> {
    message
        .headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.to_string(), value.as_str().to_owned()))
        })
        .collect()
}

/// Checks every stored message against its case, attribute by attribute,
/// and returns them as the Python SDK's reader takes them.
fn check(
    mode: ContentMode,
    cases: &[Case],
    stored: &[StreamMessage],
    what: &str,
) -> Vec<serde_json::Value> {
    assert_eq!(stored.len(), cases.len(), "{what}: one message a document");
    let by_id: BTreeMap<String, &Case> = cases
        .iter()
        .map(|case| (case.document.get_object_id("_id").unwrap().to_hex(), case))
        .collect();
    let mut read = Vec::new();
    for message in stored {
        let headers = headers_of(message);
        let header = |name: &str| {
            headers
                .iter()
                .find(|(header, _)| header == name)
                .map(|(_, value)| value.as_str())
        };
        // A replayed copy is known by its first delivery's id.
        let id = header("Outbox-Replay-Of")
            .or(header("Nats-Msg-Id"))
            .expect("a message id")
            .to_owned();
        let case = by_id[&id];
        let what = format!("{what}, {mode:?}, {}", case.name);
        let expected = &case.expected;
        let event = Event::read(&headers, &message.payload)
            .unwrap_or_else(|| panic!("{what}: no CloudEvent"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(event.event.mode, mode, "{what}");
        assert_eq!(event.event.specversion, "1.0", "{what}");
        assert_eq!(
            event.event.id, id,
            "{what}: the event's id is the message's"
        );
        assert_eq!(event.event.source, expected.source, "{what}");
        assert_eq!(
            event.event.event_type,
            case.document.get_str("type").unwrap(),
            "{what}"
        );
        assert_eq!(event.event.time, expected.time, "{what}");
        assert_eq!(event.event.subject, expected.subject, "{what}");
        assert_eq!(
            event.event.datacontenttype.as_deref(),
            Some(expected.datacontenttype.as_str()),
            "{what}"
        );
        assert_eq!(event.event.extensions, expected.extensions, "{what}");
        assert_eq!(event.data.as_ref(), expected.data.as_slice(), "{what}");
        // NATS trims the spaces around a header value: only the event's
        // subject, percent-encoded, carries such a key whole.
        assert_eq!(
            header("Outbox-Key"),
            case.document.get_str("key").ok().map(str::trim),
            "{what}"
        );
        match mode {
            ContentMode::Binary => {
                assert_eq!(
                    header("Content-Type"),
                    None,
                    "{what}: binary says no Content-Type"
                );
                for (name, value) in &headers {
                    let Some(attribute) = name.strip_prefix("ce-") else {
                        continue;
                    };
                    let decoded = percent_decode(value).expect("a binding value");
                    assert_eq!(
                        value,
                        &binding_encoded(&decoded),
                        "{what}: ce-{attribute} is encoded as the binding says"
                    );
                }
                if let Some(subject) = &expected.subject {
                    assert_eq!(
                        header("ce-subject"),
                        Some(binding_encoded(subject).as_str())
                    );
                }
                assert_eq!(message.payload.as_ref(), expected.data.as_slice(), "{what}");
            }
            ContentMode::Structured => {
                assert_eq!(
                    header("Content-Type"),
                    Some("application/cloudevents+json"),
                    "{what}"
                );
                assert!(
                    headers
                        .iter()
                        .all(|(name, _)| !name.to_ascii_lowercase().starts_with("ce-")),
                    "{what}: no attribute outside the body"
                );
            }
        }
        if expected.extensions.contains_key("traceparent") {
            assert_eq!(
                header("traceparent"),
                Some(TRACEPARENT),
                "{what}: kept for tracers"
            );
        }
        if case
            .document
            .get_document("headers")
            .is_ok_and(|h| h.contains_key("X-Plain"))
        {
            assert_eq!(header("X-Plain"), Some("not an attribute"), "{what}");
        }
        let plain: BTreeMap<String, String> = headers.iter().cloned().collect();
        read.push(json!({
            "name": what,
            "mode": match mode { ContentMode::Binary => "binary", ContentMode::Structured => "structured" },
            "headers": plain,
            "body_base64": base64::engine::general_purpose::STANDARD.encode(&message.payload),
            "expected": {
                "id": id,
                "source": expected.source,
                "type": case.document.get_str("type").unwrap(),
                "time": expected.time,
                "subject": expected.subject,
                "datacontenttype": expected.datacontenttype,
                "data_base64": base64::engine::general_purpose::STANDARD.encode(&expected.data),
                "extensions": expected.extensions,
            },
        }));
    }
    read
}

/// Has the CloudEvents Python SDK read every message; fails with what it
/// found wrong.
async fn read_with_python_sdk(env: &TestEnv, messages: Vec<serde_json::Value>) {
    let count = messages.len();
    let path = std::env::temp_dir().join(format!("{}-cloudevents.json", env.name));
    let text = serde_json::to_vec(&json!({ "messages": messages })).expect("JSON");
    std::fs::write(&path, text).expect("write the messages");
    let mut command = std::process::Command::new(python());
    command
        .arg(manifest_dir().join("tests/cloudevents/read.py"))
        .arg(&path);
    let output = bounded(command).await;
    let _ = std::fs::remove_file(&path);
    assert!(
        output.status.success(),
        "the CloudEvents SDK read them otherwise: {}",
        output_text(&output)
    );
    let summary: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("the reader's summary");
    assert_eq!(summary["read"], count, "{summary}");
    assert_eq!(summary["failed"], 0, "{summary}");
}

fn modes() -> [(CloudEventsMode, ContentMode, &'static str); 2] {
    [
        (CloudEventsMode::Binary, ContentMode::Binary, "binary"),
        (
            CloudEventsMode::Structured,
            ContentMode::Structured,
            "structured",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn run_sends_every_message_as_the_event_it_is_in_each_mode() {
    let mut read = Vec::new();
    let mut envs = Vec::new();
    for (setting, mode, _) in modes() {
        let env = TestEnv::new().await;
        let mut config = env.config();
        config.cloudevents = setting;
        config.cloudevents_source = Some(SOURCE.to_owned());
        let relay = RunningRelay::start(config).await;
        let cases = cases();
        let documents: Vec<Document> = cases.iter().map(|case| case.document.clone()).collect();
        let count = documents.len() as u64;
        env.outbox().insert_many(documents).await.expect("insert");
        env.wait_count(doc! { "status": "processed" }, count).await;
        relay.stop().await.expect("a clean stop");
        let mut stream = env.jetstream.get_stream(&env.stream).await.expect("stream");
        let stored = stream_messages(&mut stream).await;
        read.extend(check(mode, &cases, &stored, "run"));
        envs.push(env);
    }
    read_with_python_sdk(&envs[0], read).await;
    for env in envs {
        env.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sweep_once_and_replay_send_the_same_events_as_run() {
    let mut read = Vec::new();
    let mut histories = Vec::new();
    for (_, mode, name) in modes() {
        let cases = cases();
        let mut history =
            History::of(cases.iter().map(|case| case.document.clone()).collect()).await;
        let mut sweep = relay_command(&history.env);
        sweep
            .args(["sweep", "--once", "--mode", "poll"])
            .env("OUTBOX_CLOUDEVENTS", name)
            .env("OUTBOX_CLOUDEVENTS_SOURCE", SOURCE);
        let output = bounded(sweep).await;
        assert!(output.status.success(), "{}", output_text(&output));
        let mut stream = history
            .env
            .jetstream
            .get_stream(&history.env.stream)
            .await
            .expect("stream");
        let swept = stream_messages(&mut stream).await;
        read.extend(check(mode, &cases, &swept, "sweep --once"));

        let mut replay = history.replay_all(&[]);
        replay
            .env("OUTBOX_CLOUDEVENTS", name)
            .env("OUTBOX_CLOUDEVENTS_SOURCE", SOURCE);
        let output = bounded(replay).await;
        assert!(output.status.success(), "{}", output_text(&output));
        let replayed = history.stored().await;
        read.extend(check(mode, &cases, &replayed, "replay"));
        let original: BTreeMap<String, &StreamMessage> = swept
            .iter()
            .map(|m| (stored_header(m, "Nats-Msg-Id").unwrap(), m))
            .collect();
        for copy in &replayed {
            let id = stored_header(copy, "Outbox-Replay-Of").expect("a replay says what of");
            let first = original[&id];
            assert_eq!(copy.payload, first.payload, "{mode:?}: the same body");
            let attributes = |message: &StreamMessage| -> BTreeMap<String, String> {
                headers_of(message)
                    .into_iter()
                    .filter(|(name, _)| name.starts_with("ce-") || name == "Content-Type")
                    .collect()
            };
            assert_eq!(
                attributes(copy),
                attributes(first),
                "{mode:?}: the same event"
            );
        }
        histories.push(history);
    }
    read_with_python_sdk(&histories[0].env, read).await;
    for history in histories {
        history.drop().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_inbox_handler_sees_the_attributes_whichever_mode_brought_them() {
    let env = TestEnv::new().await;
    let payload = doc! { "order": 7_i64 };
    let mut ids = Vec::new();
    for setting in [
        CloudEventsMode::Off,
        CloudEventsMode::Binary,
        CloudEventsMode::Structured,
    ] {
        let mut config = env.config();
        config.cloudevents = setting;
        let relay = RunningRelay::start(config).await;
        let id = ObjectId::new();
        env.outbox()
            .insert_one(doc! {
                "_id": id, "type": "order.placed", "payload": payload.clone(),
                "key": "k 1", "status": "pending", "createdAt": DateTime::from_millis(5),
                "headers": { "tenant": "acme" },
            })
            .await
            .expect("insert");
        env.wait_count(doc! { "_id": id, "status": "processed" }, 1)
            .await;
        relay.stop().await.expect("a clean stop");
        ids.push(id.to_hex());
    }

    let seen: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let handled = Arc::clone(&seen);
    let inbox = Inbox::builder(&env.db, "billing")
        .build()
        .await
        .expect("an inbox");
    let consumer = inbox
        .consumer(env.jetstream.clone(), &env.stream)
        .bind()
        .await
        .expect("a consumer");
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(
        handler(move |_, delivery: &Delivery| {
            handled.lock().unwrap().push(delivery.clone());
            async { Ok(()) }.boxed()
        }),
        shutdown.clone(),
    ));
    wait_until("the three messages handled", || {
        let count = seen.lock().unwrap().len();
        async move { count >= 3 }
    })
    .await;
    shutdown.cancel();
    tokio::time::timeout(WAIT, running)
        .await
        .expect("the consumer stops")
        .expect("no panic")
        .expect("no error");

    let seen = seen.lock().unwrap().clone();
    let by_id = |id: &str| {
        seen.iter()
            .find(|delivery| delivery.message_id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("{id} handled"))
    };
    let plain = by_id(&ids[0]);
    assert_eq!(plain.event, None, "not a CloudEvent");
    let expected_data = plain.payload.clone();
    assert_eq!(
        plain.data, plain.payload,
        "a plain message's data is its body"
    );
    for (id, mode) in ids[1..]
        .iter()
        .zip([ContentMode::Binary, ContentMode::Structured])
    {
        let delivery = by_id(id);
        let event = delivery.event.as_ref().expect("the attributes");
        assert_eq!(event.mode, mode);
        assert_eq!(&event.id, id);
        assert_eq!(event.event_type, "order.placed");
        assert_eq!(event.subject.as_deref(), Some("k 1"));
        assert_eq!(event.time.as_deref(), Some("1970-01-01T00:00:00.005Z"));
        assert_eq!(event.source, format!("/{}/outbox", env.name));
        assert_eq!(
            event.extensions.get("tenant").map(String::as_str),
            Some("acme")
        );
        assert_eq!(delivery.key.as_deref(), Some("k 1"));
        assert_eq!(delivery.data, expected_data, "{mode:?}: the same data");
        if mode == ContentMode::Binary {
            assert_eq!(delivery.payload, expected_data, "the body, as it came");
        } else {
            assert_ne!(
                delivery.payload, expected_data,
                "the body, as it came: the event"
            );
        }
    }
    env.drop().await;
}
