//! Demo consumer for the relay's stream (see scripts/demo.sh): applies
//! `order.placed` messages to a projection through the inbox, so each
//! order counts once however often its message arrives.
//!
//! First it handles what the relay published, then checks the projection
//! against the orders themselves. Then it replays the whole stream to the
//! same inbox, every message delivered a second time, as after a crash
//! between commit and acknowledgement or a repeat past JetStream's duplicate
//! window, and shows that the projection did not change.
//!
//! With DEMO_CONSUMER set to a new name, it is a new consumer of a
//! replay (`outbox-relay replay`, see scripts/demo.sh): its inbox has no
//! records, so it applies the replayed history to a projection of its own,
//! which must match the orders too; the second delivery is left out.
//!
//! Settings (environment): MONGODB_URI, NATS_URL, DEMO_DATABASE (demo),
//! DEMO_PREFIX (demo), DEMO_STREAM (DEMO), DEMO_CONSUMER (projection),
//! DEMO_SUBJECT (<prefix>.order.placed).

use std::error::Error;
use std::time::Duration;

use async_nats::jetstream;
use bson::{doc, Bson, Document};
use futures::TryStreamExt;
use mongodb::{ClientSession, Collection};
use outbox_relay::inbox::{Delivery, Handler, HandlerError, Inbox};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
struct OrderPlaced {
    customer: String,
    total_cents: i64,
}

/// How long the consumer may handle nothing before the demo gives up.
const STILL_FOR: Duration = Duration::from_secs(60);

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Adds each order to its customer's totals, in the message's transaction.
struct Projection {
    totals: Collection<Document>,
}

impl Handler for Projection {
    async fn handle(
        &self,
        session: &mut ClientSession,
        message: &Delivery,
    ) -> Result<(), HandlerError> {
        let order: OrderPlaced = message.json()?;
        self.totals
            .update_one(
                doc! { "_id": &order.customer },
                doc! { "$inc": { "orders": 1, "totalCents": order.total_cents } },
            )
            .upsert(true)
            .session(session)
            .await?;
        Ok(())
    }
}

/// Orders and cents summed over `collection`: what `orders` and `cents`
/// (`$group` expressions) add up to.
async fn sums(
    collection: &Collection<Document>,
    orders: Bson,
    cents: &str,
) -> Result<(i64, i64), Box<dyn Error + Send + Sync>> {
    let pipeline = [doc! { "$group": {
        "_id": null,
        "orders": { "$sum": orders },
        "cents": { "$sum": cents },
    } }];
    let sums: Vec<Document> = collection.aggregate(pipeline).await?.try_collect().await?;
    let number = |name: &str| {
        sums.first()
            .and_then(|d| d.get(name))
            .and_then(|v| v.as_i64().or_else(|| v.as_i32().map(i64::from)))
            .unwrap_or(0)
    };
    Ok((number("orders"), number("cents")))
}

/// Runs the inbox's consumer (durable, named as the inbox's consumer)
/// until JetStream has nothing left for it.
async fn drain(
    inbox: &Inbox,
    jetstream: &jetstream::Context,
    stream: &str,
    subject: &str,
    handler: impl Handler,
) -> Result<(), Box<dyn Error + Send + Sync>> {
    let name = inbox.name().to_owned();
    let consumer = inbox
        .consumer(jetstream.clone(), stream)
        .durable(&name)
        .filter_subject(subject)
        .bind()
        .await?;
    let backlog = consumer.backlog();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(handler, shutdown.clone()));
    // A slow server is given time as long as the consumer moves: each
    // message is an inbox transaction, and the demo's server (the Python
    // SecantusDB) commits them slowly.
    let mut left = backlog.remaining().await?;
    loop {
        let every = Duration::from_millis(200);
        match tokio::time::timeout(STILL_FOR, backlog.caught_up(every)).await {
            Ok(()) => break,
            Err(_) => {
                let now_left = backlog.remaining().await?;
                if now_left >= left {
                    return Err(format!(
                        "the consumer handled nothing for {STILL_FOR:?}, with {now_left} \
                         messages left"
                    )
                    .into());
                }
                left = now_left;
            }
        }
    }
    shutdown.cancel();
    running.await??;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error + Send + Sync>> {
    let mongodb_uri = setting("MONGODB_URI", "mongodb://127.0.0.1:27017");
    let nats_url = setting("NATS_URL", "nats://127.0.0.1:4222");
    let database = setting("DEMO_DATABASE", "demo");
    let prefix = setting("DEMO_PREFIX", "demo");
    let stream = setting("DEMO_STREAM", "DEMO");
    let name = setting("DEMO_CONSUMER", "projection");
    let subject = setting("DEMO_SUBJECT", &format!("{prefix}.order.placed"));
    let fresh = name != "projection";

    let client = outbox_relay::connect::connect_mongodb(&mongodb_uri).await?;
    let db = client.database(&database);
    let jetstream = jetstream::new(async_nats::connect(&nats_url).await?);
    let totals = match fresh {
        false => db.collection::<Document>("order_totals"),
        true => db.collection::<Document>(&format!("order_totals_{name}")),
    };
    totals.drop().await?;
    let inbox = Inbox::builder(&db, &name).build().await?;
    inbox
        .collection()
        .delete_many(doc! { "consumer": &name })
        .await?;
    // A consumer left by an earlier run would start where that one ended.
    if let Ok(stream) = jetstream.get_stream(&stream).await {
        let _ = stream.delete_consumer(&name).await;
    }

    drain(
        &inbox,
        &jetstream,
        &stream,
        &subject,
        Projection {
            totals: totals.clone(),
        },
    )
    .await?;
    let projected = sums(&totals, "$orders".into(), "$totalCents").await?;
    let ordered = sums(&db.collection("orders"), 1.into(), "$totalCents").await?;
    let counts = inbox.metrics().counts(&name);
    println!(
        "projection: {} orders, {} cents; the orders collection: {} orders, {} cents{}",
        projected.0,
        projected.1,
        ordered.0,
        ordered.1,
        if projected == ordered {
            " (they match)"
        } else {
            " (they DIFFER)"
        }
    );
    println!(
        "handled {}, repeats skipped {}",
        counts.handled, counts.repeats
    );
    if fresh {
        if projected != ordered {
            std::process::exit(1);
        }
        return Ok(());
    }

    // Every message delivered again: the inbox knows them all.
    if let Ok(stream) = jetstream.get_stream(&stream).await {
        stream.delete_consumer(&name).await?;
    }
    drain(
        &inbox,
        &jetstream,
        &stream,
        &subject,
        Projection {
            totals: totals.clone(),
        },
    )
    .await?;
    let replayed = sums(&totals, "$orders".into(), "$totalCents").await?;
    let counts = inbox.metrics().counts(&name);
    println!(
        "replayed the whole stream: {} repeats skipped, projection {} orders, {} cents{}",
        counts.repeats,
        replayed.0,
        replayed.1,
        if replayed == projected {
            " (unchanged)"
        } else {
            " (CHANGED)"
        }
    );
    if projected != ordered || replayed != projected {
        std::process::exit(1);
    }
    Ok(())
}
