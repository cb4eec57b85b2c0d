//! How much a consumer has left, as JetStream counts it: asked of the
//! server, not of the running consumer, so it may be read from anywhere
//! while the consumer runs, or after.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;

use crate::error::{Error, Result};

/// How much a consumer has left to handle, as JetStream counts it: for a
/// batch job that stops once it has caught up, or a test that waits for
/// it. Clones look at the same consumer.
#[derive(Clone)]
pub struct Backlog {
    pub(super) pull: PullConsumer,
}

impl Backlog {
    /// Messages not yet done with: those JetStream has still to deliver,
    /// and those delivered but not acknowledged (being handled, or waiting
    /// to be tried again). A message handled, skipped as a repeat or given
    /// up on counts no more.
    pub async fn remaining(&self) -> Result<u64> {
        let mut pull = self.pull.clone();
        let name = self.pull.cached_info().name.clone();
        let info = pull
            .info()
            .await
            .map_err(|e| Error::nats(format!("reading consumer {name:?}'s state failed"), e))?;
        let unacknowledged = u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX);
        Ok(info.num_pending.saturating_add(unacknowledged))
    }

    /// Returns once nothing is left ([`Backlog::remaining`] is 0), asking
    /// JetStream every `every`; a question NATS fails to answer (away a
    /// moment) is asked again. It waits as long as that takes: bound it
    /// with `tokio::time::timeout`. Messages published later are not waited
    /// for.
    pub async fn caught_up(&self, every: Duration) {
        loop {
            match self.remaining().await {
                Ok(0) => return,
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(error = %error, "reading the backlog failed; asking again");
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}
