//! `kvroute ctl`: the operator's client of a running kvroute's Admin service.
//!
//! Operators need to see what the router knows (workers, index statistics),
//! ask why a prompt would go where it goes, and cordon a worker, without
//! writing gRPC calls by hand. Output is an aligned table by default and JSON
//! with `--json` for scripts. Any failure (a gRPC status, no connection, bad
//! input) is one line on stderr and a non-zero exit, printed by `main`.
//!
//! This file connects and hands each sub-command to its module (`workers`,
//! `worker`, `stats`, `explain`, `cordon`, `snapshot`, `health`); those
//! make the call and give their reply as a table and as JSON (`output`),
//! spelled the same way everywhere (`format`, `table`).

mod args;
mod client;
mod cordon;
mod error;
mod explain;
mod format;
mod health;
mod output;
mod snapshot;
mod stats;
mod table;
mod worker;
mod workers;

use std::io::Write;

pub use args::{CtlArgs, CtlCommand, DEFAULT_ADDR, ExplainArgs, Phase};
pub use client::normalize_addr;
pub use error::CtlError;

use kvroute::pb::admin_client::AdminClient;

use output::Output;

/// Runs `kvroute ctl` on a runtime of its own, printing to stdout.
pub fn run(args: CtlArgs) -> Result<(), CtlError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(CtlError::Runtime)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    runtime.block_on(execute(args, &mut out))?;
    out.flush()?;
    Ok(())
}

/// Connects, makes the call and writes its output.
pub(crate) async fn execute(args: CtlArgs, out: &mut dyn Write) -> Result<(), CtlError> {
    // Read the prompt before connecting: a bad file is not a network problem.
    let prompt = match &args.command {
        CtlCommand::Explain(explain) => Some(explain::request(explain)?),
        _ => None,
    };
    let (channel, bearer) = client::connect(&args.addr, &args.credentials).await?;
    let output = Output::new(out, args.json);
    if let CtlCommand::Health { service } = &args.command {
        // Not an Admin call: the health service answers every caller.
        return health::check(channel, bearer, service, output).await;
    }
    let admin = &mut AdminClient::with_interceptor(channel, bearer);
    match (args.command, prompt) {
        (CtlCommand::Workers { model }, _) => workers::list(admin, model, output).await,
        (CtlCommand::Worker { id }, _) => worker::show(admin, id, output).await,
        (CtlCommand::Stats { model }, _) => stats::show(admin, model, output).await,
        (CtlCommand::Explain(_), Some(request)) => explain::show(admin, request, output).await,
        (CtlCommand::Cordon { id }, _) => cordon::cordon(admin, id, output).await,
        (CtlCommand::Uncordon { id }, _) => cordon::uncordon(admin, id, output).await,
        (CtlCommand::Snapshot, _) => snapshot::write(admin, output).await,
        // Answered above: the prompt is read for every explain, and health
        // returned.
        (CtlCommand::Explain(_), None) | (CtlCommand::Health { .. }, _) => Ok(()),
    }
}
