//! What flows between the stages of the relay.
//!
//! Sources turn outbox documents into [`Work`]; the publish stage turns work
//! into [`Finished`] work with a [`Verdict`]; the completion stage records
//! verdicts in MongoDB and moves the checkpoint. Work keeps its order from
//! source to completion, which is what lets the checkpoint advance to a
//! token only once everything before it is done.

use bson::{oid::ObjectId, Bson};
use mongodb::change_stream::event::ResumeToken;

use crate::contract::{ContractViolation, Decoded};

/// One unit of work: a message to deliver, a resume token to record once all
/// earlier work is done, or both.
#[derive(Debug)]
pub(crate) struct Work {
    /// The message, if this work carries one.
    pub message: Option<Decoded>,
    /// The change-stream position just after this work, if it came from the stream.
    pub token: Option<ResumeToken>,
    /// The claim (`lockId`) a sweep holds on the message; completion must match it.
    pub claim: Option<ObjectId>,
}

impl Work {
    /// A message from the change stream.
    pub fn from_stream(message: Decoded, token: ResumeToken) -> Self {
        Work {
            message: Some(message),
            token: Some(token),
            claim: None,
        }
    }

    /// A message read from the collection rather than the stream.
    pub fn from_collection(message: Decoded, claim: Option<ObjectId>) -> Self {
        Work {
            message: Some(message),
            token: None,
            claim,
        }
    }

    /// A stream position with no message (the stream moved past other events
    /// or was idle).
    pub fn marker(token: ResumeToken) -> Self {
        Work {
            message: None,
            token: Some(token),
            claim: None,
        }
    }

    pub fn id(&self) -> Option<&Bson> {
        self.message.as_ref().map(|m| &m.id)
    }
}

/// What became of one unit of work.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// The broker accepted the message.
    Delivered,
    /// The message breaks the contract; no retry can help.
    Rejected(ContractViolation),
    /// The broker refused this message in a way that may pass later.
    Refused(String),
    /// Nothing to deliver: a bare stream position.
    Passed,
}

/// Work with its verdict, on its way to completion.
#[derive(Debug)]
pub(crate) struct Finished {
    pub work: Work,
    pub verdict: Verdict,
}
