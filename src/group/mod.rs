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

use bson::{doc, DateTime, RawBsonRef, RawDocumentBuf};
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
        let Some(stored) = stored else {
            return Ok(None);
        };
        let live = matches!(
            stored.get("expiresAt"),
            Ok(Some(RawBsonRef::DateTime(expires))) if expires > now
        );
        Ok(stored_count(&stored).map(|count| (count, live)))
    }

    /// The partitions the group shares.
    pub fn partitions(&self) -> impl Iterator<Item = Partition> {
        Partition::all(self.partitions)
    }

    /// Joins the group, or refuses with a configuration error if it runs
    /// with another partition count. Then renews like [`Group::renew`].
    pub async fn join(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        let until = later(now, self.timing.duration);
        let joined = self
            .documents
            .update_one(
                doc! { "_id": self.group_id(), "$or": [
                    { "partitions": i64::from(self.partitions) },
                    { "expiresAt": { "$not": { "$gt": now } } },
                ] },
                doc! { "$set": { "partitions": i64::from(self.partitions), "expiresAt": until } },
            )
            .upsert(true)
            .await;
        match joined {
            Ok(_) => self.announce(now).await,
            Err(error) if is_duplicate_key(&error) => Err(self.refusal().await),
            Err(error) => Err(Error::mongo("joining the group of relays failed", error)),
        }
    }

    /// Renews the group's count and this relay's announcement. A group
    /// that took another count meanwhile (every member was gone for a
    /// lease) is a configuration error: this relay must stop.
    pub async fn renew(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        let kept = self
            .documents
            .update_one(
                doc! { "_id": self.group_id(), "partitions": i64::from(self.partitions) },
                doc! { "$max": { "expiresAt": later(now, self.timing.duration) } },
            )
            .await
            .map_err(|e| Error::mongo("renewing the group of relays failed", e))?;
        if kept.matched_count == 0 {
            return Err(self.refusal().await);
        }
        self.announce(now).await
    }

    /// Writes this relay's announcement, to expire a lease from `now`.
    async fn announce(&self, now: DateTime) -> Result<()> {
        self.documents
            .update_one(
                doc! { "_id": self.member_id() },
                doc! {
                    "$set": {
                        "group": &self.outbox,
                        "relay": &self.me,
                        "expiresAt": later(now, self.timing.duration),
                    },
                    "$setOnInsert": { "joinedAt": now },
                },
            )
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

    /// The refusal of a relay whose count is not the group's.
    async fn refusal(&self) -> Error {
        let stored = self
            .documents
            .find_one(doc! { "_id": self.group_id() })
            .await
            .ok()
            .flatten();
        let theirs = stored
            .as_deref()
            .and_then(stored_count)
            .map_or_else(|| "another number".to_owned(), |n| n.to_string());
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
