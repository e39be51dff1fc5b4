//! The `kvroute` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use kvroute::{
    app, bench,
    cli::{self, BenchCommand, CliError, Command},
    telemetry, tools,
};

/// mimalloc instead of glibc's malloc: routing allocates many small,
/// short-lived buffers per call on every core, where glibc's arena locking
/// and consolidation showed up as latency spikes in `kvroute bench select`.
/// `cap` counts what is allocated and not yet freed (no limit is set), for
/// the `kvroute_heap_allocated_bytes` gauge: resident memory alone cannot
/// tell a leak from pages the allocator keeps for reuse.
#[global_allocator]
static GLOBAL: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

fn main() -> ExitCode {
    kvroute::metrics::count_heap_with(|| GLOBAL.allocated() as u64);
    let cli = match cli::parse(std::env::args().collect()) {
        Ok(cli) => cli,
        Err(CliError::Display(shown)) => {
            let _ = shown.print();
            return ExitCode::SUCCESS;
        }
        Err(CliError::Usage(line)) => {
            eprintln!("kvroute: {line}");
            return ExitCode::from(2);
        }
    };
    let command = match cli.command {
        Command::Hash(args) => {
            let stdin = std::io::stdin();
            let stdout = std::io::stdout();
            return report(tools::hash(
                args.block_size,
                args.lora.as_deref(),
                args.namespace.as_deref(),
                &mut stdin.lock(),
                &mut stdout.lock(),
            ));
        }
        Command::Replay(args) => {
            return report(kvroute::sim::cli::run(&args).map(|_| ()));
        }
        Command::Bench(BenchCommand::Index {
            oplog,
            implementation,
        }) => {
            return report(
                kvroute::oplog::bench_index(&oplog, &implementation)
                    .map(|report| println!("{}", report.to_json())),
            );
        }
        Command::Ctl(args) => return report(kvroute::ctl::run(args)),
        other => other,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kvroute: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result: anyhow::Result<()> = runtime.block_on(async move {
        match command {
            Command::Serve(config) => {
                telemetry::init(config.log_format, &config.log_level);
                let (grpc, metrics) = app::bind(&config).await?;
                app::run(*config, grpc, metrics, shutdown_signal()).await?;
            }
            Command::Bench(BenchCommand::Select(args)) => {
                bench::select::run(&args).await?;
            }
            Command::Bench(BenchCommand::Ingest(args)) => {
                bench::ingest::run(&args).await?;
            }
            Command::Bench(BenchCommand::Snapshot(args)) => {
                bench::snapshot::run(&args).await?;
            }
            Command::Bench(BenchCommand::Cluster(args)) => {
                bench::cluster::run(&args).await?;
            }
            Command::Bench(BenchCommand::Soak(args)) => {
                let report = bench::soak::run(&args).await?;
                if !report.verdict.pass {
                    anyhow::bail!("bench soak: the verdict failed (see its last lines)");
                }
            }
            _ => {}
        }
        Ok(())
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints a tool's error as one line; exit 1 on failure.
fn report<E: std::fmt::Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C). The handlers are installed
/// here, when it is called (inside the runtime, before the server says it
/// is serving), not when the future is first polled: a SIGTERM sent right
/// after "kvroute serving" must drain, not kill with the default action.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let term = signal(SignalKind::terminate());
        let interrupt = signal(SignalKind::interrupt());
        async move {
            match (term, interrupt) {
                (Ok(mut term), Ok(mut interrupt)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = interrupt.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
