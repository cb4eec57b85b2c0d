//! Waiting out a server that is down, shared by every stage.
//!
//! A relay's job is to outlast outages of MongoDB and NATS, so each stage
//! retries what a server refuses for a passing reason. Two rules apply
//! everywhere: the wait between tries grows (so a dead server is not
//! hammered), and the log speaks once when a server goes away and once when
//! it comes back, not once per try or per message.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use backoff::backoff::Backoff;
use backoff::ExponentialBackoff;
use tokio_util::sync::CancellationToken;

/// Backoff for reconnect-style waits: 100 ms growing to 5 s, with jitter, forever.
pub(crate) fn reconnect_backoff() -> ExponentialBackoff {
    ExponentialBackoff {
        initial_interval: Duration::from_millis(100),
        max_interval: Duration::from_secs(5),
        multiplier: 2.0,
        randomization_factor: 0.2,
        max_elapsed_time: None,
        ..ExponentialBackoff::default()
    }
}

/// How a failure reads in a log line: in one line, and a driver's error
/// without its dump of the server's reply (see [`crate::error::brief`]).
pub(crate) trait Shown {
    fn shown(&self) -> String;
}

impl Shown for mongodb::error::Error {
    fn shown(&self) -> String {
        crate::error::brief(self)
    }
}

impl Shown for crate::error::Error {
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for String {
    fn shown(&self) -> String {
        self.clone()
    }
}

impl Shown for &str {
    fn shown(&self) -> String {
        (*self).to_owned()
    }
}

impl<Kind> Shown for async_nats::error::Error<Kind>
where
    Kind: Clone + std::fmt::Debug + Display + PartialEq,
{
    fn shown(&self) -> String {
        self.to_string()
    }
}

impl Shown for Box<dyn std::error::Error + Send + Sync> {
    fn shown(&self) -> String {
        self.to_string()
    }
}

/// Tracks whether a dependency is failing, and logs only the changes.
#[derive(Debug)]
pub(crate) struct Outage {
    what: &'static str,
    failing: bool,
}

impl Outage {
    pub fn new(what: &'static str) -> Self {
        Outage {
            what,
            failing: false,
        }
    }

    /// Records a failure; logs it if this starts an outage.
    pub fn failed(&mut self, error: &impl Shown) {
        if !self.failing {
            tracing::warn!(error = %error.shown(), "{}: failing; retrying with backoff", self.what);
            self.failing = true;
        }
    }

    /// Records a success; logs it if this ends an outage.
    pub fn recovered(&mut self) {
        if self.failing {
            tracing::info!("{}: working again", self.what);
            self.failing = false;
        }
    }
}

/// Sleeps for the next backoff interval. Returns false if `shutdown` fires first.
pub(crate) async fn back_off(
    backoff: &mut ExponentialBackoff,
    shutdown: &CancellationToken,
) -> bool {
    let wait = backoff.next_backoff().unwrap_or(Duration::from_secs(5));
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// Runs `attempt` until it succeeds, backing off between tries. Returns
/// `None` if `shutdown` fires while waiting.
pub(crate) async fn until_ok<T, E, F, Fut>(
    what: &'static str,
    shutdown: &CancellationToken,
    attempt: F,
) -> Option<T>
where
    E: Shown,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    until_settled(what, shutdown, attempt, |_| false)
        .await?
        .ok()
}

/// Runs `attempt` until it succeeds or fails in a way no retry can mend
/// (`is_final`), backing off between tries of passing failures. Returns
/// `None` if `shutdown` fires while waiting.
pub(crate) async fn until_settled<T, E, F, Fut>(
    what: &'static str,
    shutdown: &CancellationToken,
    attempt: F,
    is_final: impl Fn(&E) -> bool,
) -> Option<Result<T, E>>
where
    E: Shown,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    settle(what, (shutdown, Cut::BetweenTries), attempt, is_final).await
}

/// Where a token's firing ends the tries of [`settle`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// Between tries: a try under way runs to its end.
    BetweenTries,
    /// Also during a try: for writes that must not hold up a stop past its
    /// grace when MongoDB leaves them unanswered. Whether a try cut short
    /// took effect is not known, as after a crash, and is left to what
    /// makes a crash safe.
    AnyTime,
}

/// [`until_settled`], with the token's reach stated.
pub(crate) async fn settle<T, E, F, Fut>(
    what: &'static str,
    (stop, cut): (&CancellationToken, Cut),
    mut attempt: F,
    is_final: impl Fn(&E) -> bool,
) -> Option<Result<T, E>>
where
    E: Shown,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut outage = Outage::new(what);
    let mut backoff = reconnect_backoff();
    loop {
        let tried = attempt();
        let outcome = match cut {
            Cut::BetweenTries => tried.await,
            Cut::AnyTime => tokio::select! {
                _ = stop.cancelled() => return None,
                outcome = tried => outcome,
            },
        };
        match outcome {
            Ok(value) => {
                outage.recovered();
                return Some(Ok(value));
            }
            Err(error) if is_final(&error) => {
                outage.recovered();
                return Some(Err(error));
            }
            Err(error) => {
                outage.failed(&error);
                if !back_off(&mut backoff, stop).await {
                    return None;
                }
            }
        }
    }
}
