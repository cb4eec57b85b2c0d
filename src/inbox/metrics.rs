//! What an inbox consumer counts, named and rendered as the relay's
//! metrics are (`outbox_inbox_*`, the Prometheus text format), each by
//! consumer, so several consumers in one service share one registry.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerLabel {
    consumer: String,
}

#[derive(Clone)]
struct HandlerBuckets;

impl MetricConstructor<Histogram> for HandlerBuckets {
    fn new_metric(&self) -> Histogram {
        // 100 µs to about 52 s.
        Histogram::new(exponential_buckets(0.0001, 2.0, 20))
    }
}

struct Inner {
    registry: Registry,
    handled: Family<ConsumerLabel, Counter>,
    repeats: Family<ConsumerLabel, Counter>,
    failed: Family<ConsumerLabel, Counter>,
    retried: Family<ConsumerLabel, Counter>,
    handler_time: Family<ConsumerLabel, Histogram, HandlerBuckets>,
}

/// One consumer's counters at a moment ([`InboxMetrics::counts`]); each
/// counts since the process started, as its `outbox_inbox_*_total` does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxCounts {
    /// Messages handled: their effects and inbox record committed.
    pub handled: u64,
    /// Messages acknowledged without running the handler: handled before.
    pub repeats: u64,
    /// Messages given up on after their last attempt.
    pub failed: u64,
    /// Handler failures followed by another attempt.
    pub retried: u64,
}

/// The inbox consumers' metrics; clones share them.
#[derive(Clone)]
pub struct InboxMetrics(Arc<Inner>);

impl std::fmt::Debug for InboxMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxMetrics").finish_non_exhaustive()
    }
}

impl Default for InboxMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl InboxMetrics {
    /// A fresh set, all names prefixed `outbox_inbox_`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("outbox_inbox");
        let handled = Family::<ConsumerLabel, Counter>::default();
        let repeats = Family::<ConsumerLabel, Counter>::default();
        let failed = Family::<ConsumerLabel, Counter>::default();
        let retried = Family::<ConsumerLabel, Counter>::default();
        let handler_time = Family::new_with_constructor(HandlerBuckets);
        registry.register(
            "handled",
            "Messages handled: their effects and inbox record committed",
            handled.clone(),
        );
        registry.register(
            "repeats",
            "Messages acknowledged without running the handler: the inbox had them handled",
            repeats.clone(),
        );
        registry.register(
            "failed",
            "Messages given up on after their last attempt, recorded failed and terminated",
            failed.clone(),
        );
        registry.register(
            "retried",
            "Handler failures followed by another attempt",
            retried.clone(),
        );
        registry.register_with_unit(
            "handler",
            "Time the handler took, in the attempt that committed",
            Unit::Seconds,
            handler_time.clone(),
        );
        InboxMetrics(Arc::new(Inner {
            registry,
            handled,
            repeats,
            failed,
            retried,
            handler_time,
        }))
    }

    /// Renders every metric in the Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut text, &self.0.registry);
        text
    }

    /// What `consumer` has counted so far, as numbers: for a test, a batch
    /// job or a log line, without reading the text format.
    pub fn counts(&self, consumer: &str) -> InboxCounts {
        let label = Self::label(consumer);
        let count = |family: &Family<ConsumerLabel, Counter>| {
            family.get(&label).map_or(0, |counter| counter.get())
        };
        InboxCounts {
            handled: count(&self.0.handled),
            repeats: count(&self.0.repeats),
            failed: count(&self.0.failed),
            retried: count(&self.0.retried),
        }
    }

    fn label(consumer: &str) -> ConsumerLabel {
        ConsumerLabel {
            consumer: consumer.to_owned(),
        }
    }

    pub(crate) fn handled(&self, consumer: &str, handler_time: Duration) {
        let label = Self::label(consumer);
        self.0.handled.get_or_create(&label).inc();
        let histogram = self.0.handler_time.get_or_create(&label);
        histogram.observe(handler_time.as_secs_f64());
    }

    pub(crate) fn repeat(&self, consumer: &str) {
        self.0.repeats.get_or_create(&Self::label(consumer)).inc();
    }

    /// Shows the consumer's counters at 0 before its first message, so a
    /// rule on their increase sees the first one (a series born at 1 has
    /// no increase to see).
    pub(crate) fn count_from_zero(&self, consumer: &str) {
        let label = Self::label(consumer);
        let counters = [
            &self.0.handled,
            &self.0.repeats,
            &self.0.failed,
            &self.0.retried,
        ];
        for counter in counters {
            drop(counter.get_or_create(&label));
        }
    }

    pub(crate) fn failed(&self, consumer: &str) {
        self.0.failed.get_or_create(&Self::label(consumer)).inc();
    }

    pub(crate) fn retried(&self, consumer: &str) {
        self.0.retried.get_or_create(&Self::label(consumer)).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_built_consumer_counts_from_zero() {
        let metrics = InboxMetrics::new();
        metrics.count_from_zero("billing");
        let text = metrics.render();
        for counter in ["handled", "repeats", "failed", "retried"] {
            let line = format!("outbox_inbox_{counter}_total{{consumer=\"billing\"}} 0");
            assert!(text.contains(&line), "{line} in {text}");
        }
    }

    #[test]
    fn the_counts_are_the_rendered_counters_of_their_consumer() {
        let metrics = InboxMetrics::new();
        metrics.handled("billing", Duration::from_millis(3));
        metrics.handled("billing", Duration::from_millis(3));
        metrics.repeat("billing");
        metrics.retried("shipping");
        let counts = metrics.counts("billing");
        let expected = InboxCounts {
            handled: 2,
            repeats: 1,
            failed: 0,
            retried: 0,
        };
        assert_eq!(counts, expected);
        assert_eq!(metrics.counts("shipping").retried, 1);
        assert_eq!(metrics.counts("nobody"), InboxCounts::default());
        let text = metrics.render();
        assert!(
            text.contains("outbox_inbox_handled_total{consumer=\"billing\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("outbox_inbox_repeats_total{consumer=\"billing\"} 1"),
            "{text}"
        );
    }
}
