//! The outbox against what the streams store: one pass over the window's
//! messages in `_id` order beside the stored ids, sorted the same way.
//!
//! The outbox is read after the streams: a message marked `processed` was
//! stored before it was marked, so a read of the streams that began before
//! the outbox's finds it, unless it was processed after that read began,
//! which the caller confirms with a second, short read (see `super`).

use bson::oid::ObjectId;
use bson::{DateTime, RawDocumentBuf};
use futures::TryStreamExt;
use mongodb::Collection;

use super::pace::Pace;
use super::stream::MAX_STORED;
use crate::contract::{field, status, DecodeRules};
use crate::error::{Error, Result};
use crate::replay::Selection;
use crate::time::made_at;

/// Documents read between two looks at the pace.
const PACED_EVERY: u64 = 256;

/// How many of each finding are listed by name; the rest are counted.
pub const LISTED: usize = 1_000;

/// A message marked `processed` that no stream holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Missing {
    pub id: ObjectId,
    pub processed_at: Option<DateTime>,
}

/// How a message of the outbox is described in a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Described {
    pub id: ObjectId,
    pub subject: String,
    pub message_type: String,
    pub key: Option<String>,
    pub processed_at: Option<DateTime>,
    /// Copies stored.
    pub copies: u64,
}

/// What the comparison found.
#[derive(Debug, Default)]
pub struct Compared {
    /// Messages of the window in the outbox, whatever their state.
    pub messages: u64,
    /// Processed and stored once.
    pub delivered: u64,
    /// Processed and not stored, in `_id` order.
    pub missing: Vec<Missing>,
    /// The first [`LISTED`] of them, described.
    pub missing_listed: Vec<Described>,
    /// Processed and stored more than once.
    pub repeated: u64,
    pub repeated_listed: Vec<Described>,
    /// Not delivered yet (pending, or in no state the relay wrote), or
    /// processed too recently to judge.
    pub pending: u64,
    /// Given up on (dead letters).
    pub failed: u64,
    /// Stored copies of ids the outbox does not hold, in `_id` order.
    pub unrecorded: Vec<ObjectId>,
    /// The first message not settled: pending, or processed at or after
    /// the moment the caller asked about (its copy may yet be lost to a
    /// flush). An audit that moves on moves on to it, no further.
    pub first_unsettled: Option<ObjectId>,
}

/// Compares the window's messages in `outbox` with `stored` (sorted).
pub async fn compare(
    outbox: &Collection<bson::Document>,
    selection: &Selection,
    rules: &DecodeRules,
    stored: &[ObjectId],
    pace: Pace,
    settled_before: Option<DateTime>,
) -> Result<Compared> {
    let failed = |e| {
        Error::mongo("reading the outbox's messages failed", e).needing("find", outbox.namespace())
    };
    let mut cursor = outbox
        .clone_with_type::<RawDocumentBuf>()
        .find(selection.window_filter())
        .sort(bson::doc! { field::ID: 1 })
        .await
        .map_err(failed)?;
    let mut compared = Compared::default();
    let mut next = 0;
    let mut pacer = pace.start();
    let mut unpaced = 0;
    while let Some(document) = cursor.try_next().await.map_err(failed)? {
        unpaced += 1;
        if unpaced == PACED_EVERY {
            pacer.read(unpaced).await;
            unpaced = 0;
        }
        let Ok(id) = document.get_object_id(field::ID) else {
            continue;
        };
        let described = describe(&document, id, rules);
        while next < stored.len() && stored[next] < id {
            compared.unrecorded.push(stored[next]);
            next += 1;
        }
        let mut copies = 0;
        while next < stored.len() && stored[next] == id {
            copies += 1;
            next += 1;
        }
        // Its copies are passed over with it: the stream side cannot
        // select by subject (a subject is rendered by today's rules).
        if !selection.matches(&described.message_type, &described.subject) {
            continue;
        }
        compared.messages += 1;
        let state = document.get_str(field::STATUS).ok();
        let unsettled = match state {
            Some(status::FAILED) => false,
            Some(status::PROCESSED) => settled_before
                .is_some_and(|moment| described.processed_at.is_none_or(|at| at >= moment)),
            _ => true,
        };
        if unsettled && compared.first_unsettled.is_none() {
            compared.first_unsettled = Some(id);
        }
        // Processed too recently to judge: as if it were pending.
        let state = if unsettled { None } else { state };
        compared.judge(state, described, copies)?;
    }
    compared.unrecorded.extend_from_slice(&stored[next..]);
    Ok(compared)
}

impl Compared {
    fn judge(&mut self, state: Option<&str>, mut described: Described, copies: u64) -> Result<()> {
        described.copies = copies;
        match (state, copies) {
            (Some(status::PROCESSED), 0) => {
                if self.missing.len() >= MAX_STORED {
                    return Err(Error::Config(format!(
                        "more than {MAX_STORED} messages of the window are missing, more than \
                         one audit holds: audit it in parts (--since and --until)"
                    )));
                }
                self.missing.push(Missing {
                    id: described.id,
                    processed_at: described.processed_at,
                });
                if self.missing_listed.len() < LISTED {
                    self.missing_listed.push(described);
                }
            }
            (Some(status::PROCESSED), 1) => self.delivered += 1,
            (Some(status::PROCESSED), _) => {
                self.repeated += 1;
                if self.repeated_listed.len() < LISTED {
                    self.repeated_listed.push(described);
                }
            }
            (Some(status::FAILED), _) => self.failed += 1,
            _ => self.pending += 1,
        }
        Ok(())
    }

    /// Takes the missing messages committed before `horizon` out of the
    /// missing: a stream's limits may have removed them. How many. Judged
    /// by the commit, which comes before the store: a message stored
    /// before the horizon was committed before it (and one committed
    /// before it and stored after is given the benefit of the doubt).
    pub fn set_aside_before(&mut self, horizon: DateTime) -> u64 {
        let before = |id: &ObjectId| made_at(id) < horizon;
        let count = self.missing.len();
        self.missing.retain(|m| !before(&m.id));
        self.missing_listed.retain(|d| !before(&d.id));
        (count - self.missing.len()) as u64
    }

    /// Takes `found` (copies of missing messages a later read found, by
    /// id) out of the missing: each is delivered, or repeated.
    pub fn found_later(&mut self, found: &[ObjectId]) {
        let mut counted: std::collections::HashMap<ObjectId, u64> =
            std::collections::HashMap::with_capacity(found.len());
        for id in found {
            *counted.entry(*id).or_default() += 1;
        }
        let copies = |id: &ObjectId| counted.get(id).copied().unwrap_or(0);
        let mut kept = Vec::with_capacity(self.missing.len());
        for missing in self.missing.drain(..) {
            match copies(&missing.id) {
                0 => kept.push(missing),
                1 => self.delivered += 1,
                _ => self.repeated += 1,
            }
        }
        self.missing = kept;
        let still: std::collections::HashSet<ObjectId> =
            self.missing.iter().map(|m| m.id).collect();
        let (listed, now_found): (Vec<_>, Vec<_>) = self
            .missing_listed
            .drain(..)
            .partition(|d| still.contains(&d.id));
        self.missing_listed = listed;
        for mut described in now_found {
            described.copies = copies(&described.id);
            if described.copies > 1 && self.repeated_listed.len() < LISTED {
                self.repeated_listed.push(described);
            }
        }
    }
}

/// What a list says of a message: its subject as the relay sends it (or
/// would have, for one that breaks the contract now).
fn describe(document: &RawDocumentBuf, id: ObjectId, rules: &DecodeRules) -> Described {
    let decoded = rules.decode_raw(document);
    let (subject, message_type) = match decoded.message {
        Ok(message) => (message.subject, message.message_type),
        Err(_) => (
            rules.likely_subject(document),
            document.get_str(field::TYPE).unwrap_or_default().to_owned(),
        ),
    };
    Described {
        id,
        subject,
        message_type,
        key: decoded.key,
        processed_at: document.get_datetime(field::PROCESSED_AT).ok(),
        copies: 0,
    }
}
