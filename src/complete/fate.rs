//! A message's fate when it was not delivered: another attempt, a dead
//! letter, or parked behind an earlier message of its key.
//!
//! Deciding is where a broker's fault could pass for a message's: a
//! message out of attempts is failed only on evidence that the fault is its
//! own, and every decision is one write fenced by the claim and the
//! attempts the message was read with. A dead letter that holds its key
//! (`--on-dead-letter hold`) says so in `holdsKey`, so a new leader finds
//! the hold in the collection.

use std::time::Duration;

use bson::{doc, oid::ObjectId, Bson, DateTime, Document};

use super::{still_ours, unlock, CompletionStage, Target};
use crate::contract::{field, status, ContractViolation, Decoded};
use crate::observe::FailureKind;
use crate::order::PARKED;

/// What became of a refused message.
pub(super) enum Retry {
    Scheduled,
    GaveUp,
    /// Completed or reclaimed by another processor meanwhile.
    NotOurs,
}

impl CompletionStage {
    /// Fails a message that breaks the contract, at once: no attempt can
    /// mend it. Returns whether it was ours to fail.
    pub(super) async fn reject(
        &self,
        message: &Decoded,
        claim: Option<ObjectId>,
        violation: &ContractViolation,
        now: DateTime,
    ) -> Option<bool> {
        let reason = violation.to_string();
        let failed = fail(&reason, None, self.holds_key(message), now);
        let decided = self
            .decide(message, claim, Fate::Failed(&failed), &reason)
            .await?;
        Some(self.failed_as(message, decided, FailureKind::Rejected))
    }

    /// Records an attempt the broker refused: schedules the next, or with
    /// none left fails the message. One conditional write that matches the
    /// claim and the attempts read with the message, so it cannot change a
    /// message another processor has delivered, claimed or counted meanwhile.
    ///
    /// A message out of attempts is failed only on evidence that the fault
    /// is its own: the broker was found to take other messages when it was
    /// refused (`own`), or the relay delivered something within the evidence
    /// window. Without it, the broker may be refusing everything (a
    /// permission lost for every subject), and failing would dead-letter the
    /// outbox one message at a time; the message is tried again after the
    /// longest retry delay instead.
    pub(super) async fn refuse(
        &self,
        message: &Decoded,
        claim: Option<ObjectId>,
        reason: &str,
        own: bool,
        now: DateTime,
    ) -> Option<Retry> {
        let attempts = message.attempts_made().saturating_add(1);
        let exhausted = self.retry.exhausted(attempts);
        let refusal = Refusal {
            message,
            claim,
            reason,
            attempts,
            stored: i32::try_from(attempts).unwrap_or(i32::MAX),
            now,
        };
        if exhausted && (own || self.deliveries.within(self.evidence_window())) {
            self.fail_exhausted(refusal).await
        } else {
            self.schedule(refusal, exhausted).await
        }
    }

    /// Fails a refused message out of attempts.
    async fn fail_exhausted(&self, refusal: Refusal<'_>) -> Option<Retry> {
        let message = refusal.message;
        let attempts = refusal.attempts;
        let reason = format!("{} (gave up after {attempts} attempts)", refusal.reason);
        let holds_key = self.holds_key(message);
        let failed = fail(&reason, Some(refusal.stored), holds_key, refusal.now);
        let decided = self
            .decide(message, refusal.claim, Fate::Failed(&failed), &reason)
            .await?;
        Some(
            if self.failed_as(message, decided, FailureKind::Exhausted) {
                Retry::GaveUp
            } else {
                Retry::NotOurs
            },
        )
    }

    /// Schedules a refused message's next attempt: after the retry delay,
    /// or, out of attempts without evidence that the fault is its own,
    /// after the evidence window (a held dead letter).
    async fn schedule(&self, refusal: Refusal<'_>, exhausted: bool) -> Option<Retry> {
        let Refusal {
            message,
            attempts,
            stored,
            now,
            ..
        } = refusal;
        let (delay, reason) = if exhausted {
            let window = humantime::format_duration(self.evidence_window());
            tracing::warn!(
                id = %message.id,
                attempts,
                reason = refusal.reason,
                "outbox message is out of attempts, but the broker took no other message in the \
                 last {window}: not failing it, since the fault may be the broker's"
            );
            let held = format!(
                "{} (out of attempts; not failed, as the broker took no other message in the \
                 last {window})",
                refusal.reason
            );
            (self.retry.max_delay.max(self.evidence_window()), held)
        } else {
            (self.retry.delay_after(attempts), refusal.reason.to_owned())
        };
        tracing::debug!(id = %message.id, attempts, ?delay, reason, "outbox message refused; will retry");
        let next = DateTime::from_millis(
            now.timestamp_millis()
                .saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX)),
        );
        let schedule = doc! {
            "$set": {
                field::ATTEMPTS: stored,
                field::NEXT_ATTEMPT_AT: next,
                field::LAST_ERROR: &reason,
            },
            "$unset": unlock(),
        };
        let instead_reason = format!(
            "{} (its document takes no schedule for another attempt)",
            refusal.reason
        );
        let instead = fail(&instead_reason, Some(stored), self.holds_key(message), now);
        let fate = Fate::Retried {
            schedule: &schedule,
            instead: &instead,
        };
        let decided = self
            .decide(message, refusal.claim, fate, &instead_reason)
            .await?;
        Some(match decided {
            // Counted once the document says so: the count never runs
            // ahead of what an operator reads in the collection.
            Decided::AsMeant if exhausted => {
                self.metrics.dead_letter_held();
                Retry::Scheduled
            }
            Decided::AsMeant => Retry::Scheduled,
            Decided::NotOurs => Retry::NotOurs,
            // The document took no schedule, only a failure in its place.
            Decided::Failed | Decided::FailedBare => {
                self.failed_as(message, decided, FailureKind::Rejected);
                Retry::GaveUp
            }
        })
    }

    /// Records a failure written for a message, if its document took one
    /// (returns whether it did): counted as `kind`, and its key held or let
    /// go as the document says, so that a new leader, which reads the holds
    /// from the collection, holds the same keys.
    fn failed_as(&self, message: &Decoded, decided: Decided, kind: FailureKind) -> bool {
        if decided == Decided::NotOurs {
            return false;
        }
        self.metrics.failed(kind);
        let (Some(tenure), Some(key)) = (&self.tenure, key(message)) else {
            return true;
        };
        let holds = self.holds_key(message);
        if holds && decided == Decided::FailedBare {
            tracing::warn!(
                id = %message.id,
                key,
                "the dead letter's document took only `status: failed`, not `holdsKey`: its key \
                 is let go, not held, and its later messages are delivered"
            );
        }
        let held = holds && decided != Decided::FailedBare;
        tenure.order.dead_letter(key, &message.id, held);
        true
    }

    /// Parks a message behind the earlier message holding its key: out of
    /// every range the sweep reads, until a release reads it back. Returns
    /// whether it was ours to park.
    pub(super) async fn park(&self, message: &Decoded, claim: Option<ObjectId>) -> Option<bool> {
        let update = doc! {
            "$set": { field::NEXT_ATTEMPT_AT: PARKED },
            "$unset": unlock(),
        };
        let decided = self
            .decide(message, claim, Fate::Parked(&update), "")
            .await?;
        Some(decided == Decided::AsMeant)
    }

    /// What a verdict that holds no claim requires of `lockId`: no claim,
    /// or in a term a claim older than the term, a former leader's. The
    /// term's sweep clears those before its first claim, and its stream
    /// does not wait for that: a verdict must not miss its message for a
    /// claim about to go (a refusal that missed would leave its key held
    /// in the term's order and nothing in the collection saying so).
    ///
    /// "Older" is read off the claim id's seconds, which come from the
    /// former leader's clock, against this relay's: hosts whose clocks
    /// differ by more than the lease's margin may see a former leader's
    /// last claims as this term's (see docs/operating.md, Clocks).
    fn unclaimed(&self) -> Bson {
        match &self.tenure {
            Some(tenure) => doc! { "$not": { "$gte": tenure.claims_before } }.into(),
            None => Bson::Null,
        }
    }

    /// Whether a dead letter of this message holds its key.
    fn holds_key(&self, message: &Decoded) -> bool {
        key(message).is_some()
            && self
                .tenure
                .as_ref()
                .is_some_and(|tenure| tenure.order.dead_letters_hold())
    }

    /// How recent a delivery must be to show that the broker takes messages:
    /// the longest retry delay, and at least a minute. A held message waits
    /// as long before it is tried again.
    fn evidence_window(&self) -> Duration {
        self.retry.max_delay.max(Duration::from_secs(60))
    }

    /// Applies a message's fate with the fence of a decision: still
    /// pending, held by this processor's claim or by none, and with the
    /// attempts it was read with. A document that cannot take the update is
    /// failed with the least change that says so. Returns what the
    /// document took.
    async fn decide(
        &self,
        message: &Decoded,
        claim: Option<ObjectId>,
        fate: Fate<'_>,
        reason: &str,
    ) -> Option<Decided> {
        let mut filter = still_ours(doc! { "$eq": &message.id }, None);
        match Fence::of(fate, claim) {
            Fence::Claim(claim) => filter.insert(field::LOCK_ID, claim),
            Fence::NoClaimOfThisTerm => filter.insert(field::LOCK_ID, self.unclaimed()),
            Fence::NotParked => filter.insert(field::NEXT_ATTEMPT_AT, doc! { "$ne": PARKED }),
        };
        // `$eq`, so that a value a writer stored (`{"$exists": false}`, say)
        // is compared, never read as an operator.
        match &message.attempts {
            Some(attempts) => filter.insert(field::ATTEMPTS, doc! { "$eq": attempts.clone() }),
            None => filter.insert(field::ATTEMPTS, doc! { "$exists": false }),
        };
        // Should the document not take its fate, fail it with the reason,
        // or else with the least change that takes it out of pending.
        let least = doc! { "$set": { field::STATUS: status::FAILED } };
        let offered: &[(&Document, Decided)] = match fate {
            Fate::Failed(update) => &[(update, Decided::AsMeant), (&least, Decided::FailedBare)],
            Fate::Retried { schedule, instead } => &[
                (schedule, Decided::AsMeant),
                (instead, Decided::Failed),
                (&least, Decided::FailedBare),
            ],
            // A message that cannot be parked is left as it is: pending
            // and skipped, like any document no write can change.
            Fate::Parked(update) => &[(update, Decided::AsMeant)],
        };
        let updates: Vec<&Document> = offered.iter().map(|(update, _)| *update).collect();
        let target = Target::of(message, filter);
        let taken = self.write_one(&message.id, target, &updates).await?;
        let decided = taken
            .and_then(|place| offered.get(place))
            .map_or(Decided::NotOurs, |(_, decided)| *decided);
        let failed = match decided {
            Decided::Failed | Decided::FailedBare => true,
            Decided::AsMeant => matches!(fate, Fate::Failed(_)),
            Decided::NotOurs => false,
        };
        if failed {
            tracing::warn!(id = %message.id, reason, "outbox message failed");
        }
        Some(decided)
    }
}

/// The update that fails a message, with its reason (and attempts, when
/// the failure used the last one), marking it as holding its key if it does.
fn fail(reason: &str, attempts: Option<i32>, holds_key: bool, now: DateTime) -> Document {
    let mut fields = doc! {
        field::STATUS: status::FAILED,
        field::FAILED_AT: now,
        field::LAST_ERROR: reason,
    };
    if let Some(attempts) = attempts {
        fields.insert(field::ATTEMPTS, attempts);
    }
    if holds_key {
        fields.insert(field::HOLDS_KEY, true);
    }
    doc! { "$set": fields, "$unset": unlock() }
}

/// The message's key, if it has one.
fn key(message: &Decoded) -> Option<&str> {
    message.key.as_deref()
}

/// Whose claim a decision's write must meet, besides the message being
/// still pending with the attempts it was read with.
enum Fence {
    /// The processor's own claim: a sweep decides only what it claimed.
    Claim(ObjectId),
    /// No claim of this term: the stream and the catch-up pass claim
    /// nothing (nor does a sweep for a document it could not claim), and a
    /// claim taken since (a sweep's) is the claimant's to decide. A claim
    /// from before the term is a former leader's, and stale; outside a
    /// term only no claim at all will do (see [`CompletionStage::unclaimed`]).
    NoClaimOfThisTerm,
    /// Any claim, unless the message is parked already. A park must land
    /// wherever the message is (a sweep may still hold a claim it is about
    /// to give back), since a key is freed only once its parks are in the
    /// collection; the claim's holder then finds the message no longer its
    /// own. A park already there is left alone: a release may hold a claim
    /// on it.
    NotParked,
}

impl Fence {
    fn of(fate: Fate<'_>, claim: Option<ObjectId>) -> Fence {
        match (fate, claim) {
            (Fate::Parked(_), _) => Fence::NotParked,
            (_, Some(claim)) => Fence::Claim(claim),
            (_, None) => Fence::NoClaimOfThisTerm,
        }
    }
}

/// What a decision writes: a failure, another attempt scheduled (or,
/// should the document refuse that, a failure `instead`), or a park.
#[derive(Clone, Copy)]
enum Fate<'a> {
    Failed(&'a Document),
    Retried {
        schedule: &'a Document,
        instead: &'a Document,
    },
    Parked(&'a Document),
}

/// What a decision left in the message's document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decided {
    /// The fate meant.
    AsMeant,
    /// In the fate's place, `failed` with its reason, and `holdsKey` where
    /// the message holds its key.
    Failed,
    /// In the fate's place, `status: failed` alone: the least change that
    /// takes the message out of pending.
    FailedBare,
    /// Nothing: the message was not this processor's to decide, or its
    /// document took no write.
    NotOurs,
}

/// A refused attempt, as the stage records it.
#[derive(Clone, Copy)]
struct Refusal<'a> {
    message: &'a Decoded,
    claim: Option<ObjectId>,
    reason: &'a str,
    /// Attempts made, this one included.
    attempts: u32,
    /// `attempts` as the document stores it.
    stored: i32,
    now: DateTime,
}
