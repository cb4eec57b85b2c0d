//! The `outbox-relay` command: a thin layer over the library.

mod cli;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use outbox_relay::admin::status::Status;
use outbox_relay::{Relay, Result};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

use cli::{open_database, to_json, Cli, Command, LogFormat};

/// Every message costs the relay a few dozen small allocations (its
/// document, subject, headers, futures); the system allocator took a
/// quarter of the relay's CPU in a drain's profile. mimalloc's v2 line
/// gives freed pages back within about 100 ms; v3 keeps them a second or
/// more, and a drain of 100 KB messages then held twice its budget's worth.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    // One thread: the relay waits on the network, and its stages hand each
    // message from task to task. On a multi-threaded runtime every hand-off
    // may wake another worker (a futex and a context switch), which doubled
    // the relay's CPU per message in the benchmark and delayed deliveries on
    // a busy machine; one thread does all the work at a fraction of a core.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli.command)) {
        Ok(code) => code,
        Err(error) => {
            tracing::error!("{error}");
            ExitCode::from(error.exit_code())
        }
    }
}

async fn execute(command: Command) -> Result<ExitCode> {
    match command {
        Command::Run(args) => {
            let config = args.resolve()?;
            // However MongoDB answers, the process ends this long after
            // the first signal: the stop's own bounds, and room to end.
            let limit = config.shutdown_timeout
                + outbox_relay::relay::RELEASE_TIMEOUT
                + Duration::from_secs(2);
            let relay = Relay::connect(config).await?;
            relay.run(stop_on_signal(Some(limit))).await?;
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "bench")]
        Command::Bench(args) => {
            args.run().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check(args) => {
            let config = args.resolve()?;
            let report = outbox_relay::check::run(&config).await;
            println!("{}", report.render());
            Ok(report
                .failure()
                .map_or(ExitCode::SUCCESS, |e| ExitCode::from(e.exit_code())))
        }
        Command::Status(args) => {
            let config = args.settings.resolve()?;
            let database = open_database(&config).await?;
            let status = Status::read(&database, &config).await?;
            if args.json {
                println!("{}", to_json(&status)?);
            } else {
                println!("{}", status.render());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq(command) => {
            command.run().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Replay(args) => args.run(stop_on_signal(None)).await,
        Command::Audit(args) => args.run(stop_on_signal(None)).await,
        Command::Inbox(command) => {
            command.run().await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Sweep(args) => {
            let relay = Relay::connect_for_sweep_once(args.settings.resolve()?).await?;
            let tally = relay.sweep_once(args.give_up_after).await?;
            println!(
                "delivered {}, retried {}, failed {}, parked {}",
                tally.delivered, tally.retried, tally.failed, tally.parked
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A token cancelled by the first SIGINT or SIGTERM; a second one exits at
/// once, and so does the stop outlasting `limit`.
fn stop_on_signal(limit: Option<Duration>) -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stopping: finishing in-flight messages (signal again to exit at once)");
        fire.cancel();
        if let Some(limit) = limit {
            // A thread of its own, so that nothing blocking the runtime
            // (a name lookup while DNS is down, say) holds it up.
            std::thread::spawn(move || {
                std::thread::sleep(limit);
                tracing::error!(
                    ?limit,
                    "the stop did not end in time (MongoDB not answering?): exiting; what was \
                     not marked is delivered again by the next leader, and the lease ends when \
                     it expires"
                );
                std::process::exit(1);
            });
        }
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
