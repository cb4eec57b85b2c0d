//! The relay under test, as a process of its own, so its CPU time and
//! memory are its own and can be read from `/proc`.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};

/// The relay's log filter: the one asked for, if any, with every line of
/// the change stream source kept whatever it says. The benchmark reads
/// them to refuse a drain of the wrong kind (a replay that caught up from
/// the collection, say), which a quieter filter would let pass unseen.
fn log_filter(asked: Option<String>) -> String {
    let keep = format!("{}=trace", crate::source::change_stream::LOG_TARGET);
    match asked {
        // A later directive for the same target replaces an earlier one.
        Some(asked) if !asked.trim().is_empty() => format!("{asked},{keep}"),
        _ => format!("info,{keep}"),
    }
}

/// The user and system CPU time of process `pid` ("self" for this one), in
/// seconds (Linux `/proc`; zero elsewhere).
pub fn cpu_seconds(pid: &str) -> f64 {
    let ticks_per_second = 100.0; // USER_HZ on Linux
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // Fields after the command name, which is in parentheses.
            let rest = stat.rsplit_once(')')?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let user: f64 = fields.get(11)?.parse().ok()?;
            let system: f64 = fields.get(12)?.parse().ok()?;
            Some((user + system) / ticks_per_second)
        })
        .unwrap_or(0.0)
}

/// A relay process started for one benchmark run.
pub struct RelayProcess {
    child: Child,
    /// Where it serves its metrics.
    metrics_port: u16,
}

/// What the relay itself measured, from its `/metrics`: means, since the
/// histograms' buckets are too coarse for percentiles at this scale.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct RelayView {
    /// Mean time from a message's commit (its change event's wall time) to
    /// the broker's acknowledgement.
    pub commit_to_ack_mean_ms: f64,
    /// Mean time from sending a message to its acknowledgement.
    pub publish_ack_mean_ms: f64,
}

/// What the relay process used.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Usage {
    /// User plus system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// Peak resident set size, in MiB.
    pub peak_rss_mib: f64,
}

impl RelayProcess {
    /// Starts `binary run` with these flags; its log goes to `log`.
    pub fn start(binary: &Path, args: &[String], log: &Path) -> Result<Self> {
        let file = std::fs::File::create(log)
            .map_err(|e| Error::io(format!("cannot write {}", log.display()), e))?;
        let metrics_port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .map_err(|e| Error::io("cannot find a free port for metrics", e))?;
        let child = Command::new(binary)
            .arg("run")
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(args)
            .env("RUST_LOG", log_filter(std::env::var("RUST_LOG").ok()))
            .stdout(Stdio::null())
            .stderr(Stdio::from(file))
            .spawn()
            .map_err(|e| Error::io(format!("cannot start {}", binary.display()), e))?;
        Ok(RelayProcess {
            child,
            metrics_port,
        })
    }

    /// Whether the process has exited (it gave up, say, on a server it
    /// could not use).
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// CPU time and peak memory so far (Linux `/proc`; zero elsewhere).
    pub fn usage(&self) -> Usage {
        let pid = self.child.id();
        let cpu_seconds = cpu_seconds(&pid.to_string());
        let peak_rss_mib = crate::usage::peak_memory_mib(&pid.to_string()).unwrap_or(0.0);
        Usage {
            cpu_seconds,
            peak_rss_mib,
        }
    }

    /// The relay's own view of its latency, if its metrics answer.
    pub async fn view(&self) -> Option<RelayView> {
        let text = http_get(self.metrics_port, "/metrics").await?;
        let value = |name: &str| metric(&text, name);
        let mean_ms = |histogram: &str| {
            let sum = value(&format!("{histogram}_sum"))?;
            let count = value(&format!("{histogram}_count")).filter(|c| *c > 0.0)?;
            Some(sum / count * 1e3)
        };
        Some(RelayView {
            commit_to_ack_mean_ms: mean_ms("outbox_commit_to_publish_seconds")?,
            publish_ack_mean_ms: mean_ms("outbox_publish_ack_seconds")?,
        })
    }

    /// Whether it reports itself ready, if its metrics answer.
    pub async fn ready(&self) -> Option<bool> {
        let text = http_get(self.metrics_port, "/metrics").await?;
        metric(&text, "outbox_ready").map(|ready| ready >= 1.0)
    }

    /// How many messages it has marked processed, if its metrics answer.
    pub async fn processed(&self) -> Option<u64> {
        let text = http_get(self.metrics_port, "/metrics").await?;
        metric(&text, "outbox_processed_total").map(|count| count as u64)
    }

    /// Stops it with SIGTERM, waiting up to `limit` before killing it.
    pub async fn stop(mut self, limit: Duration) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A sample's value in a metrics exposition: the line `name value`.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(name)?
            .strip_prefix(' ')?
            .parse::<f64>()
            .ok()
    })
}

/// The body of an HTTP/1.0 GET on the loopback, or `None` on any failure.
async fn http_get(port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        Some(response.split_once("\r\n\r\n")?.1.to_owned())
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[cfg(all(test, feature = "cli"))]
mod tests {
    use tracing::Level;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::EnvFilter;

    use super::log_filter;
    use crate::source::change_stream::LOG_TARGET;

    /// Whether the source's events, and another module's, at `$level`
    /// pass the filter a bench relay gets for `$asked`.
    macro_rules! logs_at {
        ($asked:expr, $level:expr) => {
            with_filter($asked, || {
                (
                    tracing::enabled!(target: LOG_TARGET, $level),
                    tracing::enabled!(target: "outbox_relay::publish", $level),
                )
            })
        };
    }

    fn logs(asked: Option<&str>) -> (bool, bool) {
        logs_at!(asked, Level::INFO)
    }

    fn with_filter<T>(asked: Option<&str>, check: impl FnOnce() -> T) -> T {
        let filter = EnvFilter::try_new(log_filter(asked.map(str::to_owned)))
            .unwrap_or_else(|e| panic!("{asked:?} gave a filter that does not parse: {e}"));
        let subscriber = tracing_subscriber::registry().with(filter);
        tracing::subscriber::with_default(subscriber, check)
    }

    #[test]
    fn a_bench_relay_logs_what_the_benchmark_reads_whatever_rust_log_says() {
        assert_eq!(logs(None), (true, true));
        assert_eq!(logs(Some(" ")), (true, true));
        assert_eq!(
            logs(Some("warn")),
            (true, false),
            "quieter elsewhere, as asked"
        );
        assert_eq!(logs(Some("off")), (true, false));
        assert_eq!(
            logs(Some(&format!("info,{LOG_TARGET}=error"))),
            (true, true)
        );
        assert_eq!(logs(Some("outbox_relay=debug")), (true, true));
        for more in ["debug", "outbox_relay=debug"] {
            assert_eq!(
                logs_at!(Some(more), Level::DEBUG),
                (true, true),
                "{more}: no quieter than asked"
            );
        }
    }
}
