//! What a consumer is set to, and the bounds that follow from it: the
//! builder fills the settings in, the running consumer reads them.
//!
//! They stand apart from the builder so that the running consumer's state,
//! which keeps them, does not depend on the builder, which makes it.

use std::sync::Arc;
use std::time::Duration;

use crate::inbox::Delivery;

#[derive(Clone)]
pub(super) struct Settings {
    pub(super) concurrency: usize,
    pub(super) max_deliveries: u64,
    pub(super) retry_initial_delay: Duration,
    pub(super) retry_max_delay: Duration,
    pub(super) after_commit: Option<AfterCommitHook>,
    pub(super) shutdown_timeout: Duration,
}

/// What the consumer does once a message's transaction has committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCommit {
    /// Acknowledge it, as always.
    Acknowledge,
    /// Leave it unacknowledged and let it go, as a process that crashed
    /// right after the commit would: JetStream redelivers it after the ack
    /// wait, and the inbox skips it. For fault-injection tests.
    Abandon,
}

/// Decides, per message, what happens after its commit.
pub type AfterCommitHook = Arc<dyn Fn(&Delivery) -> AfterCommit + Send + Sync>;

impl Settings {
    /// How many messages may be held (read and not yet settled) at once.
    pub(super) fn held_limit(&self) -> usize {
        self.concurrency.saturating_mul(HELD_PER_TRANSACTION)
    }
}

/// Messages held per concurrent transaction: the look-ahead that lets other
/// keys go on while one key's line is long.
const HELD_PER_TRANSACTION: usize = 16;

/// JetStream's bound on the messages a consumer created here has
/// unacknowledged (`max_ack_pending`), per place among the held: room for
/// the messages behind keys that wait, which hold no place (see [`Line`](super::held::Line)).
pub(super) const PENDING_PER_PLACE: usize = 8;

/// How long the consumer waits for the transactions in flight once
/// `shutdown` fires, unless told otherwise: the relay's default too.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);
