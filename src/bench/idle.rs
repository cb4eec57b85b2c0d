//! A quiet relay, measured: what a leader with nothing to deliver, and a
//! standby beside it, cost the host and MongoDB.
//!
//! Each runs with the relay's defaults (the latency runs' shorter
//! change-stream wait and longer collect interval are left out), after a
//! start-up of [`SETTLING`], over a window of `--idle`. The CPU is the
//! process's own (user and system, `/proc`); MongoDB's operations are the
//! server's `serverStatus` opcounters before and after, less the two reads
//! of them, and so include the driver's monitoring checks (`hello`), which
//! a command monitor does not see. A leader's `getMore`s are its change
//! stream's reads, one every `--max-await-time` while nothing commits, and
//! the group's watch's, one every 30 s; they are given apart from the
//! rest. The standby's figures are the window with both running less the
//! leader's alone.

use std::time::Duration;

use bson::{doc, Document};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::load::{self, Clock};
use super::process::RelayProcess;
use super::{Bench, Keys};
use crate::error::{Error, Result};

/// How long a relay runs before its window opens (a shorter window's
/// length, for a quick look): the first rounds, the held keys read back
/// through the term's first leases, and the collector's first reads are a
/// start's, not a quiet relay's.
const SETTLING: Duration = Duration::from_secs(30);

/// What a quiet relay costs.
#[derive(Debug, Clone, Serialize)]
pub struct IdleBench {
    /// The window each figure is measured over.
    pub seconds: f64,
    pub leader: IdleCost,
    pub standby: IdleCost,
}

/// One quiet relay's cost.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct IdleCost {
    /// Its CPU time as a share of one core, in percent.
    pub cpu_percent: f64,
    /// MongoDB operations a second, `getMore`s left out.
    pub operations: f64,
    /// `getMore`s a second.
    pub get_mores: f64,
    /// The operations by counter (`query`, `command`, `update`, ...), a
    /// second.
    pub by_counter: Counters,
}

/// `serverStatus.opcounters`, or a difference of two.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Counters {
    pub insert: f64,
    pub query: f64,
    pub update: f64,
    pub delete: f64,
    pub getmore: f64,
    pub command: f64,
}

impl Counters {
    fn of(opcounters: &Document) -> Self {
        let read = |name: &str| match opcounters.get(name) {
            Some(bson::Bson::Int32(n)) => f64::from(*n),
            Some(bson::Bson::Int64(n)) => *n as f64,
            Some(bson::Bson::Double(n)) => *n,
            _ => 0.0,
        };
        Counters {
            insert: read("insert"),
            query: read("query"),
            update: read("update"),
            delete: read("delete"),
            getmore: read("getmore"),
            command: read("command"),
        }
    }

    /// `self` less `earlier`, a second over `seconds`.
    fn rate_since(&self, earlier: &Counters, seconds: f64) -> Counters {
        let per = |now: f64, then: f64| (now - then) / seconds;
        Counters {
            insert: per(self.insert, earlier.insert),
            query: per(self.query, earlier.query),
            update: per(self.update, earlier.update),
            delete: per(self.delete, earlier.delete),
            getmore: per(self.getmore, earlier.getmore),
            command: per(self.command, earlier.command),
        }
    }

    /// `self` less `other`, counter by counter.
    fn less(&self, other: &Counters) -> Counters {
        self.rate_since(other, 1.0)
    }

    fn without_get_mores(&self) -> f64 {
        self.insert + self.query + self.update + self.delete + self.command
    }
}

impl IdleCost {
    fn of(cpu_seconds: f64, counters: Counters, seconds: f64) -> Self {
        IdleCost {
            cpu_percent: cpu_seconds / seconds * 100.0,
            operations: counters.without_get_mores(),
            get_mores: counters.getmore,
            by_counter: counters,
        }
    }
}

impl Bench<'_> {
    /// A quiet leader over `window`, then a standby beside it over another.
    pub(super) async fn idle(&self, window: Duration) -> Result<IdleBench> {
        let (prefix, collection) = self.names("idle");
        self.stream_for(&prefix).await?;
        let arrived = Clock::default();
        let stop = CancellationToken::new();
        let _stop_receiver = stop.clone().drop_guard();
        load::subscribe(&self.nats, &prefix, arrived.clone(), stop.clone()).await?;
        let leader = self.quiet_relay("idle-leader", &collection, &prefix)?;
        // The leader delivers before it is measured doing nothing.
        self.settle(&collection, Keys::None, &arrived, "idle leader")
            .await?;
        tokio::time::sleep(SETTLING.min(window)).await;
        tracing::info!(seconds = window.as_secs(), "measuring a quiet leader");
        let (alone, cpu) = self.measure(window, &[&leader]).await?;
        let leader_cost = IdleCost::of(cpu[0], alone, window.as_secs_f64());
        let standby = self.quiet_relay("idle-standby", &collection, &prefix)?;
        self.stood_by(&standby).await?;
        tokio::time::sleep(SETTLING.min(window)).await;
        tracing::info!(seconds = window.as_secs(), "measuring a standby beside it");
        let (both, cpu) = self.measure(window, &[&leader, &standby]).await?;
        let standby_cost = IdleCost::of(cpu[1], both.less(&alone), window.as_secs_f64());
        standby.stop(Duration::from_secs(30)).await;
        leader.stop(Duration::from_secs(30)).await;
        Ok(IdleBench {
            seconds: window.as_secs_f64(),
            leader: leader_cost,
            standby: standby_cost,
        })
    }

    /// A relay with the defaults a deployment runs with.
    fn quiet_relay(&self, tag: &str, collection: &str, prefix: &str) -> Result<RelayProcess> {
        RelayProcess::start(
            &self.config.relay_binary,
            &self.relay_args(collection, prefix),
            &self.config.output.join(format!("relay-{tag}.log")),
        )
    }

    /// Waits until `standby` reports itself ready (standing by).
    async fn stood_by(&self, standby: &RelayProcess) -> Result<()> {
        let limit = Duration::from_secs(60);
        let ready = async {
            while standby.ready().await != Some(true) {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(limit, ready).await.map_err(|_| {
            Error::Bench(format!(
                "the idle standby was not ready within {limit:?}; see its log in {}",
                self.config.output.display()
            ))
        })
    }

    /// The server's operations a second over `window`, and each of
    /// `relays`' CPU seconds in it.
    async fn measure(
        &self,
        window: Duration,
        relays: &[&RelayProcess],
    ) -> Result<(Counters, Vec<f64>)> {
        let before = self.opcounters().await?;
        let cpu_before: Vec<f64> = relays.iter().map(|r| r.usage().cpu_seconds).collect();
        tokio::time::sleep(window).await;
        let cpu: Vec<f64> = relays
            .iter()
            .zip(cpu_before)
            .map(|(relay, before)| relay.usage().cpu_seconds - before)
            .collect();
        let mut after = self.opcounters().await?;
        // The second read is counted in the window; the first before it.
        after.command -= 1.0;
        Ok((after.rate_since(&before, window.as_secs_f64()), cpu))
    }

    async fn opcounters(&self) -> Result<Counters> {
        let status = self
            .client
            .database("admin")
            .run_command(doc! { "serverStatus": 1, "opcounters": 1 })
            .await
            .map_err(|e| Error::mongo("reading serverStatus for the idle figures failed", e))?;
        let opcounters = status.get_document("opcounters").map_err(|_| {
            Error::Bench("serverStatus has no opcounters: the idle figures need them".to_owned())
        })?;
        Ok(Counters::of(opcounters))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_leave_get_mores_apart_and_count_a_second() {
        let before = Counters::of(&doc! { "query": 10_i64, "command": 5, "getmore": 100_i64 });
        let after = Counters::of(&doc! { "query": 40_i64, "command": 35, "getmore": 220_i64 });
        let cost = IdleCost::of(0.06, after.rate_since(&before, 60.0), 60.0);
        assert_eq!(cost.operations, 1.0);
        assert_eq!(cost.get_mores, 2.0);
        assert!((cost.cpu_percent - 0.1).abs() < 1e-9);
    }
}
