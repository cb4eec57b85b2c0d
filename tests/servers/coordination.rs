//! The relay's coordination survives a failover only if the majority holds
//! what it reads and writes: every lease and checkpoint write, and every
//! mark, carries write concern `majority`, and every read of the outbox's
//! candidates carries read concern `majority`, even when the connection
//! string asks for `w=1` and `readConcernLevel=local`. Checked by watching
//! the commands the driver sends to the real server.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{doc, Document};
use mongodb::event::command::CommandEvent;
use mongodb::event::EventHandler;
use mongodb::options::ClientOptions;
use mongodb::Client;
use outbox_relay::publish::NatsPublisher;
use outbox_relay::{Metrics, Relay};
use tokio_util::sync::CancellationToken;

use crate::common::{write_orders, TestEnv, WAIT};

/// The commands sent, as the server saw them.
type Sent = Arc<Mutex<Vec<(String, Document)>>>;

async fn watched_client(uri: &str, sent: &Sent) -> Client {
    let separator = if uri.contains('?') { '&' } else { '?' };
    let weak = format!("{uri}{separator}w=1&readConcernLevel=local");
    let mut options = ClientOptions::parse(&weak).await.expect("a valid URI");
    let log = sent.clone();
    options.command_event_handler = Some(EventHandler::callback(move |event| {
        if let CommandEvent::Started(started) = event {
            if let Ok(mut log) = log.lock() {
                log.push((started.command_name, started.command));
            }
        }
    }));
    Client::with_options(options).expect("a client")
}

/// The collection a command names: its first field's value.
fn target(command: &Document) -> Option<&str> {
    command.iter().next().and_then(|(_, value)| value.as_str())
}

fn level(command: &Document, concern: &str, field: &str) -> Option<String> {
    let value = command.get_document(concern).ok()?.get(field)?;
    Some(
        value
            .as_str()
            .map_or_else(|| value.to_string(), str::to_owned),
    )
}

#[tokio::test]
async fn coordination_reads_and_writes_the_majority_whatever_the_uri_says() {
    let env = TestEnv::new().await;
    let pending = write_orders(&env, 3).await;
    let sent: Sent = Arc::default();
    let client = watched_client(&env.mongodb_uri, &sent).await;
    let mut config = env.quick_config(2);
    config.sweep_interval = Duration::from_millis(50);
    let metrics = Metrics::new();
    let publisher = NatsPublisher::connect(&config, &metrics)
        .await
        .expect("NATS");
    let relay = Relay::with_publisher(config, client.database(&env.name), Arc::new(publisher))
        .expect("a relay");
    relay.prepare().await.expect("the outbox prepared");
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));

    let later = write_orders(&env, 2).await;
    env.wait_count(
        doc! { "status": "processed" },
        (pending.len() + later.len()) as u64,
    )
    .await;
    // A sweep pass reads its candidates too.
    crate::common::wait_until("a sweep's candidate read", || {
        let sent = sent.clone();
        async move {
            let sent = sent.lock().expect("the command log");
            sent.iter()
                .filter(|(name, command)| name == "find" && target(command) == Some("outbox"))
                .count()
                >= 2
        }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(WAIT, running)
        .await
        .expect("the relay stops")
        .expect("the relay task")
        .expect("the relay ran");

    let sent = sent.lock().expect("the command log").clone();
    let writes: Vec<_> = sent
        .iter()
        .filter(|(name, _)| matches!(name.as_str(), "update" | "findAndModify" | "insert"))
        .filter(|(_, command)| matches!(target(command), Some("outbox" | "outbox_checkpoints")))
        .collect();
    let reads: Vec<_> = sent
        .iter()
        .filter(|(name, _)| matches!(name.as_str(), "find" | "aggregate"))
        .filter(|(_, command)| matches!(target(command), Some("outbox" | "outbox_checkpoints")))
        .collect();
    let lease_writes = writes
        .iter()
        .filter(|(name, command)| {
            name == "findAndModify" && target(command) == Some("outbox_checkpoints")
        })
        .count();
    assert!(lease_writes >= 1, "the lease was taken: {sent:?}");
    assert!(
        writes.iter().any(|(_, c)| target(c) == Some("outbox")),
        "the marks were seen"
    );
    for (name, command) in &writes {
        assert_eq!(
            level(command, "writeConcern", "w").as_deref(),
            Some("majority"),
            "{name} {command}"
        );
        assert!(
            command
                .get_document("writeConcern")
                .is_ok_and(|c| c.contains_key("wtimeout")),
            "a bounded wait: {command}"
        );
    }
    assert!(!reads.is_empty(), "the reads were seen");
    for (name, command) in &reads {
        // The catch-up pass reads a snapshot, which holds only what a
        // majority has committed, as majority reads do.
        let level = level(command, "readConcern", "level");
        assert!(
            matches!(level.as_deref(), Some("majority" | "snapshot")),
            "{name} {command}"
        );
    }
    assert!(
        reads.iter().any(
            |(_, command)| level(command, "readConcern", "level").as_deref() == Some("snapshot")
        ),
        "the catch-up pass read a snapshot: {reads:?}"
    );
    env.drop().await;
}
