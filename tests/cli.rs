//! The command line: bad input gets a clear message and a failing exit code.

use std::process::{Command, Output};

fn relay(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .env_remove("OUTBOX_MONGODB_URI")
        .env_remove("OUTBOX_DATABASE")
        .env("NO_COLOR", "1")
        .output()
        .expect("run outbox-relay")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_fails_saying(args: &[&str], expected: &[&str]) {
    let output = relay(args);
    let text = stderr(&output);
    assert!(!output.status.success(), "{args:?} should fail");
    for part in expected {
        assert!(
            text.contains(part),
            "{args:?}: {text:?} should mention {part:?}"
        );
    }
    assert!(!text.contains("panicked"), "{args:?} panicked: {text}");
}

#[test]
fn missing_connection_settings_are_named() {
    assert_fails_saying(
        &["run", "--database", "d"],
        &["--mongodb-uri", "OUTBOX_MONGODB_URI"],
    );
    assert_fails_saying(&["run", "--mongodb-uri", "mongodb://h"], &["--database"]);
}

#[test]
fn bad_values_are_explained() {
    let base = [
        "run",
        "--mongodb-uri",
        "mongodb://127.0.0.1:1",
        "--database",
        "d",
    ];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    assert_fails_saying(
        &with(&["--ack-timeout", "soon"]),
        &["ack-timeout", "\"soon\"", "10s"],
    );
    assert_fails_saying(
        &with(&["--subject-prefix", "a.*"]),
        &["subject-prefix", "wildcard"],
    );
    assert_fails_saying(&with(&["--max-in-flight", "0"]), &["max-in-flight"]);
    assert_fails_saying(
        &with(&["--metrics-addr", "everywhere"]),
        &["metrics-addr", "off"],
    );
    assert_fails_saying(
        &[
            "dlq",
            "list",
            "--limit",
            "0",
            "--mongodb-uri",
            "mongodb://h",
            "--database",
            "d",
        ],
        &["--limit"],
    );
    assert_fails_saying(
        &[
            "dlq",
            "replay",
            "--mongodb-uri",
            "mongodb://h",
            "--database",
            "d",
        ],
        &["--id", "--type", "--all"],
    );
    assert_fails_saying(
        &with(&["--max-in-flight", "many"]),
        &["--max-in-flight", "many"],
    );
    assert_fails_saying(
        &with(&["--nats-mode", "fast"]),
        &["--nats-mode", "jetstream", "core"],
    );
}

#[test]
fn a_bad_connection_string_is_reported_without_a_password() {
    assert_fails_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://u:hunter2@/x",
            "--database",
            "d",
        ],
        &["not a valid connection string"],
    );
    let output = relay(&[
        "run",
        "--mongodb-uri",
        "mongodb://u:hunter2@/x",
        "--database",
        "d",
    ]);
    assert!(!stderr(&output).contains("hunter2"));
}

#[test]
fn an_unreachable_mongodb_gets_a_plain_message() {
    assert_fails_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://u:hunter2@127.0.0.1:1/?serverSelectionTimeoutMS=300",
            "--database",
            "d",
        ],
        &[
            "cannot reach MongoDB at mongodb://u:***@127.0.0.1:1",
            "no server answered",
        ],
    );
}

#[test]
fn config_file_problems_name_the_file_and_key() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("relay.toml");
    std::fs::write(
        &file,
        "database = \"d\"\nmongodb_uri = \"mongodb://h\"\nbatchsize = 3\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    assert_fails_saying(&["run", "--config", path], &["relay.toml", "batchsize"]);
    assert_fails_saying(
        &["run", "--config", "/nonexistent/relay.toml"],
        &["cannot read config file"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_duration_flag_is_read_and_checked() {
    let flags = [
        "--checkpoint-interval",
        "--max-await-time",
        "--idle-checkpoint-interval",
        "--grace-period",
        "--ack-timeout",
        "--shutdown-timeout",
        "--sweep-interval",
        "--poll-interval",
        "--lock-timeout",
        "--retry-initial-delay",
        "--retry-max-delay",
        "--lease-duration",
        "--lease-renew-interval",
        "--standby-poll-interval",
        "--retention",
    ];
    for flag in flags {
        let name = flag.trim_start_matches("--");
        assert_fails_saying(
            &[
                "run",
                "--mongodb-uri",
                "mongodb://h",
                "--database",
                "d",
                flag,
                "soon",
            ],
            &[name, "\"soon\""],
        );
    }
    assert_fails_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://h",
            "--database",
            "d",
            "--max-attempts",
            "0",
        ],
        &["max-attempts"],
    );
    assert_fails_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://h",
            "--database",
            "d",
            "--lease-renew-interval",
            "8s",
        ],
        &["lease-renew-interval", "half"],
    );
}
