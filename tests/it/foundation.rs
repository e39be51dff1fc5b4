//! The service foundation over real gRPC: health, reflection, metrics,
//! message limits and graceful shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::time::Duration;

use common::TestServer;
use kvroute::config::ServeConfig;
use tokio_stream::StreamExt;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

async fn health_status(server: &TestServer, service: &str) -> ServingStatus {
    let response = server
        .health()
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health check");
    response.into_inner().status()
}

#[tokio::test]
async fn health_reports_serving_overall_and_per_service() {
    let server = TestServer::start().await;
    assert_eq!(health_status(&server, "").await, ServingStatus::Serving);
    for name in kvroute::app::SERVICE_NAMES {
        assert_eq!(
            health_status(&server, name).await,
            ServingStatus::Serving,
            "{name}"
        );
    }
    let unknown = server
        .health()
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    server.stop().await.expect("clean stop");
}

#[tokio::test]
async fn reflection_lists_the_three_kvroute_services() {
    let server = TestServer::start().await;
    let mut client = ServerReflectionClient::new(server.channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = client
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection stream")
        .into_inner();
    let reply = replies.next().await.expect("one reply").expect("ok reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("expected a service list, got {:?}", reply.message_response);
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for wanted in [
        "kvroute.v1.Router",
        "kvroute.v1.Workers",
        "kvroute.v1.Admin",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.iter().any(|n| n == wanted),
            "{wanted} missing from {names:?}"
        );
    }
}

#[tokio::test]
async fn metrics_endpoint_counts_rpcs_by_method_and_code() {
    let server = TestServer::start().await;
    // TestServer::start waited for SERVING with health checks of its own.
    let ok = r#"kvroute_rpc_requests_total{code="OK",method="/grpc.health.v1.Health/Check"}"#;
    let count = |body: &str| -> u64 {
        body.lines()
            .find_map(|l| l.strip_prefix(ok)?.trim().parse().ok())
            .unwrap_or(0)
    };
    let (_, before) = server.http_get("/metrics").await;
    health_status(&server, "").await;
    let _ = server
        .health()
        .check(HealthCheckRequest {
            service: "missing".into(),
        })
        .await;
    let (status, body) = server.http_get("/metrics").await;
    assert_eq!(status, 200);
    assert_eq!(count(&body), count(&before) + 1, "{body}");
    assert!(
        body.contains(r#"kvroute_rpc_requests_total{code="NOT_FOUND",method="/grpc.health.v1.Health/Check"} 1"#),
        "{body}"
    );
    assert!(body.contains("kvroute_rpc_duration_seconds_bucket"));
    let (missing, _) = server.http_get("/nope").await;
    assert_eq!(missing, 404);
}

#[tokio::test]
async fn oversized_message_is_refused_with_a_clear_status() {
    let config = ServeConfig {
        max_message_bytes: 4096,
        ..ServeConfig::for_tests()
    };
    let server = TestServer::start_with(config).await;
    let request = kvroute::pb::MarkPrefillCompleteRequest {
        cached_tokens: None,
        request_id: "x".repeat(10_000),
    };
    let error = server
        .router()
        .mark_prefill_complete(request)
        .await
        .expect_err("too large");
    assert_eq!(error.code(), tonic::Code::OutOfRange, "{error:?}");
    assert!(error.message().contains("too large"), "{}", error.message());
    // The server is unharmed.
    assert_eq!(health_status(&server, "").await, ServingStatus::Serving);
}

#[tokio::test]
async fn health_goes_not_serving_while_draining() {
    let config = ServeConfig {
        drain_delay: Duration::from_millis(500),
        ..ServeConfig::for_tests()
    };
    let mut server = TestServer::start_with(config).await;
    assert_eq!(health_status(&server, "").await, ServingStatus::Serving);
    server.begin_shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(health_status(&server, "").await, ServingStatus::NotServing);
    assert_eq!(
        health_status(&server, "kvroute.v1.Router").await,
        ServingStatus::NotServing
    );
    server.stop().await.expect("clean stop");
}
