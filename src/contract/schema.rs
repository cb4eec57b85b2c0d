//! The document contract as a MongoDB `$jsonSchema`, for `--install-validator`.
//!
//! The schema says in the database what the decoder says in the relay, so a
//! writer in any language has a malformed insert refused in its own
//! transaction instead of dead-lettered later. It is built from the same
//! rules and limits as the decoder ([`SubjectRules`], the header rules), and
//! a test holds the two to the same verdicts on a table of documents. One
//! field is stricter here than in the relay: `keyHash`, which decides no
//! delivery, so the relay delivers a document whatever it holds there,
//! while the validator refuses a value no writer stores. One is looser: a
//! subject template's rendered length, which a schema cannot compute (the
//! validator requires the key and headers the template reads; the relay
//! also fails a message whose escaped key makes its subject too long).

use bson::{doc, Bson, Document};

use super::cloudevents::URI_REFERENCE;
use super::subject::{SubjectRules, MAX_SUBJECT_CHARS};
use super::{field, status, DecodeRules};

/// Subject tokens: none empty, no space, control character or wildcard
/// (the same characters [`validate_subject`](super::validate_subject) refuses).
const TOKENS: &str = r"^[^.*> \x00-\x1f\x7f-\x9f]+(\.[^.*> \x00-\x1f\x7f-\x9f]+)*$";
/// What NATS keeps for itself: `$…` and `_INBOX` subjects.
const RESERVED: &str = r"^(\$|_INBOX(\.|$))";
/// A line break anywhere. (An anchored `^[^\r\n]*$` would not do: `$`
/// also matches before a final line break.)
const LINE_BREAK: &str = "[\r\n]";
/// A control character anywhere, for the same reason.
const CONTROL: &str = r"[\x00-\x1f\x7f-\x9f]";
/// Header names the relay sets itself, in any letter case.
const RESERVED_HEADERS: &str = "^([Nn][Aa][Tt][Ss]|[Oo][Uu][Tt][Bb][Oo][Xx])-";
/// A header name holding anything but visible ASCII other than ':'.
const BAD_HEADER_NAME: &str = "(^$|[^!-9;-~])";
/// What a CloudEvents receiver reads as an attribute: `ce-*` in any letter
/// case, and the core attributes' names.
const CLOUDEVENTS_HEADERS: &str =
    "^([Cc][Ee]-|(specversion|id|source|type|subject|time|datacontenttype|dataschema|data)$)";
/// A header that is an extension attribute: an attribute's name.
const EXTENSION: &str = "^[a-z0-9]{1,20}$";
/// `Content-Type`, in any letter case: the event's datacontenttype.
const CONTENT_TYPE: &str = "^[Cc][Oo][Nn][Tt][Ee][Nn][Tt]-[Tt][Yy][Pp][Ee]$";

/// The document contract as a `$jsonSchema`, for the relay's rules: its
/// subjects, and the CloudEvents attribute rules where they hold.
pub fn contract_schema(rules: &DecodeRules) -> Document {
    let subjects = &rules.subjects;
    let string = doc! { "bsonType": "string" };
    let one_line = doc! { "bsonType": "string", "not": { "pattern": LINE_BREAK } };
    let tokens = [
        doc! { "pattern": TOKENS },
        doc! { "not": { "pattern": CONTROL } },
    ];
    let date = doc! { "bsonType": "date" };
    // A CloudEvents string: no control character at all.
    let attribute = doc! { "bsonType": "string", "not": { "pattern": CONTROL } };
    let never = doc! { "not": {} };
    let permitted: Vec<Bson> = subjects
        .permitted_regexes()
        .into_iter()
        .map(|regex| Bson::Document(doc! { "pattern": regex }))
        .collect();
    // The default subject is `<prefix>.<type>`, so a type may take what
    // the prefix and its dot leave of the subject's length.
    let type_chars = MAX_SUBJECT_CHARS.saturating_sub(subjects.prefix().chars().count() + 1);
    let mut schema = doc! {
        "bsonType": "object",
        "required": [field::ID, field::TYPE, field::PAYLOAD, field::STATUS],
        "properties": {
            field::ID: { "bsonType": "objectId" },
            field::TYPE: {
                "bsonType": "string",
                "minLength": 1,
                "maxLength": bson_len(type_chars),
                "allOf": tokens.to_vec(),
            },
            field::PAYLOAD: { "bsonType": ["object", "binData", "string"] },
            field::STATUS: { "enum": [status::PENDING, status::PROCESSED, status::FAILED] },
            field::CREATED_AT: date.clone(),
            field::CORRELATION_ID: one_line.clone(),
            field::KEY: one_line.clone(),
            // What the writers store, a long; an int is the same number
            // as mongosh stores a small one by hand. A double is not: no
            // writer stores one, and it could hold a fraction.
            field::KEY_HASH: {
                "bsonType": ["int", "long"],
                "minimum": 0,
                "maximum": i64::from(u32::MAX),
            },
            field::HEADERS: {
                "bsonType": "object",
                "patternProperties": {
                    RESERVED_HEADERS: never.clone(),
                    BAD_HEADER_NAME: never.clone(),
                },
                "additionalProperties": one_line,
            },
            field::SUBJECT: {
                "bsonType": "string",
                "maxLength": bson_len(MAX_SUBJECT_CHARS),
                "allOf": [
                    tokens[0].clone(),
                    tokens[1].clone(),
                    { "not": { "pattern": RESERVED } },
                    { "anyOf": permitted },
                ],
            },
            field::ATTEMPTS: { "bsonType": ["int", "long"] },
            field::NEXT_ATTEMPT_AT: date.clone(),
            field::LOCK_ID: { "bsonType": "objectId" },
            field::LOCKED_AT: date.clone(),
            field::PROCESSED_AT: date.clone(),
            field::FAILED_AT: date,
            field::LAST_ERROR: string,
            field::HOLDS_KEY: { "bsonType": "bool" },
        },
    };
    if rules.holds_attribute_rules() {
        hold_attribute_rules(&mut schema, attribute, never);
    }
    if let Some(needs) = template_needs(subjects) {
        schema.insert("anyOf", vec![doc! { "required": [field::SUBJECT] }, needs]);
    }
    schema
}

/// The CloudEvents attribute rules: a key and an extension's value with no
/// control character, a `source` that is a URI-reference, and no header a
/// receiver of events reads as an attribute.
fn hold_attribute_rules(schema: &mut Document, attribute: Document, never: Document) {
    let Ok(properties) = schema.get_document_mut("properties") else {
        return;
    };
    properties.insert(field::KEY, attribute.clone());
    properties.insert(
        field::SOURCE,
        doc! {
            "bsonType": "string",
            "minLength": 1,
            "allOf": [{ "pattern": URI_REFERENCE }, { "not": { "pattern": CONTROL } }],
        },
    );
    let headers = properties
        .get_document_mut(field::HEADERS)
        .and_then(|headers| headers.get_document_mut("patternProperties"));
    if let Ok(patterns) = headers {
        patterns.insert(CLOUDEVENTS_HEADERS, never);
        patterns.insert(EXTENSION, attribute.clone());
        // Not empty, nor only spaces (the attribute rule refuses a tab).
        let mut media_type = attribute;
        media_type.insert("pattern", "[^ ]");
        patterns.insert(CONTENT_TYPE, media_type);
    }
}

/// What a document that names no subject must hold for the template: a
/// non-empty key, and each header it reads, non-empty. None for a
/// template that reads neither.
fn template_needs(subjects: &SubjectRules) -> Option<Document> {
    let template = subjects.template();
    let headers: Vec<&str> = template.headers().collect();
    let mut required = Vec::new();
    let mut properties = Document::new();
    let filled = doc! { "bsonType": "string", "minLength": 1 };
    if template.uses_key() {
        required.push(field::KEY);
        properties.insert(field::KEY, filled.clone());
    }
    if !headers.is_empty() {
        let mut each = Document::new();
        for name in &headers {
            each.insert(*name, filled.clone());
        }
        required.push(field::HEADERS);
        properties.insert(
            field::HEADERS,
            doc! { "bsonType": "object", "required": headers, "properties": each },
        );
    }
    (!required.is_empty()).then(|| doc! { "required": required, "properties": properties })
}

fn bson_len(chars: usize) -> i64 {
    i64::try_from(chars).unwrap_or(i64::MAX)
}
