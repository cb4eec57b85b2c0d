//! `outbox-relay bench`: its flags, and writing its results.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use outbox_relay::bench::{self, BenchConfig, Keys};
use outbox_relay::{Error, Result};

use super::duration;

/// `outbox-relay bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// MongoDB to measure against (a database of its own is used and dropped).
    #[arg(
        long,
        env = "OUTBOX_MONGODB_URI",
        hide_env_values = true,
        default_value = "mongodb://127.0.0.1:27017"
    )]
    pub mongodb_uri: String,
    /// NATS to measure against.
    #[arg(
        long,
        env = "OUTBOX_NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// Offered rates in messages a second, comma-separated; "max" is as fast as it goes; "none" runs none.
    #[arg(long, default_value = "20,100,1000,max", value_delimiter = ',')]
    pub rates: Vec<String>,
    /// Messages per run; a run at a low rate writes a minute's worth at most.
    #[arg(long, default_value_t = 2000)]
    pub count: usize,
    /// Poll intervals to compare against, comma-separated; "none" runs none.
    #[arg(long, default_value = "1s,100ms", value_delimiter = ',', value_parser = poll_interval)]
    pub poll_intervals: Vec<Option<Duration>>,
    /// Messages in the backlog drain, comma-separated for several sizes
    /// (each drained on a first start and resumed); 0 skips it.
    #[arg(long, default_value = "100000", value_delimiter = ',')]
    pub backlog: Vec<usize>,
    /// Bytes of padding in each backlog message's payload, to measure the
    /// memory budget with large messages [default: a payload of a few bytes].
    #[arg(long, default_value_t = 0)]
    pub payload_bytes: usize,
    /// Messages the inbox handles, timed against the same updates without
    /// it, then the latency from outbox commit to consumer commit; 0 skips.
    #[arg(long, default_value_t = 10_000)]
    pub inbox: usize,
    /// Messages in a window of delivered messages that `audit` checks,
    /// timed with its memory; 0 skips it.
    #[arg(long, default_value_t = 0)]
    pub audit: usize,
    /// How long a quiet leader, then a standby beside it, are watched for
    /// their CPU and MongoDB operations; 0 skips it.
    #[arg(long, default_value = "2m", value_parser = duration)]
    pub idle: Duration,
    /// How messages are keyed, comma-separated: "none", a number of
    /// distinct keys, or "one" (a single hot key); push over JetStream and
    /// the backlog drain run once for each.
    #[arg(long, default_value = "none,10000,one", value_delimiter = ',')]
    pub keys: Vec<String>,
    /// Group sizes to compare, comma-separated (say 1,2,4): each runs on as
    /// many partitions as the largest, beside one relay with one, on the
    /// same keyed load; 1 alone runs no group.
    #[arg(long, default_value = "1", value_delimiter = ',')]
    pub relays: Vec<usize>,
    /// The group runs' paced rate, in messages a second, or "max".
    #[arg(long, default_value = "1000")]
    pub group_rate: String,
    /// Messages the group runs write at once, to time a full load.
    #[arg(long, default_value_t = 20_000)]
    pub group_burst: usize,
    /// Folder for bench.json, latency-cdf.svg and the relay logs.
    #[arg(long, default_value = "bench-results")]
    pub output: PathBuf,
    /// How to describe the MongoDB server in the results [default: its buildInfo version].
    #[arg(long)]
    pub server: Option<String>,
}

/// A rate in messages a second, or "max" (`None`), for the flag `flag`.
/// Reads one of `--poll-intervals`: a duration, or "none".
fn poll_interval(text: &str) -> std::result::Result<Option<Duration>, String> {
    match text.trim() {
        "none" => Ok(None),
        every => duration(every).map(Some),
    }
}

fn parse_rate(flag: &str, rate: &str) -> Result<Option<u32>> {
    match rate.trim() {
        "max" => Ok(None),
        number => number
            .parse::<u32>()
            .ok()
            .filter(|&r| r > 0)
            .map(Some)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{flag}: {number:?} is neither a positive number nor \"max\""
                ))
            }),
    }
}

/// The largest padding `--payload-bytes` takes: NATS's default
/// `max_payload` (1 MB), less room for the rest of the message.
const MAX_PAYLOAD_BYTES: usize = 1_000_000 - 4_096;

impl BenchArgs {
    /// The checked benchmark settings.
    fn resolve(self, server: String) -> Result<BenchConfig> {
        // "none": no latency runs, for a run of the other parts alone.
        let rates = self
            .rates
            .iter()
            .filter(|rate| rate.trim() != "none")
            .map(|rate| parse_rate("--rates", rate))
            .collect::<Result<Vec<_>>>()?;
        let keys = self
            .keys
            .iter()
            .map(|keys| match keys.trim() {
                "none" => Ok(Keys::None),
                "one" => Ok(Keys::One),
                number => number
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| n > 0)
                    .map(Keys::Spread)
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "--keys: {number:?} is neither \"none\", \"one\" nor a positive number"
                        ))
                    }),
            })
            .collect::<Result<Vec<_>>>()?;
        if self.count == 0 {
            return Err(Error::Config("--count must be at least 1".into()));
        }
        if self.payload_bytes > MAX_PAYLOAD_BYTES {
            return Err(Error::Config(format!(
                "--payload-bytes {} is more than {MAX_PAYLOAD_BYTES}, the most NATS takes in a \
                 message by default (max_payload)",
                self.payload_bytes
            )));
        }
        // Each size drains in a collection of its own: one named twice
        // would be drained resumed where a first start was meant.
        let mut seen = std::collections::HashSet::new();
        let backlog: Vec<usize> = self
            .backlog
            .iter()
            .copied()
            .filter(|&n| n > 0 && seen.insert(n))
            .collect();
        if let Some(n) = self.relays.iter().find(|n| !(1..=64).contains(*n)) {
            return Err(Error::Config(format!(
                "--relays: {n} is not between 1 and 64 (a group shares at most 64 partitions)"
            )));
        }
        let group_rate = parse_rate("--group-rate", &self.group_rate)?;
        let relay_binary = std::env::current_exe()
            .map_err(|e| Error::io("cannot find this program's path to start the relay", e))?;
        Ok(BenchConfig {
            mongodb_uri: self.mongodb_uri,
            nats_url: self.nats_url,
            relay_binary,
            rates,
            count: self.count,
            poll_intervals: self.poll_intervals.into_iter().flatten().collect(),
            backlog,
            payload_bytes: self.payload_bytes,
            inbox: self.inbox,
            audit: self.audit,
            idle: self.idle,
            keys,
            relays: self.relays,
            group_rate,
            group_burst: self.group_burst.max(1),
            output: self.output,
            server: self.server.unwrap_or(server),
        })
    }

    /// Runs the benchmark, prints its table, and writes bench.json and the
    /// latency plot (of 1,000 messages a second, or else the first rate).
    pub async fn run(self) -> Result<()> {
        let server = bench::describe_server(&self.mongodb_uri).await;
        let config = self.resolve(server)?;
        let report = bench::run(&config).await?;
        bench::print_table(&report);
        let json = config.output.join("bench.json");
        bench::write_json(&report, &json)?;
        let plotted = config
            .rates
            .iter()
            .copied()
            .find(|r| *r == Some(1000))
            .or(config.rates.first().copied());
        let plot = config.output.join("latency-cdf.svg");
        bench::write_plot(&report, plotted.flatten(), &plot)?;
        println!("results: {} and {}", json.display(), plot.display());
        Ok(())
    }
}
