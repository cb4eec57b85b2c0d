//! The publish stage: keeps many publishes in flight, in order, and rides
//! out broker outages.
//!
//! Messages are put on the wire one after another and their acknowledgements
//! are awaited together, up to `max_in_flight` at once, so throughput is not
//! bound by one round trip per message. Verdicts leave in the order the work
//! came in. When the broker fails, delivery pauses: what is in flight is
//! collected, the first failed message is retried with backoff until the
//! broker takes it, and the rest follow in order. A broker fault never counts
//! against a message's attempts.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::{self, BoxFuture, FutureExt};
use futures::stream::{FuturesOrdered, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Ack, PublishError, Publisher};
use crate::observe::{Metrics, Origin};
use crate::pipeline::{Finished, Verdict, Work};
use crate::retry::{pause, reconnect_backoff, Outage};

/// One try at publishing a unit of work.
struct Attempt {
    work: Work,
    result: Result<Ack, PublishError>,
    /// From sending to the acknowledgement.
    waited: Duration,
}

impl Attempt {
    fn broker_down(&self) -> bool {
        matches!(self.result, Err(PublishError::Unavailable(_)))
    }

    /// The verdict, recorded in the metrics if the broker took the message.
    fn finish(self, metrics: &Metrics) -> Finished {
        if let (Some(Ok(_)), Ok(ack)) =
            (self.work.message.as_ref().map(|m| &m.message), &self.result)
        {
            let origin = self.work.origin();
            metrics.published(origin, self.waited, ack.duplicate);
            if let (Origin::Stream, Some(committed)) = (origin, self.work.at) {
                metrics.delivered_since_commit(committed);
            }
        }
        let verdict = match (self.work.message.as_ref().map(|m| &m.message), self.result) {
            (None, _) => Verdict::Passed,
            (Some(Err(violation)), _) => Verdict::Rejected(violation.clone()),
            (Some(Ok(_)), Ok(_)) => Verdict::Delivered,
            (Some(Ok(_)), Err(PublishError::Invalid(violation))) => Verdict::Rejected(violation),
            (Some(Ok(_)), Err(error)) => Verdict::Refused(error.to_string()),
        };
        Finished {
            work: self.work,
            verdict,
        }
    }
}

type InFlight = FuturesOrdered<BoxFuture<'static, Attempt>>;

/// Drives a [`Publisher`] from a channel of work to a channel of verdicts.
pub(crate) struct PublishStage {
    pub publisher: Arc<dyn Publisher>,
    pub max_in_flight: usize,
    /// Graceful stop: the source closes the input, and what was read is
    /// published; only waiting out a broker outage ends at once.
    pub shutdown: CancellationToken,
    /// Fires when this relay must publish nothing more (it lost the lease):
    /// no queued work is taken, only acknowledgements already due are
    /// collected. What was queued stays pending for the next leader.
    pub halt: CancellationToken,
    pub metrics: Metrics,
}

impl PublishStage {
    pub async fn run(self, mut input: mpsc::Receiver<Work>, output: mpsc::Sender<Finished>) {
        let mut in_flight = InFlight::new();
        let mut input_open = true;
        let mut outage = Outage::new("NATS publishing");
        while input_open || !in_flight.is_empty() {
            tokio::select! {
                biased;
                _ = self.halt.cancelled(), if input_open => input_open = false,
                Some(attempt) = in_flight.next(), if !in_flight.is_empty() => {
                    let forwarded = if attempt.broker_down() {
                        self.recover(attempt, &mut in_flight, &mut outage, &output).await
                    } else {
                        output.send(attempt.finish(&self.metrics)).await.is_ok()
                    };
                    if !forwarded {
                        return;
                    }
                }
                work = input.recv(), if input_open && in_flight.len() < self.max_in_flight => {
                    match work {
                        Some(work) => in_flight.push_back(self.start(work).await),
                        None => input_open = false,
                    }
                }
            }
        }
    }

    /// Sends the message (if any) and returns the future of its attempt.
    async fn start(&self, work: Work) -> BoxFuture<'static, Attempt> {
        let started = Instant::now();
        let sent = match work.message.as_ref().map(|m| &m.message) {
            Some(Ok(message)) => Some(self.publisher.send(message).await),
            _ => None,
        };
        let done = move |work, result| Attempt {
            work,
            result,
            waited: started.elapsed(),
        };
        match sent {
            Some(Ok(ack)) => ack.map(move |result| done(work, result)).boxed(),
            Some(Err(error)) => future::ready(done(work, Err(error))).boxed(),
            None => future::ready(done(work, Ok(Ack::default()))).boxed(),
        }
    }

    /// Handles a broker fault: gathers everything in flight behind the
    /// failed attempt, then retries in order until the broker takes each one.
    /// Returns false if the relay is stopping or completion has gone.
    async fn recover(
        &self,
        failed: Attempt,
        in_flight: &mut InFlight,
        outage: &mut Outage,
        output: &mpsc::Sender<Finished>,
    ) -> bool {
        if let Err(error) = &failed.result {
            outage.failed(error);
        }
        let mut held = VecDeque::from([failed]);
        while let Some(attempt) = in_flight.next().await {
            held.push_back(attempt);
        }
        let mut backoff = reconnect_backoff();
        while let Some(mut attempt) = held.pop_front() {
            while attempt.broker_down() {
                if self.halt.is_cancelled() || !pause(&mut backoff, &self.shutdown).await {
                    return false;
                }
                attempt = self.start(attempt.work).await.await;
            }
            outage.recovered();
            if output.send(attempt.finish(&self.metrics)).await.is_err() {
                return false;
            }
        }
        true
    }
}
