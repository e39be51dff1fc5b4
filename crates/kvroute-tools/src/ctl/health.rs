//! `kvroute ctl health`: the gRPC health service, which answers every caller
//! (no Admin role needed); the exit status is the answer, so a Kubernetes
//! probe over TLS can run it.

use serde_json::json;
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use kvroute::security::client::Bearer;

use super::{error::CtlError, output::Output};

/// Asks for `service` (empty: the server): SERVING is success, anything
/// else an error.
pub(super) async fn check(
    channel: Channel,
    bearer: Bearer,
    service: &str,
    output: Output<'_>,
) -> Result<(), CtlError> {
    let reply = HealthClient::with_interceptor(channel, bearer)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner();
    let status = ServingStatus::try_from(reply.status).unwrap_or(ServingStatus::Unknown);
    output.print(
        || json!({ "service": service, "status": status.as_str_name() }),
        || format!("{}\n", status.as_str_name()),
    )?;
    if status == ServingStatus::Serving {
        Ok(())
    } else {
        Err(CtlError::NotServing(status.as_str_name().to_owned()))
    }
}
