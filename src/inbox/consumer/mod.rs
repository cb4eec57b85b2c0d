//! The JetStream side of the inbox: a durable pull consumer whose messages
//! are handled through the inbox, many at once, each key's one at a time.
//!
//! - **Concurrency.** Up to `concurrency` transactions run at once. Messages
//!   that share an `Outbox-Key` wait in their key's line and are handled
//!   one at a time in stream order, so the relay's per-key order reaches the
//!   handler; messages without a key take no line.
//! - **Acknowledgement after the commit.** A message is acknowledged only
//!   once its transaction committed (or the inbox showed it handled
//!   before). A crash in between leads to a redelivery the inbox skips.
//! - **Failures.** A handler that returns an error is given another
//!   attempt after a growing delay: a message without a key is negatively
//!   acknowledged with that delay, and JetStream redelivers it; a keyed one
//!   is tried again in place, so the later messages of its key keep waiting
//!   behind it. Attempts are counted in the inbox record (`failing`
//!   between them), so a delivery that ran no handler costs none. After
//!   `max_deliveries` attempts the message is recorded `failed` in the
//!   inbox with the error, for a person to see, and terminated; its key's
//!   next message goes on. A count the inbox refuses to keep ends the
//!   message the same way, since nothing else would bound its attempts.
//! - **Held messages stay ours.** Every message read and not yet settled
//!   is kept from redelivery with in-progress acknowledgements, a third of
//!   the consumer's ack wait apart, however long it waits for its key or
//!   for a retry. How many are held is bounded: 16 places per concurrent
//!   transaction, past which the consumer reads no further. While a key's
//!   first message waits (for its record, or a retry) the messages behind
//!   it give their places up, so the other keys go on; all the messages
//!   held, with a place or without, are bounded at 8 places' worth, as is
//!   JetStream's `max_ack_pending` for a consumer created here.
//! - **A failure is the message's own unless MongoDB is unreachable.** A
//!   transaction the server refused (a validator, a handler that ended the
//!   transaction or swallowed an error that aborted it, transient errors
//!   past the drivers' limit) costs an attempt like a handler's error, and
//!   so does a handler that panics. Only a MongoDB that cannot be reached
//!   (down, electing, refusing this user) or starts no transaction charges
//!   none: the message waits,
//!   kept alive, until it answers, and an outage burns no attempts.
//! - **A held record holds up its message alone.** A record another
//!   transaction holds (a process killed mid-run leaves one until the server
//!   ends its transaction) answers the count before a run with a write
//!   conflict at once; the message waits without a transaction's place and
//!   is tried again, and nothing is counted.
//! - **Graceful shutdown, bounded.** On `shutdown` the consumer reads
//!   nothing more, finishes the transactions in flight and acknowledges
//!   them, and, once its last pull has ended, hands every other message it
//!   holds back to JetStream (a negative acknowledgement without delay, in
//!   stream order), so the consumer started next receives them before their
//!   keys' later messages. Past the shutdown timeout the transactions still
//!   running are abandoned (`stopping`), so `run` returns within
//!   [`Consumer::stop_bound`]. After a crash, the messages held wait out
//!   their ack wait instead (refreshed in the order they came, so they come
//!   back in it): a consumer started sooner may handle a key's later
//!   message first.
//!
//! # Layout
//! This file binds the parts into a run and ends it; each of the
//! consumer's jobs has its own module:
//! - `settings`: what a consumer is set to, and the bounds that follow;
//! - `builder`: the settings checked, the JetStream consumer bound;
//! - `backlog`: how much a consumer has left, as JetStream counts it;
//! - `shared`: what the running consumer's tasks share;
//! - `held`: a message held, and the line a key's messages wait in;
//! - `pull`: reading messages, no more than the free places among the held;
//! - `lanes`: each key's messages one at a time, in stream order;
//! - `settle`: a message's attempts, and the acknowledgement that ends it;
//! - `failure`: retries, a held record waited for, and giving up;
//! - `keep_alive`: held messages kept from redelivery, in the order they
//!   came;
//! - `stopping`: the consumer's stop, bounded whatever the servers do, and
//!   the hand-back of what it holds.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{Handler, Inbox};
use crate::error::{Error, Result};
use crate::stop::Stop;
use keep_alive::{keep_alive, Keeping};
use pull::Pulling;
use settings::{Settings, PENDING_PER_PLACE};
use shared::Shared;
use stopping::{Finished, LastWords};

pub use backlog::Backlog;
pub use builder::ConsumerBuilder;
pub use settings::{AfterCommit, AfterCommitHook, DEFAULT_SHUTDOWN_TIMEOUT};
pub use stopping::LAST_WORDS_WAIT;

mod backlog;
mod builder;
mod failure;
mod held;
mod keep_alive;
mod lanes;
mod pull;
mod settings;
mod settle;
mod shared;
mod stopping;

/// A bound consumer, ready to [`Consumer::run`].
pub struct Consumer {
    inbox: Inbox,
    nats: async_nats::Client,
    pull: PullConsumer,
    settings: Settings,
    ack_wait: Duration,
    /// The most messages one pull asks for.
    pull_limit: usize,
}

impl Consumer {
    /// How much this consumer has left: take it before [`Consumer::run`],
    /// to learn while it runs when it has caught up.
    pub fn backlog(&self) -> Backlog {
        Backlog {
            pull: self.pull.clone(),
        }
    }

    /// The longest [`Consumer::run`] takes to return once `shutdown` fires:
    /// the shutdown timeout, then at most [`LAST_WORDS_WAIT`] to hand
    /// messages back and send the last acknowledgements.
    pub fn stop_bound(&self) -> Duration {
        self.settings
            .shutdown_timeout
            .saturating_add(LAST_WORDS_WAIT)
    }

    /// Handles messages until `shutdown` fires, then stops within
    /// [`Consumer::stop_bound`] (the shutdown timeout, 10 s by default,
    /// plus 5 s), whatever MongoDB or NATS do meanwhile: it reads nothing
    /// more, finishes the transactions in flight and acknowledges them,
    /// and hands every other message it holds back to JetStream. Past the
    /// shutdown timeout the transactions still running are abandoned (a
    /// MongoDB that stopped answering, say), nothing is handed back, and
    /// every message held comes back after its ack wait, as after a crash:
    /// it returns [`Error::ShutdownTimeout`] then, and also when NATS did
    /// not take the hand-back and last acknowledgements in 5 s (those
    /// messages come back the same way). Returns an error as well if
    /// JetStream ends the consumer (deleted).
    pub async fn run<H: Handler>(self, handler: H, shutdown: CancellationToken) -> Result<()> {
        let held_limit = self.settings.held_limit();
        let shutdown_timeout = self.settings.shutdown_timeout;
        // Fired by `shutdown`, and also when the consumer ends on its own
        // (deleted), so its tasks stop then too, within the same bound.
        let ending = shutdown.child_token();
        let stop = Stop::after_grace(ending.clone(), shutdown_timeout);
        let shared = Arc::new(Shared {
            client: self.inbox.collection().client().clone(),
            inbox: self.inbox,
            nats: self.nats,
            handler: Box::new(handler),
            running: Semaphore::new(self.settings.concurrency),
            settings: self.settings,
            lanes: Mutex::default(),
            keeping: Arc::new(Keeping::default()),
            handed_back: Mutex::default(),
            shutdown: ending,
        });
        let holding = Arc::new(Semaphore::new(held_limit));
        let room = Arc::new(Semaphore::new(held_limit.saturating_mul(PENDING_PER_PLACE)));
        let keeper_stop = CancellationToken::new();
        let keeper = tokio::spawn(keep_alive(
            shared.keeping.clone(),
            shared.nats.clone(),
            self.ack_wait,
            keeper_stop.clone(),
        ));
        // However `run` ends (its future dropped included), nothing is kept
        // alive after it: what it held goes back to JetStream by ack wait.
        let _release = Release {
            shared: shared.clone(),
            keeper_stop: keeper_stop.clone(),
            abandon: stop.abandon.clone(),
        };
        let mut tasks = JoinSet::new();
        let pulling = Pulling {
            pull: &self.pull,
            limit: self.pull_limit,
            holding: &holding,
            room: &room,
        };
        let outcome = tokio::select! {
            outcome = pulling.until(&shared, &mut tasks, &shutdown) => outcome,
            // A pull NATS never ends.
            _ = stop.abandon.cancelled() => Ok(()),
        };
        shared.shutdown.cancel();
        let finished = stopping::finish(&mut tasks, &stop.abandon).await;
        let said = stopping::last_words(&shared, finished).await;
        keeper_stop.cancel();
        // A keeper stuck in a publish to a NATS that does not take it.
        keeper.abort();
        let _ = keeper.await;
        match (outcome, finished, said) {
            (Err(error), _, _) => Err(error),
            (Ok(()), Finished::All, LastWords::Said) => Ok(()),
            (Ok(()), Finished::Abandoned, _) | (Ok(()), _, LastWords::CutShort) => {
                Err(Error::ShutdownTimeout(shutdown_timeout))
            }
        }
    }
}

/// Ends the keeping alive of a consumer's messages when it is dropped, and
/// lets go of what it still held (the shared state may outlive the run in a
/// task abandoned and not yet dropped, and its held messages with it).
struct Release {
    shared: Arc<Shared>,
    keeper_stop: CancellationToken,
    /// Fired here too, so the timer waiting to fire it ends with the run.
    abandon: CancellationToken,
}

impl Drop for Release {
    fn drop(&mut self) {
        self.keeper_stop.cancel();
        self.abandon.cancel();
        self.shared.shutdown.cancel();
        drop(std::mem::take(
            &mut *self
                .shared
                .handed_back
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        ));
        self.shared.lock_lanes().clear();
    }
}
