//! How fast an audit reads: at most so many messages a second, so that an
//! audit beside a running relay leaves it the servers' time. Reads are
//! counted in batches and the reader waits out whatever it is ahead of the
//! rate, so a paced read costs no more than an unpaced one, spread out.

use std::time::Duration;

use tokio::time::Instant;

/// The most messages a second an audit reads, of the streams and of the
/// outbox each; none: as fast as the servers answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pace(pub Option<f64>);

/// One read's progress against its pace.
pub(super) struct Pacer {
    per_second: Option<f64>,
    started: Instant,
    read: u64,
}

impl Pace {
    pub(super) fn start(self) -> Pacer {
        Pacer {
            per_second: self.0,
            started: Instant::now(),
            read: 0,
        }
    }
}

/// The longest a paced reader waits between two batches: a stream's
/// reading consumer is deleted by the server after a minute without one.
const LONGEST_PAUSE: Duration = Duration::from_secs(10);

impl Pacer {
    /// How many to ask for at a time, at most `most`: no more than the
    /// pace reads in [`LONGEST_PAUSE`].
    pub(super) fn batch(&self, most: usize) -> usize {
        match self.per_second {
            Some(per_second) => {
                let paced = (per_second * LONGEST_PAUSE.as_secs_f64()) as usize;
                paced.clamp(1, most)
            }
            None => most,
        }
    }

    /// Counts `n` messages read, and waits while the read is ahead of its
    /// pace.
    pub(super) async fn read(&mut self, n: u64) {
        self.read += n;
        let Some(per_second) = self.per_second else {
            return;
        };
        let due = Duration::from_secs_f64(self.read as f64 / per_second);
        let ahead = due.saturating_sub(self.started.elapsed());
        if !ahead.is_zero() {
            tokio::time::sleep(ahead).await;
        }
    }
}
