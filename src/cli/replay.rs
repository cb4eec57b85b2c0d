//! `outbox-relay replay`: its flags, its progress on a terminal, and its
//! summary.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use clap::Args;
use outbox_relay::replay::{self, Report, Request, State, Summary};
use outbox_relay::Result;
use tokio_util::sync::CancellationToken;

use super::{to_json, RunArgs, WindowArgs};

/// `outbox-relay replay`.
#[derive(Debug, Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    pub window: WindowArgs,
    /// Failed messages too, not only delivered ones.
    #[arg(long)]
    pub include_failed: bool,
    /// Send to NEW.<subject> instead of the messages' own subjects (--subject-prefix is the relay's).
    #[arg(long, value_name = "NEW")]
    pub replay_prefix: Option<String>,
    /// Most messages a second, so the replay never starves live delivery.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Count what would be sent, by type, and send nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Go on with a replay that stopped, by the id it printed (its selection is recorded).
    #[arg(long, conflicts_with_all = ["since", "until", "types", "subjects", "keys", "all", "include_failed", "replay_prefix"])]
    pub resume: Option<String>,
    /// The collection replay records are kept in.
    #[arg(long, default_value = replay::DEFAULT_COLLECTION)]
    pub replays_collection: String,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub settings: RunArgs,
}

impl ReplayArgs {
    /// The checked request and its options.
    pub fn resolve(&self) -> Result<(Request, replay::Options)> {
        let options = replay::Options {
            records_collection: self.replays_collection.clone(),
            rate: self.rate,
            dry_run: self.dry_run,
        };
        if let Some(id) = &self.resume {
            return Ok((Request::Resume(id.trim().to_owned()), options));
        }
        let mut selection = self.window.selection("replay", "every delivered message")?;
        selection.include_failed = self.include_failed;
        let request = Request::New {
            selection,
            replay_prefix: self.replay_prefix.as_ref().map(|p| p.trim().to_owned()),
        };
        Ok((request, options))
    }

    /// Runs the replay until it ends or `stop` is cancelled, and prints
    /// what it sent; a stopped replay exits 130 and says how to resume it.
    pub async fn run(self, stop: CancellationToken) -> Result<ExitCode> {
        let (request, options) = self.resolve()?;
        let config = self.settings.resolve()?;
        let shown = Shown::new(self.json);
        let show = |report: &Report| shown.show(report);
        let summary = replay::run(&config, request, &options, stop, &show).await;
        shown.finish();
        let summary = summary?;
        if self.json {
            println!("{}", to_json(&summary)?);
        } else {
            print!("{}", render(&summary));
        }
        Ok(match summary.state {
            State::Stopped => ExitCode::from(130),
            _ => ExitCode::SUCCESS,
        })
    }
}

/// A replay's summary for a reader.
fn render(summary: &Summary) -> String {
    use std::fmt::Write;
    let mut text = String::new();
    let id = summary.replay_id.as_deref().unwrap_or("-");
    let verb = if summary.dry_run {
        "would send"
    } else {
        "sent"
    };
    let _ = writeln!(
        text,
        "replay {id}: {verb} {}, skipped {}, in {:.1} s",
        summary.sent, summary.skipped, summary.seconds
    );
    for counted in &summary.by_type {
        let _ = writeln!(text, "  {:>10}  {}", counted.sent, counted.message_type);
    }
    match summary.state {
        State::Stopped => {
            let _ = writeln!(
                text,
                "stopped before the end: resume with outbox-relay replay --resume {id}"
            );
        }
        _ if summary.dry_run => {
            let _ = writeln!(text, "dry run: nothing was sent");
        }
        _ => {}
    }
    text
}

/// Shows a replay's progress: a bar on a terminal, else a log line every
/// few seconds.
pub struct Shown {
    bar: Option<indicatif::ProgressBar>,
    logged: Mutex<Duration>,
}

/// Time between two log lines where there is no terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

impl Shown {
    pub fn new(quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "replay [{bar:40}] {pos}/{len} read, {msg} ({per_sec}, {eta} left)",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            bar
        });
        Shown {
            bar,
            logged: Mutex::new(Duration::ZERO),
        }
    }

    pub fn show(&self, report: &Report) {
        match &self.bar {
            Some(bar) => {
                bar.set_length(report.total.unwrap_or(report.scanned).max(report.scanned));
                bar.set_position(report.scanned);
                bar.set_message(format!("{} sent, {} skipped", report.sent, report.skipped));
            }
            None => {
                let Ok(mut logged) = self.logged.lock() else {
                    return;
                };
                if report.elapsed < *logged + LOG_EVERY {
                    return;
                }
                *logged = report.elapsed;
                let rate = report.scanned as f64 / report.elapsed.as_secs_f64().max(0.001);
                tracing::info!(
                    read = report.scanned,
                    of = report.total,
                    sent = report.sent,
                    skipped = report.skipped,
                    per_second = rate.round(),
                    "replaying"
                );
            }
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
