//! The error type of the library.
//!
//! One enum whose variants are the kinds a caller may want to tell apart: a
//! refused writer call, a bad setting, an unreachable or failing server, a
//! file that cannot be written, a stored document that cannot be read, a
//! fault of the relay itself. Each message says what went wrong and what to
//! do, and never carries a password; the driver's error stays reachable as
//! the `source`. Each kind has one exit code ([`Error::exit_code`]), and a
//! code means only what docs/operating.md says it means.

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

    /// A setting (flag, environment variable or config file entry) is wrong,
    /// or a command was given the wrong flags.
    #[error("configuration error: {0}")]
    Config(String),

    /// MongoDB could not be reached or refused an operation.
    #[error("MongoDB: {context}: {}", brief(source))]
    Mongo {
        context: String,
        #[source]
        source: mongodb::error::Error,
    },

    /// NATS refused an operation.
    #[error("NATS: {context}: {source}")]
    Nats {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A start-up check failed: the deployment cannot serve the relay yet.
    #[error("{message}")]
    Check { kind: CheckKind, message: String },

    /// A bounded run (`sweep --once`) gave up waiting for the servers.
    #[error("gave up: {0}")]
    GaveUp(String),

    /// A file or the terminal could not be read or written.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    /// A document the relay keeps (its checkpoint) cannot be read. The relay
    /// starts over from the pending messages, and its next checkpoint
    /// replaces the document.
    #[error("{0}")]
    StoredState(String),

    /// Another run took over what this one held (a replay whose hold
    /// lapsed): this run stopped, and the other goes on. Or another relay
    /// changed the group this one was joining: it tries again.
    #[error("{0}")]
    TakenOver(String),

    /// A server answered in a way its protocol does not allow.
    #[error("unexpected reply: {0}")]
    Protocol(String),

    /// A part of the relay failed in a way it never should: a bug.
    #[error("internal error: {0}; please report it")]
    Internal(String),

    /// The benchmark could not measure what it set out to.
    #[error("benchmark: {0}")]
    Bench(String),

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
    /// NATS refused the relay's credentials, or the TLS handshake failed.
    NatsRefused,
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
            CheckKind::NatsRefused => 10,
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
            Error::NoTransaction
            | Error::InvalidMessage(_)
            | Error::Payload(_)
            | Error::Mongo { .. }
            | Error::Nats { .. }
            | Error::Io { .. }
            | Error::StoredState(_)
            | Error::TakenOver(_)
            | Error::Protocol(_)
            | Error::Internal(_)
            | Error::Bench(_)
            | Error::ShutdownTimeout(_) => 1,
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

    pub(crate) fn nats(
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Error::Nats {
            context: context.into(),
            source: Box::new(source),
        }
    }

    /// Where MongoDB refused the operation to the relay's user, says which
    /// privilege the user lacks: `action` on `resource` (a collection, or
    /// a database for a database's action). Any other error is unchanged.
    pub(crate) fn needing(self, action: &str, resource: impl std::fmt::Display) -> Self {
        match self {
            Error::Mongo { context, source } if is_unauthorized(&source) => {
                let actions = if action.contains(" and ") {
                    "actions"
                } else {
                    "action"
                };
                Error::Mongo {
                    context: format!(
                        "{context}: the relay's user needs the {action} {actions} on {resource} \
                         (docs/configuration.md#permissions)"
                    ),
                    source,
                }
            }
            other => other,
        }
    }

    /// An I/O failure, with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Lets the writer's errors pass through the driver's convenient
/// transaction API (`start_transaction().and_run2(..)`): a MongoDB error
/// comes back as itself, with its labels, so a transient one runs the
/// transaction again; any other ends it with this error inside.
impl From<Error> for mongodb::error::Error {
    fn from(error: Error) -> Self {
        match error {
            Error::Mongo { source, .. } => source,
            other => mongodb::error::Error::custom(other),
        }
    }
}

/// A driver error in one line: the server's code and message, or the kind of
/// failure without the driver's topology description.
pub(crate) fn brief(error: &mongodb::error::Error) -> String {
    use mongodb::error::{ErrorKind, WriteFailure};
    match &*error.kind {
        ErrorKind::Command(command) => {
            format!(
                "{} {}",
                command.message,
                code(command.code, &command.code_name)
            )
        }
        ErrorKind::ServerSelection { .. } => {
            "no server answered in time (is it running, and is the address right?)".to_owned()
        }
        ErrorKind::Write(WriteFailure::WriteConcernError(concern)) => format!(
            "the write concern was not met: {} {}",
            concern.message,
            code(concern.code, &concern.code_name)
        ),
        ErrorKind::Write(WriteFailure::WriteError(write)) => {
            let name = write.code_name.as_deref().unwrap_or("");
            match &write.details {
                // A validator's refusal says why in its details.
                Some(details) => format!("{} {}: {details}", write.message, code(write.code, name)),
                None => format!("{} {}", write.message, code(write.code, name)),
            }
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

/// A server's error code, with its name where the server gave one.
fn code(code: i32, name: &str) -> String {
    if name.is_empty() {
        format!("(code {code})")
    } else {
        format!("(code {code} {name})")
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

/// The code of a command's failure, if the server refused a command.
pub(crate) fn command_code(error: &mongodb::error::Error) -> Option<i32> {
    match &*error.kind {
        mongodb::error::ErrorKind::Command(command) => Some(command.code),
        _ => None,
    }
}

/// Whether the server gave up on an operation at its time limit
/// (MaxTimeMSExpired, 50).
pub(crate) fn is_max_time_expired(error: &mongodb::error::Error) -> bool {
    const MAX_TIME_MS_EXPIRED: i32 = 50;
    command_code(error) == Some(MAX_TIME_MS_EXPIRED)
}

/// Whether the server refused an operation to this user (Unauthorized, 13).
pub(crate) fn is_unauthorized(error: &mongodb::error::Error) -> bool {
    const UNAUTHORIZED: i32 = 13;
    command_code(error) == Some(UNAUTHORIZED)
}

/// Whether a write failed on a unique index (DuplicateKey, 11000).
pub(crate) fn is_duplicate_key(error: &mongodb::error::Error) -> bool {
    use mongodb::error::{ErrorKind, WriteFailure};
    const DUPLICATE_KEY: i32 = 11000;
    match &*error.kind {
        ErrorKind::Write(WriteFailure::WriteError(write)) => write.code == DUPLICATE_KEY,
        ErrorKind::Command(command) => command.code == DUPLICATE_KEY,
        _ => false,
    }
}

/// Whether a MongoDB operation failed because the deployment could not be
/// reached or could not serve anyone (down, electing, shutting down, or
/// refusing this user), rather than because of what the operation was: a
/// failure no message is to blame for.
pub(crate) fn is_unreachable(error: &mongodb::error::Error) -> bool {
    use mongodb::error::{ErrorKind, WriteFailure};
    /// HostUnreachable (6), HostNotFound (7), Unauthorized (13),
    /// AuthenticationFailed (18), WriteConcernFailed (64, no majority to
    /// acknowledge), NetworkTimeout (89), ShutdownInProgress (91),
    /// ReadConcernMajorityNotAvailableYet (134), PrimarySteppedDown (189),
    /// ExceededTimeLimit (262), ReauthenticationRequired (391),
    /// SocketException (9001), NotWritablePrimary (10107), LegacyNotPrimary
    /// (10058), InterruptedAtShutdown (11600),
    /// InterruptedDueToReplStateChange (11602), NotPrimaryNoSecondaryOk
    /// (13435), NotPrimaryOrSecondary (13436).
    const DEPLOYMENT_CODES: [i32; 18] = [
        6, 7, 13, 18, 64, 89, 91, 134, 189, 262, 391, 9001, 10058, 10107, 11600, 11602, 13435,
        13436,
    ];
    // The driver labels what a retry may mend for the deployment's sake.
    if error.contains_label("RetryableWriteError") {
        return true;
    }
    match &*error.kind {
        ErrorKind::Io(_)
        | ErrorKind::ServerSelection { .. }
        | ErrorKind::ConnectionPoolCleared { .. }
        | ErrorKind::DnsResolve { .. }
        | ErrorKind::Authentication { .. } => true,
        ErrorKind::Command(command) => DEPLOYMENT_CODES.contains(&command.code),
        ErrorKind::Write(WriteFailure::WriteConcernError(concern)) => {
            DEPLOYMENT_CODES.contains(&concern.code)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind of failure keeps to the exit code docs/operating.md gives
    /// it, and the table there lists every code the relay exits with.
    #[test]
    fn each_kind_has_its_documented_exit_code() {
        let guide = include_str!("../docs/operating.md");
        let documented: Vec<u8> = guide
            .lines()
            .filter_map(|line| line.strip_prefix("| "))
            .filter_map(|row| row.split(' ').next()?.parse().ok())
            .collect();
        // 130: a second signal ends the process at once (main.rs).
        let exits: Vec<u8> = (0..=10).chain([130]).collect();
        assert_eq!(documented, exits, "the exit code table");
        let io = || std::io::Error::other("disk full");
        let cases = [
            (Error::Config("x".into()), 2),
            (Error::GaveUp("x".into()), 9),
            (Error::check(CheckKind::MongodbUnreachable, "x"), 3),
            (Error::check(CheckKind::NotReplicaSet, "x"), 4),
            (Error::check(CheckKind::OutboxSetup, "x"), 5),
            (Error::check(CheckKind::NatsUnreachable, "x"), 6),
            (Error::check(CheckKind::NoStream, "x"), 7),
            (Error::check(CheckKind::DuplicateWindow, "x"), 8),
            (Error::check(CheckKind::NatsRefused, "x"), 10),
            (Error::io("writing", io()), 1),
            (Error::StoredState("x".into()), 1),
            (Error::TakenOver("x".into()), 1),
            (Error::Protocol("x".into()), 1),
            (Error::Internal("x".into()), 1),
            (Error::Bench("x".into()), 1),
            (Error::nats("x", io()), 1),
            (Error::ShutdownTimeout(Duration::from_secs(1)), 1),
            (Error::NoTransaction, 1),
        ];
        for (error, code) in cases {
            assert_eq!(error.exit_code(), code, "{error:?}");
        }
    }

    #[test]
    fn nats_and_io_errors_keep_their_source() {
        use std::error::Error as _;
        let error = Error::nats("creating the stream", std::io::Error::other("denied"));
        assert_eq!(
            error.source().map(|s| s.to_string()).as_deref(),
            Some("denied")
        );
        let error = Error::io("writing bench.json", std::io::Error::other("disk full"));
        assert!(error.source().is_some());
        assert_eq!(error.to_string(), "writing bench.json: disk full");
    }
}
