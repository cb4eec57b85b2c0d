//! Delivering what a pass claimed, through a pipeline of its own.
//!
//! The pass's pipeline publishes and completes its messages as the
//! stream's does, each completion matching the pass's claim. A message
//! another pipeline took up since the pass read it is left to that one,
//! its claim given back at once (see [`super::gate`]).

use crate::error::{Error, Result};
use crate::work::{Tally, Work};

use super::gate::{KeyGate, Kind};
use super::Sweeper;

/// What a pass's delivery did.
pub(super) struct Delivered {
    /// What became of the messages it took on.
    pub tally: Tally,
    /// How many it took on: those claimed, less those left to other
    /// pipelines.
    pub taken: u64,
    /// The pass's claim is left on messages it did not complete.
    pub left_claimed: bool,
}

impl Sweeper {
    /// Publishes and completes `works`, the messages a pass claimed.
    pub(super) async fn deliver(&self, works: Vec<Work>, gate: &mut KeyGate) -> Result<Delivered> {
        let mut delivered = Delivered {
            tally: Tally::default(),
            taken: works.len() as u64,
            left_claimed: false,
        };
        if works.is_empty() {
            return Ok(delivered);
        }
        let running = self.pipeline.start(None);
        for mut work in works {
            let Some(decoded) = &work.message else {
                continue;
            };
            let key = decoded.key.as_deref();
            if gate.leaves(&self.pipeline.underway, &decoded.id, key) {
                // Should this fail, the pass's release of its claim covers it.
                if let Err(error) = self.release_one(&decoded.id, work.claim).await {
                    tracing::debug!(%error, "could not give back one claim at once");
                    delivered.left_claimed = true;
                }
                delivered.taken -= 1;
                continue;
            }
            gate.sends(key);
            work.release = gate.kind() == Kind::Release;
            if running.input.send(work).await.is_err() {
                break;
            }
        }
        drop(running.input);
        delivered.tally = running
            .done
            .await
            .map_err(|e| Error::Internal(format!("a sweep pass stopped unexpectedly: {e}")))?;
        delivered.left_claimed |= delivered.tally.total() < delivered.taken;
        Ok(delivered)
    }
}
