//! Tests at volume, alone on the servers: a test that loads the shared
//! servers for a minute stretches the waits of the tests beside it past
//! their bounds on a two-core machine. Cargo runs test binaries one after
//! another, so this one runs alone.

#[path = "../common/mod.rs"]
mod common;

use std::time::Duration;

use bson::{oid::ObjectId, Document};

use common::history::*;
use common::*;

#[tokio::test]
async fn a_replay_of_100000_messages_holds_the_memory_of_a_few() {
    let mut history = History::of(Vec::new()).await;
    for _ in 0..10 {
        let batch: Vec<Document> = (0..10_000)
            .map(|n| delivered(ObjectId::new(), "order.placed", &format!("k{}", n % 100)))
            .collect();
        history
            .env
            .outbox()
            .insert_many(batch)
            .await
            .expect("insert");
    }
    let output = bounded_for(history.replay_all(&[]), Duration::from_secs(600)).await;
    assert_exit(&output, 0, "");
    let summary = summary(&output);
    assert_eq!(summary["sent"], 100_000);
    eprintln!("a replay of 100,000 messages: {summary}");
    assert_eq!(history.count().await, 100_000);
    // A relay draining a backlog holds 30 to 50 MiB; a replay streams its
    // range, and holds no more.
    let peak = summary["peak_memory_mib"].as_f64().expect("Linux says it");
    assert!(peak < 64.0, "peak memory {peak} MiB");
    history.drop().await;
}
