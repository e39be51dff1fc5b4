//! The `kvroute` command line: `serve` runs the service. The tools
//! (`replay`, `bench`, `ctl`, `hash`) are another binary, `kvroute-tools`,
//! which `tools.rs` finds and hands the command line to, so the server
//! links none of them while the user keeps one command.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{self, ServeConfig};

/// kvroute: KV-cache-aware routing for LLM inference fleets.
#[derive(Debug, Parser)]
#[command(
    name = "kvroute",
    version,
    about,
    propagate_version = true,
    after_help = crate::tools::TOOLS_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// What to run.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the routing service (gRPC + Prometheus metrics).
    Serve(Box<ServeConfig>),
}

/// Why the command line was refused.
#[derive(Debug)]
pub enum CliError {
    /// `--help` or `--version`: print and exit 0.
    Display(clap::Error),
    /// Bad arguments: one line, exit 2.
    Usage(String),
}

/// Parses `argv` (program name first), folding in `serve --config FILE`.
pub fn parse(argv: Vec<String>) -> Result<Cli, CliError> {
    let first = parse_once(&argv)?;
    let Command::Serve(serve) = &first.command;
    if serve.config.is_none() {
        return Ok(first);
    }
    let command = Cli::command();
    let matches = command
        .clone()
        .try_get_matches_from(&argv)
        .map_err(clap_error)?;
    let (Some(("serve", serve_matches)), Some(serve_command)) =
        (matches.subcommand(), command.find_subcommand("serve"))
    else {
        return Ok(first);
    };
    let argv =
        config::argv_with_config_file(serve_command, serve_matches, serve.config.as_ref(), argv)
            .map_err(|e| CliError::Usage(e.to_string()))?;
    parse_once(&argv)
}

fn parse_once(argv: &[String]) -> Result<Cli, CliError> {
    let matches = Cli::command()
        .try_get_matches_from(argv)
        .map_err(clap_error)?;
    Cli::from_arg_matches(&matches).map_err(clap_error)
}

/// One line for a refused command line, or the help or version to print.
pub fn clap_error(error: clap::Error) -> CliError {
    use clap::error::ErrorKind;
    match error.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => CliError::Display(error),
        _ => {
            // clap's first line says what is wrong; when it ends with a colon
            // (missing arguments) the next lines name them.
            let rendered = error.to_string();
            let mut lines = rendered.lines().filter(|l| !l.trim().is_empty());
            let mut line = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            while line.ends_with(':') {
                let Some(next) = lines.next().filter(|l| l.starts_with("  ")) else {
                    break;
                };
                line = format!("{line} {}", next.trim());
            }
            CliError::Usage(line)
        }
    }
}

/// Runs `work` on a multi-threaded runtime: exit 0 when it succeeds; when
/// it fails, its error on one line and exit 2 for invalid settings
/// ([`crate::app::ServeError::is_invalid_setting`]), 1 for anything else
/// (and when the runtime cannot start).
pub fn run_on_runtime(work: impl std::future::Future<Output = anyhow::Result<()>>) -> ExitCode {
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
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvroute: {}", one_line(&error));
            let settings = error
                .downcast_ref::<crate::app::ServeError>()
                .is_some_and(crate::app::ServeError::is_invalid_setting);
            if settings {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// An error and its causes on one line, each cause said once: a cause
/// whose text its error already shows is left out.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in error.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// What a refused command line ends with: help or version printed and
/// exit 0, or one `kvroute: ...` line and exit 2.
pub fn exit_for(error: CliError) -> ExitCode {
    match error {
        CliError::Display(shown) => {
            let _ = shown.print();
            ExitCode::SUCCESS
        }
        CliError::Usage(line) => {
            eprintln!("kvroute: {line}");
            ExitCode::from(2)
        }
    }
}
