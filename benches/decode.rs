//! Cost of turning an outbox document into a NATS message: the relay's own
//! CPU work per message on the hot path (everything else is waiting on the
//! servers). `cargo bench --bench decode` runs it in full; under `cargo test`
//! it runs a few iterations so it keeps working.

use std::hint::black_box;
use std::time::Instant;

use bson::{doc, oid::ObjectId, Binary, RawDocumentBuf};
use outbox_relay::contract::{
    CloudEvents, ContentMode, DecodeRules, SubjectRules, SubjectTemplate,
};

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let iterations = if full { 200_000 } else { 100 };
    let subjects = SubjectRules::under("outbox").expect("a valid prefix");
    let rules = DecodeRules::new(subjects, 1 << 20);
    let cases = [
        (
            "json payload, 5 fields",
            doc! {
                "_id": ObjectId::new(), "type": "order.placed", "status": "pending",
                "correlationId": "c-1", "key": "order-1", "createdAt": bson::DateTime::now(),
                "headers": { "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" },
                "payload": { "order": 1_i64, "customer": "c-17", "total": 42.5, "items": [1, 2, 3], "note": "x".repeat(100) },
            },
        ),
        (
            "json payload, 100 KB",
            doc! {
                "_id": ObjectId::new(), "type": "order.placed", "status": "pending",
                "payload": { "n": 1_i64, "padding": "x".repeat(100_000) },
            },
        ),
        (
            "binary payload, 1 KiB",
            doc! {
                "_id": ObjectId::new(), "type": "blob", "status": "pending",
                "payload": Binary { subtype: bson::spec::BinarySubtype::Generic, bytes: vec![7; 1024] },
            },
        ),
    ];
    // The same message with its key in the subject: the template's cost.
    let by_key = SubjectTemplate::parse("{prefix}.{type}.{key}").expect("a template");
    let keyed = SubjectRules::under("outbox")
        .and_then(|subjects| subjects.with_template(by_key))
        .expect("valid rules");
    let keyed = DecodeRules::new(keyed, 1 << 20);
    let raw = RawDocumentBuf::try_from(&cases[0].1).expect("a document encodes");
    let started = Instant::now();
    for _ in 0..iterations {
        black_box(keyed.decode_raw(black_box(&raw)));
    }
    let per_message = started.elapsed() / iterations;
    println!(
        "decode {}, from BSON bytes, subject {{prefix}}.{{type}}.{{key}}: {per_message:?} per \
         message ({iterations} iterations)",
        cases[0].0
    );
    for (name, document) in &cases {
        let started = Instant::now();
        for _ in 0..iterations {
            black_box(rules.decode(black_box(document)));
        }
        let per_message = started.elapsed() / iterations;
        println!("decode {name}: {per_message:?} per message ({iterations} iterations)");
        // As the sources read it: the server's bytes.
        let raw = RawDocumentBuf::try_from(document).expect("a document encodes");
        let started = Instant::now();
        for _ in 0..iterations {
            black_box(rules.decode_raw(black_box(&raw)));
        }
        let per_message = started.elapsed() / iterations;
        println!(
            "decode {name}, from BSON bytes: {per_message:?} per message ({iterations} iterations)"
        );
    }
    // Each message as a CloudEvent: what each content mode adds.
    for (mode, name) in [
        (ContentMode::Binary, "binary"),
        (ContentMode::Structured, "structured"),
    ] {
        let events = DecodeRules::new(
            SubjectRules::under("outbox").expect("a valid prefix"),
            1 << 20,
        )
        .with_cloudevents(Some(
            CloudEvents::new(mode, "/shop/outbox").expect("a valid source"),
        ));
        for (case, document) in &cases {
            let raw = RawDocumentBuf::try_from(document).expect("a document encodes");
            let started = Instant::now();
            for _ in 0..iterations {
                black_box(events.decode_raw(black_box(&raw)));
            }
            let per_message = started.elapsed() / iterations;
            println!(
                "decode {case}, from BSON bytes, as a {name} CloudEvent: {per_message:?} per \
                 message ({iterations} iterations)"
            );
        }
    }
}
