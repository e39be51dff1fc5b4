//! The `kvroute-tools` binary: `kvroute replay | bench | ctl | hash`, which
//! the server's `kvroute` hands here. Errors print as one line; exit 1 on
//! failure, 2 for a refused command line.

use std::process::ExitCode;

use kvroute_tools::{
    bench,
    cli::{self, BenchCommand, Command},
    hash_tool,
};

/// The server's allocator, counted the same way: `bench soak` runs a
/// server in this process and judges its memory by the live heap.
#[global_allocator]
static GLOBAL: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

fn main() -> ExitCode {
    kvroute::metrics::count_heap_with(|| GLOBAL.allocated() as u64);
    let cli = match cli::parse(std::env::args().collect()) {
        Ok(cli) => cli,
        Err(error) => return kvroute::cli::exit_for(error),
    };
    match cli.command {
        Command::Hash(args) => {
            let stdin = std::io::stdin();
            let stdout = std::io::stdout();
            report(hash_tool::hash(
                args.block_size,
                args.lora.as_deref(),
                args.namespace.as_deref(),
                &mut stdin.lock(),
                &mut stdout.lock(),
            ))
        }
        Command::Replay(args) => report(kvroute_tools::sim::cli::run(&args).map(|_| ())),
        Command::Bench(BenchCommand::Index {
            oplog,
            implementation,
        }) => report(
            kvroute_tools::oplog::bench_index(&oplog, &implementation)
                .map(|report| println!("{}", report.to_json())),
        ),
        Command::Ctl(args) => report(kvroute_tools::ctl::run(args)),
        Command::Demo(args) => {
            kvroute::cli::run_on_runtime(async move { kvroute_tools::demo::run(&args).await })
        }
        Command::MockEngine(args) => {
            kvroute::cli::run_on_runtime(
                async move { kvroute_tools::mock_engine::run(&args).await },
            )
        }
        Command::Loadgen(args) => kvroute::cli::run_on_runtime(async move {
            kvroute_tools::loadgen::run(&args).await?;
            Ok(())
        }),
        Command::Bench(bench) => run_async(bench),
    }
}

/// The benchmarks that run a server and its clients on a runtime.
fn run_async(command: BenchCommand) -> ExitCode {
    kvroute::cli::run_on_runtime(async move {
        match command {
            BenchCommand::Select(args) => {
                bench::select::run(&args).await?;
            }
            BenchCommand::Ingest(args) => {
                bench::ingest::run(&args).await?;
            }
            BenchCommand::Snapshot(args) => {
                bench::snapshot::run(&args).await?;
            }
            BenchCommand::Cluster(args) => {
                bench::cluster::run(&args).await?;
            }
            BenchCommand::Decisions(args) => {
                bench::decisions::run(&args).await?;
            }
            BenchCommand::Soak(args) => {
                let report = bench::soak::run(&args).await?;
                if !report.verdict.pass {
                    anyhow::bail!("bench soak: the verdict failed (see its last lines)");
                }
            }
            BenchCommand::Index { .. } => {}
        }
        Ok(())
    })
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
