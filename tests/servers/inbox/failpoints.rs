//! The inbox's transaction and commit meeting the errors a replica set
//! returns, injected with `failCommand` scoped by `appName` to the
//! consumer's client: a commit whose outcome is unknown (a dropped
//! connection, a write concern error so labelled), a write inside the
//! transaction failing with a transient label, a held connection. Each
//! message's effect is applied once, each key's in stream order.

use super::*;
use crate::common::failpoint::{self, Failure};
use crate::common::{nats_url, MongoProcess};

/// The name the consumer under test gives its connections.
const CONSUMER: &str = "inbox-under-test";

/// Messages published while one fault is armed, a third of them keyed.
const BATCH: usize = 12;
const KEYS: usize = 2;

#[tokio::test]
async fn transaction_errors_apply_each_effect_once_in_each_keys_order() {
    let mongo = MongoProcess::start_with(&["--enable-test-commands"]).await;
    let env = TestEnv::on(&mongo.uri(), &nats_url()).await;
    let client = mongodb::Client::with_uri_str(failpoint::uri_for(&mongo.uri(), CONSUMER))
        .await
        .unwrap();
    let db = client.database(&env.name);
    let metrics = InboxMetrics::new();
    let inbox = Inbox::builder(&db, "billing")
        .metrics(metrics.clone())
        .build()
        .await
        .unwrap();
    let effects = env.db.collection::<Document>("effects");
    let consumer = quick(&inbox, &env).bind().await.unwrap();
    let running = Running::start(consumer, recording(&db.collection("effects")));

    let faults = [
        (
            "commit: connection closed",
            &["commitTransaction"][..],
            Failure::CloseConnection,
        ),
        (
            "commit: WriteConcernFailed, UnknownTransactionCommitResult",
            &["commitTransaction"][..],
            Failure::Code(64, &["UnknownTransactionCommitResult"]),
        ),
        (
            "write: WriteConflict, TransientTransactionError",
            &["update"][..],
            Failure::Code(112, &["TransientTransactionError"]),
        ),
        (
            "write: NotWritablePrimary, TransientTransactionError",
            &["update", "insert"][..],
            Failure::Code(10107, &["TransientTransactionError"]),
        ),
        (
            "commit: connection held 1 s",
            &["commitTransaction"][..],
            Failure::Block(1000),
        ),
    ];
    let mut published: HashMap<String, Vec<String>> = HashMap::new();
    let mut all = Vec::new();
    for (n, (name, commands, failure)) in faults.iter().enumerate() {
        failpoint::arm(&env.client, CONSUMER, commands, 3, failure).await;
        for m in 0..BATCH {
            let id = ObjectId::new().to_hex();
            let key = (m % 3 == 0).then(|| format!("k{}", (n * BATCH + m) % KEYS));
            assert!(publish_stored(&env, "order.placed", &id, key.as_deref()).await);
            if let Some(key) = key {
                published.entry(key).or_default().push(id.clone());
            }
            all.push(id);
        }
        wait_until(
            &format!("the messages published under {name:?} to be handled"),
            || async { metrics.counts("billing").handled >= all.len() as u64 },
        )
        .await;
        failpoint::off(&env.client).await;
    }
    for id in &all {
        assert_eq!(counted(&effects, id).await, 1, "{id}: applied once");
    }
    for (key, ids) in &published {
        let found = effects
            .find_one(doc! { "_id": format!("key-{key}") })
            .await
            .unwrap()
            .expect("the key's list");
        let order: Vec<String> = found
            .get_array("ids")
            .unwrap()
            .iter()
            .filter_map(|id| id.as_str().map(str::to_owned))
            .collect();
        assert_eq!(&order, ids, "{key}: each message once, in stream order");
    }
    running.stop().await;
    env.drop().await;
}
