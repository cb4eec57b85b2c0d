//! The error type of the library.
//!
//! One enum whose variants are the kinds a caller may want to tell apart: a
//! refused writer call, a bad setting, an unreachable or failing server. Each
//! message says what went wrong and what to do, and never carries a password.

use std::time::Duration;

use crate::contract::ContractViolation;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the writer, the relay or its set-up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The writer was given a session with no active transaction; nothing was written.
    #[error(
        "the session has no active transaction: call session.start_transaction() before adding \
         outbox messages, so that the message commits or aborts with the business write"
    )]
    NoTransaction,

    /// A message given to the writer breaks the document contract; nothing was written.
    #[error("invalid outbox message: {0}")]
    InvalidMessage(#[from] ContractViolation),

    /// A payload could not be serialized to a BSON document.
    #[error("the payload cannot be stored as a BSON document: {0}")]
    Payload(String),

    /// A setting (flag, environment variable or config file entry) is wrong.
    #[error("configuration error: {0}")]
    Config(String),

    /// MongoDB could not be reached or refused an operation.
    #[error("MongoDB: {context}: {}", brief(source))]
    Mongo {
        context: String,
        #[source]
        source: mongodb::error::Error,
    },

    /// NATS could not be reached or refused an operation.
    #[error("NATS: {context}: {message}")]
    Nats { context: String, message: String },

    /// A start-up check failed: the deployment cannot serve the relay yet.
    #[error("{message}")]
    Check { kind: CheckKind, message: String },

    /// A bounded run (`sweep --once`) gave up waiting for the servers.
    #[error("gave up: {0}")]
    GaveUp(String),

    /// A graceful stop did not finish in time.
    #[error("shutdown did not finish within {0:?}; undelivered messages stay pending and are delivered after restart")]
    ShutdownTimeout(Duration),
}

/// The start-up checks, each failing with its own exit code so scripts and
/// orchestrators can tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CheckKind {
    /// MongoDB cannot be reached, or refused the connection.
    MongodbUnreachable,
    /// MongoDB is a standalone server: no change streams or transactions.
    NotReplicaSet,
    /// The outbox collection or its indexes cannot be prepared.
    OutboxSetup,
    /// NATS cannot be reached.
    NatsUnreachable,
    /// No JetStream stream captures the relay's subjects.
    NoStream,
    /// The stream forgets message ids sooner than the relay may redeliver.
    DuplicateWindow,
}

impl CheckKind {
    /// The process exit code for this failure (2 is a bad setting, 1 any
    /// other error).
    pub fn exit_code(self) -> u8 {
        match self {
            CheckKind::MongodbUnreachable => 3,
            CheckKind::NotReplicaSet => 4,
            CheckKind::OutboxSetup => 5,
            CheckKind::NatsUnreachable => 6,
            CheckKind::NoStream => 7,
            CheckKind::DuplicateWindow => 8,
        }
    }
}

impl Error {
    /// The process exit code for this error: a failed check's own code,
    /// 2 for a bad setting, 9 for a bounded run that gave up, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Check { kind, .. } => kind.exit_code(),
            Error::Config(_) => 2,
            Error::GaveUp(_) => 9,
            _ => 1,
        }
    }

    pub(crate) fn check(kind: CheckKind, message: impl Into<String>) -> Self {
        Error::Check {
            kind,
            message: message.into(),
        }
    }

    pub(crate) fn mongo(context: impl Into<String>, source: mongodb::error::Error) -> Self {
        Error::Mongo {
            context: context.into(),
            source,
        }
    }

    pub(crate) fn nats(context: impl Into<String>, err: impl std::fmt::Display) -> Self {
        Error::Nats {
            context: context.into(),
            message: err.to_string(),
        }
    }
}

/// A driver error in one line: the server's code and message, or the kind of
/// failure without the driver's topology description.
pub(crate) fn brief(error: &mongodb::error::Error) -> String {
    use mongodb::error::ErrorKind;
    match &*error.kind {
        ErrorKind::Command(command) => format!(
            "{} (code {} {})",
            command.message, command.code, command.code_name
        ),
        ErrorKind::ServerSelection { .. } => {
            "no server answered in time (is it running, and is the address right?)".to_owned()
        }
        _ => {
            let text = error.kind.to_string();
            match text.find(" Topology:") {
                Some(end) => text[..end].to_owned(),
                None => text,
            }
        }
    }
}

/// Whether a MongoDB write failed because of the documents it touched, so
/// that no retry of the same write can succeed: a type mismatch, a
/// validator's refusal, a document over 16 MiB, and the like. Anything else
/// (network, elections, write conflicts, timeouts, a missing permission)
/// concerns the server or the deployment and is worth retrying.
pub(crate) fn is_document_error(error: &mongodb::error::Error) -> bool {
    use mongodb::error::{ErrorKind, WriteFailure};
    /// BadValue, TypeMismatch, DollarPrefixedFieldName (52), ImmutableField
    /// (66), PathNotViable (28), ConflictingUpdateOperators (40),
    /// DocumentValidationFailure (121), BSONObjectTooLarge (10334),
    /// DuplicateKey (11000), Location17419 (document grew too large),
    /// KeyTooLong (17280), Location16837 (path conflict).
    const DOCUMENT_CODES: [i32; 12] = [
        2, 14, 28, 40, 52, 66, 121, 10334, 11000, 16837, 17280, 17419,
    ];
    let code = match &*error.kind {
        ErrorKind::Write(WriteFailure::WriteError(write)) => write.code,
        ErrorKind::Command(command) => command.code,
        _ => return false,
    };
    DOCUMENT_CODES.contains(&code)
}
