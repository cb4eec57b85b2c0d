//! Showing results: a progress bar while running, then a table, a JSON
//! file, and a latency CDF plot (SVG).

use std::io::IsTerminal;
use std::path::Path;

use plotters::prelude::*;

use super::{rate_label, Report, RunResult};
use crate::error::{Error, Result};

/// A progress bar on a terminal; nothing otherwise.
pub(crate) fn progress(total: usize, label: &str) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:>28} [{bar:40}] {pos}/{len} {per_sec}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_owned());
    bar
}

/// Prints the results as a table.
pub fn print_table(report: &Report) {
    print_runs(report);
    print_groups(report);
}

/// One relay against groups of relays on the same load.
fn print_groups(report: &Report) {
    if report.groups.is_empty() {
        return;
    }
    println!(
        "{:<24} {:>8} {:>9} {:>9} {:>9} {:>12} {:>9} {:>13} {:>10} {:>8}",
        "group",
        "offered",
        "p50 ms",
        "p99 ms",
        "max ms",
        "burst msg/s",
        "insert s",
        "streams msg/s",
        "cpu µs/msg",
        "rss MiB"
    );
    for group in &report.groups {
        println!(
            "{:<24} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>12.0} {:>9.2} {:>13.0} {:>10.1} {:>8.1}",
            format!("{} relays, {} partitions", group.relays, group.partitions),
            rate_label(group.offered_rate),
            group.p50_ms,
            group.p99_ms,
            group.max_ms,
            group.burst_rate,
            group.insert_seconds,
            group.streams_rate,
            group.cpu_us_per_message,
            group.peak_rss_mib,
        );
    }
}

/// Each mode at each rate, the drains and the inbox.
fn print_runs(report: &Report) {
    println!(
        "{:<25} {:>7} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>10} {:>8}",
        "mode",
        "offered",
        "received",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "achieved",
        "cpu s",
        "cpu µs/msg",
        "rss MiB"
    );
    for run in &report.runs {
        let usage = run.relay.unwrap_or_default();
        let shown = |value: f64| {
            if run.relay.is_some() {
                format!("{value:.2}")
            } else {
                "-".into()
            }
        };
        println!(
            "{:<25} {:>7} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.0} {:>8} {:>10} {:>8}",
            run.mode,
            rate_label(run.offered_rate),
            format!("{}/{}", run.received, run.messages),
            run.p50_ms,
            run.p90_ms,
            run.p99_ms,
            run.p999_ms,
            run.max_ms,
            run.achieved_rate,
            shown(usage.cpu_seconds),
            shown(run.cpu_us_per_message()),
            shown(usage.peak_rss_mib),
        );
    }
    print_over_floor(report);
    for run in &report.runs {
        if let Some(view) = &run.relay_view {
            println!(
                "{} at {}/s, as the relay measured it: commit to acknowledgement {:.2} ms mean, \
                 of which publish to acknowledgement {:.2} ms",
                run.mode,
                rate_label(run.offered_rate),
                view.commit_to_ack_mean_ms,
                view.publish_ack_mean_ms,
            );
        }
    }
    for drain in &report.drains {
        let padded = match drain.payload_bytes {
            0 => String::new(),
            bytes => format!(" of {bytes}-byte payloads"),
        };
        println!(
            "backlog of {} messages{padded}: the server updates them at {:.0}/s in one update, \
             at {:.0}/s named 500 an update ({:.0}/s without the sweep index), and reads and \
             marks them 500 at a time at {:.0}/s",
            drain.messages,
            drain.bulk_update_rate,
            drain.batched_update_rate,
            drain.bare_batched_update_rate,
            drain.read_and_mark_rate,
        );
        for (how, run) in [
            ("on a first start (catch-up pass)", &drain.first),
            ("resumed from a stored position", &drain.resumed),
            ("resumed, the change stream replaying it", &drain.replayed),
        ] {
            let first_mark = run
                .first_mark_seconds
                .map(|at| format!(", first mark after {at:.2} s"))
                .unwrap_or_default();
            println!(
                "  drained {how}: {:.2} s = {:.0}/s{first_mark}, {:.0}% of the server's rate named \
                 500 an update ({:.0}% without the sweep index, {:.0}% of reading and marking); \
                 relay cpu {:.2} s ({:.1} µs a message), peak rss {:.1} MiB",
                run.seconds,
                run.rate,
                run.share_of_batched * 100.0,
                run.share_of_bare_batched * 100.0,
                run.share_of_read_and_mark * 100.0,
                run.relay.cpu_seconds,
                run.cpu_us_per_message,
                run.relay.peak_rss_mib,
            );
        }
    }
    for keyed in &report.keyed_drains {
        println!(
            "backlog drain, {}: {} messages in {:.2} s = {:.0}/s ({:.0}% of the drain without \
             keys); relay cpu {:.2} s, peak rss {:.1} MiB",
            keyed.keys,
            keyed.messages,
            keyed.seconds,
            keyed.rate,
            keyed.share_of_unkeyed * 100.0,
            keyed.relay.cpu_seconds,
            keyed.relay.peak_rss_mib,
        );
    }
    if let Some(idle) = &report.idle {
        for (role, cost) in [("leader", &idle.leader), ("standby", &idle.standby)] {
            println!(
                "quiet {role}, {:.0} s: {:.3}% of a core, {:.2} MongoDB operations/s \
                 (getMore left out: {:.2}/s)",
                idle.seconds, cost.cpu_percent, cost.operations, cost.get_mores,
            );
        }
    }
    if let Some(audit) = &report.audit {
        println!(
            "audit of {} delivered messages: {:.1} s, {:.0}/s, peak memory {} MiB; the stream's \
             headers alone read in {:.1} s; at its default pace {:.1} s, and a relay drains {:.0}/s \
             and {:.0}/s alone (before, after), {:.0}/s beside it",
            audit.messages,
            audit.seconds,
            audit.rate,
            audit
                .peak_memory_mib
                .map_or("?".to_owned(), |mib| format!("{mib:.0}")),
            audit.stream_floor_seconds,
            audit.paced_seconds,
            audit.drain_alone_rates[0],
            audit.drain_alone_rates[1],
            audit.drain_beside_audit_rate,
        );
    }
    if let Some(inbox) = &report.inbox {
        println!(
            "inbox, {} messages at {} at once: {:.0}/s handled with the inbox, {:.0}/s in a \
             transaction without the record, {:.0}/s as plain updates ({:.0}% of that)",
            inbox.messages,
            inbox.concurrency,
            inbox.inbox_rate,
            inbox.transaction_rate,
            inbox.plain_rate,
            inbox.share_of_plain * 100.0,
        );
        for e2e in &inbox.end_to_end {
            println!(
                "outbox commit to inbox commit at {}/s: {}/{} received, p50 {:.2} ms, p90 {:.2} \
                 ms, p99 {:.2} ms, max {:.2} ms; relay cpu {:.2} s",
                e2e.offered_rate,
                e2e.received,
                e2e.messages,
                e2e.p50_ms,
                e2e.p90_ms,
                e2e.p99_ms,
                e2e.max_ms,
                e2e.relay.cpu_seconds,
            );
        }
    }
}

/// What the relay adds to the database's own delay in each push run, and
/// what it spends a message: the figures to compare across rates.
fn print_over_floor(report: &Report) {
    let push: Vec<_> = report
        .runs
        .iter()
        .filter_map(|run| Some((run, run.over_floor?)))
        .collect();
    if push.is_empty() {
        return;
    }
    println!(
        "\nthe relay over the change-stream floor (same inserts, same run), beside a bare \
         forward's (one NATS hop):\n{:<25} {:>7} {:>10} {:>10} {:>10} {:>10} {:>12} {:>9} {:>9}",
        "mode",
        "offered",
        "+p50 ms",
        "+p99 ms",
        "+max ms",
        "cpu µs/msg",
        "slowest",
        "hop p50",
        "hop p99"
    );
    let at = |run: &RunResult| run.max_at_s.map_or("-".into(), |s| format!("{s:.1} s in"));
    for (run, over) in push {
        println!(
            "{:<25} {:>7} {:>+10.2} {:>+10.2} {:>+10.2} {:>10.0} {:>12} {:>+9.2} {:>+9.2}",
            run.mode,
            rate_label(run.offered_rate),
            over.p50_ms,
            over.p99_ms,
            over.max_ms,
            run.cpu_us_per_message(),
            at(run),
            over.hop_p50_ms,
            over.hop_p99_ms,
        );
    }
    println!();
}

/// Writes the report as JSON.
pub fn write_json(report: &Report, path: &Path) -> Result<()> {
    let json = serde_json::to_string_pretty(report)
        .map_err(|e| Error::Internal(format!("cannot encode the report: {e}")))?;
    std::fs::write(path, json).map_err(|e| Error::io(format!("cannot write {}", path.display()), e))
}

/// Plots the latency CDF of each run at `rate` on one chart (log-scale
/// latency), as SVG.
pub fn write_plot(report: &Report, rate: Option<u32>, path: &Path) -> Result<()> {
    let runs: Vec<&RunResult> = report
        .runs
        .iter()
        .filter(|r| r.offered_rate == rate && !r.latencies.is_empty())
        .collect();
    let failed =
        |e: &dyn std::fmt::Display| Error::Bench(format!("cannot draw {}: {e}", path.display()));
    let max_ms = runs.iter().map(|r| r.max_ms).fold(1.0_f64, f64::max);
    let min_ms = runs
        .iter()
        .filter_map(|r| r.latencies.first())
        .map(|d| d.as_secs_f64() * 1e3)
        .fold(max_ms, f64::min)
        .max(0.01);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(&e))?;
    let title = format!(
        "commit-to-receipt latency, {} msg/s offered ({})",
        rate_label(rate),
        report.server
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((min_ms * 0.8..max_ms * 1.2).log_scale(), 0.0..1.0)
        .map_err(|e| failed(&e))?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .y_desc("fraction delivered")
        .draw()
        .map_err(|e| failed(&e))?;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (run, color) in runs.iter().zip(colors.iter().cycle()) {
        let n = run.latencies.len() as f64;
        let points = run
            .latencies
            .iter()
            .enumerate()
            .map(|(i, d)| (d.as_secs_f64() * 1e3, (i + 1) as f64 / n));
        let color = *color;
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| failed(&e))?
            .label(run.mode.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| failed(&e))?;
    root.present().map_err(|e| failed(&e))
}
