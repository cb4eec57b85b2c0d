//! `outbox-relay audit`: its flags, its report, and its exit code (0:
//! nothing missing, 1: something is, 2: a bad setting), for a cron job to
//! alert on.

use std::fmt::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use outbox_relay::audit::{self, Conclusion, Findings, Listed, Summary};
use outbox_relay::Result;
use tokio_util::sync::CancellationToken;

use super::{duration, to_json, RunArgs, WindowArgs};

/// `outbox-relay audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub window: WindowArgs,
    /// Most messages a second it reads of the streams and of the outbox, so a relay beside it keeps its pace; "max": as fast as the servers answer.
    #[arg(long, default_value = "10000", value_parser = read_rate)]
    pub read_rate: ReadRate,
    /// Publish the missing messages again, each with its own id, subject and headers, then audit again.
    #[arg(long)]
    pub repair: bool,
    /// Most messages a second a repair sends.
    #[arg(long, requires = "repair")]
    pub rate: Option<f64>,
    /// The longest a repair waits for JetStream to forget the ids of messages deleted within its duplicate window.
    #[arg(long, default_value = "10m", value_parser = duration, requires = "repair")]
    pub repair_wait: Duration,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub settings: RunArgs,
}

impl AuditArgs {
    /// Audits, repairs if asked, prints the report, and exits 0 if nothing
    /// is missing (after the repair), else 1.
    pub async fn run(self, stop: CancellationToken) -> Result<ExitCode> {
        let selection = self
            .window
            .selection("audit", "every message the outbox holds")?;
        let config = self.settings.resolve()?;
        let options = audit::Options {
            pace: audit::Pace(self.read_rate.0),
            repair: self.repair.then_some(audit::RepairOptions {
                rate: self.rate,
                wait: self.repair_wait,
            }),
        };
        let summary = audit::run(&config, selection, &options, &stop).await?;
        if self.json {
            println!("{}", to_json(&summary)?);
        } else {
            print!("{}", render(&summary));
        }
        Ok(match summary.conclusion() {
            Conclusion::AllStored => ExitCode::SUCCESS,
            Conclusion::Missing => ExitCode::from(1),
            Conclusion::Stopped => ExitCode::from(130),
        })
    }
}

/// An audit's report for a reader.
fn render(summary: &Summary) -> String {
    let mut text = String::new();
    let since = summary.since.as_deref().unwrap_or("the first message");
    let streams: Vec<String> = summary
        .streams
        .iter()
        .map(|stream| format!("{} (replicas {})", stream.name, stream.replicas))
        .collect();
    let _ = writeln!(
        text,
        "audit of {since} to {} against {}, in {:.1} s",
        summary.until,
        streams.join(", "),
        summary.seconds
    );
    findings(&mut text, &summary.found);
    if let Some(repair) = &summary.repair {
        let repaired = &repair.repaired;
        let _ = writeln!(
            text,
            "repair: published {} again ({} after JetStream forgot their ids); not published: {} \
             still remembered, {} found stored after all, {} gone from the outbox, {} not sendable",
            repaired.published,
            repaired.after_waiting,
            repaired.still_remembered,
            repaired.found_stored,
            repaired.gone,
            repaired.unsendable.len()
        );
        for unsendable in repaired.unsendable.iter().take(20) {
            let _ = writeln!(text, "  {}: {}", unsendable.id, unsendable.reason);
        }
        match &repair.after {
            Some(after) => {
                let _ = writeln!(text, "after the repair:");
                findings(&mut text, after);
            }
            None => {
                let _ = writeln!(text, "the repair was stopped: run it again for the rest");
            }
        }
    }
    let _ = writeln!(
        text,
        "{}",
        match summary.conclusion() {
            Conclusion::AllStored => "every delivered message is in the stream",
            Conclusion::Missing => "some delivered messages are not in the stream (exit 1)",
            Conclusion::Stopped => "stopped before the repair was audited (exit 130)",
        }
    );
    text
}

fn findings(text: &mut String, found: &Findings) {
    let _ = writeln!(
        text,
        "  {:>10}  messages in the window\n  {:>10}  delivered and stored once\n  {:>10}  \
         missing: processed, in no stream\n  {:>10}  stored more than once\n  {:>10}  \
         processed, older than a stream's limits keep\n  {:>10}  pending\n  {:>10}  failed\n  {:>10}  in the stream, not in the outbox: old enough for the retention \
         to have deleted\n  {:>10}  in the stream, not in the outbox: unexplained\n  {:>10}  \
         foreign: under the relay's subjects, with no outbox id\n  {:>10}  replayed copies (not \
         judged)",
        found.messages,
        found.delivered,
        found.missing,
        found.stored_more_than_once,
        found.past_stream_limits,
        found.pending,
        found.failed,
        found.unrecorded.past_retention,
        found.unrecorded.unexplained,
        found.foreign,
        found.replayed,
    );
    if let Some(remembered) = &found.remembered {
        let _ = writeln!(
            text,
            "  {} of the missing may still be remembered by JetStream: a repeat is dropped as a \
             duplicate until {}",
            remembered.messages, remembered.until
        );
    }
    listing(text, "missing", &found.missing_listed, found.missing);
    listing(
        text,
        "stored more than once",
        &found.stored_more_than_once_listed,
        found.stored_more_than_once,
    );
}

/// Lists the first messages of a finding, and says how many more.
fn listing(text: &mut String, what: &str, listed: &[Listed], count: u64) {
    const SHOWN: usize = 20;
    if listed.is_empty() {
        return;
    }
    let _ = writeln!(text, "  {what}:");
    for message in listed.iter().take(SHOWN) {
        let copies = match message.copies {
            0 | 1 => String::new(),
            n => format!(" ×{n}"),
        };
        let _ = writeln!(
            text,
            "    {}  {}  {}{copies}",
            message.id, message.committed_at, message.subject
        );
    }
    let more = count.saturating_sub(SHOWN.min(listed.len()) as u64);
    if more > 0 {
        let _ = writeln!(text, "    and {more} more (--json lists up to 1000)");
    }
}

/// `--read-rate`: a number of messages a second, or "max".
#[derive(Debug, Clone, Copy)]
pub struct ReadRate(Option<f64>);

fn read_rate(text: &str) -> std::result::Result<ReadRate, String> {
    match text.trim() {
        "max" => Ok(ReadRate(None)),
        number => match number.parse::<f64>() {
            Ok(rate) if rate.is_finite() && rate >= 1.0 => Ok(ReadRate(Some(rate))),
            _ => Err("is a number of messages a second (at least 1), or max".to_owned()),
        },
    }
}
