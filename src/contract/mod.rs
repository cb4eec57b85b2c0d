//! The outbox document contract, and its translation to a NATS message.
//!
//! The document is the public interface of the relay: any driver in any
//! language may insert one, and a writer's bug or an attacker may insert
//! anything. This module owns the field names, the rules a document must
//! follow, and the mapping onto the wire (subject, headers, body).
//! [`DecodeRules::decode`] states the contract: the relay decodes every
//! document with it, the writer runs it on each document before writing,
//! and `--install-validator`'s schema ([`contract_schema`]) says the same in
//! the database.

pub mod cloudevents;
mod key_hash;
mod schema;
mod subject;
mod template;

use std::fmt;

use bson::{oid::ObjectId, spec::BinarySubtype, Bson, Document, RawDocument};
use bytes::Bytes;

pub use key_hash::{key_hash, stored_key_hash};
pub use schema::contract_schema;
pub use subject::{pattern_matches, validate_subject, SubjectRules, MAX_SUBJECT_CHARS};
pub(crate) use subject::{pattern_regex, shown, validate_pattern};
pub use template::{subject_token, SubjectTemplate, DEFAULT_SUBJECT_TEMPLATE};

use crate::unreadable::RawField;
pub use cloudevents::{CloudEvents, ContentMode};
use cloudevents::{EventParts, PayloadKind};

/// Document field names. The relay owns `status` and everything after it.
pub mod field {
    pub const ID: &str = "_id";
    pub const TYPE: &str = "type";
    pub const PAYLOAD: &str = "payload";
    pub const CREATED_AT: &str = "createdAt";
    pub const CORRELATION_ID: &str = "correlationId";
    pub const KEY: &str = "key";
    /// The key's hash ([`key_hash`](super::key_hash)), or a random one
    /// for a keyless message; the relay does not read it.
    pub const KEY_HASH: &str = "keyHash";
    pub const HEADERS: &str = "headers";
    pub const SUBJECT: &str = "subject";
    /// The CloudEvents `source` of the message, where it is not the
    /// relay's (`--cloudevents-source`).
    pub const SOURCE: &str = "source";
    pub const STATUS: &str = "status";
    pub const ATTEMPTS: &str = "attempts";
    pub const NEXT_ATTEMPT_AT: &str = "nextAttemptAt";
    pub const LOCK_ID: &str = "lockId";
    pub const LOCKED_AT: &str = "lockedAt";
    pub const PROCESSED_AT: &str = "processedAt";
    pub const FAILED_AT: &str = "failedAt";
    pub const LAST_ERROR: &str = "lastError";
    /// On a dead letter: it holds its key (`--on-dead-letter hold`).
    pub const HOLDS_KEY: &str = "holdsKey";
}

/// The subject prefix of a relay that is not given one.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox";

/// Values of the `status` field.
pub mod status {
    pub const PENDING: &str = "pending";
    pub const PROCESSED: &str = "processed";
    pub const FAILED: &str = "failed";
}

/// NATS header names the relay sets itself. A document's own `headers` may not
/// set any `Nats-*` header: the message id is what JetStream deduplicates
/// by, and the others steer the server (`Nats-Expected-Last-Sequence`,
/// `Nats-Rollup`, `Nats-TTL`, ...), so only the relay may send them. Nor may
/// it set `Outbox-*`, which must describe the document they came from.
pub mod header {
    pub const MSG_ID: &str = "Nats-Msg-Id";
    pub const TYPE: &str = "Outbox-Type";
    pub const CORRELATION_ID: &str = "Outbox-Correlation-Id";
    pub const KEY: &str = "Outbox-Key";
    /// On a replayed message: the replay that sent it.
    pub const REPLAY: &str = "Outbox-Replay";
    /// On a replayed message: its first delivery's `Nats-Msg-Id`, by which
    /// an inbox knows it.
    pub const REPLAY_OF: &str = "Outbox-Replay-Of";
    pub const CONTENT_TYPE: &str = "Content-Type";
    /// Prefixes of the header names reserved to the relay.
    pub const RESERVED_PREFIXES: [&str; 2] = ["Nats-", "Outbox-"];
}

const JSON: &str = "application/json";
const BINARY: &str = "application/octet-stream";
const TEXT: &str = "text/plain; charset=utf-8";

/// Why a document cannot be delivered. No retry can fix it: the relay marks
/// such a document `failed` with this text as `lastError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ContractViolation {
    rule: Rule,
    message: String,
}

impl ContractViolation {
    pub(crate) fn new(rule: Rule, message: impl Into<String>) -> Self {
        ContractViolation {
            rule,
            message: message.into(),
        }
    }

    /// The rule the document breaks.
    pub fn rule(&self) -> Rule {
        self.rule
    }
}

/// Which rule of the contract a document breaks: a kind to match on, with
/// a stable name ([`Rule::as_str`]) that the writers in other languages
/// (`examples/writers/`) report for the same input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// Not readable as BSON, or an `_id` that is missing or not an ObjectId.
    Document,
    /// A `type` that is missing, not a string, empty, or unable to end a
    /// subject.
    Type,
    /// A `payload` that is missing or has no wire form.
    Payload,
    /// A `correlationId`, `key` or `subject` that is not a string, or
    /// `headers` that are not a document of strings.
    FieldType,
    /// A subject NATS cannot carry: bad syntax, a wildcard, too long.
    Subject,
    /// A subject in NATS's own space (`$…`, `_INBOX…`).
    ReservedSubject,
    /// A subject outside the relay's prefix and allow-list.
    SubjectNotAllowed,
    /// No subject of its own, and no key (or an empty one), or not a
    /// header, that the subject template needs.
    SubjectTemplate,
    /// A header NATS cannot carry.
    Header,
    /// A header the relay keeps for itself (`Nats-*`, `Outbox-*`, and
    /// what a CloudEvents receiver reads as an attribute: `ce-*` and the
    /// core attributes' names).
    ReservedHeader,
    /// A value that cannot be a CloudEvents attribute: a `source` that is
    /// not a URI-reference, a control character in a key or in a header
    /// that is an extension attribute, an empty `Content-Type` or one with
    /// a control character.
    Attribute,
    /// Larger than the NATS server's `max_payload`.
    TooLarge,
    /// Refused by the broker as invalid, for a reason only it knows.
    Refused,
}

impl Rule {
    /// The rule's stable name, as the writers in every language report it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Document => "document",
            Rule::Type => "type",
            Rule::Payload => "payload",
            Rule::FieldType => "field_type",
            Rule::Subject => "subject",
            Rule::ReservedSubject => "reserved_subject",
            Rule::SubjectNotAllowed => "subject_not_allowed",
            Rule::SubjectTemplate => "subject_template",
            Rule::Header => "header",
            Rule::ReservedHeader => "reserved_header",
            Rule::Attribute => "attribute",
            Rule::TooLarge => "too_large",
            Rule::Refused => "refused",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A message ready for the wire: what every publisher receives.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxMessage {
    /// The outbox document's `_id`.
    pub id: ObjectId,
    /// The `type` field.
    pub message_type: String,
    /// The NATS subject it goes to.
    pub subject: String,
    /// Headers in the order they are sent, the relay's own first.
    pub headers: Vec<(String, String)>,
    /// The encoded payload.
    pub body: Bytes,
}

impl OutboxMessage {
    /// The document's `key`, which orders it among the messages sharing it.
    pub fn key(&self) -> Option<&str> {
        self.headers
            .iter()
            .find(|(name, _)| name == header::KEY)
            .map(|(_, value)| value.as_str())
    }

    /// Size on the wire as NATS counts it against `max_payload`: the body plus
    /// the encoded header block (`NATS/1.0\r\n`, one `name: value\r\n` a
    /// header, and a closing `\r\n`).
    pub fn wire_size(&self) -> usize {
        let header_block: usize = self
            .headers
            .iter()
            .map(|(name, value)| name.len() + 2 + value.len() + 2)
            .sum::<usize>()
            + "NATS/1.0\r\n\r\n".len();
        self.body.len() + header_block
    }
}

/// The outcome of reading one outbox document: its `_id` (needed to mark it
/// whatever happens), either the message or the reason it is undeliverable,
/// and the relay's own record of earlier attempts.
#[derive(Debug, Clone)]
pub struct Decoded {
    pub id: Bson,
    pub message: Result<OutboxMessage, ContractViolation>,
    /// The `attempts` field exactly as stored (absent: `None`), whatever
    /// its type: a write that records another attempt matches it, so two
    /// processors cannot both count from the same value.
    pub attempts: Option<Bson>,
    /// The `key` field if it is a string, read even from a document that
    /// breaks the contract, so that such a message keeps its place among
    /// its key's messages (and holds the key as a dead letter with
    /// `--on-dead-letter hold`).
    pub key: Option<String>,
    /// The `_id` and `attempts` as stored, where the driver cannot read
    /// one of them: `id` then holds a stand-in, and writes find the
    /// document by these instead (see `unreadable`).
    pub(crate) stored: Option<StoredFields>,
}

/// A document's `_id` and `attempts` as stored, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredFields {
    pub id: Option<RawField>,
    pub attempts: Option<RawField>,
}

impl Decoded {
    /// Attempts made so far. A value the relay did not write (a string, a
    /// fraction, a negative number) counts as none: the relay overwrites it
    /// with its own count rather than trusting it.
    pub fn attempts_made(&self) -> u32 {
        let counted = match &self.attempts {
            Some(Bson::Int32(n)) => i64::from(*n),
            Some(Bson::Int64(n)) => *n,
            _ => 0,
        };
        u32::try_from(counted).unwrap_or(0)
    }
}

/// What decoding needs to know besides the document.
#[derive(Debug, Clone)]
pub struct DecodeRules {
    /// Where messages may go, and the prefix of their default subject.
    pub subjects: SubjectRules,
    /// The broker's largest accepted message, headers included.
    pub max_payload: usize,
    /// Each message as a CloudEvent, in this mode; none: the relay's own
    /// headers and the payload as the body.
    pub cloudevents: Option<CloudEvents>,
    /// Whether documents are held to the CloudEvents attribute rules
    /// where messages do not go out as events.
    pub attribute_rules: AttributeRules,
}

/// When a document is held to the rules that keep it a sound CloudEvent:
/// a `source` that is a URI-reference, no `ce-*` header nor one named as a
/// core attribute, no control character in a key or in an extension's
/// value. A relay sending events holds every document to them; one that
/// does not holds none to them, so that a document valid before events
/// existed stays deliverable as it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttributeRules {
    /// Where messages go out as CloudEvents.
    WhenSent,
    /// Always: what a writer checks, not knowing how a relay will send
    /// its messages, so that turning `--cloudevents` on fails no document
    /// a writer let through.
    Always,
}

impl DecodeRules {
    /// Rules for a relay publishing under `subjects` to a broker that takes
    /// messages of up to `max_payload` bytes, each message as it is (no
    /// CloudEvent).
    pub fn new(subjects: SubjectRules, max_payload: usize) -> Self {
        DecodeRules {
            subjects,
            max_payload,
            cloudevents: None,
            attribute_rules: AttributeRules::WhenSent,
        }
    }

    /// Whether a document is held to the CloudEvents attribute rules.
    pub fn holds_attribute_rules(&self) -> bool {
        self.cloudevents.is_some() || self.attribute_rules == AttributeRules::Always
    }

    /// The same rules, with each message sent as a CloudEvent (or not).
    pub fn with_cloudevents(self, cloudevents: Option<CloudEvents>) -> Self {
        DecodeRules {
            cloudevents,
            ..self
        }
    }

    /// The rules every relay holds, whatever its configuration and mode:
    /// any subject outside NATS's reserved space, any size, and the
    /// CloudEvents attribute rules. What a writer checks when it is not
    /// told the relay's own rules.
    pub fn any_relay() -> Self {
        DecodeRules {
            attribute_rules: AttributeRules::Always,
            ..DecodeRules::new(SubjectRules::anything_unreserved(), usize::MAX)
        }
    }

    /// Decodes a document as the server sent it. One that cannot be read
    /// at all (a string that is not UTF-8, say) is this document's failure,
    /// not the failure of the read that brought it.
    pub fn decode_raw(&self, raw: &RawDocument) -> Decoded {
        match Document::try_from(raw) {
            Ok(mut document) => {
                // The payload is taken out, not copied: it is the bulk of
                // the document, which is dropped after.
                let payload = document.remove(field::PAYLOAD);
                self.decode_with(&document, payload)
            }
            Err(error) => {
                let id = RawField::of(raw, field::ID);
                let attempts = RawField::of(raw, field::ATTEMPTS);
                let unreadable = [&id, &attempts]
                    .into_iter()
                    .any(|field| field.as_ref().is_some_and(|f| !f.readable()));
                Decoded {
                    id: id.as_ref().map_or(Bson::Null, |id| {
                        id.as_bson().unwrap_or_else(|| id.stand_in())
                    }),
                    message: Err(ContractViolation::new(
                        Rule::Document,
                        format!("the document cannot be read as BSON: {error}"),
                    )),
                    attempts: attempts.as_ref().and_then(RawField::as_bson),
                    key: raw.get_str(field::KEY).ok().map(str::to_owned),
                    stored: unreadable.then_some(StoredFields { id, attempts }),
                }
            }
        }
    }

    /// The subject a document that cannot be decoded would have had: its
    /// own, or the template's (from its key; `<prefix>.<type>` where that
    /// cannot be said). What a replay or an audit selects it by.
    pub fn likely_subject(&self, document: &RawDocument) -> String {
        let message_type = document.get_str(field::TYPE).unwrap_or_default();
        let key = document.get_str(field::KEY).ok();
        match document.get_str(field::SUBJECT) {
            Ok(subject) => subject.to_owned(),
            Err(_) => self
                .subjects
                .subject_of(message_type, key, &[])
                .unwrap_or_else(|_| self.subjects.type_subject(message_type)),
        }
    }

    /// Decodes one outbox document as inserted (the change event's
    /// `fullDocument`, or a document read by a sweep).
    pub fn decode(&self, document: &Document) -> Decoded {
        self.decode_with(document, document.get(field::PAYLOAD).cloned())
    }

    /// Decodes `document`, whose payload is `payload`.
    fn decode_with(&self, document: &Document, payload: Option<Bson>) -> Decoded {
        let id = document.get(field::ID).cloned().unwrap_or(Bson::Null);
        let message = self.to_message(&id, document, payload);
        Decoded {
            id,
            message,
            attempts: document.get(field::ATTEMPTS).cloned(),
            key: document.get_str(field::KEY).ok().map(str::to_owned),
            stored: None,
        }
    }

    fn to_message(
        &self,
        id: &Bson,
        doc: &Document,
        payload: Option<Bson>,
    ) -> Result<OutboxMessage, ContractViolation> {
        let id = match id {
            Bson::ObjectId(oid) => *oid,
            Bson::Null => {
                return Err(ContractViolation::new(
                    Rule::Document,
                    "the document has no _id",
                ))
            }
            other => {
                return Err(ContractViolation::new(
                    Rule::Document,
                    format!("_id must be an ObjectId, found {}", type_name(other)),
                ))
            }
        };
        let message_type = message_type(doc)?;
        validate_type(&message_type)?;
        // The type must be able to end a subject even where the document
        // names its own, or the template leaves it out, so that one type
        // means one thing everywhere (and the validator, which cannot look
        // at both fields, agrees).
        validate_subject(&self.subjects.type_subject(&message_type))
            .map_err(|violation| ContractViolation::new(Rule::Type, violation.message))?;
        let named = optional_string(doc, field::SUBJECT)?;
        if let Some(subject) = &named {
            self.subjects.check(subject)?;
        }
        let (body, kind) = encode_payload(payload)?;
        let correlation_id = optional_string(doc, field::CORRELATION_ID)?;
        let key = optional_string(doc, field::KEY)?;
        let attributes = self.holds_attribute_rules();
        let source = if attributes {
            optional_string(doc, field::SOURCE)?
        } else {
            None
        };
        if let Some(source) = &source {
            cloudevents::check_source(source)
                .map_err(|why| ContractViolation::new(Rule::Attribute, format!("source: {why}")))?;
        }
        let own = document_headers(doc, attributes)?;

        let hex = id.to_hex();
        let mut headers = vec![
            (header::MSG_ID.to_owned(), hex.clone()),
            (header::TYPE.to_owned(), message_type.clone()),
        ];
        if let Some(correlation_id) = correlation_id {
            headers.push((header::CORRELATION_ID.to_owned(), correlation_id));
        }
        if let Some(key) = &key {
            headers.push((header::KEY.to_owned(), key.clone()));
        }
        for (name, value) in headers.iter().chain(&own) {
            validate_header(name, value)?;
        }
        let controlled = key.as_deref().filter(|key| cloudevents::has_control(key));
        if let Some(key) = controlled.filter(|_| attributes) {
            return Err(ContractViolation::new(
                Rule::Attribute,
                format!(
                    "key {} holds a control character, which no CloudEvents subject may",
                    shown(key)
                ),
            ));
        }
        // Rendered last, from fields already found sound: a message that
        // breaks another rule is refused for it, template or not.
        let subject = match named {
            Some(subject) => subject,
            None => self
                .subjects
                .subject_of(&message_type, key.as_deref(), &own)?,
        };
        let own_content_type = own
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(header::CONTENT_TYPE))
            .map(|(_, value)| value.as_str());
        let content_type = own_content_type.unwrap_or(content_type_of(kind));
        let (headers, body) = match &self.cloudevents {
            None => {
                if own_content_type.is_none() {
                    // The payload's own goes before the document's headers.
                    headers.push((header::CONTENT_TYPE.to_owned(), content_type.to_owned()));
                }
                headers.extend(own.iter().cloned());
                (headers, body)
            }
            Some(events) => {
                let event = EventParts {
                    id: &hex,
                    source: source.as_deref().unwrap_or(events.source()),
                    event_type: &message_type,
                    time: match doc.get(field::CREATED_AT) {
                        Some(Bson::DateTime(date)) => cloudevents::rfc3339(*date),
                        _ => None,
                    },
                    subject: key.as_deref().filter(|key| !key.is_empty()),
                    datacontenttype: content_type,
                    extensions: Vec::new(),
                };
                events.encode(headers, &own, body, kind, event)
            }
        };

        let message = OutboxMessage {
            id,
            message_type,
            subject,
            headers,
            body,
        };
        if message.wire_size() > self.max_payload {
            return Err(ContractViolation::new(
                Rule::TooLarge,
                format!(
                "the message is {} bytes with headers, over the NATS server's max_payload of {} \
                 bytes",
                message.wire_size(),
                self.max_payload
            ),
            ));
        }
        Ok(message)
    }
}

/// Checks a message type: non-empty, and usable as the last tokens of a subject.
pub fn validate_type(message_type: &str) -> Result<(), ContractViolation> {
    if message_type.is_empty() {
        return Err(ContractViolation::new(
            Rule::Type,
            "type must be a non-empty string",
        ));
    }
    Ok(())
}

/// Checks one header as NATS carries it: a name of visible ASCII without ':',
/// a value without line breaks, and none of the names the relay reserves.
pub fn validate_header(name: &str, value: &str) -> Result<(), ContractViolation> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Err(ContractViolation::new(
            Rule::Header,
            format!("invalid header name {name:?}: use visible ASCII characters other than ':'"),
        ));
    }
    if value.contains(['\r', '\n']) {
        return Err(ContractViolation::new(
            Rule::Header,
            format!("invalid value for header {name:?}: it contains a line break"),
        ));
    }
    Ok(())
}

/// Whether header `name` begins with `prefix`, in any letter case, as
/// header names compare.
pub(crate) fn starts_with_ignoring_case(name: &str, prefix: &str) -> bool {
    name.get(..prefix.len())
        .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
}

/// Whether `name` is a header the relay sets itself (`Nats-*`, `Outbox-*`).
pub(crate) fn is_relays_header(name: &str) -> bool {
    header::RESERVED_PREFIXES
        .iter()
        .any(|prefix| starts_with_ignoring_case(name, prefix))
}

/// Checks a header that an application asks for, as opposed to one the relay adds.
pub(crate) fn validate_own_header(name: &str, value: &str) -> Result<(), ContractViolation> {
    validate_header(name, value)?;
    if is_relays_header(name) {
        return Err(ContractViolation::new(
            Rule::ReservedHeader,
            format!(
            "header {name:?} is reserved to the relay (every Nats-* and Outbox-* header) and may \
             not be given in headers"
        ),
        ));
    }
    Ok(())
}

/// Checks a document's header against the CloudEvents attribute rules: a
/// receiver of events reads `ce-*` and the core attributes' names as
/// attributes, and a header with an attribute's name is an extension,
/// whose value no control character may be in.
pub(crate) fn validate_attribute_header(name: &str, value: &str) -> Result<(), ContractViolation> {
    if let Some(why) = cloudevents::reserved_header(name) {
        return Err(ContractViolation::new(
            Rule::ReservedHeader,
            format!("header {name:?} may not be given in headers: {why}"),
        ));
    }
    if name.eq_ignore_ascii_case(header::CONTENT_TYPE)
        && (value.trim_matches(' ').is_empty() || cloudevents::has_control(value))
    {
        return Err(ContractViolation::new(
            Rule::Attribute,
            format!(
                "header {name:?} is the event's datacontenttype, a media type: it must not be \
                 empty or hold a control character"
            ),
        ));
    }
    if cloudevents::is_attribute_name(name) && cloudevents::has_control(value) {
        return Err(ContractViolation::new(
            Rule::Attribute,
            format!(
                "header {name:?} is a CloudEvents extension attribute, and its value holds a \
                 control character, which no attribute may"
            ),
        ));
    }
    Ok(())
}

/// The document's own headers, checked; against the attribute rules too
/// where `attributes` holds.
fn document_headers(
    doc: &Document,
    attributes: bool,
) -> Result<Vec<(String, String)>, ContractViolation> {
    let headers = match doc.get(field::HEADERS) {
        None | Some(Bson::Null) => return Ok(Vec::new()),
        Some(Bson::Document(headers)) => headers,
        Some(other) => {
            return Err(ContractViolation::new(
                Rule::FieldType,
                format!(
                    "headers must be a document of strings, found {}",
                    type_name(other)
                ),
            ))
        }
    };
    headers
        .iter()
        .map(|(name, value)| match value {
            Bson::String(value) => {
                validate_own_header(name, value)?;
                if attributes {
                    validate_attribute_header(name, value)?;
                }
                Ok((name.clone(), value.clone()))
            }
            other => Err(ContractViolation::new(
                Rule::FieldType,
                format!(
                    "header {name:?} must be a string, found {}",
                    type_name(other)
                ),
            )),
        })
        .collect()
}

/// The body in an allocation of its own size. The JSON writer grows its
/// buffer by doubling, so a body can hold up to twice its length, and
/// `Bytes` keeps the whole of it while the message waits: memory the byte
/// budget, which counts the body's length, would not see. Copied, since
/// an allocator may shrink a block in place without freeing anything
/// (mimalloc does, down to half a block).
fn fitted(body: Vec<u8>) -> Bytes {
    if body.capacity() - body.len() > body.len() / 8 {
        Bytes::copy_from_slice(&body)
    } else {
        Bytes::from(body)
    }
}

/// The `Content-Type` of a payload of this form.
fn content_type_of(kind: PayloadKind) -> &'static str {
    match kind {
        PayloadKind::Json => JSON,
        PayloadKind::Text => TEXT,
        PayloadKind::Bytes => BINARY,
    }
}

fn encode_payload(payload: Option<Bson>) -> Result<(Bytes, PayloadKind), ContractViolation> {
    match payload {
        Some(Bson::Document(document)) => {
            let json = Bson::Document(document).into_relaxed_extjson();
            let body = serde_json::to_vec(&json).map_err(|e| {
                ContractViolation::new(
                    Rule::Payload,
                    format!("payload cannot be written as JSON: {e}"),
                )
            })?;
            Ok((fitted(body), PayloadKind::Json))
        }
        Some(Bson::Binary(binary)) if binary.subtype == BinarySubtype::Generic => {
            Ok((Bytes::from(binary.bytes), PayloadKind::Bytes))
        }
        Some(Bson::Binary(binary)) => Err(ContractViolation::new(
            Rule::Payload,
            format!(
                "payload is binData of subtype {:?}; use the generic subtype 0",
                binary.subtype
            ),
        )),
        Some(Bson::String(text)) => Ok((Bytes::from(text.into_bytes()), PayloadKind::Text)),
        None => Err(ContractViolation::new(
            Rule::Payload,
            "the document has no payload",
        )),
        Some(other) => Err(ContractViolation::new(
            Rule::Payload,
            format!(
                "payload must be a document, binData or string, found {}",
                type_name(&other)
            ),
        )),
    }
}

/// The `type`: every way it can be wrong breaks [`Rule::Type`].
fn message_type(doc: &Document) -> Result<String, ContractViolation> {
    string_field(doc, field::TYPE, Rule::Type)?
        .ok_or_else(|| ContractViolation::new(Rule::Type, "the document has no type"))
}

fn optional_string(doc: &Document, name: &str) -> Result<Option<String>, ContractViolation> {
    string_field(doc, name, Rule::FieldType)
}

/// A field that is a string if present; another type breaks `rule`.
fn string_field(
    doc: &Document,
    name: &str,
    rule: Rule,
) -> Result<Option<String>, ContractViolation> {
    match doc.get(name) {
        None | Some(Bson::Null) => Ok(None),
        Some(Bson::String(value)) => Ok(Some(value.clone())),
        Some(other) => Err(ContractViolation::new(
            rule,
            format!("{name} must be a string, found {}", type_name(other)),
        )),
    }
}

/// The BSON type name as MongoDB spells it in `$type`, for error messages.
pub(crate) fn type_name(value: &Bson) -> impl fmt::Display {
    match value.element_type() {
        bson::spec::ElementType::Double => "double",
        bson::spec::ElementType::String => "string",
        bson::spec::ElementType::EmbeddedDocument => "object",
        bson::spec::ElementType::Array => "array",
        bson::spec::ElementType::Binary => "binData",
        bson::spec::ElementType::ObjectId => "objectId",
        bson::spec::ElementType::Boolean => "bool",
        bson::spec::ElementType::DateTime => "date",
        bson::spec::ElementType::Null => "null",
        bson::spec::ElementType::Int32 => "int",
        bson::spec::ElementType::Int64 => "long",
        bson::spec::ElementType::Timestamp => "timestamp",
        bson::spec::ElementType::Decimal128 => "decimal",
        bson::spec::ElementType::RegularExpression => "regex",
        _ => "another BSON type",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::{doc, Binary};

    fn rules() -> DecodeRules {
        let subjects = SubjectRules::under("outbox").and_then(|r| r.allow("a.>"));
        DecodeRules::new(subjects.expect("rules"), 1024)
    }

    fn decode(document: Document) -> Result<OutboxMessage, ContractViolation> {
        rules().decode(&document).message
    }

    #[test]
    fn a_document_whose_id_is_not_utf8_keeps_its_id_and_attempts_as_stored() {
        let raw = crate::unreadable::tests::not_utf8(b"ab\xff");
        let decoded = rules().decode_raw(&raw);
        assert!(decoded.message.is_err(), "it cannot be delivered");
        let stored = decoded.stored.expect("its fields as stored");
        let id = stored.id.expect("its _id");
        assert!(!id.readable());
        assert_eq!(
            id.stand_in(),
            decoded.id,
            "a stand-in tells it apart, not Null"
        );
        assert_eq!(
            stored.attempts.and_then(|a| a.as_bson()),
            Some(Bson::Int32(2))
        );
        assert_eq!(decoded.attempts, Some(Bson::Int32(2)));
    }

    #[test]
    fn a_broken_document_whose_id_and_attempts_read_is_addressed_as_usual() {
        let document = doc! { "_id": ObjectId::new(), "type": 5, "attempts": 1 };
        let raw = bson::RawDocumentBuf::from_document(&document).expect("raw");
        let decoded = rules().decode_raw(&raw);
        assert!(decoded.message.is_err());
        assert!(decoded.stored.is_none());
    }

    #[test]
    fn minimal_document_maps_to_subject_headers_and_json_body() {
        let id = ObjectId::new();
        let message =
            decode(doc! { "_id": id, "type": "order.placed", "payload": { "n": 1 } }).unwrap();
        assert_eq!(message.subject, "outbox.order.placed");
        assert_eq!(message.body.as_ref(), br#"{"n":1}"#);
        assert_eq!(
            message.headers,
            vec![
                ("Nats-Msg-Id".to_owned(), id.to_hex()),
                ("Outbox-Type".to_owned(), "order.placed".to_owned()),
                ("Content-Type".to_owned(), "application/json".to_owned()),
            ]
        );
    }

    #[test]
    fn optional_fields_become_headers_and_document_headers_follow() {
        let message = decode(doc! {
            "_id": ObjectId::new(), "type": "t", "payload": "x",
            "correlationId": "c", "key": "k", "subject": "a.b",
            "headers": { "traceparent": "00-1-2-01", "Content-Type": "text/csv" },
        })
        .unwrap();
        assert_eq!(message.subject, "a.b");
        let names: Vec<&str> = message.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "Nats-Msg-Id",
                "Outbox-Type",
                "Outbox-Correlation-Id",
                "Outbox-Key",
                "traceparent",
                "Content-Type"
            ]
        );
        let content_type = message.headers.iter().find(|(n, _)| n == "Content-Type");
        assert_eq!(content_type.map(|(_, v)| v.as_str()), Some("text/csv"));
    }

    #[test]
    fn a_key_hash_of_any_value_or_none_changes_nothing_on_the_wire() {
        let without = doc! { "_id": ObjectId::new(), "type": "t", "payload": "x", "key": "k" };
        let expected = decode(without.clone()).unwrap();
        for key_hash in [
            Bson::Int64(i64::from(key_hash("k"))),
            Bson::Int64(-1),
            Bson::String("k".into()),
            Bson::Double(0.5),
        ] {
            let mut with = without.clone();
            with.insert(field::KEY_HASH, key_hash.clone());
            assert_eq!(decode(with).unwrap(), expected, "{key_hash}");
        }
    }

    #[test]
    fn binary_and_text_payloads_are_sent_as_is() {
        let bytes = Binary {
            subtype: BinarySubtype::Generic,
            bytes: vec![1, 2, 3],
        };
        let message =
            decode(doc! { "_id": ObjectId::new(), "type": "t", "payload": bytes }).unwrap();
        assert_eq!(message.body.as_ref(), &[1, 2, 3]);
        let message = decode(doc! { "_id": ObjectId::new(), "type": "t", "payload": "é" }).unwrap();
        assert_eq!(message.body.as_ref(), "é".as_bytes());
    }

    #[test]
    fn subjects_are_validated() {
        for good in ["a", "a.b.c", "orders-v2.created_1", "a\u{a0}b"] {
            assert!(validate_subject(good).is_ok(), "{good}");
        }
        for bad in [
            "", ".a", "a.", "a..b", "a b", "a\tb", "a.*", "a.>", "a*b", "a\u{7}", "a\u{85}",
        ] {
            assert!(validate_subject(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reserved_and_malformed_headers_are_refused() {
        assert!(validate_own_header("traceparent", "v").is_ok());
        for name in [
            "Nats-Msg-Id",
            "nats-msg-id",
            "Nats-Expected-Last-Sequence",
            "NATS-ROLLUP",
            "Nats-TTL",
            "Outbox-Type",
            "outbox-anything",
        ] {
            assert!(validate_own_header(name, "v").is_err(), "{name}");
        }
        assert!(validate_header("bad name", "v").is_err());
        assert!(validate_header("a:b", "v").is_err());
        assert!(validate_header("", "v").is_err());
        assert!(validate_header("ok", "line\r\nbreak").is_err());
    }

    #[test]
    fn every_contract_breach_says_what_is_wrong() {
        let cases = [
            (doc! { "type": "t", "payload": {} }, "no _id"),
            (
                doc! { "_id": 1, "type": "t", "payload": {} },
                "_id must be an ObjectId",
            ),
            (doc! { "_id": ObjectId::new(), "payload": {} }, "no type"),
            (
                doc! { "_id": ObjectId::new(), "type": 1, "payload": {} },
                "type must be a string, found int",
            ),
            (
                doc! { "_id": ObjectId::new(), "type": "", "payload": {} },
                "non-empty",
            ),
            (doc! { "_id": ObjectId::new(), "type": "t" }, "no payload"),
            (
                doc! { "_id": ObjectId::new(), "type": "t", "payload": [1] },
                "found array",
            ),
            (
                doc! { "_id": ObjectId::new(), "type": "t", "payload": {}, "headers": "x" },
                "headers must be a document",
            ),
            (
                doc! { "_id": ObjectId::new(), "type": "t", "payload": {}, "subject": 5 },
                "subject must be a string",
            ),
            (
                doc! { "_id": ObjectId::new(), "type": "t", "payload": "x".repeat(2000) },
                "max_payload of 1024",
            ),
        ];
        for (document, expected) in cases {
            let error = decode(document.clone()).unwrap_err().to_string();
            assert!(
                error.contains(expected),
                "{document}: {error:?} lacks {expected:?}"
            );
        }
    }

    #[test]
    fn an_unreadable_document_is_its_own_failure() {
        let id = ObjectId::new();
        let good = bson::to_vec(&doc! { "_id": id, "type": "t", "payload": "ab", "attempts": 2 })
            .expect("encode");
        let at = good
            .windows(3)
            .position(|w| w == b"ab\0")
            .expect("the payload");
        let mut bad = good.clone();
        bad[at..at + 2].copy_from_slice(&[0xff, 0xfe]);
        let raw = RawDocument::from_bytes(&bad).expect("well-formed BSON");
        let decoded = rules().decode_raw(raw);
        assert_eq!(decoded.id, Bson::ObjectId(id));
        assert_eq!(decoded.attempts, Some(Bson::Int32(2)));
        let error = decoded.message.expect_err("not UTF-8").to_string();
        assert!(error.contains("cannot be read"), "{error}");
        let raw = RawDocument::from_bytes(&good).expect("BSON");
        assert!(rules().decode_raw(raw).message.is_ok());
    }

    #[test]
    fn wire_size_counts_the_header_block() {
        let message = decode(doc! { "_id": ObjectId::new(), "type": "t", "payload": "" }).unwrap();
        let expected = "NATS/1.0\r\n".len()
            + message
                .headers
                .iter()
                .map(|(n, v)| format!("{n}: {v}\r\n").len())
                .sum::<usize>()
            + 2;
        assert_eq!(message.wire_size(), expected);
    }
}
