//! The sweep: the slow path that makes the collection, not the stream, the
//! source of truth.
//!
//! Each pass claims a batch of pending messages that are due and not held
//! by a live claim, publishes them, and completes them matching its claim,
//! so a processor that lost a message to another cannot write over its
//! state. Claims are conditional updates on `lockId`/`lockedAt`; a claim
//! older than the lock timeout is stale and may be taken over. Passes run
//! one after another in a single task, never two at once; a pass that comes
//! back full is followed at once by the next, so a backlog drains without
//! waiting for the interval.
//!
//! A pass looks in two places, each an index range on
//! `{status, nextAttemptAt, _id}` read in the index's order: messages never
//! tried (`nextAttemptAt` missing) created a grace period before what the
//! change stream has read (see `progress`), which leaves the stream time to
//! deliver them first, however far behind it runs in a drain; and messages
//! whose retry is due. While a catch-up pass is delivering, a pass reads
//! nothing: the catch-up pass has every due message. A pass with room left also looks for misfits, pending
//! documents whose fields put them in neither range, at most once a minute. The read names only indexed fields, so any planner
//! serves it from the index; whether a candidate is free (unclaimed, or
//! claimed longer ago than the lock timeout) is decided by the claim's
//! conditional update, which is the authority anyway.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::{doc, oid::ObjectId, Bson, DateTime, Document, RawDocumentBuf};
use futures::TryStreamExt;
use tokio_util::sync::CancellationToken;

use crate::config::DeadLetters;
use crate::contract::{field, status, DecodeRules, Decoded};
use crate::error::{brief, is_document_error, Error, Result};
use crate::order::{held_keys, stored::parked_messages, KeyOrder, Parks, PARKED};
use crate::pipeline::Pipeline;
use crate::retry::Outage;
use crate::time::{earlier, later, object_id_at};
use crate::unreadable::RawField;
use crate::work::{id_key, Tally, Work};

use super::progress::{StreamProgress, SweepScope};

/// Runs sweep passes over one outbox collection.
#[derive(Clone)]
pub struct Sweeper {
    pub(crate) rules: DecodeRules,
    pub(crate) pipeline: Pipeline,
    pub(crate) batch_size: usize,
    pub(crate) lock_timeout: Duration,
    /// Never-tried messages younger than this are left to the change stream.
    pub(crate) grace_period: Duration,
    /// How far the change stream has read: the grace runs from there.
    pub(crate) progress: StreamProgress,
    /// The most bytes of documents one pass reads.
    pub(crate) max_pass_bytes: usize,
    /// When the sweep last looked for misfits.
    pub(crate) misfits_read: Arc<Mutex<Option<Instant>>>,
    /// When the sweep last read the held keys back.
    pub(crate) holds_read: Arc<Mutex<Option<Instant>>>,
    /// How often it reads them back, for a hold written out of the term's
    /// sight (a former leader's write that landed late).
    pub(crate) holds_interval: Duration,
    /// Whether dead letters hold their keys, for reading holds back.
    pub(crate) dead_letters: DeadLetters,
    /// Whether a former leader's claims are cleared (see
    /// [`Sweeper::clear_claims`]): done before this term's first claim.
    pub(crate) claims_cleared: Arc<AtomicBool>,
}

/// How often a sweep with room to spare looks for misfits: documents a
/// writer's bug put outside both index ranges are rare, and finding them
/// costs a scan of every pending entry.
pub const MISFIT_INTERVAL: Duration = Duration::from_secs(60);

/// The most keys one release reads, and the most holders one read checks.
const RELEASE_KEYS: usize = 1000;

/// The most bytes of keys one release names, so that its query stays far
/// below MongoDB's 16 MiB, however long the keys.
const RELEASE_KEY_BYTES: usize = 1 << 20;

/// The releasing keys one read names: as many as fit [`RELEASE_KEY_BYTES`],
/// and always the first.
fn release_batch(mut releasing: Vec<(String, Parks)>) -> Vec<(String, Parks)> {
    let mut bytes = 0;
    let fits = releasing
        .iter()
        .take_while(|(key, _)| {
            bytes += key.len();
            bytes <= RELEASE_KEY_BYTES
        })
        .count();
    releasing.truncate(fits.max(1));
    releasing
}

/// What a pass's reads found, besides the documents it claimed.
#[derive(Debug, Default)]
pub(crate) struct Read {
    /// The keys of every candidate read, claimed or not.
    keys: HashSet<String>,
    /// Keys of which an earlier message read is not this pass's to send
    /// (another claim holds it, or another pipeline has it under way): the
    /// pass sends no later message of them.
    blocked: HashSet<String>,
    /// A read stopped at its limit: there may be more than it found.
    truncated: bool,
    /// This pass's claim is left on documents it did not complete.
    left_claimed: bool,
    /// Bytes of the messages claimed, as the budget counts them.
    bytes: usize,
    /// A read stopped because the relay's byte budget had no room for
    /// more while the pass held some: it took all it could.
    out_of_room: bool,
    /// The pass reads parked messages back to release their keys: those
    /// go first by their key's own rules, whatever else of the key is
    /// under way (the newer messages that will be parked behind them).
    release: bool,
}

/// The result of one pass.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// What became of the claimed messages.
    pub tally: Tally,
    /// How many messages the pass claimed.
    pub claimed: u64,
    /// The pass claimed a whole batch (or its bytes' worth): more may be waiting.
    pub full: bool,
}

impl Sweeper {
    /// Runs passes until shutdown: at once again after a full pass, else
    /// after `interval` or as soon as a key starts releasing. After each
    /// pass it tends the held keys (see [`Sweeper::tend_keys`]).
    pub(crate) async fn run(self, interval: Duration, shutdown: CancellationToken) {
        let mut outage = Outage::new("MongoDB sweep");
        while !shutdown.is_cancelled() {
            let full = match self.pass_and_tend().await {
                Ok(pass) => {
                    outage.recovered();
                    if pass.claimed > 0 {
                        tracing::debug!(?pass, "sweep pass");
                    }
                    pass.full
                }
                Err(error) => {
                    outage.failed(&error);
                    false
                }
            };
            if !full {
                let order = self.pipeline.order.clone();
                let release_wanted = async move {
                    match order {
                        Some(order) => order.release_wanted().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(interval) => {}
                    _ = release_wanted => {}
                }
            }
        }
    }

    /// Passes until one comes back short of a full batch: everything due now
    /// is handled. For `outbox-relay sweep --once`.
    pub async fn drain(&self) -> Result<Tally> {
        let mut tally = Tally::default();
        loop {
            let pass = self.pass_and_tend().await?;
            tally += pass.tally;
            if !pass.full {
                return Ok(tally);
            }
        }
    }

    /// One pass, then the held keys tended; full if either left work for
    /// the next at once.
    async fn pass_and_tend(&self) -> Result<Pass> {
        let mut pass = self.pass().await?;
        let (released, more) = self.tend_keys().await?;
        pass.tally += released;
        pass.full |= more;
        Ok(pass)
    }

    /// One pass: claim, publish, complete, release what was not completed.
    pub async fn pass(&self) -> Result<Pass> {
        let now = DateTime::now();
        let never_tried_before = match self.progress.scope(now, self.grace_period) {
            SweepScope::Nothing => return Ok(Pass::default()),
            SweepScope::RetriesOnly => None,
            SweepScope::Before(before) => Some(before),
        };
        // ObjectIds count whole seconds, so a bound at now would hold back
        // the current second's messages even with no grace at all.
        let bound = never_tried_before.filter(|before| *before < now);
        let [never_tried, retry_due, misfits] = candidate_queries(now, bound);
        let mut reads = vec![(retry_due, true), (misfits, false)];
        if never_tried_before.is_some() {
            reads.insert(0, (never_tried, true));
        }
        Ok(self.pass_over(reads, false).await?.0)
    }

    /// A pass over `reads` (each a query, and whether it is read every
    /// pass rather than when misfits are due), in order, until a batch is
    /// claimed. `release` marks parked messages read back to release their
    /// keys. Returns the pass, and what its reads found.
    async fn pass_over(
        &self,
        reads: impl IntoIterator<Item = ((Document, Document), bool)>,
        release: bool,
    ) -> Result<(Pass, Read)> {
        self.clear_claims_once().await?;
        let claim = ObjectId::new();
        let mut read = Read {
            release,
            ..Read::default()
        };
        let claimed = self.claim_all(reads, claim, &mut read).await;
        let outcome = match claimed {
            Ok(documents) => self.deliver(documents, release, &mut read).await,
            Err(error) => Err(error),
        };
        // A pass cut short by an error leaves claims that would hide the
        // messages (and hold back the rest of their keys) until they go
        // stale: give them back.
        if outcome.is_err() || read.left_claimed {
            self.release(claim).await?;
        }
        outcome.map(|pass| (pass, read))
    }

    /// Claims from each of `reads` (a query, and whether it is read every
    /// pass rather than when misfits are due), in order, until a batch.
    async fn claim_all(
        &self,
        reads: impl IntoIterator<Item = ((Document, Document), bool)>,
        claim: ObjectId,
        read: &mut Read,
    ) -> Result<Vec<Work>> {
        let now = DateTime::now();
        let mut works = Vec::new();
        for (query, always) in reads {
            let room = self.batch_size - works.len();
            let bytes = self.max_pass_bytes.saturating_sub(read.bytes);
            if room == 0 || bytes == 0 || read.out_of_room || !(always || self.misfits_due()) {
                break;
            }
            let claimed = self.claim(query, claim, now, room, bytes, read).await?;
            read.bytes += claimed.iter().map(Work::size).sum::<usize>();
            works.extend(claimed);
        }
        Ok(works)
    }

    /// Publishes and completes what a pass claimed.
    async fn deliver(&self, works: Vec<Work>, release: bool, read: &mut Read) -> Result<Pass> {
        let read_count = works.len();
        let claimed = read_count as u64;
        if claimed == 0 {
            return Ok(Pass::default());
        }
        let running = self.pipeline.start(None);
        let mut left = 0;
        let mut own_keys = HashSet::new();
        for mut work in works {
            let Some(decoded) = &work.message else {
                continue;
            };
            if self.taken_meanwhile(decoded, &mut own_keys, read) {
                // Should this fail, the pass's release below covers it.
                if let Err(error) = self.release_one(&decoded.id, work.claim).await {
                    tracing::debug!(%error, "could not give back one claim at once");
                    read.left_claimed = true;
                }
                left += 1;
                continue;
            }
            work.release = release;
            if running.input.send(work).await.is_err() {
                break;
            }
        }
        drop(running.input);
        // What the pass took on: what it claimed, less what it left to
        // other pipelines.
        let claimed = claimed - left;
        let tally = running
            .done
            .await
            .map_err(|e| Error::Internal(format!("a sweep pass stopped unexpectedly: {e}")))?;
        read.left_claimed |= tally.total() < claimed;
        // Only a pass that finished what it claimed may be followed at once:
        // one that was cut short (a stop, a broker that takes nothing) would
        // otherwise claim and release the same messages in a tight loop.
        let whole =
            read_count == self.batch_size || read.bytes >= self.max_pass_bytes || read.out_of_room;
        Ok(Pass {
            tally,
            claimed,
            full: whole && tally.total() == claimed,
        })
    }

    /// Whether another pipeline took up `message`, or a message of its key,
    /// since the pass read it: then the pass leaves it, and the rest of its
    /// key, to that pipeline. `own_keys` are the keys this pass has sent
    /// messages of already, which it goes on with.
    fn taken_meanwhile(
        &self,
        message: &Decoded,
        own_keys: &mut HashSet<String>,
        read: &mut Read,
    ) -> bool {
        let key = message.key.as_deref();
        if read.release {
            return false;
        }
        if key.is_some_and(|key| read.blocked.contains(key)) {
            return true;
        }
        if key.is_some_and(|key| own_keys.contains(key)) {
            return false;
        }
        if self.pipeline.underway.ahead(&message.id, key) {
            read.blocked.extend(key.map(str::to_owned));
            return true;
        }
        own_keys.extend(key.map(str::to_owned));
        false
    }

    /// Tends the keys the term's order holds: takes on holds written out of
    /// its sight (now and then), lets go of keys whose holder was settled
    /// out of its sight, then releases one read's worth of the parked
    /// messages of releasing keys, in `_id` order. Returns what the release
    /// did, and whether another may find more; one read at a time, so that
    /// a long release never keeps the sweep's own passes waiting.
    pub(crate) async fn tend_keys(&self) -> Result<(Tally, bool)> {
        let Some(order) = &self.pipeline.order else {
            return Ok((Tally::default(), false));
        };
        if self.reconcile_due() {
            let held = held_keys(&self.pipeline.outbox, self.dead_letters).await?;
            let adopted = order.adopt(held);
            if adopted > 0 {
                tracing::warn!(
                    keys = adopted,
                    "found held keys this relay did not know of; holding them"
                );
            }
        }
        self.check_holders(order).await?;
        let releasing = release_batch(order.releasing(RELEASE_KEYS));
        if releasing.is_empty() || self.pipeline.shutdown.is_cancelled() {
            return Ok((Tally::default(), false));
        }
        let names: Vec<String> = releasing.iter().map(|(key, _)| key.clone()).collect();
        let (pass, read) = self
            .pass_over([(parked_messages(&names), true)], true)
            .await?;
        // A key is free once a read that left nothing unread found no
        // parked message of it.
        let mut freed = false;
        if !read.truncated {
            for (key, before) in releasing.iter().filter(|(key, _)| !read.keys.contains(key)) {
                freed |= order.released(key, *before);
            }
        }
        Ok((pass.tally, pass.tally.delivered > 0 || freed))
    }

    /// Lets go of keys whose holder is no longer what holds them: delivered
    /// or failed by another processor, replayed, discarded, or a document no
    /// write can change. A failed holder keeps its key only if it is marked
    /// `holdsKey` and dead letters hold their keys.
    async fn check_holders(&self, order: &KeyOrder) -> Result<()> {
        let failed = |e| Error::mongo("sweep: reading the messages holding keys failed", e);
        for holders in order.holders().chunks(RELEASE_KEYS) {
            let ids: Vec<&Bson> = holders.iter().map(|(_, id, _)| id).collect();
            // As stored: a field the driver cannot read fails one holder's
            // check (it no longer holds), not the read.
            let found: Vec<RawDocumentBuf> = self
                .pipeline
                .outbox
                .clone_with_type::<RawDocumentBuf>()
                .find(doc! { field::ID: { "$in": ids } })
                .projection(
                    doc! { field::STATUS: 1, field::HOLDS_KEY: 1, field::NEXT_ATTEMPT_AT: 1 },
                )
                .await
                .map_err(failed)?
                .try_collect()
                .await
                .map_err(failed)?;
            let states: HashMap<String, &RawDocumentBuf> = found
                .iter()
                .filter_map(|d| Some((id_key(&raw_id(d)?), d)))
                .collect();
            for (key, id, version) in holders {
                let holds = states.get(&id_key(id)).is_some_and(|document| {
                    match document.get_str(field::STATUS).unwrap_or_default() {
                        // Parked, it waits behind its key rather than holds it.
                        status::PENDING => {
                            !self.pipeline.unmarkable.contains(id)
                                && document.get_datetime(field::NEXT_ATTEMPT_AT) != Ok(PARKED)
                        }
                        status::FAILED => {
                            order.dead_letters_hold()
                                && document.get_bool(field::HOLDS_KEY).unwrap_or(false)
                        }
                        _ => false,
                    }
                });
                if !holds {
                    order.let_go_of(key, id, *version);
                }
            }
        }
        Ok(())
    }

    /// The misfit read, if it is due: at most once per [`MISFIT_INTERVAL`],
    /// since no index range can serve it (it scans every pending entry).
    fn misfits_due(&self) -> bool {
        due(&self.misfits_read, MISFIT_INTERVAL)
    }

    /// Waits until the term's stored holds are taken on; false if the
    /// term ended first. The next reading of them is then an interval
    /// away. A stream source kept waiting for them until now (its pipeline
    /// sends nothing before) counts as moving from now: the wait is not a
    /// stall of its own, and the sweep must not take the never-tried
    /// messages the source is about to deliver.
    pub(crate) async fn await_stored_holds(&self, shutdown: &CancellationToken) -> bool {
        let Some(order) = &self.pipeline.order else {
            return true;
        };
        let kept_waiting = !order.stored_holds_adopted();
        if !order.stored_holds_before(shutdown.cancelled()).await {
            return false;
        }
        if let Ok(mut read) = self.holds_read.lock() {
            *read = Some(Instant::now());
        }
        if kept_waiting {
            self.progress.waited();
        }
        true
    }

    /// Reading the held keys back, if it is due: once per holds interval
    /// (a term starts having read them).
    fn reconcile_due(&self) -> bool {
        due(&self.holds_read, self.holds_interval)
    }

    /// Reads up to `limit` documents matching `filter`, in `sort` order, and
    /// about `max_bytes` of them at most (the first always); skips messages
    /// no write can change, and messages under way.
    ///
    /// Each is decoded as it is read, its document dropped, and its work
    /// charged to the relay's byte budget at once, so that what a pass
    /// holds is what the budget counts. A pass holding nothing waits for
    /// room; one holding some stops reading where the budget has none, as
    /// waiting could wait for its own.
    async fn candidates(
        &self,
        filter: &Document,
        sort: Document,
        limit: usize,
        max_bytes: usize,
        read: &mut Read,
    ) -> Result<Vec<Work>> {
        let unmarkable = &self.pipeline.unmarkable;
        let failed = |e| Error::mongo("sweep: reading due messages failed", e);
        let mut cursor = self
            .pipeline
            .outbox
            .clone_with_type::<RawDocumentBuf>()
            .find(filter.clone())
            .sort(sort)
            .limit(i64::try_from(limit + unmarkable.len()).unwrap_or(i64::MAX))
            .await
            .map_err(failed)?;
        let (mut candidates, mut bytes, mut fetched) = (Vec::new(), 0, 0);
        let mut exhausted = false;
        while candidates.len() < limit && bytes < max_bytes {
            let Some(document) = cursor.try_next().await.map_err(failed)? else {
                exhausted = true;
                break;
            };
            fetched += 1;
            let Some(id) = raw_id(&document) else {
                continue;
            };
            if unmarkable.contains(&id) {
                continue;
            }
            // Under way in another pipeline, or of a key that has a message
            // under way there (the stream's, say, in a drain): that
            // pipeline's to send, and before any later message of the key.
            let key = document.get_str(field::KEY).ok();
            if !read.release && self.pipeline.underway.ahead(&id, key) {
                read.blocked.extend(key.map(str::to_owned));
                continue;
            }
            let mut work = Work::from_collection(self.rules.decode_raw(&document), None);
            drop(document);
            let holding = read.bytes > 0 || !candidates.is_empty();
            let budget = &self.pipeline.budget;
            work.reserved = match holding {
                false => budget.reserve(work.size()).await,
                true => budget.try_reserve(work.size()),
            };
            if work.reserved.is_none() {
                read.out_of_room = true;
                break;
            }
            bytes += work.size();
            candidates.push(work);
        }
        // The server's limit counts skipped documents too: reaching it
        // leaves more unread.
        read.truncated |= read.out_of_room || !exhausted || fetched >= limit + unmarkable.len();
        read.keys.extend(
            candidates
                .iter()
                .filter_map(|work| work_key(work).map(str::to_owned)),
        );
        Ok(candidates)
    }

    /// Claims up to `limit` documents matching `filter` that no live claim
    /// holds, and returns those this claim got, each with its claim. A
    /// document that cannot take a claim (it is at the size limit, say) is
    /// returned without one, so that it is still delivered or failed: the
    /// fences of its completion (pending, unclaimed, its attempts) keep that
    /// safe, and should two processors publish it, JetStream drops the repeat.
    ///
    /// A message of a key whose earlier message in this pass is held by
    /// another claim or under way is not returned (nor kept claimed): it
    /// must not go before that one.
    async fn claim(
        &self,
        (mut filter, sort): (Document, Document),
        claim: ObjectId,
        now: DateTime,
        limit: usize,
        max_bytes: usize,
        read: &mut Read,
    ) -> Result<Vec<Work>> {
        let candidates = self
            .candidates(&filter, sort, limit, max_bytes, read)
            .await?;
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Bson> = candidates.iter().filter_map(work_id).cloned().collect();
        // No filter can name an `_id` the driver cannot read: such a
        // document goes without a claim, fenced as it is completed.
        let unnamable: HashSet<String> = candidates
            .iter()
            .filter(|work| unnamable_id(work))
            .filter_map(|work| Some(id_key(work_id(work)?)))
            .collect();
        // A claim is live only if taken within the lock timeout of now, on
        // either side (clocks differ): a `lockedAt` far in the future, or an
        // array of dates, which no processor wrote, must not hide a message.
        let free = doc! { "$or": [
            { field::LOCKED_AT: { "$exists": false } },
            { field::LOCKED_AT: { "$not": { "$type": "date" } } },
            { field::LOCKED_AT: { "$lt": earlier(now, self.lock_timeout) } },
            { field::LOCKED_AT: { "$gt": later(now, self.lock_timeout) } },
        ] };
        filter.insert("$and", vec![free]);
        let take = doc! { "$set": { field::LOCK_ID: claim, field::LOCKED_AT: now } };
        let mut all = filter.clone();
        all.insert(field::ID, doc! { "$in": &ids });
        // Misfit ids (not ObjectIds) are claimed one by one with `$eq`: in
        // an `$in` list a regular expression would match other documents.
        let misfit = ids.iter().any(|id| !matches!(id, Bson::ObjectId(_)));
        let batch = if misfit {
            None
        } else {
            Some(self.pipeline.outbox.update_many(all, take.clone()).await)
        };
        let (ours, unclaimable) = match batch {
            Some(Ok(claimed)) if claimed.modified_count == candidates.len() as u64 => {
                (ids.iter().map(id_key).collect(), HashSet::new())
            }
            Some(Ok(_)) => (self.held_by(ids, claim).await?, HashSet::new()),
            Some(Err(e)) if !is_document_error(&e) => {
                return Err(Error::mongo("sweep: claiming messages failed", e));
            }
            Some(Err(_)) | None => {
                self.claim_each(&filter, &take, &ids, &unnamable, claim)
                    .await?
            }
        };
        Ok(candidates
            .into_iter()
            .filter_map(|mut work| {
                let id = id_key(work_id(&work)?);
                let message_key = work_key(&work).map(str::to_owned);
                if message_key
                    .as_ref()
                    .is_some_and(|k| read.blocked.contains(k))
                {
                    read.left_claimed |= ours.contains(&id);
                    return None;
                }
                match (ours.contains(&id), unclaimable.contains(&id)) {
                    (true, _) => work.claim = Some(claim),
                    (false, true) => work.claim = None,
                    (false, false) => {
                        read.blocked.extend(message_key);
                        return None;
                    }
                }
                Some(work)
            })
            .collect())
    }

    /// Claims the candidates one by one (after a claim of them all failed
    /// on a document no write can change, or for misfit ids). Returns the
    /// keys of those claimed, and of those that cannot take a claim.
    ///
    /// A failed claim of them all may have claimed those before the bad
    /// document already (updates stop at the first failure), so a document
    /// that holds this claim counts as claimed.
    async fn claim_each(
        &self,
        filter: &Document,
        take: &Document,
        ids: &[Bson],
        unnamable: &HashSet<String>,
        claim: ObjectId,
    ) -> Result<(HashSet<String>, HashSet<String>)> {
        let (mut claimed, mut unclaimable) = (HashSet::new(), unnamable.clone());
        for id in ids.iter().filter(|id| !unnamable.contains(&id_key(id))) {
            let mut one = filter.clone();
            one.insert(field::ID, doc! { "$eq": id });
            let held = doc! { field::ID: { "$eq": id }, field::LOCK_ID: claim };
            match self.pipeline.outbox.update_one(one, take.clone()).await {
                Ok(result) if result.modified_count > 0 => {
                    claimed.insert(id_key(id));
                }
                Ok(_) => {
                    let holds = self.pipeline.outbox.count_documents(held).await;
                    if holds.map_err(|e| Error::mongo("sweep: reading claims failed", e))? > 0 {
                        claimed.insert(id_key(id));
                    }
                }
                Err(e) if is_document_error(&e) => {
                    tracing::warn!(%id, error = %brief(&e), "outbox message cannot take a claim");
                    unclaimable.insert(id_key(id));
                }
                Err(e) => return Err(Error::mongo("sweep: claiming messages failed", e)),
            }
        }
        Ok((claimed, unclaimable))
    }

    /// The keys of the candidates this claim holds (others took the rest).
    async fn held_by(&self, ids: Vec<Bson>, claim: ObjectId) -> Result<HashSet<String>> {
        let failed = |e| Error::mongo("sweep: reading claims failed", e);
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

    /// Clears a former leader's claims, unless this term has: called
    /// before each claim, so the clearing waits for the sweep's first
    /// claim rather than running at a new leader's start. It reads every
    /// pending message (no index holds the claim); only the sweep's claims
    /// need it gone (the term's other verdicts match a message whatever a
    /// former leader's claim on it, see `complete::fate`), and while a
    /// catch-up pass delivers a backlog the sweep reads nothing, so the
    /// clearing waits for the pass unless a held key is released
    /// meanwhile.
    async fn clear_claims_once(&self) -> Result<()> {
        if !self.claims_cleared.load(Ordering::Acquire) {
            self.clear_claims().await?;
        }
        Ok(())
    }

    /// Drops every claim on pending messages. Only the lease holder claims,
    /// so before a term's first claim, every claim there is belongs to a
    /// relay that has stopped (its lease ended before this one began); left alone,
    /// each would hide its message, and hold back the rest of its key,
    /// for up to the lock timeout.
    async fn clear_claims(&self) -> Result<()> {
        self.pipeline
            .outbox
            .update_many(
                doc! { field::STATUS: status::PENDING, field::LOCK_ID: { "$exists": true } },
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| Error::mongo("sweep: clearing a former leader's claims failed", e))?;
        self.claims_cleared.store(true, Ordering::Release);
        Ok(())
    }

    /// Drops this claim from one message the pass leaves to another
    /// pipeline, at once: that pipeline's verdict on it must not find it
    /// claimed.
    async fn release_one(&self, id: &Bson, claim: Option<ObjectId>) -> Result<()> {
        let Some(claim) = claim else {
            return Ok(());
        };
        self.pipeline
            .outbox
            .update_one(
                doc! { field::ID: { "$eq": id }, field::LOCK_ID: claim, field::STATUS: status::PENDING },
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| Error::mongo("sweep: releasing claims failed", e))?;
        Ok(())
    }

    /// Drops this claim from messages it did not complete (the broker was
    /// down at shutdown), so others need not wait for the lock timeout.
    async fn release(&self, claim: ObjectId) -> Result<()> {
        self.pipeline
            .outbox
            .update_many(
                doc! { field::LOCK_ID: claim, field::STATUS: status::PENDING },
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| Error::mongo("sweep: releasing claims failed", e))?;
        Ok(())
    }
}

/// The sweep's candidate reads, as `(filter, sort)`, in the order a pass
/// takes them: never-tried messages created before `never_tried_before`
/// (all of them without it), then retries
/// due at `now`, each a range of the sweep index sorted in its order; then,
/// with room left, misfits that neither range can find (an `_id` that is not
/// an ObjectId, a `nextAttemptAt` that is not a date), so that whatever a
/// writer put in a pending document, it is delivered or failed.
pub fn candidate_queries(
    now: DateTime,
    never_tried_before: Option<DateTime>,
) -> [(Document, Document); 3] {
    let mut never_tried = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: Bson::Null,
    };
    if let Some(before) = never_tried_before {
        never_tried.insert(field::ID, doc! { "$lt": object_id_at(before) });
    }
    let retry_due = doc! {
        field::STATUS: status::PENDING,
        field::NEXT_ATTEMPT_AT: { "$lte": now },
    };
    let order = doc! { field::STATUS: 1, field::NEXT_ATTEMPT_AT: 1, field::ID: 1 };
    [
        (never_tried, order.clone()),
        (retry_due, order.clone()),
        (misfits(), order),
    ]
}

/// Pending documents the index ranges cannot find.
pub(crate) fn misfits() -> Document {
    doc! {
        field::STATUS: status::PENDING,
        "$or": [
            { field::ID: { "$not": { "$type": "objectId" } } },
            { field::NEXT_ATTEMPT_AT: { "$exists": true, "$not": { "$type": ["date", "null"] } } },
        ],
    }
}

/// Whether `interval` has passed since `last` (or it never was), which it
/// then sets to now.
fn due(last: &Mutex<Option<Instant>>, interval: Duration) -> bool {
    let Ok(mut last) = last.lock() else {
        return false;
    };
    if last.is_some_and(|at| at.elapsed() < interval) {
        return false;
    }
    *last = Some(Instant::now());
    true
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

/// A document's `_id`, whatever its type; one the driver cannot read (a
/// string that is not UTF-8) as its stand-in (see `unreadable`).
fn raw_id(document: &RawDocumentBuf) -> Option<Bson> {
    let readable = document.get(field::ID).ok().flatten();
    if let Some(id) = readable.and_then(|id| Bson::try_from(id.to_raw_bson()).ok()) {
        return Some(id);
    }
    RawField::of(document, field::ID).map(|id| id.stand_in())
}

#[cfg(test)]
mod tests {
    use bson::Binary;
    use tokio::time::timeout;

    use super::*;
    use crate::config::RelayConfig;
    use crate::contract::SubjectRules;
    use crate::observe::Metrics;
    use crate::work::{Budget, LastDelivery, Underway, Unmarkable};

    /// A sweeper over `outbox` whose messages go to a broker that takes
    /// them all, sharing `budget` with whatever else holds it.
    fn sweeper(
        outbox: mongodb::Collection<Document>,
        budget: Budget,
        max_pass_bytes: usize,
    ) -> Sweeper {
        let config = RelayConfig::new("mongodb://unused", "unused");
        let pipeline = Pipeline {
            publisher: Arc::new(crate::testing::TakesAll),
            outbox,
            max_in_flight: 16,
            batch_size: 100,
            checkpoint_interval: Duration::from_secs(1),
            mark_delay: Duration::ZERO,
            retry: config.retry(),
            metrics: Metrics::new(),
            unmarkable: Unmarkable::default(),
            budget,
            underway: Underway::default(),
            deliveries: LastDelivery::default(),
            order: None,
            claims_before: None,
            term: None,
            acknowledged: Default::default(),
            shutdown: CancellationToken::new(),
            abandon: CancellationToken::new(),
        };
        Sweeper {
            rules: DecodeRules::new(SubjectRules::anything_unreserved(), usize::MAX),
            pipeline,
            batch_size: 100,
            lock_timeout: Duration::from_secs(60),
            grace_period: Duration::ZERO,
            progress: StreamProgress::without_stream(),
            max_pass_bytes,
            misfits_read: Arc::default(),
            holds_read: Arc::default(),
            holds_interval: Duration::from_secs(60),
            dead_letters: DeadLetters::Release,
            claims_cleared: Arc::default(),
        }
    }

    #[tokio::test]
    async fn a_pass_holds_no_more_than_the_budget_has_room_for() {
        let database = crate::testing::database().await;
        let outbox = database.collection::<Document>("outbox");
        const KIB: usize = 1024;
        let payload = Binary {
            subtype: bson::spec::BinarySubtype::Generic,
            bytes: vec![7; 200 * KIB],
        };
        let messages: Vec<Document> = (0..8)
            .map(|_| doc! { "_id": ObjectId::new(), "type": "t", "status": "pending", "payload": payload.clone() })
            .collect();
        outbox.insert_many(messages).await.expect("insert");
        // The relay's budget is 1 MiB, of which something else (the
        // stream's pipeline, say) holds all but 300 KiB: room for one.
        let budget = Budget::new(1024 * 1024);
        let elsewhere = budget.reserve(1024 * 1024 - 300 * KIB).await.expect("held");
        let sweeper = sweeper(outbox.clone(), budget, 1024 * 1024);

        let pass = timeout(Duration::from_secs(30), sweeper.pass())
            .await
            .expect("a pass does not wait for room it holds itself")
            .expect("a pass");
        assert_eq!(pass.claimed, 1, "one fits beside what is held elsewhere");
        assert_eq!(pass.tally.delivered, 1);
        assert!(
            pass.full,
            "it took all it could: the next pass comes at once"
        );

        drop(elsewhere);
        let rest = timeout(Duration::from_secs(30), sweeper.drain())
            .await
            .expect("the rest in time")
            .expect("a drain");
        assert_eq!(
            rest.delivered, 7,
            "with room, each pass takes 1 MiB's worth"
        );
        database.drop().await.expect("drop");
    }

    #[test]
    fn a_pending_document_whose_id_is_not_utf8_is_a_candidate_not_skipped() {
        let document = crate::unreadable::tests::not_utf8(b"ab\xff");
        let id = raw_id(&document).expect("an _id to tell it by");
        let stand_in = RawField::of(&document, "_id").map(|id| id.stand_in());
        assert_eq!(Some(id), stand_in);
        let readable = RawDocumentBuf::from_document(&doc! { "_id": 7 }).expect("raw");
        assert_eq!(raw_id(&readable), Some(Bson::Int32(7)));
    }
}
