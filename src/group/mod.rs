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

use std::collections::{BTreeMap, BTreeSet};
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
    /// of another partition count run. They run while a lease of their
    /// count is live (the outbox's own lease is a count of 1), whatever
    /// the group's document says or whether there is one; and while the
    /// group's document names their count and is live, which covers
    /// relays that have joined and not yet taken a lease. A document of
    /// another count that lapsed is taken only as read, so that of two
    /// relays of different counts starting at once, one joins. Then
    /// announces this relay.
    pub async fn join(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        if let Some(theirs) = self.other_count_leading(now).await? {
            return Err(self.refusal(Some(theirs)));
        }
        let stored = self
            .documents
            .find_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| Error::mongo("reading the group of relays failed", e))?;
        let taken = match stored.as_deref() {
            None => self.found_group(now).await?,
            Some(group) if stored_count(group) == Some(self.partitions) => true,
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

    /// The count of relays leading partitions of another count than this
    /// relay's, if any does: one with a live lease of it. An expiry ahead
    /// of the server's clock is live however far ahead (a clock set back
    /// must not let two counts deliver); one that is not a date is not.
    async fn other_count_leading(&self, now: DateTime) -> Result<Option<u32>> {
        let failed = |e| Error::mongo("reading the group's leases failed", e);
        let ours = format!("^{}(:[0-9]+/[0-9]+)?$", regex_escaped(&self.outbox));
        let mut leases = self
            .documents
            .find(doc! { "_id": { "$regex": ours }, "expiresAt": { "$gt": now } })
            .await
            .map_err(failed)?;
        while let Some(lease) = leases.try_next().await.map_err(failed)? {
            let Ok(Some(RawBsonRef::String(id))) = lease.get("_id") else {
                continue;
            };
            let count = match id.strip_prefix(self.outbox.as_str()) {
                Some("") => Some(1),
                Some(rest) => rest.rsplit('/').next().and_then(|n| n.parse::<u32>().ok()),
                None => None,
            };
            let held = matches!(lease.get("owner"), Ok(Some(RawBsonRef::String(_))));
            match count {
                Some(count) if count != self.partitions && held => return Ok(Some(count)),
                _ => {}
            }
        }
        Ok(None)
    }

    /// Writes the group's document where there is none: false if another
    /// relay wrote one first.
    async fn found_group(&self, now: DateTime) -> Result<bool> {
        let inserted = self
            .documents
            .clone_with_type::<Document>()
            .insert_one(self.group_fields(now))
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(error) if is_duplicate_key(&error) => Ok(false),
            Err(error) => Err(Error::mongo("joining the group of relays failed", error)),
        }
    }

    /// Sets a lapsed group's count to this relay's, where its document is
    /// still as read (`stored`): false if another relay changed it first.
    /// A document whose fields cannot be read is replaced.
    async fn take_group(&self, stored: &bson::RawDocument, now: DateTime) -> Result<bool> {
        let failed = |e| Error::mongo("joining the group of relays failed", e);
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
        let taken = self
            .documents
            .update_one(unchanged, doc! { "$set": self.group_fields(now) })
            .await
            .map_err(failed)?;
        let taken = taken.modified_count > 0;
        if taken {
            tracing::warn!(
                partitions = self.partitions,
                "no relay of the group's former partition count runs: the group now shares {} \
                 partitions, each resuming from its own stored position, if it has one, or from \
                 what is pending in it",
                self.partitions
            );
        }
        Ok(taken)
    }

    /// Replaces a lapsed group document that cannot be read.
    async fn replace_group(&self, now: DateTime) -> Result<bool> {
        tracing::warn!("the group of relays' document cannot be read: it is written anew");
        self.documents
            .delete_one(doc! { "_id": self.group_id() })
            .await
            .map_err(|e| Error::mongo("joining the group of relays failed", e))?;
        self.found_group(now).await
    }

    /// The group's document, as this relay writes it at `now`.
    fn group_fields(&self, now: DateTime) -> Document {
        doc! {
            "_id": self.group_id(),
            "partitions": i64::from(self.partitions),
            "expiresAt": later(now, self.timing.duration),
        }
    }

    /// Renews the group's count and this relay's announcement, and clears
    /// the announcements of relays gone for more than a lease. A group
    /// that took another count meanwhile (every relay of this count was
    /// gone) is a configuration error: this relay must stop.
    pub async fn renew(&self) -> Result<()> {
        let now = server_time(self.database.client()).await?;
        self.renew_at(now).await?;
        self.announce(now, Joining::Not).await?;
        // Tidying only: a relay that may not remove documents still runs.
        let lapsed = doc! {
            "group": &self.outbox,
            "expiresAt": { "$lt": crate::time::earlier(now, self.timing.duration) },
        };
        if let Err(error) = self.documents.delete_many(lapsed).await {
            tracing::debug!(%error, "could not clear lapsed relays from the group");
        }
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
        let leases: BTreeMap<String, Partition> = self
            .partitions()
            .map(|p| (p.document_id(&self.outbox), p))
            .collect();
        let ids: Vec<&String> = leases.keys().collect();
        let mut documents = self
            .documents
            .find(doc! { "$or": [{ "_id": { "$in": ids } }, { "group": &self.outbox }] })
            .await
            .map_err(failed)?;
        let mut view = View {
            holders: self.partitions().map(|p| (p, Holder::Free)).collect(),
            members: Vec::new(),
        };
        let mut holding: BTreeSet<String> = BTreeSet::new();
        let mut members = Vec::new();
        while let Some(document) = documents.try_next().await.map_err(failed)? {
            let Ok(Some(RawBsonRef::String(id))) = document.get("_id") else {
                continue;
            };
            if let Some(&partition) = leases.get(id) {
                if let Some(holder) = live_holder(&document, now) {
                    holding.insert(holder.clone());
                    view.holders.insert(partition, Holder::Relay(holder));
                }
            } else if let Some(member) = live_member(&document, now, self.timing.duration) {
                members.push(member);
            }
        }
        view.members = members
            .into_iter()
            .map(|(name, new)| Member {
                counts: new || holding.contains(&name),
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
