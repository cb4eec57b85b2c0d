//! Leadership: one relay at a time tails the change stream and publishes.
//!
//! Several copies of the relay may run against one outbox (rolling deploys,
//! one per app host). Each would publish every message, so they elect a
//! leader with a lease kept in the checkpoint document itself:
//! `{_id: "<db>.<collection>", owner, term, expiresAt, token, ...}`.
//!
//! - Expiry is judged on the database server's clock, never a relay host's:
//!   `expiresAt` is the server's `hello.localTime` plus the lease, and a
//!   candidate compares it with the server's `hello.localTime` of its own.
//!   Clock skew between relay hosts therefore cannot make two leaders. (Plain
//!   update operators only, so servers without pipeline updates serve too.)
//! - `term` grows by one with every new owner. The checkpoint is written
//!   only under the writer's term, so a deposed leader cannot move the token
//!   backwards.
//! - A holder stops on its own before the server could let anyone else in:
//!   its deadline is the local (monotonic) time just before it asked the
//!   server for the time the expiry was counted from, plus the lease, minus
//!   a margin. The server read its clock after that, so the deadline always
//!   comes first.
//! - A graceful stop releases the lease, so a standby takes over at once.

use std::time::Duration;

use bson::{doc, oid::ObjectId, DateTime, RawDocumentBuf};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{is_duplicate_key, Error, Result};
use crate::retry::Outage;
use crate::time::later;

/// The database server's clock (`hello.localTime`), which judges leases.
pub(crate) async fn server_time(client: &mongodb::Client) -> Result<DateTime> {
    let hello = client
        .database("admin")
        .run_command(doc! { "hello": 1 })
        .await
        .map_err(|e| Error::mongo("reading the server's clock failed", e))?;
    hello
        .get_datetime("localTime")
        .copied()
        .map_err(|_| Error::Protocol("the server's hello reply has no localTime".into()))
}

/// Timing of the lease (from [`RelayConfig::lease_timing`](crate::RelayConfig::lease_timing)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a lease lasts without renewal.
    pub duration: Duration,
    /// How often the holder renews it.
    pub renew_interval: Duration,
    /// How often a standby looks whether the lease is free.
    pub standby_poll_interval: Duration,
}

impl LeaseTiming {
    /// The holder's safety margin: it stops this long before its lease ends.
    fn margin(&self) -> Duration {
        (self.duration / 10).max(Duration::from_millis(100))
    }
}

/// A lease held with a term.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Term(pub i64);

/// One relay's view of the lease on one outbox.
#[derive(Debug, Clone)]
pub struct Lease {
    database: Database,
    /// Read as stored: a field the driver cannot read (a string that is
    /// not UTF-8) must not keep every relay from leading.
    documents: Collection<RawDocumentBuf>,
    id: String,
    owner: String,
    timing: LeaseTiming,
}

impl Lease {
    /// The lease of `outbox`, kept in `checkpoint_collection`, for this process.
    pub fn new(
        database: &Database,
        checkpoint_collection: &str,
        outbox: &str,
        timing: LeaseTiming,
    ) -> Self {
        Lease {
            database: database.clone(),
            documents: database.collection(checkpoint_collection),
            id: format!("{}.{}", database.name(), outbox),
            owner: owner_name(),
            timing,
        }
    }

    /// This relay's name in the lease's `owner` field.
    pub fn owner(&self) -> &str {
        &self.owner
    }

    /// Waits until this relay holds the lease, trying whenever the current
    /// holder's lease should have ended. `None` if `shutdown` fires first.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Option<Held> {
        let mut announced = false;
        let mut outage = Outage::new("MongoDB lease");
        loop {
            let wait = match self.try_acquire().await {
                Ok(Ok(held)) => return Some(held),
                Ok(Err(remaining)) => {
                    outage.recovered();
                    if !announced {
                        tracing::info!("standing by: another relay holds the lease");
                        announced = true;
                    }
                    // Not at once even if the lease read as over: a read
                    // may lag the write that took it.
                    let poll = self.timing.standby_poll_interval;
                    remaining.clamp(poll / 10, poll)
                }
                Err(error) => {
                    outage.failed(&error);
                    self.timing.standby_poll_interval
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Takes the lease if it is free or expired. `Ok(Err(remaining))` if
    /// another relay holds it, with the time its lease has left.
    pub async fn try_acquire(&self) -> Result<std::result::Result<Held, Duration>> {
        let sent = Instant::now();
        let now = self.server_time().await?;
        let taken = self
            .documents
            .find_one_and_update(
                doc! {
                    "_id": &self.id,
                    "$or": [
                        { "expiresAt": { "$lt": now } },
                        { "expiresAt": { "$exists": false } },
                    ],
                },
                doc! {
                    "$set": { "owner": &self.owner, "expiresAt": later(now, self.timing.duration) },
                    "$inc": { "term": 1_i64 },
                },
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .await;
        match taken {
            Ok(Some(document)) if document.get_str("owner") == Ok(self.owner.as_str()) => {
                // `$inc` keeps an integer an integer; a double (a shell
                // edit) is read as its whole part.
                let term = Term(
                    document
                        .get_i64("term")
                        .or_else(|_| document.get_i32("term").map(i64::from))
                        .or_else(|_| document.get_f64("term").map(|t| t as i64))
                        .unwrap_or(1),
                );
                tracing::info!(term = term.0, owner = %self.owner, "took the lease: leading");
                Ok(Ok(Held {
                    term,
                    deadline: sent + self.timing.duration - self.timing.margin(),
                }))
            }
            Ok(_) => Ok(Err(self.timing.standby_poll_interval)),
            Err(error) if is_duplicate_key(&error) => Ok(Err(self.remaining(now).await?)),
            Err(error) => Err(Error::mongo("taking the lease failed", error)),
        }
    }

    /// Extends a held lease. `Ok(false)` if another relay has taken it.
    pub async fn renew(&self, held: &mut Held) -> Result<bool> {
        let sent = Instant::now();
        let now = self.server_time().await?;
        let renewed = self
            .documents
            .update_one(
                // Not once released: a renewal a stop cut short, landing
                // after the release, must not take the lease back.
                doc! {
                    "_id": &self.id, "owner": &self.owner, "term": held.term.0,
                    "expiresAt": { "$gt": DateTime::from_millis(0) },
                },
                doc! { "$set": { "expiresAt": later(now, self.timing.duration) } },
            )
            .await
            .map_err(|e| Error::mongo("renewing the lease failed", e))?;
        if renewed.matched_count == 0 {
            return Ok(false);
        }
        held.deadline = sent + self.timing.duration - self.timing.margin();
        Ok(true)
    }

    /// Gives the lease up at once, so a standby need not wait for it to expire.
    pub async fn release(&self, held: &Held) -> Result<()> {
        self.documents
            .update_one(
                doc! { "_id": &self.id, "owner": &self.owner, "term": held.term.0 },
                doc! { "$set": { "expiresAt": DateTime::from_millis(0) } },
            )
            .await
            .map_err(|e| Error::mongo("releasing the lease failed", e))?;
        tracing::info!(term = held.term.0, "released the lease");
        Ok(())
    }

    /// Keeps a held lease renewed until `stop` fires. Abandons the
    /// leader's work (fires `abandon`: a term's, or a sweep run's) and
    /// returns if the lease is taken or cannot be renewed before its
    /// deadline.
    pub async fn keep(
        self,
        mut held: Held,
        abandon: CancellationToken,
        stop: CancellationToken,
    ) -> Held {
        let mut warned = false;
        loop {
            let next = (Instant::now() + self.timing.renew_interval).min(held.deadline);
            tokio::select! {
                _ = stop.cancelled() => return held,
                _ = tokio::time::sleep_until(next) => {}
            }
            if Instant::now() >= held.deadline {
                tracing::error!(
                    term = held.term.0,
                    lease = ?self.timing.duration,
                    "could not renew the lease in time: stopping delivery until this relay leads \
                     again; if the server answers slowly rather than not at all, raise \
                     --lease-duration"
                );
                abandon.cancel();
                return held;
            }
            let began = Instant::now();
            // A stop does not wait for a renewal MongoDB leaves unanswered:
            // the release that follows matches the lease whether it landed
            // or not.
            let renewing = tokio::time::timeout_at(held.deadline, self.renew(&mut held));
            let attempt = tokio::select! {
                _ = stop.cancelled() => None,
                attempt = renewing => Some(attempt),
            };
            let Some(attempt) = attempt else {
                return held;
            };
            match attempt {
                Ok(Ok(true)) => warned |= self.slow_renewal(began.elapsed(), warned),
                Ok(Ok(false)) => {
                    tracing::warn!(
                        term = held.term.0,
                        "another relay took the lease: stopping delivery"
                    );
                    abandon.cancel();
                    return held;
                }
                Ok(Err(error)) => tracing::warn!(%error, "renewing the lease failed; trying again"),
                Err(_) => {} // the deadline check above ends it
            }
        }
    }

    /// Warns, unless it has (`warned`), when a renewal took more than a
    /// third of the lease: a little slower and the lease is lost, and with
    /// it a term's work. Returns whether it warned.
    fn slow_renewal(&self, took: std::time::Duration, warned: bool) -> bool {
        let lease = self.timing.duration;
        if warned || took <= lease / 3 {
            return false;
        }
        tracing::warn!(
            ?took,
            ?lease,
            "renewing the lease took more than a third of it: a renewal that takes the rest \
             loses the lease, and the relay stops delivering until it leads again; raise \
             --lease-duration (keeping --lease-renew-interval at most half of it), or find what \
             keeps the server from answering"
        );
        true
    }

    /// The database server's clock.
    async fn server_time(&self) -> Result<DateTime> {
        server_time(self.database.client()).await
    }

    /// How long the current holder's lease has left, by the server's clock.
    async fn remaining(&self, now: DateTime) -> Result<Duration> {
        let lease = self
            .documents
            .find_one(doc! { "_id": &self.id })
            .await
            .map_err(|e| Error::mongo("reading the lease failed", e))?;
        let expires = lease
            .and_then(|d| d.get_datetime("expiresAt").ok())
            .unwrap_or(now);
        let left = expires
            .timestamp_millis()
            .saturating_sub(now.timestamp_millis());
        Ok(Duration::from_millis(u64::try_from(left).unwrap_or(0)))
    }
}

/// A lease this relay holds.
#[derive(Debug, Clone, Copy)]
pub struct Held {
    /// The fencing number of this tenure.
    pub term: Term,
    /// When this relay must stop acting as leader unless it renews.
    pub deadline: Instant,
}

/// A name for this process that is unique among relays: host, pid and a
/// random part (so a restarted process with a recycled pid is someone new).
pub(crate) fn owner_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "relay".to_owned());
    format!("{host}/{}/{}", std::process::id(), ObjectId::new().to_hex())
}
