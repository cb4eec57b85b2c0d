//! Demo producer and subscriber for a running relay (see scripts/demo.sh).
//!
//! Writes orders and their outbox messages in transactions at a steady rate,
//! subscribes to the relay's subjects, prints what arrives, and ends with a
//! latency summary: time from just before each commit to its receipt, both
//! taken on this process's monotonic clock.
//!
//! Settings (environment): MONGODB_URI, NATS_URL, DEMO_DATABASE (demo),
//! DEMO_PREFIX (demo), DEMO_RATE (messages/s, 300), DEMO_SECONDS (10).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bson::{doc, oid::ObjectId, Document};
use futures::{FutureExt, StreamExt};
use outbox_relay::{MessageType, NewMessage, Outbox};
use serde::Serialize;
use tokio::time::Instant;

#[derive(Serialize)]
struct OrderPlaced {
    order: i64,
    customer: String,
    total_cents: i64,
}

impl MessageType for OrderPlaced {
    const MESSAGE_TYPE: &'static str = "order.placed";
}

fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mongodb_uri = setting("MONGODB_URI", "mongodb://127.0.0.1:27017".to_owned());
    let nats_url = setting("NATS_URL", "nats://127.0.0.1:4222".to_owned());
    let database = setting("DEMO_DATABASE", "demo".to_owned());
    let prefix = setting("DEMO_PREFIX", "demo".to_owned());
    let rate: u32 = setting("DEMO_RATE", 300);
    let seconds: u64 = setting("DEMO_SECONDS", 10);

    let client = outbox_relay::connect::connect_mongodb(&mongodb_uri).await?;
    let db = client.database(&database);
    let nats = async_nats::connect(&nats_url).await?;
    let mut subscription = nats.subscribe(format!("{prefix}.>")).await?;
    nats.flush().await?;

    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let receiver = {
        let (committed, latencies) = (committed.clone(), latencies.clone());
        tokio::spawn(async move {
            let mut early: HashMap<String, Instant> = HashMap::new();
            while let Some(message) = subscription.next().await {
                let received = Instant::now();
                let Some(id) = message.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")) else {
                    continue;
                };
                let id = id.as_str().to_owned();
                let started = committed.lock().map(|c| c.get(&id).copied()).ok().flatten();
                let Some(started) = started.or_else(|| early.remove(&id)) else {
                    early.insert(id, received);
                    continue;
                };
                let latency = received.saturating_duration_since(started);
                let count = latencies.lock().map(|mut l| {
                    l.push(latency);
                    l.len()
                });
                if let Ok(count) = count {
                    if count <= 10 || count % rate.max(1) as usize == 0 {
                        println!(
                            "received #{count:<5} {} {} in {:.2} ms",
                            message.subject,
                            String::from_utf8_lossy(&message.payload),
                            latency.as_secs_f64() * 1e3
                        );
                    }
                }
            }
        })
    };

    println!("writing {rate} orders/s for {seconds} s into {database}.orders + {database}.outbox");
    let total = rate as u64 * seconds;
    let (ticks, ticks_rx) = async_channel::bounded::<i64>(64);
    let mut producers = Vec::new();
    for _ in 0..4 {
        let (client, db, ticks_rx, committed) = (
            client.clone(),
            db.clone(),
            ticks_rx.clone(),
            committed.clone(),
        );
        producers.push(tokio::spawn(async move {
            let outbox = Outbox::new(&db);
            let orders = db.collection::<Document>("orders");
            while let Ok(n) = ticks_rx.recv().await {
                if let Err(error) = place_order(&client, &outbox, &orders, n, &committed).await {
                    eprintln!("order {n} failed: {}", brief(&error));
                }
            }
        }));
    }
    let mut interval = tokio::time::interval(Duration::from_secs(1) / rate.max(1));
    for n in 0..total as i64 {
        interval.tick().await;
        ticks.send(n).await?;
    }
    drop(ticks);
    for producer in producers {
        producer.await?;
    }

    let written = committed.lock().map(|c| c.len()).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(15);
    while latencies.lock().map(|l| l.len()).unwrap_or(0) < written && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    receiver.abort();
    let mut latencies = latencies.lock().map(|l| l.clone()).unwrap_or_default();
    latencies.sort();
    let percentile = |p: f64| {
        let index = ((latencies.len() as f64 * p).ceil() as usize).saturating_sub(1);
        latencies
            .get(index)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    println!();
    println!("committed {written}, received {}", latencies.len());
    println!(
        "commit-to-receipt latency: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        percentile(0.50),
        percentile(0.90),
        percentile(0.99),
        percentile(1.0)
    );
    if latencies.len() < written {
        eprintln!(
            "{} messages did not arrive within 15 s: is the relay running?",
            written - latencies.len()
        );
        std::process::exit(1);
    }
    Ok(())
}

/// Places order `n`: the order and its outbox message in one transaction.
/// The driver's convenient transaction API runs it again after a transient
/// error (a write conflict with a concurrent transaction, an election) and
/// commits again when a commit's result is unknown.
async fn place_order(
    client: &mongodb::Client,
    outbox: &Outbox,
    orders: &mongodb::Collection<Document>,
    n: i64,
    committed: &Mutex<HashMap<String, Instant>>,
) -> mongodb::error::Result<()> {
    let customer = format!("customer-{}", n % 17);
    let total_cents = 1999 + n % 500;
    let mut session = client.start_session().await?;
    let context = (orders, outbox, committed);
    session
        .start_transaction()
        .and_run(context, |session, (orders, outbox, committed)| {
            let customer = customer.clone();
            async move {
                let order = doc! { "n": n, "customer": &customer, "totalCents": total_cents };
                orders.insert_one(order).session(&mut *session).await?;
                let event = OrderPlaced {
                    order: n,
                    customer,
                    total_cents,
                };
                let message = NewMessage::typed(&event)?
                    .key(n.to_string())
                    .correlation_id(ObjectId::new().to_hex());
                let id = outbox.add(session, message).await?;
                // Taken before the commit, as the latency counts from it.
                if let Ok(mut committed) = committed.lock() {
                    committed.insert(id.to_hex(), Instant::now());
                }
                Ok(())
            }
            .boxed()
        })
        .await
}

/// A driver error in one line: the server's message, not its raw reply.
fn brief(error: &mongodb::error::Error) -> String {
    match &*error.kind {
        mongodb::error::ErrorKind::Command(command) => {
            format!("{} (code {})", command.message, command.code)
        }
        _ => error.to_string(),
    }
}
