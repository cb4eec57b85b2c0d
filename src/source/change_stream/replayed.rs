//! What a stream brings that was delivered already, and is not sent again.
//!
//! Two kinds of repeat reach the source:
//!
//! - **A replay's window.** A stream opened just after a stored position
//!   replays every message committed since, and the position is stored
//!   less often than messages are marked (the completion stage writes it
//!   after its marks, at most every `--checkpoint-interval`). So a new
//!   leader, or a relay restarted, reads again what its predecessor had
//!   published and marked since its last stored position. Those messages
//!   are held back in chunks while the stream replays (until its first
//!   read that finds nothing more committed), and one read of each chunk's
//!   ids asks the collection which are still pending: only those are
//!   passed on, the rest as bare positions. A takeover then repeats only
//!   what was in flight when its predecessor stopped. If the read fails,
//!   the whole chunk is passed on: a repeat is allowed, a loss is not.
//! - **A driver's resume.** After a resumable error the driver reopens the
//!   stream from the position it holds itself, and it may be an earlier
//!   one than the last event it returned (a resume that is itself retried
//!   starts from where the stream was first opened). Events come in commit
//!   order, so [`Seen`] drops an event of an earlier commit than the newest
//!   passed on, or of the same commit (a transaction's events share its
//!   cluster time) with an id already passed on.

use std::collections::HashSet;

use bson::{doc, oid::ObjectId, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status};

/// How many events a replay's window holds back for one read, at most.
pub(super) const CHUNK: usize = 256;

/// How many bytes of documents a replay's window holds back, at most.
pub(super) const CHUNK_BYTES: usize = 4 << 20;

/// Whether the stream is still replaying what was committed before it
/// opened, or tails what commits now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Window {
    /// Opened just after a stored position, and not yet caught up to the
    /// present: what it reads may have been delivered by a predecessor.
    Replaying,
    /// Caught up, or opened at a catch-up pass's snapshot (the pass's own
    /// messages are skipped by `CaughtUp`).
    Live,
}

/// The newest commit the stream passed on: its cluster time, and the ids
/// of its messages passed on so far.
#[derive(Debug, Default)]
pub(super) struct Seen {
    time: Option<bson::Timestamp>,
    ids: HashSet<ObjectId>,
}

impl Seen {
    /// Whether a message committed at `time` repeats one passed on already;
    /// if not, it is remembered. An event without either is never judged
    /// a repeat.
    pub(super) fn repeats(&mut self, time: Option<bson::Timestamp>, id: Option<ObjectId>) -> bool {
        let (Some(time), Some(id)) = (time, id) else {
            return false;
        };
        match self.time {
            Some(newest) if time < newest => true,
            Some(newest) if time == newest => !self.ids.insert(id),
            _ => {
                self.time = Some(time);
                self.ids.clear();
                self.ids.insert(id);
                false
            }
        }
    }
}

/// The `_id` of a message as the stream carried it, if it is an ObjectId
/// (the contract's; any other is rejected when decoded).
pub(super) fn id_of(document: &RawDocumentBuf) -> Option<ObjectId> {
    document.get_object_id(field::ID).ok()
}

/// Which of `ids` are no longer pending in the outbox: delivered, failed,
/// or gone. `None` if the read failed or the relay stopped first, and the
/// caller passes them all on.
pub(super) async fn delivered(
    outbox: &Collection<Document>,
    ids: Vec<ObjectId>,
    shutdown: &CancellationToken,
) -> Option<HashSet<ObjectId>> {
    if ids.is_empty() {
        return Some(HashSet::new());
    }
    let read = async {
        outbox
            .find(doc! { field::ID: { "$in": &ids }, field::STATUS: status::PENDING })
            .projection(doc! { field::ID: 1 })
            .await?
            .try_collect::<Vec<Document>>()
            .await
    };
    let pending = tokio::select! {
        _ = shutdown.cancelled() => return None,
        read = read => read,
    };
    match pending {
        Ok(pending) => {
            let pending: HashSet<ObjectId> = pending
                .iter()
                .filter_map(|document| document.get_object_id(field::ID).ok())
                .collect();
            Some(ids.into_iter().filter(|id| !pending.contains(id)).collect())
        }
        Err(error) => {
            tracing::warn!(
                error = %crate::error::brief(&error),
                count = ids.len(),
                "could not read which of the replayed messages were delivered already; \
                 passing them all on (JetStream drops repeats within its duplicate window)"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use bson::Timestamp;

    use super::*;

    fn at(increment: u32) -> Option<Timestamp> {
        Some(Timestamp {
            time: 1_800_000_000,
            increment,
        })
    }

    #[test]
    fn an_event_of_an_earlier_commit_or_an_id_passed_on_repeats() {
        let (a, b, c) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
        let mut seen = Seen::default();
        assert!(!seen.repeats(at(5), Some(a)), "the first");
        assert!(
            !seen.repeats(at(5), Some(b)),
            "the same transaction, another id"
        );
        assert!(seen.repeats(at(5), Some(a)), "the same commit and id again");
        assert!(!seen.repeats(at(6), Some(c)), "a later commit");
        assert!(
            seen.repeats(at(5), Some(b)),
            "an earlier commit, resumed from too early"
        );
        assert!(!seen.repeats(None, Some(a)), "no time: never judged");
        assert!(!seen.repeats(at(7), None), "no id: never judged");
    }
}
