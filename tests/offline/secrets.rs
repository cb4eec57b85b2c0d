//! No secret in a connection string is ever printed: not by `--help`, a
//! failing `check`, `run`, `status` or `dlq`, in text or JSON logs, whatever
//! form the secret takes (a password, a token or nkey as the user, one URL
//! of a list, a secret option, an address without a scheme).

use std::process::Command;

/// Each secret is a word no output could contain by chance.
const SECRETS: [&str; 8] = [
    "PwMongo1729",
    "PwTlsKey1729",
    "PwAws1729",
    "TokNats1729",
    "PwNats1729",
    "PwBare1729",
    "PwOdd1729",
    "PwSlash1729",
];

fn mongodb_uris() -> [String; 4] {
    [
        "mongodb://app:PwMongo1729@127.0.0.1:1/?serverSelectionTimeoutMS=200".to_owned(),
        // Characters that should have been percent-encoded, in a URI the
        // driver refuses.
        "mongodb://app:Pw?#PwOdd1729/PwSlash1729@127.0.0.1:1/?serverSelectionTimeoutMS=200"
            .to_owned(),
        "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=200&tls=true\
         &tlsCertificateKeyFile=/nonexistent.pem&tlsCertificateKeyFilePassword=PwTlsKey1729"
            .to_owned(),
        "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=200&authMechanism=MONGODB-AWS\
         &authMechanismProperties=AWS_SESSION_TOKEN:PwAws1729"
            .to_owned(),
    ]
}

const NATS_URLS: [&str; 3] = [
    "nats://TokNats1729@127.0.0.1:1,nats://TokNats1729@127.0.0.1:2",
    "nats://u:PwNats1729@127.0.0.1:1",
    "u:PwBare1729@127.0.0.1:1",
];

fn output_of(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    command
        .args(args)
        .env("NO_COLOR", "1")
        // The clients' own debug logs name the addresses they connect to.
        .env("RUST_LOG", "debug")
        .env_remove("OUTBOX_MONGODB_URI")
        .env_remove("OUTBOX_NATS_URL");
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().expect("run outbox-relay");
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in SECRETS {
        assert!(!text.contains(secret), "{what} shows {secret}: {text}");
    }
}

#[test]
fn no_command_prints_a_secret() {
    let mut runs = 0;
    for mongodb_uri in mongodb_uris() {
        for nats_url in NATS_URLS {
            let env = [
                ("OUTBOX_MONGODB_URI", mongodb_uri.as_str()),
                ("OUTBOX_NATS_URL", nats_url),
            ];
            let commands: [&[&str]; 6] = [
                &["run", "--help"],
                &["check", "--database", "d"],
                &["--log-format", "json", "run", "--database", "d"],
                &["status", "--database", "d"],
                &["dlq", "list", "--database", "d"],
                &["check", "--database", "d", "--max-in-flight", "0"],
            ];
            for args in commands {
                let text = output_of(args, &env);
                assert_no_secret(
                    &format!("{args:?} with {mongodb_uri} and {nats_url}"),
                    &text,
                );
                runs += 1;
            }
            let flags = [
                "check",
                "--database",
                "d",
                "--mongodb-uri",
                mongodb_uri.as_str(),
                "--nats-url",
                nats_url,
            ];
            assert_no_secret(&format!("{flags:?}"), &output_of(&flags, &[]));
        }
    }
    assert_eq!(runs, 72);
}

/// The test above must be able to fail: the secrets are in what the
/// commands were given, and a check that reaches NATS names its address.
#[test]
fn the_commands_do_show_the_addresses() {
    let text = output_of(
        &[
            "check",
            "--database",
            "d",
            "--mongodb-uri",
            &mongodb_uris()[0],
        ],
        &[("OUTBOX_NATS_URL", NATS_URLS[0])],
    );
    assert!(text.contains("mongodb://app:***@127.0.0.1:1"), "{text}");
}
