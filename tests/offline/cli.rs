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

/// A bad setting: exit code 2, a message naming it.
fn assert_fails_saying(args: &[&str], expected: &[&str]) {
    assert_exits_saying(args, 2, expected);
}

pub(crate) fn assert_exits_saying(args: &[&str], code: i32, expected: &[&str]) {
    let output = relay(args);
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(code), "{args:?}: {text}");
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
    assert_exits_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://u:hunter2@127.0.0.1:1/?serverSelectionTimeoutMS=300",
            "--database",
            "d",
        ],
        3,
        &[
            "cannot reach MongoDB at mongodb://u:***@127.0.0.1:1",
            "no server answered",
        ],
    );
}

/// A config file with `text` in a folder of its own, removed when dropped.
pub(crate) struct ConfigFile(pub(crate) std::path::PathBuf);

impl ConfigFile {
    pub(crate) fn new(test: &str, text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-relay-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create a folder for the config file");
        let file = ConfigFile(dir.join("relay.toml"));
        std::fs::write(&file.0, text).expect("write the config file");
        file
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[test]
fn config_file_problems_name_the_file_and_key() {
    let file = ConfigFile::new(
        "cli",
        "database = \"d\"\nmongodb_uri = \"mongodb://h\"\nbatchsize = 3\n",
    );
    let path = file.0.to_str().unwrap();
    assert_fails_saying(&["run", "--config", path], &["relay.toml", "batchsize"]);
    assert_fails_saying(
        &["run", "--config", "/nonexistent/relay.toml"],
        &["cannot read config file"],
    );
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
    assert_fails_saying(
        &[
            "run",
            "--mongodb-uri",
            "mongodb://h",
            "--database",
            "d",
            "--standby-poll-interval",
            "60s",
        ],
        &["standby-poll-interval (1m)", "lease-duration (10s)"],
    );
}

/// Each source names the value as it was given, and the strongest one
/// wins: flag over environment over file over default.
#[test]
fn a_flag_beats_the_environment_which_beats_the_file() {
    let file = ConfigFile::new(
        "layers",
        "mongodb_uri = \"mongodb://h\"\ndatabase = \"d\"\nmax_in_flight = 0\n",
    );
    let run = |env: Option<&str>, flag: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
        command
            .args(["run", "--config"])
            .arg(&file.0)
            .env_remove("OUTBOX_MAX_IN_FLIGHT")
            .env("NO_COLOR", "1");
        if let Some(value) = env {
            command.env("OUTBOX_MAX_IN_FLIGHT", value);
        }
        if let Some(value) = flag {
            command.args(["--max-in-flight", value]);
        }
        let output = command.output().expect("run outbox-relay");
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        stderr(&output)
    };
    let from_file = run(None, None);
    assert!(
        from_file.contains("max_in_flight = \"0\" in") && from_file.contains("relay.toml"),
        "{from_file}"
    );
    let from_env = run(Some("70000"), None);
    assert!(
        from_env.contains("OUTBOX_MAX_IN_FLIGHT=\"70000\" is out of range"),
        "{from_env}"
    );
    let from_flag = run(Some("70000"), Some("80000"));
    assert!(
        from_flag.contains("--max-in-flight \"80000\" is out of range"),
        "{from_flag}"
    );
}

/// The connection string may come from a file (a mounted secret), but not
/// from a file and a flag at once.
#[test]
fn the_connection_string_may_come_from_a_file() {
    let file = ConfigFile::new(
        "uri-file",
        "mongodb://app:FileSecret1729@127.0.0.1:1/?serverSelectionTimeoutMS=200\n",
    );
    let path = file.0.to_str().unwrap();
    assert_exits_saying(
        &["run", "--database", "d", "--mongodb-uri-file", path],
        3,
        &["cannot reach MongoDB at mongodb://app:***@127.0.0.1:1"],
    );
    let both = [
        "run",
        "--database",
        "d",
        "--mongodb-uri-file",
        path,
        "--mongodb-uri",
        "mongodb://h",
    ];
    assert_fails_saying(&both, &["mongodb-uri-file, not both"]);
    assert_fails_saying(
        &[
            "run",
            "--database",
            "d",
            "--mongodb-uri-file",
            "/nonexistent/uri",
        ],
        &["mongodb-uri-file: cannot read /nonexistent/uri"],
    );
}
