//! The consumer's stop, bounded whatever MongoDB or NATS do: the
//! transactions in flight are waited for until the shutdown timeout, then
//! abandoned; handing messages back and sending the last acknowledgements
//! take at most [`LAST_WORDS_WAIT`] more. So `Consumer::run` returns within
//! the two once `shutdown` fires, as the relay's stop is bounded by
//! `--shutdown-timeout` and its release's wait.
//!
//! What the consumer holds and has not settled as it stops is handed back
//! to JetStream here, in stream order, once no pull is open, so the
//! consumer started next receives each key's messages in their order.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::held::Held;
use super::settle::acknowledge;
use super::shared::Shared;

/// How long a stopping consumer may take, after its transactions, to hand
/// messages back and send its last acknowledgements (a NATS that does not
/// take them holds up neither past it).
pub const LAST_WORDS_WAIT: Duration = Duration::from_secs(5);

/// How the transactions in flight ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Finished {
    /// Each finished, and settled its message.
    All,
    /// The shutdown timeout ran out first: those still running were
    /// dropped, their messages left to come back after their ack wait.
    Abandoned,
}

/// Waits for the consumer's tasks to end, until `abandon` fires; then
/// drops those still running. A dropped transaction is aborted by the
/// server (its session ends), or, if its commit had been sent, may have
/// committed: the message's redelivery finds its record either way.
pub(super) async fn finish(tasks: &mut JoinSet<()>, abandon: &CancellationToken) -> Finished {
    let all_ended = async { while tasks.join_next().await.is_some() {} };
    // The abandon first: once it fired (a pull that never ended fires it
    // too), nothing may be handed back, even if no task is left.
    let finished = tokio::select! {
        biased;
        () = abandon.cancelled() => Finished::Abandoned,
        () = all_ended => Finished::All,
    };
    if finished == Finished::Abandoned {
        let running = tasks.len();
        tracing::warn!(
            running,
            "the consumer's shutdown timeout ran out with transactions in flight; they are \
             abandoned, and their messages, with every other message held, come back after \
             their ack wait"
        );
        // An aborted task ends at its next await, with its message neither
        // acknowledged nor handed back. It is not waited for: a handler
        // that blocks its thread never reaches an await, and would hold
        // the stop past its bound.
        tasks.abort_all();
        tasks.detach_all();
    }
    finished
}

/// Whether the last words were all said in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LastWords {
    Said,
    /// NATS did not take them within [`LAST_WORDS_WAIT`]: what was not
    /// handed back or acknowledged comes back after its ack wait, as
    /// after a crash.
    CutShort,
}

/// Hands back what the consumer holds, unless it abandoned transactions,
/// then sends the acknowledgements still buffered, so a process that exits
/// next does not lose them; within [`LAST_WORDS_WAIT`] in all.
///
/// After an abandon nothing is handed back: an abandoned message of a key
/// comes back only after its ack wait, and a later message of that key
/// handed back now would come before it.
pub(super) async fn last_words(shared: &Shared, finished: Finished) -> LastWords {
    let said = async {
        if finished == Finished::All {
            shared.hand_back().await;
        }
        // Acknowledgements are buffered publishes.
        shared.nats.flush().await
    };
    match tokio::time::timeout(LAST_WORDS_WAIT, said).await {
        Ok(Ok(())) => LastWords::Said,
        Ok(Err(_)) | Err(_) => {
            tracing::warn!(
                "sending the last acknowledgements failed; JetStream will redeliver those \
                 messages after their ack wait"
            );
            LastWords::CutShort
        }
    }
}

impl Shared {
    /// Keeps messages left as the consumer stops, to be handed back.
    pub(super) fn keep_for_handing_back(&self, held: impl IntoIterator<Item = Held>) {
        let mut handed_back = self.handed_back.lock().unwrap_or_else(|e| e.into_inner());
        handed_back.extend(held);
    }

    /// Hands every message left back to JetStream (a negative
    /// acknowledgement without delay) in stream order, so that each key's
    /// come back in its order, ahead of its later messages. Run once no
    /// pull is open: a pull still open would take a message handed back
    /// ahead of those handed back after it.
    pub(super) async fn hand_back(&self) {
        let mut left =
            std::mem::take(&mut *self.handed_back.lock().unwrap_or_else(|e| e.into_inner()));
        left.sort_by_key(|held| held.delivery.stream_sequence);
        for held in left {
            acknowledge(&held.message, AckKind::Nak(None)).await;
        }
    }
}
