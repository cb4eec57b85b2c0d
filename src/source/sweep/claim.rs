//! Finding a pass's candidates and claiming them.
//!
//! A read takes the candidates of one index range in its order, decoded as
//! they are read and charged to the relay's byte budget at once; the claim
//! is one conditional update of them all, on `lockId`/`lockedAt`, which is
//! the authority on whether a candidate is free. A document no write can
//! change is claimed alone, or goes without a claim (see [`Sweeper::claim`]).

use std::collections::HashSet;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocumentBuf};
use futures::TryStreamExt;

use super::gate::KeyGate;
use super::{raw_id, Sweeper};
use crate::contract::field;
use crate::error::{brief, is_document_error, Error, Result};
use crate::time::{earlier, later};
use crate::work::{id_key, Work};

/// A read of candidates: a query and its sort.
pub(super) type Query = (Document, Document);

/// What a pass's claims took, over all its reads.
#[derive(Debug, Default)]
pub(super) struct Claimed {
    /// The messages to send, each with the pass's claim, or with none if
    /// it cannot take one.
    pub works: Vec<Work>,
    /// Bytes of the messages taken, as the budget counts them.
    pub bytes: usize,
    /// The pass's claim is left on messages it does not send.
    pub left_claimed: bool,
    pub sighted: Sighted,
}

/// What a pass's reads saw, claimed or not.
#[derive(Debug, Default)]
pub(crate) struct Sighted {
    /// The keys of every candidate read.
    pub keys: HashSet<String>,
    /// How far the reads got.
    pub end: ReadEnd,
}

/// How a read ended. In the order of the variants: a pass's reads end
/// where the furthest of them did (any but `Exhausted` may leave more
/// unread; `OutOfRoom` also stops the pass's further reads).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ReadEnd {
    /// Every match was read.
    #[default]
    Exhausted,
    /// A read stopped at its count or byte limit: there may be more.
    AtLimit,
    /// The relay's byte budget had no room for more while the pass held
    /// some: it took all it could.
    OutOfRoom,
}

/// Whose a candidate is once the claim is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    /// This pass's claim holds it.
    Pass,
    /// It cannot take a claim (no write can change it, or its `_id`
    /// cannot be named): it goes without one.
    Unclaimable,
    /// Another claim holds it.
    Another,
}

/// Who holds each candidate of a claim, by the candidate's `_id` key.
#[derive(Debug, Default)]
struct Holders {
    pass: HashSet<String>,
    unclaimable: HashSet<String>,
}

impl Holders {
    fn of(&self, id: &str) -> Holder {
        if self.pass.contains(id) {
            Holder::Pass
        } else if self.unclaimable.contains(id) {
            Holder::Unclaimable
        } else {
            Holder::Another
        }
    }
}

/// What one read's claim took.
#[derive(Debug, Default)]
struct Took {
    works: Vec<Work>,
    /// The claim holds candidates it does not return.
    left_claimed: bool,
}

/// Candidates one read found, before the claim.
struct Candidates {
    works: Vec<Work>,
    end: ReadEnd,
}

impl Sweeper {
    /// Claims from each of `reads` (a query, and whether it is read every
    /// pass rather than when misfits are due), in order, until a batch, or
    /// a batch's bytes, is taken, or the budget has no room.
    pub(super) async fn claim_all(
        &self,
        reads: impl IntoIterator<Item = (Query, bool)>,
        claim: ObjectId,
        gate: &mut KeyGate,
    ) -> Result<Claimed> {
        let now = DateTime::now();
        let mut claimed = Claimed::default();
        for ((filter, sort), always) in reads {
            // Every read and claim of the sweep, of its partition alone.
            let filter = self.pipeline.partition.scope(filter);
            let room = self.batch_size - claimed.works.len();
            let bytes = self.max_pass_bytes.saturating_sub(claimed.bytes);
            let stop = claimed.sighted.end == ReadEnd::OutOfRoom || room == 0 || bytes == 0;
            if stop || !(always || self.misfits_due()) {
                break;
            }
            let holding = claimed.bytes > 0;
            let found = self
                .candidates(&filter, sort, room, bytes, holding, gate)
                .await?;
            claimed.sighted.end = claimed.sighted.end.max(found.end);
            claimed.sighted.keys.extend(
                found
                    .works
                    .iter()
                    .filter_map(|w| work_key(w).map(str::to_owned)),
            );
            let took = self.claim(filter, found.works, claim, now, gate).await?;
            claimed.left_claimed |= took.left_claimed;
            claimed.bytes += took.works.iter().map(Work::size).sum::<usize>();
            claimed.works.extend(took.works);
        }
        Ok(claimed)
    }

    /// Reads up to `limit` documents matching `filter`, in `sort` order, and
    /// about `max_bytes` of them at most (the first always); skips messages
    /// no write can change, and messages the pass leaves to another
    /// pipeline (see [`KeyGate::leaves`]).
    ///
    /// Each is decoded as it is read, its document dropped, and its work
    /// charged to the relay's byte budget at once, so that what a pass
    /// holds is what the budget counts. A pass holding nothing (neither
    /// `holding` from earlier reads nor from this one) waits for room; one
    /// holding some stops reading where the budget has none, as waiting
    /// could wait for its own.
    async fn candidates(
        &self,
        filter: &Document,
        sort: Document,
        limit: usize,
        max_bytes: usize,
        holding: bool,
        gate: &mut KeyGate,
    ) -> Result<Candidates> {
        let unmarkable = &self.pipeline.unmarkable;
        let failed = |e| {
            Error::mongo("sweep: reading due messages failed", e)
                .needing("find", self.pipeline.outbox.namespace())
        };
        let mut cursor = self
            .pipeline
            .outbox
            .clone_with_type::<RawDocumentBuf>()
            .find(filter.clone())
            .sort(sort)
            .limit(i64::try_from(limit + unmarkable.len()).unwrap_or(i64::MAX))
            .await
            .map_err(failed)?;
        let (mut works, mut bytes, mut fetched) = (Vec::new(), 0, 0);
        let mut end = ReadEnd::AtLimit;
        while works.len() < limit && bytes < max_bytes {
            let Some(document) = cursor.try_next().await.map_err(failed)? else {
                end = ReadEnd::Exhausted;
                break;
            };
            fetched += 1;
            let Some(id) = raw_id(&document) else {
                continue;
            };
            let key = document.get_str(field::KEY).ok();
            if unmarkable.contains(&id) || gate.leaves(&self.pipeline.underway, &id, key) {
                continue;
            }
            let mut work = Work::from_sweep(self.rules.decode_raw(&document));
            drop(document);
            let budget = &self.pipeline.budget;
            work.reserved = match holding || !works.is_empty() {
                false => budget.reserve(work.size()).await,
                true => budget.try_reserve(work.size()),
            };
            if work.reserved.is_none() {
                end = ReadEnd::OutOfRoom;
                break;
            }
            bytes += work.size();
            works.push(work);
        }
        // The server's limit counts skipped documents too: reaching it
        // leaves more unread.
        if end == ReadEnd::Exhausted && fetched >= limit + unmarkable.len() {
            end = ReadEnd::AtLimit;
        }
        Ok(Candidates { works, end })
    }

    /// Claims `candidates` (read by `filter`) where no live claim holds
    /// them, and returns those the pass may send, each with its claim. A
    /// document that cannot take a claim (it is at the size limit, say) is
    /// returned without one, so that it is still delivered or failed: the
    /// fences of its completion (pending, unclaimed, its attempts) keep that
    /// safe, and should two processors publish it, JetStream drops the repeat.
    ///
    /// A candidate another claim holds holds its key back (see
    /// [`KeyGate`]); one of a held-back key is not returned, nor kept
    /// claimed: it must not go before that one.
    async fn claim(
        &self,
        filter: Document,
        candidates: Vec<Work>,
        claim: ObjectId,
        now: DateTime,
        gate: &mut KeyGate,
    ) -> Result<Took> {
        if candidates.is_empty() {
            return Ok(Took::default());
        }
        let ids: Vec<Bson> = candidates.iter().filter_map(work_id).cloned().collect();
        // A claim is live only if taken within the lock timeout of now, on
        // either side (clocks differ): a `lockedAt` far in the future, or an
        // array of dates, which no processor wrote, must not hide a message.
        let free = doc! { "$or": [
            { field::LOCKED_AT: { "$exists": false } },
            { field::LOCKED_AT: { "$not": { "$type": "date" } } },
            { field::LOCKED_AT: { "$lt": earlier(now, self.lock_timeout) } },
            { field::LOCKED_AT: { "$gt": later(now, self.lock_timeout) } },
        ] };
        // Beside the read's filter, whatever operators it has at its top.
        let filter = doc! { "$and": [filter, free] };
        let take = doc! { "$set": { field::LOCK_ID: claim, field::LOCKED_AT: now } };
        let holders = self
            .take_claims(&filter, &take, &candidates, ids, claim)
            .await?;
        let mut took = Took::default();
        for mut work in candidates {
            let Some(id) = work_id(&work).map(id_key) else {
                continue;
            };
            let key = work_key(&work);
            let holder = holders.of(&id);
            if gate.holds_back(key) {
                took.left_claimed |= holder == Holder::Pass;
                continue;
            }
            work.claim = match holder {
                Holder::Pass => Some(claim),
                Holder::Unclaimable => None,
                Holder::Another => {
                    gate.hold_back(key);
                    continue;
                }
            };
            took.works.push(work);
        }
        Ok(took)
    }

    /// Writes the claim `take` on the candidates `ids` that `filter` still
    /// matches: all in one update where it can, else one by one. Says who
    /// holds each.
    async fn take_claims(
        &self,
        filter: &Document,
        take: &Document,
        candidates: &[Work],
        ids: Vec<Bson>,
        claim: ObjectId,
    ) -> Result<Holders> {
        // No filter can name an `_id` the driver cannot read: such a
        // document goes without a claim, fenced as it is completed.
        let unnamable: HashSet<String> = candidates
            .iter()
            .filter(|work| unnamable_id(work))
            .filter_map(|work| Some(id_key(work_id(work)?)))
            .collect();
        // Misfit ids (not ObjectIds) are claimed one by one with `$eq`: in
        // an `$in` list a regular expression would match other documents.
        if ids.iter().any(|id| !matches!(id, Bson::ObjectId(_))) {
            return self.claim_each(filter, take, &ids, unnamable, claim).await;
        }
        let mut all = filter.clone();
        all.insert(field::ID, doc! { "$in": &ids });
        match self.pipeline.outbox.update_many(all, take.clone()).await {
            Ok(claimed) if claimed.modified_count == candidates.len() as u64 => Ok(Holders {
                pass: ids.iter().map(id_key).collect(),
                unclaimable: HashSet::new(),
            }),
            Ok(_) => Ok(Holders {
                pass: self.held_by(ids, claim).await?,
                unclaimable: HashSet::new(),
            }),
            Err(e) if is_document_error(&e) => {
                self.claim_each(filter, take, &ids, unnamable, claim).await
            }
            Err(e) => Err(Error::mongo("sweep: claiming messages failed", e)
                .needing("update", self.pipeline.outbox.namespace())),
        }
    }

    /// Claims the candidates one by one (after a claim of them all failed
    /// on a document no write can change, or for misfit ids); `unnamable`
    /// go without a claim.
    ///
    /// A failed claim of them all may have claimed those before the bad
    /// document already (updates stop at the first failure), so a document
    /// that holds this claim counts as claimed.
    async fn claim_each(
        &self,
        filter: &Document,
        take: &Document,
        ids: &[Bson],
        unnamable: HashSet<String>,
        claim: ObjectId,
    ) -> Result<Holders> {
        let mut holders = Holders {
            pass: HashSet::new(),
            unclaimable: unnamable,
        };
        for id in ids {
            if holders.unclaimable.contains(&id_key(id)) {
                continue;
            }
            let mut one = filter.clone();
            one.insert(field::ID, doc! { "$eq": id });
            let held = doc! { field::ID: { "$eq": id }, field::LOCK_ID: claim };
            match self.pipeline.outbox.update_one(one, take.clone()).await {
                Ok(result) if result.modified_count > 0 => {
                    holders.pass.insert(id_key(id));
                }
                Ok(_) => {
                    let holds = self.pipeline.outbox.count_documents(held).await;
                    if holds.map_err(|e| {
                        Error::mongo("sweep: reading claims failed", e)
                            .needing("find", self.pipeline.outbox.namespace())
                    })? > 0
                    {
                        holders.pass.insert(id_key(id));
                    }
                }
                Err(e) if is_document_error(&e) => {
                    tracing::warn!(%id, error = %brief(&e), "outbox message cannot take a claim");
                    holders.unclaimable.insert(id_key(id));
                }
                Err(e) => {
                    return Err(Error::mongo("sweep: claiming messages failed", e)
                        .needing("update", self.pipeline.outbox.namespace()))
                }
            }
        }
        Ok(holders)
    }

    /// The keys of the candidates this claim holds (others took the rest).
    async fn held_by(&self, ids: Vec<Bson>, claim: ObjectId) -> Result<HashSet<String>> {
        let failed = |e| {
            Error::mongo("sweep: reading claims failed", e)
                .needing("find", self.pipeline.outbox.namespace())
        };
        let held: Vec<Document> = self
            .pipeline
            .outbox
            .find(doc! { field::ID: { "$in": ids }, field::LOCK_ID: claim })
            .projection(doc! { field::ID: 1 })
            .await
            .map_err(failed)?
            .try_collect()
            .await
            .map_err(failed)?;
        Ok(held
            .iter()
            .filter_map(|d| d.get(field::ID))
            .map(id_key)
            .collect())
    }
}

/// The `_id` of the message a work carries.
fn work_id(work: &Work) -> Option<&Bson> {
    work.message.as_ref().map(|decoded| &decoded.id)
}

/// Whether the `_id` of the message a work carries cannot be read, so
/// that it stands in (see `unreadable`).
fn unnamable_id(work: &Work) -> bool {
    let stored = work.message.as_ref().and_then(|m| m.stored.as_ref());
    stored.is_some_and(|stored| stored.id.as_ref().is_some_and(|id| !id.readable()))
}

/// The key of the message a work carries, if it is a string.
fn work_key(work: &Work) -> Option<&str> {
    work.message.as_ref()?.key.as_deref()
}
