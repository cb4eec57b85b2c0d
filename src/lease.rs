//! Leadership: one relay at a time tails the change stream and publishes.
//!
//! Several copies of the relay may run against one outbox (rolling deploys,
//! one per app host). Each would publish every message, so they elect a
//! leader with a lease kept in the checkpoint document itself:
//! `{_id: "<db>.<collection>", owner, term, expiresAt, token, ...}`.
//!
//! - Expiry is judged on the database server's clock, never a relay host's:
//!   `expiresAt` is the server's `hello.localTime` plus the lease, and a
//!   candidate compares it with the server's `hello.localTime` of its own.
//!   Clock skew between relay hosts therefore cannot make two leaders. (Plain
//!   update operators only, so servers without pipeline updates serve too.)
//! - `term` grows by one with every new owner. The checkpoint is written
//!   only under the writer's term, so a deposed leader cannot move the token
//!   backwards.
//! - A holder stops on its own before the server could let anyone else in:
//!   its deadline is the local (monotonic) time just before it asked the
//!   server for the time the expiry was counted from, plus the lease, minus
//!   a margin. The server read its clock after that, so the deadline always
//!   comes first.
//! - A graceful stop releases the lease, so a standby takes over at once.
//! - No stored field keeps every relay from leading: an expiry that is not
//!   a date, or one further ahead than any relay writes, is given one a
//!   lease from now (a holder may renew it), and a
//!   lapsed lease whose term cannot be counted is taken at a term above any
//!   a relay could have counted to (`fresh_term`), each with a warning.
//!   Further ahead means more than twice the lease its holder states
//!   (`leaseMillis`), or more than the longest lease and a minute where it
//!   states none: a clock set back by more than a lease is noticed within
//!   two leases, not after the step.
//!
//! # A group holds the outbox's own lease
//!
//! Where a group of relays shares the outbox in partitions (see `group`),
//! each partition has a lease of its own, and the outbox's own lease is
//! what a relay of one partition, a `sweep --once` run and a relay from
//! before groups take. So that none of them delivers beside the group, a
//! partition's lease is taken and renewed together with the outbox's,
//! held for the group ([`Holder::Group`]): its `owner` names the group and
//! its count (a document, so that relays of earlier versions, which count
//! a name there as a relay of one partition, do not refuse to join), and
//! each partition's renewal extends it to at least its own expiry, from
//! the same reading of the server's clock. Only one count holds it at a
//! time, so two counts never deliver at once. A partition whose take finds
//! the outbox's lease held by another is released at once, before it
//! delivers anything; one whose renewal finds it taken stops delivering,
//! as with a lost lease. The group never releases the outbox's lease: a
//! member leaving cannot know that no other is about to renew it, so it
//! lapses a lease after the group's last renewal. Taking it retires the
//! position stored in it: a group keeps its positions in its partitions.

use std::sync::Arc;
use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawBsonRef, RawDocument, RawDocumentBuf};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{is_duplicate_key, Error, Result};
use crate::partition::Partition;
use crate::retry::Outage;
use crate::server_clock::{server_time, ServerClock};
use crate::time::later;

/// The field of a lease's document holding when its stored position was
/// reached: the document is its partition's checkpoint too (written by
/// `crate::checkpoint`), and a group's hold of the outbox's clears it.
pub const POSITION_AT: &str = "positionAt";

/// Timing of the lease (from [`RelayConfig::lease_timing`](crate::RelayConfig::lease_timing)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a lease lasts without renewal.
    pub duration: Duration,
    /// How often the holder renews it.
    pub renew_interval: Duration,
    /// How often a standby looks whether the lease is free.
    pub standby_poll_interval: Duration,
}

impl LeaseTiming {
    /// The holder's safety margin: it stops this long before its lease ends.
    fn margin(&self) -> Duration {
        (self.duration / 10).max(Duration::from_millis(100))
    }
}

/// A lease held with a term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(pub i64);

/// One relay's view of the lease on one outbox.
#[derive(Debug, Clone)]
pub struct Lease {
    database: Database,
    /// Read as stored: a field the driver cannot read (a string that is
    /// not UTF-8) must not keep every relay from leading.
    documents: Collection<RawDocumentBuf>,
    /// The outbox's id, `<db>.<collection>`.
    outbox: String,
    /// This lease's document: the outbox's, or one partition's.
    id: String,
    owner: String,
    /// What a take writes as the holder.
    holder: Holder,
    /// For a partition's lease of a group: the group's hold on the
    /// outbox's own lease, taken and renewed with it (see the module's doc).
    hold: Option<Box<Lease>>,
    timing: LeaseTiming,
    /// What renewals read the server's clock from (see `server_clock`).
    clock: Arc<ServerClock>,
}

/// What holds a lease, and so what a take writes in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// A relay delivering what the lease covers: the outbox, or a partition.
    Relay,
    /// A `sweep --once` run: it holds the outbox's lease for its run, and a
    /// group starting meanwhile waits it out rather than refusing to start.
    SweepOnce,
    /// A group of relays sharing this many partitions, holding the outbox's
    /// lease while any of them holds a partition's.
    Group(u32),
}

/// What a stored lease names as its holder, as another relay reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoredHolder {
    /// A relay (or a relay from before groups): its name.
    Relay(String),
    /// A `sweep --once` run: its name.
    SweepOnce(String),
    /// A group of relays sharing this many partitions.
    Group(u32),
    /// Nothing a relay writes.
    Unknown,
}

impl StoredHolder {
    /// The holder `stored` names.
    pub(crate) fn of(stored: &RawDocument) -> StoredHolder {
        match field(stored, "owner") {
            // The mark names the run it is of: one a later holder left
            // behind (a relay of an earlier version takes the lease
            // without removing it) is not its own.
            Ok(Some(RawBsonRef::String(name))) => match field(stored, SWEEP_ONCE) {
                Ok(Some(RawBsonRef::String(run))) if run == name => {
                    StoredHolder::SweepOnce(name.to_owned())
                }
                _ => StoredHolder::Relay(name.to_owned()),
            },
            Ok(Some(RawBsonRef::Document(group))) => {
                let count = match group.get("partitions") {
                    Ok(Some(RawBsonRef::Int64(n))) => u32::try_from(n).ok(),
                    Ok(Some(RawBsonRef::Int32(n))) => u32::try_from(n).ok(),
                    _ => None,
                };
                count.map_or(StoredHolder::Unknown, StoredHolder::Group)
            }
            _ => StoredHolder::Unknown,
        }
    }
}

/// The field that marks the outbox's lease as held by a `sweep --once` run,
/// naming it as `owner` does.
const SWEEP_ONCE: &str = "sweepOnce";

/// What taking the outbox's lease for a group, or renewing the hold, came
/// to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Held,
    /// Another holds it, for this long yet as far as can be told.
    Busy(Duration),
}

impl Lease {
    /// The lease of `outbox`, kept in `checkpoint_collection`, for this process.
    pub fn new(
        database: &Database,
        checkpoint_collection: &str,
        outbox: &str,
        timing: LeaseTiming,
    ) -> Self {
        let outbox = format!("{}.{}", database.name(), outbox);
        Lease {
            database: database.clone(),
            documents: database.collection(checkpoint_collection),
            id: outbox.clone(),
            outbox,
            owner: owner_name(),
            holder: Holder::Relay,
            hold: None,
            timing,
            clock: Arc::new(ServerClock::new(database.client(), Duration::ZERO)),
        }
    }

    /// The same lease, its renewals reading the server's clock into
    /// `clock`, which the relay's group counts on between.
    pub(crate) fn with_clock(self, clock: Arc<ServerClock>) -> Lease {
        Lease { clock, ..self }
    }

    /// The same lease, taken for a `sweep --once` run.
    pub fn for_sweep_once(self) -> Lease {
        Lease {
            holder: Holder::SweepOnce,
            ..self
        }
    }

    /// The same relay's lease on `partition` of the outbox: a document of
    /// its own, with its own term. Where the outbox has more than one
    /// partition, it holds the outbox's own lease for the group with it.
    pub fn of_partition(&self, partition: Partition) -> Lease {
        let outbox = Lease {
            id: self.outbox.clone(),
            holder: Holder::Relay,
            hold: None,
            ..self.clone()
        };
        let hold = (partition.count() > 1).then(|| {
            Box::new(Lease {
                holder: Holder::Group(partition.count()),
                ..outbox.clone()
            })
        });
        Lease {
            id: partition.document_id(&self.outbox),
            hold,
            ..outbox
        }
    }

    /// The same relay's view of another lease document of the outbox, `id`
    /// (one whose expiry it may mend: see [`Lease::mend_expiry`]).
    pub(crate) fn of_document(&self, id: &str) -> Lease {
        Lease {
            id: id.to_owned(),
            holder: Holder::Relay,
            hold: None,
            ..self.clone()
        }
    }

    /// The timing the lease keeps.
    pub fn timing(&self) -> LeaseTiming {
        self.timing
    }

    /// This relay's name in the lease's `owner` field.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Waits until this relay holds the lease, trying whenever the current
    /// holder's lease should have ended. `None` if `shutdown` fires first.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Option<Held> {
        let mut announced = false;
        let mut outage = Outage::new("MongoDB lease");
        loop {
            let wait = match self.try_acquire().await {
                Ok(Ok(held)) => return Some(held),
                Ok(Err(remaining)) => {
                    outage.recovered();
                    if !announced {
                        tracing::info!("standing by: another relay holds the lease");
                        announced = true;
                    }
                    // Not at once even if the lease read as over: a read
                    // may lag the write that took it.
                    let poll = self.timing.standby_poll_interval;
                    remaining.clamp(poll / 10, poll)
                }
                Err(error) => {
                    outage.failed(&error);
                    self.timing.standby_poll_interval
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Takes the lease if it is free or expired. `Ok(Err(remaining))` if
    /// another relay holds it, with the time its lease has left.
    ///
    /// No stored field keeps every relay from leading: a lease whose
    /// fields are not what relays write (an expiry that is not a date, a
    /// term that is not an integer the server can add one to) is judged
    /// on what can be read of it (`Standing`) and taken over, with a
    /// warning saying what was wrong.
    pub async fn try_acquire(&self) -> Result<std::result::Result<Held, Duration>> {
        let (took, now) = self.try_take().await?;
        self.with_hold(took, now).await
    }

    /// [`Lease::try_acquire`] of this lease alone, and the server's time
    /// the take was judged by.
    async fn try_take(&self) -> Result<(std::result::Result<Held, Duration>, DateTime)> {
        let sent = Instant::now();
        let now = self.server_time().await?;
        // The common case in one step: a lapsed (or new) lease whose term
        // the server counts on.
        let mut update = self.take(now);
        update.insert("$inc", doc! { "term": 1_i64 });
        let taken = self
            .documents
            .find_one_and_update(
                doc! { "_id": &self.id, "$and": [lapsed(now), doc! { "$or": countable() }] },
                update,
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        let took = match taken {
            Ok(Some(document)) => self.took(&document, sent),
            Ok(None) => Err(self.timing.standby_poll_interval),
            // The lease exists, and is not lapsed with a countable term.
            Err(error) if is_duplicate_key(&error) => self.judge(now, sent).await?,
            Err(error) => {
                return Err(Error::mongo("taking the lease failed", error)
                    .needing("update and insert", self.documents.namespace()))
            }
        };
        Ok((took, now))
    }

    /// What a take writes, from `now` (the term is the take's own): this
    /// relay as the holder, as its kind says, with the lease it states.
    fn take(&self, now: DateTime) -> Document {
        let stamp = self.stamp();
        let mut set = doc! {
            "owner": stamp.clone(),
            "expiresAt": later(now, self.timing.duration),
            "leaseMillis": self.lease_millis(),
            "leaseOwner": stamp,
        };
        let mut unset = Document::new();
        match self.holder {
            Holder::SweepOnce => {
                set.insert(SWEEP_ONCE, &self.owner);
            }
            Holder::Relay => {
                unset.insert(SWEEP_ONCE, "");
            }
            // The group keeps its positions in its partitions: one stored
            // here is a relay of one partition's, and stale from now on.
            Holder::Group(_) => {
                for stale in [SWEEP_ONCE, "token", POSITION_AT, "updatedAt"] {
                    unset.insert(stale, "");
                }
            }
        }
        let mut update = doc! { "$set": set };
        if !unset.is_empty() {
            update.insert("$unset", unset);
        }
        update
    }

    /// What this lease's holder is written as in `owner`: the relay's name,
    /// or, for a group's hold, the group and its count.
    fn stamp(&self) -> Bson {
        match self.holder {
            Holder::Relay | Holder::SweepOnce => Bson::String(self.owner.clone()),
            Holder::Group(count) => Bson::Document(doc! {
                "group": format!("{}/group", self.outbox),
                "partitions": i64::from(count),
            }),
        }
    }

    /// A partition's lease just taken (`took`), held only if the group's
    /// hold on the outbox's lease is taken too (see the module's doc):
    /// otherwise it is released at once, before anything is delivered.
    async fn with_hold(
        &self,
        took: std::result::Result<Held, Duration>,
        now: DateTime,
    ) -> Result<std::result::Result<Held, Duration>> {
        let (Ok(held), Some(hold)) = (&took, &self.hold) else {
            return Ok(took);
        };
        let refused = match hold.hold_for_group(now).await {
            Ok(Hold::Held) => return Ok(took),
            Ok(Hold::Busy(left)) => {
                tracing::info!(
                    lease = %self.id,
                    "the outbox's own lease is held by a relay of one partition, a sweep --once \
                     run or a relay of another partition count: releasing the partition taken"
                );
                Ok(Err(left))
            }
            Err(error) => {
                tracing::info!(
                    lease = %self.id,
                    %error,
                    "could not hold the outbox's own lease for the group: releasing the \
                     partition taken, to be taken again at the next round"
                );
                Err(error)
            }
        };
        if let Err(error) = self.release(held).await {
            tracing::warn!(%error, "could not release the partition; its lease expires");
        }
        refused
    }

    /// Takes or renews the outbox's own lease for the group (a lease of
    /// [`Holder::Group`]), to expire a lease from `now` at the least.
    ///
    /// Held by the group of this count already (by this relay or another,
    /// lapsed or not: no other holder took it meanwhile), it is extended,
    /// never shortened. Else it is taken as any lease is: if it is free or
    /// lapsed. `Busy` while another holds it.
    async fn hold_for_group(&self, now: DateTime) -> Result<Hold> {
        let extended = self
            .documents
            .update_one(
                doc! { "_id": &self.id, "owner": self.stamp() },
                doc! { "$max": {
                    "expiresAt": later(now, self.timing.duration),
                    "leaseMillis": self.lease_millis(),
                } },
            )
            .await
            .map_err(|e| {
                Error::mongo("holding the outbox's lease for the group failed", e)
                    .needing("update", self.documents.namespace())
            })?;
        if extended.matched_count > 0 {
            return Ok(Hold::Held);
        }
        Ok(match self.try_take().await?.0 {
            Ok(_) => Hold::Held,
            Err(left) => Hold::Busy(left),
        })
    }

    /// What a take the server answered with `document` gives this relay:
    /// the lease, if it is the owner now, at the term stored.
    fn took(
        &self,
        document: &RawDocumentBuf,
        sent: Instant,
    ) -> std::result::Result<Held, Duration> {
        let owner = document
            .get("owner")
            .ok()
            .flatten()
            .and_then(|owner| Bson::try_from(owner.to_raw_bson()).ok());
        // Both takes leave an integer: `$inc` keeps one an integer, and the
        // other writes one.
        let term = document
            .get_i64("term")
            .ok()
            .or_else(|| document.get_i32("term").ok().map(i64::from));
        match (owner, term) {
            (Some(owner), Some(term)) if owner == self.stamp() => {
                let term = Term(term);
                tracing::info!(term = term.0, owner = %self.owner, lease = %self.id, "took the lease: leading");
                Ok(Held {
                    term,
                    deadline: sent + self.timing.duration - self.timing.margin(),
                })
            }
            _ => Err(self.timing.standby_poll_interval),
        }
    }

    /// Reads a lease the common take did not take, and acts on what it is.
    async fn judge(
        &self,
        now: DateTime,
        sent: Instant,
    ) -> Result<std::result::Result<Held, Duration>> {
        let stored = self
            .documents
            .find_one(doc! { "_id": &self.id })
            .await
            .map_err(|e| {
                Error::mongo("reading the lease failed", e)
                    .needing("find", self.documents.namespace())
            })?;
        // Removed since: it is taken anew at the next try.
        let Some(stored) = stored else {
            return Ok(Err(Duration::ZERO));
        };
        match Standing::of(&stored, now) {
            Standing::Held(left) => Ok(Err(left)),
            Standing::Changed => Ok(Err(Duration::ZERO)),
            Standing::Timeless(found) => {
                let lasts = stated_lease(&stored).unwrap_or(self.timing.duration);
                self.give_expiry(&found, lasts, far_ahead(&stored)).await
            }
            // A clock set back makes a live holder's expiry look far: with
            // no lease stated, it is given the longest a relay takes.
            Standing::FarAhead(found) => {
                let lasts = stated_lease(&stored).unwrap_or(LONGEST_LEASE);
                self.give_expiry(&found, lasts, far_ahead(&stored)).await
            }
            Standing::Lapsed { next, found } => self.take_over(next, found, now, sent).await,
        }
    }

    /// Gives this lease an expiry a lease from now where the stored one
    /// says nothing dependable (see [`Standing::of`]), so that it lapses
    /// unless its holder renews it; how long that is, or `None` if there
    /// was nothing to mend (or no lease).
    pub(crate) async fn mend_expiry(&self) -> Result<Option<Duration>> {
        let now = self.server_time().await?;
        let stored = self
            .documents
            .find_one(doc! { "_id": &self.id })
            .await
            .map_err(|e| {
                Error::mongo("reading the lease failed", e)
                    .needing("find", self.documents.namespace())
            })?;
        let Some(stored) = stored else {
            return Ok(None);
        };
        let lasts = match Standing::of(&stored, now) {
            Standing::Timeless(found) => {
                let lasts = stated_lease(&stored).unwrap_or(self.timing.duration);
                (found, lasts)
            }
            Standing::FarAhead(found) => {
                let lasts = stated_lease(&stored).unwrap_or(LONGEST_LEASE);
                (found, lasts)
            }
            _ => return Ok(None),
        };
        let (found, lasts) = lasts;
        let _left = self.give_expiry(&found, lasts, far_ahead(&stored)).await?;
        Ok(Some(lasts))
    }

    /// Gives a lease whose expiry says nothing dependable (not a date, or
    /// a date further ahead than any relay writes) an expiry `lasts` from
    /// now, as if its holder had just renewed it.
    ///
    /// Not taken at once: the expiry is what says when a holder must stop,
    /// and one may still be delivering. It cannot renew an expiry that is
    /// not a date (a renewal matches dates), so its deadline falls within
    /// a lease of the moment the expiry was overwritten, before the expiry
    /// given here; a far date no renewal wrote, and a holder renewing meets
    /// the new expiry. A holder that renews the new expiry first goes on
    /// leading (its owner and term still stand); otherwise the lease
    /// lapses and is taken as any other.
    async fn give_expiry(
        &self,
        found: &str,
        lasts: Duration,
        far: Duration,
    ) -> Result<std::result::Result<Held, Duration>> {
        // The clock read anew: with the time the take was judged by, a
        // relay that stalled since would take a live holder's renewed
        // expiry for a far one.
        let now = self.server_time().await?;
        let dated = self
            .documents
            .update_one(
                // An array of dates matches `$type: "date"` by its elements.
                doc! {
                    "_id": &self.id,
                    "expiresAt": { "$exists": true },
                    "$or": [
                        { "expiresAt": { "$not": { "$type": "date" } } },
                        { "expiresAt": { "$type": "array" } },
                        { "expiresAt": { "$gt": later(now, far) } },
                    ],
                },
                doc! { "$set": { "expiresAt": later(now, lasts) } },
            )
            .await
            .map_err(|e| {
                Error::mongo("writing the lease's expiry failed", e)
                    .needing("update", self.documents.namespace())
            })?;
        if dated.modified_count > 0 {
            tracing::warn!(
                lease = ?lasts,
                "the lease's expiresAt is {found}, so no relay could tell when it ends, and none \
                 could take it: it now ends one lease from now, when a standby takes it over \
                 unless its holder renews it first"
            );
        }
        Ok(Err(lasts))
    }

    /// Takes a lapsed lease whose term the common take does not count on,
    /// at term `next`; `found` says what was wrong with the stored term.
    async fn take_over(
        &self,
        next: Term,
        found: Option<String>,
        now: DateTime,
        sent: Instant,
    ) -> Result<std::result::Result<Held, Duration>> {
        let taken = self
            .documents
            .find_one_and_update(
                // Only as judged: of two relays that read it at once, the
                // first take leaves a countable term, and the other's
                // matches nothing.
                doc! { "_id": &self.id, "$and": [lapsed(now), doc! { "$nor": countable() }] },
                {
                    let mut update = self.take(now);
                    if let Ok(set) = update.get_document_mut("$set") {
                        set.insert("term", next.0);
                    }
                    update
                },
            )
            .return_document(ReturnDocument::After)
            .await
            .map_err(|e| {
                Error::mongo("taking the lease failed", e)
                    .needing("update and insert", self.documents.namespace())
            })?;
        let Some(document) = taken else {
            return Ok(Err(Duration::ZERO));
        };
        let held = self.took(&document, sent);
        if let (Ok(_), Some(found)) = (&held, found) {
            tracing::warn!(
                term = next.0,
                "took over a lease whose term was {found}, not an integer a term can grow from: \
                 leading at term {}, a number above any term relays count to",
                next.0
            );
        }
        Ok(held)
    }

    /// Extends a held lease. `Ok(false)` if another relay has taken it.
    pub async fn renew(&self, held: &mut Held) -> Result<bool> {
        // A reading of its own (see `server_clock`): the expiry is written
        // from the latest the server's clock can read at `sent`, and the
        // deadline counted from `sent`, so it comes first. The group's
        // announcements and rounds count on this reading after it.
        let reading = self.clock.read().await?;
        let sent = Instant::now();
        let now = reading.latest(sent);
        let renewed = self
            .documents
            .update_one(
                // Not once released: a renewal a stop cut short, landing
                // after the release, must not take the lease back.
                doc! {
                    "_id": &self.id, "owner": self.stamp(), "term": held.term.0,
                    "expiresAt": { "$gt": DateTime::from_millis(0) },
                },
                doc! { "$set": {
                    "expiresAt": later(now, self.timing.duration),
                    "leaseMillis": self.lease_millis(),
                    "leaseOwner": self.stamp(),
                } },
            )
            .await
            .map_err(|e| {
                Error::mongo("renewing the lease failed", e)
                    .needing("update", self.documents.namespace())
            })?;
        if renewed.matched_count == 0 {
            return Ok(false);
        }
        // The group's hold lasts at least as long as the partition's, from
        // the same reading of the clock; the deadline moves only once both
        // are written.
        if let Some(hold) = &self.hold {
            if let Hold::Busy(_) = hold.hold_for_group(now).await? {
                tracing::warn!(
                    term = held.term.0,
                    lease = %self.id,
                    "a relay of one partition, a sweep --once run or a relay of another \
                     partition count took the outbox's own lease: stopping delivery"
                );
                return Ok(false);
            }
        }
        held.deadline = sent + self.timing.duration - self.timing.margin();
        Ok(true)
    }

    /// Gives the lease up at once, so a standby need not wait for it to expire.
    pub async fn release(&self, held: &Held) -> Result<()> {
        self.documents
            .update_one(
                doc! { "_id": &self.id, "owner": self.stamp(), "term": held.term.0 },
                doc! { "$set": { "expiresAt": DateTime::from_millis(0) } },
            )
            .await
            .map_err(|e| {
                Error::mongo("releasing the lease failed", e)
                    .needing("update", self.documents.namespace())
            })?;
        tracing::info!(term = held.term.0, lease = %self.id, "released the lease");
        Ok(())
    }

    /// Keeps a held lease renewed until `stop` fires. Abandons the
    /// leader's work (fires `abandon`: a term's, or a sweep run's) and
    /// returns if the lease is taken or cannot be renewed before its
    /// deadline.
    pub async fn keep(
        self,
        mut held: Held,
        abandon: CancellationToken,
        stop: CancellationToken,
    ) -> Held {
        let mut warned = false;
        loop {
            let next = (Instant::now() + self.timing.renew_interval).min(held.deadline);
            tokio::select! {
                _ = stop.cancelled() => return held,
                _ = tokio::time::sleep_until(next) => {}
            }
            if Instant::now() >= held.deadline {
                tracing::error!(
                    term = held.term.0,
                    lease = ?self.timing.duration,
                    "could not renew the lease in time: stopping delivery until this relay leads \
                     again; if the server answers slowly rather than not at all, raise \
                     --lease-duration"
                );
                abandon.cancel();
                return held;
            }
            let began = Instant::now();
            // A stop does not wait for a renewal MongoDB leaves unanswered:
            // the release that follows matches the lease whether it landed
            // or not.
            let renewing = tokio::time::timeout_at(held.deadline, self.renew(&mut held));
            let attempt = tokio::select! {
                _ = stop.cancelled() => None,
                attempt = renewing => Some(attempt),
            };
            let Some(attempt) = attempt else {
                return held;
            };
            match attempt {
                Ok(Ok(true)) => warned |= self.slow_renewal(began.elapsed(), warned),
                Ok(Ok(false)) => {
                    tracing::warn!(
                        term = held.term.0,
                        "another relay took the lease: stopping delivery"
                    );
                    abandon.cancel();
                    return held;
                }
                Ok(Err(error)) => tracing::warn!(%error, "renewing the lease failed; trying again"),
                Err(_) => {} // the deadline check above ends it
            }
        }
    }

    /// Warns, unless it has (`warned`), when a renewal took more than a
    /// third of the lease: a little slower and the lease is lost, and with
    /// it a term's work. Returns whether it warned.
    fn slow_renewal(&self, took: std::time::Duration, warned: bool) -> bool {
        let lease = self.timing.duration;
        if warned || took <= lease / 3 {
            return false;
        }
        tracing::warn!(
            ?took,
            ?lease,
            "renewing the lease took more than a third of it: a renewal that takes the rest \
             loses the lease, and the relay stops delivering until it leads again; raise \
             --lease-duration (keeping --lease-renew-interval at most half of it), or find what \
             keeps the server from answering"
        );
        true
    }

    /// This relay's lease, as it states it in the lease (`leaseMillis`).
    fn lease_millis(&self) -> i64 {
        i64::try_from(self.timing.duration.as_millis()).unwrap_or(i64::MAX)
    }

    /// The database server's clock.
    async fn server_time(&self) -> Result<DateTime> {
        server_time(self.database.client()).await
    }
}

/// The longest lease a relay takes (`--lease-duration` takes 1 s to 1 h).
pub(crate) const LONGEST_LEASE: Duration = Duration::from_secs(3600);

/// How far ahead of the server's clock an expiry a relay wrote can be: its
/// lease, counted from the server's clock when it wrote it, and a minute
/// for that clock to have been set back since.
pub(crate) const FAR_AHEAD: Duration = Duration::from_secs(3660);

/// The lease its holder states (`leaseMillis`), if the holder stated it
/// (`leaseOwner` names the owner: a relay that does not state its lease
/// leaves an earlier holder's) and it is one a relay could have taken.
fn stated_lease(stored: &RawDocument) -> Option<Duration> {
    match (field(stored, "owner"), field(stored, "leaseOwner")) {
        (Ok(Some(owner)), Ok(Some(stated_by))) if owner == stated_by => {}
        _ => return None,
    }
    let millis = match field(stored, "leaseMillis") {
        Ok(Some(RawBsonRef::Int64(millis))) => u64::try_from(millis).ok()?,
        Ok(Some(RawBsonRef::Int32(millis))) => u64::try_from(millis).ok()?,
        _ => return None,
    };
    let lease = Duration::from_millis(millis);
    (Duration::from_secs(1)..=LONGEST_LEASE)
        .contains(&lease)
        .then_some(lease)
}

/// How far ahead of the server's clock an expiry may lie before it is
/// judged an edit or a clock set back: twice the lease its holder states,
/// or, where it states none, the longest lease and a minute.
fn far_ahead(stored: &RawDocument) -> Duration {
    stated_lease(stored).map_or(FAR_AHEAD, |lease| lease.saturating_mul(2))
}

/// A lease whose expiry has passed, or that has none. A query compares a
/// date with dates alone, so an expiry of another type matches neither.
fn lapsed(now: DateTime) -> Document {
    doc! { "$or": [
        { "expiresAt": { "$lt": now } },
        { "expiresAt": { "$exists": false } },
    ] }
}

/// The terms the common take counts on: none yet, or an integer the
/// server can add one to. `$inc` fails on a string (every take would), on
/// the largest integer, and leaves a double past 2^53 as it was (`1e20 +
/// 1` is `1e20`: two relays would hold one term). `$type` and `$lt` match
/// an array's elements, and `$inc` fails on an array: arrays are left out.
fn countable() -> Vec<Document> {
    vec![
        doc! { "term": { "$exists": false } },
        doc! { "term": {
            "$type": ["int", "long"],
            "$lt": i64::MAX,
            "$not": { "$type": "array" },
        } },
    ]
}

/// A lease the common take did not take, as read, by the server's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    /// Another relay holds it, for this long yet.
    Held(Duration),
    /// Its expiry is not a date (what it is, said): no one can tell when
    /// it ends.
    Timeless(String),
    /// Its expiry is further ahead of the server's clock than any relay
    /// writes (said): an edit, or a clock set back since.
    FarAhead(String),
    /// Lapsed, with a term the common take does not count on: taken at
    /// `next`. `found` says what was wrong with the term, if anything was
    /// (an integer stored as a double, a shell's edit, is read as itself).
    Lapsed { next: Term, found: Option<String> },
    /// Lapsed with a countable term: it changed between the take and the
    /// read (taken, released or removed), or the read lags the write.
    Changed,
}

impl Standing {
    fn of(stored: &RawDocument, now: DateTime) -> Standing {
        match field(stored, "expiresAt") {
            Ok(None) => {}
            Ok(Some(RawBsonRef::DateTime(expires))) => {
                let left = expires
                    .timestamp_millis()
                    .saturating_sub(now.timestamp_millis());
                let stated = stated_lease(stored);
                match u64::try_from(left).map(Duration::from_millis) {
                    Ok(left) if left > far_ahead(stored) => {
                        let expires = expires.try_to_rfc3339_string().unwrap_or_default();
                        return Standing::FarAhead(match stated {
                            Some(lease) => format!(
                                "{expires}, more than twice the lease its holder states ({}) \
                                 ahead of the server's clock",
                                humantime::format_duration(lease),
                            ),
                            None => format!(
                                "{expires}, further ahead than any relay's lease lasts ({} at \
                                 most)",
                                humantime::format_duration(LONGEST_LEASE),
                            ),
                        });
                    }
                    Ok(left) if !left.is_zero() => return Standing::Held(left),
                    _ => {}
                }
            }
            Ok(Some(other)) => return Standing::Timeless(describe(other)),
            Err(unreadable) => return Standing::Timeless(unreadable),
        }
        match StoredTerm::of(field(stored, "term")) {
            StoredTerm::Counted => Standing::Changed,
            StoredTerm::Whole(term) => Standing::Lapsed {
                next: Term(term + 1),
                found: None,
            },
            StoredTerm::Uncounted { found, read_as } => Standing::Lapsed {
                next: fresh_term(read_as, now),
                found: Some(found),
            },
        }
    }
}

/// Whether `stored` is held by the server's clock `now`: its expiry is
/// ahead, and no further than its holder could have written it.
pub(crate) fn is_live(stored: &RawDocument, now: DateTime) -> bool {
    matches!(Standing::of(stored, now), Standing::Held(_))
}

/// How long `stored` is held yet by the server's clock `now`, if it is.
pub(crate) fn held_for(stored: &RawDocument, now: DateTime) -> Option<Duration> {
    match Standing::of(stored, now) {
        Standing::Held(left) => Some(left),
        _ => None,
    }
}

/// Whether `stored`'s expiry lies further ahead of `now` than its holder
/// could have written it (a clock set back, or an edit): a lease to mend
/// (see [`Lease::mend_expiry`]) rather than to wait out.
pub(crate) fn is_far_ahead(stored: &RawDocument, now: DateTime) -> bool {
    matches!(Standing::of(stored, now), Standing::FarAhead(_))
}

/// A stored term, as the takes count it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StoredTerm {
    /// None, or an integer the common take adds one to.
    Counted,
    /// An integer stored as a double, below 2^53, where a double counts
    /// exactly: the next term is one more, written as an integer.
    Whole(i64),
    /// Anything else: what it is, and the term a relay of an earlier
    /// version read from it (a number's whole part), if it is a number.
    Uncounted { found: String, read_as: Option<i64> },
}

impl StoredTerm {
    /// Where a double stops counting whole numbers exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;

    fn of(term: std::result::Result<Option<RawBsonRef<'_>>, String>) -> StoredTerm {
        let term = match term {
            Ok(Some(term)) => term,
            Ok(None) => return StoredTerm::Counted,
            Err(found) => {
                return StoredTerm::Uncounted {
                    found,
                    read_as: None,
                }
            }
        };
        match term {
            RawBsonRef::Int32(_) => StoredTerm::Counted,
            RawBsonRef::Int64(term) if term < i64::MAX => StoredTerm::Counted,
            RawBsonRef::Double(term) if term.fract() == 0.0 && term.abs() < Self::EXACT - 1.0 => {
                // Exact: a whole number below 2^53 in magnitude.
                StoredTerm::Whole(term as i64)
            }
            // `as` saturates, as an earlier version's reading did.
            RawBsonRef::Double(term) => StoredTerm::Uncounted {
                found: describe(RawBsonRef::Double(term)),
                read_as: term.is_finite().then_some(term.trunc() as i64),
            },
            RawBsonRef::Int64(term) => StoredTerm::Uncounted {
                found: format!("{term}, the largest a term can be"),
                read_as: Some(term),
            },
            other => StoredTerm::Uncounted {
                found: describe(other),
                read_as: None,
            },
        }
    }
}

/// The term taken over a stored one the takes cannot count on.
///
/// Such a term says nothing dependable about the terms held before it: an
/// edit may have put it there after any number of terms, and relays of
/// earlier versions read a fraction, a double past 2^53 or a string as
/// some other number (its whole part, the largest integer, or 1). So the
/// new term is the server's clock in milliseconds since 1970. Terms are
/// counted from 1, one per new leader: reaching that number would take a
/// new leader every millisecond since 1970, and a later take-over of
/// another unreadable term reads a later clock, so a larger number. Where
/// the stored number is larger still, the term is one more than what was
/// read from it. At the very top nothing is larger: the clock's number is
/// then a term that is neither that holder's nor the one after it, which
/// is all a relay's memory of its own terms asks (`checkpoint::KeptPlace`,
/// `work::Acknowledged`), and the checkpoint is fenced by owner as well as
/// term, so that holder writes nothing more.
fn fresh_term(read_as: Option<i64>, now: DateTime) -> Term {
    let clock = now.timestamp_millis().max(1);
    let above_read = read_as.and_then(|term| term.checked_add(1));
    Term(above_read.map_or(clock, |above| above.max(clock)))
}

/// Field `name` of a stored lease: absent, its value, or, where the driver
/// cannot read it (a string that is not UTF-8), what it is said as.
fn field<'a>(
    stored: &'a RawDocument,
    name: &str,
) -> std::result::Result<Option<RawBsonRef<'a>>, String> {
    let unreadable = |e: bson::raw::Error| format!("a value that cannot be read ({e})");
    for element in stored.iter_elements() {
        let element = element.map_err(unreadable)?;
        if element.key() == name {
            return element.value().map(Some).map_err(unreadable);
        }
    }
    Ok(None)
}

/// A stored value as a warning says it.
fn describe(value: RawBsonRef<'_>) -> String {
    match value {
        RawBsonRef::String(text) => format!("the string {text:?}"),
        RawBsonRef::Double(number) => format!("the number {number}"),
        RawBsonRef::Int32(number) => format!("the number {number}"),
        RawBsonRef::Int64(number) => format!("the number {number}"),
        RawBsonRef::Null => "null".to_owned(),
        RawBsonRef::Boolean(value) => value.to_string(),
        other => format!("a value of BSON type {:?}", other.element_type()),
    }
}

/// A lease this relay holds.
#[derive(Debug, Clone, Copy)]
pub struct Held {
    /// The fencing number of this tenure.
    pub term: Term,
    /// When this relay must stop acting as leader unless it renews.
    pub deadline: Instant,
}

/// A name for this process that is unique among relays: host, pid and a
/// random part (so a restarted process with a recycled pid is someone new).
pub(crate) fn owner_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "relay".to_owned());
    format!("{host}/{}/{}", std::process::id(), ObjectId::new().to_hex())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bson::Bson;

    const NOW: i64 = 1_800_000_000_000;

    fn standing(fields: Document) -> Standing {
        let mut stored = doc! { "_id": "db.outbox", "owner": "gone" };
        stored.extend(fields);
        let raw = RawDocumentBuf::from_document(&stored).expect("a document");
        Standing::of(&raw, DateTime::from_millis(NOW))
    }

    fn past() -> DateTime {
        DateTime::from_millis(NOW - 1)
    }

    #[test]
    fn an_expiry_that_is_not_a_date_is_said_and_dated() {
        for (expiry, said) in [
            (Bson::Null, "null"),
            (Bson::Int64(NOW + 60_000), "the number 1800000060000"),
            (
                Bson::String("2030-01-01".into()),
                "the string \"2030-01-01\"",
            ),
            (
                Bson::Document(doc! {}),
                "a value of BSON type EmbeddedDocument",
            ),
        ] {
            assert_eq!(
                standing(doc! { "expiresAt": expiry, "term": 3_i64 }),
                Standing::Timeless(said.to_owned())
            );
        }
        assert_eq!(
            standing(doc! { "expiresAt": DateTime::from_millis(NOW + 1500), "term": "x" }),
            Standing::Held(Duration::from_millis(1500)),
            "a term that cannot be counted waits for the expiry"
        );
    }

    #[test]
    fn an_expiry_further_ahead_than_any_lease_is_not_waited_for() {
        let ahead = |by: Duration| {
            standing(doc! { "expiresAt": later(DateTime::from_millis(NOW), by), "term": 3_i64 })
        };
        assert_eq!(ahead(LONGEST_LEASE), Standing::Held(LONGEST_LEASE));
        let far = ahead(LONGEST_LEASE * 2);
        assert!(
            matches!(&far, Standing::FarAhead(said) if said.contains("further ahead than any")),
            "{far:?}"
        );
    }

    #[test]
    fn an_expiry_more_than_twice_the_stated_lease_ahead_is_mended() {
        let ahead = |by: Duration| {
            standing(doc! {
                "expiresAt": later(DateTime::from_millis(NOW), by), "term": 3_i64,
                "leaseOwner": "gone", "leaseMillis": 2_000_i64,
            })
        };
        assert_eq!(
            ahead(Duration::from_secs(3)),
            Standing::Held(Duration::from_secs(3))
        );
        let far = ahead(Duration::from_secs(30 * 60));
        assert!(
            matches!(&far, Standing::FarAhead(said) if said.contains("twice the lease")),
            "a clock set back by half an hour: {far:?}"
        );
    }

    #[test]
    fn a_holder_is_read_as_a_relay_a_sweep_or_a_group() {
        let holder =
            |fields: Document| StoredHolder::of(&RawDocumentBuf::from_document(&fields).unwrap());
        assert_eq!(
            holder(doc! { "owner": "a" }),
            StoredHolder::Relay("a".into())
        );
        assert_eq!(
            holder(doc! { "owner": "a", "sweepOnce": "a" }),
            StoredHolder::SweepOnce("a".into())
        );
        assert_eq!(
            holder(doc! { "owner": "b", "sweepOnce": "a" }),
            StoredHolder::Relay("b".into()),
            "a mark a later holder left behind"
        );
        assert_eq!(
            holder(doc! { "owner": { "group": "db.outbox/group", "partitions": 4_i64 } }),
            StoredHolder::Group(4)
        );
        assert_eq!(
            holder(doc! { "owner": { "group": "x" } }),
            StoredHolder::Unknown
        );
        assert_eq!(holder(doc! {}), StoredHolder::Unknown);
    }

    #[test]
    fn a_stated_lease_is_read_where_a_relay_could_have_taken_it() {
        let stated = |value: Bson| {
            let raw = RawDocumentBuf::from_document(&doc! {
                "owner": "a", "leaseOwner": "a", "leaseMillis": value,
            })
            .unwrap();
            stated_lease(&raw)
        };
        assert_eq!(stated(Bson::Int64(2_000)), Some(Duration::from_secs(2)));
        assert_eq!(stated(Bson::Int32(3_000)), Some(Duration::from_secs(3)));
        for nonsense in [
            Bson::Int64(0),
            Bson::Int64(-5),
            Bson::Int64(i64::MAX),
            Bson::Double(2_000.0),
            Bson::String("2s".into()),
        ] {
            assert_eq!(stated(nonsense.clone()), None, "{nonsense:?}");
        }
        for (owner, stated_by) in [("a", Some("b")), ("a", None)] {
            let mut stored = doc! { "owner": owner, "leaseMillis": 2_000_i64 };
            if let Some(stated_by) = stated_by {
                stored.insert("leaseOwner", stated_by);
            }
            let raw = RawDocumentBuf::from_document(&stored).unwrap();
            assert_eq!(stated_lease(&raw), None, "not the holder's: {stored}");
        }
    }

    #[test]
    fn a_term_that_cannot_be_counted_is_taken_over_above_any_counted_one() {
        let fresh = |found: &str| Standing::Lapsed {
            next: Term(NOW),
            found: Some(found.to_owned()),
        };
        for (term, expected) in [
            (Bson::String("7".into()), fresh("the string \"7\"")),
            (Bson::Double(7.5), fresh("the number 7.5")),
            (
                Bson::Double(1e20),
                fresh("the number 100000000000000000000"),
            ),
            (
                Bson::Int64(i64::MAX),
                fresh("9223372036854775807, the largest a term can be"),
            ),
            (Bson::Null, fresh("null")),
            (Bson::Boolean(true), fresh("true")),
        ] {
            let found = standing(doc! { "expiresAt": past(), "term": term.clone() });
            assert_eq!(found, expected, "{term:?}");
        }
        assert_eq!(
            standing(doc! { "expiresAt": past(), "term": 7.0 }),
            Standing::Lapsed {
                next: Term(8),
                found: None
            },
            "a whole double is read as itself"
        );
        assert_eq!(
            standing(doc! { "expiresAt": past(), "term": 4e15 }),
            Standing::Lapsed {
                next: Term(4_000_000_000_000_001),
                found: None
            },
            "below 2^53 a double counts exactly"
        );
        assert_eq!(
            standing(doc! { "term": 7_i64 }),
            Standing::Changed,
            "the common take counts it"
        );
    }

    #[test]
    fn a_fresh_term_is_above_the_clock_and_what_was_read() {
        let now = DateTime::from_millis(NOW);
        assert_eq!(fresh_term(None, now), Term(NOW));
        assert_eq!(fresh_term(Some(7), now), Term(NOW));
        assert_eq!(fresh_term(Some(i64::MAX), now), Term(NOW));
        assert_eq!(fresh_term(Some(NOW * 10), now), Term(NOW * 10 + 1));
        assert_eq!(fresh_term(None, DateTime::from_millis(-5)), Term(1));
    }
}
