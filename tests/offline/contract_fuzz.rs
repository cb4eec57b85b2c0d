//! Property-based checks of the outbox document contract.
//!
//! An outbox document is untrusted input: any driver in any language, a
//! writer's bug or an attacker may insert anything into the collection, and
//! the relay decodes whatever it finds. No document may panic the relay (one
//! panic would stop delivery for every message behind it), every refusal
//! must say why (the reason becomes the dead letter's `lastError`), and a
//! message that is accepted must be safe to publish: a permitted subject
//! outside NATS's reserved space, none of the relay's reserved headers
//! forged, nothing that breaks the header block, nothing over the broker's
//! `max_payload`. The writer checks its documents with the same decoder, so
//! the last properties hold it to that: what it builds from valid input
//! arrives intact, and what it refuses or accepts, the relay refuses or
//! accepts too.
//!
//! Everything here runs in memory (no database, no broker), with a bounded
//! number of cases so that `cargo test` stays quick.

use std::collections::BTreeMap;

use bson::{
    oid::ObjectId, spec::BinarySubtype, Binary, Bson, DateTime, Decimal128, Document,
    JavaScriptCodeWithScope, Regex, Timestamp,
};
use outbox_relay::contract::cloudevents;
use outbox_relay::contract::{
    field, header, CloudEvents, ContentMode, DecodeRules, OutboxMessage, SubjectRules,
};
use outbox_relay::{NewMessage, Payload};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
use serde_json::Value;

/// Cases each property runs per `cargo test`.
const CASES: u32 = 256;

/// The largest generated "huge" string, in bytes: well past any header or
/// subject limit, yet small enough that a few of them per document keep a
/// case fast.
const HUGE: usize = 100_000;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: CASES,
        // A failure is reported with its minimal input in the test output;
        // writing regression files would add files to the work tree.
        failure_persistence: None,
        // Shrinking 100 KB strings can take long; a partly shrunk input is
        // still a reproducer.
        max_shrink_time: 60_000,
        // ChaCha, the default, takes about half the run time in a debug
        // build; test data needs no cryptographic generator.
        rng_algorithm: RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Strings
// ---------------------------------------------------------------------------

/// Characters that trip up parsers and protocols: controls, line breaks,
/// Unicode line separators, direction overrides, non-characters, combining
/// marks, and the characters the subject and header syntax give meaning to.
const ODD_CHARS: &[char] = &[
    '\0',
    '\r',
    '\n',
    '\t',
    '\u{7}',
    '\u{1b}',
    '\u{7f}',
    '\u{85}',
    '\u{a0}',
    '\u{2028}',
    '\u{2029}',
    '\u{202e}',
    '\u{200b}',
    '\u{feff}',
    '\u{fffd}',
    '\u{ffff}',
    '\u{10ffff}',
    '\u{301}',
    'é',
    'ß',
    'İ',
    '😀',
    '$',
    '.',
    '*',
    '>',
    ':',
    ' ',
    '-',
    '_',
    '"',
    '\\',
    '{',
];

fn odd_char() -> impl Strategy<Value = char> {
    prop_oneof![
        6 => proptest::char::range('a', 'z'),
        3 => proptest::char::range(' ', '~'),
        2 => proptest::sample::select(ODD_CHARS),
        1 => any::<char>(),
    ]
}

fn odd_string(max_chars: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(odd_char(), 0..=max_chars).prop_map(String::from_iter)
}

/// BSON keys and regex parts are C strings: they cannot hold NUL.
fn without_nul(text: String) -> String {
    text.replace('\0', "")
}

/// `seed` repeated up to exactly `bytes` bytes (or just under, at a
/// character boundary). Repetition keeps huge strings cheap to generate and
/// to shrink.
fn fill(seed: &str, bytes: usize) -> String {
    let seed = if seed.is_empty() { "x" } else { seed };
    let mut out = seed.repeat(bytes / seed.len() + 1);
    let mut end = bytes.min(out.len());
    while !out.is_char_boundary(end) {
        end -= 1;
    }
    out.truncate(end);
    out
}

fn huge_string() -> impl Strategy<Value = String> {
    (odd_string(16), 1..=HUGE).prop_map(|(seed, bytes)| fill(&seed, bytes))
}

/// A document or header key: empty, dotted, `$`-prefixed, a contract field
/// name, or odd text.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => proptest::sample::select(vec![
            "", ".", "$", "a.b", "$set", "$oid", "..", " ", "_id", "type", "payload",
            "subject", "headers", "attempts", "é.$",
        ])
        .prop_map(str::to_owned),
        4 => odd_string(12).prop_map(without_nul),
    ]
}

// ---------------------------------------------------------------------------
// BSON values
// ---------------------------------------------------------------------------

const NAMED_SUBTYPES: &[u8] = &[
    0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x80, 0xff,
];

fn binary_subtype() -> impl Strategy<Value = BinarySubtype> {
    prop_oneof![
        3 => Just(BinarySubtype::Generic),
        // Every named subtype, the first and last user-defined ones, and
        // any byte at all (reserved subtypes included).
        2 => proptest::sample::select(NAMED_SUBTYPES).prop_map(BinarySubtype::from),
        1 => any::<u8>().prop_map(BinarySubtype::from),
    ]
}

fn binary(max_bytes: usize) -> impl Strategy<Value = Bson> {
    (
        binary_subtype(),
        proptest::collection::vec(any::<u8>(), 0..=max_bytes),
    )
        .prop_map(|(subtype, bytes)| Bson::Binary(Binary { subtype, bytes }))
}

/// A DBPointer. The bson crate keeps its fields private, so it is read from
/// raw BSON: `{ "p": DBPointer(namespace, id) }`.
fn db_pointer(namespace: &str, id: [u8; 12]) -> Bson {
    let length = |n: usize| i32::try_from(n).expect("a generated namespace fits an i32 length");
    let mut element = vec![0x0c, b'p', 0];
    element.extend(length(namespace.len() + 1).to_le_bytes());
    element.extend(namespace.as_bytes());
    element.push(0);
    element.extend(id);
    let mut raw = length(4 + element.len() + 1).to_le_bytes().to_vec();
    raw.extend(element);
    raw.push(0);
    let document =
        Document::from_reader(raw.as_slice()).expect("a hand-built DBPointer is valid BSON");
    document
        .get("p")
        .cloned()
        .expect("the hand-built document holds its one element")
}

fn scalar() -> impl Strategy<Value = Bson> {
    prop_oneof![
        any::<f64>().prop_map(Bson::Double),
        odd_string(48).prop_map(Bson::String),
        binary(48),
        any::<[u8; 12]>().prop_map(|bytes| Bson::ObjectId(ObjectId::from_bytes(bytes))),
        any::<bool>().prop_map(Bson::Boolean),
        any::<i64>().prop_map(|millis| Bson::DateTime(DateTime::from_millis(millis))),
        Just(Bson::Null),
        (odd_string(24), odd_string(6)).prop_map(|(pattern, options)| {
            Bson::RegularExpression(Regex {
                pattern: without_nul(pattern),
                options: without_nul(options),
            })
        }),
        odd_string(32).prop_map(Bson::JavaScriptCode),
        any::<i32>().prop_map(Bson::Int32),
        any::<i64>().prop_map(Bson::Int64),
        any::<(u32, u32)>()
            .prop_map(|(time, increment)| Bson::Timestamp(Timestamp { time, increment })),
        // Every bit pattern, including the non-canonical ones a careless
        // driver might write.
        any::<[u8; 16]>().prop_map(|bytes| Bson::Decimal128(Decimal128::from_bytes(bytes))),
        Just(Bson::MinKey),
        Just(Bson::MaxKey),
        Just(Bson::Undefined),
        odd_string(16).prop_map(Bson::Symbol),
        (odd_string(16), any::<[u8; 12]>())
            .prop_map(|(namespace, id)| db_pointer(&without_nul(namespace), id)),
    ]
}

fn document_of(
    value: impl Strategy<Value = Bson>,
    max_len: usize,
) -> impl Strategy<Value = Document> {
    proptest::collection::vec((key(), value), 0..=max_len)
        .prop_map(|entries| entries.into_iter().collect())
}

/// Any BSON value, nested up to six levels.
fn any_bson() -> BoxedStrategy<Bson> {
    scalar()
        .prop_recursive(6, 64, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..=5).prop_map(Bson::Array),
                document_of(inner.clone(), 5).prop_map(Bson::Document),
                (odd_string(24), document_of(inner, 3)).prop_map(|(code, scope)| {
                    Bson::JavaScriptCodeWithScope(JavaScriptCodeWithScope { code, scope })
                }),
            ]
        })
        .boxed()
}

// ---------------------------------------------------------------------------
// Outbox documents
// ---------------------------------------------------------------------------

/// How a generated document leans. Wild documents put anything anywhere and
/// are nearly always refused; tame ones mostly hold well-formed fields, so
/// that a good share decode and the invariants of accepted messages get
/// checked on documents that were never built by the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lean {
    Wild,
    Tame,
}

/// A contract field's value: absent, plausible, any BSON at all, or a huge
/// string. Tame documents always have their `required` fields, though not
/// always of the right type.
fn field_value(
    lean: Lean,
    required: bool,
    plausible: impl Strategy<Value = Bson> + 'static,
) -> BoxedStrategy<Option<Bson>> {
    let (absent, wild) = match (lean, required) {
        (Lean::Wild, _) => (2, 2),
        (Lean::Tame, true) => (0, 1),
        (Lean::Tame, false) => (4, 1),
    };
    let plausible_weight = if lean == Lean::Wild { 8 } else { 24 };
    let mut arms = vec![
        (plausible_weight, plausible.prop_map(Some).boxed()),
        (wild, any_bson().prop_map(Some).boxed()),
        (
            1,
            huge_string()
                .prop_map(|text| Some(Bson::String(text)))
                .boxed(),
        ),
    ];
    if absent > 0 {
        arms.push((absent, Just(None).boxed()));
    }
    proptest::strategy::Union::new_weighted(arms).boxed()
}

/// `loose`, or in a tame document mostly `strict`.
fn leaning<T: std::fmt::Debug + 'static>(
    lean: Lean,
    strict: impl Strategy<Value = T> + 'static,
    loose: impl Strategy<Value = T> + 'static,
) -> BoxedStrategy<T> {
    match lean {
        Lean::Wild => loose.boxed(),
        Lean::Tame => prop_oneof![6 => strict, 1 => loose].boxed(),
    }
}

fn pick(values: &[&'static str]) -> impl Strategy<Value = String> {
    proptest::sample::select(values.to_vec()).prop_map(str::to_owned)
}

/// Text a document might carry in a string field: hostile literals and
/// odd text.
fn plausible_text(literals: &[&'static str]) -> impl Strategy<Value = String> {
    prop_oneof![
        2 => pick(literals),
        1 => odd_string(24),
    ]
}

fn type_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[a-z][a-z0-9_-]{0,8}(\\.[a-z][a-z0-9_-]{0,8}){0,3}",
        1 => pick(&[
            "", "order.placed", "a", "a b", "a.*", "a.>", ">", "a..b", ".a", "a.", "x\r\ny",
            "é", "$JS.API.X", "_INBOX.x", "a\u{85}b", "a\tb",
        ]),
        1 => odd_string(16),
    ]
}

fn subject_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "outbox(\\.[a-z0-9_-]{1,6}){1,3}",
        1 => "billing(\\.[a-z0-9]{1,6}){0,2}",
        2 => pick(&[
            "outbox.a", "outbox.order.placed", "billing.invoice", "billing", "outbox",
            "outbox.", "outbox..a", ".outbox.a", "outbox.*", "outbox.>", "outbox.a b",
            "outbox.a\tb", "outbox.a\r\nb", "outbox.\u{85}", "outbox.é", "outboxes.a",
            "$JS.API.STREAM.DELETE.ORDERS", "$SYS.REQ.SERVER.PING", "$KV.b.k", "$G",
            "_INBOX.abc.1", "_INBOX", "_INBOXES.x", "x.$JS.y", "other.x", "*.x", ">",
        ]),
        1 => "[a-z$_>*. ]{1,6}(\\.[a-z$_>* ]{0,6}){0,3}",
        1 => (0usize..=600).prop_map(|n| format!("outbox.{}", "a".repeat(n))),
        1 => odd_string(24),
    ]
}

fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "[A-Za-z][A-Za-z0-9-]{0,12}",
        3 => pick(&[
            "traceparent", "Content-Type", "content-type", "CONTENT-TYPE", "Nats-Msg-Id",
            "nats-msg-id", "Nats-Expected-Last-Sequence", "NATS-ROLLUP", "Nats-TTL",
            "Outbox-Type", "outbox-key", "Outbox-Correlation-Id", "Nats", "Outbox",
            "Natsx", "Outboxes", "nats_x", "X-Trace", "bad name", "a:b", "", "é", "a\tb",
            "a\r\nb", "$set", "a.b",
        ]),
        1 => key(),
    ]
}

fn header_value() -> impl Strategy<Value = Bson> {
    prop_oneof![
        6 => plausible_text(&["v", "", "00-1-2-01", "a\r\nb", "\n", "\r", "text/csv", "a: b"])
            .prop_map(Bson::String),
        1 => any_bson(),
        1 => huge_string().prop_map(Bson::String),
    ]
}

fn headers_value() -> impl Strategy<Value = Bson> {
    prop_oneof![
        4 => document_of(header_value(), 5).prop_map(Bson::Document),
        8 => proptest::collection::vec((header_name(), header_value()), 0..=5)
            .prop_map(|entries| Bson::Document(entries.into_iter().collect())),
        1 => Just(Bson::Null),
    ]
}

fn payload_value() -> impl Strategy<Value = Bson> {
    prop_oneof![
        3 => document_of(any_bson(), 6).prop_map(Bson::Document),
        2 => odd_string(64).prop_map(Bson::String),
        2 => proptest::collection::vec(any::<u8>(), 0..=64).prop_map(|bytes| {
            Bson::Binary(Binary { subtype: BinarySubtype::Generic, bytes })
        }),
        1 => binary(64),
        1 => (1usize..=HUGE).prop_map(|n| {
            Bson::Binary(Binary { subtype: BinarySubtype::Generic, bytes: vec![0xab; n] })
        }),
    ]
}

fn object_id() -> impl Strategy<Value = Bson> {
    any::<[u8; 12]>().prop_map(|bytes| Bson::ObjectId(ObjectId::from_bytes(bytes)))
}

fn date() -> impl Strategy<Value = Bson> {
    any::<i64>().prop_map(|millis| Bson::DateTime(DateTime::from_millis(millis)))
}

fn attempts_value() -> impl Strategy<Value = Bson> {
    prop_oneof![
        any::<i32>().prop_map(Bson::Int32),
        (0i32..10).prop_map(Bson::Int32),
        any::<i64>().prop_map(Bson::Int64),
        (0i64..=i64::from(u32::MAX) + 1).prop_map(Bson::Int64),
        any::<f64>().prop_map(Bson::Double),
        pick(&["3", "", "-1"]).prop_map(Bson::String),
    ]
}

/// An outbox document as anyone might insert it: every contract field
/// present or not, of the right type or any other, plus extra keys.
fn outbox_document() -> impl Strategy<Value = Document> {
    prop_oneof![Just(Lean::Wild), Just(Lean::Tame)].prop_flat_map(document_leaning)
}

fn document_leaning(lean: Lean) -> impl Strategy<Value = Document> {
    let text =
        |strict, literals| leaning(lean, strict, plausible_text(literals)).prop_map(Bson::String);
    let valid_subject = prop_oneof![
        tokens().prop_map(|tokens| format!("outbox.{tokens}")),
        tokens().prop_map(|tokens| format!("billing.{tokens}")),
    ];
    let valid_headers =
        proptest::collection::btree_map(valid_header_name(), attribute_text(24), 0..=4).prop_map(
            |headers| {
                Bson::Document(
                    headers
                        .into_iter()
                        .map(|(name, value)| (name, Bson::String(value)))
                        .collect(),
                )
            },
        );
    let writer_fields = (
        field_value(lean, true, object_id()),
        field_value(
            lean,
            true,
            leaning(lean, tokens(), type_text()).prop_map(Bson::String),
        ),
        field_value(lean, true, payload_value()),
        field_value(
            lean,
            false,
            leaning(lean, valid_subject, subject_text()).prop_map(Bson::String),
        ),
        field_value(lean, false, leaning(lean, valid_headers, headers_value())),
        field_value(
            lean,
            false,
            text(
                attribute_text(24).boxed(),
                &["k", "", "a\r\nb", "order-1", "a\tb"],
            ),
        ),
        field_value(
            lean,
            false,
            text(line_text(24).boxed(), &["c", "", "a\nb", "req-7"]),
        ),
    );
    let relay_fields = (
        field_value(
            lean,
            false,
            pick(&["pending", "processed", "failed", ""]).prop_map(Bson::String),
        ),
        field_value(lean, false, attempts_value()),
        field_value(lean, false, date()),
        field_value(
            lean,
            false,
            prop_oneof![object_id(), odd_string(16).prop_map(Bson::String)],
        ),
        field_value(lean, false, date()),
    );
    let extra = proptest::collection::vec((key(), any_bson()), 0..=4);
    (writer_fields, relay_fields, extra).prop_map(|(writer, relay, extra)| {
        let (id, message_type, payload, subject, headers, key, correlation_id) = writer;
        let (status, attempts, next_attempt_at, lock_id, locked_at) = relay;
        let fields = [
            (field::ID, id),
            (field::TYPE, message_type),
            (field::PAYLOAD, payload),
            (field::SUBJECT, subject),
            (field::HEADERS, headers),
            (field::KEY, key),
            (field::CORRELATION_ID, correlation_id),
            (field::STATUS, status),
            (field::ATTEMPTS, attempts),
            (field::NEXT_ATTEMPT_AT, next_attempt_at),
            (field::LOCK_ID, lock_id),
            (field::LOCKED_AT, locked_at),
        ];
        let mut document = Document::new();
        for (name, value) in fields {
            if let Some(value) = value {
                document.insert(name, value);
            }
        }
        // An extra key may replace a contract field: one more way for a
        // field to hold anything.
        for (name, value) in extra {
            document.insert(name, value);
        }
        document
    })
}

// ---------------------------------------------------------------------------
// Rules and checks
// ---------------------------------------------------------------------------

fn outbox_rules(max_payload: usize) -> DecodeRules {
    let subjects = SubjectRules::under("outbox")
        .and_then(|rules| rules.allow("billing.>"))
        .expect("constant subject rules are valid");
    DecodeRules::new(subjects, max_payload)
}

/// Rule sets that differ in every way decoding depends on: a relay's own
/// prefix and allow-list, a writer's permissive default, and a broker with
/// a small `max_payload` so that size refusals are exercised too.
fn rule_sets() -> [DecodeRules; 5] {
    let events = |mode| Some(CloudEvents::new(mode, "/shop/outbox").expect("a valid source"));
    [
        outbox_rules(1 << 20),
        DecodeRules::any_relay(),
        outbox_rules(4096),
        outbox_rules(1 << 20).with_cloudevents(events(ContentMode::Binary)),
        outbox_rules(4096).with_cloudevents(events(ContentMode::Structured)),
    ]
}

/// A value as BSON bytes, so that comparisons see through `NaN != NaN`
/// and tell `-0.0` from `0.0`.
fn bson_bytes(value: &Bson) -> Vec<u8> {
    let mut wrapper = Document::new();
    wrapper.insert("v", value.clone());
    let mut out = Vec::new();
    wrapper
        .to_writer(&mut out)
        .expect("generated values are valid BSON");
    out
}

/// A header no document may set: the relay's own, or one a CloudEvents
/// receiver reads as an attribute.
fn is_reserved(name: &str) -> bool {
    is_relays(name) || outbox_relay::contract::cloudevents::reserved_header(name).is_some()
}

/// A header no document may set under `rules`: the relay's own, and where
/// the attribute rules hold, one a CloudEvents receiver reads.
fn is_reserved_under(rules: &DecodeRules, name: &str) -> bool {
    if rules.holds_attribute_rules() {
        is_reserved(name)
    } else {
        is_relays(name)
    }
}

/// A header the relay sets itself: `Nats-*`, `Outbox-*`.
fn is_relays(name: &str) -> bool {
    header::RESERVED_PREFIXES.iter().any(|prefix| {
        name.get(..prefix.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
    })
}

/// The invariants every accepted message must keep, whatever document it
/// came from.
fn check_accepted(
    rules: &DecodeRules,
    document: &Document,
    message: &OutboxMessage,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        document.get(field::ID),
        Some(&Bson::ObjectId(message.id)),
        "the message id is the document's _id"
    );
    prop_assert_eq!(
        document.get(field::TYPE),
        Some(&Bson::String(message.message_type.clone())),
        "the message type is the document's type"
    );

    let subject = &message.subject;
    prop_assert!(
        rules.subjects.check(subject).is_ok(),
        "accepted subject {:?} fails the subject rules",
        subject
    );
    prop_assert!(
        !subject.starts_with('$'),
        "accepted reserved subject {:?}",
        subject
    );
    // `_INBOX` is reserved as a whole first token (`_INBOXES.x` is an
    // ordinary subject), as NATS's inbox prefix is `_INBOX.`.
    prop_assert_ne!(
        subject.split('.').next(),
        Some("_INBOX"),
        "accepted an inbox subject"
    );

    let mut own = vec![
        (header::MSG_ID.to_owned(), message.id.to_hex()),
        (header::TYPE.to_owned(), message.message_type.clone()),
    ];
    if let Some(Bson::String(correlation_id)) = document.get(field::CORRELATION_ID) {
        own.push((header::CORRELATION_ID.to_owned(), correlation_id.clone()));
    }
    if let Some(Bson::String(key)) = document.get(field::KEY) {
        own.push((header::KEY.to_owned(), key.clone()));
    }
    prop_assert!(
        message.headers.len() >= own.len(),
        "headers {:?} lack the relay's own {:?}",
        message.headers,
        own
    );
    let (first, rest) = message.headers.split_at(own.len());
    prop_assert_eq!(first, own.as_slice(), "the relay's own headers come first");
    for (name, value) in rest {
        if rules.cloudevents.is_some() && name.starts_with("ce-") {
            // An attribute, percent-encoded as the binding requires.
            prop_assert!(
                value
                    .bytes()
                    .all(|b| (0x21..=0x7e).contains(&b) && b != b'"'),
                "attribute {:?} is not encoded: {:?}",
                name,
                value
            );
            continue;
        }
        prop_assert!(
            !is_reserved_under(rules, name),
            "reserved header {:?} after the relay's own",
            name
        );
    }
    if let Some(events) = &rules.cloudevents {
        let read = cloudevents::Event::read(&message.headers, &message.body);
        let event = match read {
            Some(Ok(read)) => read.event,
            other => return Err(TestCaseError::fail(format!("no readable event: {other:?}"))),
        };
        prop_assert_eq!(event.mode, events.mode());
        prop_assert_eq!(event.id, message.id.to_hex());
        prop_assert_eq!(&event.event_type, &message.message_type);
    }
    if let Some(Bson::Document(given)) = document.get(field::HEADERS) {
        for name in given.keys() {
            prop_assert!(
                !is_reserved_under(rules, name),
                "accepted a document that sets reserved header {:?}",
                name
            );
        }
    }
    for (name, value) in &message.headers {
        prop_assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_graphic() && b != b':'),
            "header name {:?} would break the header block",
            name
        );
        prop_assert!(
            !value.contains(['\r', '\n']),
            "header {:?} has a line break in {:?}",
            name,
            value
        );
    }

    prop_assert!(
        message.wire_size() <= rules.max_payload,
        "{} bytes on the wire, over max_payload {}",
        message.wire_size(),
        rules.max_payload
    );
    Ok(())
}

/// Decodes under every rule set and checks what holds for any document:
/// decoding returns, a refusal says why, the relay's bookkeeping fields
/// come back as stored, and an accepted message keeps the invariants.
fn check_any_document(document: &Document) -> Result<(), TestCaseError> {
    for rules in rule_sets() {
        let decoded = rules.decode(document);

        let expected_id = document.get(field::ID).cloned().unwrap_or(Bson::Null);
        prop_assert_eq!(bson_bytes(&decoded.id), bson_bytes(&expected_id));
        prop_assert_eq!(
            decoded.attempts.as_ref().map(bson_bytes),
            document.get(field::ATTEMPTS).map(bson_bytes),
            "attempts must come back exactly as stored"
        );
        let made = decoded.attempts_made();
        let counted = match &decoded.attempts {
            Some(Bson::Int32(n)) => u32::try_from(*n).ok(),
            Some(Bson::Int64(n)) => u32::try_from(*n).ok(),
            _ => None,
        };
        prop_assert_eq!(made, counted.unwrap_or(0));

        match &decoded.message {
            Ok(message) => check_accepted(&rules, document, message)?,
            Err(violation) => prop_assert!(
                !violation.to_string().trim().is_empty(),
                "a refusal without a reason"
            ),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Writer inputs
// ---------------------------------------------------------------------------

/// What a `NewMessage` is built from, kept so that the decoded message can
/// be compared with it.
#[derive(Debug, Clone)]
struct Input {
    message_type: String,
    payload: Payload,
    correlation_id: Option<String>,
    key: Option<String>,
    headers: BTreeMap<String, String>,
    subject: Option<String>,
}

/// The parts of an [`Input`], in field order, as strategies produce them.
type Parts = (
    String,
    Payload,
    Option<String>,
    Option<String>,
    BTreeMap<String, String>,
    Option<String>,
);

impl From<Parts> for Input {
    fn from((message_type, payload, correlation_id, key, headers, subject): Parts) -> Self {
        Input {
            message_type,
            payload,
            correlation_id,
            key,
            headers,
            subject,
        }
    }
}

impl Input {
    fn build(&self) -> NewMessage {
        let mut message = NewMessage::new(self.message_type.clone(), self.payload.clone());
        if let Some(correlation_id) = &self.correlation_id {
            message = message.correlation_id(correlation_id.clone());
        }
        if let Some(key) = &self.key {
            message = message.key(key.clone());
        }
        for (name, value) in &self.headers {
            message = message.header(name.clone(), value.clone());
        }
        if let Some(subject) = &self.subject {
            message = message.subject(subject.clone());
        }
        message
    }

    fn document(&self, id: ObjectId) -> Document {
        self.build()
            .into_document(id, DateTime::from_millis(1_700_000_000_000))
    }
}

fn tokens() -> impl Strategy<Value = String> {
    proptest::collection::vec("[a-z][a-z0-9_-]{0,10}", 1..=4).prop_map(|tokens| tokens.join("."))
}

fn line_text(max_chars: usize) -> impl Strategy<Value = String> {
    odd_string(max_chars).prop_map(|text| text.replace(['\r', '\n'], ""))
}

/// Text that may be a CloudEvents attribute: no control character, as a
/// key and a header that is an extension must be.
fn attribute_text(max_chars: usize) -> impl Strategy<Value = String> {
    odd_string(max_chars).prop_map(|text| {
        text.chars()
            .filter(|c| !outbox_relay::contract::cloudevents::has_control(&c.to_string()))
            .collect()
    })
}

fn valid_payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        document_of(any_bson(), 6).prop_map(Payload::Document),
        prop_oneof![
            4 => proptest::collection::vec(any::<u8>(), 0..=256),
            1 => (0usize..=HUGE).prop_map(|n| vec![0x5a; n]),
        ]
        .prop_map(Payload::Bytes),
        prop_oneof![
            4 => odd_string(256),
            1 => huge_string(),
        ]
        .prop_map(Payload::Text),
    ]
}

fn valid_header_name() -> impl Strategy<Value = String> {
    "[A-Za-z][A-Za-z0-9-]{0,15}".prop_filter("reserved or Content-Type", |name| {
        !is_reserved(name) && !name.eq_ignore_ascii_case(header::CONTENT_TYPE)
    })
}

/// Input the writer must accept: the contract's well-formed shapes.
fn valid_input() -> impl Strategy<Value = Input> {
    (
        tokens(),
        valid_payload(),
        proptest::option::of(line_text(40)),
        proptest::option::of(attribute_text(40)),
        proptest::collection::btree_map(valid_header_name(), attribute_text(40), 0..=4),
        proptest::option::of(tokens().prop_map(|tokens| format!("outbox.{tokens}"))),
    )
        .prop_map(Input::from)
}

/// Text an application might pass, by mistake or on purpose.
fn hostile_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => pick(&[
            "$JS.API.X", "$JS.API.STREAM.DELETE.ORDERS", "_INBOX.x", "_INBOX", "_INBOXES.x",
            "Nats-Expected-Last-Sequence", "Nats-Msg-Id", "nats-rollup", "Outbox-Type",
            "Content-Type", "outbox.>", "outbox.*", "outbox.a", "outbox.a.b", "billing.x",
            ">", "*", "a b", "a\tb", "line\r\nbreak", "\n", "\r", "", " ", ".", "a..b",
            "order.placed", "é", "a:b", "\u{85}", "\u{2028}",
        ]),
        2 => "[a-zA-Z0-9$_>*. :-]{0,20}",
        2 => odd_string(32),
        1 => (0usize..=700).prop_map(|n| "a".repeat(n)),
        1 => huge_string(),
    ]
}

fn any_payload() -> impl Strategy<Value = Payload> {
    prop_oneof![
        document_of(any_bson(), 6).prop_map(Payload::Document),
        proptest::collection::vec(any::<u8>(), 0..=256).prop_map(Payload::Bytes),
        hostile_text().prop_map(Payload::Text),
    ]
}

/// Input with no guarantees at all; header names are still BSON keys, so
/// they carry no NUL.
fn any_input() -> impl Strategy<Value = Input> {
    (
        hostile_text(),
        any_payload(),
        proptest::option::of(hostile_text()),
        proptest::option::of(hostile_text()),
        proptest::collection::btree_map(
            hostile_text().prop_map(without_nul),
            hostile_text(),
            0..=4,
        ),
        proptest::option::of(prop_oneof![hostile_text(), subject_text()]),
    )
        .prop_map(Input::from)
}

fn header_value_of<'a>(message: &'a OutboxMessage, name: &str) -> Option<&'a str> {
    message
        .headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, value)| value.as_str())
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    /// Property 1: no document panics the decoder; a refusal has a reason;
    /// `_id` and `attempts` come back as stored; `attempts_made` is total.
    #[test]
    fn any_document_decodes_without_panic(document in outbox_document()) {
        // The generator must only make documents MongoDB could hold.
        let mut raw = Vec::new();
        document.to_writer(&mut raw).expect("generated documents are valid BSON");
        check_any_document(&document)?;
    }

    /// Property 2: an accepted message keeps the contract's invariants.
    /// Checked on every accepted document of property 1's kind, and on a
    /// valid document with one field replaced by something generated, so
    /// that most cases here are accepted ones.
    #[test]
    fn accepted_messages_keep_the_invariants(
        input in valid_input(),
        replaced in proptest::option::of((
            proptest::sample::select(vec![
                field::TYPE, field::PAYLOAD, field::SUBJECT, field::HEADERS, field::KEY,
                field::CORRELATION_ID, field::ATTEMPTS,
            ]),
            prop_oneof![
                type_text().prop_map(Bson::String),
                subject_text().prop_map(Bson::String),
                headers_value(),
                payload_value(),
                header_value(),
            ],
        )),
    ) {
        let mut document = input.document(ObjectId::new());
        if let Some((name, value)) = replaced {
            document.insert(name, value);
        }
        for rules in rule_sets() {
            if let Ok(message) = rules.decode(&document).message {
                check_accepted(&rules, &document, &message)?;
            }
        }
    }

    /// Property 3: what the writer builds from valid input decodes, and the
    /// message gives back what was put in.
    #[test]
    fn valid_writer_messages_round_trip(input in valid_input()) {
        let id = ObjectId::new();
        let document = input.document(id);
        let rules = DecodeRules::new(
            SubjectRules::under("outbox").expect("a constant prefix is valid"),
            1 << 20,
        );
        let message = match rules.decode(&document).message {
            Ok(message) => message,
            Err(violation) => {
                return Err(TestCaseError::fail(format!("valid input refused: {violation}")));
            }
        };
        check_accepted(&rules, &document, &message)?;

        prop_assert_eq!(message.id, id);
        prop_assert_eq!(&message.message_type, &input.message_type);
        let expected_subject = input
            .subject
            .clone()
            .unwrap_or_else(|| format!("outbox.{}", input.message_type));
        prop_assert_eq!(&message.subject, &expected_subject);

        let content_type = match &input.payload {
            Payload::Bytes(bytes) => {
                prop_assert_eq!(message.body.as_ref(), bytes.as_slice());
                "application/octet-stream"
            }
            Payload::Text(text) => {
                prop_assert_eq!(message.body.as_ref(), text.as_bytes());
                "text/plain; charset=utf-8"
            }
            Payload::Document(payload) => {
                let actual: Value = serde_json::from_slice(&message.body)
                    .expect("a document payload is sent as JSON");
                // serde_json parses floats on a fast path that may land a
                // ULP or two off (its `float_roundtrip` feature is off here),
                // so the expected JSON goes through the same parser rather
                // than being compared in memory.
                let expected = Bson::Document(payload.clone()).into_relaxed_extjson();
                let expected = serde_json::to_vec(&expected)
                    .and_then(|text| serde_json::from_slice::<Value>(&text))
                    .expect("relaxed Extended JSON is JSON");
                prop_assert_eq!(&actual, &expected, "the body is not the payload");
                "application/json"
            }
        };
        prop_assert_eq!(header_value_of(&message, header::CONTENT_TYPE), Some(content_type));
        prop_assert_eq!(
            header_value_of(&message, header::KEY),
            input.key.as_deref()
        );
        prop_assert_eq!(
            header_value_of(&message, header::CORRELATION_ID),
            input.correlation_id.as_deref()
        );
        for (name, value) in &input.headers {
            prop_assert!(
                message.headers.contains(&(name.clone(), value.clone())),
                "header {:?}: {:?} missing from {:?}",
                name,
                value,
                message.headers
            );
        }
    }

    /// Property 4: for any input, the writer's check and the relay's decode
    /// agree. Decoding is deterministic (the writer decodes once, the relay
    /// again later, possibly more than once); a refusal has a reason; what
    /// a relay sending events accepts, the writer's default rules accept
    /// too (a relay sending none holds fewer rules than a writer does).
    #[test]
    fn writer_and_relay_agree(input in any_input()) {
        let document = input.document(ObjectId::new());
        let plain = outbox_rules(1 << 20);
        let relay = outbox_rules(1 << 20)
            .with_cloudevents(Some(CloudEvents::new(ContentMode::Binary, "/s").expect("a valid source")));
        let writer = DecodeRules::any_relay();
        for rules in [&plain, &relay, &writer] {
            let first = rules.decode(&document).message;
            let second = rules.decode(&document).message;
            prop_assert_eq!(&first, &second, "decoding the same document twice differs");
            match &first {
                Ok(message) => check_accepted(rules, &document, message)?,
                Err(violation) => prop_assert!(
                    !violation.to_string().trim().is_empty(),
                    "a refusal without a reason"
                ),
            }
        }
        if relay.decode(&document).message.is_ok() {
            prop_assert!(
                writer.decode(&document).message.is_ok(),
                "the writer's default rules refuse what a relay accepts"
            );
        }
    }
}

/// The generators must reach both outcomes, or properties 2 and 4 would
/// pass without checking an accepted message. A fixed seed keeps this
/// from depending on luck.
#[test]
fn generators_reach_accepted_and_refused_documents() {
    fn outcomes<T: std::fmt::Debug>(
        strategy: impl Strategy<Value = T>,
        to_document: impl Fn(T) -> Document,
    ) -> (usize, usize) {
        let mut runner =
            TestRunner::new_with_rng(config(), TestRng::deterministic_rng(RngAlgorithm::XorShift));
        let rules = outbox_rules(1 << 20);
        let mut accepted = 0;
        let mut refused = 0;
        for _ in 0..200 {
            let value = strategy
                .new_tree(&mut runner)
                .expect("the generators never give up")
                .current();
            match rules.decode(&to_document(value)).message {
                Ok(_) => accepted += 1,
                Err(_) => refused += 1,
            }
        }
        (accepted, refused)
    }

    let (accepted, refused) = outcomes(outbox_document(), |document| document);
    assert!(
        accepted >= 5 && refused >= 5,
        "arbitrary documents: {accepted} accepted, {refused} refused"
    );
    let (accepted, refused) = outcomes(any_input(), |input| input.document(ObjectId::new()));
    assert!(
        accepted >= 5 && refused >= 5,
        "arbitrary writer input: {accepted} accepted, {refused} refused"
    );
}
