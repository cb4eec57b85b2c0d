//! One contract, three enforcers: the writer, the relay's decoder and the
//! `--install-validator` schema must give every document the same verdict,
//! or a message one accepts is a dead letter for another.

use crate::common::TestEnv;
use bson::{doc, oid::ObjectId, Bson, DateTime, Document};
use mongodb::Collection;
use outbox_relay::contract::{
    field, key_hash, CloudEvents, ContentMode, DecodeRules, SubjectRules, SubjectTemplate,
};
use outbox_relay::{Error, NewMessage, Outbox, Payload};

fn message(message_type: &str) -> NewMessage {
    NewMessage::new(message_type, Payload::Document(doc! { "n": 1 }))
}

/// Documents, each with whether the contract accepts it.
fn table(prefix: &str) -> Vec<(String, NewMessage, bool)> {
    let long = "a".repeat(600);
    let longest_type = "t".repeat(512 - prefix.len() - 1);
    let rows = [
        ("a plain message", message("order.placed"), true),
        (
            "an explicit subject under the prefix",
            message("t").subject(format!("{prefix}.x.y")),
            true,
        ),
        (
            "an allowed subject",
            message("t").subject("billing.invoice"),
            true,
        ),
        (
            "a matching allowed pattern",
            message("t").subject("audit.eu.events"),
            true,
        ),
        (
            "headers of its own",
            message("t")
                .header("traceparent", "00-1-2-01")
                .header("Content-Type", "text/csv"),
            true,
        ),
        (
            "a key and a correlation id",
            message("t").key("ключ-7").correlation_id("c-1"),
            true,
        ),
        ("the longest type", message(&longest_type), true),
        (
            "a text payload",
            NewMessage::new("t", Payload::Text("é".into())),
            true,
        ),
        ("an empty type", message(""), false),
        ("a type with a space", message("order placed"), false),
        ("a type with a wildcard", message("order.*"), false),
        (
            "a type with a control character",
            message("order\u{7}"),
            false,
        ),
        (
            "a type one character too long",
            message(&format!("{longest_type}t")),
            false,
        ),
        ("a type ending in a line break", message("t\n"), false),
        (
            "a subject ending in a line break",
            message("t").subject(format!("{prefix}.a\n")),
            false,
        ),
        (
            "a header value ending in a line break",
            message("t").header("x", "a\n"),
            false,
        ),
        (
            "a key ending in a line break",
            message("t").key("k\n"),
            false,
        ),
        (
            "a bad type beside a good subject",
            message("a b").subject(format!("{prefix}.x")),
            false,
        ),
        (
            "a subject deleting a stream",
            message("t").subject("$JS.API.STREAM.DELETE.ORDERS"),
            false,
        ),
        (
            "a key-value subject",
            message("t").subject("$KV.bucket.key"),
            false,
        ),
        (
            "another client's inbox",
            message("t").subject("_INBOX.abc.1"),
            false,
        ),
        (
            "a subject outside the allow-list",
            message("t").subject("payroll.run"),
            false,
        ),
        (
            "a subject too long",
            message("t").subject(format!("{prefix}.{long}")),
            false,
        ),
        (
            "a subject with an empty token",
            message("t").subject(format!("{prefix}..x")),
            false,
        ),
        (
            "a subject that is only the prefix",
            message("t").subject(prefix),
            false,
        ),
        (
            "a JetStream control header",
            message("t").header("Nats-Expected-Last-Sequence", "1"),
            false,
        ),
        (
            "the message id header",
            message("t").header("nats-msg-id", "x"),
            false,
        ),
        (
            "a relay header",
            message("t").header("Outbox-Type", "x"),
            false,
        ),
        (
            "a header name with a space",
            message("t").header("bad name", "x"),
            false,
        ),
        (
            "a header name with a colon",
            message("t").header("a:b", "x"),
            false,
        ),
        (
            "a header value with a line break",
            message("t").header("x", "a\r\nb"),
            false,
        ),
        ("a key with a line break", message("t").key("a\nb"), false),
        (
            "a correlation id with a line break",
            message("t").correlation_id("a\rb"),
            false,
        ),
    ];
    rows.into_iter()
        .map(|(what, message, good)| (what.to_owned(), message, good))
        .collect()
}

/// Whether the validator of `validated` takes `document`; any other
/// failure of the insert fails the test.
/// Messages the CloudEvents attribute rules decide: each with whether it
/// is valid where the rules do not hold (a relay not sending events) and
/// where they do.
fn attribute_table() -> Vec<(String, NewMessage, bool, bool)> {
    let rows = [
        (
            "a source",
            message("t").source("urn:shop:orders"),
            true,
            true,
        ),
        (
            "a source path",
            message("t").source("/shop/outbox?x=1#f"),
            true,
            true,
        ),
        (
            "a source with a space",
            message("t").source("a b"),
            true,
            false,
        ),
        (
            "a source beyond ASCII",
            message("t").source("/ü"),
            true,
            false,
        ),
        ("an empty source", message("t").source(""), true, false),
        (
            "a scheme of a digit",
            message("t").source("1a:x"),
            true,
            false,
        ),
        (
            "an extension",
            message("t").extension("tenant", "acme corp"),
            true,
            true,
        ),
        (
            "a ce- header",
            message("t").header("ce-id", "x"),
            true,
            false,
        ),
        (
            "a CE- header",
            message("t").header("CE-Tenant", "x"),
            true,
            false,
        ),
        (
            "a header named source",
            message("t").header("source", "x"),
            true,
            false,
        ),
        (
            "a header named Source",
            message("t").header("Source", "x"),
            true,
            true,
        ),
        (
            "an extension with a tab",
            message("t").header("tenant", "a\tb"),
            true,
            false,
        ),
        (
            "a plain header with a tab",
            message("t").header("X-Tenant", "a\tb"),
            true,
            true,
        ),
        ("a key with a tab", message("t").key("a\tb"), true, false),
        (
            "a key with U+0085",
            message("t").key("a\u{85}"),
            true,
            false,
        ),
        (
            "a key of spaces and wildcards",
            message("t").key(" a.*>%\"ü "),
            true,
            true,
        ),
        (
            "an empty content type",
            message("t").header("Content-Type", ""),
            true,
            false,
        ),
        (
            "a content type of spaces",
            message("t").header("content-type", "  "),
            true,
            false,
        ),
        (
            "a content type with a NUL",
            message("t").header("Content-Type", "a\0"),
            true,
            false,
        ),
        (
            "a content type",
            message("t").header("Content-Type", "text/csv"),
            true,
            true,
        ),
    ];
    rows.into_iter()
        .map(|(what, message, off, events)| (what.to_owned(), message, off, events))
        .collect()
}

async fn validator_takes(
    validated: &Collection<Document>,
    document: &Document,
    what: &str,
) -> bool {
    match validated.insert_one(document).await {
        Ok(_) => true,
        Err(error) => {
            let refused = error.to_string().contains("Document failed validation");
            assert!(refused, "{what}: {error}");
            false
        }
    }
}

#[tokio::test]
async fn the_writer_the_decoder_and_the_validator_agree() {
    let env = TestEnv::new().await;
    let subjects = SubjectRules::under(&env.prefix)
        .and_then(|rules| rules.allow("billing.>"))
        .and_then(|rules| rules.allow("audit.*.events"))
        .expect("valid rules");
    let off = DecodeRules::new(subjects.clone(), usize::MAX);
    let events = off.clone().with_cloudevents(Some(
        CloudEvents::new(ContentMode::Structured, "/shop/outbox").expect("a valid source"),
    ));
    for (name, rules) in [("off", off), ("events", events)] {
        let collection = format!("validated_{name}");
        outbox_relay::setup::install_validator(&env.db, &collection, &rules)
            .await
            .expect("install the validator");
        let validated = env.db.collection::<bson::Document>(&collection);
        let writer = Outbox::with_collection(&env.db, "written").with_rules(rules.clone());
        let sending_events = rules.cloudevents.is_some();
        // The decoder and the validator follow the relay's mode; a writer
        // holds the attribute rules whatever the mode.
        let rows = table(&env.prefix)
            .into_iter()
            .map(|(what, message, good)| (what, message, good, good))
            .chain(
                attribute_table()
                    .into_iter()
                    .map(|(what, message, off, events)| {
                        let here = if sending_events { events } else { off };
                        (what, message, here, events)
                    }),
            );
        for (what, message, good, writable) in rows {
            let what = format!("{name}: {what}");
            let document = message
                .clone()
                .into_document(ObjectId::new(), DateTime::now());
            let decoder = rules.decode(&document).message.is_ok();
            let schema = validator_takes(&validated, &document, &what).await;
            let mut session = env.client.start_session().await.expect("session");
            session.start_transaction().await.expect("transaction");
            let written = match writer.add(&mut session, message).await {
                Ok(_) => true,
                Err(Error::InvalidMessage(_)) => false,
                Err(other) => panic!("{what}: {other}"),
            };
            session.abort_transaction().await.expect("abort");
            assert_eq!(
                (decoder, schema, written),
                (good, good, writable),
                "{what}: decoder, validator (expected {good}) and writer (expected {writable}) \
                 on {document}"
            );
        }
    }
    env.drop().await;
}

/// A writer told no relay's rules holds every document to the attribute
/// rules, as the validator of a relay sending events does: what it lets
/// through, a relay switched to events delivers.
#[tokio::test]
async fn a_writer_without_a_relays_rules_holds_the_attribute_rules() {
    let env = TestEnv::new().await;
    let writer = Outbox::new(&env.db);
    let events = DecodeRules::any_relay().with_cloudevents(Some(
        CloudEvents::new(ContentMode::Binary, "/s").expect("a valid source"),
    ));
    for (what, message, _, valid) in attribute_table() {
        let document = message
            .clone()
            .into_document(ObjectId::new(), DateTime::now());
        let mut session = env.client.start_session().await.expect("session");
        session.start_transaction().await.expect("transaction");
        let written = writer.add(&mut session, message).await.is_ok();
        session.abort_transaction().await.expect("abort");
        assert_eq!(written, valid, "{what}");
        assert_eq!(events.decode(&document).message.is_ok(), valid, "{what}");
    }
    env.drop().await;
}

/// `keyHash` decides no delivery, so the relay delivers a document
/// whatever the field holds; the validator takes only what a writer
/// stores, or the same number as an int, as mongosh stores a small one.
#[tokio::test]
async fn the_validator_takes_a_key_hash_as_stored_and_the_relay_delivers_any() {
    let env = TestEnv::new().await;
    let subjects = SubjectRules::under(&env.prefix).expect("valid rules");
    let rules = DecodeRules::new(subjects.clone(), usize::MAX);
    outbox_relay::setup::install_validator(&env.db, "validated", &rules)
        .await
        .expect("install the validator");
    let validated = env.db.collection::<Document>("validated");
    let rows = [
        ("none", None, true),
        (
            "the key's hash",
            Some(Bson::Int64(key_hash("k").into())),
            true,
        ),
        ("zero", Some(Bson::Int64(0)), true),
        ("the largest", Some(Bson::Int64(u32::MAX.into())), true),
        ("an int", Some(Bson::Int32(7)), true),
        ("a negative long", Some(Bson::Int64(-1)), false),
        ("a negative int", Some(Bson::Int32(-1)), false),
        ("a long past 32 bits", Some(Bson::Int64(1 << 32)), false),
        ("a string", Some(Bson::String("7".into())), false),
        ("a whole double", Some(Bson::Double(7.0)), false),
        ("a fraction", Some(Bson::Double(0.5)), false),
        ("null", Some(Bson::Null), false),
    ];
    for (what, stored, valid) in rows {
        let mut document = message("t")
            .key("k")
            .into_document(ObjectId::new(), DateTime::now());
        match stored {
            Some(stored) => document.insert(field::KEY_HASH, stored),
            None => document.remove(field::KEY_HASH),
        };
        let delivered = rules.decode(&document).message;
        assert!(delivered.is_ok(), "{what}: the relay delivers it");
        let taken = validator_takes(&validated, &document, what).await;
        assert_eq!(taken, valid, "{what}: the validator on {document}");
    }
    env.drop().await;
}

#[tokio::test]
async fn a_writer_without_a_relays_rules_still_refuses_what_every_relay_refuses() {
    let env = TestEnv::new().await;
    let writer = Outbox::new(&env.db);
    let mut session = env.client.start_session().await.expect("session");
    session.start_transaction().await.expect("transaction");
    for message in [
        message("t").subject("$JS.API.STREAM.DELETE.ORDERS"),
        message("t").subject("_INBOX.x"),
        message("t").header("Nats-Rollup", "all"),
    ] {
        let refused = writer.add(&mut session, message).await;
        assert!(
            matches!(refused, Err(Error::InvalidMessage(_))),
            "{refused:?}"
        );
    }
    let accepted = writer
        .add(&mut session, message("t").subject("anywhere.else"))
        .await;
    assert!(accepted.is_ok(), "{accepted:?}");
    session.abort_transaction().await.expect("abort");
    env.drop().await;
}

/// With a template that reads the key and a header, the validator and the
/// relay both refuse a document naming no subject that lacks either; the
/// validator cannot compute the rendered subject's length, so a key too
/// long once escaped passes it and is failed by the relay alone.
#[tokio::test]
async fn with_a_template_the_validator_requires_the_key_and_headers_it_reads() {
    let env = TestEnv::new().await;
    let template =
        SubjectTemplate::parse("{prefix}.{type}.{header.X-Tenant}.{key}").expect("a template");
    let subjects = SubjectRules::under(&env.prefix)
        .and_then(|rules| rules.with_template(template))
        .expect("valid rules");
    let rules = DecodeRules::new(subjects.clone(), usize::MAX);
    outbox_relay::setup::install_validator(&env.db, "validated", &rules)
        .await
        .expect("install the validator");
    let validated = env.db.collection::<Document>("validated");
    let tenant = |message: NewMessage| message.header("X-Tenant", "acme");
    let rows = [
        (
            "key and header",
            tenant(message("t").key("o-1")),
            true,
            true,
        ),
        ("no key", tenant(message("t")), false, false),
        ("an empty key", tenant(message("t").key("")), false, false),
        ("no header", message("t").key("o-1"), false, false),
        (
            "an empty header",
            message("t").key("o-1").header("X-Tenant", ""),
            false,
            false,
        ),
        (
            "a subject of its own",
            message("t").subject(format!("{}.x", env.prefix)),
            true,
            true,
        ),
        (
            "a key too long once escaped",
            tenant(message("t").key("é".repeat(100))),
            false,
            true,
        ),
    ];
    for (what, message, decoded, taken) in rows {
        let document = message.into_document(ObjectId::new(), DateTime::now());
        let decoder = rules.decode(&document).message.is_ok();
        let schema = validator_takes(&validated, &document, what).await;
        assert_eq!(
            (decoder, schema),
            (decoded, taken),
            "{what}: decoder and validator on {document}"
        );
    }
    env.drop().await;
}
