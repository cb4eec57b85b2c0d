//! Giving claims back: the one claim of a message a pass leaves to another
//! pipeline, the pass's claims on what it did not complete, and, before a
//! term's first claim, every claim a former leader left.
//!
//! A claim hides its message from every other claim, and holds back the
//! rest of its key, until it goes stale after the lock timeout; giving it
//! back at once lets the message go now.

use bson::{doc, oid::ObjectId, Bson};
use std::sync::atomic::Ordering;

use super::Sweeper;
use crate::contract::{field, status};
use crate::error::{Error, Result};

impl Sweeper {
    /// Clears a former leader's claims, unless this term has: called
    /// before each claim, so the clearing waits for the sweep's first
    /// claim rather than running at a new leader's start. It reads every
    /// pending message (no index holds the claim); only the sweep's claims
    /// need it gone (the term's other verdicts match a message whatever a
    /// former leader's claim on it, see `complete::fate`), and while a
    /// catch-up pass delivers a backlog the sweep reads nothing, so the
    /// clearing waits for the pass unless a held key is released
    /// meanwhile.
    pub(super) async fn clear_claims_once(&self) -> Result<()> {
        if !self.claims_cleared.load(Ordering::Acquire) {
            self.clear_claims().await?;
        }
        Ok(())
    }

    /// Drops every claim on pending messages of the term's partition (the
    /// others' have leases of their own). Only the lease holder claims,
    /// so before a term's first claim, every claim there is belongs to a
    /// relay that has stopped (its lease ended before this one began); left alone,
    /// each would hide its message, and hold back the rest of its key,
    /// for up to the lock timeout.
    async fn clear_claims(&self) -> Result<()> {
        self.pipeline
            .outbox
            .update_many(
                self.pipeline.partition.scope(
                    doc! { field::STATUS: status::PENDING, field::LOCK_ID: { "$exists": true } },
                ),
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| {
                Error::mongo("sweep: clearing a former leader's claims failed", e)
                    .needing("update", self.pipeline.outbox.namespace())
            })?;
        self.claims_cleared.store(true, Ordering::Release);
        Ok(())
    }

    /// Drops this claim from one message the pass leaves to another
    /// pipeline, at once: that pipeline's verdict on it must not find it
    /// claimed.
    pub(super) async fn release_one(&self, id: &Bson, claim: Option<ObjectId>) -> Result<()> {
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
            .map_err(|e| Error::mongo("sweep: releasing claims failed", e).needing("update", self.pipeline.outbox.namespace()))?;
        Ok(())
    }

    /// Drops this claim from messages it did not complete (the broker was
    /// down at shutdown), so others need not wait for the lock timeout.
    pub(super) async fn release(&self, claim: ObjectId) -> Result<()> {
        self.pipeline
            .outbox
            .update_many(
                doc! { field::LOCK_ID: claim, field::STATUS: status::PENDING },
                doc! { "$unset": { field::LOCK_ID: "", field::LOCKED_AT: "" } },
            )
            .await
            .map_err(|e| {
                Error::mongo("sweep: releasing claims failed", e)
                    .needing("update", self.pipeline.outbox.namespace())
            })?;
        Ok(())
    }
}
