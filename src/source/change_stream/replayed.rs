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
//!   are held back in chunks while the stream replays (up to the server's
//!   time when it opened, or its first read that finds nothing more
//!   committed), and one read of each chunk's ids asks the collection
//!   which are settled already: those are passed on as bare positions, the
//!   rest as messages. A takeover then repeats only what was in flight
//!   when its predecessor stopped. Settled is delivered (found, and no
//!   longer pending) or gone: the read is made causally after the newest
//!   event of the chunk (`afterClusterTime`, on any member it reaches), so
//!   a document it does not find was deleted after it was committed, by
//!   `--retention`, `dlq discard` or by hand. Such a message is not
//!   published again however old the position replayed from: one delivered
//!   and deleted must not come back, and one deleted before delivery is
//!   one the collection no longer holds, which no sweep would deliver
//!   either. If the read fails, the whole chunk is passed on: a repeat is
//!   allowed, a loss is not.
//! - **A driver's resume.** After a resumable error the driver reopens the
//!   stream from the position it holds itself, and it may be an earlier
//!   one than the last event it returned (a resume that is itself retried
//!   starts from where the stream was first opened). Events come in commit
//!   order, so [`Seen`] drops an event of an earlier commit than the newest
//!   passed on, or of the same commit (a transaction's events share its
//!   cluster time) with an id already passed on.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;
use tokio_util::sync::CancellationToken;

use crate::contract::{field, status};

/// How many events a replay's window holds back for one read, at most.
pub(super) const CHUNK: usize = 256;

/// How many bytes of documents a replay's window holds back, at most.
pub(super) const CHUNK_BYTES: usize = 4 << 20;

/// How long a replay's window holds messages back while a read has not
/// come back: a replay that reached the present on a quiet outbox would
/// otherwise hold its last messages for a whole `--max-await-time`.
pub(super) const HELD_AT_MOST: Duration = Duration::from_millis(500);

/// The longest a read the stream waits on may take (the server's
/// `maxTimeMS`; the wait itself is cut at twice that): a server that holds
/// it up costs a repeat or a late delivery, never a stalled stream.
pub(crate) const READ_LIMIT: Duration = Duration::from_secs(5);

/// Whether the stream is still replaying what was committed before it
/// opened, or tails what commits now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Window {
    /// Opened just after a stored position: what it reads up to the
    /// server's time when it opened (where the server said it) may have
    /// been delivered by a predecessor.
    Replaying { until: Option<bson::Timestamp> },
    /// Caught up, or opened at a catch-up pass's snapshot (the pass's own
    /// messages are skipped by `CaughtUp`).
    Live,
}

impl Window {
    /// Whether a replay's window is over before an event committed at
    /// `at`: it committed after the stream opened. An event without a
    /// time, or a window without one, ends it only by a read that finds
    /// nothing more committed.
    pub(super) fn ends_before(&self, at: Option<bson::Timestamp>) -> bool {
        match (self, at) {
            (Window::Replaying { until: Some(until) }, Some(at)) => at > *until,
            _ => false,
        }
    }
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

/// Which of `ids` need no publish: delivered already (found, and no
/// longer pending), or, where `after` is the newest commit among them, gone
/// (not found by a read causally after it). `None` if the read failed, took
/// longer than [`READ_LIMIT`], or the relay stopped first; the caller then
/// passes them all on.
pub(super) async fn settled(
    outbox: &Collection<Document>,
    ids: Vec<ObjectId>,
    after: Option<bson::Timestamp>,
    shutdown: &CancellationToken,
) -> Option<HashSet<ObjectId>> {
    if ids.is_empty() {
        return Some(HashSet::new());
    }
    let count = ids.len();
    let read = read_statuses(outbox, &ids, after);
    let found = tokio::select! {
        _ = shutdown.cancelled() => return None,
        found = tokio::time::timeout(READ_LIMIT * 2, read) => found,
    };
    let failure = match found {
        Ok(Ok(found)) => {
            let pending: HashMap<ObjectId, bool> = found
                .iter()
                .filter_map(|document| {
                    let id = document.get_object_id(field::ID).ok()?;
                    Some((id, document.get_str(field::STATUS) == Ok(status::PENDING)))
                })
                .collect();
            return Some(
                ids.into_iter()
                    .filter(|id| match pending.get(id) {
                        Some(pending) => !pending,
                        None => after.is_some(),
                    })
                    .collect(),
            );
        }
        Ok(Err(error)) => crate::error::brief(&error),
        Err(_) => "it took too long".to_owned(),
    };
    tracing::warn!(
        error = %failure,
        count,
        "could not read which of the replayed messages were delivered already; \
         passing them all on (JetStream drops repeats within its duplicate window)"
    );
    None
}

/// The `_id` and status of those of `ids` the outbox holds, read by `_id`
/// alone (which every server reads by index; the status is judged by the
/// caller) and, given `after`, causally after it: the read sees every
/// write committed up to then, or waits until it can.
async fn read_statuses(
    outbox: &Collection<Document>,
    ids: &[ObjectId],
    after: Option<bson::Timestamp>,
) -> mongodb::error::Result<Vec<Document>> {
    let mut session = outbox.client().start_session().await?;
    if let Some(after) = after {
        session.advance_operation_time(after);
    }
    let mut found = outbox
        .find(doc! { field::ID: { "$in": ids } })
        .projection(doc! { field::ID: 1, field::STATUS: 1 })
        .max_time(READ_LIMIT)
        .session(&mut session)
        .await?;
    found.stream(&mut session).try_collect().await
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
    fn a_replay_window_ends_at_the_first_event_after_the_stream_opened() {
        let window = Window::Replaying { until: at(5) };
        assert!(!window.ends_before(at(5)), "committed before it opened");
        assert!(window.ends_before(at(6)), "committed after");
        assert!(!window.ends_before(None), "an event without a time");
        let untimed = Window::Replaying { until: None };
        assert!(!untimed.ends_before(at(6)), "a window without a time");
        assert!(!Window::Live.ends_before(at(6)));
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
