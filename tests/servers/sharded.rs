//! Through mongos: a relay whose connection string names a sharded
//! cluster's router needs nothing else, and what mongos cannot read (the
//! oplog) is said once, not failed on. No mongos runs here, so the server
//! is SecantusDB refusing the `local` database as mongos does, and saying
//! it is mongos or a replica set (`MongoProcess::start_refusing_local`).

use std::process::Output;

use bson::doc;

use crate::common::{
    assert_exit, bounded, free_port, nats_url, ready_as, relay_command, wait_until, write_orders,
    MongoProcess, RelayProcess, TestEnv, LEADING,
};
use crate::operate::scrape;

/// A relay that reads its depths every 200 ms and the oplog's headroom as
/// by default (`--oplog-headroom-warning 1h`), and the port of its
/// endpoints, once it leads and tails its stream.
async fn reading_the_oplog(env: &TestEnv, label: &str) -> (RelayProcess, u16) {
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let relay = RelayProcess::start_with(
        env,
        label,
        &[
            ("OUTBOX_METRICS_ADDR", address.as_str()),
            ("OUTBOX_COLLECT_INTERVAL", "200ms"),
            ("OUTBOX_OPLOG_HEADROOM_WARNING", "1h"),
        ],
    );
    ready_as(port, LEADING).await;
    (relay, port)
}

/// When the relay on `port` last read its depths, as it reports it.
async fn depths_read_at(port: u16) -> f64 {
    let metrics = scrape(port).await;
    let read_at = metrics.get("outbox_depths_read_timestamp_seconds");
    read_at.copied().unwrap_or(0.0)
}

/// Waits until the collector of the relay on `port` has read the depths
/// `rounds` more times: each of its rounds would have said again what it
/// says only once.
async fn rounds_pass(port: u16, rounds: usize) {
    let mut last = depths_read_at(port).await;
    for round in 1..=rounds {
        let after = last;
        wait_until(&format!("depths read {round} more times"), || async move {
            depths_read_at(port).await > after
        })
        .await;
        last = depths_read_at(port).await;
    }
}

/// How often the relay's log says `text`.
fn said(relay: &RelayProcess, text: &str) -> usize {
    std::fs::read_to_string(&relay.log)
        .map(|log| log.matches(text).count())
        .unwrap_or(0)
}

/// Writes `count` orders and waits for their messages to arrive and be
/// marked processed.
async fn delivers(env: &TestEnv, count: usize) {
    let processed = doc! { "status": "processed" };
    let before = env.count(processed.clone()).await;
    let mut receiver = env.subscribe().await;
    write_orders(env, count).await;
    receiver.take(count).await;
    env.wait_count(processed, before + count as u64).await;
}

/// Runs `outbox-relay <command>` against the test's servers.
async fn run(env: &TestEnv, command: &str) -> Output {
    let mut relay = relay_command(env);
    relay.arg(command);
    bounded(relay).await
}

/// Waits until the relay says `text`, lets its collector make three more
/// rounds, and fails unless it said `text` once.
async fn said_once(relay: &RelayProcess, port: u16, text: &str) {
    wait_until(&format!("the relay to say {text:?}"), || async {
        said(relay, text) > 0
    })
    .await;
    rounds_pass(port, 3).await;
    let log = relay.log.display();
    assert_eq!(said(relay, text), 1, "{text:?} said once: {log}");
}

/// A server refusing `local` as mongos does, and saying it is mongos
/// where `says_mongos`; the test's corner of it; and a relay on it that
/// has delivered three orders.
async fn delivering(says_mongos: bool) -> (MongoProcess, TestEnv, RelayProcess, u16) {
    let mongo = MongoProcess::start_refusing_local(says_mongos).await;
    let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
    let label = if says_mongos {
        "through-mongos"
    } else {
        "oplog-refused"
    };
    let (relay, port) = reading_the_oplog(&env, label).await;
    delivers(&env, 3).await;
    (mongo, env, relay, port)
}

#[tokio::test]
async fn through_mongos_the_relay_delivers_and_says_once_that_no_headroom_is_reported() {
    let (_mongo, env, mut relay, port) = delivering(true).await;
    said_once(&relay, port, "the oplog is not readable through mongos").await;
    assert_eq!(
        said(&relay, "the oplog cannot be read"),
        0,
        "known to be mongos, the relay asks no oplog: {}",
        relay.log.display()
    );
    let metrics = scrape(port).await;
    assert_eq!(metrics.get("outbox_oplog_window_seconds"), Some(&0.0));
    ready_as(port, LEADING).await;

    assert_exit(
        &run(&env, "status").await,
        0,
        "oplog: the oplog is not readable through mongos",
    );
    assert_exit(
        &run(&env, "check").await,
        0,
        "is a sharded cluster (through mongos)",
    );
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn an_oplog_refused_as_mongos_refuses_it_is_said_once_and_delivery_goes_on() {
    let (_mongo, env, mut relay, port) = delivering(false).await;
    // The oplog is read again each round, and the refusal not said again.
    said_once(&relay, port, "the oplog cannot be read").await;
    assert_eq!(said(&relay, "as mongos does"), 1, "{}", relay.log.display());
    ready_as(port, LEADING).await;
    delivers(&env, 3).await;

    assert_exit(
        &run(&env, "status").await,
        0,
        "oplog: the oplog is not readable",
    );
    relay.terminate().await;
    env.drop().await;
}
