//! What the publish stage promises, checked against a scripted broker.
//!
//! Verdicts leave as answers come, with at most `max_in_flight`
//! acknowledgements awaited at once, and a stream position only once
//! everything before it has its verdict; a key's messages keep their
//! order. Each kind of result becomes its verdict: a delivery, a broken
//! message's rejection, a refusal charged to the message (its own only when
//! the broker was seen taking messages), or a pass for work without a
//! message. A broker that takes nothing pauses delivery without charging
//! anyone, and delivery resumes in order when it comes back. Abandoning takes
//! no more work and publishes nothing more; closing the input finishes what
//! was read.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson};
use bytes::Bytes;
use futures::future::{self, BoxFuture, FutureExt};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::stage::PublishStage;
use super::{Ack, AckFuture, Health, PublishError, Publisher};
use crate::config::DeadLetters;
use crate::contract::{header, ContractViolation, Decoded, OutboxMessage, Rule};
use crate::lease::Term;
use crate::observe::Metrics;
use crate::order::{HeldKey, Holder, KeyOrder};
use crate::work::{Acknowledged, Again, Finished, LastDelivery, Tenure, Unrecorded, Verdict, Work};

/// Long enough for anything the stage does, backoff included; with the
/// clock paused it passes only once every task is idle, so reaching it
/// means the stage is stuck, not slow.
const PATIENCE: Duration = Duration::from_secs(3600);

/// How long the stage is given to do something it should not; with the
/// clock paused this spans several backoff steps of an outage.
const QUIET: Duration = Duration::from_secs(60);

/// What the fake broker does with one send.
#[derive(Debug, Clone)]
enum Reply {
    Ack,
    SendFails(PublishError),
    AckFails(PublishError),
    /// The acknowledgement waits until the test releases it.
    Hold,
    /// The acknowledgement fails after a while (of the paused clock), as
    /// one that never comes times out.
    AckFailsAfter(Duration, PublishError),
    /// The acknowledgement comes after a while, as over a network.
    AckAfter(Duration),
}

#[derive(Default)]
struct Script {
    /// The next replies for a subject, one per send; then `default`.
    replies: HashMap<String, VecDeque<Reply>>,
    default: Option<Reply>,
    /// The next probe answers; then `health`.
    answers: VecDeque<Health>,
    health: Option<Health>,
    held: HashMap<String, VecDeque<oneshot::Sender<Result<Ack, PublishError>>>>,
    /// Room for unacknowledged sends, where the broker's client has a
    /// limit: a send waits for room, and its acknowledgement, once
    /// awaited to its end, gives the room back (as async-nats does).
    slots: Option<Arc<Semaphore>>,
    sends: Vec<String>,
    probes: Vec<String>,
}

/// A broker whose every answer the test sets, and which reports each send
/// and probe as it happens so the test can wait for them.
struct FakeBroker {
    script: Mutex<Script>,
    sent: mpsc::UnboundedSender<String>,
    probed: mpsc::UnboundedSender<String>,
}

impl FakeBroker {
    fn script(&self) -> MutexGuard<'_, Script> {
        self.script
            .lock()
            .expect("the fake broker's script is not poisoned")
    }

    fn reply(&self, subject: &str, replies: impl IntoIterator<Item = Reply>) {
        self.script()
            .replies
            .entry(subject.to_owned())
            .or_default()
            .extend(replies);
    }

    /// The reply to every send not scripted per subject.
    fn by_default(&self, reply: Reply) {
        self.script().default = Some(reply);
    }

    fn answer_probes(&self, answers: impl IntoIterator<Item = Health>) {
        self.script().answers.extend(answers);
    }

    /// Gives the broker's client room for only `slots` unacknowledged sends.
    fn limit_unacknowledged(&self, slots: usize) {
        self.script().slots = Some(Arc::new(Semaphore::new(slots)));
    }

    /// The probe's answer once the scripted ones are used up.
    fn health(&self, health: Health) {
        self.script().health = Some(health);
    }

    /// Resolves the oldest held acknowledgement of `subject`.
    fn release(&self, subject: &str, result: Result<Ack, PublishError>) {
        let ack = self
            .script()
            .held
            .get_mut(subject)
            .and_then(VecDeque::pop_front)
            .unwrap_or_else(|| panic!("no acknowledgement of {subject} is held"));
        // The stage may have dropped the acknowledgement; the verdicts tell.
        let _ = ack.send(result);
    }

    fn sends(&self) -> Vec<String> {
        self.script().sends.clone()
    }

    fn sends_to(&self, subject: &str) -> usize {
        self.script().sends.iter().filter(|s| *s == subject).count()
    }

    fn probes(&self) -> usize {
        self.script().probes.len()
    }
}

impl Publisher for FakeBroker {
    fn send<'a>(
        &'a self,
        message: &'a OutboxMessage,
    ) -> BoxFuture<'a, Result<AckFuture, PublishError>> {
        let slots = self.script().slots.clone();
        let Some(slots) = slots else {
            return future::ready(self.scripted(message)).boxed();
        };
        async move {
            let slot = slots
                .acquire_owned()
                .await
                .expect("the test never closes the slots");
            let ack = self.scripted(message)?;
            Ok(ack
                .map(move |answer| {
                    drop(slot);
                    answer
                })
                .boxed())
        }
        .boxed()
    }

    fn max_payload(&self) -> usize {
        usize::MAX
    }

    fn probe<'a>(&'a self, subject: &'a str) -> BoxFuture<'a, Health> {
        let health = {
            let mut script = self.script();
            script.probes.push(subject.to_owned());
            script
                .answers
                .pop_front()
                .or_else(|| script.health.clone())
                .unwrap_or(Health::Takes)
        };
        let _ = self.probed.send(subject.to_owned());
        future::ready(health).boxed()
    }
}

impl FakeBroker {
    /// Sends `message` as the script says, and reports the send.
    fn scripted(&self, message: &OutboxMessage) -> Result<AckFuture, PublishError> {
        let subject = message.subject.clone();
        let result = {
            let mut script = self.script();
            script.sends.push(subject.clone());
            let reply = script
                .replies
                .get_mut(&subject)
                .and_then(VecDeque::pop_front)
                .or_else(|| script.default.clone())
                .unwrap_or(Reply::Ack);
            match reply {
                Reply::Ack => Ok(future::ready(Ok(Ack::default())).boxed()),
                Reply::SendFails(error) => Err(error),
                Reply::AckFails(error) => Ok(future::ready(Err(error)).boxed()),
                Reply::Hold => {
                    let (release, ack) = oneshot::channel();
                    script
                        .held
                        .entry(subject.clone())
                        .or_default()
                        .push_back(release);
                    let ack: AckFuture = ack
                        .map(|result| {
                            result.unwrap_or_else(|_| {
                                Err(PublishError::Unavailable("the test dropped the ack".into()))
                            })
                        })
                        .boxed();
                    Ok(ack)
                }
                Reply::AckFailsAfter(after, error) => {
                    Ok(tokio::time::sleep(after).map(move |()| Err(error)).boxed())
                }
                Reply::AckAfter(after) => Ok(tokio::time::sleep(after)
                    .map(|()| Ok(Ack::default()))
                    .boxed()),
            }
        };
        let _ = self.sent.send(subject);
        result
    }
}

/// A running stage and everything the test watches it through.
struct Running {
    input: mpsc::Sender<Work>,
    output: mpsc::Receiver<Finished>,
    sent: mpsc::UnboundedReceiver<String>,
    probed: mpsc::UnboundedReceiver<String>,
    abandon: CancellationToken,
    shutdown: CancellationToken,
    metrics: Metrics,
    deliveries: LastDelivery,
    /// The stage's term, if it is in one.
    tenure: Option<Tenure>,
    task: JoinHandle<()>,
}

fn start(max_in_flight: usize) -> (Arc<FakeBroker>, Running) {
    start_with(max_in_flight, None)
}

/// A stage keeping per-key order, starting with no key held.
fn start_keyed(max_in_flight: usize, chained: bool) -> (Arc<FakeBroker>, Running, KeyOrder) {
    let order = KeyOrder::new(Vec::new(), DeadLetters::Release, chained, Metrics::new());
    let (broker, running) = start_with(max_in_flight, Some(order.clone()));
    (broker, running, order)
}

fn start_with(max_in_flight: usize, order: Option<KeyOrder>) -> (Arc<FakeBroker>, Running) {
    start_in(max_in_flight, order, None, Acknowledged::default())
}

/// A stage of `term`, remembering acknowledgements in `acknowledged`.
fn start_in(
    max_in_flight: usize,
    order: Option<KeyOrder>,
    term: Option<Term>,
    acknowledged: Acknowledged,
) -> (Arc<FakeBroker>, Running) {
    let (sent, sent_rx) = mpsc::unbounded_channel();
    let (probed, probed_rx) = mpsc::unbounded_channel();
    let broker = Arc::new(FakeBroker {
        script: Mutex::default(),
        sent,
        probed,
    });
    let (input, work) = mpsc::channel(64);
    let (finished, output) = mpsc::channel(64);
    let abandon = CancellationToken::new();
    let shutdown = CancellationToken::new();
    let metrics = Metrics::new();
    let deliveries = LastDelivery::default();
    // A stage given an order or a term is in a term, with both.
    let tenure = match (order, term) {
        (None, None) => None,
        (order, term) => Some(crate::testing::tenure(term, order)),
    };
    let stage = PublishStage {
        publisher: broker.clone(),
        max_in_flight,
        shutdown: shutdown.clone(),
        abandon: abandon.clone(),
        metrics: metrics.clone(),
        deliveries: deliveries.clone(),
        tenure: tenure.clone(),
        acknowledged,
    };
    let task = tokio::spawn(stage.run(work, finished));
    let running = Running {
        input,
        output,
        sent: sent_rx,
        probed: probed_rx,
        abandon,
        shutdown,
        metrics,
        deliveries,
        tenure,
        task,
    };
    (broker, running)
}

/// The `_id` of the message named `name` (of eight bytes at most): ids
/// sort as their names do, and [`name`] reads the name back.
fn named(name: &str) -> ObjectId {
    let mut bytes = [0u8; 12];
    bytes[..4].copy_from_slice(&1_700_000_000u32.to_be_bytes());
    assert!(name.len() <= 8, "a test message's name fits its id: {name}");
    bytes[4..4 + name.len()].copy_from_slice(name.as_bytes());
    ObjectId::from_bytes(bytes)
}

/// A message to `subject`; its verdict is known by the subject.
fn message(subject: &str) -> Work {
    let message = OutboxMessage {
        id: named(subject),
        message_type: "test".into(),
        subject: subject.into(),
        headers: Vec::new(),
        body: Bytes::from_static(b"{}"),
    };
    Work::from_catch_up(Decoded {
        id: Bson::ObjectId(named(subject)),
        message: Ok(message),
        attempts: None,
        key: None,
        stored: None,
    })
}

/// A message named `subject` (its subject too) with the key `key`.
fn keyed(subject: &str, key: &str) -> Work {
    let mut work = message(subject);
    if let Some(decoded) = work.message.as_mut() {
        decoded.key = Some(key.to_owned());
        if let Ok(message) = &mut decoded.message {
            message
                .headers
                .push((header::KEY.to_owned(), key.to_owned()));
        }
    }
    work
}

/// a1, a2 of key a, b1 of key b, then a3 of key a.
fn three_of_a_one_of_b() -> [Work; 4] {
    [
        keyed("a1", "a"),
        keyed("a2", "a"),
        keyed("b1", "b"),
        keyed("a3", "a"),
    ]
}

/// A document that failed decoding, known by `name`.
fn broken(name: &str, why: &str) -> Work {
    Work::from_catch_up(Decoded {
        id: Bson::ObjectId(named(name)),
        message: Err(ContractViolation::new(Rule::Document, why)),
        attempts: None,
        key: None,
        stored: None,
    })
}

/// A bare stream position.
fn marker() -> Work {
    let token = bson::from_bson(Bson::Document(doc! { "_data": "82000001" }))
        .expect("a resume token reads from {_data}");
    Work::marker(token, None)
}

/// How a verdict is told apart: the message's name, or "marker".
fn name(finished: &Finished) -> String {
    match &finished.work.message {
        Some(decoded) => {
            let id = decoded
                .id
                .as_object_id()
                .expect("test messages are named by their id");
            let bytes = id.bytes();
            let name = bytes[4..].iter().take_while(|b| **b != 0);
            String::from_utf8(name.copied().collect()).expect("a name is text")
        }
        None => "marker".to_owned(),
    }
}

fn names(verdicts: &[(String, Verdict)]) -> Vec<&str> {
    verdicts.iter().map(|(name, _)| name.as_str()).collect()
}

/// The keys held and their holders.
fn holding(order: &KeyOrder) -> Vec<(String, Bson)> {
    let holders = order.holders().into_iter();
    holders.map(|(key, id, _)| (key, id)).collect()
}

/// The names of the verdicts whose name starts with `key`, in order.
fn of_key<'a>(verdicts: &'a [(String, Verdict)], key: &str) -> Vec<&'a str> {
    let names = names(verdicts).into_iter();
    names.filter(|name| name.starts_with(key)).collect()
}

/// The readiness line about delivery.
fn delivery(metrics: &Metrics) -> String {
    metrics
        .readiness()
        .conditions
        .into_iter()
        .find(|condition| condition.starts_with("delivery:"))
        .expect("readiness reports delivery")
}

impl Running {
    async fn feed(&self, works: impl IntoIterator<Item = Work>) {
        for work in works {
            tokio::time::timeout(PATIENCE, self.input.send(work))
                .await
                .expect("the stage takes work in time")
                .expect("the stage is taking work");
        }
    }

    async fn verdict(&mut self) -> (String, Verdict) {
        let finished = tokio::time::timeout(PATIENCE, self.output.recv())
            .await
            .expect("a verdict in time")
            .expect("the stage is still running");
        (name(&finished), finished.verdict)
    }

    /// The next `n` finished works, held as completion holds a batch it
    /// records (each keeps its slot among the term's unrecorded).
    async fn finished(&mut self, n: usize) -> Vec<Finished> {
        let mut finished = Vec::with_capacity(n);
        for _ in 0..n {
            let next = tokio::time::timeout(PATIENCE, self.output.recv()).await;
            finished.push(next.expect("a verdict in time").expect("running"));
        }
        finished
    }

    async fn verdicts(&mut self, n: usize) -> Vec<(String, Verdict)> {
        let mut verdicts = Vec::with_capacity(n);
        for _ in 0..n {
            verdicts.push(self.verdict().await);
        }
        verdicts
    }

    /// The subject of the next probe.
    async fn probed(&mut self) -> String {
        tokio::time::timeout(PATIENCE, self.probed.recv())
            .await
            .expect("a probe in time")
            .expect("the broker is alive")
    }

    /// Every send until the stage goes idle.
    async fn sends_until_idle(&mut self) -> Vec<String> {
        let mut sent = Vec::new();
        while let Ok(subject) = tokio::time::timeout(QUIET, self.sent.recv()).await {
            sent.push(subject.expect("the broker is alive"));
        }
        sent
    }

    /// What a source does when it stops: drops its sender.
    fn close_input(&mut self) {
        let (closed, _) = mpsc::channel(1);
        drop(std::mem::replace(&mut self.input, closed));
    }

    async fn no_verdict(&mut self) -> bool {
        tokio::time::timeout(QUIET, self.output.recv())
            .await
            .is_err()
    }

    /// Waits for the stage to end, and returns the verdicts it gave on the way.
    async fn ended(mut self) -> Vec<(String, Verdict)> {
        let mut verdicts = Vec::new();
        loop {
            let next = tokio::time::timeout(PATIENCE, self.output.recv())
                .await
                .expect("the stage ends in time");
            match next {
                Some(finished) => verdicts.push((name(&finished), finished.verdict)),
                None => break,
            }
        }
        tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("the stage's task ends once its output closes")
            .expect("the stage ends without panicking");
        verdicts
    }
}

#[tokio::test(start_paused = true)]
async fn verdicts_leave_as_answers_come_and_a_position_waits_for_all_before_it() {
    let (broker, mut stage) = start(4);
    broker.by_default(Reply::Hold);
    stage
        .feed([message("m0"), message("m1"), marker(), message("m2")])
        .await;
    assert_eq!(stage.sends_until_idle().await, ["m0", "m1", "m2"]);
    broker.release("m2", Ok(Ack::default()));
    broker.release("m1", Ok(Ack::default()));
    assert_eq!(names(&stage.verdicts(2).await), ["m2", "m1"]);
    assert!(
        stage.no_verdict().await,
        "the position waits for m0, before it"
    );
    broker.release("m0", Ok(Ack::default()));
    let verdicts = stage.verdicts(2).await;
    assert_eq!(names(&verdicts), ["m0", "marker"]);
    assert!(
        verdicts
            .iter()
            .all(|(_, v)| matches!(v, Verdict::Delivered | Verdict::Passed)),
        "{verdicts:?}"
    );

    // A position a message carries waits too, and leaves after it.
    let mut carried = message("m4");
    if let Some(token) = marker().token {
        carried.token = Some(token);
    }
    stage.feed([message("m3"), carried]).await;
    assert_eq!(stage.sends_until_idle().await, ["m3", "m4"]);
    broker.release("m4", Ok(Ack::default()));
    let (first, _) = stage.verdict().await;
    assert_eq!(first, "m4");
    assert!(stage.no_verdict().await, "m4's position waits for m3");
    broker.release("m3", Ok(Ack::default()));
    assert_eq!(names(&stage.verdicts(2).await), ["m3", "marker"]);
    assert_eq!(
        broker.sends(),
        ["m0", "m1", "m2", "m3", "m4"],
        "each sent once"
    );
}

#[tokio::test(start_paused = true)]
async fn no_more_than_max_in_flight_acknowledgements_are_awaited_at_once() {
    let (broker, mut stage) = start(3);
    broker.by_default(Reply::Hold);
    stage
        .feed(["m0", "m1", "m2", "m3", "m4", "m5"].map(message))
        .await;

    assert_eq!(stage.sends_until_idle().await, ["m0", "m1", "m2"]);
    broker.release("m0", Ok(Ack::default()));
    assert_eq!(stage.verdict().await, ("m0".into(), Verdict::Delivered));
    assert_eq!(
        stage.sends_until_idle().await,
        ["m3"],
        "one verdict out makes room for one more send"
    );
}

#[tokio::test(start_paused = true)]
async fn a_term_sends_no_further_ahead_of_its_records_than_its_room() {
    let (broker, mut stage) = start_in(256, None, Some(Term(1)), Acknowledged::default());
    let names: Vec<String> = (0..50).map(|i| format!("m{i}")).collect();
    let feeding = {
        let input = stage.input.clone();
        let works: Vec<Work> = names.iter().map(|name| message(name)).collect();
        tokio::spawn(async move {
            for work in works {
                let _ = input.send(work).await;
            }
        })
    };
    let first = Unrecorded::FIRST;
    assert_eq!(
        stage.sends_until_idle().await.len(),
        first,
        "the room a term begins with"
    );
    let recording = stage.finished(first).await;
    assert!(
        stage.sends_until_idle().await.is_empty(),
        "nothing recorded yet"
    );
    drop(recording);
    let unrecorded = stage.tenure.as_ref().map(|t| t.unrecorded.clone());
    let unrecorded = unrecorded.expect("a term");
    unrecorded.recorded(4 * first);
    assert_eq!(
        stage.sends_until_idle().await.len(),
        first + 4,
        "each recorded message gives its slot back, and every FIRST adds one"
    );
    let recording = stage.finished(first + 4).await;
    drop(recording);
    assert_eq!(stage.sends_until_idle().await.len(), 50 - 2 * first - 4);
    feeding.await.expect("fed");
    assert_eq!(broker.sends().len(), 50);
}

#[tokio::test(start_paused = true)]
async fn an_acknowledged_message_is_delivered_and_counts_as_evidence_the_broker_works() {
    let (broker, mut stage) = start(8);
    assert!(!stage.deliveries.within(PATIENCE));
    stage.feed([message("a")]).await;

    assert_eq!(stage.verdict().await, ("a".into(), Verdict::Delivered));
    assert_eq!(broker.sends_to("a"), 1);
    assert_eq!(broker.probes(), 0, "nothing was in doubt");
    assert!(
        stage.deliveries.within(PATIENCE),
        "the completion stage needs the evidence to dead-letter anything"
    );
    let metrics = stage.metrics.render();
    assert!(
        metrics.contains("outbox_published_total{origin=\"catch_up\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn work_without_a_message_passes_without_reaching_the_broker() {
    let (broker, mut stage) = start(8);
    stage.feed([marker(), message("a")]).await;

    assert_eq!(
        stage.verdicts(2).await,
        [
            ("marker".into(), Verdict::Passed),
            ("a".into(), Verdict::Delivered)
        ]
    );
    assert_eq!(broker.sends(), ["a"]);
}

#[tokio::test(start_paused = true)]
async fn a_message_that_failed_decoding_is_rejected_without_reaching_the_broker() {
    let (broker, mut stage) = start(8);
    stage
        .feed([broken("broken", "no type"), message("a")])
        .await;

    assert_eq!(
        stage.verdicts(2).await,
        [
            (
                "broken".into(),
                Verdict::Rejected(ContractViolation::new(Rule::Document, "no type"))
            ),
            ("a".into(), Verdict::Delivered),
        ]
    );
    assert_eq!(broker.sends(), ["a"]);
    let metrics = stage.metrics.render();
    assert!(
        metrics.contains("outbox_published_total{origin=\"catch_up\"} 1"),
        "only the delivery counts as published: {metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_the_broker_calls_invalid_is_rejected_with_its_violation() {
    let (broker, mut stage) = start(8);
    let too_large = ContractViolation::new(Rule::TooLarge, "too large");
    let bad_header = ContractViolation::new(Rule::Header, "bad header");
    broker.reply(
        "big",
        [Reply::SendFails(PublishError::Invalid(too_large.clone()))],
    );
    broker.reply(
        "odd",
        [Reply::AckFails(PublishError::Invalid(bad_header.clone()))],
    );
    stage
        .feed([message("big"), message("odd"), message("a")])
        .await;

    assert_eq!(
        stage.verdicts(3).await,
        [
            ("big".into(), Verdict::Rejected(too_large)),
            ("odd".into(), Verdict::Rejected(bad_header)),
            ("a".into(), Verdict::Delivered),
        ]
    );
    assert_eq!(
        broker.sends(),
        ["big", "odd", "a"],
        "no retry can mend them"
    );
    assert_eq!(
        broker.probes(),
        0,
        "an invalid message says nothing about the broker"
    );
}

#[tokio::test(start_paused = true)]
async fn direct_refusals_are_charged_one_by_one_and_not_as_the_messages_own() {
    let (broker, mut stage) = start(8);
    let denied: Vec<String> = (0..40).map(|n| format!("denied{n}")).collect();
    let permission_denied = || PublishError::Refused("permission denied".into());
    for subject in &denied {
        broker.reply(subject, [Reply::AckFails(permission_denied())]);
    }
    stage
        .feed(denied.iter().map(|subject| message(subject)))
        .await;

    let verdicts = stage.verdicts(denied.len()).await;
    for (name, verdict) in &verdicts {
        match verdict {
            Verdict::Refused { reason, own, .. } => {
                assert!(reason.contains("permission denied"), "{name}: {reason}");
                assert!(
                    !own,
                    "{name}: a refusal alone proves nothing about the broker"
                );
            }
            other => panic!("{name}: expected a refusal, got {other:?}"),
        }
        assert_eq!(
            broker.sends_to(name),
            1,
            "the retry is the completion stage's"
        );
    }
    let mut charged = names(&verdicts);
    charged.sort_unstable();
    let mut fed: Vec<&str> = denied.iter().map(String::as_str).collect();
    fed.sort_unstable();
    assert_eq!(charged, fed, "each is charged once");
    assert!(
        !stage.deliveries.within(PATIENCE),
        "a refusal is no evidence that the broker works"
    );

    // The refusals paused nothing: the next message goes on.
    stage.feed([message("a")]).await;
    assert_eq!(stage.verdict().await, ("a".into(), Verdict::Delivered));
    assert!(stage.deliveries.within(PATIENCE));
    assert_eq!(broker.probes(), 0, "a refusal is not in doubt");
}

#[tokio::test(start_paused = true)]
async fn a_doubtful_failure_where_the_broker_takes_messages_is_sent_once_more_then_charged_as_its_own(
) {
    let (broker, mut stage) = start(8);
    let uncaptured = || Reply::AckFails(PublishError::Uncaptured("no stream".into()));
    broker.reply("poison", [uncaptured(), uncaptured()]);
    broker.health(Health::Takes);
    stage
        .feed([message("a"), message("poison"), message("b")])
        .await;

    let verdicts = stage.verdicts(3).await;
    assert_eq!(names(&verdicts), ["a", "poison", "b"]);
    assert!(
        matches!(verdicts[1].1, Verdict::Refused { own: true, .. }),
        "failing again where the broker takes messages is the message's own: {:?}",
        verdicts[1].1
    );
    assert_eq!(verdicts[0].1, Verdict::Delivered);
    assert_eq!(verdicts[2].1, Verdict::Delivered);
    assert_eq!(broker.sends_to("poison"), 2, "sent once more, not more");
    assert_eq!(delivery(&stage.metrics), "delivery: flowing");
    assert!(
        matches!(
            verdicts[1].1,
            Verdict::Refused {
                maybe_stored: false,
                ..
            }
        ),
        "nothing took it, so nothing holds it"
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_that_timed_out_where_the_broker_takes_messages_may_be_stored() {
    let (broker, mut stage) = start(8);
    let timed_out = || Reply::AckFails(PublishError::Unavailable("timed out".into()));
    broker.reply("slow", [timed_out(), timed_out()]);
    broker.health(Health::Takes);
    stage.feed([message("slow")]).await;
    let (_, verdict) = stage.verdict().await;
    assert!(
        matches!(
            verdict,
            Verdict::Refused {
                own: true,
                maybe_stored: true,
                ..
            }
        ),
        "a retry of it is a repeat, which the window alone drops: {verdict:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_doubtful_failure_that_does_not_recur_is_delivered_not_charged() {
    let (broker, mut stage) = start(8);
    broker.reply(
        "a",
        [Reply::AckFails(PublishError::Unavailable(
            "timed out".into(),
        ))],
    );
    broker.health(Health::Takes);
    stage.feed([message("a"), message("b")]).await;

    assert_eq!(
        stage.verdicts(2).await,
        [
            ("a".into(), Verdict::Delivered),
            ("b".into(), Verdict::Delivered)
        ]
    );
    assert_eq!(broker.sends_to("a"), 2);
}

#[tokio::test(start_paused = true)]
async fn a_destination_that_takes_nothing_refuses_its_message_without_pausing_the_rest() {
    let (broker, mut stage) = start(8);
    broker.reply(
        "audit.x",
        [Reply::AckFails(PublishError::Unavailable(
            "stream full".into(),
        ))],
    );
    broker.answer_probes([Health::TakesOthers("stream AUDIT is full".into())]);
    stage
        .feed([message("a"), message("audit.x"), message("b")])
        .await;

    let verdicts = stage.verdicts(3).await;
    assert_eq!(names(&verdicts), ["a", "audit.x", "b"]);
    match &verdicts[1].1 {
        Verdict::Refused { reason, own, .. } => {
            assert!(reason.contains("stream AUDIT is full"), "{reason}");
            assert!(!own, "the destination's fault is not the message's own");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(verdicts[2].1, Verdict::Delivered);
    // A pause would send it again after a backoff step, and ask again.
    assert_eq!(broker.sends_to("audit.x"), 1, "refused at once");
    assert_eq!(broker.probes(), 1);
    assert_eq!(delivery(&stage.metrics), "delivery: flowing");
}

#[tokio::test(start_paused = true)]
async fn an_outage_pauses_delivery_without_charging_and_resumes_in_order() {
    let (broker, mut stage) = start(64);
    broker.by_default(Reply::Hold);
    let subjects = ["a", "b", "c", "d", "e"];
    stage.feed(subjects.map(message)).await;
    assert_eq!(stage.sends_until_idle().await, subjects);

    // The connection drops with every acknowledgement still awaited.
    let lost = || PublishError::Unavailable("connection lost".into());
    broker.by_default(Reply::AckFails(lost()));
    broker.health(Health::TakesNone("no server answers".into()));
    for subject in subjects {
        broker.release(subject, Err(lost()));
    }

    for _ in 0..3 {
        assert_eq!(
            stage.probed().await,
            "a",
            "while the broker is away only the first message is tried"
        );
    }
    assert_eq!(
        stage.output.try_recv().map(|f| name(&f)),
        Err(mpsc::error::TryRecvError::Empty),
        "no message is charged for the outage"
    );
    assert_eq!(
        delivery(&stage.metrics),
        "delivery: paused: no server answers"
    );
    assert!(stage.metrics.render().contains("outbox_delivery_paused 1"));
    let tries_of_a = broker.sends_to("a");
    assert!(tries_of_a >= 3, "the first message is tried at every step");
    for held in &subjects[1..] {
        assert_eq!(broker.sends_to(held), 1, "{held} waits its turn behind a");
    }

    broker.by_default(Reply::Ack);
    broker.health(Health::Takes);
    let verdicts = stage.verdicts(subjects.len()).await;

    assert_eq!(names(&verdicts), subjects);
    assert!(
        verdicts.iter().all(|(_, v)| *v == Verdict::Delivered),
        "{verdicts:?}"
    );
    assert_eq!(broker.sends_to("a"), tries_of_a + 1);
    for held in &subjects[1..] {
        // Their failure was the outage's: each is sent again, once.
        assert_eq!(broker.sends_to(held), 2, "{held}");
    }
    assert_eq!(delivery(&stage.metrics), "delivery: flowing");
    assert!(stage.metrics.render().contains("outbox_delivery_paused 0"));

    stage.feed([message("f")]).await;
    assert_eq!(stage.verdict().await, ("f".into(), Verdict::Delivered));
    assert_eq!(broker.sends_to("f"), 1, "delivery flows as before");
}

#[tokio::test(start_paused = true)]
async fn a_publisher_that_cannot_tell_rides_out_doubtful_failures_as_an_outage() {
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::AckFails(PublishError::Uncaptured(
        "no responders".into(),
    )));
    broker.health(Health::Unknown);
    stage.feed([message("a"), message("b")]).await;

    for _ in 0..3 {
        assert_eq!(stage.probed().await, "a");
    }
    assert!(
        delivery(&stage.metrics).starts_with("delivery: paused:"),
        "{}",
        delivery(&stage.metrics)
    );
    assert!(stage.no_verdict().await, "nobody is charged for a doubt");

    broker.by_default(Reply::Ack);
    assert_eq!(
        stage.verdicts(2).await,
        [
            ("a".into(), Verdict::Delivered),
            ("b".into(), Verdict::Delivered)
        ]
    );
    assert_eq!(delivery(&stage.metrics), "delivery: flowing");
}

#[tokio::test(start_paused = true)]
async fn abandoning_takes_no_more_work_and_collects_what_is_in_flight() {
    let (broker, mut stage) = start(2);
    broker.by_default(Reply::Hold);
    stage
        .feed(["m0", "m1", "m2", "m3", "m4"].map(message))
        .await;
    assert_eq!(stage.sends_until_idle().await, ["m0", "m1"]);

    stage.abandon.cancel();
    broker.release("m1", Ok(Ack::default()));
    broker.release("m0", Ok(Ack::default()));
    let input = stage.input.clone();
    let verdicts = stage.ended().await;

    assert_eq!(
        verdicts,
        [
            ("m1".into(), Verdict::Delivered),
            ("m0".into(), Verdict::Delivered)
        ]
    );
    assert_eq!(broker.sends(), ["m0", "m1"], "queued work is never sent");
    assert!(input.is_closed(), "queued work is left for the next leader");
}

#[tokio::test(start_paused = true)]
async fn abandoning_during_an_outage_ends_the_stage_without_sending_or_charging_anything() {
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::AckFails(PublishError::Unavailable("down".into())));
    broker.health(Health::TakesNone("down".into()));
    stage.feed([message("a"), message("b")]).await;
    assert_eq!(stage.probed().await, "a");

    stage.abandon.cancel();
    let sends_when_abandoned = broker.sends();
    let metrics = stage.metrics.clone();
    let abandoned = tokio::time::Instant::now();
    let verdicts = stage.ended().await;

    // The first backoff step is 80 ms at the least.
    assert!(
        abandoned.elapsed() < Duration::from_millis(50),
        "the pause ends at once, not at its next step: {:?}",
        abandoned.elapsed()
    );
    assert_eq!(verdicts, [], "the held messages stay pending, uncharged");
    assert_eq!(
        broker.sends(),
        sends_when_abandoned,
        "nothing is sent after a abandon"
    );
    assert_eq!(
        delivery(&metrics),
        "delivery: flowing",
        "a stage that ended reports no pause"
    );
}

#[tokio::test(start_paused = true)]
async fn abandoning_sends_nothing_again_to_settle_a_doubtful_failure() {
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::Hold);
    broker.health(Health::Takes);
    stage.feed([message("a"), message("b")]).await;
    assert_eq!(stage.sends_until_idle().await, ["a", "b"]);

    stage.abandon.cancel();
    broker.release("a", Err(PublishError::Uncaptured("no stream".into())));
    broker.release("b", Ok(Ack::default()));
    let verdicts = stage.ended().await;

    assert_eq!(
        broker.sends(),
        ["a", "b"],
        "nothing is sent after a abandon"
    );
    assert!(
        verdicts.iter().all(|(name, _)| name != "a"),
        "a failure left unsettled is not charged: {verdicts:?}"
    );
    assert!(
        verdicts.iter().all(|(name, _)| name != "b"),
        "nothing overtakes the unsettled message: {verdicts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn closing_the_input_finishes_what_was_read_then_ends() {
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::Hold);
    stage.feed(["m0", "m1", "m2"].map(message)).await;
    assert_eq!(stage.sends_until_idle().await, ["m0", "m1", "m2"]);

    stage.shutdown.cancel();
    stage.close_input();
    for subject in ["m2", "m1", "m0"] {
        broker.release(subject, Ok(Ack::default()));
    }
    let verdicts = stage.ended().await;

    assert_eq!(names(&verdicts), ["m2", "m1", "m0"], "as the answers came");
    assert!(
        verdicts.iter().all(|(_, v)| *v == Verdict::Delivered),
        "{verdicts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_shutdown_ends_the_wait_for_a_broker_that_is_away() {
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::AckFails(PublishError::Unavailable("down".into())));
    broker.health(Health::TakesNone("down".into()));
    stage.feed([message("a")]).await;
    assert_eq!(stage.probed().await, "a");

    stage.shutdown.cancel();
    let sends_at_shutdown = broker.sends();
    let verdicts = stage.ended().await;

    assert_eq!(verdicts, [], "the message stays pending, uncharged");
    assert_eq!(broker.sends(), sends_at_shutdown);
}

#[tokio::test(start_paused = true)]
async fn a_key_has_one_message_on_the_wire_and_keys_do_not_wait_for_each_other() {
    let (broker, mut stage, _) = start_keyed(16, true);
    broker.by_default(Reply::Hold);
    stage.feed(three_of_a_one_of_b()).await;
    assert_eq!(
        stage.sends_until_idle().await,
        ["a1", "b1"],
        "a2 waits for a1's answer; b1 does not"
    );
    broker.release("b1", Ok(Ack::default()));
    assert!(stage.sends_until_idle().await.is_empty());
    broker.release("a1", Ok(Ack::default()));
    assert_eq!(stage.sends_until_idle().await, ["a2"]);
    broker.release("a2", Ok(Ack::default()));
    assert_eq!(stage.sends_until_idle().await, ["a3"]);
    broker.release("a3", Ok(Ack::default()));
    let verdicts = stage.verdicts(4).await;
    assert_eq!(
        names(&verdicts),
        ["b1", "a1", "a2", "a3"],
        "b1 did not wait for a"
    );
    assert!(verdicts.iter().all(|(_, v)| *v == Verdict::Delivered));
}

#[tokio::test(start_paused = true)]
async fn a_refused_message_holds_its_key_and_the_rest_are_parked() {
    let (broker, mut stage, order) = start_keyed(16, true);
    broker.reply(
        "a1",
        [Reply::AckFails(PublishError::Refused("too big".into()))],
    );
    stage.feed(three_of_a_one_of_b()).await;
    let verdicts = stage.verdicts(4).await;
    assert!(
        matches!(verdicts[0].1, Verdict::Refused { .. }),
        "{verdicts:?}"
    );
    assert_eq!(verdicts[1], ("a2".into(), Verdict::Parked));
    assert_eq!(verdicts[2], ("b1".into(), Verdict::Delivered));
    assert_eq!(verdicts[3], ("a3".into(), Verdict::Parked));
    assert_eq!(
        broker.sends(),
        ["a1", "b1"],
        "nothing of a is sent after a1"
    );
    assert_eq!(
        holding(&order),
        [("a".to_owned(), Bson::ObjectId(named("a1")))]
    );

    // The holder's retry goes; then only the parked messages, read back.
    stage.feed([keyed("a1", "a"), keyed("a4", "a")]).await;
    let verdicts = stage.verdicts(2).await;
    assert_eq!(verdicts[0], ("a1".into(), Verdict::Delivered));
    assert_eq!(
        verdicts[1],
        ("a4".into(), Verdict::Parked),
        "a4 is newer than the parked"
    );
    let mut released = keyed("a2", "a");
    released.release = true;
    stage.feed([released]).await;
    assert_eq!(stage.verdict().await, ("a2".into(), Verdict::Delivered));
}

#[tokio::test(start_paused = true)]
async fn a_message_in_doubt_keeps_its_turn_through_an_outage() {
    let (broker, mut stage, _) = start_keyed(16, true);
    broker.reply(
        "a1",
        [Reply::AckFails(PublishError::Unavailable(
            "timed out".into(),
        ))],
    );
    broker.answer_probes([Health::TakesNone("JetStream does not answer".into())]);
    stage
        .feed([keyed("a1", "a"), keyed("a2", "a"), keyed("b1", "b")])
        .await;
    let verdicts = stage.verdicts(3).await;
    assert_eq!(names(&verdicts), ["a1", "a2", "b1"]);
    assert!(
        verdicts.iter().all(|(_, v)| *v == Verdict::Delivered),
        "{verdicts:?}"
    );
    let sends = broker.sends();
    let of_a: Vec<&String> = sends.iter().filter(|s| s.starts_with('a')).collect();
    assert_eq!(of_a, ["a1", "a1", "a2"], "a2 only after a1 was settled");
}

#[tokio::test(start_paused = true)]
async fn without_stored_acknowledgements_a_key_is_sent_in_order_without_waiting() {
    let (broker, mut stage, _) = start_keyed(16, false);
    broker.by_default(Reply::Hold);
    stage.feed([keyed("a1", "a"), keyed("a2", "a")]).await;
    assert_eq!(stage.sends_until_idle().await, ["a1", "a2"]);
    broker.release("a1", Ok(Ack::default()));
    broker.release("a2", Ok(Ack::default()));
    assert_eq!(names(&stage.verdicts(2).await), ["a1", "a2"]);
}

#[tokio::test(start_paused = true)]
async fn messages_waiting_for_their_key_do_not_fill_the_window() {
    let (broker, mut stage, _) = start_keyed(2, true);
    broker.by_default(Reply::Hold);
    let hot: Vec<Work> = (1..=5).map(|n| keyed(&format!("a{n}"), "a")).collect();
    stage.feed(hot).await;
    stage.feed([keyed("b1", "b"), keyed("c1", "c")]).await;
    assert_eq!(
        stage.sends_until_idle().await,
        ["a1", "b1"],
        "b1 goes while a2..a5 wait; c1 waits for room on the wire"
    );
    broker.release("b1", Ok(Ack::default()));
    for n in 1..=5 {
        broker.release(&format!("a{n}"), Ok(Ack::default()));
        stage.sends_until_idle().await;
    }
    broker.release("c1", Ok(Ack::default()));
    let verdicts = stage.verdicts(7).await;
    assert_eq!(names(&verdicts), ["b1", "a1", "a2", "a3", "a4", "a5", "c1"]);
}

#[tokio::test(start_paused = true)]
async fn after_abandoning_no_message_waiting_for_its_key_is_sent() {
    let (broker, mut stage, _) = start_keyed(16, true);
    broker.by_default(Reply::Hold);
    stage.feed([keyed("a1", "a"), keyed("a2", "a")]).await;
    assert_eq!(stage.sends_until_idle().await, ["a1"]);
    stage.abandon.cancel();
    broker.release("a1", Ok(Ack::default()));
    assert!(
        stage.sends_until_idle().await.is_empty(),
        "a2 stays unsent once the relay stops at once"
    );
    let verdicts = stage.ended().await;
    assert!(
        verdicts.iter().all(|(name, _)| name != "a2"),
        "a2 gets no verdict: it stays pending as it was; {verdicts:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_keyed_document_that_breaks_the_contract_takes_its_turn_and_holds_its_key_in_hold_mode() {
    let order = KeyOrder::new(Vec::new(), DeadLetters::Hold, true, Metrics::new());
    let (_broker, mut stage) = start_with(16, Some(order.clone()));
    let mut bad = broken("a1", "no type");
    if let Some(decoded) = bad.message.as_mut() {
        decoded.key = Some("a".to_owned());
    }
    stage.feed([bad, keyed("a2", "a"), keyed("b1", "b")]).await;
    let verdicts = stage.verdicts(3).await;
    assert!(
        matches!(verdicts[0].1, Verdict::Rejected(_)),
        "{verdicts:?}"
    );
    assert_eq!(verdicts[1], ("a2".into(), Verdict::Parked));
    assert_eq!(verdicts[2], ("b1".into(), Verdict::Delivered));
    assert_eq!(
        holding(&order),
        [("a".to_owned(), Bson::ObjectId(named("a1")))]
    );
}

#[tokio::test(start_paused = true)]
async fn a_hot_key_holds_back_no_verdict_of_another_key() {
    let (broker, mut stage, _) = start_keyed(2, true);
    broker.by_default(Reply::Hold);
    let hot: Vec<Work> = (1..=3).map(|n| keyed(&format!("a{n}"), "a")).collect();
    stage.feed(hot).await;
    let others: Vec<Work> = (1..=4)
        .map(|n| keyed(&format!("b{n}"), &format!("b{n}")))
        .collect();
    stage.feed(others).await;
    assert_eq!(stage.sends_until_idle().await, ["a1", "b1"]);
    for n in 1..=4 {
        broker.release(&format!("b{n}"), Ok(Ack::default()));
        stage.sends_until_idle().await;
    }
    let verdicts = stage.verdicts(4).await;
    assert_eq!(
        of_key(&verdicts, "b"),
        ["b1", "b2", "b3", "b4"],
        "the others are done while a1 waits for its answer"
    );
    for n in 1..=3 {
        broker.release(&format!("a{n}"), Ok(Ack::default()));
        stage.sends_until_idle().await;
    }
    assert_eq!(of_key(&stage.verdicts(3).await, "a"), ["a1", "a2", "a3"]);
}

#[tokio::test(start_paused = true)]
async fn what_waits_for_its_key_is_bounded() {
    let (broker, mut stage, _) = start_keyed(2, true);
    broker.by_default(Reply::Hold);
    // One on the wire and 32 (16 per place on the wire) waiting fill the
    // stage, though the wire has room.
    let hot: Vec<Work> = (1..=33).map(|n| keyed(&format!("a{n}"), "a")).collect();
    stage.feed(hot).await;
    stage.feed([keyed("b1", "b")]).await;
    assert_eq!(
        stage.sends_until_idle().await,
        ["a1"],
        "b1 is not taken while the stage is full"
    );
    broker.release("a1", Ok(Ack::default()));
    assert_eq!(
        stage.sends_until_idle().await,
        ["a2", "b1"],
        "a place to wait is free again"
    );
}

/// A stage of a term whose stored holds are still being read.
fn start_unread() -> (Arc<FakeBroker>, Running, KeyOrder) {
    let order = KeyOrder::unread(DeadLetters::Release, true, Metrics::new());
    let (broker, running) = start_with(16, Some(order.clone()));
    (broker, running, order)
}

#[tokio::test(start_paused = true)]
async fn nothing_is_sent_until_the_stored_holds_are_known_and_then_they_are_kept() {
    let (broker, mut stage, order) = start_unread();
    stage.feed([keyed("a2", "a"), message("m1")]).await;
    assert_eq!(stage.sends_until_idle().await, Vec::<String>::new());
    assert!(stage.no_verdict().await, "nothing read has a verdict yet");

    // The collection records a1 as holding key a: a2 must wait behind it.
    let holder = HeldKey {
        key: "a".to_owned(),
        holders: vec![Holder {
            id: named("a1"),
            dead_letter: false,
        }],
        parked: 0,
        since: bson::DateTime::now(),
    };
    order.adopt_stored(vec![holder]);
    let verdicts = stage.verdicts(2).await;
    assert!(
        verdicts.contains(&("a2".into(), Verdict::Parked)),
        "{verdicts:?}"
    );
    assert!(
        verdicts.contains(&("m1".into(), Verdict::Delivered)),
        "{verdicts:?}"
    );
    assert_eq!(broker.sends(), ["m1"]);
}

#[tokio::test(start_paused = true)]
async fn a_stop_before_the_stored_holds_are_known_sends_nothing_and_ends() {
    let (broker, stage, _order) = start_unread();
    stage.feed([keyed("a1", "a"), message("m1")]).await;
    stage.shutdown.cancel();
    let verdicts = stage.ended().await;
    assert_eq!(verdicts, [], "what was read stays pending");
    assert_eq!(broker.sends(), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn abandoning_before_the_stored_holds_are_known_sends_nothing_and_ends() {
    let (broker, stage, _order) = start_unread();
    stage.feed([keyed("a1", "a"), message("m1")]).await;
    stage.abandon.cancel();
    let input = stage.input.clone();
    assert_eq!(stage.ended().await, [], "what was read stays pending");
    assert!(
        input.is_closed(),
        "the source is told the stage took no more"
    );
    assert_eq!(broker.sends(), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn a_window_wider_than_the_clients_room_waits_for_room_without_stalling() {
    // The client takes two unacknowledged sends; the stage may have eight
    // in flight. The third send waits for room, which only the first
    // acknowledgements, awaited by the stage, give back.
    let (broker, mut stage) = start(8);
    broker.limit_unacknowledged(2);
    broker.by_default(Reply::Hold);
    let subjects: Vec<String> = (0..6).map(|n| format!("m{n}")).collect();
    stage
        .feed(subjects.iter().map(|subject| message(subject)))
        .await;
    assert_eq!(stage.sends_until_idle().await, ["m0", "m1"]);

    let mut answered = 0;
    while answered < subjects.len() {
        for subject in broker.sends().iter().skip(answered) {
            broker.release(subject, Ok(Ack::default()));
            answered += 1;
        }
        assert!(
            answered == subjects.len() || !stage.sends_until_idle().await.is_empty(),
            "a send waiting for room goes once an answer gives room back"
        );
    }
    let verdicts = stage.verdicts(subjects.len()).await;
    assert!(
        verdicts.iter().all(|(_, v)| *v == Verdict::Delivered),
        "{verdicts:?}"
    );
    assert_eq!(broker.sends(), subjects, "sent once each, in order");
}

#[tokio::test(start_paused = true)]
async fn messages_whose_answers_never_come_settle_beside_the_others() {
    let ack_timeout = Duration::from_secs(3);
    let (broker, mut stage) = start(8);
    let timed_out = || PublishError::Unavailable("timed out".into());
    let silent = ["n1", "n2", "n3", "n4"];
    for subject in silent {
        let never = Reply::AckFailsAfter(ack_timeout, timed_out());
        broker.reply(subject, [never.clone(), never]);
    }
    broker.health(Health::Takes);
    let fed = tokio::time::Instant::now();
    stage.feed(silent.map(message)).await;
    // Past the first timeouts: the silent messages are being sent again.
    tokio::time::sleep(ack_timeout + Duration::from_millis(500)).await;

    let others: Vec<String> = (1..=10).map(|n| format!("g{n}")).collect();
    stage
        .feed(others.iter().map(|subject| message(subject)))
        .await;
    let verdicts = stage.verdicts(others.len()).await;
    assert_eq!(
        names(&verdicts),
        others,
        "the others are delivered while the silent ones wait on their second try"
    );
    assert!(verdicts.iter().all(|(_, v)| *v == Verdict::Delivered));

    let settled = stage.verdicts(silent.len()).await;
    // On the paused clock: two timeouts each, side by side, not in turn.
    assert!(
        fed.elapsed() < ack_timeout * 3,
        "the silent messages settled together: {:?}",
        fed.elapsed()
    );
    for (name, verdict) in &settled {
        assert!(
            matches!(verdict, Verdict::Refused { own: true, .. }),
            "{name}: failing again while the broker takes others is its own: {verdict:?}"
        );
    }
    for subject in silent {
        assert_eq!(
            broker.sends_to(subject),
            2,
            "{subject}: sent once more, not more"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_message_in_doubt_holds_back_only_its_own_key() {
    let ack_timeout = Duration::from_secs(3);
    let (broker, mut stage, order) = start_keyed(8, true);
    let never = || Reply::AckFailsAfter(ack_timeout, PublishError::Unavailable("timed out".into()));
    broker.reply("k1", [never(), never()]);
    broker.health(Health::Takes);
    stage.feed([keyed("k1", "k"), keyed("k2", "k")]).await;
    tokio::time::sleep(ack_timeout + Duration::from_millis(500)).await;
    stage.feed([keyed("g1", "g"), keyed("g2", "g")]).await;

    let verdicts = stage.verdicts(4).await;
    assert_eq!(
        names(&verdicts),
        ["g1", "g2", "k1", "k2"],
        "key g goes on while k1 settles; k2 waits for k1"
    );
    assert!(matches!(verdicts[2].1, Verdict::Refused { own: true, .. }));
    assert_eq!(verdicts[3].1, Verdict::Parked, "k1 holds its key now");
    assert_eq!(broker.sends_to("k2"), 0);
    assert_eq!(
        holding(&order),
        [("k".to_owned(), Bson::ObjectId(named("k1")))]
    );
}

#[tokio::test(start_paused = true)]
async fn a_message_acknowledged_in_a_lost_term_is_not_published_again_by_the_next() {
    // Term 4 was lost with m1's delivery unmarked (see `Acknowledged::remember_unmarked`).
    let acknowledged = Acknowledged::default();
    acknowledged.record([named("m1")], Term(4));

    let (broker, mut next) = start_in(8, None, Some(Term(5)), acknowledged.clone());
    next.feed([message("m1"), message("m2")]).await;
    let verdicts = next.verdicts(2).await;
    assert_eq!(
        verdicts,
        [
            ("m1".into(), Verdict::Delivered),
            ("m2".into(), Verdict::Delivered)
        ]
    );
    assert_eq!(broker.sends(), ["m2"], "m1 is stored already");
    assert!(next
        .metrics
        .render()
        .contains("outbox_republish_avoided_total 1"));

    // After another relay led (term 6), this relay's term 7 publishes it.
    let (later_broker, mut later) = start_in(8, None, Some(Term(7)), acknowledged);
    later.feed([message("m1")]).await;
    assert_eq!(later.verdict().await, ("m1".into(), Verdict::Delivered));
    assert_eq!(later_broker.sends_to("m1"), 1, "published again");
    assert!(later
        .metrics
        .render()
        .contains("outbox_republished_total 1"));
}

#[tokio::test(start_paused = true)]
async fn each_message_is_sent_as_it_comes_while_others_await_their_answers() {
    let round_trip = Duration::from_millis(1);
    let (broker, mut stage) = start(8);
    broker.by_default(Reply::AckAfter(round_trip));
    for n in 0..20 {
        let fed = tokio::time::Instant::now();
        stage.feed([message(&format!("m{n}"))]).await;
        let (name, verdict) = stage.verdict().await;
        assert_eq!((name, verdict), (format!("m{n}"), Verdict::Delivered));
        assert_eq!(
            fed.elapsed(),
            round_trip,
            "m{n} waited for nothing but its answer"
        );
        // A message a while later, as a trickle of writes comes.
        tokio::time::sleep(Duration::from_millis(7)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_lost_term_remembers_every_answer_that_came_though_completion_took_none() {
    let acknowledged = Acknowledged::default();
    let (broker, mut stage) = start_in(8, None, Some(Term(4)), acknowledged.clone());
    broker.by_default(Reply::Hold);
    stage
        .feed([message("m1"), message("m2"), message("m3")])
        .await;
    assert_eq!(stage.sends_until_idle().await, ["m1", "m2", "m3"]);
    // The term is lost, and its completion stage has gone, as the three
    // answers come.
    stage.abandon.cancel();
    stage.output.close();
    for name in ["m1", "m2", "m3"] {
        broker.release(name, Ok(Ack::default()));
    }
    assert!(stage.ended().await.is_empty());
    for name in ["m1", "m2", "m3"] {
        assert_eq!(
            acknowledged.again(&named(name), Some(Term(5))),
            Again::Stored,
            "{name} is stored, and not published again by the next term"
        );
    }
}
