//! CloudEvents on NATS: a message as the CloudEvents NATS protocol binding
//! maps an event, in either of its two content modes, and back.
//!
//! The outbox document already holds what an event is (an id, a type, a
//! time, a subject), so the relay can send it as an event that any
//! CloudEvents SDK reads. *Binary* mode puts each attribute in a `ce-`
//! header, its value percent-encoded as the binding requires, and the
//! payload in the body; *structured* mode puts the whole event, data and
//! all, in the body in the JSON event format, marked by a `Content-Type`
//! of `application/cloudevents+json`. Either way the relay's own headers
//! (`Nats-Msg-Id` first) stay, so deduplication, the inbox, `replay` and
//! `audit` work alike in every mode.
//!
//! This module owns the attribute rules the contract holds every document
//! to (whatever mode a relay runs in, so a document valid today stays
//! valid when a relay is switched to events), the encoding onto the wire,
//! and the reading back that an inbox does.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use base64::Engine as _;
use bytes::Bytes;
use serde_json::value::RawValue;

/// The CloudEvents version the relay speaks.
pub const SPECVERSION: &str = "1.0";
/// The prefix of an attribute's header in binary mode.
pub const HEADER_PREFIX: &str = "ce-";
/// The `Content-Type` of a structured event: the JSON event format's media
/// type, which a receiver tells structured mode by (`application/cloudevents`,
/// matched case-insensitively, begins it).
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// What a receiver tells a structured event by, per the binding.
const STRUCTURED_MARK: &str = "application/cloudevents";

/// The attributes the CloudEvents specification defines itself, and `data`.
/// No document header may take one of these names: as an extension it
/// would overwrite the attribute the relay derives from the document.
pub const CORE_ATTRIBUTES: [&str; 9] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
];

/// Longest attribute name: the specification's limit.
pub const MAX_ATTRIBUTE_NAME: usize = 20;

/// The Distributed Tracing extension's attributes. They are sent both as
/// attributes and as the plain headers tracing tools read: the extension
/// carries the trace context beside the protocol's own, it does not
/// replace it.
const TRACE_CONTEXT: [&str; 2] = ["traceparent", "tracestate"];

/// A URI-reference (RFC 3986, section 4.1), ASCII only: an absolute URI
/// with a scheme, or a relative reference whose first segment holds no
/// ':'. The same pattern is in the validator's schema and in the writers of
/// every language (`examples/writers/`), which match it whole. Built from
/// four classes, each a character or a `%XX`: a path character with '/'
/// (`[!$&-;=@-Z_a-z~]`), a segment's (`[!$&-.0-;=@-Z_a-z~]`, no '/'), a
/// first relative segment's (the same, no ':'), and a query's or a
/// fragment's (a path character or '?'); and an authority of user
/// information, a host (a bracketed literal or a name) and a port. Under
/// 1,000 characters, so that servers capping a pattern's length take it.
pub const URI_REFERENCE: &str = r"^(?:[A-Za-z][A-Za-z0-9+.\-]*:(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?://(?:(?:[!$&-.0-;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*@)?(?:\[[!$&-.0-;=A-Z_a-z~]+\]|(?:[!$&-.0-9;=A-Z_a-z~]|%[0-9A-Fa-f]{2})*)(?::[0-9]*)?(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|/(?:(?:[!$&-.0-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?|(?:[!$&-.0-9;=@-Z_a-z~]|%[0-9A-Fa-f]{2})+(?:/(?:[!$&-;=@-Z_a-z~]|%[0-9A-Fa-f]{2})*)?)?)(?:\?(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?(?:#(?:[!$&-;=?-Z_a-z~]|%[0-9A-Fa-f]{2})*)?$";

static URI_REFERENCE_REGEX: LazyLock<regex::Regex> = LazyLock::new(|| {
    #[allow(clippy::expect_used)] // a constant, compiled by the unit tests
    regex::Regex::new(URI_REFERENCE).expect("URI_REFERENCE is a valid pattern")
});

/// Which of the binding's two content modes a relay sends events in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentMode {
    /// Attributes in `ce-` headers, the payload as the body.
    Binary,
    /// The JSON event format in the body.
    Structured,
}

/// How a relay sends each message as a CloudEvent: the mode, and the
/// `source` of events whose document names none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    mode: ContentMode,
    source: String,
}

impl CloudEvents {
    /// Events in `mode` from `source`, which must be a URI-reference
    /// ([`check_source`] says why not).
    pub fn new(mode: ContentMode, source: impl Into<String>) -> Result<Self, String> {
        let source = source.into();
        check_source(&source)?;
        Ok(CloudEvents { mode, source })
    }

    /// The content mode.
    pub fn mode(&self) -> ContentMode {
        self.mode
    }

    /// The source of events whose document names none.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// The default `source`: `/<database>/<collection>`, each name
/// percent-encoded where a path segment needs it. Nothing of the connection
/// string (hosts, user, password) goes in.
pub fn default_source(database: &str, collection: &str) -> String {
    const SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    format!(
        "/{}/{}",
        percent_encoding::utf8_percent_encode(database, SEGMENT),
        percent_encoding::utf8_percent_encode(collection, SEGMENT)
    )
}

/// Checks a `source`: a non-empty URI-reference. The error says why not.
pub fn check_source(source: &str) -> Result<(), String> {
    if source.is_empty() {
        return Err("a source must not be empty".to_owned());
    }
    if !URI_REFERENCE_REGEX.is_match(source) {
        return Err(format!(
            "{} is not a URI-reference (RFC 3986): use ASCII, percent-encode anything else \
             (%XX), and give a scheme ('urn:', 'https:') or a path ('/orders')",
            super::shown(source)
        ));
    }
    Ok(())
}

/// Whether `name` is a valid attribute name: lower-case ASCII letters and
/// digits, at most [`MAX_ATTRIBUTE_NAME`]. A document header with such a
/// name is an extension attribute of its event.
pub fn is_attribute_name(name: &str) -> bool {
    (1..=MAX_ATTRIBUTE_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Whether `name` is a header no document may set, since a CloudEvents
/// receiver would read it as an attribute of the event: `ce-*` in any
/// letter case, or a core attribute's name. The reason, if so.
pub fn reserved_header(name: &str) -> Option<&'static str> {
    if super::starts_with_ignoring_case(name, HEADER_PREFIX) {
        Some("every ce-* header carries a CloudEvents attribute, which the relay derives from the document")
    } else if CORE_ATTRIBUTES.contains(&name) {
        Some("it names a CloudEvents attribute, which the relay derives from the document")
    } else {
        None
    }
}

/// Whether `value` holds a character no CloudEvents string may: a control
/// character (U+0000 to U+001F, U+007F to U+009F).
pub fn has_control(value: &str) -> bool {
    value
        .chars()
        .any(|c| c <= '\u{1f}' || ('\u{7f}'..='\u{9f}').contains(&c))
}

/// What the binding percent-encodes in a header value: space, `"`, `%`
/// and every character outside printable ASCII (U+0021 to U+007E); the
/// encoder writes each byte beyond ASCII too, as `%XY` in upper case.
const HEADER_VALUE: &percent_encoding::AsciiSet =
    &percent_encoding::CONTROLS.add(b' ').add(b'"').add(b'%');

/// `value` percent-encoded as the binding requires of a header value.
pub fn percent_encoded(value: &str) -> String {
    percent_encoding::utf8_percent_encode(value, HEADER_VALUE).to_string()
}

/// Why a header value cannot be read back as an attribute.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HeaderValueError(String);

/// Reads a header value as the binding says a receiver must: a
/// double-quoted string unescaped first (RFC 7230, 3.2.6), then one round
/// of percent-decoding, in either letter case; bytes that are not UTF-8
/// (an overlong `%C0%A0`, say) are refused.
pub fn percent_decode(value: &str) -> Result<String, HeaderValueError> {
    let unquoted = unquote(value.trim_matches([' ', '\t']))?;
    let bytes = unquoted.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let digit = |at: usize| bytes.get(at).and_then(|b| char::from(*b).to_digit(16));
            let (Some(high), Some(low)) = (digit(at + 1), digit(at + 2)) else {
                return Err(HeaderValueError(format!(
                    "{} has a '%' without two hexadecimal digits after it",
                    super::shown(value)
                )));
            };
            // Two hexadecimal digits make a byte: each is below 16.
            out.push(u8::try_from(high * 16 + low).unwrap_or(u8::MAX));
            at += 3;
        } else {
            out.push(bytes[at]);
            at += 1;
        }
    }
    let decoded = String::from_utf8(out).map_err(|_| {
        HeaderValueError(format!(
            "{} percent-decodes to bytes that are not UTF-8",
            super::shown(value)
        ))
    })?;
    if has_control(&decoded) {
        return Err(HeaderValueError(format!(
            "{} percent-decodes to a control character, which no attribute may hold",
            super::shown(value)
        )));
    }
    Ok(decoded)
}

/// A quoted-string's content with its backslash escapes undone; any other
/// value as it is.
fn unquote(value: &str) -> Result<std::borrow::Cow<'_, str>, HeaderValueError> {
    let Some(inner) = value
        .strip_prefix('"')
        .and_then(|rest| rest.strip_suffix('"'))
        .filter(|_| value.len() >= 2)
    else {
        return Ok(value.into());
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(escaped) => out.push(escaped),
                None => {
                    return Err(HeaderValueError(format!(
                        "{} ends its quoted string with a lone backslash",
                        super::shown(value)
                    )))
                }
            },
            '"' => {
                return Err(HeaderValueError(format!(
                    "{} has an unescaped '\"' inside its quoted string",
                    super::shown(value)
                )))
            }
            other => out.push(other),
        }
    }
    Ok(out.into())
}

/// `createdAt` as an RFC 3339 `time`, with its milliseconds, in UTC; none
/// for a date outside the years 1 to 9999: RFC 3339 cannot write a later
/// or earlier one, and readers built on the common date types (Python's
/// `datetime`, say) cannot read the year 0 it can.
pub fn rfc3339(date: bson::DateTime) -> Option<String> {
    let nanos = i128::from(date.timestamp_millis()) * 1_000_000;
    let date = time::OffsetDateTime::from_unix_timestamp_nanos(nanos).ok()?;
    (1..=9999).contains(&date.year()).then(|| {
        format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
            date.year(),
            u8::from(date.month()),
            date.day(),
            date.hour(),
            date.minute(),
            date.second(),
            date.millisecond()
        )
    })
}

/// Whether a media type declares JSON, as the event format says: a
/// subtype `json` or one ending `+json` (`application/json`,
/// `application/vnd.x+json`, `text/json`), with any parameters.
pub fn is_json_media_type(media_type: &str) -> bool {
    let essence = media_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    !kind.is_empty() && (subtype == "json" || subtype.ends_with("+json"))
}

/// The payload's form, which decides how structured mode writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PayloadKind {
    /// A document, sent as JSON.
    Json,
    /// A string, sent as UTF-8.
    Text,
    /// binData, sent as its bytes.
    Bytes,
}

/// One event, as the relay derives it from a document.
#[derive(Debug)]
pub(crate) struct EventParts<'a> {
    /// The message id in hexadecimal, as `Nats-Msg-Id` carries it.
    pub id: &'a str,
    /// The document's own source, or the relay's.
    pub source: &'a str,
    pub event_type: &'a str,
    pub time: Option<String>,
    /// The key, where it is not empty.
    pub subject: Option<&'a str>,
    pub datacontenttype: &'a str,
    /// The document's headers with attribute names, in order.
    pub extensions: Vec<(&'a str, &'a str)>,
}

impl CloudEvents {
    /// Sends a message as an event: from the relay's own headers, the
    /// document's (`own`), the body and its form, the headers and body to
    /// publish.
    pub(crate) fn encode<'a>(
        &self,
        relay_headers: Vec<(String, String)>,
        own: &'a [(String, String)],
        body: Bytes,
        kind: PayloadKind,
        mut event: EventParts<'a>,
    ) -> (Vec<(String, String)>, Bytes) {
        let mut plain = Vec::new();
        for (name, value) in own {
            if is_attribute_name(name) {
                event.extensions.push((name, value));
                if !TRACE_CONTEXT.contains(&name.as_str()) {
                    continue;
                }
            }
            if !name.eq_ignore_ascii_case(super::header::CONTENT_TYPE) {
                plain.push((name.clone(), value.clone()));
            }
        }
        let mut headers = relay_headers;
        match self.mode {
            ContentMode::Binary => {
                for (attribute, value) in event.attributes() {
                    headers.push((
                        format!("{HEADER_PREFIX}{attribute}"),
                        percent_encoded(value),
                    ));
                }
                headers.extend(plain);
                (headers, body)
            }
            ContentMode::Structured => {
                headers.push((
                    super::header::CONTENT_TYPE.to_owned(),
                    STRUCTURED_CONTENT_TYPE.to_owned(),
                ));
                headers.extend(plain);
                (headers, event.structured(&body, kind))
            }
        }
    }
}

impl EventParts<'_> {
    /// Every attribute, in the order they are sent.
    fn attributes(&self) -> impl Iterator<Item = (&str, &str)> {
        let core = [
            ("specversion", Some(SPECVERSION)),
            ("id", Some(self.id)),
            ("source", Some(self.source)),
            ("type", Some(self.event_type)),
            ("time", self.time.as_deref()),
            ("subject", self.subject),
            ("datacontenttype", Some(self.datacontenttype)),
        ];
        core.into_iter()
            .filter_map(|(name, value)| Some((name, value?)))
            .chain(self.extensions.iter().copied())
    }

    /// The event in the JSON event format: the attributes, then the data
    /// in the one form that gives a receiver its bytes back exactly.
    fn structured(&self, body: &[u8], kind: PayloadKind) -> Bytes {
        let mut out = Vec::with_capacity(body.len() + 256);
        out.push(b'{');
        for (name, value) in self.attributes() {
            push_member(&mut out, name, value);
            out.push(b',');
        }
        match DataForm::of(kind, self.datacontenttype, body) {
            DataForm::Json => {
                push_json_string(&mut out, "data");
                out.push(b':');
                out.extend_from_slice(body);
            }
            DataForm::Text => {
                push_member(&mut out, "data", &String::from_utf8_lossy(body));
            }
            DataForm::Base64 => {
                let encoded = base64::engine::general_purpose::STANDARD.encode(body);
                push_member(&mut out, "data_base64", &encoded);
            }
        }
        out.push(b'}');
        super::fitted(out)
    }
}

/// How structured mode writes an event's data. The event format's schema
/// takes `data` as an object or a string only, and a reader takes `data`
/// as JSON where the content type is JSON and as text where it is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DataForm {
    /// `data` as the JSON object it is.
    Json,
    /// `data` as a JSON string of the payload's text.
    Text,
    /// `data_base64`: bytes, and JSON-typed text that is not one whole
    /// JSON object (an array, a number, text that does not parse, or
    /// parses only past what common readers take: too deep, a lone
    /// surrogate, a number out of range).
    Base64,
}

impl DataForm {
    fn of(kind: PayloadKind, datacontenttype: &str, body: &[u8]) -> DataForm {
        let json = is_json_media_type(datacontenttype);
        match kind {
            PayloadKind::Json if json => DataForm::Json,
            // A document's JSON text, declared something else.
            PayloadKind::Json => DataForm::Text,
            PayloadKind::Text if json && is_whole_json_object(body) => DataForm::Json,
            PayloadKind::Text if !json => DataForm::Text,
            PayloadKind::Text | PayloadKind::Bytes => DataForm::Base64,
        }
    }
}

/// Whether `text` is one JSON object and nothing around it, as a reader
/// with the common limits parses it (`serde_json`'s: 128 levels deep,
/// surrogates paired, numbers in range).
fn is_whole_json_object(text: &[u8]) -> bool {
    text.first() == Some(&b'{')
        && text.last() == Some(&b'}')
        && matches!(
            serde_json::from_slice::<serde_json::Value>(text),
            Ok(serde_json::Value::Object(_))
        )
}

fn push_member(out: &mut Vec<u8>, name: &str, value: &str) {
    push_json_string(out, name);
    out.push(b':');
    push_json_string(out, value);
}

fn push_json_string(out: &mut Vec<u8>, value: &str) {
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, value);
}

/// An event's attributes, as a consumer reads them from a message in
/// either mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The content mode it came in.
    pub mode: ContentMode,
    /// `specversion`.
    pub specversion: String,
    /// `id`: for the relay's events, the outbox message's id.
    pub id: String,
    /// `source`.
    pub source: String,
    /// `type`.
    pub event_type: String,
    /// `time`, as written (RFC 3339).
    pub time: Option<String>,
    /// `subject`: for the relay's events, the key.
    pub subject: Option<String>,
    /// `datacontenttype`.
    pub datacontenttype: Option<String>,
    /// `dataschema`.
    pub dataschema: Option<String>,
    /// Every other attribute, by name.
    pub extensions: BTreeMap<String, String>,
}

/// Why a message that says it is a CloudEvent cannot be read as one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a readable CloudEvent: {0}")]
pub struct EventError(String);

/// A message read as a CloudEvent: its attributes and its data.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadEvent {
    pub event: Event,
    /// The event's data: the body in binary mode; in structured mode the
    /// `data` member (a JSON value as JSON text, a string as its UTF-8)
    /// or `data_base64` decoded.
    pub data: Bytes,
}

/// How a message says what it is, by its `Content-Type` and headers.
enum Carried {
    /// The JSON event format in the body.
    StructuredJson,
    /// Structured in another event format, which the relay does not read.
    StructuredOther,
    /// Attributes in `ce-` headers.
    Binary,
    /// No CloudEvent: no marking at all, or a batch.
    Nothing,
}

impl Carried {
    fn of(headers: &[(String, String)]) -> Carried {
        let content_type = headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(super::header::CONTENT_TYPE))
            .map(|(_, value)| {
                let essence = value.split(';').next().unwrap_or_default();
                essence.trim().to_ascii_lowercase()
            });
        match content_type.as_deref() {
            Some("application/cloudevents" | "application/cloudevents+json") => {
                Carried::StructuredJson
            }
            Some(batch) if batch.starts_with("application/cloudevents-batch") => Carried::Nothing,
            Some(other) if other.starts_with(STRUCTURED_MARK) => Carried::StructuredOther,
            _ if headers
                .iter()
                .any(|(name, _)| name.eq_ignore_ascii_case("ce-specversion")) =>
            {
                Carried::Binary
            }
            _ => Carried::Nothing,
        }
    }
}

impl Event {
    /// Reads a message as the binding says a receiver tells its mode: a
    /// `Content-Type` of `application/cloudevents` (`+json`) is structured,
    /// a `ce-specversion` header binary, anything else no event at all (a
    /// batch included, which the binding does not define). Any message may
    /// come this way, not only the relay's: one that says it is an event
    /// and is not a sound one is an error, whose text is bounded.
    pub fn read(
        headers: &[(String, String)],
        body: &Bytes,
    ) -> Option<Result<ReadEvent, EventError>> {
        match Carried::of(headers) {
            Carried::Nothing => None,
            Carried::StructuredJson => Some(Event::read_structured(body)),
            Carried::StructuredOther => Some(Err(EventError(
                "structured in an event format other than JSON".to_owned(),
            ))),
            Carried::Binary => Some(Event::read_binary(headers).map(|event| ReadEvent {
                event,
                data: body.clone(),
            })),
        }
    }

    fn read_binary(headers: &[(String, String)]) -> Result<Event, EventError> {
        let mut attributes = BTreeMap::new();
        for (name, value) in headers {
            if !super::starts_with_ignoring_case(name, HEADER_PREFIX) {
                continue;
            }
            let attribute = name[HEADER_PREFIX.len()..].to_ascii_lowercase();
            if attribute.is_empty() {
                return Err(EventError("a ce- header names no attribute".to_owned()));
            }
            let value = percent_decode(value)
                .map_err(|e| EventError(format!("header {}: {e}", super::shown(name))))?;
            // Header names are case-insensitive: two spellings of one
            // attribute must say the same, or which one counts would
            // depend on the order a map happens to hold them in.
            if let Some(earlier) = attributes.insert(attribute.clone(), value.clone()) {
                if earlier != value {
                    return Err(EventError(format!(
                        "attribute {} is given twice, differently",
                        super::shown(&attribute)
                    )));
                }
            }
        }
        Event::from_attributes(ContentMode::Binary, attributes)
    }

    fn read_structured(body: &Bytes) -> Result<ReadEvent, EventError> {
        let members: BTreeMap<String, &RawValue> = serde_json::from_slice(body)
            .map_err(|e| EventError(format!("the body is not a JSON event: {e}")))?;
        let mut attributes = BTreeMap::new();
        for (name, value) in &members {
            if name == "data" || name == "data_base64" {
                continue;
            }
            // Attributes are strings, or a JSON scalar an SDK wrote for a
            // typed extension (a number, a boolean): the text of either is
            // its canonical string.
            let parsed: serde_json::Value = serde_json::from_str(value.get())
                .map_err(|e| EventError(format!("{}: {e}", super::shown(name))))?;
            let text = match parsed {
                serde_json::Value::String(text) => text,
                serde_json::Value::Null => continue,
                other @ (serde_json::Value::Bool(_) | serde_json::Value::Number(_)) => {
                    other.to_string()
                }
                _ => {
                    return Err(EventError(format!(
                        "attribute {} is not a string",
                        super::shown(name)
                    )))
                }
            };
            attributes.insert(name.clone(), text);
        }
        let event = Event::from_attributes(ContentMode::Structured, attributes)?;
        let data = match (members.get("data"), members.get("data_base64")) {
            (Some(_), Some(_)) => {
                return Err(EventError("it has both data and data_base64".to_owned()))
            }
            (None, None) => Bytes::new(),
            (None, Some(encoded)) => {
                let text: String = serde_json::from_str(encoded.get())
                    .map_err(|_| EventError("data_base64 is not a string".to_owned()))?;
                base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .map(Bytes::from)
                    .map_err(|e| EventError(format!("data_base64 is not base64: {e}")))?
            }
            (Some(value), None) => {
                let json = event
                    .datacontenttype
                    .as_deref()
                    .is_none_or(is_json_media_type);
                // JSON data is its JSON text; text data declared otherwise
                // is the string's own bytes.
                match serde_json::from_str::<String>(value.get()) {
                    Ok(text) if !json => Bytes::from(text),
                    _ => Bytes::copy_from_slice(value.get().as_bytes()),
                }
            }
        };
        Ok(ReadEvent { event, data })
    }

    fn from_attributes(
        mode: ContentMode,
        mut attributes: BTreeMap<String, String>,
    ) -> Result<Event, EventError> {
        let mut required = |name: &str| {
            attributes
                .remove(name)
                .ok_or_else(|| EventError(format!("it has no {name}")))
        };
        let specversion = required("specversion")?;
        if specversion != SPECVERSION {
            return Err(EventError(format!(
                "its specversion is {}, not {SPECVERSION}",
                super::shown(&specversion)
            )));
        }
        let id = required("id")?;
        let source = required("source")?;
        let event_type = required("type")?;
        Ok(Event {
            mode,
            specversion,
            id,
            source,
            event_type,
            time: attributes.remove("time"),
            subject: attributes.remove("subject"),
            datacontenttype: attributes.remove("datacontenttype"),
            dataschema: attributes.remove("dataschema"),
            extensions: attributes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{DecodeRules, OutboxMessage, SubjectRules};
    use bson::{doc, oid::ObjectId, Binary, Document};

    fn send(mode: ContentMode, document: Document) -> OutboxMessage {
        let rules = DecodeRules::new(SubjectRules::anything_unreserved(), 1 << 20)
            .with_cloudevents(Some(
                CloudEvents::new(mode, "/shop/outbox").expect("a valid source"),
            ));
        rules.decode(&document).message.expect("a valid document")
    }

    fn header<'m>(message: &'m OutboxMessage, name: &str) -> Option<&'m str> {
        message
            .headers
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| value.as_str())
    }

    fn full_document(id: ObjectId) -> Document {
        doc! {
            "_id": id, "type": "order.placed", "payload": { "n": 1 },
            "key": "order 7.*>%\"ü", "correlationId": "c-1",
            "createdAt": bson::DateTime::from_millis(1_765_000_000_123),
            "headers": {
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tenant": "acme corp", "X-Plain": "kept",
            },
        }
    }

    #[test]
    fn binary_mode_puts_each_attribute_in_a_ce_header_and_keeps_the_relays_own() {
        let id = ObjectId::new();
        let message = send(ContentMode::Binary, full_document(id));
        let names: Vec<&str> = message.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "Nats-Msg-Id",
                "Outbox-Type",
                "Outbox-Correlation-Id",
                "Outbox-Key",
                "ce-specversion",
                "ce-id",
                "ce-source",
                "ce-type",
                "ce-time",
                "ce-subject",
                "ce-datacontenttype",
                "ce-traceparent",
                "ce-tenant",
                "traceparent",
                "X-Plain",
            ]
        );
        assert_eq!(header(&message, "ce-id"), Some(id.to_hex().as_str()));
        assert_eq!(header(&message, "ce-id"), header(&message, "Nats-Msg-Id"));
        assert_eq!(header(&message, "ce-source"), Some("/shop/outbox"));
        assert_eq!(
            header(&message, "ce-time"),
            Some("2025-12-06T05:46:40.123Z")
        );
        assert_eq!(
            header(&message, "ce-subject"),
            Some("order%207.*>%25%22%C3%BC")
        );
        assert_eq!(header(&message, "ce-tenant"), Some("acme%20corp"));
        assert_eq!(
            header(&message, "ce-datacontenttype"),
            Some("application/json")
        );
        assert_eq!(
            header(&message, "Content-Type"),
            None,
            "it would say structured"
        );
        assert_eq!(message.body.as_ref(), br#"{"n":1}"#);
        let read = Event::read(&message.headers, &message.body)
            .expect("an event")
            .expect("readable");
        assert_eq!(read.event.subject.as_deref(), Some("order 7.*>%\"ü"));
        assert_eq!(
            read.event.extensions.get("tenant").map(String::as_str),
            Some("acme corp")
        );
        assert_eq!(read.data, message.body);
    }

    #[test]
    fn structured_mode_writes_the_json_event_format_and_marks_it() {
        let id = ObjectId::new();
        let message = send(ContentMode::Structured, full_document(id));
        assert_eq!(
            header(&message, "Content-Type"),
            Some(STRUCTURED_CONTENT_TYPE)
        );
        assert!(message
            .headers
            .iter()
            .all(|(name, _)| !name.starts_with("ce-")));
        assert_eq!(header(&message, "traceparent").map(str::len), Some(55));
        let event: serde_json::Value = serde_json::from_slice(&message.body).expect("JSON");
        assert_eq!(
            event,
            serde_json::json!({
                "specversion": "1.0", "id": id.to_hex(), "source": "/shop/outbox",
                "type": "order.placed", "time": "2025-12-06T05:46:40.123Z",
                "subject": "order 7.*>%\"ü", "datacontenttype": "application/json",
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tenant": "acme corp", "data": { "n": 1 },
            })
        );
        let read = Event::read(&message.headers, &message.body)
            .expect("an event")
            .expect("readable");
        assert_eq!(read.event.id, id.to_hex());
        assert_eq!(read.data.as_ref(), br#"{"n":1}"#);
    }

    #[test]
    fn each_payload_is_written_as_the_event_format_says() {
        let bytes = Binary {
            subtype: bson::spec::BinarySubtype::Generic,
            bytes: vec![0, 1, 0xff],
        };
        let cases = [
            (
                bson::Bson::Binary(bytes),
                "application/octet-stream",
                "data_base64",
                serde_json::json!("AAH/"),
            ),
            (
                "héllo".into(),
                "text/plain; charset=utf-8",
                "data",
                serde_json::json!("héllo"),
            ),
        ];
        for (payload, content_type, member, value) in cases {
            let document = doc! { "_id": ObjectId::new(), "type": "t", "payload": payload };
            let message = send(ContentMode::Structured, document.clone());
            let event: serde_json::Value = serde_json::from_slice(&message.body).expect("JSON");
            assert_eq!(event["datacontenttype"], content_type);
            assert_eq!(event[member], value);
            assert!(event.get("time").is_none() && event.get("subject").is_none());
            let read = Event::read(&message.headers, &message.body)
                .expect("event")
                .expect("ok");
            let binary = send(ContentMode::Binary, document);
            assert_eq!(read.data, binary.body, "the same data in both modes");
        }
        // Each payload in the one form a reader gets its bytes back from,
        // and that the event format's schema takes (an object or a string).
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let cases: [(bson::Bson, &str, &str, serde_json::Value); 7] = [
            (
                "{\"a\": [1, 2]}".into(),
                "application/json",
                "data",
                serde_json::json!({"a": [1, 2]}),
            ),
            (
                "[1, 2]".into(),
                "application/json",
                "data_base64",
                serde_json::json!("WzEsIDJd"),
            ),
            (
                "hello".into(),
                "application/json",
                "data_base64",
                serde_json::json!("aGVsbG8="),
            ),
            (
                " {}".into(),
                "application/vnd.x+json",
                "data_base64",
                serde_json::json!("IHt9"),
            ),
            (
                "{\"a\":\"\\ud800\"}".into(),
                "application/json",
                "data_base64",
                serde_json::json!("eyJhIjoiXHVkODAwIn0="),
            ),
            (
                doc! { "n": 1 }.into(),
                "text/plain",
                "data",
                serde_json::json!("{\"n\":1}"),
            ),
            (
                deep.clone().into(),
                "application/json",
                "data_base64",
                serde_json::json!(base64::engine::general_purpose::STANDARD.encode(&deep)),
            ),
        ];
        for (payload, content_type, member, value) in cases {
            let document = doc! {
                "_id": ObjectId::new(), "type": "t", "payload": payload.clone(),
                "headers": { "Content-Type": content_type },
            };
            let message = send(ContentMode::Structured, document.clone());
            let event: serde_json::Value = serde_json::from_slice(&message.body).expect("JSON");
            assert_eq!(event[member], value, "{payload}");
            assert_eq!(event["datacontenttype"], content_type);
            let read = Event::read(&message.headers, &message.body)
                .expect("event")
                .expect("ok");
            let binary = send(ContentMode::Binary, document);
            assert_eq!(
                read.data, binary.body,
                "{payload}: the same data in both modes"
            );
        }
    }

    #[test]
    fn a_documents_own_source_and_content_type_are_its_events() {
        let document = doc! {
            "_id": ObjectId::new(), "type": "t", "payload": "a,b", "key": "",
            "source": "urn:shop:orders", "headers": { "content-type": "text/csv" },
        };
        let message = send(ContentMode::Binary, document);
        assert_eq!(header(&message, "ce-source"), Some("urn:shop:orders"));
        assert_eq!(header(&message, "ce-datacontenttype"), Some("text/csv"));
        assert_eq!(
            header(&message, "ce-subject"),
            None,
            "an empty key is no subject"
        );
        assert!(message
            .headers
            .iter()
            .all(|(name, _)| !name.eq_ignore_ascii_case("content-type")));
    }

    #[test]
    fn off_sends_no_attribute_and_a_source_changes_nothing() {
        let rules = DecodeRules::new(SubjectRules::anything_unreserved(), 1 << 20);
        let document = doc! { "_id": ObjectId::new(), "type": "t", "payload": "x" };
        let mut with_source = document.clone();
        with_source.insert("source", "urn:x");
        assert_eq!(
            rules.decode(&document).message.expect("valid"),
            rules.decode(&with_source).message.expect("valid")
        );
    }

    #[test]
    fn documents_that_would_break_an_event_are_refused_where_events_go_and_by_writers() {
        use crate::contract::Rule;
        let plain = DecodeRules::new(SubjectRules::anything_unreserved(), 1 << 20);
        let strict = [
            ("a writer", DecodeRules::any_relay()),
            (
                "binary",
                plain.clone().with_cloudevents(Some(
                    CloudEvents::new(ContentMode::Binary, "/s").expect("a valid source"),
                )),
            ),
            (
                "structured",
                plain.clone().with_cloudevents(Some(
                    CloudEvents::new(ContentMode::Structured, "/s").expect("a valid source"),
                )),
            ),
        ];
        let cases = [
            (doc! { "source": "has space" }, Rule::Attribute),
            (doc! { "source": "" }, Rule::Attribute),
            (doc! { "source": 5 }, Rule::FieldType),
            (doc! { "key": "a\tb" }, Rule::Attribute),
            (doc! { "headers": { "ce-id": "x" } }, Rule::ReservedHeader),
            (
                doc! { "headers": { "CE-Tenant": "x" } },
                Rule::ReservedHeader,
            ),
            (doc! { "headers": { "source": "x" } }, Rule::ReservedHeader),
            (doc! { "headers": { "tenant": "a\u{85}" } }, Rule::Attribute),
        ];
        let document = |fields: &Document| {
            let mut document = doc! { "_id": ObjectId::new(), "type": "t", "payload": "x" };
            document.extend(fields.clone());
            document
        };
        for (fields, rule) in &cases {
            for (what, rules) in &strict {
                let refused = rules
                    .decode(&document(fields))
                    .message
                    .expect_err("refused");
                assert_eq!(refused.rule(), *rule, "{what} {fields}: {refused}");
            }
            // A relay sending no events delivers what it always delivered.
            assert!(
                plain.decode(&document(fields)).message.is_ok(),
                "off: {fields}"
            );
        }
        let fine = doc! { "key": "k", "headers": { "X-Note": "a\tb", "Source": "s" } };
        for (what, rules) in &strict {
            assert!(rules.decode(&document(&fine)).message.is_ok(), "{what}");
        }
    }

    #[test]
    fn the_bindings_own_example_is_encoded_as_it_says() {
        assert_eq!(
            percent_encoded("Euro \u{20ac} \u{1f600}"),
            "Euro%20%E2%82%AC%20%F0%9F%98%80"
        );
    }

    #[test]
    fn space_quote_percent_and_everything_outside_printable_ascii_are_encoded() {
        for (value, encoded) in [
            ("a b", "a%20b"),
            ("say \"hi\"", "say%20%22hi%22"),
            ("100%", "100%25"),
            ("tab\there", "tab%09here"),
            ("del\u{7f}", "del%7F"),
            ("c1\u{85}", "c1%C2%85"),
            ("Zürich", "Z%C3%BCrich"),
            ("orders.*.>", "orders.*.>"),
            ("~!#$&'()*+,/:;=?@[]^`{|}", "~!#$&'()*+,/:;=?@[]^`{|}"),
        ] {
            assert_eq!(percent_encoded(value), encoded, "{value:?}");
            if !has_control(value) {
                assert_eq!(percent_decode(encoded).as_deref(), Ok(value), "{encoded}");
            }
        }
    }

    #[test]
    fn decoding_takes_lower_case_quoted_strings_and_needless_escapes_and_refuses_bad_utf8() {
        assert_eq!(percent_decode("z%c3%bcrich").as_deref(), Ok("zürich"));
        assert_eq!(percent_decode("%41%42").as_deref(), Ok("AB"));
        assert_eq!(percent_decode(r#""a b \"c\"""#).as_deref(), Ok("a b \"c\""));
        assert_eq!(percent_decode(r#""a%20b""#).as_deref(), Ok("a b"));
        // The binding's own example of what must be refused: an overlong
        // encoding of a space.
        assert!(percent_decode("%C0%A0").is_err());
        assert!(percent_decode("%E2%82").is_err(), "a cut sequence");
        assert!(percent_decode("50%").is_err());
        assert!(
            percent_decode("%+A").is_err(),
            "a sign is no hexadecimal digit"
        );
        assert!(
            percent_decode("a%0Ab").is_err(),
            "no attribute holds a line break"
        );
        assert!(percent_decode("%G0").is_err());
        assert!(
            percent_decode(r#""a\"#).is_ok(),
            "not a whole quoted string"
        );
    }

    #[test]
    fn attribute_names_are_lower_case_letters_and_digits_up_to_twenty() {
        for good in ["traceparent", "tenant", "a", "x1", "abcdefghijklmnopqrst"] {
            assert!(is_attribute_name(good), "{good}");
        }
        for bad in [
            "",
            "Tenant",
            "x-tenant",
            "a_b",
            "abcdefghijklmnopqrstu",
            "é",
        ] {
            assert!(!is_attribute_name(bad), "{bad}");
        }
    }

    #[test]
    fn ce_headers_and_core_attribute_names_are_reserved() {
        for reserved in [
            "ce-id",
            "CE-Source",
            "Ce-tenant",
            "id",
            "source",
            "data",
            "time",
        ] {
            assert!(reserved_header(reserved).is_some(), "{reserved}");
        }
        for free in [
            "tenant",
            "Source",
            "cel",
            "traceparent",
            "data_base64",
            "X-Id",
        ] {
            assert!(reserved_header(free).is_none(), "{free}");
        }
    }

    #[test]
    fn sources_are_uri_references() {
        for good in [
            "/",
            "/shop/outbox",
            "orders",
            "urn:shop:orders",
            "https://shop.example/orders?region=eu#1",
            "mongodb://db1:27017/shop",
            "http://[::1]:8080/x",
            "//host/path",
            "a/b:c",
            "%7Euser",
            "#fragment",
            "?q",
        ] {
            assert_eq!(check_source(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "has space",
            "a:b c",
            "1abc:x",
            ":x",
            "a b",
            "/ünicode",
            "/x%zz",
            "/x%4",
            "a#b#c",
            "/x\n",
            "\"quoted\"",
            "/a{b}",
            "back\\slash",
        ] {
            assert!(check_source(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_default_source_names_the_database_and_collection_and_is_a_uri_reference() {
        assert_eq!(default_source("shop", "outbox"), "/shop/outbox");
        let odd = default_source("shop", "out box:ü$");
        assert_eq!(odd, "/shop/out%20box%3A%C3%BC%24");
        assert_eq!(check_source(&odd), Ok(()));
    }

    #[test]
    fn time_has_milliseconds_and_dates_rfc_3339_cannot_write_have_none() {
        let date = bson::DateTime::from_millis(1_765_000_000_123);
        assert_eq!(rfc3339(date).as_deref(), Some("2025-12-06T05:46:40.123Z"));
        assert_eq!(
            rfc3339(bson::DateTime::from_millis(0)).as_deref(),
            Some("1970-01-01T00:00:00.000Z")
        );
        assert_eq!(rfc3339(bson::DateTime::MAX), None);
        let year_zero = bson::DateTime::from_millis(-62_167_219_200_000);
        assert_eq!(
            rfc3339(year_zero),
            None,
            "year 0, which common readers cannot read"
        );
        assert_eq!(
            rfc3339(bson::DateTime::from_millis(-62_135_596_800_000)).as_deref(),
            Some("0001-01-01T00:00:00.000Z")
        );
        assert_eq!(rfc3339(bson::DateTime::MIN), None);
    }

    #[test]
    fn a_message_that_says_it_is_an_event_and_is_no_sound_one_is_an_error() {
        let headers = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect()
        };
        let binary = [
            ("ce-specversion", "1.0"),
            ("ce-id", "1"),
            ("ce-source", "/s"),
            ("ce-type", "t"),
        ];
        let body = Bytes::from_static(b"x");
        let ok = Event::read(&headers(&binary), &body).expect("an event");
        assert_eq!(ok.expect("sound").event.id, "1");
        let mut twice = binary.to_vec();
        twice.push(("CE-ID", "2"));
        let mut same_twice = binary.to_vec();
        same_twice.push(("CE-ID", "1"));
        assert!(Event::read(&headers(&same_twice), &body)
            .expect("event")
            .is_ok());
        let mut unnamed = binary.to_vec();
        unnamed.push(("ce-", "x"));
        let mut old = binary.to_vec();
        old[0] = ("ce-specversion", "0.3");
        assert_eq!(
            Event::read(&headers(&binary[1..]), &body),
            None,
            "no specversion, no event"
        );
        for bad in [twice, unnamed, old] {
            let read = Event::read(&headers(&bad), &body);
            assert!(matches!(read, Some(Err(_))), "{bad:?}: {read:?}");
        }
        let structured = headers(&[("Content-Type", "application/cloudevents+json")]);
        let both = Bytes::from_static(
            br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","data":1,"data_base64":"eA=="}"#,
        );
        for bad in [both, Bytes::from_static(b"[]"), Bytes::from_static(b"{")] {
            assert!(
                matches!(Event::read(&structured, &bad), Some(Err(_))),
                "{bad:?}"
            );
        }
        let batch = headers(&[("Content-Type", "application/cloudevents-batch+json")]);
        assert_eq!(
            Event::read(&batch, &body),
            None,
            "a batch is no single event"
        );
        let avro = headers(&[("Content-Type", "application/cloudevents+avro")]);
        assert!(matches!(Event::read(&avro, &body), Some(Err(_))));
        let plain = headers(&[("Content-Type", "application/json")]);
        assert_eq!(Event::read(&plain, &body), None);
    }

    #[test]
    fn control_characters_are_found() {
        assert!(has_control("a\tb"));
        assert!(has_control("a\u{85}"));
        assert!(!has_control("Zürich 🚀"));
    }

    #[test]
    fn json_media_types_are_told_by_their_essence() {
        for json in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.x+json",
            "text/json",
        ] {
            assert!(is_json_media_type(json), "{json}");
        }
        for other in [
            "text/plain",
            "application/octet-stream",
            "application/jsonx",
            "json",
        ] {
            assert!(!is_json_media_type(other), "{other}");
        }
    }
}
