//! `kvroute ctl cordon ID` and `uncordon ID`: keep new requests away from a
//! worker, or let them back; both answer with the worker as it now is.

use kvroute::pb;

use super::{
    client::Admin, error::CtlError, output::Output, worker::worker_json, workers::workers_table,
};

/// Cordons worker `id`.
pub(super) async fn cordon(admin: &mut Admin, id: u64, output: Output<'_>) -> Result<(), CtlError> {
    let info = admin
        .cordon_worker(pb::CordonWorkerRequest { worker_id: id })
        .await?
        .into_inner();
    print(output, &info)
}

/// Uncordons worker `id`.
pub(super) async fn uncordon(
    admin: &mut Admin,
    id: u64,
    output: Output<'_>,
) -> Result<(), CtlError> {
    let info = admin
        .uncordon_worker(pb::UncordonWorkerRequest { worker_id: id })
        .await?
        .into_inner();
    print(output, &info)
}

/// The new state in a line, then the worker's row.
fn print(output: Output<'_>, info: &pb::WorkerInfo) -> Result<(), CtlError> {
    output.print(
        || worker_json(info),
        || {
            let state = if info.cordoned {
                "cordoned"
            } else {
                "uncordoned"
            };
            format!(
                "worker {} {state}\n{}",
                info.worker_id,
                workers_table(std::slice::from_ref(info))
            )
        },
    )
}
