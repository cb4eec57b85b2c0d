//! Operating the relay: the metrics and health endpoints, the self-check
//! and its exit codes, and the status and dlq commands.

use std::collections::HashMap;
use std::process::Output;
use std::time::Duration;

use crate::common::{
    assert_exit, free_port, get, ready_as, wait_until, write_orders, MongoProcess, RelayProcess,
    TestEnv, LEADING, STANDING_BY,
};
use async_nats::jetstream;
use bson::{doc, oid::ObjectId, DateTime, Document};

/// Parses the Prometheus text format strictly: every sample line is
/// `name{labels} value`, and every sample belongs to a family with a TYPE.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    let mut families = Vec::new();
    let mut samples = HashMap::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(declaration) = line.strip_prefix("# TYPE ") {
            let (family, kind) = declaration.split_once(' ').expect("TYPE has a kind");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            if kind == "counter" {
                assert!(family.ends_with("_total"), "counter without _total: {line}");
            }
            families.push(family.to_owned());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        let value: f64 = value
            .parse()
            .unwrap_or_else(|_| panic!("value of {line:?}"));
        let name = series.split('{').next().unwrap_or(series);
        assert!(
            families.iter().any(|f| name.starts_with(f.as_str())),
            "sample without a TYPE: {line}"
        );
        assert!(name.starts_with("outbox_"), "{line}");
        samples.insert(series.to_owned(), value);
    }
    samples
}

pub(crate) async fn scrape(port: u16) -> HashMap<String, f64> {
    let (status, body) = get(port, "/metrics").await.expect("/metrics answers");
    assert_eq!(status, 200);
    parse_metrics(&body)
}

fn metrics_settings(port: &str) -> [(&'static str, &str); 2] {
    [
        ("OUTBOX_METRICS_ADDR", port),
        ("OUTBOX_COLLECT_INTERVAL", "200ms"),
    ]
}

#[tokio::test]
async fn endpoints_report_deliveries_depths_and_roles() {
    let env = TestEnv::new().await;
    let leader_port = free_port();
    let leader_addr = format!("127.0.0.1:{leader_port}");
    let mut leader =
        RelayProcess::start_with(&env, "metrics-leader", &metrics_settings(&leader_addr));
    ready_as(leader_port, LEADING).await;
    assert_eq!(get(leader_port, "/healthz").await.map(|r| r.0), Some(200));

    write_orders(&env, 5).await;
    env.outbox()
        .insert_one(doc! { "type": "bad type!", "payload": {}, "status": "pending" })
        .await
        .unwrap();
    // The depths are read every collect interval: one read before the
    // marks were written still counts the messages pending.
    wait_until(
        "deliveries, the dead letter and the depths in the metrics",
        || async {
            let metrics = scrape(leader_port).await;
            metrics.get("outbox_processed_total") == Some(&5.0)
                && metrics.get("outbox_failed_total{kind=\"rejected\"}") == Some(&1.0)
                && metrics.get("outbox_failed_messages") == Some(&1.0)
                && metrics.get("outbox_pending_messages") == Some(&0.0)
        },
    )
    .await;
    // Leading, as it was when it became ready: with a lease a loaded
    // machine renews, it has not lost it meanwhile.
    let metrics = scrape(leader_port).await;
    assert_eq!(metrics["outbox_published_total{origin=\"stream\"}"], 5.0);
    assert_eq!(metrics["outbox_publish_ack_seconds_count"], 5.0);
    assert_eq!(metrics["outbox_commit_to_publish_seconds_count"], 5.0);
    assert!(
        metrics["outbox_depths_read_timestamp_seconds"] > 0.0,
        "the depths were read"
    );
    assert_eq!(metrics["outbox_leader"], 1.0);
    assert!(metrics["outbox_lease_term"] >= 1.0);
    for gauge in [
        "outbox_oldest_pending_age_seconds",
        "outbox_change_stream_lag_seconds",
        "outbox_checkpoint_age_seconds",
        "outbox_oplog_window_seconds",
    ] {
        assert!(metrics.contains_key(gauge), "{gauge} missing");
    }

    let standby_port = free_port();
    let standby_addr = format!("127.0.0.1:{standby_port}");
    let mut standby =
        RelayProcess::start_with(&env, "metrics-standby", &metrics_settings(&standby_addr));
    ready_as(standby_port, STANDING_BY).await;
    assert_eq!(scrape(standby_port).await["outbox_leader"], 0.0);
    // A standby reads the leader's checkpoint, so it reports its age too.
    wait_until("the standby to report the checkpoint's age", || async {
        scrape(standby_port)
            .await
            .get("outbox_checkpoint_age_seconds")
            .is_some_and(|age| *age > 0.0)
    })
    .await;

    standby.terminate().await;
    leader.terminate().await;
    env.drop().await;
}

/// Runs `outbox-relay <args>` with the test's servers in the environment.
fn relay_command(env: &TestEnv, args: &[&str]) -> Output {
    crate::common::relay_command(env)
        .args(args)
        .output()
        .expect("run outbox-relay")
}

#[tokio::test]
async fn check_gives_each_failure_its_own_exit_code() {
    let env = TestEnv::new().await;
    let passed = relay_command(&env, &["check"]);
    assert_exit(&passed, 0, "ok    duplicate window");
    // The test stream keeps one replica: said, with the choices, and no
    // failure.
    assert_exit(&passed, 0, "warn  stream durability");
    assert_exit(&passed, 0, "outbox-relay audit");
    let unreachable_mongodb = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=300";
    assert_exit(
        &relay_command(&env, &["check", "--mongodb-uri", unreachable_mongodb]),
        3,
        "cannot reach MongoDB",
    );
    let unreachable_nats = "nats://127.0.0.1:1";
    assert_exit(
        &relay_command(&env, &["check", "--nats-url", unreachable_nats]),
        6,
        "cannot connect to NATS",
    );
    let no_stream = format!("{}none", env.prefix);
    assert_exit(
        &relay_command(&env, &["check", "--subject-prefix", &no_stream]),
        7,
        "no JetStream stream captures",
    );
    // The relay runs the same checks before it serves.
    assert_exit(
        &relay_command(&env, &["run", "--subject-prefix", &no_stream]),
        7,
        "no JetStream stream captures",
    );

    let short_window = format!("{}short", env.prefix);
    env.jetstream
        .create_stream(jetstream::stream::Config {
            name: short_window.to_uppercase(),
            subjects: vec![format!("{short_window}.>")],
            duplicate_window: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_exit(
        &relay_command(&env, &["check", "--subject-prefix", &short_window]),
        8,
        "--dupe-window",
    );
    env.jetstream
        .delete_stream(short_window.to_uppercase())
        .await
        .unwrap();

    let standalone = MongoProcess::start_with(&["--standalone"]).await;
    for command in ["check", "run"] {
        assert_exit(
            &relay_command(&env, &[command, "--mongodb-uri", &standalone.uri()]),
            4,
            "standalone",
        );
    }
    drop(standalone);
    env.drop().await;
}

/// Failures past the settings and the checks keep to the documented exit codes: a
/// metrics address already taken is an I/O error (1), not a bad setting.
#[tokio::test]
async fn run_exits_with_the_code_of_its_failure() {
    let env = TestEnv::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let addr = taken.local_addr().expect("the bound address").to_string();
    assert_exit(
        &relay_command(&env, &["run", "--metrics-addr", &addr]),
        1,
        "cannot serve metrics",
    );
    assert_exit(
        &relay_command(&env, &["run", "--batch-size", "0"]),
        2,
        "--batch-size \"0\" is out of range",
    );
    drop(taken);
    env.drop().await;
}

/// A failed message as the relay leaves it.
fn failed(message_type: &str, error: &str) -> Document {
    doc! {
        "_id": ObjectId::new(),
        "type": message_type,
        "payload": { "n": 1 },
        "status": "failed",
        "attempts": 10,
        "failedAt": DateTime::now(),
        "lastError": error,
    }
}

#[tokio::test]
async fn status_and_dlq_commands_show_and_mend_the_dead_letters() {
    let env = TestEnv::new().await;
    let outbox = env.outbox();
    let replayed = failed("invoice.sent", "refused by the broker: quota");
    let replayed_id = replayed.get_object_id("_id").unwrap();
    outbox
        .insert_many([
            failed("order.placed", "invalid subject"),
            failed("order.placed", "invalid subject"),
            replayed,
            doc! { "type": "order.placed", "payload": {}, "status": "pending" },
            doc! { "type": "order.placed", "payload": {}, "status": "processed" },
        ])
        .await
        .unwrap();

    let output = relay_command(&env, &["status", "--json"]);
    assert_exit(&output, 0, "failed_by_type");
    let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        status["counts"],
        serde_json::json!({ "pending": 1, "processed": 1, "failed": 3 })
    );
    assert_eq!(status["failed_by_type"][0]["type"], "order.placed");
    assert_eq!(status["failed_by_type"][0]["count"], 2);
    assert_eq!(status["failed_by_type"][0]["last_error"], "invalid subject");
    assert!(status["oldest_pending_age_seconds"].as_f64().is_some());
    assert_exit(
        &relay_command(&env, &["status"]),
        0,
        "1 pending, 1 processed, 3 failed",
    );

    let output = relay_command(&env, &["dlq", "list", "--type", "order.placed", "--json"]);
    assert_exit(&output, 0, "order.placed");
    let listed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(listed["total"], 2);
    assert_eq!(listed["messages"].as_array().map(Vec::len), Some(2));

    let id = replayed_id.to_hex();
    assert_exit(
        &relay_command(&env, &["dlq", "replay", "--id", &id, "--dry-run"]),
        0,
        "would replay 1",
    );
    assert_eq!(env.count(doc! { "status": "failed" }).await, 3);
    assert_exit(
        &relay_command(&env, &["dlq", "replay", "--id", &id]),
        0,
        "replayed 1",
    );
    let document = outbox
        .find_one(doc! { "_id": replayed_id })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(document.get_str("status"), Ok("pending"));
    assert_eq!(document.get_i32("attempts"), Ok(0));
    assert!(!document.contains_key("lastError"));
    let history = document.get_array("errorHistory").unwrap();
    assert_eq!(
        history[0].as_document().unwrap().get_str("error"),
        Ok("refused by the broker: quota")
    );
    // The next sweep delivers it.
    let mut receiver = env.subscribe().await;
    assert_exit(
        &relay_command(&env, &["sweep", "--once", "--grace-period", "0s"]),
        0,
        "delivered 2",
    );
    receiver.until_id(replayed_id).await;

    assert_exit(
        &relay_command(&env, &["dlq", "discard", "--type", "order.placed"]),
        2,
        "--yes",
    );
    assert_eq!(env.count(doc! { "status": "failed" }).await, 2);
    assert_exit(
        &relay_command(&env, &["dlq", "discard", "--type", "order.placed", "--yes"]),
        0,
        "discarded 2",
    );
    assert_eq!(env.count(doc! { "status": "failed" }).await, 0);
    assert_exit(
        &relay_command(&env, &["dlq", "replay", "--id", "not-an-id"]),
        2,
        "not an ObjectId",
    );
    env.drop().await;
}

#[tokio::test]
async fn readiness_follows_nats_and_a_short_oplog_is_reported() {
    let (mongo, mut nats) = (
        MongoProcess::start().await,
        crate::common::NatsProcess::start().await,
    );
    let env = TestEnv::on(&mongo.uri(), &nats.url()).await;
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut settings = metrics_settings(&addr).to_vec();
    settings.push(("OUTBOX_OPLOG_HEADROOM_WARNING", "1h"));
    settings.push(("OUTBOX_CHECKPOINT_INTERVAL", "100ms"));
    let mut relay = RelayProcess::start_with(&env, "readiness", &settings);
    let ready = |expected: u16, saying: &'static str| async move {
        get(port, "/readyz")
            .await
            .is_some_and(|(status, body)| status == expected && body.contains(saying))
    };
    wait_until("the relay to be ready", || ready(200, "tailing")).await;

    // A fresh server's oplog holds seconds of history, far under an hour.
    write_orders(&env, 1).await;
    wait_until("the oplog headroom to be reported", || async {
        scrape(port)
            .await
            .get("outbox_oplog_headroom_seconds")
            .is_some_and(|headroom| *headroom < 3600.0)
    })
    .await;
    wait_until("the short headroom to be logged", || async {
        std::fs::read_to_string(&relay.log)
            .is_ok_and(|log| log.contains("the oplog holds little history"))
    })
    .await;

    nats.stop();
    wait_until("readiness to drop with NATS", || {
        ready(503, "nats: disconnected")
    })
    .await;
    nats.restart().await;
    wait_until("readiness to return with NATS", || {
        ready(200, "nats: connected")
    })
    .await;
    assert!(scrape(port).await["outbox_reconnects_total{server=\"nats\"}"] >= 1.0);
    relay.terminate().await;
    env.drop().await;
}

#[tokio::test]
async fn check_writes_nothing_and_says_what_run_would_change() {
    let env = TestEnv::new().await;
    let mut config = env.config();
    config.retention = Some(outbox_relay::Retention::Keep(Duration::from_secs(
        7 * 86_400,
    )));
    outbox_relay::Relay::connect(config).await.unwrap();
    let before = crate::sweep::set_up(&env).await;
    // As the docs show it, and with settings that differ from the outbox's.
    let cases: [(&[&str], &str); 4] = [
        (
            &["check"],
            "its indexes, retention and validator are as configured",
        ),
        (
            &["check", "--retention", "1d"],
            "change outbox_processed_ttl from 7days to 1day",
        ),
        (
            &["check", "--retention", "off"],
            "drop outbox_processed_ttl (retention 7days)",
        ),
        (
            &["check", "--install-validator"],
            "install the contract's validator",
        ),
    ];
    for (args, saying) in cases {
        assert_exit(&relay_command(&env, args), 0, saying);
        assert_eq!(crate::sweep::set_up(&env).await, before, "{args:?}");
    }
    env.drop().await;
}

#[tokio::test]
async fn the_operating_docs_check_sample_is_what_check_prints() {
    let env = TestEnv::new().await;
    let docs = std::fs::read_to_string(crate::common::manifest_dir().join("docs/operating.md"))
        .expect("docs/operating.md");
    let sample = docs
        .split("```text\n$ outbox-relay check")
        .nth(1)
        .and_then(|block| block.split("\n```").next())
        .and_then(|block| block.split_once('\n'))
        .map(|(_, printed)| printed.to_owned())
        .expect("docs/operating.md has a check sample");
    // As the sample: an outbox not created yet, and no stream for it.
    let (database, prefix) = (format!("{}_new", env.name), format!("{}none", env.prefix));
    let output = relay_command(
        &env,
        &[
            "check",
            "--database",
            &database,
            "--subject-prefix",
            &prefix,
        ],
    );
    assert_eq!(
        output.status.code(),
        Some(7),
        "{}",
        crate::common::output_text(&output)
    );
    let printed = String::from_utf8_lossy(&output.stdout)
        .replace(&env.mongodb_uri, "mongodb://127.0.0.1:27017")
        .replace(&env.nats_url, "nats://127.0.0.1:4222")
        .replace(&database, "shop")
        .replace(&prefix, "outbox");
    let version = |text: &str| {
        text.lines()
            .map(|line| match line.split_once("(nats-server ") {
                Some((before, _)) => format!("{before}(nats-server …)"),
                None => line.to_owned(),
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(version(&sample), version(printed.trim_end()));
    env.drop().await;
}
