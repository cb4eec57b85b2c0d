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
//!   group uses, kept alive by every member; a relay with another count
//!   is refused while it lives, so two counts never deliver at once;
//! - `<db>.<collection>/member/<relay>`: `{group, joinedAt, expiresAt}`,
//!   one per relay, renewed as its leases are and removed when it stops;
//! - each partition's lease and checkpoint, as a single relay keeps its
//!   own ([`Partition::document_id`]).
//!
//! Each round a relay renews its announcement, reads the group, and
//! applies one rule ([`balance::moves`]): it takes free partitions up to
//! its share, and hands over gracefully what is above it. Expiries are
//! judged on the server's clock, as the lease's are.

pub mod balance;

use std::collections::BTreeMap;
use std::time::Duration;

use bson::{doc, DateTime, Document, RawBsonRef, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::{Collection, Database};

use crate::error::{is_duplicate_key, Error, Result};
use crate::lease::{server_time, LeaseTiming, FAR_AHEAD};
use crate::partition::{Partition, MOST_PARTITIONS};
use crate::time::later;
use balance::{Holder, Member};

/// One relay's membership in the group of its outbox.
#[derive(Debug, Clone)]
pub struct Group {
    database: Database,
    documents: Collection<RawDocumentBuf>,
    /// `<db>.<collection>`: the outbox's own lease and checkpoint id.
    outbox: String,
    collection: String,
    me: String,
    partitions: u32,
    timing: LeaseTiming,
}

/// The group as one read shows it.
#[derive(Debug, Clone, Default)]
pub struct View {
    pub members: Vec<Member>,
    pub holders: BTreeMap<Partition, Holder>,
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
            collection: collection.to_owned(),
            me: me.to_owned(),
            partitions,
            timing,
        }
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
            .map_err(|e| Error::mongo("reading the group of relays failed", e))?;
        Ok(stored.and_then(|stored| Some((stored_count(&stored)?, live_until(&stored, now)))))
    }

    /// The partitions the group shares.
    pub fn partitions(&self) -> impl Iterator<Item = Partition> {
        Partition::all(self.partitions)
    }

    /// Joins the group, or refuses with a configuration error while relays
    /// of another partition count run: the group's document names a count
    /// and lives while its relays renew it, and a lease of that count that
    /// is still live counts as a running relay too, whatever the document
    /// says. (No group document, as relays from before groups leave, is a
    /// count of 1: the outbox's own lease.) Then announces this relay.
    pub async fn join(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        let stored = self
            .documents
            .find_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| Error::mongo("reading the group of relays failed", e))?;
        let theirs = stored.as_deref().map_or(Some(1), stored_count);
        let ours = theirs == Some(self.partitions);
        if !ours {
            let live = stored.as_deref().is_some_and(|g| live_until(g, now))
                || self.leases_live(theirs.unwrap_or(1), now).await?;
            if live {
                return Err(self.refusal(theirs));
            }
        }
        // Another relay may change it between the read and the take: the
        // join is then judged again at the next try.
        if (!ours || stored.is_none()) && !self.take_group(stored.as_deref(), now).await? {
            return Err(Error::TakenOver(
                "another relay changed the group of relays while this one joined it".to_owned(),
            ));
        }
        self.renew_at(now).await?;
        self.announce(now, Joining::Again).await
    }

    /// Sets the group's count to this relay's, where the group document is
    /// still as read (`stored`, or none): false if another relay changed
    /// it first.
    async fn take_group(&self, stored: Option<&bson::RawDocument>, now: DateTime) -> Result<bool> {
        let fields = doc! {
            "_id": self.group_id(),
            "partitions": i64::from(self.partitions),
            "expiresAt": later(now, self.timing.duration),
        };
        let failed = |e| Error::mongo("joining the group of relays failed", e);
        let Some(stored) = stored else {
            return match self
                .documents
                .clone_with_type::<Document>()
                .insert_one(fields)
                .await
            {
                Ok(_) => Ok(true),
                Err(error) if is_duplicate_key(&error) => Ok(false),
                Err(error) => Err(failed(error)),
            };
        };
        // As read: its count and its expiry, whatever their types.
        let mut unchanged = doc! { "_id": self.group_id() };
        for name in ["partitions", "expiresAt"] {
            let value = match stored.get(name) {
                Ok(Some(value)) => bson::Bson::try_from(value.to_raw_bson()).ok(),
                _ => None,
            };
            unchanged.insert(
                name,
                match value {
                    Some(value) => doc! { "$eq": value },
                    None => doc! { "$exists": false },
                },
            );
        }
        let taken = self
            .documents
            .update_one(unchanged, doc! { "$set": fields })
            .await
            .map_err(failed)?;
        if taken.modified_count > 0 {
            tracing::warn!(
                partitions = self.partitions,
                "no relay of the group's former partition count runs: the group now shares {} \
                 partitions, each starting from what is pending in it",
                self.partitions
            );
        }
        Ok(taken.modified_count > 0)
    }

    /// Whether a lease of the `count` partitions is held now.
    async fn leases_live(&self, count: u32, now: DateTime) -> Result<bool> {
        let ids: Vec<String> = Partition::all(count)
            .map(|p| p.document_id(&self.outbox))
            .collect();
        let mut leases = self
            .documents
            .find(doc! { "_id": { "$in": ids } })
            .await
            .map_err(|e| Error::mongo("reading the group's leases failed", e))?;
        while let Some(lease) = leases
            .try_next()
            .await
            .map_err(|e| Error::mongo("reading the group's leases failed", e))?
        {
            if live_holder(&lease, now).is_some() {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Renews the group's count and this relay's announcement, and clears
    /// the announcements of relays gone for more than a lease. A group
    /// that took another count meanwhile (every relay of this count was
    /// gone) is a configuration error: this relay must stop.
    pub async fn renew(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        self.renew_at(now).await?;
        self.announce(now, Joining::Not).await?;
        self.documents
            .delete_many(doc! {
                "group": &self.outbox,
                "expiresAt": { "$lt": crate::time::earlier(now, self.timing.duration) },
            })
            .await
            .map_err(|e| Error::mongo("clearing lapsed relays from the group failed", e))?;
        Ok(())
    }

    /// Keeps the group's document alive, from `now`, at this count.
    async fn renew_at(&self, now: DateTime) -> Result<()> {
        let kept = self
            .documents
            .update_one(
                doc! { "_id": self.group_id(), "partitions": i64::from(self.partitions) },
                doc! { "$set": { "expiresAt": later(now, self.timing.duration) } },
            )
            .await
            .map_err(|e| Error::mongo("renewing the group of relays failed", e))?;
        if kept.matched_count == 0 {
            let stored = Self::stored(&self.database, self.documents.name(), &self.collection)
                .await
                .ok()
                .flatten();
            return Err(self.refusal(stored.map(|(count, _)| count)));
        }
        Ok(())
    }

    /// Counts this relay as joining again from now, so that the others
    /// make room for it: for one that holds nothing and is not counted.
    pub async fn rejoin(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
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
            .map_err(|e| Error::mongo("announcing this relay to its group failed", e))?;
        Ok(())
    }

    /// Removes this relay's announcement, as it stops.
    pub async fn leave(&self) -> Result<()> {
        self.documents
            .delete_one(doc! { "_id": self.member_id() })
            .await
            .map_err(|e| Error::mongo("leaving the group of relays failed", e))?;
        Ok(())
    }

    /// Reads the group: the live members, and who holds each partition.
    pub async fn view(&self) -> Result<View> {
        let now = server_time(self.database.client()).await?;
        let failed = |e| Error::mongo("reading the group of relays failed", e);
        let ids: Vec<String> = self
            .partitions()
            .map(|p| p.document_id(&self.outbox))
            .collect();
        let mut documents = self
            .documents
            .find(doc! { "$or": [{ "_id": { "$in": &ids } }, { "group": &self.outbox }] })
            .await
            .map_err(failed)?;
        let mut view = View {
            holders: self.partitions().map(|p| (p, Holder::Free)).collect(),
            members: Vec::new(),
        };
        let mut holding: BTreeMap<String, u32> = BTreeMap::new();
        let mut members = Vec::new();
        while let Some(document) = documents.try_next().await.map_err(failed)? {
            let Ok(Some(RawBsonRef::String(id))) = document.get("_id") else {
                continue;
            };
            if let Some(partition) = self
                .partitions()
                .find(|p| p.document_id(&self.outbox) == id)
            {
                if let Some(holder) = live_holder(&document, now) {
                    *holding.entry(holder.clone()).or_default() += 1;
                    view.holders.insert(partition, Holder::Relay(holder));
                }
            } else if let Some(member) = live_member(&document, now, self.timing.duration) {
                members.push(member);
            }
        }
        view.members = members
            .into_iter()
            .map(|(name, new)| Member {
                counts: new || holding.contains_key(&name),
                name,
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

/// Whether an announcement says the relay joins now (it counts towards the
/// share for two leases from now) or keeps the time it joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joining {
    Again,
    Not,
}

/// Whether a group document is live by the server's clock `now`: a date
/// further ahead than any relay writes is not trusted.
fn live_until(document: &bson::RawDocument, now: DateTime) -> bool {
    matches!(
        document.get("expiresAt"),
        Ok(Some(RawBsonRef::DateTime(expires))) if expires > now && expires <= later(now, FAR_AHEAD)
    )
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
/// clock `now`. Anything else (lapsed, released, or fields no relay
/// writes) is free: a take judges and mends it as a single relay's does.
fn live_holder(document: &RawDocumentBuf, now: DateTime) -> Option<String> {
    let owner = match document.get("owner") {
        Ok(Some(RawBsonRef::String(owner))) => owner,
        _ => return None,
    };
    match document.get("expiresAt") {
        // A date further ahead than any relay writes is mended by a take.
        Ok(Some(RawBsonRef::DateTime(expires)))
            if expires > now && expires <= later(now, FAR_AHEAD) =>
        {
            Some(owner.to_owned())
        }
        _ => None,
    }
}

/// A live announcement: the relay's name, and whether it joined within
/// two leases of `now` (it counts towards the share before it holds a
/// partition).
fn live_member(
    document: &RawDocumentBuf,
    now: DateTime,
    lease: Duration,
) -> Option<(String, bool)> {
    let name = match document.get("relay") {
        Ok(Some(RawBsonRef::String(name))) => name,
        _ => return None,
    };
    match document.get("expiresAt") {
        Ok(Some(RawBsonRef::DateTime(expires))) if expires > now => {}
        _ => return None,
    }
    let new = match document.get("joinedAt") {
        Ok(Some(RawBsonRef::DateTime(joined))) => later(joined, lease.saturating_mul(2)) > now,
        _ => false,
    };
    Some((name.to_owned(), new))
}
