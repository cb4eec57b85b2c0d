//! How work stops, at two levels that every part of the relay names the
//! same way:
//!
//! - **shutdown**, the graceful stop: sources read nothing new, and what
//!   was read is published and recorded;
//! - **abandon**, the stop at once: nothing more is published or written
//!   (the grace time is over, the lease is lost, or a run's time is up).
//!
//! Abandoning shuts down too, so nothing that waits on `shutdown` outlives
//! `abandon`. A term's pair lives inside the relay's: the relay's stop ends
//! the term's, and a term can end on its own when its lease is lost.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// The two stops of one scope (the relay, a term, one sweep run).
#[derive(Debug, Clone)]
pub(crate) struct Stop {
    pub shutdown: CancellationToken,
    pub abandon: CancellationToken,
}

impl Stop {
    /// The relay's: `shutdown` comes from outside (a signal), and
    /// `abandon` fires `grace` after it, and only then, so the rule holds
    /// without a link.
    pub fn after_grace(shutdown: CancellationToken, grace: Duration) -> Stop {
        let abandon = CancellationToken::new();
        tokio::spawn(abandon_after_grace(
            shutdown.clone(),
            abandon.clone(),
            grace,
        ));
        Stop { shutdown, abandon }
    }

    /// A scope of its own, inside `self`: it stops when `self` does, and
    /// may be abandoned (and so shut down) alone.
    pub fn inner(&self) -> Stop {
        // A token has one parent, so the term's shutdown follows its
        // abandon by a task of its own.
        let (shutdown, abandon) = (self.shutdown.child_token(), self.abandon.child_token());
        tokio::spawn(shut_down_when_abandoned(abandon.clone(), shutdown.clone()));
        Stop { shutdown, abandon }
    }

    /// A scope of its own inside `self`, as [`Stop::inner`], that is also
    /// abandoned `grace` after it alone is shut down: a partition handed
    /// over has the relay's grace to finish.
    pub fn inner_with_grace(&self, grace: Duration) -> Stop {
        let inner = self.inner();
        tokio::spawn(abandon_after_grace(
            inner.shutdown.clone(),
            inner.abandon.clone(),
            grace,
        ));
        inner
    }

    /// A scope of its own, with nothing outside it.
    pub fn new() -> Stop {
        let abandon = CancellationToken::new();
        Stop {
            shutdown: abandon.child_token(),
            abandon,
        }
    }
}

/// Abandons `grace` after `shutdown` fires; ends early if abandoned first.
async fn abandon_after_grace(
    shutdown: CancellationToken,
    abandon: CancellationToken,
    grace: Duration,
) {
    tokio::select! {
        _ = abandon.cancelled() => {}
        _ = async {
            shutdown.cancelled().await;
            tokio::time::sleep(grace).await;
        } => abandon.cancel(),
    }
}

/// Shuts down when abandoned; ends early if shut down first.
async fn shut_down_when_abandoned(abandon: CancellationToken, shutdown: CancellationToken) {
    tokio::select! {
        _ = abandon.cancelled() => shutdown.cancel(),
        _ = shutdown.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn abandoning_a_scope_shuts_it_down_and_no_other() {
        let relay = Stop::after_grace(CancellationToken::new(), Duration::from_secs(3600));
        let term = relay.inner();
        term.abandon.cancel();
        tokio::time::timeout(Duration::from_secs(10), term.shutdown.cancelled())
            .await
            .expect("the term shuts down");
        assert!(!relay.shutdown.is_cancelled() && !relay.abandon.is_cancelled());
        let run = Stop::new();
        run.abandon.cancel();
        assert!(run.shutdown.is_cancelled());
        let run = Stop::new();
        run.shutdown.cancel();
        assert!(!run.abandon.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn the_relays_stop_reaches_its_terms_and_abandons_after_the_grace() {
        let relay = Stop::after_grace(CancellationToken::new(), Duration::from_secs(10));
        let term = relay.inner();
        relay.shutdown.cancel();
        assert!(term.shutdown.is_cancelled());
        assert!(!term.abandon.is_cancelled());
        tokio::time::timeout(Duration::from_secs(60), term.abandon.cancelled())
            .await
            .expect("abandoned after the grace");
    }
}
