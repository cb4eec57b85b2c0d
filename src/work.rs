//! What flows between the stages of the relay, and what they share.
//!
//! Sources turn outbox documents into [`Work`]; the publish stage turns work
//! into [`Finished`] work with a [`Verdict`]; the completion stage records
//! verdicts in MongoDB and moves the checkpoint. Verdicts may pass each
//! other, stream positions may not: a position reaches completion only
//! after every work before it, which is what lets the checkpoint advance
//! to a token only once everything before it is done.
//!
//! This module is a leaf: the stages and the code that assembles them
//! (`pipeline`) import it, and it imports none of them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{oid::ObjectId, Bson, DateTime};
use mongodb::change_stream::event::ResumeToken;
use tokio::sync::futures::Notified;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use crate::contract::{ContractViolation, Decoded};
use crate::lease::Term;
use crate::observe::{Metrics, Origin};
use crate::order::{KeyOrder, ParkTicket};

/// One unit of work: a message to deliver, a resume token to record once all
/// earlier work is done, or both.
///
/// # Its end
///
/// A message ends when its work is dropped, and dropping it does all of
/// this, in field order:
/// - its share of the byte budget is given back (`reserved`), so a source
///   waiting for room may read on;
/// - its park, if it was parked, counts as settled (`park`, a
///   [`ParkTicket`]), so a release that reads the collection from now on
///   may free its key: the park is written, or will never be;
/// - it leaves the messages under way (`underway`, an [`UnderwayEntry`]),
///   so the sweep no longer keeps away from it, nor from later messages
///   of its key;
/// - its slot among the term's unrecorded messages, if it was sent, is
///   given back (`sent`; see [`Unrecorded`]), so another may be sent.
///
/// Ordinarily the completion stage drops it, once the batch holding its
/// verdict is recorded; a bare position the publish stage has taken the
/// token of is dropped there. On every other path (the relay stops or
/// loses its term with work in a channel or a stage, a task is cancelled,
/// a sweep leaves a candidate out) the drop does the same, so that no
/// share of the budget, no key and no place under way stays held: the
/// message has no verdict recorded, stays pending, and is read again.
///
/// Its turn in its key's line (a [`Turn`](crate::order::Turn)) is not part
/// of it: the publish stage ends that with the message's answer, before
/// the verdict is recorded.
#[derive(Debug)]
pub(crate) struct Work {
    /// The message, if this work carries one.
    pub message: Option<Decoded>,
    /// The change-stream position just after this work, if it came from the stream.
    pub token: Option<ResumeToken>,
    /// The claim (`lockId`) a sweep holds on the message; completion must
    /// match it. Only a sweep's message has one, and only once the sweep
    /// has claimed it (a document that cannot take a claim has none).
    pub claim: Option<ObjectId>,
    /// When the stream position was reached: the event's commit time, or
    /// when the server reported the position. Kept with the token, it tells
    /// how much oplog history remains before the token is lost.
    pub at: Option<DateTime>,
    /// Where the work was read, decided once, by the constructor that
    /// made it: [`Origin::Stream`] ([`Work::from_stream`], [`Work::marker`]),
    /// [`Origin::CatchUp`] ([`Work::from_catch_up`]), [`Origin::Sweep`]
    /// ([`Work::from_sweep`]). Neither the token, taken away once the
    /// position waits for earlier work, nor the claim, which a sweep's
    /// message may lack, says it.
    origin: Origin,
    /// This work's share of the relay's byte budget, given back when the
    /// work ends (see [its end](Work#its-end)).
    pub reserved: Option<OwnedSemaphorePermit>,
    /// A parked message read back to release its key (see `order`).
    pub release: bool,
    /// The park decided for this work, settled when the work ends.
    pub park: Option<ParkTicket>,
    /// The message's place among those under way, given up when the work
    /// ends.
    pub underway: Option<UnderwayEntry>,
    /// Its slot among the term's messages sent and not yet recorded, taken
    /// as it first goes on the wire and given back when the work ends.
    pub sent: Option<OwnedSemaphorePermit>,
}

impl Work {
    /// A message from the change stream, committed at `at`.
    pub fn from_stream(message: Decoded, token: ResumeToken, at: Option<DateTime>) -> Self {
        Work::carrying(Origin::Stream, Some(message), Some(token), at)
    }

    /// A message from the catch-up pass's snapshot of the collection.
    pub fn from_catch_up(message: Decoded) -> Self {
        Work::carrying(Origin::CatchUp, Some(message), None, None)
    }

    /// A message a sweep read from the collection; its claim is set once
    /// the sweep has taken it.
    pub fn from_sweep(message: Decoded) -> Self {
        Work::carrying(Origin::Sweep, Some(message), None, None)
    }

    /// A stream position with no message (the stream moved past other events
    /// or was idle), reached at `at`.
    pub fn marker(token: ResumeToken, at: Option<DateTime>) -> Self {
        Work::carrying(Origin::Stream, None, Some(token), at)
    }

    /// Work read at `origin` carrying these; what is settled after it is
    /// read (its claim, its share of the budget, whether it releases a key,
    /// its park, its place under way) starts empty. Every constructor
    /// builds its work here.
    fn carrying(
        origin: Origin,
        message: Option<Decoded>,
        token: Option<ResumeToken>,
        at: Option<DateTime>,
    ) -> Self {
        Work {
            message,
            token,
            claim: None,
            at,
            origin,
            reserved: None,
            release: false,
            park: None,
            underway: None,
            sent: None,
        }
    }

    /// Bytes this work holds in memory, roughly: its message on the wire,
    /// or the reason it cannot be sent, plus its bookkeeping.
    pub fn size(&self) -> usize {
        const BOOKKEEPING: usize = 256;
        let message = match self.message.as_ref().map(|m| &m.message) {
            Some(Ok(message)) => message.wire_size(),
            Some(Err(violation)) => violation.to_string().len(),
            None => 0,
        };
        BOOKKEEPING.saturating_add(message)
    }

    /// Where the message was read, for the metrics.
    pub fn origin(&self) -> Origin {
        self.origin
    }
}

/// What became of one unit of work.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Verdict {
    /// The broker accepted the message.
    Delivered,
    /// The message breaks the contract; no retry can help.
    Rejected(ContractViolation),
    /// The broker refused this message in a way that may pass later.
    Refused {
        reason: String,
        /// The broker was found to take other messages meanwhile (the
        /// probe said so), so the refusal is this message's own.
        own: bool,
        /// Its answer was in doubt (a timeout): the broker may hold it, and
        /// a retry is a repeat, dropped only within the duplicate window.
        maybe_stored: bool,
    },
    /// Not sent: an earlier message of its key holds the key, so it is
    /// parked until the key is released (see `order`).
    Parked,
    /// Nothing to deliver: a bare stream position.
    Passed,
}

/// Work with its verdict, on its way to completion.
#[derive(Debug)]
pub(crate) struct Finished {
    pub work: Work,
    pub verdict: Verdict,
}

/// What became of the messages of a pipeline run, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Published and marked `processed`.
    pub delivered: u64,
    /// Refused by the broker and scheduled for another attempt.
    pub retried: u64,
    /// Marked `failed`: broken, or out of attempts.
    pub failed: u64,
    /// Parked behind an earlier message of their key.
    pub parked: u64,
}

impl Tally {
    pub fn total(&self) -> u64 {
        self.delivered + self.retried + self.failed + self.parked
    }
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, other: Tally) {
        self.delivered += other.delivered;
        self.retried += other.retried;
        self.failed += other.failed;
        self.parked += other.parked;
    }
}

/// Messages that no write can change (over the size limit, refused by a
/// validator), which the relay leaves pending and skips: the sweep does not
/// claim or publish them again while this process runs.
///
/// Kept in memory and bounded: after a restart the relay tries such a
/// message once more (JetStream drops the repeat within its duplicate
/// window), and past the bound the oldest entries are forgotten.
#[derive(Debug, Clone, Default)]
pub(crate) struct Unmarkable(Arc<Mutex<Remembered>>);

/// Ids by key, and their keys in the order they were added.
#[derive(Debug, Default)]
struct Remembered {
    ids: HashMap<String, Bson>,
    order: VecDeque<String>,
}

impl Unmarkable {
    /// The most messages remembered.
    pub const LIMIT: usize = 1000;

    /// Records a message no write could change; logs it the first time.
    pub fn add(&self, id: &Bson, why: &str, metrics: &Metrics) {
        let Ok(mut remembered) = self.0.lock() else {
            return;
        };
        let key = id_key(id);
        if remembered.ids.contains_key(&key) {
            return;
        }
        if remembered.order.len() >= Self::LIMIT {
            if let Some(oldest) = remembered.order.pop_front() {
                remembered.ids.remove(&oldest);
            }
        }
        remembered.ids.insert(key.clone(), id.clone());
        remembered.order.push_back(key);
        metrics.unmarkable();
        tracing::error!(
            id = %id,
            why,
            "outbox message cannot be updated at all (not even marked failed): it stays \
             pending and this relay skips it; fix or delete the document"
        );
    }

    pub fn contains(&self, id: &Bson) -> bool {
        self.0
            .lock()
            .is_ok_and(|remembered| remembered.ids.contains_key(&id_key(id)))
    }

    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |remembered| remembered.order.len())
    }
}

/// Messages NATS acknowledged to this process whose `processed` mark a
/// term that ended did not write, each with the term that published it.
///
/// A term lost before its marks were written (MongoDB away longer than the
/// lease, say) leaves messages stored in the stream and still pending in
/// the collection, which will be read again. The stages record them here
/// as the term gives up (the completion stage the delivered verdicts it
/// held or had yet to take, the publish stage the answers completion never
/// took), and forget them as marks are written. Rules: read again in this
/// relay's next term with no other leader between (the term after), or in
/// the same term, nothing else has touched them, so they are marked without
/// being published again; read again after another leader led, they are
/// published again (that leader may have changed them) and counted, a
/// repeat the operator can see. (Terms are the lease document's: deleted,
/// it numbers them from 1 again, and an old entry may be taken for the
/// term just before; NATS did store that message, so it is marked without
/// a second publish.) Bounded: past [`Acknowledged::LIMIT`] the
/// oldest term's are forgotten. Empty, as it nearly always is, it costs a
/// message one atomic read.
#[derive(Debug, Clone, Default)]
pub(crate) struct Acknowledged(Arc<AckedShared>);

#[derive(Debug, Default)]
struct AckedShared {
    ids: Mutex<AckedIds>,
    /// How many ids are remembered, read without the lock.
    count: AtomicUsize,
}

#[derive(Debug, Default)]
struct AckedIds {
    terms: HashMap<ObjectId, Term>,
    by_term: BTreeMap<Term, HashSet<ObjectId>>,
}

/// What an acknowledged message read again calls for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Again {
    /// Not remembered as acknowledged.
    Unseen,
    /// Acknowledged in this term or the one just before: stored, and
    /// untouched since; mark it, publish nothing.
    Stored,
    /// Acknowledged before another leader led: publish it again.
    Republish,
}

impl Acknowledged {
    /// The most messages remembered.
    pub const LIMIT: usize = 100_000;

    /// Changes the ids under the lock, keeping the count with them.
    fn change<T>(&self, change: impl FnOnce(&mut AckedIds) -> T) -> T {
        // Ids only: a panic elsewhere while it was held leaves them whole.
        let mut ids = self.0.ids.lock().unwrap_or_else(|e| e.into_inner());
        let changed = change(&mut ids);
        self.0.count.store(ids.terms.len(), Ordering::Release);
        changed
    }

    /// NATS acknowledged the messages `ids` published in `term`, and their
    /// marks were not written.
    pub fn record(&self, ids: impl IntoIterator<Item = ObjectId>, term: Term) {
        self.change(|acked| {
            for id in ids {
                if let Some(before) = acked.terms.insert(id, term) {
                    acked.forget_in(before, &id);
                }
                acked.by_term.entry(term).or_default().insert(id);
            }
            while acked.terms.len() > Self::LIMIT {
                let Some((_, oldest)) = acked.by_term.pop_first() else {
                    break;
                };
                for id in oldest {
                    acked.terms.remove(&id);
                }
            }
        });
    }

    /// Remembers the deliveries among `unrecorded`, whose marks will not
    /// be written in `term`, so that the relay does not publish them again
    /// where nothing has touched them since.
    pub fn remember_unmarked(
        &self,
        term: Option<Term>,
        unrecorded: impl IntoIterator<Item = Finished>,
    ) {
        let Some(term) = term else {
            return;
        };
        let delivered = unrecorded.into_iter().filter_map(|finished| {
            let message = finished.work.message.as_ref()?;
            match (&finished.verdict, &message.id) {
                (Verdict::Delivered, Bson::ObjectId(id)) => Some(*id),
                _ => None,
            }
        });
        self.record(delivered, term);
    }

    /// The marks of `marked` are written.
    pub fn marked<'a>(&self, marked: impl IntoIterator<Item = &'a Bson>) {
        if self.0.count.load(Ordering::Acquire) == 0 {
            return;
        }
        self.change(|acked| {
            for id in marked {
                let Bson::ObjectId(id) = id else { continue };
                if let Some(term) = acked.terms.remove(id) {
                    acked.forget_in(term, id);
                }
            }
        });
    }

    /// What `id`, read again in `term`, calls for.
    pub fn again(&self, id: &ObjectId, term: Option<Term>) -> Again {
        if self.0.count.load(Ordering::Acquire) == 0 {
            return Again::Unseen;
        }
        let acknowledged_in = self.change(|acked| acked.terms.get(id).copied());
        let Some(acknowledged_in) = acknowledged_in else {
            return Again::Unseen;
        };
        let untouched = term.is_some_and(|term| {
            term == acknowledged_in || acknowledged_in.0.checked_add(1) == Some(term.0)
        });
        if untouched {
            Again::Stored
        } else {
            Again::Republish
        }
    }
}

impl AckedIds {
    /// Takes `id` out of `term`'s ids.
    fn forget_in(&mut self, term: Term, id: &ObjectId) {
        if let Some(of_term) = self.by_term.get_mut(&term) {
            of_term.remove(id);
            if of_term.is_empty() {
                self.by_term.remove(&term);
            }
        }
    }
}

/// An `_id` as a key that tells its type too (`Int32(1)` is not `Int64(1)`).
pub(crate) fn id_key(id: &Bson) -> String {
    format!("{id:?}")
}

/// The messages read and not yet recorded, across a relay's pipelines,
/// and their keys.
///
/// The change stream and the catch-up pass deliver in order and send what
/// they read, whatever else is under way (a message two pipelines have is
/// published twice, and JetStream drops the repeat). The sweep, the
/// fallback, keeps out of their way: it sends no message that is under way
/// elsewhere, nor any message of a key that has an earlier one under way
/// elsewhere, so it can neither publish a message twice during a drain nor
/// put a key's message in its line ahead of an earlier one still in
/// another pipeline's channel. Bounded as the work is, by the byte budget.
#[derive(Debug, Clone, Default)]
pub(crate) struct Underway(Arc<Mutex<Ledger>>);

/// How many copies of each message are under way, in all and by key.
#[derive(Debug, Default)]
struct Ledger {
    ids: HashMap<UnderwayId, u32>,
    keys: HashMap<String, BTreeMap<UnderwayId, u32>>,
}

/// A message's `_id` among those under way: ObjectIds without allocating,
/// in `_id` order (other ids, which break the contract, after them).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum UnderwayId {
    ObjectId([u8; 12]),
    Other(String),
}

impl UnderwayId {
    fn of(id: &Bson) -> Self {
        match id {
            Bson::ObjectId(id) => UnderwayId::ObjectId(id.bytes()),
            other => UnderwayId::Other(id_key(other)),
        }
    }
}

impl Underway {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        // Counts only: a panic elsewhere while it was held leaves them whole.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a copy of `message` as under way until the entry is dropped.
    pub(crate) fn enter(&self, message: &Decoded) -> UnderwayEntry {
        let id = UnderwayId::of(&message.id);
        let mut ledger = self.ledger();
        *ledger.ids.entry(id.clone()).or_default() += 1;
        if let Some(key) = &message.key {
            let of_key = ledger.keys.entry(key.clone()).or_default();
            *of_key.entry(id.clone()).or_default() += 1;
        }
        UnderwayEntry {
            underway: self.clone(),
            id,
            key: message.key.clone(),
        }
    }

    /// Whether the message `id`, or an earlier message of its `key`, is
    /// under way.
    pub fn ahead(&self, id: &Bson, key: Option<&str>) -> bool {
        let id = UnderwayId::of(id);
        let ledger = self.ledger();
        let earliest = key.and_then(|key| ledger.keys.get(key)?.keys().next());
        ledger.ids.contains_key(&id) || earliest.is_some_and(|earliest| *earliest < id)
    }
}

/// A copy of a message under way, given up when dropped: with the
/// [`Work`] that carries it (see [its end](Work#its-end)).
#[derive(Debug)]
pub(crate) struct UnderwayEntry {
    underway: Underway,
    id: UnderwayId,
    key: Option<String>,
}

impl Drop for UnderwayEntry {
    fn drop(&mut self) {
        let mut ledger = self.underway.ledger();
        if lower(ledger.ids.get_mut(&self.id)) {
            ledger.ids.remove(&self.id);
        }
        let Some(key) = &self.key else {
            return;
        };
        if let Some(of_key) = ledger.keys.get_mut(key) {
            if lower(of_key.get_mut(&self.id)) {
                of_key.remove(&self.id);
            }
            if of_key.is_empty() {
                ledger.keys.remove(key);
            }
        }
    }
}

/// Counts one fewer; whether none is left.
fn lower(count: Option<&mut u32>) -> bool {
    count.is_some_and(|count| {
        *count -= 1;
        *count == 0
    })
}

/// When the relay last delivered a message, across its pipelines: the
/// evidence that the broker takes messages, without which a refused
/// message is not dead-lettered (the broker may be refusing everything).
#[derive(Debug, Clone, Default)]
pub(crate) struct LastDelivery(Arc<AtomicI64>);

impl LastDelivery {
    /// Records a delivery now.
    pub fn now(&self) {
        self.0
            .store(DateTime::now().timestamp_millis(), Ordering::Relaxed);
    }

    /// Whether the relay delivered anything within `window` of now.
    pub fn within(&self, window: Duration) -> bool {
        let last = self.0.load(Ordering::Relaxed);
        let window = i64::try_from(window.as_millis()).unwrap_or(i64::MAX);
        last > 0 && DateTime::now().timestamp_millis().saturating_sub(last) <= window
    }
}

/// The bytes of work read but not yet recorded, shared by every pipeline of
/// a relay: a source waits for room before it sends more, so memory follows
/// the budget, not the size of a backlog or of its messages.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    permits: Arc<Semaphore>,
    bytes: u32,
    /// Told each time a reservation has to wait for room.
    starved: Arc<Notify>,
}

impl Budget {
    pub fn new(bytes: u32) -> Self {
        let bytes = bytes.max(1);
        Budget {
            permits: Arc::new(Semaphore::new(bytes as usize)),
            bytes,
            starved: Arc::new(Notify::new()),
        }
    }

    /// Waits until `bytes` fit. Work larger than the whole budget waits
    /// for all of it, and then goes alone.
    pub async fn reserve(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let wanted = self.wanted(bytes);
        if let Ok(permit) = self.permits.clone().try_acquire_many_owned(wanted) {
            return Some(permit);
        }
        self.starved.notify_waiters();
        self.permits.clone().acquire_many_owned(wanted).await.ok()
    }

    /// Resolves when a reservation starts waiting for room after this is
    /// enabled (see [`Notified::enable`]); pair it with [`Budget::is_short`]
    /// for one that waits already.
    pub fn starved(&self) -> Notified<'_> {
        self.starved.notified()
    }

    /// `bytes`, if they fit now. For one who holds some of the budget
    /// already, and must not wait for what it holds itself.
    pub fn try_reserve(&self, bytes: usize) -> Option<OwnedSemaphorePermit> {
        let wanted = self.wanted(bytes);
        self.permits.clone().try_acquire_many_owned(wanted).ok()
    }

    /// Whether less than half of it is free: a source may be waiting for
    /// room that only recorded work gives back.
    pub fn is_short(&self) -> bool {
        self.permits.available_permits() * 2 < self.bytes as usize
    }

    /// What `bytes` take of the budget: all of it at the most.
    fn wanted(&self, bytes: usize) -> u32 {
        u32::try_from(bytes)
            .unwrap_or(u32::MAX)
            .clamp(1, self.bytes)
    }
}

/// The way into a pipeline: sends work once its bytes fit in the budget,
/// and counts its message as under way.
#[derive(Debug, Clone)]
pub(crate) struct Feed {
    sender: mpsc::Sender<Work>,
    budget: Budget,
    underway: Underway,
}

/// The pipeline has stopped taking work.
#[derive(Debug)]
pub(crate) struct Closed;

impl Feed {
    pub fn new(sender: mpsc::Sender<Work>, budget: Budget, underway: Underway) -> Self {
        Feed {
            sender,
            budget,
            underway,
        }
    }

    /// Sends `work`, counting its message as under way until the work is
    /// dropped (after its verdict is recorded). Work charged to the budget
    /// already (as it was read) is not charged again.
    pub async fn send(&self, mut work: Work) -> Result<(), Closed> {
        if let Some(message) = &work.message {
            work.underway = Some(self.underway.enter(message));
        }
        if work.reserved.is_none() {
            work.reserved = Some(self.budget.reserve(work.size()).await.ok_or(Closed)?);
        }
        self.sender.send(work).await.map_err(|_| Closed)
    }
}

/// The term a pipeline delivers in, and what the term's pipelines share:
/// one value, so that a pipeline either is in a term with all of it, or
/// in none (a test's, or a pipeline no lease stands behind).
#[derive(Clone)]
pub(crate) struct Tenure {
    /// The lease's term: what NATS acknowledged to this relay is
    /// remembered under it (see [`Acknowledged`]).
    pub term: Term,
    /// The term's per-key order, shared by its pipelines.
    pub order: KeyOrder,
    /// Claims made before the term began (below this id) are a former
    /// holder's, and no verdict waits for them.
    pub claims_before: ObjectId,
    /// The term's messages sent and not yet recorded, shared by its
    /// pipelines.
    pub unrecorded: Unrecorded,
}

impl Tenure {
    /// The term `term`, beginning now, keeping `order`, with at most
    /// `most_unrecorded` messages sent and not yet recorded at once.
    pub fn begun(term: Term, order: KeyOrder, most_unrecorded: usize) -> Self {
        Tenure {
            term,
            order,
            claims_before: crate::time::object_id_at(DateTime::now()),
            unrecorded: Unrecorded::new(most_unrecorded),
        }
    }
}

/// A term's messages sent to the broker whose verdicts are not yet
/// recorded: what the next holder of the lease would publish again, were
/// this relay to die now.
///
/// Rules: a message takes a slot as it first goes on the wire, and gives it
/// back when its work ends, once its verdict is recorded (see `Work`'s
/// end); a message whose answer is in doubt gives it back while it is
/// asked about, so that a few answers that never come hold back no other
/// message (they are published again after a crash, as any unrecorded
/// one). There are at most `most` slots (`--max-in-flight` plus
/// `--batch-size`: see `RelayConfig::most_unrecorded`), and, as a term
/// begins, only [`Unrecorded::FIRST`]: one more for every `FIRST` messages
/// the term records. A term that takes over a backlog publishes a little
/// of it, records it, and only then more: a takeover killed having
/// recorded `n` messages publishes again at most `FIRST + n / FIRST`.
/// Growing with what is recorded rather than with each round of marks, the
/// room is full after 3,840 records at the default most, a few percent of
/// a large drain, while a backlog of a few hundred (what piles up while a
/// lease lapses) is drained in slots of 16 to 40.
#[derive(Debug, Clone)]
pub(crate) struct Unrecorded(Arc<UnrecordedShared>);

#[derive(Debug)]
struct UnrecordedShared {
    slots: Arc<Semaphore>,
    /// How many slots there are now: from `FIRST` up to `most`.
    room: AtomicUsize,
    /// How many messages the term has recorded.
    recorded: AtomicUsize,
    most: usize,
    /// Told each time a message has to wait for a slot.
    starved: Notify,
}

impl Unrecorded {
    /// The slots a term begins with.
    pub const FIRST: usize = 16;

    pub fn new(most: usize) -> Self {
        let most = most.max(1);
        let room = Self::FIRST.min(most);
        Unrecorded(Arc::new(UnrecordedShared {
            slots: Arc::new(Semaphore::new(room)),
            room: AtomicUsize::new(room),
            recorded: AtomicUsize::new(0),
            most,
            starved: Notify::new(),
        }))
    }

    /// A slot for a message about to go on the wire, once there is one.
    /// `None` only if the slots are closed, which they never are.
    pub async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        if let Ok(slot) = self.0.slots.clone().try_acquire_owned() {
            return Some(slot);
        }
        self.0.starved.notify_waiters();
        self.0.slots.clone().acquire_owned().await.ok()
    }

    /// `count` messages had their verdicts recorded: the room grows by one
    /// for every `FIRST` the term has recorded, up to the most.
    pub fn recorded(&self, count: usize) {
        let shared = &self.0;
        let recorded = shared.recorded.fetch_add(count, Ordering::Relaxed) + count;
        let room = Self::FIRST
            .saturating_add(recorded / Self::FIRST)
            .min(shared.most);
        let before = shared.room.fetch_max(room, Ordering::Relaxed);
        if room > before {
            shared.slots.add_permits(room - before);
        }
    }

    /// Resolves when a message starts waiting for a slot after this is
    /// enabled (see [`Notified::enable`]); pair it with
    /// [`Unrecorded::is_full`] for one that waits already.
    pub fn starved(&self) -> Notified<'_> {
        self.0.starved.notified()
    }

    /// Whether every slot is taken: a message may be waiting for one that
    /// only a recorded verdict gives back.
    pub fn is_full(&self) -> bool {
        self.0.slots.available_permits() == 0
    }

    /// How many slots there are now.
    #[cfg(test)]
    pub fn room(&self) -> usize {
        self.0.room.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use bson::{oid::ObjectId, Bson};

    use super::*;
    use crate::testing::keyed;

    #[test]
    fn an_acknowledgement_is_trusted_in_its_term_and_the_next_alone_until_marked() {
        let acknowledged = Acknowledged::default();
        let (id, other) = (ObjectId::new(), ObjectId::new());
        acknowledged.record([id], Term(3));
        assert_eq!(acknowledged.again(&id, Some(Term(3))), Again::Stored);
        assert_eq!(acknowledged.again(&id, Some(Term(4))), Again::Stored);
        assert_eq!(acknowledged.again(&id, Some(Term(5))), Again::Republish);
        assert_eq!(acknowledged.again(&id, None), Again::Republish);
        assert_eq!(acknowledged.again(&other, Some(Term(3))), Again::Unseen);
        // Published again in term 5 and lost again, it belongs to term 5 alone.
        acknowledged.record([id], Term(5));
        assert_eq!(acknowledged.again(&id, Some(Term(6))), Again::Stored);
        acknowledged.marked([&Bson::ObjectId(id)]);
        assert_eq!(acknowledged.again(&id, Some(Term(6))), Again::Unseen);
        assert!(
            acknowledged.change(|acked| acked.by_term.is_empty()),
            "nothing left behind"
        );
    }

    #[tokio::test]
    async fn the_unrecorded_room_grows_by_what_is_recorded_up_to_the_most() {
        let unrecorded = Unrecorded::new(100);
        let mut slots = Vec::new();
        for _ in 0..Unrecorded::FIRST {
            slots.push(unrecorded.slot().await.expect("a slot"));
        }
        assert!(unrecorded.is_full());
        let waiting = unrecorded.starved();
        tokio::pin!(waiting);
        waiting.as_mut().enable();
        let mut next = Box::pin(unrecorded.slot());
        assert!(
            futures::FutureExt::now_or_never(&mut next).is_none(),
            "no room"
        );
        assert!(
            futures::FutureExt::now_or_never(&mut waiting).is_some(),
            "the wait is told"
        );
        // Recorded: each slot comes back, and one more for every FIRST.
        slots.clear();
        unrecorded.recorded(Unrecorded::FIRST);
        assert_eq!(unrecorded.room(), Unrecorded::FIRST + 1);
        assert!(next.await.is_some());
        unrecorded.recorded(3 * Unrecorded::FIRST - 1);
        assert_eq!(unrecorded.room(), Unrecorded::FIRST + 3);
        unrecorded.recorded(10_000);
        assert_eq!(unrecorded.room(), 100, "never past the most");
        assert_eq!(Unrecorded::new(4).room(), 4, "a most below the first");
    }

    #[test]
    fn a_message_is_ahead_while_it_or_an_earlier_one_of_its_key_is_under_way() {
        let underway = Underway::default();
        let (first, second, third) = (ObjectId::new(), ObjectId::new(), ObjectId::new());
        let entry = underway.enter(&keyed(second, "k"));
        let id = |id: ObjectId| Bson::ObjectId(id);
        assert!(underway.ahead(&id(second), Some("k")), "itself");
        assert!(underway.ahead(&id(third), Some("k")), "a later one waits");
        assert!(
            !underway.ahead(&id(first), Some("k")),
            "an earlier one goes first"
        );
        assert!(!underway.ahead(&id(third), Some("other")));
        let again = underway.enter(&keyed(second, "k"));
        drop(entry);
        assert!(
            underway.ahead(&id(third), Some("k")),
            "a copy is still under way"
        );
        drop(again);
        assert!(!underway.ahead(&id(third), Some("k")));
        assert!(!underway.ahead(&id(second), None));
    }
}
