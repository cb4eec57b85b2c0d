//! Where the change stream's resume token is kept between runs.
//!
//! One document per outbox collection in the checkpoint collection:
//! `{_id: "<db>.<collection>", token, positionAt, updatedAt}`, which also holds the
//! leader's lease (see `lease`). The completion stage writes a token only
//! once every message before it is acknowledged and marked, so resuming from
//! it can repeat work but never skip any. Writes are fenced by the lease's
//! owner and term: a leader that has been replaced cannot move the token
//! backwards, even if a rolled-back write left two relays with one term.

use std::sync::{Arc, Mutex};

use bson::{doc, Bson, DateTime, Document, RawDocumentBuf};
use mongodb::change_stream::event::ResumeToken;
use mongodb::{Collection, Database};

use crate::config::RelayConfig;
use crate::error::{Error, Result};
use crate::lease::Term;
pub use crate::lease::POSITION_AT;
use crate::partition::Partition;

/// Reads and writes the resume token of one outbox collection.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    collection: Collection<Document>,
    id: String,
    /// The partition whose position it keeps.
    partition: Partition,
    fence: Option<(String, Term)>,
    /// Where the term's newest recorded position is kept in memory.
    place: Option<KeptPlace>,
}

/// The newest position a term's stream recorded (every message before it
/// has its verdict written), kept in memory for this relay's next term.
///
/// A relay that leads again right after losing the lease, with no other
/// relay leading between (its new term is the next number), resumes from
/// it rather than from the stored checkpoint, which is written less often
/// and may not hold the lost term's last positions at all. What is pending
/// is counted against `--max-replay` as at any start: writers went on
/// while the relay was cut off, however long that was.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeptPlace(Arc<Mutex<Option<(Term, ResumeToken)>>>);

impl KeptPlace {
    fn record(&self, term: Term, token: &ResumeToken) {
        if let Ok(mut kept) = self.0.lock() {
            *kept = Some((term, token.clone()));
        }
    }

    /// The position the term just before `term` kept, if this relay led
    /// it; taken, so that it serves one term.
    pub fn take_before(&self, term: Term) -> Option<ResumeToken> {
        let mut kept = self.0.lock().ok()?;
        match kept.take() {
            Some((kept_by, token)) if kept_by.0.checked_add(1) == Some(term.0) => Some(token),
            _ => None,
        }
    }
}

impl CheckpointStore {
    /// The store for `outbox` in `database`, kept in `checkpoint_collection`.
    pub fn new(database: &Database, checkpoint_collection: &str, outbox: &str) -> Self {
        CheckpointStore {
            collection: database.collection(checkpoint_collection),
            id: format!("{}.{}", database.name(), outbox),
            partition: Partition::WHOLE,
            fence: None,
            place: None,
        }
    }

    /// The store of `partition` of this outbox (called on the outbox's
    /// store): a document of its own, as its lease is.
    pub fn of_partition(mut self, partition: Partition) -> Self {
        self.id = partition.document_id(&self.id);
        self.partition = partition;
        self
    }

    /// The partition whose position it keeps.
    pub fn partition(&self) -> Partition {
        self.partition
    }

    /// The store of the outbox a relay's configuration names.
    pub fn for_config(database: &Database, config: &RelayConfig) -> Self {
        Self::new(database, &config.checkpoint_collection, &config.collection)
    }

    /// The same store, writing only while `owner` holds the lease at `term`.
    pub fn fenced(mut self, owner: &str, term: Term) -> Self {
        self.fence = Some((owner.to_owned(), term));
        self
    }

    /// The same store, also keeping each position recorded in `place`
    /// (a fenced store's, for its term).
    pub(crate) fn keeping(mut self, place: KeptPlace) -> Self {
        self.place = Some(place);
        self
    }

    /// A position whose messages all have their verdicts written: kept in
    /// memory at once, stored at the next save.
    pub(crate) fn recorded(&self, token: &ResumeToken) {
        if let (Some(place), Some((_, term))) = (&self.place, &self.fence) {
            place.record(*term, token);
        }
    }

    /// The whole checkpoint document (token, position time, lease), if
    /// any. One the driver cannot read (a string that is not UTF-8) is a
    /// stored state no retry mends.
    pub async fn document(&self) -> Result<Option<Document>> {
        let Some(raw) = self.raw().await? else {
            return Ok(None);
        };
        Document::try_from(raw.as_ref()).map(Some).map_err(|e| {
            Error::StoredState(format!(
                "the checkpoint {:?} cannot be read ({e}); delete it, and the relay starts \
                 from the pending messages",
                self.id
            ))
        })
    }

    /// The checkpoint document as stored.
    async fn raw(&self) -> Result<Option<RawDocumentBuf>> {
        self.collection
            .clone_with_type::<RawDocumentBuf>()
            .find_one(doc! { "_id": &self.id })
            .await
            .map_err(|e| {
                Error::mongo("reading the checkpoint failed", e)
                    .needing("find", self.collection.namespace())
            })
    }

    /// The stored token, if any; read alone, so that no other field of the
    /// document can keep it from being used.
    pub async fn load(&self) -> Result<Option<ResumeToken>> {
        let Some(raw) = self.raw().await? else {
            return Ok(None);
        };
        let unreadable = |e: &dyn std::fmt::Display| {
            Error::StoredState(format!(
                "the checkpoint {:?} holds no readable resume token ({e})",
                self.id
            ))
        };
        let token = match raw.get("token") {
            Ok(Some(token)) => token,
            Ok(None) => return Ok(None),
            Err(e) => return Err(unreadable(&e)),
        };
        let token = Bson::try_from(token.to_raw_bson()).map_err(|e| unreadable(&e))?;
        bson::from_bson(token).map(Some).map_err(|e| unreadable(&e))
    }

    /// Stores a token reached at `at` (the commit time of its event, or
    /// when the server reported the position). Returns false, writing
    /// nothing, if the store is fenced and the lease has moved to another owner or term.
    pub async fn save(
        &self,
        token: &ResumeToken,
        at: Option<DateTime>,
    ) -> mongodb::error::Result<bool> {
        let token = bson::to_bson(token)?;
        let mut fields = doc! { "token": token, "updatedAt": DateTime::now() };
        if let Some(at) = at {
            fields.insert(POSITION_AT, at);
        }
        let update = doc! { "$set": fields };
        let saved = match &self.fence {
            Some((owner, term)) => {
                let held = doc! { "_id": &self.id, "owner": owner, "term": term.0 };
                self.collection.update_one(held, update).await?
            }
            None => {
                self.collection
                    .update_one(doc! { "_id": &self.id }, update)
                    .upsert(true)
                    .await?
            }
        };
        Ok(saved.matched_count > 0 || saved.upserted_id.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(data: &str) -> ResumeToken {
        bson::from_bson(bson::Bson::Document(doc! { "_data": data })).expect("a token")
    }

    #[test]
    fn a_place_is_kept_for_the_next_term_alone_and_once() {
        let place = KeptPlace::default();
        place.record(Term(4), &token("01"));
        place.record(Term(4), &token("02"));
        assert_eq!(place.take_before(Term(6)), None, "another relay led term 5");
        place.record(Term(6), &token("03"));
        assert_eq!(place.take_before(Term(7)), Some(token("03")));
        assert_eq!(place.take_before(Term(7)), None, "taken");
    }
}
