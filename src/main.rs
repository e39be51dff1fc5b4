//! The `kvroute` binary: parse the command line, set up logging, serve;
//! a tool's sub-command goes to `kvroute-tools` (`tools.rs`).

use std::process::ExitCode;

use kvroute::{
    app,
    cli::{self, Command},
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

/// Returns freed pages to the OS now (mimalloc keeps them for reuse, and
/// a dropped index table's pages would stay resident).
#[allow(unsafe_code)]
fn return_freed_pages() {
    // SAFETY: `mi_collect` takes no pointer and has no precondition; it
    // only walks mimalloc's own structures, from any thread, at any time
    // (mimalloc's documentation: "Eagerly free memory").
    unsafe { libmimalloc_sys::mi_collect(true) }
}

/// How long mimalloc keeps freed memory before giving it back to the OS:
/// 10 s, not its default 1 s. Each request body, template and token list
/// of a large prompt takes a few MB for a few ms; purged every second, the
/// same pages were faulted in (and zeroed, 2 MB at a time under
/// transparent huge pages) about 90 times per 0.7 MB request, a tenth of
/// the picker's CPU. Memory is no larger than its peak either way, and
/// [`return_freed_pages`] still returns it at once where that matters.
const PURGE_DELAY_MS: std::os::raw::c_long = 10_000;
/// `mi_option_purge_delay` in mimalloc.h (the bindings do not name it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[allow(unsafe_code)]
fn keep_freed_pages_longer() {
    // SAFETY: `mi_option_set` takes plain values and may be called at any
    // time (mimalloc's documentation: runtime options).
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) }
}

fn main() -> ExitCode {
    keep_freed_pages_longer();
    kvroute::metrics::count_heap_with(|| GLOBAL.allocated() as u64);
    kvroute::metrics::return_freed_memory_with(return_freed_pages);
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if tools::is_tool_command(&argv) {
        return match tools::run_tool(&argv) {
            Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            Err(error) => {
                eprintln!("kvroute: {error}");
                ExitCode::from(2)
            }
        };
    }
    let cli = match cli::parse(std::env::args().collect()) {
        Ok(cli) => cli,
        Err(error) => return cli::exit_for(error),
    };
    let Command::Serve(config) = cli.command;
    cli::run_on_runtime(async move {
        telemetry::init(config.log_format, &config.log_level);
        let (grpc, metrics) = app::bind(&config).await?;
        app::run(*config, grpc, metrics, shutdown_signal()).await?;
        Ok(())
    })
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
