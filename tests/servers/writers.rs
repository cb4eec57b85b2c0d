//! The writers in other languages (`examples/writers/`): one table of
//! cases (`tests/writers/cases.json`) written by the Rust, Python and
//! Node.js writers. Each valid case arrives from all three with the same
//! subject, headers and body, and is stored with the same `keyHash` and
//! `source`; each invalid one is refused by all three for the same rule;
//! none of them writes outside a transaction.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;

use base64::Engine;
use bson::{doc, oid::ObjectId, Bson, Document};
use outbox_relay::contract::cloudevents::is_attribute_name;
use outbox_relay::contract::{
    field, key_hash, subject_token, DecodeRules, SubjectRules, SubjectTemplate,
};
use outbox_relay::{Error, NewMessage, Outbox, Payload};
use serde::Deserialize;

use crate::common::*;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Table {
    cases: Vec<Case>,
    key_hashes: Vec<KeyHash>,
}

/// A key and its hash, which every writer's hash function is held to.
#[derive(Debug, Deserialize)]
struct KeyHash {
    key: String,
    hash: u32,
}

/// One case: a message's fields as a writer is handed them, any of them
/// possibly of the wrong type, and the rule it breaks, if any.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Case {
    name: String,
    #[serde(rename = "type")]
    message_type: Option<Bson>,
    payload: Option<CasePayload>,
    key: Option<Bson>,
    correlation_id: Option<Bson>,
    headers: Option<Bson>,
    subject: Option<Bson>,
    /// The CloudEvents source.
    source: Option<Bson>,
    /// CloudEvents extension attributes: headers, each overriding a header
    /// of its name.
    extensions: Option<Bson>,
    refused: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum CasePayload {
    Document(Document),
    Text(String),
    /// Base64.
    Bytes(String),
    /// Any other value, which no writer may accept.
    Other(Bson),
}

/// What a writer did with one case.
#[derive(Debug, Deserialize, PartialEq)]
struct Outcome {
    name: String,
    id: Option<String>,
    refused: Option<String>,
    /// For a case of the writer's own language's values (`native: ...`),
    /// the rule it breaks.
    expected: Option<String>,
}

/// The table with the test's subject prefix put in, as text and read.
fn table(prefix: &str) -> (String, Table) {
    let path = manifest_dir().join("tests/writers/cases.json");
    let text = std::fs::read_to_string(&path).expect("the case table");
    let text = text.replace("{prefix}", prefix);
    let table: Table = serde_json::from_str(&text).expect("a valid case table");
    (text, table)
}

fn string(value: &Option<Bson>) -> Option<Option<String>> {
    match value {
        None => Some(None),
        Some(Bson::String(text)) => Some(Some(text.clone())),
        Some(_) => None,
    }
}

/// A payload of a kind the Rust writer takes.
fn typed_payload(payload: &CasePayload) -> Option<Payload> {
    Some(match payload {
        CasePayload::Document(document) => Payload::Document(document.clone()),
        CasePayload::Text(text) => Payload::Text(text.clone()),
        CasePayload::Bytes(bytes) => Payload::Bytes(
            base64::engine::general_purpose::STANDARD
                .decode(bytes)
                .expect("base64"),
        ),
        CasePayload::Other(_) => return None,
    })
}

/// The case as the Rust writer's typed API, where it can say it: a value
/// of the wrong type cannot be handed to it.
fn new_message(case: &Case) -> Option<NewMessage> {
    let payload = typed_payload(case.payload.as_ref()?)?;
    let mut message = NewMessage::new(string(&case.message_type)??, payload);
    if let Some(key) = string(&case.key)? {
        message = message.key(key);
    }
    if let Some(correlation_id) = string(&case.correlation_id)? {
        message = message.correlation_id(correlation_id);
    }
    if let Some(subject) = string(&case.subject)? {
        message = message.subject(subject);
    }
    if let Some(source) = string(&case.source)? {
        message = message.source(source);
    }
    match &case.headers {
        None => {}
        Some(Bson::Document(headers)) => {
            for (name, value) in headers {
                message = message.header(name, value.as_str()?);
            }
        }
        Some(_) => return None,
    }
    // After the headers, so that an extension overrides a header of its
    // name, as in the other writers.
    match &case.extensions {
        None => {}
        Some(Bson::Document(extensions)) => {
            for (name, value) in extensions {
                message = message.extension(name, value.as_str()?);
            }
        }
        Some(_) => return None,
    }
    Some(message)
}

/// The headers a writer without types stores: the case's, with its
/// extensions added. Headers that are no document stay as they are, to be
/// refused as such.
fn untyped_headers(case: &Case) -> Option<Bson> {
    match (&case.headers, &case.extensions) {
        (headers, None) => headers.clone(),
        (None, Some(extensions)) => Some(extensions.clone()),
        (Some(Bson::Document(headers)), Some(Bson::Document(extensions))) => {
            let mut merged = headers.clone();
            for (name, value) in extensions {
                merged.insert(name, value.clone());
            }
            Some(Bson::Document(merged))
        }
        (Some(headers), Some(_)) => Some(headers.clone()),
    }
}

/// The document a writer in a language without types could hand over.
fn untyped_document(case: &Case) -> Document {
    let mut document = doc! { "_id": ObjectId::new(), "status": "pending" };
    let payload = case.payload.as_ref().map(|payload| match payload {
        CasePayload::Other(value) => value.clone(),
        known => Bson::from(typed_payload(known).expect("a known kind")),
    });
    let fields = [
        ("type", case.message_type.clone()),
        ("payload", payload),
        ("key", case.key.clone()),
        ("correlationId", case.correlation_id.clone()),
        ("headers", untyped_headers(case)),
        ("subject", case.subject.clone()),
        ("source", case.source.clone()),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            document.insert(name, value);
        }
    }
    document
}

/// Each case through the Rust writer, in a transaction of its own; a case
/// its types cannot express is decoded as the relay decodes a document.
async fn write_in_rust(env: &TestEnv, cases: &[Case]) -> Vec<Outcome> {
    let outbox = Outbox::new(&env.db);
    let mut outcomes = Vec::new();
    for case in cases {
        let (id, refused) = match new_message(case) {
            Some(message) => {
                let mut session = env.client.start_session().await.expect("session");
                session.start_transaction().await.expect("transaction");
                match outbox.add(&mut session, message).await {
                    Ok(id) => {
                        session.commit_transaction().await.expect("commit");
                        (Some(id.to_hex()), None)
                    }
                    Err(Error::InvalidMessage(violation)) => {
                        (None, Some(violation.rule().to_string()))
                    }
                    Err(other) => panic!("{}: {other}", case.name),
                }
            }
            None => {
                // The document holds extensions as mere headers: only the
                // typed API can refuse one for its name.
                if let Some(Bson::Document(extensions)) = &case.extensions {
                    assert!(
                        extensions.keys().all(|name| is_attribute_name(name)),
                        "{}: a case with an extension that is no attribute name must be one \
                         the typed API can express",
                        case.name
                    );
                }
                let decoded = DecodeRules::any_relay().decode(&untyped_document(case));
                let violation = decoded.message.expect_err("an untyped case is refused");
                (None, Some(violation.rule().to_string()))
            }
        };
        outcomes.push(Outcome {
            name: case.name.clone(),
            id,
            refused,
            expected: None,
        });
    }
    let mut session = env.client.start_session().await.expect("session");
    let outside = outbox
        .add(&mut session, new_message(&cases[0]).expect("a typed case"))
        .await;
    assert!(
        matches!(outside, Err(Error::NoTransaction)),
        "the Rust writer refuses to write outside a transaction: {outside:?}"
    );
    outcomes
}

/// Runs a writer's conformance script on the table; its outcomes, the
/// last of them its call outside a transaction.
async fn write_with(program: PathBuf, script: &str, env: &TestEnv, text: &str) -> Vec<Outcome> {
    let args = [env.mongodb_uri.as_str(), env.name.as_str()];
    let lines = run_script(program, script, &args, &env.name, text).await;
    lines
        .iter()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}")))
        .collect()
}

/// Runs a writer's conformance script with `args`, `text` on its input;
/// the lines it printed.
async fn run_script(
    program: PathBuf,
    script: &str,
    args: &[&str],
    run: &str,
    text: &str,
) -> Vec<String> {
    let input = std::env::temp_dir().join(format!("{run}-{script}.json"));
    std::fs::write(&input, text).expect("write the table");
    let mut command = Command::new(&program);
    command
        .arg(manifest_dir().join("tests/writers").join(script))
        .args(args)
        .stdin(std::fs::File::open(&input).expect("the table"));
    let output = bounded(command).await;
    let _ = std::fs::remove_file(&input);
    assert!(
        output.status.success(),
        "{} {script} failed (scripts/test.sh installs what the writers need):\n{}",
        program.display(),
        output_text(&output)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// What a stream message carries that a writer decides: its subject, its
/// headers but the message id, and its body.
type Delivered = (String, BTreeMap<String, Vec<String>>, Vec<u8>);

async fn delivered_by_id(env: &TestEnv) -> HashMap<String, Delivered> {
    let mut stream = env.jetstream.get_stream(&env.stream).await.expect("stream");
    let mut by_id = HashMap::new();
    for message in stream_messages(&mut stream).await {
        let id = stored_header(&message, "Nats-Msg-Id").expect("a message id");
        let headers = message
            .headers
            .iter()
            .filter(|(name, _)| name.to_string() != "Nats-Msg-Id")
            .map(|(name, values)| {
                let values = values.iter().map(|v| v.as_str().to_owned()).collect();
                (name.to_string(), values)
            })
            .collect();
        let delivered = (
            message.subject.to_string(),
            headers,
            message.payload.to_vec(),
        );
        assert!(
            by_id.insert(id, delivered).is_none(),
            "a message stored twice"
        );
    }
    by_id
}

/// A field of the document a writer wrote for a case.
async fn stored_field(env: &TestEnv, outcome: &Outcome, name: &str) -> Option<Bson> {
    let id = ObjectId::parse_str(outcome.id.as_ref().expect("written")).expect("an ObjectId");
    let document = env
        .outbox()
        .find_one(doc! { "_id": id })
        .await
        .expect("find")
        .expect("the written document");
    document.get(name).cloned()
}

/// Checks the `keyHash` of every document a writer wrote: an int64, the
/// table's hash of its key (`key_hash`'s for a key the table lacks), and
/// for keyless documents a value within 32 bits, not one for all of them.
async fn check_key_hashes(env: &TestEnv, writer: &str, outcomes: &[Outcome], table: &Table) {
    let vectors: HashMap<&str, u32> = table
        .key_hashes
        .iter()
        .map(|vector| (vector.key.as_str(), vector.hash))
        .collect();
    let mut keyless = HashSet::new();
    for outcome in outcomes {
        let Some(id) = &outcome.id else { continue };
        let id = ObjectId::parse_str(id).expect("an ObjectId");
        let document = env
            .outbox()
            .find_one(doc! { "_id": id })
            .await
            .expect("find");
        let document = document.expect("the written document");
        let what = format!("{writer}, {}", outcome.name);
        let stored = match document.get(field::KEY_HASH) {
            Some(Bson::Int64(hash)) => *hash,
            other => panic!("{what}: keyHash {other:?} is not an int64"),
        };
        match document.get(field::KEY) {
            Some(Bson::String(key)) => {
                let hash = vectors.get(key.as_str()).copied();
                let hash = hash.unwrap_or_else(|| key_hash(key));
                assert_eq!(stored, i64::from(hash), "{what}: the hash of {key:?}");
            }
            None => {
                assert!((0..1 << 32).contains(&stored), "{what}: {stored}");
                keyless.insert(stored);
            }
            Some(other) => panic!("{what}: a key {other:?} written"),
        }
    }
    assert!(
        keyless.len() > 1,
        "{writer}: keyless messages spread, not one keyHash for all: {keyless:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn python_and_node_writers_deliver_and_refuse_as_the_rust_writer_does() {
    let env = TestEnv::new().await;
    let (text, table) = table(&env.prefix);
    let cases = &table.cases;
    let valid = cases.iter().filter(|case| case.refused.is_none()).count();
    assert!(valid >= 5 && cases.len() > valid + 20, "a table that tests");
    let relay = RunningRelay::start(env.config()).await;

    let rust = write_in_rust(&env, cases).await;
    let python = write_with(python(), "conformance.py", &env, &text).await;
    let node = write_with("node".into(), "conformance.mjs", &env, &text).await;

    for (writer, outcomes) in [("Python", &python), ("Node.js", &node)] {
        let (last, outcomes) = outcomes.split_last().expect("outcomes");
        assert_eq!(
            last.refused.as_deref(),
            Some("no_transaction"),
            "{writer} refuses to write outside a transaction"
        );
        let (outcomes, native) = outcomes.split_at(cases.len().min(outcomes.len()));
        assert_eq!(outcomes.len(), cases.len(), "{writer}: one outcome a case");
        assert!(native.len() >= 5, "{writer}: its own values tried");
        for case in native {
            assert!(case.name.starts_with("native: "), "{writer}: {}", case.name);
            assert_eq!(
                case.refused, case.expected,
                "{writer}, {}: refused for the rule the relay names",
                case.name
            );
        }
        for ((case, theirs), ours) in cases.iter().zip(outcomes).zip(&rust) {
            assert_eq!(theirs.name, case.name);
            assert_eq!(
                ours.refused, case.refused,
                "{}: the Rust writer's rule",
                case.name
            );
            assert_eq!(
                theirs.refused, case.refused,
                "{writer}, {}: refused for the rule the Rust writer names",
                case.name
            );
        }
    }

    wait_until("every valid case delivered by all three", || async {
        env.stream_count().await == 3 * valid as u64
    })
    .await;
    let delivered = delivered_by_id(&env).await;
    let arrived = |outcome: &Outcome| {
        let id = outcome.id.as_ref().expect("written");
        delivered.get(id).expect("delivered").clone()
    };
    for (n, case) in cases.iter().enumerate() {
        if case.refused.is_some() {
            continue;
        }
        let expected = arrived(&rust[n]);
        assert_eq!(arrived(&python[n]), expected, "Python, {}", case.name);
        assert_eq!(arrived(&node[n]), expected, "Node.js, {}", case.name);
        // A relay that sends no CloudEvents leaves the source off the
        // wire: it is compared as stored.
        for (writer, outcome) in [
            ("Rust", &rust[n]),
            ("Python", &python[n]),
            ("Node.js", &node[n]),
        ] {
            assert_eq!(
                stored_field(&env, outcome, field::SOURCE).await,
                case.source,
                "{writer}, {}: the source stored",
                case.name
            );
        }
    }
    assert_eq!(
        env.count(doc! {}).await,
        3 * valid as u64,
        "a refused message is never written"
    );
    for (writer, outcomes) in [("Rust", &rust), ("Python", &python), ("Node.js", &node)] {
        check_key_hashes(&env, writer, outcomes, &table).await;
    }
    relay.stop().await.expect("relay stops");
    env.drop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn each_order_script_commits_an_order_with_its_message() {
    let env = TestEnv::new().await;
    let relay = RunningRelay::start(env.config()).await;
    let scripts = [
        (
            python(),
            "examples/writers/python/place_order.py",
            "order-py",
        ),
        (
            "node".into(),
            "examples/writers/node/place-order.js",
            "order-js",
        ),
    ];
    for (program, script, order) in scripts {
        let mut command = Command::new(program);
        command.arg(manifest_dir().join(script)).args([
            env.mongodb_uri.as_str(),
            env.name.as_str(),
            order,
        ]);
        let output = bounded(command).await;
        assert!(
            output.status.success(),
            "{script}: {}",
            output_text(&output)
        );
        let id = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        wait_until("the order's message delivered", || async {
            delivered_by_id(&env).await.contains_key(&id)
        })
        .await;
        let (subject, headers, body) = delivered_by_id(&env).await.remove(&id).expect("it");
        assert_eq!(subject, format!("{}.order.placed", env.prefix), "{script}");
        assert_eq!(headers.get("Outbox-Key"), Some(&vec![order.to_owned()]));
        let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(body, serde_json::json!({ "orderId": order, "total": 42 }));
        let orders = env.db.collection::<Document>("orders");
        let stored = orders.find_one(doc! { "_id": order }).await.expect("find");
        assert!(stored.is_some(), "{script}: the order committed with it");
    }
    relay.stop().await.expect("relay stops");
    env.drop().await;
}

/// The subject-template cases (`tests/writers/templates.json`): what each
/// writer checks before it writes, against what the relay decides.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Templates {
    prefix: String,
    tokens: Vec<TokenVector>,
    cases: Vec<TemplateCase>,
    bad_templates: Vec<String>,
}

#[derive(Debug, Deserialize, PartialEq)]
struct TokenVector {
    value: String,
    token: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TemplateCase {
    name: String,
    template: String,
    #[serde(rename = "type")]
    message_type: String,
    key: Option<Bson>,
    headers: Option<Document>,
    own_subject: Option<String>,
    /// The subject it goes to, or the rule it breaks.
    subject: Option<String>,
    refused: Option<String>,
}

/// A template case's outcome, as a writer reports it.
#[derive(Debug, Deserialize, PartialEq)]
struct Rendered {
    name: String,
    subject: Option<String>,
    refused: Option<String>,
}

/// What the relay makes of a template case: its subject, or the rule.
fn relay_renders(prefix: &str, case: &TemplateCase) -> Rendered {
    let template = SubjectTemplate::parse(&case.template).expect("a template");
    let rules = SubjectRules::under(prefix)
        .and_then(|rules| rules.allow(">"))
        .and_then(|rules| rules.with_template(template))
        .expect("rules");
    let mut document = doc! {
        "_id": ObjectId::new(), "type": &case.message_type, "payload": {}, "status": "pending",
    };
    let fields = [
        ("key", case.key.clone()),
        ("headers", case.headers.clone().map(Bson::Document)),
        ("subject", case.own_subject.clone().map(Bson::String)),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            document.insert(name, value);
        }
    }
    let decoded = DecodeRules::new(rules, usize::MAX).decode(&document);
    let (subject, refused) = match decoded.message {
        Ok(message) => (Some(message.subject), None),
        Err(violation) => (None, Some(violation.rule().to_string())),
    };
    Rendered {
        name: case.name.clone(),
        subject,
        refused,
    }
}

#[tokio::test]
async fn writers_render_and_refuse_template_subjects_as_the_relay_does() {
    let path = manifest_dir().join("tests/writers/templates.json");
    let text = std::fs::read_to_string(&path).expect("the template table");
    let table: Templates = serde_json::from_str(&text).expect("a valid template table");
    assert!(
        table
            .cases
            .iter()
            .filter(|case| case.refused.is_some())
            .count()
            >= 8,
        "a table that tests"
    );
    for case in &table.cases {
        let expected = Rendered {
            name: case.name.clone(),
            subject: case.subject.clone(),
            refused: case.refused.clone(),
        };
        assert_eq!(relay_renders(&table.prefix, case), expected, "the relay");
    }
    for vector in &table.tokens {
        assert_eq!(subject_token(&vector.value), vector.token, "{vector:?}");
    }
    for template in &table.bad_templates {
        assert!(SubjectTemplate::parse(template).is_err(), "{template}");
    }

    let run = format!("templates-{}", ObjectId::new().to_hex());
    for (writer, program, script) in [
        ("Python", python(), "conformance.py"),
        ("Node.js", "node".into(), "conformance.mjs"),
    ] {
        let lines = run_script(program, script, &["--templates"], &run, &text).await;
        let (cases, rest) = lines.split_at(table.cases.len().min(lines.len()));
        let (tokens, bad) = rest.split_at(table.tokens.len().min(rest.len()));
        assert_eq!(bad.len(), table.bad_templates.len(), "{writer}: {lines:?}");
        for (line, case) in cases.iter().zip(&table.cases) {
            let theirs: Rendered = serde_json::from_str(line).expect("a case's line");
            assert_eq!(theirs.name, case.name, "{writer}");
            assert_eq!(
                (theirs.subject, theirs.refused),
                (case.subject.clone(), case.refused.clone()),
                "{writer}, {}",
                case.name
            );
        }
        for (line, vector) in tokens.iter().zip(&table.tokens) {
            let theirs: TokenVector = serde_json::from_str(line).expect("a token's line");
            assert_eq!(&theirs, vector, "{writer}");
        }
        for (line, template) in bad.iter().zip(&table.bad_templates) {
            let theirs: serde_json::Value = serde_json::from_str(line).expect("a template's line");
            assert_eq!(theirs["template"], template.as_str(), "{writer}");
            assert!(theirs["error"].is_string(), "{writer} refuses {template}");
        }
    }
}
