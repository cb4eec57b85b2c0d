//! The write side: adding outbox messages inside an application's transaction.
//!
//! An outbox message only means something if it commits or aborts together
//! with the business write it announces, so [`Outbox::add`] refuses a session
//! with no active transaction rather than writing on its own. Each document
//! is decoded as the relay will decode it before it is written, so an invalid
//! one fails here, in the application, and not later as a dead letter. Give
//! the writer the relay's own subject rules ([`Outbox::with_rules`]) to have
//! it refuse exactly what that relay refuses; without them it refuses what
//! every relay refuses.

use std::collections::BTreeMap;

use bson::{doc, oid::ObjectId, spec::BinarySubtype, Binary, Bson, DateTime, Document};
use mongodb::{error::ErrorKind, ClientSession, Collection, Database};
use serde::Serialize;

use crate::contract::cloudevents::{is_attribute_name, MAX_ATTRIBUTE_NAME};
use crate::contract::{
    field, status, stored_key_hash, AttributeRules, ContractViolation, DecodeRules, Rule,
};
use crate::error::{Error, Result};

/// The default name of the outbox collection.
pub const DEFAULT_COLLECTION: &str = "outbox";

/// A payload type with a stable message type name.
///
/// The name is part of the wire contract (it ends the NATS subject), so it is
/// spelled out rather than taken from the Rust type's path, which changes when
/// code is moved or renamed.
pub trait MessageType {
    /// The `type` written to the outbox document, for example `"order.placed"`.
    const MESSAGE_TYPE: &'static str;
}

/// The body of a message as stored in the outbox document.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// Sent as relaxed Extended JSON.
    Document(Document),
    /// Sent as the raw bytes.
    Bytes(Vec<u8>),
    /// Sent as UTF-8.
    Text(String),
}

impl From<Payload> for Bson {
    fn from(payload: Payload) -> Bson {
        match payload {
            Payload::Document(document) => Bson::Document(document),
            Payload::Bytes(bytes) => Bson::Binary(Binary {
                subtype: BinarySubtype::Generic,
                bytes,
            }),
            Payload::Text(text) => Bson::String(text),
        }
    }
}

/// A message to add to the outbox, built with its optional fields.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMessage {
    message_type: String,
    payload: Payload,
    correlation_id: Option<String>,
    key: Option<String>,
    headers: BTreeMap<String, String>,
    /// The names given as extensions, which must be attribute names.
    extensions: Vec<String>,
    subject: Option<String>,
    source: Option<String>,
}

impl NewMessage {
    /// A message whose payload is a serializable value, under its [`MessageType`] name.
    pub fn typed<T: MessageType + Serialize>(payload: &T) -> Result<Self> {
        Self::serialized(T::MESSAGE_TYPE, payload)
    }

    /// A message whose payload is a serializable value, under an explicit type name.
    pub fn serialized(message_type: impl Into<String>, payload: &impl Serialize) -> Result<Self> {
        let document = bson::to_document(payload).map_err(|e| {
            Error::Payload(format!(
                "{e} (a payload must serialize to a document: a struct or a map)"
            ))
        })?;
        Ok(Self::new(message_type, Payload::Document(document)))
    }

    /// A message with a payload given as is.
    pub fn new(message_type: impl Into<String>, payload: Payload) -> Self {
        NewMessage {
            message_type: message_type.into(),
            payload,
            correlation_id: None,
            key: None,
            headers: BTreeMap::new(),
            extensions: Vec::new(),
            subject: None,
            source: None,
        }
    }

    /// Sets the correlation id, sent as the `Outbox-Correlation-Id` header.
    pub fn correlation_id(mut self, correlation_id: impl Into<String>) -> Self {
        self.correlation_id = Some(correlation_id.into());
        self
    }

    /// Sets the ordering or partition key, sent as the `Outbox-Key` header;
    /// its hash is stored as `keyHash`.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a NATS header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Adds a CloudEvents extension attribute: a header whose name is an
    /// attribute name (lower-case letters and digits, at most 20), which a
    /// relay sending CloudEvents sends as an attribute of the event. A
    /// name that is not one is refused when the message is added.
    pub fn extension(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        self.headers.insert(name.clone(), value.into());
        self.extensions.push(name);
        self
    }

    /// Sets the CloudEvents `source` of the message (a URI-reference), for
    /// a relay sending CloudEvents; without one, the relay's
    /// `--cloudevents-source` is the source.
    pub fn source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// Refuses an extension whose name is no attribute name, which the
    /// document could not tell from an ordinary header.
    fn check_extensions(&self) -> std::result::Result<(), ContractViolation> {
        match self.extensions.iter().find(|name| !is_attribute_name(name)) {
            None => Ok(()),
            Some(name) => Err(ContractViolation::new(
                Rule::Attribute,
                format!(
                    "extension {name:?} is no CloudEvents attribute name: use lower-case \
                     letters and digits, at most {MAX_ATTRIBUTE_NAME}"
                ),
            )),
        }
    }

    /// Sends the message to this subject instead of `<prefix>.<type>`.
    pub fn subject(mut self, subject: impl Into<String>) -> Self {
        self.subject = Some(subject.into());
        self
    }

    /// The outbox document for this message, as [`Outbox::add`] writes it.
    pub fn into_document(self, id: ObjectId, now: DateTime) -> Document {
        let mut document = doc! {
            field::ID: id,
            field::TYPE: self.message_type,
            field::PAYLOAD: Bson::from(self.payload),
            field::STATUS: status::PENDING,
            field::CREATED_AT: now,
            field::KEY_HASH: stored_key_hash(self.key.as_deref()),
        };
        let optional = [
            (field::CORRELATION_ID, self.correlation_id),
            (field::KEY, self.key),
            (field::SUBJECT, self.subject),
            (field::SOURCE, self.source),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                document.insert(name, value);
            }
        }
        if !self.headers.is_empty() {
            let headers: Document = self
                .headers
                .into_iter()
                .map(|(name, value)| (name, Bson::String(value)))
                .collect();
            document.insert(field::HEADERS, headers);
        }
        document
    }
}

/// A handle for adding messages to one outbox collection.
#[derive(Debug, Clone)]
pub struct Outbox {
    collection: Collection<Document>,
    rules: DecodeRules,
}

impl Outbox {
    /// The outbox in the default collection of `database`.
    pub fn new(database: &Database) -> Self {
        Self::with_collection(database, DEFAULT_COLLECTION)
    }

    /// The outbox in a named collection of `database`.
    pub fn with_collection(database: &Database, collection: &str) -> Self {
        Outbox {
            collection: database.collection(collection),
            rules: DecodeRules::any_relay(),
        }
    }

    /// Checks messages against a relay's own rules (its subject prefix,
    /// allow-list and subject template, and the broker's largest message)
    /// rather than only those every relay holds: with a template that names
    /// the key, a message without one is refused here.
    pub fn with_rules(mut self, rules: DecodeRules) -> Self {
        // A writer holds every message to the CloudEvents attribute rules,
        // whatever the relay's mode, which may change.
        self.rules = DecodeRules {
            attribute_rules: AttributeRules::Always,
            ..rules
        };
        self
    }

    /// Adds one message inside the session's transaction and returns its `_id`.
    pub async fn add(&self, session: &mut ClientSession, message: NewMessage) -> Result<ObjectId> {
        let mut ids = self.add_many(session, [message]).await?;
        Ok(ids.remove(0))
    }

    /// Adds several messages inside the session's transaction, in order, with
    /// one insert, and returns their `_id`s. If any message is invalid, none is
    /// written.
    pub async fn add_many(
        &self,
        session: &mut ClientSession,
        messages: impl IntoIterator<Item = NewMessage>,
    ) -> Result<Vec<ObjectId>> {
        let now = DateTime::now();
        let mut ids = Vec::new();
        let mut documents = Vec::new();
        for message in messages {
            message.check_extensions()?;
            let id = ObjectId::new();
            ids.push(id);
            documents.push(message.into_document(id, now));
        }
        for document in &documents {
            self.rules.decode(document).message?;
        }
        ensure_transaction(session).await?;
        if documents.is_empty() {
            return Ok(Vec::new());
        }
        self.collection
            .insert_many(documents)
            .session(session)
            .await
            .map_err(|e| Error::mongo("insert into the outbox failed", e))?;
        Ok(ids)
    }
}

/// Fails unless the session has a transaction in progress.
///
/// The driver does not expose the transaction state, but the transactions
/// specification requires `startTransaction` to fail with "transaction already
/// in progress" when one is. Without one, the probe starts a transaction and
/// aborts it at once; neither sends anything to the server.
async fn ensure_transaction(session: &mut ClientSession) -> Result<()> {
    match session.start_transaction().await {
        Err(e) if is_transaction_in_progress(&e) => Ok(()),
        Err(e) => Err(Error::mongo("cannot use the session for the outbox", e)),
        Ok(()) => {
            if let Err(e) = session.abort_transaction().await {
                tracing::debug!(error = %e, "aborting the probe transaction failed");
            }
            Err(Error::NoTransaction)
        }
    }
}

fn is_transaction_in_progress(error: &mongodb::error::Error) -> bool {
    matches!(&*error.kind, ErrorKind::Transaction { message, .. } if message.contains("in progress"))
}
