//! The `outbox-relay` process: signals and settings from the environment.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::{wait_until, write_orders, TestEnv, WAIT};
use bson::doc;

#[tokio::test]
async fn sigterm_finishes_in_flight_work_and_exits_zero() {
    let env = TestEnv::new().await;
    let mut receiver = env.subscribe().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .arg("run")
        .env("OUTBOX_MONGODB_URI", crate::common::mongodb_uri())
        .env("OUTBOX_DATABASE", &env.name)
        .env("OUTBOX_NATS_URL", crate::common::nats_url())
        .env("OUTBOX_SUBJECT_PREFIX", &env.prefix)
        .env("OUTBOX_CHECKPOINT_INTERVAL", "1h")
        .env("OUTBOX_METRICS_ADDR", "127.0.0.1:0")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start outbox-relay");
    // Its log, read as it comes: the orders are written once the stream
    // tails, which ends the first start's catch-up pass. Stopped during
    // that pass, a relay has no stream position to record yet.
    let log = Arc::new(Mutex::new(String::new()));
    let reader = {
        let (stderr, log) = (child.stderr.take().expect("its stderr"), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut log = log.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        })
    };
    wait_until("the relay's catch-up pass to end", || async {
        log.lock().unwrap().contains("catch-up pass queued")
    })
    .await;

    let ids = write_orders(&env, 5).await;
    receiver.until_id(ids[4]).await;
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("send SIGTERM");
    assert!(status.success());

    let deadline = Instant::now() + WAIT;
    let exit = loop {
        if let Some(exit) = child.try_wait().expect("wait for the relay") {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    reader.join().expect("its log read whole");
    let log = log.lock().unwrap().clone();
    assert!(exit.success(), "exit {exit:?}; log:\n{log}");
    assert_eq!(
        env.count(doc! { "status": "processed" }).await,
        5,
        "log:\n{log}"
    );
    // With a one-hour checkpoint interval, only the stop itself can have written the token.
    assert!(
        env.checkpoint_token().await.is_some(),
        "no checkpoint written on stop; log:\n{log}"
    );
    env.drop().await;
}

#[test]
fn settings_come_from_the_environment_and_flags_beat_the_file() {
    let relay = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        command
            .arg("run")
            .env(
                "OUTBOX_MONGODB_URI",
                "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=200",
            )
            .env("OUTBOX_DATABASE", "d");
        command
    };
    let output = relay().env("OUTBOX_ACK_TIMEOUT", "soon").output().unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.code() == Some(2) && text.contains("OUTBOX_ACK_TIMEOUT=\"soon\""),
        "{text}"
    );

    let dir = std::env::temp_dir().join(format!("outbox-relay-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("relay.toml");
    std::fs::write(&file, "subject_prefix = \"bad.*\"\n").unwrap();
    let from_file = relay().arg("--config").arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&from_file.stderr);
    assert!(
        text.contains("subject-prefix"),
        "the file's value is used: {text}"
    );
    let overridden = relay()
        .arg("--config")
        .arg(&file)
        .args(["--subject-prefix", "good"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&overridden.stderr);
    assert!(
        !text.contains("subject-prefix") && text.contains("cannot reach"),
        "the flag beats the file, so the relay gets as far as connecting: {text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
