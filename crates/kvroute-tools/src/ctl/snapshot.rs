//! `kvroute ctl snapshot`: write the router's state to its `--state-dir`
//! now (before a planned restart, say) and say what was written.

use serde_json::json;

use kvroute::pb;

use super::{client::Admin, error::CtlError, format::bytes_text, output::Output};

/// Asks for a snapshot and shows where it went, its size and its timings.
pub(super) async fn write(admin: &mut Admin, output: Output<'_>) -> Result<(), CtlError> {
    let written = admin.snapshot(pb::SnapshotRequest {}).await?.into_inner();
    output.print(
        || {
            json!({
                "path": written.path,
                "bytes": written.bytes,
                "entries": written.entries,
                "workers": written.workers,
                "capture_seconds": written.capture_seconds,
                "write_seconds": written.write_seconds,
            })
        },
        || {
            format!(
                "snapshot {}: {} entries of {} workers, {} (capture {:.3}s, write {:.3}s)\n",
                written.path,
                written.entries,
                written.workers,
                bytes_text(written.bytes),
                written.capture_seconds,
                written.write_seconds
            )
        },
    )
}
