//! Documents the driver cannot read whole, and how the relay still changes
//! them.
//!
//! MongoDB stores a string that is not valid UTF-8 without complaint; the
//! driver refuses to read one. A writer's bug or an attacker can put such a
//! string in any field, `_id` and `attempts` included, and the relay must
//! still fail that document, which means naming its `_id` (and the
//! `attempts` it was read with) in a filter. Those two are kept as stored,
//! byte for byte ([`RawField`]), and the write goes out as a command built
//! from bytes ([`update_one`]), since the driver's own writes take filters
//! of values it can read.
//!
//! This module is a leaf: it knows the BSON layout and the update command,
//! nothing of the stages that use it.

use bson::spec::BinarySubtype;
use bson::{Binary, Bson, Document, RawArrayBuf, RawDocument, RawDocumentBuf};
use mongodb::error::{ErrorKind, WriteError, WriteFailure};
use mongodb::Collection;

/// The binary subtype of a stand-in `_id` (see [`RawField::stand_in`]).
const STAND_IN: u8 = 0x80;

/// One field's value as stored: its BSON type and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawField {
    element_type: u8,
    value: Vec<u8>,
}

impl RawField {
    /// Field `name` of `document` as stored; `None` if it is absent, or
    /// the document cannot be walked as far as it.
    pub fn of(document: &RawDocument, name: &str) -> Option<Self> {
        let bytes = document.as_bytes();
        // Each element: its type, its key and a 0, then its value.
        let mut at = 4;
        for element in document.iter_elements() {
            let element = element.ok()?;
            let value_at = at + 1 + element.key().len() + 1;
            let end = value_at + element.len();
            if element.key() == name {
                return Some(RawField {
                    element_type: *bytes.get(at)?,
                    value: bytes.get(value_at..end)?.to_vec(),
                });
            }
            at = end;
        }
        None
    }

    /// Whether the driver can read this value.
    pub fn readable(&self) -> bool {
        self.as_bson().is_some()
    }

    /// The value, if the driver can read it.
    pub fn as_bson(&self) -> Option<Bson> {
        let document = RawDocumentBuf::from_bytes(self.in_document("v")).ok()?;
        let value = document.get("v").ok().flatten()?;
        Bson::try_from(value.to_raw_bson()).ok()
    }

    /// The value as a person may read it: a string's text with what is
    /// not UTF-8 replaced, quoted; other values as the driver shows them.
    pub fn lossy(&self) -> String {
        if let Some(value) = self.as_bson() {
            return value.to_string();
        }
        // A string: its length, its bytes, and a 0.
        let text = self.value.get(4..self.value.len().saturating_sub(1));
        format!("{:?}", String::from_utf8_lossy(text.unwrap_or_default()))
    }

    /// A value that stands for this one in memory, where the driver cannot
    /// read it: its bytes, as binary data of a subtype writers do not use.
    /// It tells documents apart (which ones are under way, or unmarkable);
    /// a filter naming it matches nothing, so writes go through
    /// [`update_one`].
    pub fn stand_in(&self) -> Bson {
        let mut bytes = Vec::with_capacity(1 + self.value.len());
        bytes.push(self.element_type);
        bytes.extend_from_slice(&self.value);
        Bson::Binary(Binary {
            subtype: BinarySubtype::UserDefined(STAND_IN),
            bytes,
        })
    }

    /// This value as an element named `key`.
    fn element(&self, key: &str) -> Vec<u8> {
        let mut element = Vec::with_capacity(key.len() + 2 + self.value.len());
        element.push(self.element_type);
        element.extend_from_slice(key.as_bytes());
        element.push(0);
        element.extend_from_slice(&self.value);
        element
    }

    /// A document holding only this value, as `key`.
    fn in_document(&self, key: &str) -> Vec<u8> {
        document_of(&[self.element(key)])
    }
}

/// A document of `elements`, each already encoded.
fn document_of(elements: &[Vec<u8>]) -> Vec<u8> {
    let body: usize = elements.iter().map(Vec::len).sum();
    let length = 4 + body + 1;
    let mut bytes = Vec::with_capacity(length);
    // A document is far below 2 GiB: the elements came from one.
    bytes.extend_from_slice(&(length as i32).to_le_bytes());
    for element in elements {
        bytes.extend_from_slice(element);
    }
    bytes.push(0);
    bytes
}

/// A filter that compares fields with values as stored (`$eq`, so that a
/// stored value is never read as an operator), beside the fields of
/// `rest`; a field of `raw` with no value must be absent.
pub(crate) fn filter(
    raw: &[(&str, Option<&RawField>)],
    rest: &Document,
) -> Result<RawDocumentBuf, bson::raw::Error> {
    let mut elements = Vec::with_capacity(raw.len() + 1);
    for (name, field) in raw {
        let condition = match field {
            Some(field) => field.in_document("$eq"),
            None => RawDocumentBuf::from_document(&bson::doc! { "$exists": false })
                .map(RawDocumentBuf::into_bytes)
                .unwrap_or_default(),
        };
        let mut element = vec![bson::spec::ElementType::EmbeddedDocument as u8];
        element.extend_from_slice(name.as_bytes());
        element.push(0);
        element.extend_from_slice(&condition);
        elements.push(element);
    }
    let rest = RawDocumentBuf::from_document(rest)?;
    // The rest's elements, without its length and its closing 0.
    let rest_bytes = rest.as_bytes();
    elements.push(rest_bytes[4..rest_bytes.len() - 1].to_vec());
    RawDocumentBuf::from_bytes(document_of(&elements))
}

/// Applies `update` to the first document `filter` (from [`filter`])
/// matches, with the collection's write concern. Returns how many
/// documents it changed. A write the server refuses comes back as the
/// driver's own write error, so callers sort it as any other; a reply the
/// driver cannot read (one that quotes the document) counts as the
/// document's refusal too, since a write that took says nothing of it.
pub(crate) async fn update_one(
    outbox: &Collection<Document>,
    filter: RawDocumentBuf,
    update: &Document,
) -> mongodb::error::Result<u64> {
    let mut statement = RawDocumentBuf::new();
    statement.append("q", filter);
    statement.append("u", RawDocumentBuf::from_document(update)?);
    let mut updates = RawArrayBuf::new();
    updates.push(statement);
    let mut command = RawDocumentBuf::new();
    command.append("update", outbox.name());
    command.append("updates", updates);
    command.append("ordered", true);
    if let Some(concern) = outbox.write_concern() {
        let concern = bson::to_document(concern)?;
        command.append("writeConcern", RawDocumentBuf::from_document(&concern)?);
    }
    let reply = match outbox
        .client()
        .database(outbox.namespace().db.as_str())
        .run_raw_command(command)
        .await
    {
        Ok(reply) => reply,
        Err(error) if unreadable_reply(&error) => {
            return Err(refused(
                "the server's reply about the document cannot be read",
            ))
        }
        Err(error) => return Err(error),
    };
    if let Ok(errors) = reply.get_array("writeErrors") {
        let first = errors.iter().find_map(Bson::as_document).cloned();
        return Err(match first.map(bson::from_document::<WriteError>) {
            Some(Ok(error)) => {
                mongodb::error::Error::from(ErrorKind::Write(WriteFailure::WriteError(error)))
            }
            _ => refused("the server refused the write"),
        });
    }
    if let Ok(concern) = reply.get_document("writeConcernError") {
        if let Ok(concern) = bson::from_document(concern.clone()) {
            return Err(mongodb::error::Error::from(ErrorKind::Write(
                WriteFailure::WriteConcernError(concern),
            )));
        }
    }
    let changed = match reply.get("nModified") {
        Some(Bson::Int32(n)) => u64::try_from(*n).unwrap_or(0),
        Some(Bson::Int64(n)) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    };
    Ok(changed)
}

/// Whether the driver failed to read a reply, rather than to reach the
/// server.
fn unreadable_reply(error: &mongodb::error::Error) -> bool {
    matches!(
        &*error.kind,
        ErrorKind::BsonDeserialization(_) | ErrorKind::InvalidResponse { .. }
    )
}

/// A refusal of the document (BadValue), as the driver reports one.
fn refused(message: &str) -> mongodb::error::Error {
    let error = bson::doc! { "code": 2, "codeName": "BadValue", "errmsg": message };
    match bson::from_document::<WriteError>(error) {
        Ok(error) => mongodb::error::Error::from(ErrorKind::Write(WriteFailure::WriteError(error))),
        Err(error) => mongodb::error::Error::from(ErrorKind::BsonDeserialization(error)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use bson::{doc, oid::ObjectId};

    use super::*;

    /// A document whose field `name` is a string of `bytes` (not UTF-8,
    /// say) followed by the fields of `rest`, as a writer talking raw BSON
    /// can store it.
    pub(crate) fn with_string(name: &str, bytes: &[u8], rest: &Document) -> RawDocumentBuf {
        let mut element = vec![0x02];
        element.extend_from_slice(name.as_bytes());
        element.push(0);
        element.extend_from_slice(&((bytes.len() + 1) as i32).to_le_bytes());
        element.extend_from_slice(bytes);
        element.push(0);
        let rest = RawDocumentBuf::from_document(rest).expect("raw");
        let rest = rest.as_bytes()[4..rest.as_bytes().len() - 1].to_vec();
        RawDocumentBuf::from_bytes(document_of(&[element, rest])).expect("a well-framed document")
    }

    /// `{_id: <id>, key: "k\xff", attempts: 2}`, the `_id` a string of
    /// `id`'s bytes.
    pub(crate) fn not_utf8(id: &[u8]) -> RawDocumentBuf {
        let key = with_string("key", b"k\xff", &doc! { "attempts": 2 });
        let key = key.as_bytes()[4..key.as_bytes().len() - 1].to_vec();
        let id = with_string("_id", id, &doc! {});
        let id = id.as_bytes()[4..id.as_bytes().len() - 1].to_vec();
        RawDocumentBuf::from_bytes(document_of(&[id, key])).expect("a well-framed document")
    }

    #[test]
    fn a_field_the_driver_cannot_read_is_kept_as_stored() {
        let document = not_utf8(b"ab\xff");
        let id = RawField::of(&document, "_id").expect("the _id is found");
        assert!(!id.readable());
        assert_eq!(id.value, b"\x04\0\0\0ab\xff\0");
        let attempts = RawField::of(&document, "attempts").expect("after the bad fields");
        assert_eq!(attempts.as_bson(), Some(Bson::Int32(2)));
        assert!(RawField::of(&document, "missing").is_none());
    }

    #[test]
    fn stand_ins_tell_unreadable_ids_apart() {
        let one = RawField::of(&not_utf8(b"ab\xff"), "_id").expect("_id");
        let other = RawField::of(&not_utf8(b"ab\xfe"), "_id").expect("_id");
        assert_ne!(one.stand_in(), other.stand_in());
        assert_eq!(one.stand_in(), one.clone().stand_in());
    }

    #[test]
    fn a_filter_names_the_stored_bytes_beside_ordinary_fields() {
        let document = not_utf8(b"ab\xff");
        let id = RawField::of(&document, "_id").expect("_id");
        let claim = ObjectId::new();
        let rest = doc! { "status": "pending", "lockId": claim };
        let filter = filter(&[("_id", Some(&id)), ("attempts", None)], &rest).expect("a filter");
        let mut found = filter
            .iter_elements()
            .map(|e| e.expect("an element").key().to_owned());
        assert_eq!(
            found.by_ref().collect::<Vec<_>>(),
            ["_id", "attempts", "status", "lockId"]
        );
        let condition = filter.get_document("_id").expect("a condition on _id");
        let stored = RawField::of(condition, "$eq").expect("$eq the stored value");
        assert_eq!(stored, id, "the very bytes stored");
        let absent = filter.get_document("attempts").expect("attempts");
        assert_eq!(
            Document::try_from(absent).ok(),
            Some(doc! { "$exists": false })
        );
        assert_eq!(filter.get_object_id("lockId").ok(), Some(claim));
    }
}
