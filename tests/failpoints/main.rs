//! Errors a replica set returns, as MongoDB's own drivers test for them:
//! each scenario starts a SecantusDB of its own with
//! `--enable-test-commands` and arms `failCommand`, scoped by `appName` to
//! the process under test, on the commands that process sends, while a
//! writer commits messages in transactions. Every class of error is met:
//! resumable state changes with their label, dropped connections,
//! non-resumable stream errors, write concern errors, transaction errors
//! and a connection the server holds.
//!
//! A core-NATS subscription counts every publish, so a repeat that
//! JetStream drops still counts: each scenario asserts nothing lost,
//! nothing the stream never committed, each key in order, repeats within
//! the bound docs/guarantees.md states for that fault, and the relay
//! leading and ready again; it writes its figures (repeats, the longest
//! pause) to `target/fault-report.jsonl`.
//!
//! The scenarios run one at a time, as the process faults do.

#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::failpoint::{self, Failure, RESUMABLE};
use common::scenario::*;
use common::{free_port, ready_as, RelayProcess, TestEnv, LEADING};

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The name the relay under test gives its connections.
const RELAY: &str = "relay-under-test";

/// The name of its coordination client (the lease and the checkpoint):
/// the relay's own name with this suffix (see `connect`).
const COORDINATION: &str = "relay-under-test (coordination)";

/// The name of the writer under test.
const WRITER: &str = "writer-under-test";

/// Messages committed after a fault was armed that must arrive before the
/// next is armed: delivery went on through it.
const THROUGH: usize = 10;

/// The labels a server puts on an error inside a transaction that the
/// whole transaction may be retried after.
const TRANSIENT: &[&str] = &["TransientTransactionError"];

/// The label on a commit whose outcome is unknown.
const UNKNOWN_COMMIT: &[&str] = &["UnknownTransactionCommitResult"];

/// How a scenario knows its fault met the process: by a line the relay
/// logs for it (any of these), or, for a fault the driver rides out
/// silently (it retries a read or a write once, and resumes a stream), by
/// this many messages flowing while it is armed for three commands that
/// the flow itself sends (marks, the stream's reads, the writer's
/// transactions) or sends beside it (checkpoint writes, every 100 ms here).
#[derive(Clone, Copy)]
enum Met {
    Said(&'static [&'static str]),
    Flowed(usize),
}

/// One fault of a scenario: a name for the report, the failure, and how
/// to know it was met.
struct Fault {
    name: &'static str,
    failure: Failure,
    met: Met,
}

fn fault(name: &'static str, failure: Failure, met: Met) -> Fault {
    Fault { name, failure, met }
}

/// A scenario: the faults armed in turn on `commands` of the client named
/// `app`, and the most repeats the docs allow.
struct Scenario {
    name: &'static str,
    app: &'static str,
    commands: &'static [&'static str],
    faults: Vec<Fault>,
    repeats_at_most: usize,
    /// Settings the relay under test runs with, beyond its name.
    settings: &'static [(&'static str, &'static str)],
}

/// A relay process under test, connecting as [`RELAY`], once it tails its
/// stream (so that a first start's catch-up cannot meet the stream on a
/// message the writer commits meanwhile), and the port of its `/readyz`.
async fn tailing(
    servers: &Servers,
    env: &TestEnv,
    label: &str,
    settings: &[(&str, &str)],
) -> (RelayProcess, u16) {
    let uri = failpoint::uri_for(&servers.mongo.uri(), RELAY);
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let mut all = vec![
        ("OUTBOX_MONGODB_URI", uri.as_str()),
        ("OUTBOX_METRICS_ADDR", address.as_str()),
    ];
    all.extend_from_slice(settings);
    let relay = RelayProcess::start_with(env, label, &all);
    ready_as(port, LEADING).await;
    (relay, port)
}

/// How often any of `texts` appears in a relay's log so far.
fn said_any(relay: &RelayProcess, texts: &[&str]) -> usize {
    std::fs::read_to_string(&relay.log)
        .map(|log| texts.iter().map(|text| log.matches(text).count()).sum())
        .unwrap_or(0)
}

/// Runs a scenario: a first relay stores a position and stops, so that
/// the relay under test resumes from it as most starts do; each fault is
/// armed (three times), met, turned off, and delivery seen going on; then
/// everything committed is checked.
async fn run(scenario: Scenario) {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::with_fail_points().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let writer_client =
        mongodb::Client::with_uri_str(failpoint::uri_for(&servers.mongo.uri(), WRITER))
            .await
            .expect("the writer's client");
    let writer = Writer::start_on(writer_client, &env, Duration::from_millis(20));
    let (mut first, _) = tailing(&servers, &env, "first", scenario.settings).await;
    publishes.wait_count_after(Instant::now(), THROUGH).await;
    first.terminate().await;
    let (mut relay, port) = tailing(&servers, &env, "under-test", scenario.settings).await;
    // Past its replay of what the first relay left, so that the faults
    // meet the commands of a relay that tails the stream.
    publishes.wait_count_after(Instant::now(), THROUGH).await;

    let started = Instant::now();
    let mut met = Vec::new();
    for fault in &scenario.faults {
        let armed = Instant::now();
        let before = match fault.met {
            Met::Said(texts) => said_any(&relay, texts),
            Met::Flowed(_) => 0,
        };
        failpoint::arm(
            &env.client,
            scenario.app,
            scenario.commands,
            3,
            &fault.failure,
        )
        .await;
        match fault.met {
            Met::Said(texts) => {
                common::wait_until(&format!("the relay to say one of {texts:?}"), || async {
                    said_any(&relay, texts) > before
                })
                .await
            }
            Met::Flowed(n) => publishes.wait_count_after(armed, n).await,
        }
        failpoint::off(&env.client).await;
        publishes.wait_count_after(Instant::now(), THROUGH).await;
        met.push(fault.name);
    }
    let paused = publishes.longest_gap(started, Instant::now());
    let aborted = writer.finish().await;
    verify(
        &env,
        scenario.name,
        &publishes,
        &aborted,
        serde_json::json!({
            "faults": met,
            "commands": scenario.commands,
            "longest_pause_ms": paused.as_millis() as u64,
        }),
    )
    .await;
    let repeats = publishes.repeats();
    assert!(
        repeats <= scenario.repeats_at_most,
        "{}: {repeats} messages published again, more than the {} the docs allow",
        scenario.name,
        scenario.repeats_at_most
    );
    ready_as(port, LEADING).await;
    assert!(relay.running(), "the relay is alive");
    let log = std::fs::read_to_string(&relay.log).unwrap_or_default();
    for dump in ["RawDocumentBuf", "server response: Some("] {
        assert!(
            !log.contains(dump),
            "{}: the log shows a driver's dump ({dump}) where one line would do: {}",
            scenario.name,
            relay.log.display()
        );
    }
    relay.terminate().await;
    env.drop().await;
}

/// What an election returns, with the label a 4.4+ server sets, and a
/// dropped connection: the errors a change stream resumes after.
fn resumable() -> Vec<Fault> {
    vec![
        fault(
            "NotWritablePrimary (10107)",
            Failure::Code(10107, &[RESUMABLE]),
            Met::Flowed(THROUGH),
        ),
        fault(
            "InterruptedDueToReplStateChange (11602)",
            Failure::Code(11602, &[RESUMABLE]),
            Met::Flowed(THROUGH),
        ),
        fault(
            "PrimarySteppedDown (189)",
            Failure::Code(189, &[RESUMABLE]),
            Met::Flowed(THROUGH),
        ),
        fault(
            "connection closed",
            Failure::CloseConnection,
            Met::Flowed(THROUGH),
        ),
        fault(
            "connection held 1 s",
            Failure::Block(1000),
            Met::Flowed(THROUGH),
        ),
    ]
}

/// Errors a write meets: a write concern the majority did not confirm in
/// time (the driver does not retry it, and the relay logs one of `said`),
/// a dropped connection and an election (the driver retries the write
/// once), and a connection the server holds.
fn write_failures(said: &'static [&'static str], flow: usize) -> Vec<Fault> {
    vec![
        fault(
            "writeConcernError 64 (WriteConcernFailed)",
            Failure::WriteConcern(64),
            Met::Said(said),
        ),
        fault(
            "connection closed",
            Failure::CloseConnection,
            Met::Flowed(flow),
        ),
        fault(
            "NotWritablePrimary (10107)",
            Failure::Code(10107, &[]),
            Met::Flowed(flow),
        ),
        fault(
            "connection held 1 s",
            Failure::Block(1000),
            Met::Flowed(flow),
        ),
    ]
}

#[tokio::test]
async fn a_stream_the_driver_resumes_publishes_nothing_twice() {
    run(Scenario {
        name: "stream aggregate and getMore: resumable errors",
        app: RELAY,
        commands: &["aggregate", "getMore"],
        faults: resumable(),
        repeats_at_most: 0,
        settings: &[],
    })
    .await;
}

#[tokio::test]
async fn a_stream_that_cannot_resume_is_reopened_where_it_broke() {
    let said = &["change stream failed; reopening it"];
    run(Scenario {
        name: "stream getMore: errors no resume mends (286, 280)",
        app: RELAY,
        commands: &["getMore"],
        faults: vec![
            fault(
                "ChangeStreamHistoryLost (286)",
                Failure::Code(286, &[]),
                Met::Said(said),
            ),
            fault(
                "ChangeStreamFatalError (280)",
                Failure::Code(280, &[]),
                Met::Said(said),
            ),
        ],
        repeats_at_most: 0,
        settings: &[],
    })
    .await;
}

/// The most messages failing marks may publish again: a mark that failed
/// is retried until it lands, and its messages are not published again
/// meanwhile; a relay that lost its term would (docs/guarantees.md).
const MARKS_REPEAT_AT_MOST: usize = 0;

#[tokio::test]
async fn marks_that_fail_lose_nothing_and_publish_nothing_twice() {
    run(Scenario {
        name: "marks (update): write concern error, dropped connection, election, held connection",
        app: RELAY,
        commands: &["update"],
        faults: write_failures(
            &[
                "MongoDB marking processed: failing",
                "MongoDB sweep: failing",
            ],
            THROUGH,
        ),
        repeats_at_most: MARKS_REPEAT_AT_MOST,
        settings: &[],
    })
    .await;
}

/// Messages flowing while a fault on the sweep's reads is armed: at 50 a
/// second, the time of four sweep passes 300 ms apart.
const SWEEP_PASSES: usize = 60;

#[tokio::test]
async fn sweep_reads_that_fail_hold_up_nothing() {
    let said = &["MongoDB sweep: failing"];
    run(Scenario {
        name: "sweep reads (find): election, dropped connection, held connection",
        app: RELAY,
        commands: &["find"],
        faults: vec![
            fault(
                "NotWritablePrimary (10107)",
                Failure::Code(10107, &[]),
                Met::Said(said),
            ),
            // The driver retries a read after a dropped connection, and
            // may ride it out unseen: the sweep passes of a flow of 60
            // messages (1.2 s, passes every 300 ms) meet it.
            fault(
                "connection closed",
                Failure::CloseConnection,
                Met::Flowed(SWEEP_PASSES),
            ),
            fault(
                "connection held 1 s",
                Failure::Block(1000),
                Met::Flowed(SWEEP_PASSES),
            ),
        ],
        repeats_at_most: 0,
        settings: &[("OUTBOX_SWEEP_INTERVAL", "300ms")],
    })
    .await;
}

/// The most messages a lease or checkpoint write that fails may publish
/// again: none while the lease holds; a term that ends (a renewal that
/// failed for the whole lease) repeats what was in flight.
const COORDINATION_REPEAT_AT_MOST: usize = 10;

#[tokio::test]
async fn lease_and_checkpoint_writes_that_fail_keep_the_relay_leading() {
    run(Scenario {
        name: "lease and checkpoint writes (update, findAndModify): write concern error, dropped connection, election, held connection",
        app: COORDINATION,
        commands: &["update", "findAndModify"],
        faults: write_failures(
            &[
                "renewing the lease failed; trying again",
                "MongoDB checkpoint write: failing",
            ],
            // About two seconds of flow: twenty checkpoint writes.
            100,
        ),
        repeats_at_most: COORDINATION_REPEAT_AT_MOST,
        settings: &[("OUTBOX_CHECKPOINT_INTERVAL", "100ms")],
    })
    .await;
}

#[tokio::test]
async fn writers_transactions_that_fail_publish_only_what_committed() {
    run(Scenario {
        name: "writer's transactions: transient errors, an unknown commit result",
        app: WRITER,
        commands: &["insert", "commitTransaction"],
        faults: vec![
            fault(
                "insert: NotWritablePrimary, TransientTransactionError",
                Failure::Code(10107, TRANSIENT),
                Met::Flowed(THROUGH),
            ),
            fault(
                "commit: connection closed (UnknownTransactionCommitResult)",
                Failure::CloseConnection,
                Met::Flowed(THROUGH),
            ),
            fault(
                "commit: WriteConcernFailed, UnknownTransactionCommitResult",
                Failure::Code(64, UNKNOWN_COMMIT),
                Met::Flowed(THROUGH),
            ),
        ],
        repeats_at_most: 0,
        settings: &[],
    })
    .await;
}

/// The settings of the relay whose marks are refused: a window of
/// `--max-in-flight` plus `--batch-size` unrecorded messages, 10, below a
/// new term's first window (16), so it is all there at once; without it,
/// a mark batch and the completion stage's queue of `--batch-size` each
/// would hold 16 acknowledged messages, far more than `--max-in-flight`.
const SMALL_WINDOW: [(&str, &str); 4] = [
    ("OUTBOX_MAX_IN_FLIGHT", "2"),
    ("OUTBOX_BATCH_SIZE", "8"),
    ("OUTBOX_LEASE_DURATION", "2s"),
    ("OUTBOX_LEASE_RENEW_INTERVAL", "500ms"),
];

#[tokio::test]
async fn a_relay_killed_with_its_marks_held_repeats_at_most_its_window() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let servers = Servers::with_fail_points().await;
    let env = servers.env().await;
    let publishes = Publishes::watch(&env).await;
    let (mut first, _) = tailing(&servers, &env, "first", &SMALL_WINDOW).await;
    let began = Instant::now();
    common::write_orders(&env, 2).await;
    publishes.wait_count_after(began, 2).await;
    first.terminate().await;

    // A backlog the relay under test takes over, every mark of it refused
    // as a stepped-down primary refuses it, and retried: NATS acknowledges
    // what no mark records, waiting in a batch being marked and in the
    // completion stage's queue as well as on the wire, and the window alone
    // bounds it. (SecantusDB holds every connection while it holds one, so
    // a held mark cannot stand in for a refused one.)
    common::write_orders(&env, 40).await;
    let not_primary = Failure::Code(10107, &[]);
    failpoint::arm_always(&env.client, RELAY, &["update"], &not_primary).await;
    let held = Instant::now();
    let (mut relay, _) = tailing(&servers, &env, "under-test", &SMALL_WINDOW).await;
    let window = 2 + 8;
    publishes.wait_count_after(held, window).await;
    relay.kill9();
    failpoint::off(&env.client).await;
    let (mut next, _) = tailing(&servers, &env, "next", &SMALL_WINDOW).await;
    verify(
        &env,
        "relay killed with its marks held: at most its window again",
        &publishes,
        &[],
        serde_json::json!({ "window": window }),
    )
    .await;
    let repeats = publishes.repeats();
    assert!(
        repeats <= window,
        "{repeats} published again, more than --max-in-flight plus --batch-size ({window})"
    );
    assert!(
        repeats > 2,
        "{repeats} published again: no more than --max-in-flight was left unrecorded"
    );
    next.terminate().await;
    env.drop().await;
}
