//! Telling a relay's rounds when its group changes, so that a settled group
//! costs no reads.
//!
//! A round reads the whole group. Most of what changes it is a write: a
//! relay joins, leaves or joins anew, a lease is taken or released, the
//! count changes. A change stream on the group's documents in the
//! checkpoint collection hears each as it commits, and wakes the rounds
//! (MongoDB answers an awaiting read as soon as a change commits, so a
//! graceful hand-over is taken at once, as with a poll). What changes with
//! no write (a lease or an announcement lapses) the rounds time themselves,
//! from the expiries the last view showed.
//!
//! Renewals are left out: each member writes its own every half lease, and
//! a partition's checkpoint is written into its lease's document, so a
//! stream that passed them on would wake every relay at every renewal and
//! every checkpoint.
//!
//! Until the stream is open (the server or the credentials refuse it, or
//! it broke and is opened again), the rounds poll every
//! `--standby-poll-interval`, as they would with no stream at all. Each
//! opening wakes a round, which reads whatever changed while it was shut.

use std::sync::Arc;
use std::time::Duration;

use bson::{doc, DateTime, Document};
use mongodb::Collection;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// What the rounds hear from the watch.
#[derive(Debug, Clone)]
pub struct Changes {
    changed: Arc<Notify>,
    open: watch::Receiver<bool>,
}

impl Changes {
    /// Resolves when the group changed since the last call returned (or,
    /// the first time, since the watch began), or when the stream opened.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Whether the stream is open, so that a change wakes the rounds
    /// rather than their next poll finding it.
    pub fn open(&self) -> bool {
        *self.open.borrow()
    }

    /// Resolves once the stream is not open (at once if it is not): the
    /// rounds poll from then on.
    pub async fn closed(&self) {
        let mut open = self.open.clone();
        // The sender lives as long as the watch's task; a watch that ended
        // is as closed as one that broke.
        let _ = open.wait_for(|open| !open).await;
    }
}

/// How long one read of the stream waits for a change before it is sent
/// again: every read is an operation on the server, and a change ends the
/// wait at once, so it is long.
pub const MAX_AWAIT: Duration = Duration::from_secs(30);

/// How long past [`MAX_AWAIT`] a read may take before the stream is taken
/// for broken and opened again.
const ANSWER_MARGIN: Duration = Duration::from_secs(30);

/// Pauses between attempts to open the stream, growing to the last.
const REOPEN_PAUSES: [Duration; 4] = [
    Duration::from_secs(1),
    Duration::from_secs(5),
    Duration::from_secs(15),
    Duration::from_secs(60),
];

/// Watches the group of the outbox `outbox` (`<db>.<collection>`) in
/// `documents` until `shutdown`, waking [`Changes`] at each change.
pub fn start(
    documents: Collection<Document>,
    outbox: &str,
    shutdown: CancellationToken,
) -> Changes {
    let changed = Arc::new(Notify::new());
    let (opened, open) = watch::channel(false);
    let pipeline = pipeline(outbox);
    tokio::spawn({
        let changed = Arc::clone(&changed);
        async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = run(documents, pipeline, changed, &opened) => {}
            }
            opened.send_replace(false);
        }
    });
    Changes { changed, open }
}

/// Opens the stream, and passes each change on, opening it again when it
/// ends; forever (its caller stops it).
async fn run(
    documents: Collection<Document>,
    pipeline: Vec<Document>,
    changed: Arc<Notify>,
    opened: &watch::Sender<bool>,
) {
    let mut failures = 0_usize;
    loop {
        let stream = documents
            .watch()
            .pipeline(pipeline.clone())
            .max_await_time(MAX_AWAIT)
            .await;
        match stream {
            Ok(mut stream) => {
                failures = 0;
                opened.send_replace(true);
                changed.notify_one();
                // Each read is bounded: one the server never answers (a
                // connection cut without a word) would leave the rounds
                // waiting on a watch that hears nothing.
                let ended = loop {
                    let read =
                        tokio::time::timeout(MAX_AWAIT + ANSWER_MARGIN, stream.next_if_any());
                    match read.await {
                        Ok(Ok(Some(_))) => changed.notify_one(),
                        Ok(Ok(None)) if stream.is_alive() => {}
                        Ok(Ok(None)) => break "it ended".to_owned(),
                        Ok(Err(error)) => break crate::error::brief(&error),
                        Err(_) => {
                            break format!(
                                "a read went unanswered for {:?}",
                                MAX_AWAIT + ANSWER_MARGIN
                            )
                        }
                    }
                };
                opened.send_replace(false);
                tracing::debug!(
                    why = %ended,
                    "the watch on the group of relays closed: its rounds poll until it is open again"
                );
            }
            Err(error) => {
                if failures == 0 {
                    tracing::info!(
                        error = %crate::error::brief(&error),
                        "cannot watch the group of relays (the server or the credentials refuse \
                         a change stream on the checkpoint collection): its rounds poll every \
                         --standby-poll-interval instead"
                    );
                }
                failures += 1;
            }
        }
        let pause = REOPEN_PAUSES[failures.min(REOPEN_PAUSES.len() - 1)];
        tokio::time::sleep(pause).await;
    }
}

/// The changes to `outbox`'s group that a round acts on: whatever inserts,
/// replaces or removes one of its documents, and the updates that take or
/// release a lease, join a relay anew or change the count. Renewals and
/// checkpoints, which set none of those fields, are left out (see the
/// module's doc).
fn pipeline(outbox: &str) -> Vec<Document> {
    let ours = format!("^{}(/|:[0-9]|$)", super::regex_escaped(outbox));
    let set = |field: &str| doc! { format!("updateDescription.updatedFields.{field}"): { "$exists": true } };
    vec![doc! { "$match": {
        "documentKey._id": { "$regex": ours },
        "$or": [
            { "operationType": { "$ne": "update" } },
            set("owner"),
            set("term"),
            set("joinedAt"),
            set("partitions"),
            // A release sets the expiry to the epoch.
            { "updateDescription.updatedFields.expiresAt": DateTime::from_millis(0) },
        ],
    } }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_matches_the_groups_documents_and_no_other_outbox() {
        let pipeline = pipeline("app.outbox");
        let stage = pipeline[0].get_document("$match").expect("a match");
        let ours = stage
            .get_document("documentKey._id")
            .and_then(|id| id.get_str("$regex"))
            .expect("a pattern");
        assert_eq!(ours, r"^app\.outbox(/|:[0-9]|$)");
    }
}
