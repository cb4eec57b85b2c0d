//! Delivered history in a test's outbox, and a stream of its own that
//! `outbox-relay replay` sends it into.

use std::time::Duration;

use async_nats::jetstream;
use bson::{doc, oid::ObjectId, Document};

use super::{output_text, relay_command, stream_messages, TestEnv};

/// A message as the relay left it once delivered.
pub fn delivered(id: ObjectId, message_type: &str, key: &str) -> Document {
    doc! {
        "_id": id, "type": message_type, "key": key, "payload": { "n": id.to_hex() },
        "status": "processed", "processedAt": bson::DateTime::now(),
    }
}

/// A test's outbox, and a stream of its own for a replay's new subject
/// space, `r<name>.>`: outside the relay's prefix, so a replay is told to
/// allow it.
pub struct History {
    pub env: TestEnv,
    pub prefix: String,
    pub stream: jetstream::stream::Stream,
}

impl History {
    /// `messages` written to a new test's outbox.
    pub async fn of(messages: Vec<Document>) -> Self {
        let env = TestEnv::new().await;
        if !messages.is_empty() {
            env.outbox().insert_many(messages).await.expect("insert");
        }
        Self::on(env).await
    }

    /// `count` delivered messages of `order.placed`, over `keys` keys.
    pub async fn delivered(count: usize, keys: usize) -> Self {
        let messages = (0..count)
            .map(|n| delivered(ObjectId::new(), "order.placed", &format!("k{}", n % keys)))
            .collect();
        Self::of(messages).await
    }

    pub async fn on(env: TestEnv) -> Self {
        Self::with_largest(env, -1).await
    }

    /// A history whose replay stream takes messages of at most `largest`
    /// bytes (-1: any).
    pub async fn with_largest(env: TestEnv, largest: i32) -> Self {
        let prefix = format!("r{}", env.name);
        let stream = env
            .jetstream
            .create_stream(jetstream::stream::Config {
                name: prefix.to_uppercase(),
                subjects: vec![format!("{prefix}.>")],
                duplicate_window: Duration::from_secs(3600),
                max_message_size: largest,
                ..Default::default()
            })
            .await
            .expect("create the replay stream");
        History {
            env,
            prefix,
            stream,
        }
    }

    /// `outbox-relay replay` with `args`, allowed to publish under the prefix.
    pub fn replay(&self, args: &[&str]) -> std::process::Command {
        let mut command = relay_command(&self.env);
        command
            .arg("replay")
            .args(args)
            .env("OUTBOX_ALLOW_SUBJECT", format!("{}.>", self.prefix));
        command
    }

    /// `replay` of every message into the prefix, with `args` besides.
    pub fn replay_all(&self, args: &[&str]) -> std::process::Command {
        let prefix = ["--all", "--replay-prefix", &self.prefix, "--json"];
        self.replay(&[&prefix[..], args].concat())
    }

    /// How many messages the replay stream holds.
    pub async fn count(&mut self) -> u64 {
        self.stream
            .info()
            .await
            .expect("stream info")
            .state
            .messages
    }

    /// Every message of the replay stream, in stream order.
    pub async fn stored(&mut self) -> Vec<jetstream::message::StreamMessage> {
        stream_messages(&mut self.stream).await
    }

    pub async fn drop(self) {
        let _ = self
            .env
            .jetstream
            .delete_stream(self.prefix.to_uppercase())
            .await;
        self.env.drop().await;
    }
}

/// The summary a replay printed with `--json`.
pub fn summary(output: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("a JSON summary ({e}): {}", output_text(output)))
}
