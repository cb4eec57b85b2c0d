//! The publish stage: keeps many publishes in flight, keeps each key's
//! messages in order, rides out broker outages, and keeps each message's
//! failure its own.
//!
//! Messages are put on the wire one after another and their acknowledgements
//! are awaited together, up to `max_in_flight` at once, so throughput is not
//! bound by one round trip per message. A message with a `key` takes its
//! turn in its key's line ([`KeyOrder`]): it is sent once the message of its
//! key before it has its answer, or parked if an earlier message holds the
//! key. Keys do not wait for each other: a verdict leaves as soon as it is
//! known, whatever came before it, and only a stream position waits, until
//! every work before it has its verdict ([`Positions`]), so the checkpoint
//! never passes a message that is not done.
//!
//! The stage's loop never waits on the broker. A message's send has two
//! steps: its [`Put`] on the wire, which keeps the order the stage reads
//! work in, and its [`Life`] in flight: its answer, a second try, the end
//! of its key's turn, in its own future beside the others. A put that must
//! wait (for room in the client, say) is one branch of the loop, beside
//! the answers in flight, which are what make that room.
//! What a message comes to is one [`Outcome`], which gives its verdict,
//! how the metrics count it, and how its key's turn ends.
//!
//! A failure is either the broker's (it takes no message: delivery pauses,
//! no attempt is charged) or the message's (it is refused: an attempt is
//! charged and every other message goes on). Where the publisher cannot
//! tell which (nothing took the subject, a timeout), the message asks
//! [`Publisher::probe`] about the stream of its subject: if the broker
//! takes messages there, the message is sent once more, and a second
//! failure is its own; if not, it is an outage and delivery pauses,
//! reported to readiness. One message at a time asks ([`Probing`]), so an
//! outage is probed by one message while the others wait for its answer,
//! and the stage takes no new work until the broker is back. A message in
//! doubt keeps its turn until it is settled, so no later message of its key
//! is sent before it is; messages of other keys go on meanwhile.
//!
//! A refusal the publisher reports directly (a permission denied, say) may
//! still be the broker refusing everything; the stage cannot know, so it
//! charges the attempt, and the completion stage dead-letters the message
//! only with evidence that the broker takes other messages (see
//! [`LastDelivery`]).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backoff::ExponentialBackoff;
use bson::DateTime;
use futures::future::{self, BoxFuture, FutureExt};
use futures::stream::{FuturesUnordered, StreamExt};
use mongodb::change_stream::event::ResumeToken;
use tokio::sync::{mpsc, watch, Notify};
use tokio_util::sync::CancellationToken;

use super::{Ack, AckFuture, Health, PublishError, Publisher};
use crate::contract::{ContractViolation, OutboxMessage};
use crate::lease::Term;
use crate::observe::{Metrics, Origin, PausedDelivery};
use crate::order::{self, Admission, KeyOrder, ParkTicket, Turn};
use crate::retry::{back_off, reconnect_backoff, Outage};
use crate::work::{Acknowledged, Again, Finished, LastDelivery, Tenure, Unrecorded, Verdict, Work};

/// What one try at publishing a unit of work came to, once nothing about
/// it is in doubt. Each case says the verdict it gives, how the metrics
/// count it, and how it ends the message's turn in its key's line.
enum Outcome {
    /// Nothing to send, a bare stream position: passed on, uncounted. It
    /// has no key, so no turn.
    Passed,
    /// Not sent: an earlier message of its key holds the key. Parked,
    /// uncounted; its turn ended as it was parked. (A broken message
    /// parked so is failed in its turn, once the key is released.)
    Parked,
    /// The message breaks the contract, as decoding or the broker found
    /// (too large, say): rejected, as no retry can mend it; uncounted;
    /// fails its turn.
    Rejected(ContractViolation),
    /// Not sent: NATS acknowledged it to this relay before, and nothing
    /// has touched it since (see `Acknowledged`). Delivered, counted as a
    /// republish avoided; ends its turn as delivered.
    StoredBefore,
    /// The broker acknowledged it `waited` after sending. Delivered,
    /// counted as published and taken as evidence that the broker takes
    /// messages (see [`LastDelivery`]); ends its turn as delivered.
    Acked { ack: Ack, waited: Duration },
    /// The broker refused it: refused, an attempt charged; holds its key.
    /// `own` where the broker was seen taking other messages meanwhile,
    /// which is what lets completion dead-letter it.
    /// `maybe_stored` where its answer was in doubt (a timeout, say): the
    /// broker may hold it, and a retry sends it again.
    Refused {
        reason: String,
        own: bool,
        maybe_stored: bool,
    },
}

impl Outcome {
    fn refused(error: &PublishError, own: bool) -> Self {
        Outcome::Refused {
            reason: error.to_string(),
            own,
            maybe_stored: false,
        }
    }

    /// How it ends the message's turn in its key's line; `None` where it
    /// has no turn to end (see [`Outcome::Passed`], [`Outcome::Parked`]).
    fn for_key(&self) -> Option<order::Outcome> {
        match self {
            Outcome::Passed | Outcome::Parked => None,
            Outcome::Rejected(_) => Some(order::Outcome::Failed),
            Outcome::StoredBefore | Outcome::Acked { .. } => Some(order::Outcome::Delivered),
            Outcome::Refused { .. } => Some(order::Outcome::Refused),
        }
    }
}

/// One try at publishing a unit of work, and what it came to.
struct Attempt {
    work: Work,
    outcome: Outcome,
}

impl Attempt {
    /// Work that was not sent, because an earlier message holds its key.
    fn parked(mut work: Work, ticket: ParkTicket) -> Self {
        work.park = Some(ticket);
        Attempt {
            work,
            outcome: Outcome::Parked,
        }
    }

    /// The verdict, with the outcome counted as its case says.
    fn finish(self, metrics: &Metrics, deliveries: &LastDelivery) -> Finished {
        let Attempt { work, outcome } = self;
        let verdict = match outcome {
            Outcome::Passed => Verdict::Passed,
            Outcome::Parked => Verdict::Parked,
            Outcome::Rejected(violation) => Verdict::Rejected(violation),
            Outcome::Refused {
                reason,
                own,
                maybe_stored,
            } => Verdict::Refused {
                reason,
                own,
                maybe_stored,
            },
            Outcome::StoredBefore => {
                metrics.republish_avoided();
                Verdict::Delivered
            }
            Outcome::Acked { ack, waited } => {
                deliveries.now();
                let origin = work.origin();
                metrics.published(origin, waited, ack.duplicate);
                if let (Origin::Stream, Some(committed)) = (origin, work.at) {
                    metrics.delivered_since_commit(committed);
                }
                Verdict::Delivered
            }
        };
        Finished { work, verdict }
    }
}

/// The message the work carries, if it carries one that keeps the contract.
fn message_of(work: &Work) -> Option<&OutboxMessage> {
    work.message.as_ref()?.message.as_ref().ok()
}

/// Work handed to the broker (see [`Flight::put`]).
enum Sent {
    /// On the wire: the broker's answer to await (or the send's failure),
    /// timed from `since`.
    Awaiting {
        work: Work,
        answer: AckFuture,
        since: Instant,
    },
    /// Not on the wire: what it comes to is known without the broker.
    Known(Attempt),
}

impl Sent {
    /// Waits for the broker's answer, and sorts it.
    async fn answer(self) -> Answer {
        let (work, result, waited) = match self {
            Sent::Known(attempt) => return Answer::Known(attempt),
            Sent::Awaiting {
                work,
                answer,
                since,
            } => (work, answer.await, since.elapsed()),
        };
        let outcome = match result {
            Ok(ack) => Outcome::Acked { ack, waited },
            Err(PublishError::Invalid(violation)) => Outcome::Rejected(violation),
            Err(error @ PublishError::Refused(_)) => Outcome::refused(&error, false),
            Err(error @ (PublishError::Unavailable(_) | PublishError::Uncaptured(_))) => {
                return Answer::InDoubt(Doubt { work, error });
            }
        };
        Answer::Known(Attempt { work, outcome })
    }
}

/// The broker's answer to a send, sorted by whose it is.
enum Answer {
    /// What the attempt came to.
    Known(Attempt),
    /// A failure that may be the broker's or the message's (the broker is
    /// unavailable, or nothing took the subject): settled
    /// ([`Flight::settle`]) before anyone is charged.
    InDoubt(Doubt),
}

/// A message whose failure may be the broker's or its own.
struct Doubt {
    work: Work,
    error: PublishError,
}

impl Doubt {
    /// Settled as a refusal of the message (see [`Outcome::Refused`]).
    fn refused(self, error: &PublishError, own: bool) -> Attempt {
        Attempt {
            work: self.work,
            outcome: Outcome::Refused {
                reason: error.to_string(),
                own,
                // Unanswered, not refused: JetStream may have stored it.
                maybe_stored: matches!(self.error, PublishError::Unavailable(_)),
            },
        }
    }
}

/// What the broker's answer to a probe means for a message in doubt.
enum Finding {
    /// Settled as a refusal (see [`Finding::of`] for whose).
    Refused { error: PublishError, own: bool },
    /// The broker takes messages there: the message is sent once more, as
    /// a failure from before (an acknowledgement in flight when the broker
    /// went away) says nothing about it.
    BrokerTakes,
    /// The broker takes nothing, or the publisher cannot tell: delivery
    /// pauses (readiness says `why`; the log, `logged`), and the message
    /// is sent again after a backoff step, still in doubt.
    BrokerAway { why: String, logged: String },
}

impl Finding {
    /// What `health` means for a message that failed with `error`, sent
    /// again or not since the broker was last seen taking messages.
    fn of(health: Health, error: &PublishError, resent_while_taken: bool) -> Self {
        match health {
            // Failing again where the broker takes messages: its own.
            Health::Takes if resent_while_taken => Finding::Refused {
                error: PublishError::Refused(format!(
                    "{error}, while the broker takes other messages"
                )),
                own: true,
            },
            Health::Takes => Finding::BrokerTakes,
            // Its destination's fault, which says nothing about the message.
            Health::TakesOthers(why) => Finding::Refused {
                error: PublishError::Refused(format!("{error} ({why})")),
                own: false,
            },
            Health::TakesNone(why) => Finding::BrokerAway {
                logged: format!("{error} ({why})"),
                why,
            },
            Health::Unknown => Finding::BrokerAway {
                why: error.to_string(),
                logged: error.to_string(),
            },
        }
    }
}

/// A message's life in flight, from its put on the wire (or from when it
/// was taken, for one that waits for its key's turn) to what it came to,
/// with its work's place in the stage's input. No attempt if the relay
/// stopped at once while its answer was in doubt: it gets no verdict and
/// stays pending, and its turn, dropped, holds its key.
type Life = BoxFuture<'static, (u64, Option<Attempt>)>;

/// The messages in flight, whose lives end in any order.
type InFlight = FuturesUnordered<Life>;

/// The life in flight of the work at `place`, which `landing` ends.
fn life(place: u64, landing: impl Future<Output = Option<Attempt>> + Send + 'static) -> Life {
    landing.map(move |attempt| (place, attempt)).boxed()
}

/// Work going on the wire: the first of a sent message's two steps, the
/// one that keeps the order the stage reads work in. The stage puts one
/// message at a time and takes no more work until the put is done; a put
/// that must wait (for room in the client) waits in [`Wire`], beside the
/// answers in flight, which make that room. The second step, awaiting the
/// answer, is the message's [`Life`] in flight, beside the others. Ends
/// `None` if the relay stopped at once first: nothing went on the wire,
/// and the work stays pending (its turn, dropped, holds its key).
type Put = BoxFuture<'static, Option<OnTheWire>>;

/// What a [`Put`] handed to the broker, ready for its life in flight.
struct OnTheWire {
    place: u64,
    sent: Sent,
    /// Its turn in its key's line, ended with what it comes to.
    turn: Option<Turn>,
}

impl OnTheWire {
    /// Its life in flight (see [`Flight::land`]).
    fn in_flight(self, flight: &Flight) -> Life {
        life(self.place, flight.clone().land(self.sent, self.turn))
    }
}

/// The put under way, if any.
#[derive(Default)]
struct Wire(Option<Put>);

impl Wire {
    fn is_busy(&self) -> bool {
        self.0.is_some()
    }

    /// Starts `put`, and returns what it handed to the broker if the
    /// client took the message at once, as it nearly always does: then it
    /// costs the stage's loop no extra turn. A put that must wait is under
    /// way until [`Wire::done`].
    fn start(&mut self, mut put: Put) -> Option<OnTheWire> {
        match (&mut put).now_or_never() {
            Some(on_the_wire) => on_the_wire,
            None => {
                self.0 = Some(put);
                None
            }
        }
    }

    /// Waits for the put under way to be done; for ever if none is.
    async fn done(&mut self) -> Option<OnTheWire> {
        let Some(put) = self.0.as_mut() else {
            return std::future::pending().await;
        };
        let on_the_wire = put.await;
        self.0 = None;
        on_the_wire
    }

    /// Stopping at once: a put not yet done is dropped, and nothing of it
    /// goes on the wire.
    fn stop(&mut self) {
        self.0 = None;
    }
}

/// What becomes of work as the stage takes it (see [`PublishStage::take`]).
enum Taken {
    /// It goes on the wire now, before any work read after it.
    Put(Put),
    /// Its life is in flight from now on: it is parked at once behind its
    /// key's holder, or it waits for its key's turn, aside from the window,
    /// and goes on the wire when its turn comes, in its key's order rather
    /// than the input's.
    InFlight(Life),
}

/// How many messages in flight are aside from the window: waiting, unsent,
/// for their key's turn, or settling an answer in doubt.
///
/// `--max-in-flight` bounds what is sent and awaited on a first try; a
/// message waiting behind an earlier one of its key is not on the wire,
/// and one settling a doubt waits on its own answer, so neither counts
/// against it: a hot key, or a few messages whose answers never come,
/// cannot fill the window and hold back other keys. Up to
/// [`Aside::PER_SENT`] times as many may be aside: the look-ahead past
/// them, in bounded memory.
#[derive(Default, Clone)]
struct Aside(Arc<AsideCount>);

#[derive(Default)]
struct AsideCount {
    count: AtomicUsize,
    /// Woken when a message steps aside or comes back: the room changed.
    changed: Notify,
}

impl Aside {
    const PER_SENT: usize = 16;

    /// One message aside, until the slot is dropped.
    fn take(&self) -> AsideSlot {
        self.0.count.fetch_add(1, Ordering::Relaxed);
        self.0.changed.notify_one();
        AsideSlot(self.0.clone())
    }

    /// Whether the stage may take more work: room on the wire, and room
    /// for one more aside.
    fn room(&self, in_flight: usize, max_in_flight: usize) -> bool {
        let aside = self.0.count.load(Ordering::Relaxed).min(in_flight);
        let most_aside = max_in_flight.saturating_mul(Self::PER_SENT);
        in_flight - aside < max_in_flight && aside < most_aside
    }

    /// Waits until a message steps aside or comes back.
    async fn changed(&self) {
        self.0.changed.notified().await;
    }
}

struct AsideSlot(Arc<AsideCount>);

impl Drop for AsideSlot {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::Relaxed);
        self.0.changed.notify_one();
    }
}

/// Whether delivery flows. While it is paused the stage takes no new
/// work, and readiness says why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Delivery {
    Flowing,
    /// The broker was found taking nothing, and not yet found back.
    Paused,
}

/// The asking of the broker about messages in doubt, shared by the
/// messages of one stage.
///
/// Rules: one message at a time asks: it holds [`Asking`] while
/// it asks, and while it waits out a backoff step after an answer that
/// the broker takes nothing; the others wait for the turn rather than
/// each ask and send again, so an outage costs one probe and one send a
/// step, not one a message. Delivery is paused from an answer that the
/// broker takes nothing until an answer that it takes messages, and only
/// the message holding the turn changes it.
struct Probing {
    /// The outage as found, held by the message asking.
    outage: tokio::sync::Mutex<FoundOutage>,
    /// Whether delivery flows, for the stage's loop, which does not ask.
    delivery: watch::Sender<Delivery>,
}

/// An outage as the asking messages find it: logged as it starts and
/// ends, and reported to readiness while delivery is paused.
struct FoundOutage {
    log: Outage,
    /// Held while delivery is paused: readiness reports it until dropped.
    reported: Option<PausedDelivery>,
}

/// The right to ask the broker, held by one message at a time.
struct Asking<'a> {
    outage: tokio::sync::MutexGuard<'a, FoundOutage>,
    delivery: &'a watch::Sender<Delivery>,
}

impl Probing {
    fn new() -> Self {
        Probing {
            outage: tokio::sync::Mutex::new(FoundOutage {
                log: Outage::new("NATS publishing"),
                reported: None,
            }),
            delivery: watch::Sender::new(Delivery::Flowing),
        }
    }

    /// Waits for the right to ask; `None` if the relay stops at once first.
    async fn wait_to_ask(&self, abandon: &CancellationToken) -> Option<Asking<'_>> {
        tokio::select! {
            biased;
            _ = abandon.cancelled() => None,
            outage = self.outage.lock() => Some(Asking {
                outage,
                delivery: &self.delivery,
            }),
        }
    }
}

impl Asking<'_> {
    /// The broker takes nothing (`why`, as readiness says it; `logged`, as
    /// the log does): delivery pauses.
    fn broker_away(&mut self, why: &str, logged: &str, metrics: &Metrics) {
        self.outage.log.failed(&logged);
        self.outage
            .reported
            .get_or_insert_with(|| metrics.pause_delivery(why));
        self.delivery.send_replace(Delivery::Paused);
    }

    /// The broker takes messages: delivery goes on.
    fn broker_back(&mut self) {
        if self.outage.reported.take().is_some() {
            self.outage.log.recovered();
        }
        self.delivery.send_replace(Delivery::Flowing);
    }
}

/// What every message in flight shares, one reference a message.
#[derive(Clone)]
struct Flight(Arc<FlightShared>);

impl std::ops::Deref for Flight {
    type Target = FlightShared;

    fn deref(&self) -> &FlightShared {
        &self.0
    }
}

/// Where messages go, when to stop, the window they may step aside from,
/// and their asking of the broker when in doubt.
struct FlightShared {
    publisher: Arc<dyn Publisher>,
    term: Option<Term>,
    /// The term's messages sent and not yet recorded, which a first send
    /// takes a slot among; `None` outside a term.
    unrecorded: Option<Unrecorded>,
    acknowledged: Acknowledged,
    metrics: Metrics,
    shutdown: CancellationToken,
    abandon: CancellationToken,
    aside: Aside,
    probing: Probing,
}

impl Flight {
    /// The first send of work the stage takes now (see [`Put`]).
    fn put_now(&self, place: u64, work: Work, turn: Option<Turn>, started: Instant) -> Put {
        let flight = self.clone();
        async move {
            let sent = flight.put_first(work, started).await?;
            Some(OnTheWire { place, sent, turn })
        }
        .boxed()
    }

    /// Puts the work's message (if any) on the wire now; `None` if the
    /// relay stopped at once first (a send may wait for room in the
    /// client, or for a slot among the term's unrecorded messages, and
    /// nothing may go on the wire after the stop). A message NATS already
    /// acknowledged to this relay is not sent again where nothing has
    /// touched it since (see `Acknowledged`).
    async fn put_first(&self, mut work: Work, started: Instant) -> Option<Sent> {
        let Some(message) = message_of(&work) else {
            return self.put(work, started).await;
        };
        let again = self.acknowledged.again(&message.id, self.term);
        if again == Again::Stored {
            return Some(Sent::Known(Attempt {
                work,
                outcome: Outcome::StoredBefore,
            }));
        }
        if let Some(unrecorded) = &self.unrecorded {
            work.sent = tokio::select! {
                biased;
                _ = self.abandon.cancelled() => return None,
                slot = unrecorded.slot() => slot,
            };
        }
        if again == Again::Republish {
            self.metrics.republished();
        }
        self.put(work, started).await
    }

    /// Puts the work's message (if any) on the wire now; `None` if the
    /// relay stopped at once first.
    async fn put(&self, work: Work, started: Instant) -> Option<Sent> {
        let message = match work.message.as_ref().map(|m| &m.message) {
            Some(Ok(message)) => message,
            Some(Err(violation)) => {
                let outcome = Outcome::Rejected(violation.clone());
                return Some(Sent::Known(Attempt { work, outcome }));
            }
            None => {
                let outcome = Outcome::Passed;
                return Some(Sent::Known(Attempt { work, outcome }));
            }
        };
        let answer = tokio::select! {
            biased;
            _ = self.abandon.cancelled() => return None,
            sent = self.publisher.send(message) => sent,
        };
        Some(Sent::Awaiting {
            work,
            answer: answer.unwrap_or_else(|error| future::ready(Err(error)).boxed()),
            since: started,
        })
    }

    /// The rest of a sent message's life: its answer, settled if it is in
    /// doubt, then its turn (if it has one) ended with what it came to.
    /// The one place a sent message's turn ends; should the relay stop at
    /// once first, the turn is dropped instead, and holds its key.
    async fn land(self, sent: Sent, turn: Option<Turn>) -> Option<Attempt> {
        let attempt = match sent.answer().await {
            Answer::Known(attempt) => attempt,
            Answer::InDoubt(doubt) => self.settle(doubt).await?,
        };
        let for_key = attempt.outcome.for_key();
        // A sent message's outcome always says what its key's turn came
        // to; a turn dropped unended would hold its key for the term.
        debug_assert!(
            turn.is_none() || for_key.is_some(),
            "a sent message's outcome ends its turn"
        );
        if let (Some(turn), Some(outcome)) = (turn, for_key) {
            turn.finish(outcome);
        }
        Some(attempt)
    }

    /// The life in flight of work that waits for its key's turn: then it
    /// is sent or parked. Aside from the window (`slot`) while it waits.
    async fn after_turn(
        self,
        work: Work,
        mut turn: Turn,
        started: Instant,
        slot: AsideSlot,
    ) -> Option<Attempt> {
        turn.wait().await;
        drop(slot);
        match turn.admit() {
            Admission::Park(ticket) => Some(Attempt::parked(work, ticket)),
            // Stopping at once: nothing more goes on the wire, and without
            // a verdict the work stays as it is (its turn, dropped, holds
            // its key).
            Admission::Send(_) if self.abandon.is_cancelled() => None,
            Admission::Send(turn) => {
                let sent = self.put_first(work, started).await?;
                self.land(sent, Some(turn)).await
            }
        }
    }

    /// Settles a doubt: sends the message again until its failure is no
    /// longer in doubt (delivered, refused, or found to be its own).
    /// `None` if the relay stopped first. Aside from the window meanwhile.
    ///
    /// Each failure in doubt asks the broker ([`Finding`]). Where the
    /// broker is away, this message keeps asking, and sending again, at
    /// every backoff step, and holds [`Asking`] until the broker is
    /// back: the others wait for it.
    async fn settle(&self, mut doubt: Doubt) -> Option<Attempt> {
        let _aside = self.aside.take();
        // Its slot among the unrecorded goes to another message meanwhile
        // (see `Unrecorded`): one whose answer never comes holds none back.
        doubt.work.sent = None;
        let Some(subject) = message_of(&doubt.work).map(|m| m.subject.clone()) else {
            // Only a message is sent, so only a message is in doubt.
            let error = doubt.error.clone();
            return Some(doubt.refused(&error, false));
        };
        let mut backoff = reconnect_backoff();
        // Held from an answer that the broker is away until it is back.
        let mut kept = None;
        // Sent again since the broker was seen taking messages.
        let mut resent_while_taken = false;
        loop {
            // Stopping at once: what is in doubt stays so, and pending.
            if self.abandon.is_cancelled() {
                return None;
            }
            let mut asking = match kept.take() {
                Some(asking) => asking,
                None => self.probing.wait_to_ask(&self.abandon).await?,
            };
            let health = self.publisher.probe(&subject).await;
            match Finding::of(health, &doubt.error, resent_while_taken) {
                Finding::Refused { error, own } => {
                    asking.broker_back();
                    return Some(doubt.refused(&error, own));
                }
                Finding::BrokerTakes => {
                    asking.broker_back();
                    // The others need not wait for this one's second answer.
                    drop(asking);
                    resent_while_taken = true;
                }
                Finding::BrokerAway { why, logged } => {
                    asking.broker_away(&why, &logged, &self.metrics);
                    if !self.back_off(&mut backoff).await {
                        return None;
                    }
                    // Keep asking, the others waiting.
                    kept = Some(asking);
                    resent_while_taken = false;
                }
            }
            self.metrics.resent();
            let sent = self.put(doubt.work, Instant::now()).await?;
            doubt = match sent.answer().await {
                Answer::InDoubt(again) => again,
                Answer::Known(attempt) => {
                    // Settled after the broker was found away: it answers again.
                    if let Some(mut asking) = kept {
                        asking.broker_back();
                    }
                    return Some(attempt);
                }
            };
        }
    }

    /// Waits out the next backoff step. False if the relay must stop
    /// publishing.
    async fn back_off(&self, backoff: &mut ExponentialBackoff) -> bool {
        tokio::select! {
            biased;
            _ = self.abandon.cancelled() => false,
            waited = back_off(backoff, &self.shutdown) => waited,
        }
    }
}

/// The stream positions of work that has its verdict while work before it
/// does not: each is passed on once everything before it has its verdict.
#[derive(Default)]
struct Positions {
    /// The place the next work takes.
    next: u64,
    /// The places of work with no verdict yet.
    open: BTreeSet<u64>,
    /// Positions waiting for earlier work, by place.
    waiting: BTreeMap<u64, (ResumeToken, Option<DateTime>)>,
}

impl Positions {
    /// A place for new work.
    fn enter(&mut self) -> u64 {
        let place = self.next;
        self.next += 1;
        self.open.insert(place);
        place
    }

    /// The work at `place` has its verdict: takes its position, and returns
    /// the newest position that nothing before it holds back any more.
    fn done(&mut self, place: u64, work: &mut Work) -> Option<Work> {
        self.open.remove(&place);
        if let Some(token) = work.token.take() {
            self.waiting.insert(place, (token, work.at));
        }
        let ready = match self.open.first() {
            Some(&first) => {
                let later = self.waiting.split_off(&first);
                std::mem::replace(&mut self.waiting, later)
            }
            None => std::mem::take(&mut self.waiting),
        };
        let (_, (token, at)) = ready.into_iter().next_back()?;
        Some(Work::marker(token, at))
    }
}

/// Drives a [`Publisher`] from a channel of work to a channel of verdicts.
pub(crate) struct PublishStage {
    pub publisher: Arc<dyn Publisher>,
    pub max_in_flight: usize,
    /// Graceful stop: the source closes the input, and what was read is
    /// published; only waiting out a broker outage ends at once.
    pub shutdown: CancellationToken,
    /// The stop at once (the lease is lost, the grace time is over, or a
    /// run's time is up; see [`crate::stop`]):
    /// no queued work is taken and nothing is sent again; answers already
    /// due are collected until one is found still in doubt. What has no
    /// verdict stays pending for the next leader (JetStream drops a repeat
    /// of one that did arrive).
    pub abandon: CancellationToken,
    pub metrics: Metrics,
    /// When the relay last delivered anything, for the completion stage.
    pub deliveries: LastDelivery,
    /// The term published in, with its per-key order; `None` keeps no
    /// order by key.
    pub tenure: Option<Tenure>,
    /// What NATS acknowledged and is not marked yet (see `Acknowledged`).
    pub acknowledged: Acknowledged,
}

impl PublishStage {
    /// The term published in, if any.
    fn term(&self) -> Option<Term> {
        self.tenure.as_ref().map(|tenure| tenure.term)
    }

    /// The term's per-key order, if in a term.
    fn order(&self) -> Option<&KeyOrder> {
        self.tenure.as_ref().map(|tenure| &tenure.order)
    }

    pub async fn run(self, mut input: mpsc::Receiver<Work>, output: mpsc::Sender<Finished>) {
        if !self.stored_holds_known().await {
            return;
        }
        let flight = self.flight();
        let mut delivery = flight.probing.delivery.subscribe();
        let mut in_flight = InFlight::new();
        let mut wire = Wire::default();
        let mut positions = Positions::default();
        let mut input_open = true;
        while input_open || wire.is_busy() || !in_flight.is_empty() {
            let under_way = in_flight.len() + usize::from(wire.is_busy());
            let room = flight.aside.room(under_way, self.max_in_flight);
            let flowing = *delivery.borrow_and_update() == Delivery::Flowing;
            tokio::select! {
                biased;
                // Stopping at once: the work not yet on the wire stays pending.
                _ = self.abandon.cancelled(), if input_open || wire.is_busy() => {
                    input_open = false;
                    wire.stop();
                }
                // A message that stepped aside, or came back, changed the room.
                _ = flight.aside.changed(), if input_open && !room => {}
                _ = delivery.changed(), if input_open && !flowing => {}
                Some((place, landed)) = in_flight.next(), if !in_flight.is_empty() => {
                    let Some(attempt) = landed else { break };
                    if !self.forward(attempt, place, &mut positions, &output).await {
                        break;
                    }
                }
                done = wire.done(), if wire.is_busy() => {
                    if let Some(on_the_wire) = done {
                        in_flight.push(on_the_wire.in_flight(&flight));
                    }
                }
                work = input.recv(), if input_open && room && flowing && !wire.is_busy() => {
                    let Some(work) = work else {
                        input_open = false;
                        continue;
                    };
                    match self.take(&flight, positions.enter(), work) {
                        Taken::InFlight(life) => in_flight.push(life),
                        Taken::Put(put) => {
                            if let Some(on_the_wire) = wire.start(put) {
                                in_flight.push(on_the_wire.in_flight(&flight));
                            }
                        }
                    }
                }
            }
        }
        self.remember_answered(&mut in_flight);
    }

    /// The stage stops at once (the term is lost) with messages in flight:
    /// the deliveries whose answers have come already are remembered, as
    /// completion will not mark them. Polled only once the relay stops at
    /// once, when every life in flight ends without sending.
    fn remember_answered(&self, in_flight: &mut InFlight) {
        if in_flight.is_empty() || !self.abandon.is_cancelled() {
            return;
        }
        let answered = std::iter::from_fn(|| in_flight.next().now_or_never().flatten())
            .filter_map(|(_, landed)| landed)
            .map(|attempt| attempt.finish(&self.metrics, &self.deliveries));
        self.acknowledged.remember_unmarked(self.term(), answered);
    }

    fn flight(&self) -> Flight {
        Flight(Arc::new(FlightShared {
            publisher: self.publisher.clone(),
            term: self.term(),
            unrecorded: self.tenure.as_ref().map(|tenure| tenure.unrecorded.clone()),
            acknowledged: self.acknowledged.clone(),
            metrics: self.metrics.clone(),
            shutdown: self.shutdown.clone(),
            abandon: self.abandon.clone(),
            aside: Aside::default(),
            probing: Probing::new(),
        }))
    }

    /// Waits until the term's order knows the holds the collection records,
    /// before any message takes its turn. False if the relay stopped first:
    /// nothing read is published, and all of it stays pending.
    async fn stored_holds_known(&self) -> bool {
        let Some(order) = self.order() else {
            return true;
        };
        let stop = async {
            tokio::select! {
                _ = self.shutdown.cancelled() => {}
                _ = self.abandon.cancelled() => {}
            }
        };
        order.stored_holds_before(stop).await
    }

    /// Passes the verdict on, and then the stream position it frees, if
    /// any; false if completion has gone.
    async fn forward(
        &self,
        attempt: Attempt,
        place: u64,
        positions: &mut Positions,
        output: &mpsc::Sender<Finished>,
    ) -> bool {
        let mut finished = attempt.finish(&self.metrics, &self.deliveries);
        let position = positions.done(place, &mut finished.work);
        if finished.work.message.is_some() {
            if let Err(unrecorded) = output.send(finished).await {
                // Completion has gone (the term is lost): a delivery it
                // never saw is remembered, not published again.
                self.acknowledged
                    .remember_unmarked(self.term(), [unrecorded.0]);
                return false;
            }
        }
        match position {
            Some(work) => {
                let marker = Finished {
                    work,
                    verdict: Verdict::Passed,
                };
                output.send(marker).await.is_ok()
            }
            None => true,
        }
    }

    /// Takes the work's turn in its key's line, and decides what becomes
    /// of it: it goes on the wire now if nothing of its key is before it
    /// (sends keep the input's order), and later, in its life in flight,
    /// if something is. The turn goes with the work: to
    /// [`Flight::after_turn`] if it waits, else to [`Flight::land`], which
    /// ends it with what the message comes to; a parked message's ends as
    /// it is parked.
    fn take(&self, flight: &Flight, place: u64, work: Work) -> Taken {
        let started = Instant::now();
        let Some(mut turn) = self.turn(&work) else {
            return Taken::Put(flight.put_now(place, work, None, started));
        };
        if !turn.first() {
            // Aside from now on, so the stage's room counts it at once.
            let slot = flight.aside.take();
            let waiting = flight.clone().after_turn(work, turn, started, slot);
            return Taken::InFlight(life(place, waiting));
        }
        match turn.admit() {
            Admission::Park(ticket) => {
                let parked = Attempt::parked(work, ticket);
                Taken::InFlight(life(place, future::ready(Some(parked))))
            }
            Admission::Send(turn) => Taken::Put(flight.put_now(place, work, Some(turn), started)),
        }
    }

    /// The work's place in its key's line, if it carries a keyed message
    /// (one that breaks the contract too: it is failed in its turn).
    fn turn(&self, work: &Work) -> Option<Turn> {
        let order = self.order()?;
        let decoded = work.message.as_ref()?;
        let key = decoded.key.as_deref()?;
        Some(order.enter(key, &decoded.id, work.release))
    }
}
