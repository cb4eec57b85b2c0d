//! Errors a replica set returns, as MongoDB's own drivers test for them:
//! each scenario starts a SecantusDB of its own with
//! `--enable-test-commands` and arms `failCommand`, scoped by `appName` to
//! the relay under test, on the commands that relay sends, while a writer
//! commits messages in transactions. A core-NATS subscription counts every
//! publish, so a repeat that JetStream drops still counts: each scenario
//! asserts nothing lost, nothing the stream never committed, each key in
//! order, and repeats within the bound docs/guarantees.md states for that
//! fault, and writes its figures to `target/fault-report.jsonl`.
//!
//! The scenarios run one at a time, as the process faults do.

#[path = "../common/mod.rs"]
mod common;

use std::time::Instant;

use common::failpoint::{self, Failure, RESUMABLE};
use common::scenario::*;
use common::{free_port, ready_as, RelayProcess, LEADING};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The name the relay under test gives its connections.
const RELAY: &str = "relay-under-test";

/// Messages committed after a fault was armed that must arrive before the
/// next is armed: the stream went on through it.
const THROUGH: usize = 40;

/// What an election returns, with the label a 4.4+ server sets, and a
/// dropped connection: the errors a change stream resumes after.
fn resumable() -> [(&'static str, Failure); 4] {
    [
        ("NotWritablePrimary", Failure::Code(10107, &[RESUMABLE])),
        (
            "InterruptedDueToReplStateChange",
            Failure::Code(11602, &[RESUMABLE]),
        ),
        ("PrimarySteppedDown", Failure::Code(189, &[RESUMABLE])),
        ("connection closed", Failure::CloseConnection),
    ]
}

/// A relay process under test, connecting as [`RELAY`], once it tails its
/// stream (so that its first start's catch-up cannot meet the stream on a
/// message the writer commits meanwhile).
async fn tailing(servers: &Servers, env: &common::TestEnv, label: &str) -> RelayProcess {
    let uri = failpoint::uri_for(&servers.mongo.uri(), RELAY);
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let relay = RelayProcess::start_with(
        env,
        label,
        &[
            ("OUTBOX_MONGODB_URI", &uri),
            ("OUTBOX_METRICS_ADDR", &address),
        ],
    );
    ready_as(port, LEADING).await;
    relay
}

#[tokio::test]
async fn a_stream_the_driver_resumes_publishes_nothing_twice() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::with_fail_points().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let writer = Writer::start(&env);
    // The relay under test resumes from a stored position, as most starts do.
    let mut first = tailing(&servers, &env, "first").await;
    publishes.wait_count_after(Instant::now(), THROUGH).await;
    first.terminate().await;
    let mut relay = tailing(&servers, &env, "resumed").await;
    let mut faults = Vec::new();
    for (name, failure) in resumable() {
        let armed = Instant::now();
        failpoint::arm(&env.client, RELAY, &["getMore", "aggregate"], 3, &failure).await;
        publishes.wait_count_after(armed, THROUGH).await;
        failpoint::off(&env.client).await;
        publishes.wait_count_after(Instant::now(), THROUGH).await;
        faults.push(name);
    }
    failpoint::off(&env.client).await;
    let aborted = writer.finish().await;
    verify(
        &env,
        "change stream getMore failed 3 times each with resumable errors",
        &publishes,
        &aborted,
        serde_json::json!({ "faults": faults }),
    )
    .await;
    assert_eq!(
        publishes.repeats(),
        0,
        "a stream the driver resumes publishes nothing a second time"
    );
    relay.terminate().await;
    env.drop().await;
}

/// Errors a write meets in a replica set: a write concern the majority
/// did not confirm in time, a dropped connection, an election.
fn write_failures() -> [(&'static str, Failure); 3] {
    [
        ("writeConcernError 64", Failure::WriteConcern(64)),
        ("connection closed", Failure::CloseConnection),
        ("NotWritablePrimary", Failure::Code(10107, &[])),
    ]
}

/// The most messages a scenario of failing marks may publish again: a
/// mark that failed leaves its batch unmarked, and the batch is published
/// again by the sweep (at most `--batch-size`, 100 here, for each of the
/// three failures armed three times).
const UNMARKED_AT_MOST: usize = 3 * 3 * 100;

#[tokio::test]
async fn marks_that_fail_lose_nothing() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::with_fail_points().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let mut relay = tailing(&servers, &env, "marks").await;
    let writer = Writer::start(&env);
    let mut faults = Vec::new();
    for (name, failure) in write_failures() {
        let armed = Instant::now();
        failpoint::arm(&env.client, RELAY, &["update"], 3, &failure).await;
        publishes.wait_count_after(armed, THROUGH).await;
        faults.push(name);
    }
    failpoint::off(&env.client).await;
    let aborted = writer.finish().await;
    verify(
        &env,
        "marks failed 3 times each with a write concern error, a dropped connection, an election",
        &publishes,
        &aborted,
        serde_json::json!({ "faults": faults }),
    )
    .await;
    assert!(publishes.repeats() <= UNMARKED_AT_MOST);
    relay.terminate().await;
    env.drop().await;
}
