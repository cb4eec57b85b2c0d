//! The publish stage: keeps many publishes in flight, in order, rides out
//! broker outages, and keeps each message's failure its own.
//!
//! Messages are put on the wire one after another and their acknowledgements
//! are awaited together, up to `max_in_flight` at once, so throughput is not
//! bound by one round trip per message. Verdicts leave in the order the work
//! came in.
//!
//! A failure is either the broker's (it takes no message: delivery pauses,
//! no attempt is charged) or the message's (it is refused: an attempt is
//! charged and every other message goes on). Where the publisher cannot
//! tell which, the stage finds out:
//! - a failure that could be either (nothing took the subject, a timeout)
//!   is checked with [`Publisher::probe`]: if the broker takes messages,
//!   the failure is the message's own (at once where nothing took the
//!   subject, after a few tries otherwise); if not, it is an outage;
//! - a run of [`REFUSAL_STORM`] refusals with nothing delivered between them
//!   (a permission lost for every subject, say) is the broker refusing
//!   everything: the messages are held, uncharged, and sent again with
//!   backoff until the broker takes one of them.
//!
//! While paused, the stage reports it to readiness.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backoff::ExponentialBackoff;
use futures::future::{self, BoxFuture, FutureExt};
use futures::stream::{FuturesOrdered, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Ack, Health, PublishError, Publisher};
use crate::observe::{Metrics, Origin, PausedDelivery};
use crate::pipeline::{Finished, Verdict, Work};
use crate::retry::{pause, reconnect_backoff, Outage};

/// Refusals in a row, with nothing delivered between them, that make the
/// stage take a refusal for the broker refusing every message.
pub(crate) const REFUSAL_STORM: usize = 16;

/// Tries after which a failure that may be the broker's (a timeout, say)
/// counts as the message's own, when the broker takes other messages.
const OWN_FAILURE_TRIES: usize = 3;

/// One try at publishing a unit of work.
struct Attempt {
    work: Work,
    result: Result<Ack, PublishError>,
    /// From sending to the acknowledgement.
    waited: Duration,
    /// The failure was found to be the message's own (the broker took
    /// others meanwhile), so it says nothing about the broker.
    own: bool,
}

impl Attempt {
    /// Work not sent yet, to be sent with the next round of a pause.
    fn unsent(work: Work) -> Self {
        Attempt {
            work,
            result: Err(PublishError::Unavailable("not sent yet".into())),
            waited: Duration::ZERO,
            own: false,
        }
    }

    /// The failure may be the broker's: find out before charging anyone.
    fn in_doubt(&self) -> bool {
        matches!(
            self.result,
            Err(PublishError::Unavailable(_) | PublishError::Uncaptured(_))
        )
    }

    /// A refusal that could be the broker refusing everything.
    fn unexplained_refusal(&self) -> bool {
        !self.own && matches!(self.result, Err(PublishError::Refused(_)))
    }

    fn delivered(&self) -> bool {
        matches!(
            (self.work.message.as_ref().map(|m| &m.message), &self.result),
            (Some(Ok(_)), Ok(_))
        )
    }

    /// The verdict, recorded in the metrics if the broker took the message.
    fn finish(self, metrics: &Metrics) -> Finished {
        if let (true, Ok(ack)) = (self.delivered(), &self.result) {
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

/// Refusals in a row with nothing delivered between them.
#[derive(Debug, Default)]
struct Streak {
    refused: usize,
    /// Verdicts still to come that were settled by a pause that ended with a
    /// delivery: their refusals are their own and must not start another.
    exempt: usize,
}

impl Streak {
    /// Whether this attempt's refusal makes the run a storm.
    fn trips(&self, attempt: &Attempt) -> bool {
        self.exempt == 0 && attempt.unexplained_refusal() && self.refused + 1 >= REFUSAL_STORM
    }

    fn record(&mut self, attempt: &Attempt) {
        self.exempt = self.exempt.saturating_sub(1);
        if attempt.delivered() {
            self.refused = 0;
        } else if attempt.unexplained_refusal() {
            self.refused += 1;
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

/// What the stage keeps between attempts.
struct State {
    input: mpsc::Receiver<Work>,
    input_open: bool,
    in_flight: InFlight,
    outage: Outage,
    streak: Streak,
}

impl PublishStage {
    pub async fn run(self, input: mpsc::Receiver<Work>, output: mpsc::Sender<Finished>) {
        let mut state = State {
            input,
            input_open: true,
            in_flight: InFlight::new(),
            outage: Outage::new("NATS publishing"),
            streak: Streak::default(),
        };
        while state.input_open || !state.in_flight.is_empty() {
            tokio::select! {
                biased;
                _ = self.halt.cancelled(), if state.input_open => state.input_open = false,
                Some(attempt) = state.in_flight.next(), if !state.in_flight.is_empty() => {
                    let forwarded = if attempt.in_doubt() || state.streak.trips(&attempt) {
                        self.recover(attempt, &mut state, &output).await
                    } else {
                        state.streak.record(&attempt);
                        output.send(attempt.finish(&self.metrics)).await.is_ok()
                    };
                    if !forwarded {
                        return;
                    }
                }
                work = state.input.recv(),
                    if state.input_open && state.in_flight.len() < self.max_in_flight =>
                {
                    match work {
                        Some(work) => state.in_flight.push_back(self.start(work).await),
                        None => state.input_open = false,
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
            own: false,
        };
        match sent {
            Some(Ok(ack)) => ack.map(move |result| done(work, result)).boxed(),
            Some(Err(error)) => future::ready(done(work, Err(error))).boxed(),
            None => future::ready(done(work, Ok(Ack::default()))).boxed(),
        }
    }

    /// Handles a failure that may be the broker's: gathers everything in
    /// flight behind it, then settles each attempt in order, pausing where
    /// the broker takes nothing. Returns false if the relay is stopping or
    /// completion has gone.
    async fn recover(
        &self,
        failed: Attempt,
        state: &mut State,
        output: &mpsc::Sender<Finished>,
    ) -> bool {
        let mut held = VecDeque::from([failed]);
        while let Some(attempt) = state.in_flight.next().await {
            held.push_back(attempt);
        }
        while let Some(attempt) = held.pop_front() {
            let Some(attempt) = self.settle(attempt, &mut state.outage).await else {
                return false;
            };
            if state.streak.trips(&attempt) {
                held.push_front(attempt);
                if !self.ride_out_refusals(&mut held, state).await {
                    return false;
                }
                state.streak = Streak {
                    refused: 0,
                    exempt: held.len(),
                };
                continue;
            }
            state.streak.record(&attempt);
            if output.send(attempt.finish(&self.metrics)).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Tries one attempt again until its failure is no longer in doubt:
    /// delivered, refused, or found to be its own. `None` if the relay
    /// stopped first.
    async fn settle(&self, mut attempt: Attempt, outage: &mut Outage) -> Option<Attempt> {
        let mut backoff = reconnect_backoff();
        let mut own_failures = 0;
        let mut paused: Option<PausedDelivery> = None;
        while attempt.in_doubt() {
            let Err(error) = &attempt.result else { break };
            match self.publisher.probe().await {
                Health::Takes => {
                    own_failures += 1;
                    let uncaptured = matches!(error, PublishError::Uncaptured(_));
                    if uncaptured || own_failures >= OWN_FAILURE_TRIES {
                        attempt.result = Err(PublishError::Refused(format!(
                            "{error}, while the broker takes other messages"
                        )));
                        attempt.own = true;
                        break;
                    }
                }
                Health::TakesNone(why) => {
                    own_failures = 0;
                    outage.failed(&format!("{error} ({why})"));
                    paused.get_or_insert_with(|| self.metrics.pause_delivery(why));
                }
                Health::Unknown => {
                    outage.failed(error);
                    paused.get_or_insert_with(|| self.metrics.pause_delivery(error.to_string()));
                }
            }
            if !self.wait(&mut backoff).await {
                return None;
            }
            attempt = self.start(attempt.work).await.await;
        }
        if paused.is_some() {
            outage.recovered();
        }
        Some(attempt)
    }

    /// The broker refuses message after message: holds them all (and what
    /// waits in the input, up to the in-flight limit), uncharged, and sends
    /// them again with backoff until the broker takes one. Returns false if
    /// the relay stopped first.
    async fn ride_out_refusals(&self, held: &mut VecDeque<Attempt>, state: &mut State) -> bool {
        let reason = match held.front().map(|a| &a.result) {
            Some(Err(error)) => error.to_string(),
            _ => String::new(),
        };
        let why = format!(
            "the broker refused {REFUSAL_STORM} messages in a row and took none ({reason}); \
             holding them without charging attempts until it takes one"
        );
        state.outage.failed(&why);
        let _paused = self.metrics.pause_delivery(why);
        let mut backoff = reconnect_backoff();
        loop {
            while state.input_open && held.len() < self.max_in_flight {
                match state.input.try_recv() {
                    Ok(work) => held.push_back(Attempt::unsent(work)),
                    Err(_) => break,
                }
            }
            if !self.wait(&mut backoff).await {
                return false;
            }
            let mut round = InFlight::new();
            for attempt in held.drain(..) {
                round.push_back(self.start(attempt.work).await);
            }
            while let Some(attempt) = round.next().await {
                held.push_back(attempt);
            }
            if held.iter().any(Attempt::delivered) {
                state.outage.recovered();
                return true;
            }
        }
    }

    /// Waits the next backoff step. False if the relay must stop publishing.
    async fn wait(&self, backoff: &mut ExponentialBackoff) -> bool {
        !self.halt.is_cancelled() && pause(backoff, &self.shutdown).await
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use bson::{doc, oid::ObjectId};

    use super::*;
    use crate::contract::{DecodeRules, OutboxMessage};
    use crate::publish::AckFuture;

    /// A broker whose answers the test sets: per subject, or for everything.
    #[derive(Default)]
    struct Scripted {
        by_subject: Mutex<HashMap<String, PublishError>>,
        everything: Mutex<Option<PublishError>>,
        health: Mutex<Option<Health>>,
        sends: Mutex<Vec<String>>,
    }

    impl Scripted {
        fn answer(&self, subject: &str, error: PublishError) {
            self.by_subject
                .lock()
                .unwrap()
                .insert(subject.to_owned(), error);
        }

        fn fail_all(&self, error: Option<PublishError>, health: Health) {
            *self.everything.lock().unwrap() = error;
            *self.health.lock().unwrap() = Some(health);
        }

        fn sends_to(&self, subject: &str) -> usize {
            let sends = self.sends.lock().unwrap();
            sends.iter().filter(|s| *s == subject).count()
        }
    }

    impl Publisher for Scripted {
        fn send<'a>(
            &'a self,
            message: &'a OutboxMessage,
        ) -> BoxFuture<'a, Result<AckFuture, PublishError>> {
            self.sends.lock().unwrap().push(message.subject.clone());
            let everything = self.everything.lock().unwrap().clone();
            let answer = everything.or_else(|| {
                let by_subject = self.by_subject.lock().unwrap();
                by_subject.get(&message.subject).cloned()
            });
            let ack: AckFuture = match answer {
                Some(error) => future::ready(Err(error)).boxed(),
                None => future::ready(Ok(Ack::default())).boxed(),
            };
            future::ready(Ok(ack)).boxed()
        }

        fn max_payload(&self) -> usize {
            usize::MAX
        }

        fn probe(&self) -> BoxFuture<'_, Health> {
            let health = self.health.lock().unwrap().clone();
            future::ready(health.unwrap_or(Health::Takes)).boxed()
        }
    }

    struct Running {
        input: mpsc::Sender<Work>,
        output: mpsc::Receiver<Finished>,
        halt: CancellationToken,
    }

    fn start(publisher: Arc<Scripted>) -> Running {
        let (input, work) = mpsc::channel(1024);
        let (finished, output) = mpsc::channel(1024);
        let halt = CancellationToken::new();
        let stage = PublishStage {
            publisher,
            max_in_flight: 64,
            shutdown: CancellationToken::new(),
            halt: halt.clone(),
            metrics: Metrics::new(),
        };
        tokio::spawn(stage.run(work, finished));
        Running {
            input,
            output,
            halt,
        }
    }

    fn work(subject: &str) -> Work {
        let document = doc! {
            "_id": ObjectId::new(), "type": "t", "payload": "x", "subject": subject,
        };
        Work::from_collection(DecodeRules::any_relay().decode(&document), None)
    }

    impl Running {
        async fn send(&self, subjects: &[&str]) {
            for subject in subjects {
                self.input.send(work(subject)).await.unwrap();
            }
        }

        /// The next `n` verdicts, by subject.
        async fn verdicts(&mut self, n: usize) -> Vec<(String, Verdict)> {
            let mut verdicts = Vec::new();
            for _ in 0..n {
                let finished = tokio::time::timeout(Duration::from_secs(3600), self.output.recv())
                    .await
                    .expect("a verdict in time")
                    .expect("the stage is running");
                let subject = match &finished.work.message.as_ref().unwrap().message {
                    Ok(message) => message.subject.clone(),
                    Err(_) => String::new(),
                };
                verdicts.push((subject, finished.verdict));
            }
            verdicts
        }

        /// Whether a verdict arrives within `within` (of the paused clock).
        async fn quiet_for(&mut self, within: Duration) -> bool {
            tokio::time::timeout(within, self.output.recv())
                .await
                .is_err()
        }
    }

    fn refused(verdicts: &[(String, Verdict)]) -> Vec<&str> {
        verdicts
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Refused(_)))
            .map(|(s, _)| s.as_str())
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_subject_nothing_captures_is_refused_alone_while_the_broker_takes_others() {
        let broker = Arc::new(Scripted::default());
        broker.answer("poison", PublishError::Uncaptured("no stream".into()));
        let mut stage = start(broker.clone());
        stage.send(&["a", "poison", "b", "c"]).await;
        let verdicts = stage.verdicts(4).await;
        let order: Vec<&str> = verdicts.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(
            order,
            ["a", "poison", "b", "c"],
            "verdicts keep their order"
        );
        assert_eq!(refused(&verdicts), ["poison"]);
        assert_eq!(broker.sends_to("poison"), 1, "refused at once, not retried");
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_pauses_without_charging_and_resumes_in_order() {
        let broker = Arc::new(Scripted::default());
        broker.fail_all(
            Some(PublishError::Uncaptured("no responders".into())),
            Health::TakesNone("JetStream does not answer".into()),
        );
        let mut stage = start(broker.clone());
        stage.send(&["a", "b", "c"]).await;
        assert!(stage.quiet_for(Duration::from_secs(60)).await);
        assert!(broker.sends_to("a") > 2, "the stage keeps trying");
        broker.fail_all(None, Health::Takes);
        let verdicts = stage.verdicts(3).await;
        assert!(refused(&verdicts).is_empty(), "{verdicts:?}");
        let order: Vec<&str> = verdicts.iter().map(|(s, _)| s.as_str()).collect();
        assert_eq!(order, ["a", "b", "c"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_that_keeps_timing_out_alone_becomes_its_own_refusal() {
        let broker = Arc::new(Scripted::default());
        broker.answer("slow", PublishError::Unavailable("timed out".into()));
        let mut stage = start(broker.clone());
        stage.send(&["slow", "a"]).await;
        let verdicts = stage.verdicts(2).await;
        assert_eq!(refused(&verdicts), ["slow"]);
        assert_eq!(broker.sends_to("slow"), OWN_FAILURE_TRIES);
        assert!(matches!(verdicts[1].1, Verdict::Delivered));
    }

    #[tokio::test(start_paused = true)]
    async fn refusing_everything_pauses_instead_of_dead_lettering_everything() {
        let broker = Arc::new(Scripted::default());
        broker.fail_all(
            Some(PublishError::Refused("permission denied".into())),
            Health::Takes,
        );
        let mut stage = start(broker.clone());
        let subjects: Vec<String> = (0..40).map(|n| format!("s{n}")).collect();
        let names: Vec<&str> = subjects.iter().map(String::as_str).collect();
        stage.send(&names).await;
        let charged = stage.verdicts(REFUSAL_STORM - 1).await;
        assert_eq!(refused(&charged).len(), REFUSAL_STORM - 1);
        assert!(
            stage.quiet_for(Duration::from_secs(600)).await,
            "a storm of refusals charges no more messages"
        );
        broker.fail_all(None, Health::Takes);
        let rest = stage.verdicts(40 - (REFUSAL_STORM - 1)).await;
        assert!(refused(&rest).is_empty(), "{rest:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_run_of_refusals_among_good_messages_is_charged_and_the_rest_go_on() {
        let broker = Arc::new(Scripted::default());
        let mut subjects: Vec<String> = (0..REFUSAL_STORM + 4)
            .map(|n| format!("denied{n}"))
            .collect();
        for subject in &subjects {
            broker.answer(subject, PublishError::Refused("permission denied".into()));
        }
        subjects.push("good".into());
        let mut stage = start(broker.clone());
        let names: Vec<&str> = subjects.iter().map(String::as_str).collect();
        stage.send(&names).await;
        let verdicts = stage.verdicts(subjects.len()).await;
        assert_eq!(refused(&verdicts).len(), REFUSAL_STORM + 4);
        assert!(matches!(verdicts.last(), Some((s, Verdict::Delivered)) if s == "good"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_ends_a_pause_at_once() {
        let broker = Arc::new(Scripted::default());
        broker.fail_all(
            Some(PublishError::Unavailable("down".into())),
            Health::TakesNone("down".into()),
        );
        let mut stage = start(broker);
        stage.send(&["a"]).await;
        assert!(stage.quiet_for(Duration::from_secs(10)).await);
        stage.halt.cancel();
        let closed = tokio::time::timeout(Duration::from_secs(60), stage.output.recv()).await;
        assert!(
            matches!(closed, Ok(None)),
            "the stage ends without a verdict"
        );
    }
}
