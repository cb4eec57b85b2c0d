//! Watching the relay: metrics, health endpoints, and the collector that
//! reads the outbox's depths and the oplog's headroom.
//!
//! The two signals operators alert on are how much waits (pending depth and
//! the oldest pending message's age) and how much has been given up (failed
//! depth). Neither can be counted from inside the pipeline, since other
//! writers and other relays change the collection, so a collector reads
//! them from MongoDB every collect interval. Everything else is recorded by
//! the stages as it happens.

mod collector;
mod metrics;
mod server;

pub(crate) use collector::collect;
pub use collector::Collector;
pub use metrics::{FailureKind, Metrics, Origin, Readiness, Role, Server};
pub(crate) use metrics::{HeldKeysReport, PausedDelivery};
pub use server::{serve, Endpoints};

use mongodb::event::sdam::SdamEvent;
use mongodb::event::EventHandler;

/// A MongoDB event handler that keeps `metrics` told whether the driver
/// sees a server it can write to.
pub(crate) fn reachability_handler(metrics: Metrics) -> EventHandler<SdamEvent> {
    EventHandler::callback(move |event| {
        if let SdamEvent::TopologyDescriptionChanged(change) = event {
            metrics.mongodb_reachable(change.new_description.has_writable_server());
        }
    })
}
