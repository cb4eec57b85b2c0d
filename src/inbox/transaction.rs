//! One message handled in one transaction, retried as MongoDB's drivers
//! specify for their convenient transaction API.
//!
//! The record goes first, then the handler's writes, in the same session:
//! all commit or none does. An error labelled `TransientTransactionError`
//! (a write conflict, an election, a network failure), whether from the
//! record, from the handler's own writes, or from the commit, means the
//! server aborted the transaction: it is run again from the start, and the
//! handler with it, whose earlier effects went with the abort. A commit
//! whose result is unknown (`UnknownTransactionCommitResult`) is committed
//! again, not run again, since it may have taken effect. Either retry stops
//! after [`RETRY_LIMIT`], as the drivers' does.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backoff::backoff::Backoff;
use futures::FutureExt;

use bson::{DateTime, Document};
use mongodb::error::TRANSIENT_TRANSACTION_ERROR;
use mongodb::options::{Acknowledgment, WriteConcern};
use mongodb::{Client, ClientSession, Collection};

use super::commit::{commit, RETRY_LIMIT};
use super::record::{record_handled, Before, Entry, Recorded, Standing};
use super::{BoxedHandler, Delivery, HandlerError};
use crate::error::{is_duplicate_key, is_unreachable};

/// How a message's transaction ended.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The record and the handler's effects committed.
    Committed {
        /// How long the handler ran, in the attempt that committed.
        handler_time: Duration,
    },
    /// The message was handled before: nothing was run.
    Repeat,
    /// The handler returned an error or panicked: nothing committed.
    Failed(HandlerError),
    /// MongoDB failed in a way no retry here mends (it is down, refused the
    /// transaction's writes, or the transient errors outlasted the limit):
    /// nothing is known committed but what a commit of unknown result may
    /// have done.
    Mongo(mongodb::error::Error),
    /// No transaction could be started (no session, or a deployment that
    /// takes none): nothing was run, and nothing about the message is to
    /// blame.
    Unavailable(mongodb::error::Error),
    /// Nothing was run and nothing counted: another transaction holds the
    /// message's record (a copy being handled, or a process that died
    /// mid-run, whose transaction the server ends only at its lifetime,
    /// 60 s on MongoDB). The message is tried again later, and waits
    /// without holding a transaction's place meanwhile.
    Busy,
    /// Nothing was run, and the message is to be given up on for this
    /// reason: its runs are past the limit (begun and never ended: its
    /// handler ends the process, say), or the inbox refuses to count them.
    Spent(String),
}

impl Outcome {
    /// Given up on without another run, as `before` (which
    /// [`Before::allows_a_run`] refused) says why.
    pub(crate) fn refused(before: &Before) -> Outcome {
        let runs = before.runs;
        Outcome::Spent(match before.standing {
            Standing::GivenUp => format!(
                "it was given up on after {runs} runs, and came again only as a redelivery of \
                 that same message (its termination was lost): no further run"
            ),
            Standing::Open | Standing::CameAgain => format!(
                "the handler began {runs} runs of it, and the last never ended with a result \
                 (the process stopped during it?)"
            ),
        })
    }
}

/// Where a message's transaction runs.
pub(crate) struct Transaction<'a> {
    pub client: &'a Client,
    pub inbox: &'a Collection<Document>,
    pub retention: Option<Duration>,
    /// The runs a message gets: `max_deliveries`.
    pub max_runs: u64,
    /// Set once the handler has begun: a run that then ends in an outage
    /// was a run all the same.
    pub handler_began: AtomicBool,
}

impl Transaction<'_> {
    /// Handles `delivery` once in a transaction with its record in
    /// `consumer`'s inbox (without a message id, the handler alone). Its
    /// `attempt` is set from the record first: this run's count if it was
    /// `counted` before it began, else the runs before it plus one.
    pub async fn run(
        &self,
        handler: &dyn BoxedHandler,
        delivery: &mut Delivery,
        consumer: &str,
        counted: Option<u64>,
    ) -> Outcome {
        let started = Instant::now();
        let mut session = match self.client.start_session().await {
            Ok(session) => session,
            Err(error) => return Outcome::Unavailable(error),
        };
        let mut backoff = conflict_backoff();
        loop {
            let attempt = self
                .attempt(
                    &mut session,
                    handler,
                    (delivery, counted),
                    consumer,
                    started,
                )
                .await;
            match attempt {
                Attempt::Done(outcome) => return outcome,
                // Held past a moment: a dead process's transaction, most
                // likely, which would hold this place for up to a minute.
                Attempt::Held(_) if started.elapsed() >= RECORD_HELD_WAIT => return Outcome::Busy,
                Attempt::Again(error) | Attempt::Held(error) => match backoff.next_backoff() {
                    Some(pause) if started.elapsed() < RETRY_LIMIT => {
                        tracing::debug!(error = %error, "transient transaction error; running it again");
                        tokio::time::sleep(pause).await;
                    }
                    _ => return Outcome::Mongo(error),
                },
            }
        }
    }

    /// One run of the transaction, from its start to its commit.
    async fn attempt(
        &self,
        session: &mut ClientSession,
        handler: &dyn BoxedHandler,
        (delivery, counted): (&mut Delivery, Option<u64>),
        consumer: &str,
        started: Instant,
    ) -> Attempt {
        let majority = WriteConcern::builder().w(Acknowledgment::Majority).build();
        if let Err(error) = session.start_transaction().write_concern(majority).await {
            return Attempt::Done(Outcome::Unavailable(error));
        }
        if let Some(entry) = Entry::of(consumer, delivery) {
            let now = DateTime::now();
            let recorded =
                record_handled(self.inbox, session, (&entry, counted), now, self.retention).await;
            match recorded {
                // Not counted before it began, as JetStream called it a
                // first delivery; but JetStream's count can fall short (a
                // delivery that reached no client is taken back from it),
                // so the record bounds the runs here too, by the rule the
                // count before a run keeps.
                Ok(Recorded::New(before))
                    if counted.is_none() && !before.allows_a_run(self.max_runs) =>
                {
                    abort(session).await;
                    delivery.attempt = before.runs;
                    return Attempt::Done(Outcome::refused(&before));
                }
                Ok(Recorded::New(before)) => {
                    delivery.attempt = counted.unwrap_or(before.runs.saturating_add(1));
                }
                Ok(Recorded::HandledBefore) => {
                    abort(session).await;
                    return Attempt::Done(Outcome::Repeat);
                }
                // Recorded outside any transaction meanwhile (a failed
                // run's count, by another copy): run again, to read it.
                Err(error) if is_duplicate_key(&error) => {
                    abort(session).await;
                    return Attempt::Again(error);
                }
                Err(error) => {
                    abort(session).await;
                    return match Attempt::from_error(error) {
                        // Before the handler: the record's own conflict.
                        Attempt::Again(error) if !is_unreachable(&error) => Attempt::Held(error),
                        other => other,
                    };
                }
            }
        }
        let began = Instant::now();
        self.handler_began.store(true, Ordering::Relaxed);
        let handled = run_handler(handler, session, delivery).await;
        let handler_time = began.elapsed();
        if let Err(error) = handled {
            abort(session).await;
            return match error.transient() {
                Ok(error) => Attempt::Again(error),
                Err(error) => Attempt::Done(Outcome::Failed(error)),
            };
        }
        match commit(session, started).await {
            Ok(()) => Attempt::Done(Outcome::Committed { handler_time }),
            Err(error) => Attempt::from_error(error),
        }
    }
}

/// The pause before a transaction is run again: short and growing, with
/// jitter, so that two transactions that conflicted do not meet again.
fn conflict_backoff() -> backoff::ExponentialBackoff {
    backoff::ExponentialBackoff {
        initial_interval: Duration::from_millis(5),
        max_interval: Duration::from_millis(500),
        max_elapsed_time: None,
        ..Default::default()
    }
}

/// One run's end: an outcome, or a transient error to run again after.
enum Attempt {
    Done(Outcome),
    Again(mongodb::error::Error),
    /// The record's write conflicted: another transaction holds it.
    Held(mongodb::error::Error),
}

/// How long a message's transaction tries again to write a record another
/// transaction holds before it gives the message's place up (see
/// [`Outcome::Busy`]).
const RECORD_HELD_WAIT: Duration = Duration::from_secs(1);

impl Attempt {
    fn from_error(error: mongodb::error::Error) -> Self {
        if error.contains_label(TRANSIENT_TRANSACTION_ERROR) {
            Attempt::Again(error)
        } else {
            Attempt::Done(Outcome::Mongo(error))
        }
    }
}

/// Runs the handler; a panic in it is its failure, like an error, so that
/// it costs the message an attempt and not the consumer its task.
async fn run_handler(
    handler: &dyn BoxedHandler,
    session: &mut ClientSession,
    delivery: &Delivery,
) -> Result<(), HandlerError> {
    // Inside the async block, so that a panic in the handler's own body,
    // before the future it returns, is caught as well.
    let handled = AssertUnwindSafe(async { handler.handle_boxed(session, delivery).await })
        .catch_unwind()
        .await;
    handled.unwrap_or_else(|panic| {
        let text = panic
            .downcast_ref::<&str>()
            .map(|text| (*text).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(HandlerError::new(format!("the handler panicked: {text}")))
    })
}

/// Aborts the session's transaction. An error is no matter: the server
/// aborted it already (an error it raised does), or ends it when it times
/// out.
async fn abort(session: &mut ClientSession) {
    if let Err(error) = session.abort_transaction().await {
        tracing::debug!(error = %error, "aborting a transaction failed");
    }
}
