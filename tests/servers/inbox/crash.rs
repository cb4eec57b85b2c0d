//! The inbox through SIGKILLs: a consumer process killed three times at
//! random moments mid-handling, then a fourth that finishes, on a server
//! that ends a dead client's transactions as MongoDB does (SecantusDB's
//! Rust build; the Python build never ends one while a write waits on it).
//! Every message's effect is applied once, each key's in stream order, and
//! the last process stops within its documented bound.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use outbox_relay::inbox::{DEFAULT_SHUTDOWN_TIMEOUT, LAST_WORDS_WAIT};

use super::*;
use crate::common::{logs_dir, nats_url, MongoProcess};

const MESSAGES: usize = 2_000;
/// Half the messages are keyed, over this many keys.
const KEYS: usize = 40;
const KILLS: usize = 3;
/// How long the server keeps a dead client's open transaction.
const TRANSACTION_LIFETIME: Duration = Duration::from_secs(60);
/// The consumer process's ack wait.
const ACK_WAIT: Duration = Duration::from_secs(5);
/// How long the last process may take to catch up: the dead processes'
/// transactions hold their records for their lifetime (60 s) first.
const CATCH_UP: Duration = Duration::from_secs(300);

/// A random number of milliseconds in `range`.
fn random_ms(range: std::ops::Range<u64>) -> u64 {
    let random = RandomState::new().build_hasher().finish();
    range.start + random % (range.end - range.start)
}

/// Publishes the test's messages: every other one keyed, each key's
/// numbered in stream order.
async fn publish_all(env: &TestEnv) -> Vec<String> {
    let mut ids = Vec::with_capacity(MESSAGES);
    let mut acks = Vec::with_capacity(MESSAGES);
    let mut next_seq = vec![0i64; KEYS];
    for n in 0..MESSAGES {
        let id = ObjectId::new().to_hex();
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        let payload = if n % 2 == 0 {
            let key = (n / 2) % KEYS;
            headers.insert("Outbox-Key", format!("k{key}").as_str());
            next_seq[key] += 1;
            serde_json::json!({ "id": id, "key": format!("k{key}"), "seq": next_seq[key] - 1 })
        } else {
            serde_json::json!({ "id": id })
        };
        let body = serde_json::to_vec(&payload).unwrap();
        let subject = format!("{}.order.placed", env.prefix);
        acks.push(
            env.jetstream
                .publish_with_headers(subject, headers, body.into())
                .await
                .expect("publish"),
        );
        ids.push(id);
    }
    for ack in acks {
        ack.await.expect("stored");
    }
    ids
}

/// Starts the consumer process, logging to `target/relay-logs`, noting its
/// runs in `runs`.
fn start_consumer(env: &TestEnv, runs: &Path, round: usize) -> Child {
    let log = consumer_log(env, round);
    Command::new(env!("CARGO_BIN_EXE_inbox-crash-consumer"))
        .env("MONGODB_URI", &env.mongodb_uri)
        .env("NATS_URL", &env.nats_url)
        .env("INBOX_DATABASE", &env.name)
        .env("INBOX_STREAM", &env.stream)
        .env("INBOX_RUNS", runs)
        .env("INBOX_ROUND", round.to_string())
        .env("RUST_LOG", "info,outbox_relay::inbox=trace")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("a log file"))
        .spawn()
        .expect("start the consumer process")
}

/// Where the consumer process of `round` logs.
fn consumer_log(env: &TestEnv, round: usize) -> std::path::PathBuf {
    logs_dir().join(format!("{}-inbox-consumer-{round}.log", env.name))
}

/// Runs noted per message id, in all the files.
fn runs_by_id(files: &[std::path::PathBuf]) -> HashMap<String, usize> {
    let mut runs = HashMap::new();
    for file in files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        for id in text.lines() {
            *runs.entry(id.to_owned()).or_insert(0) += 1;
        }
    }
    runs
}

/// Messages consumer `crash` has still to deliver or to see acknowledged.
async fn remaining(env: &TestEnv) -> u64 {
    let stream = env.jetstream.get_stream(&env.stream).await.unwrap();
    let mut consumer: jetstream::consumer::PullConsumer =
        stream.get_consumer("crash").await.unwrap();
    let info = consumer.info().await.unwrap();
    info.num_pending + info.num_ack_pending as u64
}

#[tokio::test]
async fn killed_three_times_mid_handling_each_effect_is_applied_once_in_each_keys_order() {
    let started = Instant::now();
    let mongo = MongoProcess::start_rust_build(&[]).await;
    let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
    // Collections and indexes before any writer (docs/developing.md).
    for collection in ["effects", "key_order"] {
        env.db.create_collection(collection).await.unwrap();
    }
    Inbox::builder(&env.db, "crash").build().await.unwrap();
    let ids = publish_all(&env).await;
    let dir = std::env::temp_dir().join(format!("outbox-relay-{}", env.name));
    std::fs::create_dir_all(&dir).unwrap();
    let files: Vec<_> = (0..=KILLS).map(|n| dir.join(format!("runs-{n}"))).collect();

    let mut kills = Vec::new();
    for (round, runs) in files.iter().enumerate().take(KILLS) {
        let mut consumer = start_consumer(&env, runs, round);
        // The first messages it is given may be those whose records a
        // killed process's transactions hold until they expire (60 s).
        let began = tokio::time::timeout(TRANSACTION_LIFETIME + WAIT, async {
            while !std::fs::metadata(runs).is_ok_and(|m| m.len() > 0) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        assert!(
            began.await.is_ok(),
            "timed out waiting for the consumer process to begin handling"
        );
        let after = Duration::from_millis(random_ms(200..2_500));
        tokio::time::sleep(after).await;
        consumer.kill().expect("SIGKILL the consumer");
        consumer.wait().unwrap();
        kills.push(after);
        // The documented rule for a restart that keeps each key's order:
        // what the dead process held comes back after its ack wait (from
        // its last in-progress acknowledgement, or from its delivery to
        // the dead process's last pull, which JetStream keeps open up to a
        // second after the kill), and JetStream then delivers it ahead of
        // the messages no one has had. Started sooner, a consumer may take
        // a key's later message first.
        tokio::time::sleep(ACK_WAIT + Duration::from_secs(2)).await;
    }
    eprintln!("killed after {kills:?} of handling");

    let mut last = start_consumer(&env, &files[KILLS], KILLS);
    // Running before anything is asked of it: the killed ones may have
    // handled every message, and a SIGTERM that came before the process
    // heard signals would end it by the signal's default action.
    let log = consumer_log(&env, KILLS);
    wait_until("the last process to run", || async {
        std::fs::read_to_string(&log).is_ok_and(|log| log.contains("consuming"))
    })
    .await;
    let caught_up = async {
        while remaining(&env).await > 0 {
            assert!(
                last.try_wait().unwrap().is_none(),
                "the last process ended early"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    tokio::time::timeout(CATCH_UP, caught_up)
        .await
        .expect("the last process catches up");
    let caught_up_after = started.elapsed();

    // A graceful stop, within its documented bound.
    let stopping = Instant::now();
    let sent = Command::new("kill")
        .args(["-TERM", &last.id().to_string()])
        .status();
    assert!(sent.is_ok_and(|s| s.success()), "send SIGTERM");
    let bound = DEFAULT_SHUTDOWN_TIMEOUT + LAST_WORDS_WAIT;
    let exited = tokio::time::timeout(bound, async {
        loop {
            if let Some(status) = last.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the last process stops within its documented bound");
    assert!(exited.success(), "stopped cleanly: {exited}");
    eprintln!(
        "caught up {caught_up_after:?} after the start; stopped in {:?}",
        stopping.elapsed()
    );

    let effects = env.db.collection::<Document>("effects");
    let applied = super::stops::effects_by_id(&effects).await;
    assert_eq!(applied.len(), MESSAGES, "an effect for every message");
    for id in &ids {
        assert_eq!(applied.get(id), Some(&1), "message {id} applied once");
    }
    let mut cursor = env
        .db
        .collection::<Document>("key_order")
        .find(doc! {})
        .await
        .unwrap();
    let mut keys = 0;
    while let Some(key) = cursor.next().await {
        let key = key.unwrap();
        let seqs: Vec<i64> = key
            .get_array("seqs")
            .unwrap()
            .iter()
            .map(|seq| {
                seq.as_i64()
                    .or_else(|| seq.as_i32().map(i64::from))
                    .unwrap()
            })
            .collect();
        let expected: Vec<i64> = (0..(MESSAGES / 2 / KEYS) as i64).collect();
        assert_eq!(
            seqs,
            expected,
            "key {} in stream order; applied {:?}",
            key.get_str("_id").unwrap(),
            key.get_array("applied").unwrap()
        );
        keys += 1;
    }
    assert_eq!(keys, KEYS);
    let runs = runs_by_id(&files);
    for id in &ids {
        assert!(runs.get(id).is_some_and(|&n| n >= 1), "message {id} ran");
    }
    let total: usize = runs.values().sum();
    eprintln!("{total} handler runs for {MESSAGES} effects");
    assert!(
        total > MESSAGES,
        "some runs were cut short by the kills (the test killed no one mid-handling?)"
    );
    let handled = env
        .db
        .collection::<Document>("inbox")
        .count_documents(doc! { "consumer": "crash", "status": "handled" })
        .await
        .unwrap();
    assert_eq!(handled, MESSAGES as u64, "every record says handled");
    let _ = std::fs::remove_dir_all(&dir);
    env.drop().await;
}
