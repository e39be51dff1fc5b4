//! `kvroute replay | loadgen | bench | ctl | hash` are tools, built as their own
//! binary (`kvroute-tools`, crate `crates/kvroute-tools`) so that the
//! server links no simulator, benchmark or client code. The user keeps one
//! command: `kvroute` hands a tool's command line, unchanged, to the
//! `kvroute-tools` found beside its own executable (where `cargo build`
//! and an install put both), or on `PATH`; `KVROUTE_TOOLS` names another.

use std::{
    ffi::OsString,
    path::{Path, PathBuf},
};

/// The sub-commands that `kvroute-tools` runs.
pub const TOOL_COMMANDS: &[&str] = &["replay", "loadgen", "mock-engine", "bench", "ctl", "hash"];

/// Shown under `kvroute --help`.
pub const TOOLS_HELP: &str = "\
Tools (run by kvroute-tools, installed beside kvroute):
  replay  Replay a request trace through simulated engines under several routing policies
  loadgen Replay a request trace against real engines over HTTP; the replay's table from the client
  mock-engine  A GPU-free vLLM stand-in: OpenAI API, load metrics and KV events, simulated timing
  demo    kvroute against round robin on four mock engines over real sockets, in about two minutes
  bench   Benchmarks that print figures (index, select, ingest, snapshot, cluster, soak)
  ctl     Ask a running kvroute what it knows, why it routes a prompt where it does; cordon
  hash    Print the local hash of each complete block of token ids read from stdin";

/// The binary's file name.
const TOOLS_BINARY: &str = "kvroute-tools";

/// Whether `argv` (program name first) asks for a tool.
pub fn is_tool_command(argv: &[OsString]) -> bool {
    argv.get(1)
        .and_then(|arg| arg.to_str())
        .is_some_and(|arg| TOOL_COMMANDS.contains(&arg))
}

/// Where `kvroute-tools` is: `KVROUTE_TOOLS`, else beside this executable,
/// else the first on `PATH`.
pub(crate) fn find_tools_binary() -> Option<PathBuf> {
    if let Some(named) = std::env::var_os("KVROUTE_TOOLS") {
        return Some(PathBuf::from(named));
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join(TOOLS_BINARY)))
        .filter(|path| path.is_file());
    beside.or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join(TOOLS_BINARY))
                .find(|path| path.is_file())
        })
    })
}

/// Why a tool could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error(
        "`{command}` is a tool of kvroute-tools, which is not beside this binary or on PATH \
         (build it with `cargo build -p kvroute-tools`, or name it in KVROUTE_TOOLS)"
    )]
    NotFound { command: String },
    #[error("cannot run {}: {source}", path.display())]
    Run {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Runs the tool with `argv`'s arguments (the program name dropped) and
/// returns its exit code; on Unix the tool replaces this process, so its
/// signals, standard streams and exit status are the user's.
pub fn run_tool(argv: &[OsString]) -> Result<i32, LaunchError> {
    let command = argv
        .get(1)
        .map(|arg| arg.to_string_lossy().into_owned())
        .unwrap_or_default();
    let path = find_tools_binary().ok_or(LaunchError::NotFound { command })?;
    exec(&path, argv.get(1..).unwrap_or_default())
}

#[cfg(unix)]
fn exec(path: &Path, args: &[OsString]) -> Result<i32, LaunchError> {
    use std::os::unix::process::CommandExt;
    // exec only returns on failure.
    let source = std::process::Command::new(path).args(args).exec();
    Err(LaunchError::Run {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(not(unix))]
fn exec(path: &Path, args: &[OsString]) -> Result<i32, LaunchError> {
    let status = std::process::Command::new(path)
        .args(args)
        .status()
        .map_err(|source| LaunchError::Run {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(status.code().unwrap_or(1))
}
