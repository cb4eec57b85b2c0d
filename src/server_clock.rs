//! The database server's clock, which judges leases and the group's
//! announcements: read with one `hello`, and counted on locally for a while.
//!
//! Every renewal and every round of the group needs the server's time, and
//! a `hello` for each would be most of what a quiet relay sends MongoDB. A
//! [`Reading`] says the clock stood at `server` at some moment between
//! `sent` and `answered`; until it is `max_age` old, the clock at a later
//! local instant is counted from it, each way round as its use needs:
//!
//! - [`Reading::latest`] (counted from `sent`) is never behind the server's
//!   clock: an expiry written from it lasts at least as long as meant;
//! - [`Reading::earliest`] (counted from `answered`) is never ahead of it:
//!   whatever times a round by another's expiry uses it, so nothing is
//!   judged lapsed early.
//!
//! Counting on a reading assumes the two clocks keep pace: a server clock
//! slewed fast, or stepped, runs ahead of one. So a lease's renewal, whose
//! expiry the holder's deadline counts on, reads the clock afresh each
//! time ([`ServerClock::read`]), as it always did, and the group's
//! announcements and rounds, which no deadline counts on, use the
//! renewals' readings. Takes, and every judge of whether another's lease
//! has lapsed before taking it, read it afresh too.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use bson::{doc, DateTime};
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::time::later;

/// The server's clock as one `hello` read it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reading {
    /// Just before the `hello` was sent.
    sent: Instant,
    /// Just after its answer came.
    answered: Instant,
    /// `hello.localTime`.
    server: DateTime,
}

impl Reading {
    /// The server's clock at `at`, at the latest.
    pub(crate) fn latest(&self, at: Instant) -> DateTime {
        later(self.server, at.saturating_duration_since(self.sent))
    }

    /// The server's clock at `at`, at the earliest, for an `at` no
    /// earlier than the answer (before it, the server's clock may not yet
    /// have read `server`).
    pub(crate) fn earliest(&self, at: Instant) -> DateTime {
        later(self.server, at.saturating_duration_since(self.answered))
    }
}

/// One relay's view of the server's clock, shared by its leases and its
/// group (see the module's doc).
#[derive(Debug)]
pub(crate) struct ServerClock {
    client: mongodb::Client,
    /// How long a reading is counted on; zero reads anew each time.
    max_age: Duration,
    last: Mutex<Option<Reading>>,
}

impl ServerClock {
    /// The clock of the server `client` reaches, each reading counted on
    /// for `max_age`.
    pub(crate) fn new(client: &mongodb::Client, max_age: Duration) -> Self {
        ServerClock {
            client: client.clone(),
            max_age,
            last: Mutex::new(None),
        }
    }

    /// A reading younger than `max_age`, from a `hello` if the last is older.
    pub(crate) async fn reading(&self) -> Result<Reading> {
        let kept = *self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(reading) = kept.filter(|r| r.sent.elapsed() < self.max_age) {
            return Ok(reading);
        }
        self.read().await
    }

    /// A reading from a `hello` sent now, kept for later readings.
    pub(crate) async fn read(&self) -> Result<Reading> {
        let sent = Instant::now();
        let server = server_time(&self.client).await?;
        let reading = Reading {
            sent,
            answered: Instant::now(),
            server,
        };
        *self.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(reading);
        Ok(reading)
    }
}

/// The database server's clock (`hello.localTime`), read now.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_counts_the_server_clock_from_both_ends_of_its_round_trip() {
        let sent = Instant::now();
        let reading = Reading {
            sent,
            answered: sent + Duration::from_millis(40),
            server: DateTime::from_millis(1_000_000),
        };
        let at = sent + Duration::from_millis(1_000);
        assert_eq!(reading.latest(at).timestamp_millis(), 1_001_000);
        assert_eq!(reading.earliest(at).timestamp_millis(), 1_000_960);
        // Before the answer came, the earliest is the reading itself.
        assert_eq!(reading.earliest(sent).timestamp_millis(), 1_000_000);
    }
}
