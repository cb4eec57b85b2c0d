//! The group of relays on one outbox: who is in it, and which partitions
//! each delivers.
//!
//! A partition ([`Partition`]) is what a single relay does alone: its own
//! lease, change stream, stored position and sweep. With `--partitions P`
//! the relays on one outbox share P of them; each relay runs one such
//! unit per partition it holds. Everything lives in the checkpoint
//! collection beside the leases, so the group needs nothing but MongoDB:
//!
//! - `<db>.<collection>/group`: `{partitions, expiresAt}`, the count the
//!   group uses, kept alive by its members (by those holding a partition,
//!   and by every one while none does; see [`Renewal`]); a relay with
//!   another count is refused while it lives, or while a lease of this
//!   count does, so two counts never deliver at once;
//! - `<db>.<collection>/member/<relay>`: `{group, joinedAt, expiresAt}`,
//!   one per relay, renewed every half lease and removed when it stops;
//! - each partition's lease and checkpoint, as a single relay keeps its
//!   own ([`Partition::document_id`]).
//!
//! Each round a relay reads the group (when it changes: see [`watch`]),
//! and applies one rule ([`balance::moves`]): it takes free partitions up to
//! its share, and hands over gracefully what is above it. Expiries are
//! judged on the server's clock, as the lease's are, and an expiry further
//! ahead than its writer could have set it (a clock set back) is mended,
//! not waited out (see `lease`).
//!
//! The group's count and its positions: a partition's stored position is
//! good only for the period its count ran in. When the group takes another
//! count, every stored position is retired (its token removed, its term
//! moved on), so that each partition of the new count catches up from what
//! is pending rather than replaying from where the same count stopped long
//! ago; when a group forms where none was recorded, the positions of other
//! counts are. And while any partition is held, the group holds the
//! outbox's own lease too (see `lease`), so that a relay of one partition,
//! a `sweep --once` run, or a relay from before groups waits for it.

pub mod balance;

pub mod watch;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use bson::{doc, DateTime, Document, RawBsonRef, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::{Collection, Database};

use crate::checkpoint::POSITION_AT;
use crate::error::{is_duplicate_key, Error, Result};
use crate::lease::{held_for, is_far_ahead, is_live, Lease, LeaseTiming, StoredHolder, FAR_AHEAD};
use crate::partition::{Partition, MOST_PARTITIONS};
use crate::server_clock::{server_time, ServerClock};
use crate::time::{later, until};
use balance::{Holder, Member};

/// One relay's membership in the group of its outbox.
#[derive(Debug, Clone)]
pub struct Group {
    database: Database,
    documents: Collection<RawDocumentBuf>,
    /// `<db>.<collection>`: the outbox's own lease and checkpoint id.
    outbox: String,
    me: String,
    partitions: u32,
    timing: LeaseTiming,
    /// The outbox's leases as this relay reads them, to mend an expiry
    /// set too far ahead.
    leases: Lease,
    /// What renewals and rounds read the server's clock from.
    clock: Arc<ServerClock>,
}

/// The group as one read shows it.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub members: Vec<Member>,
    pub holders: BTreeMap<Partition, Holder>,
    /// Whether the outbox's own lease lets this group deliver.
    pub outbox: OutboxLease,
    /// When something this view shows lapses by the server's clock, and
    /// the view would change with no write: another relay's lease or
    /// announcement ends, or a newcomer stops counting as one. `None` if
    /// nothing does.
    pub next_lapse: Option<tokio::time::Instant>,
    /// Announcements gone for more than a lease, to be cleared.
    pub lapsed: bool,
}

/// The outbox's own lease, as a group of more than one partition sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutboxLease {
    /// Free, lapsed, or held for this group: its partitions may be taken.
    #[default]
    Open,
    /// Held by a relay of one partition, a `sweep --once` run, a relay from
    /// before groups, or a group of another count: no partition is taken
    /// until it ends (a take would be released at once).
    Taken,
}

/// Relays of another partition count than this relay's, as the outbox's
/// live leases show them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Others {
    None,
    /// A lease of this count is held.
    Leading(u32),
    /// A lease of this count had an expiry further ahead than its holder
    /// could have written (a clock set back); it was given one this long
    /// from now, and lapses then unless its holder renews it.
    Mended(u32, Duration),
}

impl Group {
    /// The group on the outbox `collection` of `database`, kept in
    /// `checkpoint_collection`, as the relay named `me` with `partitions`.
    pub fn new(
        database: &Database,
        checkpoint_collection: &str,
        collection: &str,
        me: &str,
        partitions: u32,
        timing: LeaseTiming,
    ) -> Self {
        Group {
            database: database.clone(),
            documents: database.collection(checkpoint_collection),
            outbox: format!("{}.{}", database.name(), collection),
            me: me.to_owned(),
            partitions,
            timing,
            leases: Lease::new(database, checkpoint_collection, collection, timing),
            clock: Arc::new(ServerClock::new(database.client(), Duration::ZERO)),
        }
    }

    /// Starts watching the group for the changes its rounds act on, until
    /// `shutdown` (see [`watch`]), through `database`'s client: one other
    /// than the renewals', whose few connections the stream's long reads
    /// would take.
    pub(crate) fn watch(
        &self,
        database: &Database,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> watch::Changes {
        watch::start(
            database.collection(self.documents.name()),
            &self.outbox,
            shutdown,
        )
    }

    /// The same group, its renewals and rounds reading the server's clock
    /// from `clock`, which the relay's leases read it from too.
    pub(crate) fn with_clock(self, clock: Arc<ServerClock>) -> Group {
        Group { clock, ..self }
    }

    /// The partition count the relays on `collection` run with, as its
    /// group stores it, and whether a relay of it is running (the group
    /// is live by the server's clock); `None` if no group was formed.
    pub async fn stored(
        database: &Database,
        checkpoint_collection: &str,
        collection: &str,
    ) -> Result<Option<(u32, bool)>> {
        let id = format!("{}.{}/group", database.name(), collection);
        let now = server_time(database.client()).await?;
        let stored = database
            .collection::<RawDocumentBuf>(checkpoint_collection)
            .find_one(doc! { "_id": id })
            .await
            .map_err(|e| {
                Error::mongo("reading the group of relays failed", e).needing(
                    "find",
                    format!("{}.{checkpoint_collection}", database.name()),
                )
            })?;
        Ok(stored.and_then(|stored| Some((stored_count(&stored)?, live_until(&stored, now)))))
    }

    /// The partitions the group shares.
    pub fn partitions(&self) -> impl Iterator<Item = Partition> {
        Partition::all(self.partitions)
    }

    /// Joins the group, or refuses with a configuration error while relays
    /// of another partition count run. They run while a lease of their
    /// count is live (the outbox's own lease is a count of 1, as relays of
    /// one partition hold it, or the group's count, as a group holds it),
    /// whatever the group's document says or whether there is one; and
    /// while the group's document names their count and is live, which
    /// covers relays that have joined and not yet taken a lease. A
    /// `sweep --once` run is not a count: it ends by itself, and the group
    /// waits for it (see [`View::outbox`]). A document of another count
    /// that lapsed is taken only as read, so that of two relays of
    /// different counts starting at once, one joins. Then announces this
    /// relay.
    pub async fn join(&self) -> Result<()> {
        let now = self.others_gone().await?;
        let stored = self
            .documents
            .find_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| {
                Error::mongo("reading the group of relays failed", e)
                    .needing("find", self.documents.namespace())
            })?;
        let taken = match stored.as_deref() {
            None => self.found_group(now, Retire::OtherCounts).await?,
            Some(group) if stored_count(group) == Some(self.partitions) => {
                // A relay that changed the count may have stopped before
                // it retired the positions: whoever joins next does.
                let pending = Retire::pending(group);
                if let Some(which) = pending {
                    self.finish_retiring(which, now).await?;
                }
                if pending != Some(Retire::All)
                    && self.partitions > 1
                    && self.led_alone_since().await?
                {
                    self.retire_positions(Retire::All, now).await?;
                    tracing::info!(
                        "a relay of one partition delivered the outbox since this group did: \
                         each partition catches up from what is pending in it"
                    );
                }
                true
            }
            Some(group) if live_until(group, now) => {
                return Err(self.refusal(stored_count(group)));
            }
            Some(group) => self.take_group(group, now).await?,
        };
        if !taken {
            // Another relay changed it between the read and the take: the
            // join is judged again at the next try.
            return Err(Error::TakenOver(
                "another relay changed the group of relays while this one joined it".to_owned(),
            ));
        }
        self.renew_at(now).await?;
        self.announce(now, Joining::Again).await
    }

    /// Whether a relay of one partition held the outbox's own lease last,
    /// after this group of several: a rollback to a version from before
    /// groups, which
    /// leaves the group's document as it was. Its deliveries moved the
    /// outbox past the partitions' stored positions, which are retired as
    /// for a change of count (the group marks the lease as its own while it
    /// delivers, and a `sweep --once` marks its run, so neither counts).
    /// Until the group takes the lease again the evidence stays, so a join
    /// that stops half way is finished by the next.
    async fn led_alone_since(&self) -> Result<bool> {
        let outbox = self
            .documents
            .clone_with_type::<RawDocumentBuf>()
            .find_one(doc! { "_id": &self.outbox })
            .await
            .map_err(|e| {
                Error::mongo("reading the outbox's lease failed", e)
                    .needing("find", self.documents.namespace())
            })?;
        Ok(
            outbox
                .is_some_and(|outbox| matches!(StoredHolder::of(&outbox), StoredHolder::Relay(_))),
        )
    }

    /// Whether the outbox is free of relays of another count for a relay
    /// of one partition that joins no group (`sweep --once`): an error
    /// naming their count if not (see [`Group::join`]). It does not wait:
    /// a lease of another count whose expiry it mended refuses it too, and
    /// lapses by the next run unless its holder still renews it.
    pub async fn admits_one(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        match self.other_count_leading(now).await? {
            Others::None => {}
            Others::Leading(theirs) | Others::Mended(theirs, _) => {
                return Err(self.refusal(Some(theirs)))
            }
        }
        let stored = self
            .documents
            .find_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| {
                Error::mongo("reading the group of relays failed", e)
                    .needing("find", self.documents.namespace())
            })?;
        match stored.as_deref() {
            Some(group)
                if stored_count(group) != Some(self.partitions) && live_until(group, now) =>
            {
                Err(self.refusal(stored_count(group)))
            }
            _ => Ok(()),
        }
    }

    /// Waits until no lease of another count is live, or refuses naming the
    /// count that holds one; the server's clock then. A lease whose expiry
    /// was set too far ahead is mended and waited out: its holder renews it
    /// if it runs, and then it counts.
    async fn others_gone(&self) -> Result<DateTime> {
        for _ in 0..MENDS {
            let now = server_time(self.database.client()).await?;
            match self.other_count_leading(now).await? {
                Others::None => return Ok(now),
                Others::Leading(theirs) => return Err(self.refusal(Some(theirs))),
                Others::Mended(theirs, left) => {
                    tracing::warn!(
                        partitions = theirs,
                        "a lease of another partition count expires further ahead than its \
                         holder could have written (the server's clock set back?): it now \
                         ends within {}, unless its holder still runs and renews it",
                        humantime::format_duration(left)
                    );
                    tokio::time::sleep(left + MEND_MARGIN).await;
                }
            }
        }
        let now = server_time(self.database.client()).await?;
        match self.other_count_leading(now).await? {
            Others::None => Ok(now),
            Others::Leading(theirs) | Others::Mended(theirs, _) => Err(self.refusal(Some(theirs))),
        }
    }

    /// The count of relays leading partitions of another count than this
    /// relay's, if any does: one with a live lease of it. One whose expiry
    /// is further ahead than its holder could have written is given an
    /// expiry a lease from now (a clock set back must neither let two
    /// counts deliver nor keep a new count out for as long as the step),
    /// and said as mended.
    async fn other_count_leading(&self, now: DateTime) -> Result<Others> {
        let failed = |e| {
            Error::mongo("reading the group's leases failed", e)
                .needing("find", self.documents.namespace())
        };
        let ours = format!("^{}(:[0-9]+/[0-9]+)?$", regex_escaped(&self.outbox));
        let mut leases = self
            .documents
            .find(doc! { "_id": { "$regex": ours }, "expiresAt": { "$gt": now } })
            .await
            .map_err(failed)?;
        let mut mended: Option<(u32, Duration)> = None;
        while let Some(lease) = leases.try_next().await.map_err(failed)? {
            let Ok(Some(RawBsonRef::String(id))) = lease.get("_id") else {
                continue;
            };
            let count = match (
                id.strip_prefix(self.outbox.as_str()),
                StoredHolder::of(&lease),
            ) {
                (Some(""), StoredHolder::Relay(_)) => Some(1),
                (Some(""), StoredHolder::Group(count)) => Some(count),
                (Some(rest), StoredHolder::Relay(_)) if !rest.is_empty() => {
                    rest.rsplit('/').next().and_then(|n| n.parse::<u32>().ok())
                }
                _ => None,
            };
            let Some(count) = count.filter(|count| *count != self.partitions) else {
                continue;
            };
            if is_live(&lease, now) {
                return Ok(Others::Leading(count));
            }
            if is_far_ahead(&lease, now) {
                if let Some(left) = self.leases.of_document(id).mend_expiry().await? {
                    mended = Some((count, mended.map_or(left, |(_, l)| l.max(left))));
                }
            }
        }
        Ok(mended.map_or(Others::None, |(count, left)| Others::Mended(count, left)))
    }

    /// Writes the group's document where there is none: false if another
    /// relay wrote one first. The positions `which` names are retired:
    /// where the document is written fresh, those of other counts (what ran
    /// here before recorded no group: relays from before groups, or the
    /// document was deleted; this count's are its own).
    async fn found_group(&self, now: DateTime, which: Retire) -> Result<bool> {
        let mut group = self.group_fields(now);
        group.insert(RETIRING, which.as_str());
        let inserted = self
            .documents
            .clone_with_type::<Document>()
            .insert_one(group)
            .await;
        match inserted {
            Ok(_) => {
                self.finish_retiring(which, now).await?;
                Ok(true)
            }
            Err(error) if is_duplicate_key(&error) => Ok(false),
            Err(error) => Err(Error::mongo("joining the group of relays failed", error)
                .needing("insert", self.documents.namespace())),
        }
    }

    /// Retires the positions `which` names, which the group's document
    /// says are still to be retired, and then says they are no longer. The
    /// document says it in the same write that changes the count, so a
    /// relay that stops in between leaves the retiring to the next to join:
    /// no relay of the count delivers before it is done.
    async fn finish_retiring(&self, which: Retire, now: DateTime) -> Result<()> {
        self.retire_positions(which, now).await?;
        self.documents
            .update_one(
                doc! {
                    "_id": self.group_id(),
                    "partitions": i64::from(self.partitions),
                    RETIRING: which.as_str(),
                },
                doc! { "$unset": { RETIRING: "" } },
            )
            .await
            .map_err(|e| {
                Error::mongo("retiring the stored positions of another count failed", e)
                    .needing("update", self.documents.namespace())
            })?;
        Ok(())
    }

    /// Retires the stored positions `which` names: each loses its token and
    /// its position's time (and is said written now, so that a partition
    /// that writes no new one shows its age from here), and a lapsed
    /// lease's term moves on by one, so that no relay resumes from it, from
    /// the collection or from its memory of its own last term (which it
    /// keeps only for the term just after). Its partition catches up from
    /// what is pending instead, which is always complete. Done twice, it
    /// does no harm.
    async fn retire_positions(&self, which: Retire, now: DateTime) -> Result<()> {
        let failed = |e| {
            Error::mongo("retiring the stored positions of another count failed", e)
                .needing("update", self.documents.namespace())
        };
        let ours = format!("^{}(:[0-9]+/[0-9]+)?$", regex_escaped(&self.outbox));
        let mut filter = doc! { "_id": { "$regex": ours } };
        if which == Retire::OtherCounts {
            let kept: Vec<String> = self
                .partitions()
                .map(|p| p.document_id(&self.outbox))
                .collect();
            filter.insert("$and", vec![doc! { "_id": { "$nin": kept } }]);
        }
        let mut positions = filter.clone();
        positions.insert("token", doc! { "$exists": true });
        let retired = self
            .documents
            .update_many(
                positions,
                doc! {
                    "$unset": { "token": "", POSITION_AT: "" },
                    "$set": { "updatedAt": now },
                },
            )
            .await
            .map_err(failed)?;
        // A term moves on only where it can be counted and no one holds
        // the lease (a holder of another count has none by now; see `join`).
        let mut lapsed = filter;
        lapsed.insert(
            "$or",
            vec![
                doc! { "expiresAt": { "$lt": now } },
                doc! { "expiresAt": { "$exists": false } },
            ],
        );
        lapsed.insert("term", doc! { "$type": ["int", "long"], "$lt": i64::MAX });
        self.documents
            .update_many(lapsed, doc! { "$inc": { "term": 1_i64 } })
            .await
            .map_err(failed)?;
        if retired.modified_count > 0 {
            tracing::info!(
                retired = retired.modified_count,
                partitions = self.partitions,
                "stored positions of another period retired: each partition of this count \
                 catches up from what is pending in it"
            );
        }
        Ok(())
    }

    /// Sets a lapsed group's count to this relay's, where its document is
    /// still as read (`stored`): false if another relay changed it first.
    /// A document whose fields cannot be read is replaced.
    async fn take_group(&self, stored: &bson::RawDocument, now: DateTime) -> Result<bool> {
        let failed = |e| {
            Error::mongo("joining the group of relays failed", e)
                .needing("update", self.documents.namespace())
        };
        let mut unchanged = doc! { "_id": self.group_id() };
        for name in ["partitions", "expiresAt"] {
            let value = match stored.get(name) {
                Ok(None) => None,
                Ok(Some(value)) => match bson::Bson::try_from(value.to_raw_bson()) {
                    Ok(value) => Some(value),
                    Err(_) => return self.replace_group(now).await,
                },
                Err(_) => return self.replace_group(now).await,
            };
            let condition = match value {
                Some(value) => doc! { "$eq": value },
                None => doc! { "$exists": false },
            };
            unchanged.insert(name, condition);
        }
        let mut group = self.group_fields(now);
        group.insert(RETIRING, Retire::All.as_str());
        let taken = self
            .documents
            .update_one(unchanged, doc! { "$set": group })
            .await
            .map_err(failed)?;
        let taken = taken.modified_count > 0;
        if taken {
            self.finish_retiring(Retire::All, now).await?;
            tracing::warn!(
                partitions = self.partitions,
                "no relay of the group's former partition count runs: the group now shares {} \
                 partitions, each catching up from what is pending in it",
                self.partitions
            );
        }
        Ok(taken)
    }

    /// Replaces a lapsed group document that cannot be read: which count
    /// ran is not known, so every stored position is retired.
    async fn replace_group(&self, now: DateTime) -> Result<bool> {
        tracing::warn!("the group of relays' document cannot be read: it is written anew");
        self.documents
            .delete_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| {
                Error::mongo("joining the group of relays failed", e)
                    .needing("remove", self.documents.namespace())
            })?;
        self.found_group(now, Retire::All).await
    }

    /// The group's document, as this relay writes it at `now`.
    fn group_fields(&self, now: DateTime) -> Document {
        let mut group = doc! {
            "_id": self.group_id(),
            "partitions": i64::from(self.partitions),
        };
        group.extend(self.expiry(now));
        group
    }

    /// The group's expiry from `now`, with the lease this relay states for
    /// it: `leaseFor` names the expiry the lease was stated with, so that a
    /// renewal by a relay of an earlier version, which states none, leaves
    /// no lease stated for its expiry (see [`trusted_ahead`]).
    fn expiry(&self, now: DateTime) -> Document {
        let expires = later(now, self.timing.duration);
        doc! {
            "expiresAt": expires,
            "leaseMillis": self.lease_millis(),
            "leaseFor": expires,
        }
    }

    /// The lease this relay states in the group's document, as a lease's
    /// holder does (see [`Group::live_until`]).
    fn lease_millis(&self) -> i64 {
        i64::try_from(self.timing.duration.as_millis()).unwrap_or(i64::MAX)
    }

    /// Renews this relay's announcement, and the group's count as
    /// `renewal` says. A group that took another count meanwhile (every
    /// relay of this count was gone) is a configuration error: this relay
    /// must stop.
    pub async fn renew(&self, renewal: Renewal) -> Result<()> {
        let now = self.now().await?;
        if renewal == Renewal::Whole {
            self.renew_at(now).await?;
        }
        self.announce(now, Joining::Not).await
    }

    /// Clears the announcements of relays gone for more than a lease, which
    /// a view found ([`View::lapsed`]). Tidying only: a relay that may not
    /// remove documents still runs.
    pub async fn clear_lapsed(&self) {
        let Ok(now) = self.now().await else {
            return;
        };
        let lapsed = doc! {
            "group": &self.outbox,
            "expiresAt": { "$lt": crate::time::earlier(now, self.timing.duration) },
        };
        if let Err(error) = self.documents.delete_many(lapsed).await {
            tracing::debug!(%error, "could not clear lapsed relays from the group");
        }
    }

    /// The server's clock now, at the earliest: what judges others'
    /// expiries, and what this relay's announcement and the group's
    /// document are renewed from (neither guards a deadline of its own).
    async fn now(&self) -> Result<DateTime> {
        let reading = self.clock.reading().await?;
        Ok(reading.earliest(tokio::time::Instant::now()))
    }

    /// Keeps the group's document alive, from `now`, at this count. One
    /// that is gone (deleted by hand) is written anew: the group runs on,
    /// and only another count in it stops this relay.
    async fn renew_at(&self, now: DateTime) -> Result<()> {
        for _ in 0..2 {
            let kept = self
                .documents
                .update_one(
                    doc! { "_id": self.group_id(), "partitions": i64::from(self.partitions) },
                    doc! { "$set": self.expiry(now) },
                )
                .await
                .map_err(|e| {
                    Error::mongo("renewing the group of relays failed", e)
                        .needing("update", self.documents.namespace())
                })?;
            if kept.matched_count > 0 {
                return Ok(());
            }
            let stored = self
                .documents
                .find_one(doc! { "_id": self.group_id() })
                .await
                .map_err(|e| {
                    Error::mongo("reading the group of relays failed", e)
                        .needing("find", self.documents.namespace())
                })?;
            match stored.as_deref() {
                None => {
                    tracing::warn!(
                        "the group of relays' document is gone (deleted?): writing it anew; \
                         the group runs on"
                    );
                    if self.found_group(now, Retire::OtherCounts).await? {
                        return Ok(());
                    }
                }
                Some(group) if stored_count(group) == Some(self.partitions) => {}
                Some(group) => return Err(self.refusal(stored_count(group))),
            }
        }
        Err(Error::TakenOver(
            "another relay changed the group of relays while this one renewed it".to_owned(),
        ))
    }

    /// Counts this relay as joining again from now, so that the others
    /// make room for it: for one that holds nothing and is not counted.
    pub async fn rejoin(&self) -> Result<()> {
        let now = self.now().await?;
        self.announce(now, Joining::Again).await
    }

    /// Writes this relay's announcement, to expire a lease from `now`.
    async fn announce(&self, now: DateTime, joining: Joining) -> Result<()> {
        let mut fields = doc! {
            "group": &self.outbox,
            "relay": &self.me,
            "expiresAt": later(now, self.timing.duration),
        };
        let mut update = doc! {};
        match joining {
            Joining::Again => {
                fields.insert("joinedAt", now);
            }
            Joining::Not => {
                update.insert("$setOnInsert", doc! { "joinedAt": now });
            }
        }
        update.insert("$set", fields);
        self.documents
            .update_one(doc! { "_id": self.member_id() }, update)
            .upsert(true)
            .await
            .map_err(|e| {
                Error::mongo("announcing this relay to its group failed", e)
                    .needing("update and insert", self.documents.namespace())
            })?;
        Ok(())
    }

    /// Removes this relay's announcement, as it stops.
    pub async fn leave(&self) -> Result<()> {
        self.documents
            .delete_one(doc! { "_id": self.member_id() })
            .await
            .map_err(|e| {
                Error::mongo("leaving the group of relays failed", e)
                    .needing("remove", self.documents.namespace())
            })?;
        Ok(())
    }

    /// Reads the group: the live members, and who holds each partition.
    pub async fn view(&self) -> Result<View> {
        let reading = self.clock.reading().await?;
        let read_at = tokio::time::Instant::now();
        let now = reading.earliest(read_at);
        let failed = |e| {
            Error::mongo("reading the group of relays failed", e)
                .needing("find", self.documents.namespace())
        };
        let leases: BTreeMap<String, Partition> = self
            .partitions()
            .map(|p| (p.document_id(&self.outbox), p))
            .collect();
        let mut ids: Vec<&String> = leases.keys().collect();
        ids.push(&self.outbox);
        let mut documents = self
            .documents
            .find(doc! { "$or": [{ "_id": { "$in": ids } }, { "group": &self.outbox }] })
            .await
            .map_err(failed)?;
        let mut view = View {
            holders: self.partitions().map(|p| (p, Holder::Free)).collect(),
            members: Vec::new(),
            outbox: OutboxLease::Open,
            next_lapse: None,
            lapsed: false,
        };
        let mut holding: BTreeSet<String> = BTreeSet::new();
        let mut members = Vec::new();
        // How long until the first of what this relay does not renew lapses.
        let mut lapses: Option<Duration> = None;
        let mut lapses_in = |left: Duration| lapses = Some(lapses.map_or(left, |l| l.min(left)));
        while let Some(document) = documents.try_next().await.map_err(failed)? {
            let Ok(Some(RawBsonRef::String(id))) = document.get("_id") else {
                continue;
            };
            if let Some(&partition) = leases.get(id) {
                if let Some(holder) = live_holder(&document, now) {
                    if let Some(left) = held_for(&document, now).filter(|_| holder != self.me) {
                        lapses_in(left);
                    }
                    holding.insert(holder.clone());
                    view.holders.insert(partition, Holder::Relay(holder));
                }
            } else if id == self.outbox {
                let ours = StoredHolder::of(&document) == StoredHolder::Group(self.partitions);
                if !ours && is_live(&document, now) {
                    view.outbox = OutboxLease::Taken;
                    if let Some(left) = held_for(&document, now) {
                        lapses_in(left);
                    }
                }
            } else if let Some(member) = live_member(&document, now, self.timing.duration) {
                members.push(member);
            } else {
                view.lapsed |= long_lapsed(&document, now, self.timing.duration);
            }
        }
        // A newcomer counts towards the share while it holds nothing: the
        // share changes when its announcement ends or it stops counting as
        // new. (A holder's announcement ending frees nothing: its leases
        // do, and their expiries are counted above.)
        for member in members.iter().filter(|m| !holding.contains(&m.name)) {
            if let Some(stops_counting) = member.stops_counting {
                if member.name != self.me {
                    lapses_in(member.ends);
                }
                lapses_in(stops_counting);
            }
        }
        view.next_lapse = lapses.map(|left| read_at + left);
        view.members = members
            .into_iter()
            .map(|member| Member {
                counts: member.stops_counting.is_some() || holding.contains(&member.name),
                name: member.name,
            })
            .collect();
        Ok(view)
    }

    /// The refusal of a relay whose count is not the group's (`theirs`,
    /// if it can be read).
    fn refusal(&self, theirs: Option<u32>) -> Error {
        let theirs = theirs.map_or_else(|| "another number".to_owned(), |n| n.to_string());
        Error::Config(format!(
            "the relays on {outbox} run with --partitions {theirs}, and this one was started \
             with --partitions {mine}; start it with --partitions {theirs}, or stop every relay \
             on {outbox} (their announcements end within {lease}) to change the number",
            outbox = self.outbox,
            mine = self.partitions,
            lease = humantime::format_duration(self.timing.duration),
        ))
    }

    fn group_id(&self) -> String {
        format!("{}/group", self.outbox)
    }

    fn member_id(&self) -> String {
        format!("{}/member/{}", self.outbox, self.me)
    }
}

/// What a member's renewal writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// The group's document and the member's announcement: by a member
    /// that holds a partition, or by any while none is held.
    Whole,
    /// The announcement alone: by a member that holds nothing while
    /// another holds a partition, whose lease keeps relays of another
    /// count out as the group's document does (see [`Group::join`]), and
    /// whose member renews the document.
    Announcement,
}

/// Which stored positions a change of the group retires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retire {
    /// Every one: the group takes another count.
    All,
    /// Those of other counts: a group forms where none was recorded.
    OtherCounts,
}

/// The group document's field naming the positions still to be retired.
const RETIRING: &str = "retiring";

impl Retire {
    fn as_str(self) -> &'static str {
        match self {
            Retire::All => "all",
            Retire::OtherCounts => "otherCounts",
        }
    }

    /// What a group document says is still to be retired. A value no relay
    /// writes retires every position: it costs a catch-up, never a loss.
    fn pending(group: &bson::RawDocument) -> Option<Retire> {
        match group.get(RETIRING) {
            Ok(None) => None,
            Ok(Some(RawBsonRef::String("otherCounts"))) => Some(Retire::OtherCounts),
            _ => Some(Retire::All),
        }
    }
}

/// How many times a join waits out leases of another count whose expiry
/// was mended before it refuses.
const MENDS: usize = 2;

/// How long past a mended expiry a join looks again.
const MEND_MARGIN: Duration = Duration::from_millis(100);

/// Whether an announcement says the relay joins now (it counts towards the
/// share for two leases from now) or keeps the time it joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joining {
    Again,
    Not,
}

/// `text` with the characters a regular expression gives meaning to
/// escaped.
fn regex_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if r"\^$.|?*+()[]{}/-".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// Whether a group document is live by the server's clock `now`: a date
/// further ahead than its writer could have set it is not trusted.
fn live_until(document: &bson::RawDocument, now: DateTime) -> bool {
    matches!(
        document.get("expiresAt"),
        Ok(Some(RawBsonRef::DateTime(expires)))
            if expires > now && expires <= later(now, trusted_ahead(document))
    )
}

/// How far ahead of the server's clock a group document's expiry may be
/// and be trusted: twice the lease its writer states with it, or, where it
/// states none for that expiry (a relay of an earlier version renewed it),
/// as far as any relay writes.
fn trusted_ahead(document: &bson::RawDocument) -> Duration {
    let stated_for_it = matches!(
        (document.get("leaseFor"), document.get("expiresAt")),
        (Ok(Some(RawBsonRef::DateTime(stated))), Ok(Some(RawBsonRef::DateTime(expires))))
            if stated == expires
    );
    let stated = match document.get("leaseMillis") {
        Ok(Some(RawBsonRef::Int64(millis))) if stated_for_it => u64::try_from(millis).ok(),
        Ok(Some(RawBsonRef::Int32(millis))) if stated_for_it => u64::try_from(millis).ok(),
        _ => None,
    };
    stated
        .map(Duration::from_millis)
        .filter(|lease| *lease >= Duration::from_secs(1))
        .map_or(FAR_AHEAD, |lease| lease.saturating_mul(2).min(FAR_AHEAD))
}

/// The partition count a group document holds, if it is one a relay runs
/// with.
fn stored_count(document: &bson::RawDocument) -> Option<u32> {
    let count = match document.get("partitions") {
        Ok(Some(RawBsonRef::Int64(n))) => u32::try_from(n).ok(),
        Ok(Some(RawBsonRef::Int32(n))) => u32::try_from(n).ok(),
        _ => None,
    }?;
    (1..=MOST_PARTITIONS).contains(&count).then_some(count)
}

/// The relay holding a partition's lease, if it is live by the server's
/// clock `now`. Anything else (lapsed, released, an expiry further ahead
/// than its holder could have written, or fields no relay writes) is free:
/// a take judges and mends it as a single relay's does.
fn live_holder(document: &RawDocumentBuf, now: DateTime) -> Option<String> {
    match StoredHolder::of(document) {
        StoredHolder::Relay(owner) | StoredHolder::SweepOnce(owner) if is_live(document, now) => {
            Some(owner)
        }
        _ => None,
    }
}

/// A live announcement, as a round reads it.
struct Announced {
    /// The relay's name.
    name: String,
    /// How long until the announcement ends, from the reading.
    ends: Duration,
    /// For a relay that joined within two leases of the reading, which
    /// counts towards the share before it holds a partition: how long
    /// until it no longer does.
    stops_counting: Option<Duration>,
}

/// A live announcement by the server's clock `now`, if `document` is one.
fn live_member(document: &RawDocumentBuf, now: DateTime, lease: Duration) -> Option<Announced> {
    let name = match document.get("relay") {
        Ok(Some(RawBsonRef::String(name))) => name,
        _ => return None,
    };
    let ends = match document.get("expiresAt") {
        Ok(Some(RawBsonRef::DateTime(expires))) if expires > now => until(now, expires),
        _ => return None,
    };
    let new_until = match document.get("joinedAt") {
        Ok(Some(RawBsonRef::DateTime(joined))) => Some(later(joined, lease.saturating_mul(2))),
        _ => None,
    }
    .filter(|until| *until > now);
    Some(Announced {
        name: name.to_owned(),
        ends,
        stops_counting: new_until.map(|at| until(now, at)),
    })
}

/// Whether `document` is an announcement gone for more than a lease by the
/// server's clock `now`.
fn long_lapsed(document: &RawDocumentBuf, now: DateTime, lease: Duration) -> bool {
    matches!(
        document.get("expiresAt"),
        Ok(Some(RawBsonRef::DateTime(expires))) if expires < crate::time::earlier(now, lease)
    ) && matches!(document.get("group"), Ok(Some(RawBsonRef::String(_))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(document: Document) -> RawDocumentBuf {
        RawDocumentBuf::from_document(&document).expect("a document")
    }

    #[test]
    fn a_group_expiry_is_trusted_twice_its_lease_ahead_only_where_stated_for_it() {
        let expires = DateTime::from_millis(1_800_000_000_000);
        let stated = raw(doc! {
            "expiresAt": expires, "leaseMillis": 2_000_i64, "leaseFor": expires,
        });
        assert_eq!(trusted_ahead(&stated), Duration::from_secs(4));
        // Renewed since by a relay that states no lease.
        let renewed = raw(doc! {
            "expiresAt": later(expires, Duration::from_secs(60)),
            "leaseMillis": 2_000_i64, "leaseFor": expires,
        });
        assert_eq!(trusted_ahead(&renewed), FAR_AHEAD);
        assert_eq!(
            trusted_ahead(&raw(doc! { "expiresAt": expires })),
            FAR_AHEAD
        );
    }

    #[test]
    fn what_is_left_to_retire_is_read_from_the_group() {
        let pending = |value: Option<bson::Bson>| {
            let mut group = doc! { "partitions": 4_i64 };
            if let Some(value) = value {
                group.insert(RETIRING, value);
            }
            Retire::pending(&raw(group))
        };
        assert_eq!(pending(None), None);
        assert_eq!(pending(Some("all".into())), Some(Retire::All));
        assert_eq!(
            pending(Some("otherCounts".into())),
            Some(Retire::OtherCounts)
        );
        assert_eq!(
            pending(Some(7.into())),
            Some(Retire::All),
            "a value no relay writes retires all: a catch-up, never a loss"
        );
    }
}
