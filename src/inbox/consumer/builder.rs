//! A consumer's settings, checked, and the durable JetStream consumer
//! created or bound with them.
//!
//! An existing JetStream consumer keeps its own settings, so binding one
//! checks them too: those the inbox cannot work with are refused, with what
//! to change, before anything is read.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};

use super::pull::{pull_limit, PULL_EXPIRES};
use super::settings::{AfterCommitHook, Settings, DEFAULT_SHUTDOWN_TIMEOUT, PENDING_PER_PLACE};
use super::Consumer;
use crate::error::{Error, Result};
use crate::inbox::Inbox;

/// Settings of a [`Consumer`]; [`ConsumerBuilder::bind`] creates or binds
/// the durable JetStream consumer.
pub struct ConsumerBuilder {
    inbox: Inbox,
    jetstream: jetstream::Context,
    stream: String,
    durable: Option<String>,
    filter_subject: Option<String>,
    settings: Settings,
    ack_wait: Duration,
}

impl ConsumerBuilder {
    pub(in crate::inbox) fn new(inbox: Inbox, jetstream: jetstream::Context, stream: &str) -> Self {
        ConsumerBuilder {
            inbox,
            jetstream,
            stream: stream.to_owned(),
            durable: None,
            filter_subject: None,
            settings: Settings {
                concurrency: 16,
                max_deliveries: 5,
                retry_initial_delay: Duration::from_secs(1),
                retry_max_delay: Duration::from_secs(60),
                after_commit: None,
                shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
            },
            ack_wait: Duration::from_secs(30),
        }
    }

    /// The durable consumer's name (default: the inbox consumer's name).
    pub fn durable(mut self, name: &str) -> Self {
        self.durable = Some(name.to_owned());
        self
    }

    /// Take only messages on subjects matching `subject` (a NATS pattern:
    /// `shop.order.*`, `shop.>`). Default: every subject of the stream.
    pub fn filter_subject(mut self, subject: &str) -> Self {
        self.filter_subject = Some(subject.to_owned());
        self
    }

    /// Transactions run at once (default 16).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.settings.concurrency = concurrency;
        self
    }

    /// Attempts before a message is recorded failed and terminated
    /// (default 5).
    pub fn max_deliveries(mut self, attempts: u64) -> Self {
        self.settings.max_deliveries = attempts;
        self
    }

    /// Delay after the first failed attempt, doubling up to `max`
    /// (default 1 s, up to 60 s).
    pub fn retry_delay(mut self, initial: Duration, max: Duration) -> Self {
        self.settings.retry_initial_delay = initial;
        self.settings.retry_max_delay = max;
        self
    }

    /// Decide after each commit whether the message is acknowledged (see
    /// [`AfterCommit`](super::AfterCommit)); for fault-injection tests.
    pub fn after_commit(mut self, hook: AfterCommitHook) -> Self {
        self.settings.after_commit = Some(hook);
        self
    }

    /// How long the transactions in flight may take to finish once
    /// `shutdown` fires (default 10 s); past it they are abandoned, and
    /// [`Consumer::run`] returns within [`Consumer::stop_bound`].
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.settings.shutdown_timeout = timeout;
        self
    }

    /// How long JetStream waits for an acknowledgement before it
    /// redelivers, for a consumer this creates (default 30 s).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait;
        self
    }

    /// Checks the settings, then binds the durable consumer, creating it
    /// if it does not exist (an existing one keeps its own settings).
    pub async fn bind(self) -> Result<Consumer> {
        self.check()?;
        // Before a consumer is created with this ack wait.
        self.check_retention(self.ack_wait)?;
        let durable = self
            .durable
            .clone()
            .unwrap_or_else(|| self.inbox.name().to_owned());
        let stream = self.jetstream.get_stream(&self.stream).await.map_err(|e| {
            Error::nats(
                format!(
                    "reading stream {:?} failed (does it exist, and may this user read it?)",
                    self.stream
                ),
                e,
            )
        })?;
        let config = pull::Config {
            durable_name: Some(durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.ack_wait,
            // The inbox counts attempts and records the last one failed;
            // JetStream's own limit would end a message silently.
            max_deliver: -1,
            max_ack_pending: i64::try_from(self.held_limit().saturating_mul(PENDING_PER_PLACE))
                .unwrap_or(i64::MAX),
            filter_subject: self.filter_subject.clone().unwrap_or_default(),
            ..Default::default()
        };
        let pull: PullConsumer = stream
            .get_or_create_consumer(&durable, config)
            .await
            .map_err(|e| {
                Error::nats(
                    format!(
                        "creating or binding consumer {durable:?} on {:?} failed",
                        self.stream
                    ),
                    e,
                )
            })?;
        self.check_existing(&durable, &pull.cached_info().config)?;
        self.warn_of_fewer_pending(&durable, pull.cached_info().config.max_ack_pending);
        let ack_wait = pull.cached_info().config.ack_wait;
        self.check_retention(ack_wait)?;
        let pull_limit = pull_limit(self.held_limit(), &pull.cached_info().config);
        let nats = self.jetstream.client();
        Ok(Consumer {
            inbox: self.inbox,
            nats,
            pull,
            ack_wait,
            pull_limit,
            settings: self.settings,
        })
    }

    /// A record must outlast any redelivery of its message: one after the
    /// ack wait (a crash between commit and acknowledgement), plus the TTL
    /// monitor's minute.
    fn check_retention(&self, ack_wait: Duration) -> Result<()> {
        match self.inbox.retention {
            Some(retention) if retention < ack_wait + Duration::from_secs(60) => {
                Err(Error::Config(format!(
                    "inbox consumer: the inbox's retention ({}) must exceed the ack wait ({}) by \
                     a minute at least, or a message redelivered after a crash would be handled \
                     again",
                    humantime::format_duration(retention),
                    humantime::format_duration(ack_wait)
                )))
            }
            _ => Ok(()),
        }
    }

    fn check(&self) -> Result<()> {
        let settings = &self.settings;
        let problem = if settings.concurrency == 0 {
            Some("concurrency must be at least 1")
        } else if settings.max_deliveries == 0 {
            Some("max_deliveries must be at least 1")
        } else if settings.retry_initial_delay.is_zero()
            || settings.retry_max_delay < settings.retry_initial_delay
        {
            Some("retry delays must be above zero, the longest no shorter than the first")
        } else if self.ack_wait < Duration::from_secs(1) {
            Some("ack_wait must be at least 1s")
        } else if self.stream.is_empty() {
            Some("the stream's name must not be empty")
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::Config(format!("inbox consumer: {problem}"))),
            None => Ok(()),
        }
    }

    /// A consumer that existed keeps its own settings; refuses those the
    /// inbox cannot work with.
    fn check_existing(&self, durable: &str, config: &jetstream::consumer::Config) -> Result<()> {
        let wanted = self.filter_subject.as_deref().unwrap_or("");
        let problem = if config.ack_policy != AckPolicy::Explicit {
            Some(format!(
                "acknowledges {:?}, not each message explicitly, so a message would count as \
                 handled before its commit",
                config.ack_policy
            ))
        } else if config.filter_subject != wanted || !config.filter_subjects.is_empty() {
            Some(format!(
                "filters subjects {:?}, not {wanted:?}",
                if config.filter_subjects.is_empty() {
                    vec![config.filter_subject.clone()]
                } else {
                    config.filter_subjects.clone()
                }
            ))
        } else if config.max_deliver > 0 {
            // Deliveries are not attempts: a hand-back at shutdown or an
            // ack wait run out takes one too.
            Some(format!(
                "ends a message after {} deliveries itself, silently, where the inbox records \
                 it failed",
                config.max_deliver
            ))
        } else if !config.max_expires.is_zero() && config.max_expires < PULL_EXPIRES {
            Some(format!(
                "refuses pulls that wait longer than {:?}; the inbox's wait {PULL_EXPIRES:?}",
                config.max_expires
            ))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(Error::Config(format!(
                "the existing JetStream consumer {durable:?} on {:?} {problem}; delete it \
                 (nats consumer rm) to have it created anew, or name another with durable()",
                self.stream
            ))),
            None => Ok(()),
        }
    }

    fn held_limit(&self) -> usize {
        self.settings.held_limit()
    }

    /// An existing consumer that lets JetStream deliver fewer messages
    /// unacknowledged than this one may hold stops delivering sooner while
    /// a key waits, and every key waits with it.
    fn warn_of_fewer_pending(&self, durable: &str, max_ack_pending: i64) {
        let room = self.held_limit().saturating_mul(PENDING_PER_PLACE);
        if usize::try_from(max_ack_pending).is_ok_and(|pending| pending > 0 && pending < room) {
            tracing::warn!(
                durable,
                max_ack_pending,
                room,
                "the existing JetStream consumer delivers at most max_ack_pending messages \
                 unacknowledged: a key that waits on its record or a retry holds every other \
                 key up once its messages fill that; raise it (nats consumer edit) to the room \
                 this consumer has"
            );
        }
    }
}
