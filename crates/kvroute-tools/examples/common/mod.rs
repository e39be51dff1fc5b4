//! What the op-log examples share: their `FILE [REPS]` arguments.
use kvroute_tools::oplog::OpLog;
use std::path::PathBuf;
use std::process::ExitCode;

/// The op log named by the first argument and the replay count given by
/// the second (`default_reps` if absent); on a missing or unreadable file,
/// the message is printed and the exit code to return.
pub fn log_and_reps(example: &str, default_reps: usize) -> Result<(OpLog, usize), ExitCode> {
    let Some(path) = std::env::args().nth(1).map(PathBuf::from) else {
        eprintln!("usage: {example} FILE [REPS]");
        return Err(ExitCode::from(2));
    };
    let reps = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_reps);
    match OpLog::load(&path) {
        Ok(log) => Ok((log, reps)),
        Err(e) => {
            eprintln!("{}: {e}", path.display());
            Err(ExitCode::FAILURE)
        }
    }
}
