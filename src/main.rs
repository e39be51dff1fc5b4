//! The `kvroute` binary: parse the command line, set up logging, run.

use std::process::ExitCode;

use kvroute::{
    app,
    cli::{self, CliError, Command},
    telemetry,
};

fn main() -> ExitCode {
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
        match cli.command {
            Command::Serve(config) => {
                telemetry::init(config.log_format, &config.log_level);
                let (grpc, metrics) = app::bind(&config).await?;
                app::run(*config, grpc, metrics, shutdown_signal()).await?;
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
