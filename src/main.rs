//! The `outbox-relay` command: a thin layer over the library.

mod cli;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use outbox_relay::Relay;
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use cli::{Cli, Command, LogFormat};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!("{error}");
            ExitCode::FAILURE
        }
    }
}

async fn execute(command: Command) -> outbox_relay::Result<()> {
    match command {
        Command::Run(args) => {
            let config = args.resolve()?;
            let relay = Relay::connect(config).await?;
            relay.run(stop_on_signal()).await
        }
        Command::Bench(args) => {
            let server = outbox_relay::bench::describe_server(&args.mongodb_uri).await;
            let config = args.resolve(server)?;
            let report = outbox_relay::bench::run(&config).await?;
            outbox_relay::bench::print_table(&report);
            let json = config.output.join("bench.json");
            outbox_relay::bench::write_json(&report, &json)?;
            let plotted = config
                .rates
                .iter()
                .copied()
                .find(|r| *r == Some(1000))
                .or(config.rates.first().copied());
            let plot = config.output.join("latency-cdf.svg");
            outbox_relay::bench::write_plot(&report, plotted.flatten(), &plot)?;
            println!("results: {} and {}", json.display(), plot.display());
            Ok(())
        }
        Command::Sweep(args) => {
            let relay = Relay::connect(args.settings.resolve()?).await?;
            let tally = relay.sweep_once().await?;
            println!(
                "delivered {}, retried {}, failed {}",
                tally.delivered, tally.retried, tally.failed
            );
            Ok(())
        }
    }
}

/// A token cancelled by the first SIGINT or SIGTERM; a second one exits at once.
fn stop_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stopping: finishing in-flight messages (signal again to exit at once)");
        fire.cancel();
        wait_for_signal().await;
        tracing::warn!("second signal: exiting at once; unfinished messages stay pending");
        std::process::exit(130);
    });
    token
}

#[cfg(unix)]
async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut terminate) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = terminate.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() {
    let _ = tokio::signal::ctrl_c().await;
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,outbox_relay=info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
