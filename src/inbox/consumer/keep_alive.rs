//! Held messages kept from redelivery: an in-progress acknowledgement for
//! each, a third of the ack wait apart, sent in the order the messages came
//! (each key's stream order), so that after a crash JetStream, which
//! redelivers as ack waits run out, gives them back in that order.
//!
//! What the consumer's tasks and the keeper share of it is its own
//! [`Keeping`], not the consumer's whole state: a held message's entry
//! points back to it alone.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use async_nats::Subject;
use bytes::Bytes;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The held messages kept from redelivery, shared by the consumer's tasks,
/// which hold them, and its keeper, which sends their acknowledgements.
#[derive(Default)]
pub(super) struct Keeping {
    /// The reply subjects of held messages, kept from redelivery.
    kept: Mutex<KeptAlive>,
    /// Told when an acknowledgement is due before the keeper's next round.
    keep_now: Notify,
}

#[derive(Default)]
struct KeptAlive {
    next: u64,
    /// By the order the messages came in, which is each key's stream
    /// order: JetStream redelivers a dead consumer's messages in the order
    /// their ack waits run out, so they are refreshed in this order.
    subjects: BTreeMap<u64, Subject>,
    /// In-progress acknowledgements to send, in the order due: the keeper
    /// alone sends them, so they reach JetStream in this order.
    due: VecDeque<Subject>,
}

/// A held message's entry among those kept alive.
pub(super) struct KeptEntry {
    keeping: Arc<Keeping>,
    number: u64,
}

impl Drop for KeptEntry {
    fn drop(&mut self) {
        let mut kept = self.keeping.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.subjects.remove(&self.number);
    }
}

impl Keeping {
    /// Registers a held message to be kept from redelivery. A keyed one is
    /// acknowledged in progress at once, after those already due: its ack
    /// wait runs from its delivery, which JetStream may have made before
    /// it received the keeper's last round for the key's earlier messages,
    /// and after a crash it would then come back ahead of them.
    pub(super) fn keep(self: &Arc<Self>, message: &jetstream::Message, keyed: bool) -> KeptEntry {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.next += 1;
        let number = kept.next;
        if let Some(reply) = &message.reply {
            kept.subjects.insert(number, reply.clone());
            if keyed {
                kept.due.push_back(reply.clone());
                self.keep_now.notify_one();
            }
        }
        KeptEntry {
            keeping: self.clone(),
            number,
        }
    }
}

/// Keeps every held message from redelivery until `stop`: an in-progress
/// acknowledgement for each, a third of the ack wait apart, in the order
/// they came. After a crash JetStream redelivers them as their ack waits
/// run out, each from its last acknowledgement: refreshed in any other
/// order (a map's), a key's later message could come back first.
pub(super) async fn keep_alive(
    keeping: Arc<Keeping>,
    nats: async_nats::Client,
    ack_wait: Duration,
    stop: CancellationToken,
) {
    let every = (ack_wait / 3).max(Duration::from_millis(100));
    let mut round = tokio::time::interval(every);
    round.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: nothing is held yet.
    round.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = round.tick() => {
                let mut kept = keeping.kept.lock().unwrap_or_else(|e| e.into_inner());
                let every_held: Vec<Subject> = kept.subjects.values().cloned().collect();
                kept.due.extend(every_held);
            }
            () = keeping.keep_now.notified() => {}
        }
        let due = std::mem::take(&mut keeping.kept.lock().unwrap_or_else(|e| e.into_inner()).due);
        for subject in due {
            let progress = Bytes::from(AckKind::Progress);
            if let Err(error) = nats.publish(subject, progress).await {
                tracing::debug!(error = %error, "an in-progress acknowledgement failed");
            }
        }
    }
}
