//! What one MongoDB round trip costs the driver in CPU, back to back and
//! paced at the rates the relay meets: the share of a message's CPU that
//! no relay built on the driver can take away.
//!
//! `cargo bench --bench round_trip` reads one small document by `_id`,
//! 3,000 times back to back, then at 1,000 and 100 a second, against
//! MONGODB_URI, and prints the CPU of this process each read (user and
//! system, over the reads alone), beside the CPU of the pacing's sleeps
//! alone. Under `cargo test` it runs a few reads so it keeps working.

use std::time::Duration;

use bson::{doc, Document};
use mongodb::Collection;
use outbox_relay::bench::cpu_seconds;
use tokio::time::Instant;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let uri = std::env::var("MONGODB_URI").unwrap_or_else(|_| "mongodb://127.0.0.1:27017".into());
    if let Err(error) = measure(&uri, if full { 3000 } else { 20 }).await {
        eprintln!("round-trip benchmark failed: {error}");
        std::process::exit(1);
    }
}

async fn measure(uri: &str, reads: usize) -> Result<(), String> {
    let client = outbox_relay::connect::connect_mongodb(uri)
        .await
        .map_err(|e| e.to_string())?;
    let database = client.database(&format!("round_trip_{}", bson::oid::ObjectId::new()));
    let measured = reads_timed(&database, reads).await;
    let dropped = database.drop().await.map_err(failed);
    measured.and(dropped)
}

async fn reads_timed(database: &mongodb::Database, reads: usize) -> Result<(), String> {
    let documents = database.collection::<Document>("documents");
    documents
        .insert_one(doc! { "_id": 1, "payload": "x" })
        .await
        .map_err(failed)?;
    println!(
        "{:<16} {:>12} {:>14}",
        "reads", "cpu µs/read", "of it pacing"
    );
    for rate in [None, Some(1_000), Some(100)] {
        let pause = rate.map(|rate| Duration::from_secs(1) / rate);
        let with_reads = timed(reads, pause, Some(&documents)).await?;
        let pacing = timed(reads, pause, None).await?;
        let label = rate.map_or("back to back".into(), |rate| format!("at {rate}/s"));
        println!("{label:<16} {with_reads:>12.0} {pacing:>14.0}");
    }
    Ok(())
}

fn failed(error: mongodb::error::Error) -> String {
    format!("a round trip failed: {error}")
}

/// CPU µs each of `n` rounds of a pause (if any) then a read (if any).
async fn timed(
    n: usize,
    pause: Option<Duration>,
    documents: Option<&Collection<Document>>,
) -> Result<f64, String> {
    let (cpu, mut next) = (cpu_seconds("self"), Instant::now());
    for _ in 0..n {
        if let Some(pause) = pause {
            next += pause;
            tokio::time::sleep_until(next).await;
        }
        if let Some(documents) = documents {
            documents
                .find_one(doc! { "_id": 1 })
                .await
                .map_err(failed)?;
        }
    }
    Ok((cpu_seconds("self") - cpu) / n as f64 * 1e6)
}
