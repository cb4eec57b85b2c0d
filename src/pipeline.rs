//! The stages assembled: a publish stage and a completion stage joined by
//! bounded channels, one recipe for the change stream's long-lived pipeline
//! and for each sweep pass. Channel capacity follows `--batch-size`, so a
//! slow stage holds back the one before it rather than piling up memory.

use std::sync::Arc;
use std::time::Duration;

use bson::Document;
use mongodb::Collection;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::CheckpointStore;
use crate::complete::CompletionStage;
use crate::config::RetryPolicy;
use crate::observe::Metrics;
use crate::order::KeyOrder;
use crate::partition::Partition;
use crate::publish::stage::PublishStage;
use crate::publish::Publisher;
use crate::stop::Stop;
use crate::work::{Acknowledged, Budget, Feed, LastDelivery, Tally, Tenure, Underway, Unmarkable};

/// Everything a publish stage and a completion stage need: one recipe for
/// the change stream's long-lived pipeline and for each sweep pass.
#[derive(Clone)]
pub(crate) struct Pipeline {
    pub publisher: Arc<dyn Publisher>,
    pub outbox: Collection<Document>,
    pub max_in_flight: usize,
    pub batch_size: usize,
    pub checkpoint_interval: Duration,
    pub mark_delay: Duration,
    pub retry: RetryPolicy,
    pub metrics: Metrics,
    pub unmarkable: Unmarkable,
    pub budget: Budget,
    /// The messages under way in every pipeline of the relay.
    pub underway: Underway,
    pub deliveries: LastDelivery,
    /// The term the pipelines deliver in, with its per-key order; `None`
    /// outside a term (no order by key is kept, nothing is fenced by a term).
    pub tenure: Option<Tenure>,
    /// The partition of the outbox the pipelines deliver: every query of
    /// their sources is narrowed to it.
    pub partition: Partition,
    /// What NATS acknowledged to the relay and is not marked yet.
    pub acknowledged: Acknowledged,
    /// The graceful stop: sources read nothing new, what was read is
    /// published and recorded, and waits for the broker end (see
    /// [`Stop`]).
    pub shutdown: CancellationToken,
    /// The stop at once (the grace time is over, the lease is lost, or a
    /// run's time is up): publish nothing more and write nothing more.
    pub abandon: CancellationToken,
}

/// A started pipeline: feed it work, drop the sender, await the tally.
pub(crate) struct Running {
    pub input: Feed,
    pub done: JoinHandle<Tally>,
}

impl Pipeline {
    /// The term's per-key order, if the pipeline is in a term.
    pub fn order(&self) -> Option<&KeyOrder> {
        self.tenure.as_ref().map(|tenure| &tenure.order)
    }

    /// The same pipeline, stopping with `stop`.
    pub fn with_stop(&self, stop: &Stop) -> Pipeline {
        Pipeline {
            shutdown: stop.shutdown.clone(),
            abandon: stop.abandon.clone(),
            ..self.clone()
        }
    }

    /// Starts the two stages. Resume tokens in the work are stored in
    /// `checkpoints` (the change stream's pipeline has one; sweeps do not).
    pub fn start(&self, checkpoints: Option<CheckpointStore>) -> Running {
        let (input, work) = mpsc::channel(self.batch_size);
        let (finished_tx, finished) = mpsc::channel(self.batch_size);
        let publish = PublishStage {
            publisher: self.publisher.clone(),
            max_in_flight: self.max_in_flight,
            shutdown: self.shutdown.clone(),
            abandon: self.abandon.clone(),
            metrics: self.metrics.clone(),
            deliveries: self.deliveries.clone(),
            tenure: self.tenure.clone(),
            acknowledged: self.acknowledged.clone(),
        };
        let complete = CompletionStage {
            outbox: self.outbox.clone(),
            checkpoints,
            batch_size: self.batch_size,
            checkpoint_interval: self.checkpoint_interval,
            mark_delay: self.mark_delay,
            budget: self.budget.clone(),
            retry: self.retry.clone(),
            abandon: self.abandon.clone(),
            metrics: self.metrics.clone(),
            unmarkable: self.unmarkable.clone(),
            deliveries: self.deliveries.clone(),
            tenure: self.tenure.clone(),
            acknowledged: self.acknowledged.clone(),
        };
        let publishing = tokio::spawn(publish.run(work, finished_tx));
        let done = tokio::spawn(async move {
            let tally = complete.run(finished).await;
            if let Err(error) = publishing.await {
                tracing::error!(%error, "the publish stage stopped unexpectedly");
            }
            tally
        });
        let input = Feed::new(input, self.budget.clone(), self.underway.clone());
        Running { input, done }
    }
}
