//! A transaction's commit, as the drivers' specifications make it: a
//! commit whose result is unknown (`UnknownTransactionCommitResult`) is
//! sent again, since the server answers a second commit of one transaction
//! with the first one's result. The inbox's two kinds of transaction (a
//! message's, and the count before a run) commit through it.

use std::time::{Duration, Instant};

use mongodb::error::UNKNOWN_TRANSACTION_COMMIT_RESULT;
use mongodb::ClientSession;

use crate::error::is_max_time_expired;

/// How long a transaction is run again, or a commit tried again, after
/// transient errors: the limit of the drivers' convenient transaction API.
pub(crate) const RETRY_LIMIT: Duration = Duration::from_secs(120);

/// Commits, again while the result is unknown, until [`RETRY_LIMIT`] after
/// the transaction's first start (`started`), as the drivers do.
pub(super) async fn commit(
    session: &mut ClientSession,
    started: Instant,
) -> mongodb::error::Result<()> {
    loop {
        match session.commit_transaction().await {
            Ok(()) => return Ok(()),
            Err(error)
                if error.contains_label(UNKNOWN_TRANSACTION_COMMIT_RESULT)
                    // A commit that timed out is not tried again.
                    && !is_max_time_expired(&error)
                    && started.elapsed() < RETRY_LIMIT =>
            {
                tracing::debug!(error = %error, "commit result unknown; committing again");
            }
            Err(error) => return Err(error),
        }
    }
}
