//! The delivery-latency benchmark as a bench target.
//!
//! `cargo bench --bench latency` runs push, poll and the change-stream
//! floor at 100 and 1000 messages a second, and a 10,000-message backlog
//! drain, against MONGODB_URI and NATS_URL (scripts/services.sh starts local
//! ones; scripts/bench.sh runs the full benchmark on the faster server).
//! Under `cargo test` it runs a few messages so it keeps working; it checks
//! that everything arrived, never how fast.

use std::path::PathBuf;
use std::time::Duration;

use outbox_relay::bench::{self, BenchConfig, Keys};

#[tokio::main]
async fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let env =
        |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let output = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-latency");
    let config = BenchConfig {
        mongodb_uri: env("MONGODB_URI", "mongodb://127.0.0.1:27017"),
        nats_url: env("NATS_URL", "nats://127.0.0.1:4222"),
        relay_binary: PathBuf::from(env!("CARGO_BIN_EXE_outbox-relay")),
        rates: if full {
            vec![Some(100), Some(1000)]
        } else {
            vec![Some(50)]
        },
        count: if full { 2000 } else { 20 },
        poll_intervals: vec![Duration::from_millis(100)],
        backlog: vec![if full { 10_000 } else { 50 }],
        payload_bytes: 0,
        inbox: if full { 10_000 } else { 50 },
        audit: if full { 100_000 } else { 0 },
        idle: Duration::from_secs(if full { 120 } else { 1 }),
        keys: if full {
            vec![Keys::None, Keys::Spread(10_000), Keys::One]
        } else {
            vec![Keys::None, Keys::One]
        },
        relays: if full { vec![1, 2, 4] } else { vec![1, 2] },
        group_rate: Some(if full { 1000 } else { 50 }),
        group_burst: if full { 20_000 } else { 50 },
        output: output.clone(),
        server: bench::describe_server(&env("MONGODB_URI", "mongodb://127.0.0.1:27017")).await,
    };
    let report = match bench::run(&config).await {
        Ok(report) => report,
        Err(error) => {
            eprintln!("benchmark failed: {error}");
            std::process::exit(1);
        }
    };
    bench::print_table(&report);
    let mut incomplete: Vec<&str> = report
        .runs
        .iter()
        .filter(|run| run.received < run.messages)
        .map(|run| run.mode.as_str())
        .collect();
    incomplete.extend(
        report
            .groups
            .iter()
            .filter(|group| group.received < group.messages)
            .map(|_| "a group of relays"),
    );
    let groups_expected = config.relays.len() + 1;
    if report.groups.len() != groups_expected {
        eprintln!(
            "the benchmark ran {} groups of relays, not {groups_expected}",
            report.groups.len()
        );
        std::process::exit(1);
    }
    if !incomplete.is_empty() {
        eprintln!("benchmark runs lost messages: {incomplete:?}");
        std::process::exit(1);
    }
    let written = bench::write_json(&report, &output.join("bench.json")).and_then(|()| {
        bench::write_plot(
            &report,
            config.rates.last().copied().flatten(),
            &output.join("latency-cdf.svg"),
        )
    });
    if let Err(error) = written {
        eprintln!("{error}");
        std::process::exit(1);
    }
}
