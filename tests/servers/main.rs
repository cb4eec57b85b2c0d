//! Integration tests against a real MongoDB-compatible server and a real
//! nats-server (`MONGODB_URI`, `NATS_URL`; `scripts/services.sh` starts
//! both). One binary, so the crate is linked once for all of them; each
//! test works in a database and under a subject prefix of its own.

#[path = "../common/mod.rs"]
mod common;

mod audit;
mod cloudevents;
mod contract;
mod coordination;
mod inbox;
mod leader;
mod operate;
mod order;
mod partitions;
mod permissions;
mod poison;
mod process;
mod prometheus;
mod relay;
mod replay;
mod secured;
mod sharded;
mod subjects;
mod sweep;
mod writers;
