//! The operators' web view (#37): a read-only page of what the router
//! knows (the fleet, each model's index, event health, the last decisions
//! and, in cluster mode, this replica's place in the shared log), served
//! on the metrics listener under `/ui/` (or on `--web-addr`).
//!
//! Why here and so: operators look at pictures, not series names; the page
//! is plain HTML, CSS and JavaScript compiled into the binary (no build
//! step, no framework, no file system access), polling small JSON
//! endpoints that page through the fleet so 1,000 workers stay usable.
//!
//! Invariants:
//! * read-only: nothing here changes the router;
//! * with an auth policy loaded, every data path (`/ui/api/...`) needs a
//!   bearer token of an identity with the operator-read role (the Admin
//!   service's check); without one, 401 or 403 and nothing else; the page
//!   itself holds no data and asks the operator for a token;
//! * every request is bounded: the query at most [`MAX_QUERY_BYTES`], a
//!   page at most [`MAX_PAGE`] workers, at most [`MAX_IN_FLIGHT`] requests
//!   at once (the rest get 503), each outcome counted in
//!   `kvroute_web_requests_total`.

mod json;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use axum::{
    Router,
    extract::{Query, Request, State, rejection::QueryRejection},
    http::{HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Redirect, Response},
    routing::get,
};
use serde::Deserialize;
use serde_json::{Value, json};

use kvroute_core::types::CacheView;

use crate::{fleet::Fleet, grpc::convert, metrics::Metrics, security::Guard};

/// The query string's longest accepted length.
pub const MAX_QUERY_BYTES: usize = 1024;
/// Workers one fleet page holds at most.
pub const MAX_PAGE: usize = 200;
/// Requests of the view served at once; more get 503.
pub const MAX_IN_FLIGHT: usize = 32;
/// The pseudo method the auth policy's check sees (operator-read).
pub use crate::security::WEB_VIEW_PATH as VIEW_PATH;

const PAGE: &str = include_str!("assets/index.html");
const SCRIPT: &str = include_str!("assets/app.js");
const STYLE: &str = include_str!("assets/style.css");

/// What the view reads.
#[derive(Clone)]
pub(crate) struct WebState {
    pub fleet: Arc<Fleet>,
    pub metrics: Arc<Metrics>,
    /// The auth check, when a policy is loaded.
    pub guard: Option<Guard>,
    /// This replica's id, in cluster mode.
    pub replica: Option<String>,
    in_flight: Arc<tokio::sync::Semaphore>,
}

impl WebState {
    pub(crate) fn new(
        fleet: Arc<Fleet>,
        metrics: Arc<Metrics>,
        guard: Option<Guard>,
        replica: Option<String>,
    ) -> Self {
        Self {
            fleet,
            metrics,
            guard,
            replica,
            in_flight: Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT)),
        }
    }

    fn count(&self, outcome: &str) {
        self.metrics
            .web_requests
            .with_label_values(&[outcome])
            .inc();
    }
}

/// The view's routes, to serve alone or beside `/metrics`.
pub(crate) fn routes(state: WebState) -> Router {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| asset(PAGE, "text/html; charset=utf-8")))
        .route(
            "/ui/app.js",
            get(|| asset(SCRIPT, "text/javascript; charset=utf-8")),
        )
        .route(
            "/ui/style.css",
            get(|| asset(STYLE, "text/css; charset=utf-8")),
        )
        .route("/ui/api/fleet", get(fleet))
        .route("/ui/api/index", get(index))
        .route("/ui/api/decisions", get(decisions))
        .route("/ui/api/cluster", get(cluster))
        .route("/ui/{*rest}", get(not_found))
        .layer(middleware::from_fn_with_state(state.clone(), screen))
        .with_state(state)
}

async fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(kind)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static("default-src 'self'"),
            ),
        ],
        body,
    )
        .into_response()
}

fn refused(status: StatusCode, message: &str) -> Response {
    (status, axum::Json(json!({ "error": message }))).into_response()
}

async fn not_found() -> Response {
    refused(StatusCode::NOT_FOUND, "no such page")
}

/// Bounds, then authentication, then the handler; each outcome counted.
async fn screen(State(state): State<WebState>, request: Request, next: Next) -> Response {
    let query = request.uri().query().map_or(0, str::len);
    if query > MAX_QUERY_BYTES || request.uri().path().len() > MAX_QUERY_BYTES {
        state.count("too_long");
        return refused(StatusCode::URI_TOO_LONG, "the address is too long");
    }
    // The page, its script and style hold no state of the router; the
    // data behind them does. (A browser cannot send a bearer token on a
    // navigation: the page asks for one when the data answers 401.)
    let data = request.uri().path().starts_with("/ui/api/");
    if data
        && let Some(guard) = &state.guard
        && let Err(status) = guard.authorize(VIEW_PATH, request.headers(), request.extensions())
    {
        let (code, outcome) = if status.code() == tonic::Code::PermissionDenied {
            (StatusCode::FORBIDDEN, "forbidden")
        } else {
            (StatusCode::UNAUTHORIZED, "unauthenticated")
        };
        state.count(outcome);
        let mut response = refused(code, status.message());
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"kvroute\""),
        );
        return response;
    }
    let Ok(_permit) = state.in_flight.clone().try_acquire_owned() else {
        state.count("busy");
        return refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests of the view at once",
        );
    };
    let response = next.run(request).await;
    state.count(
        if response.status().is_success() || response.status().is_redirection() {
            "ok"
        } else {
            "not_found"
        },
    );
    response
}

#[derive(Deserialize)]
struct FleetQuery {
    #[serde(default)]
    offset: usize,
    limit: Option<usize>,
    /// Workers whose id, model, endpoint or taints contain it.
    #[serde(default)]
    filter: String,
}

/// A page of the fleet, and its totals.
async fn fleet(
    State(state): State<WebState>,
    query: Result<Query<FleetQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return refused(StatusCode::BAD_REQUEST, "offset and limit are numbers");
    };
    // Registrations for the filter and the totals; a full view (index,
    // subscription, bookings) only of the page's workers.
    let router = state.fleet.router();
    let records = router.workers(None);
    let filter = query.filter.to_lowercase();
    let matching: Vec<_> = records
        .iter()
        .filter(|record| {
            let r = &record.registration;
            filter.is_empty()
                || r.worker_id.to_string().contains(&filter)
                || r.model.to_lowercase().contains(&filter)
                || r.endpoint.to_lowercase().contains(&filter)
                || r.taints.iter().any(|t| t.to_lowercase().contains(&filter))
        })
        .collect();
    let limit = query.limit.unwrap_or(100).min(MAX_PAGE);
    let page: Vec<Value> = matching
        .iter()
        .skip(query.offset)
        .take(limit)
        .filter_map(|record| state.fleet.worker_view(record.registration.worker_id).ok())
        .map(|view| crate::grpc::json::worker_json(&convert::worker_view_to_pb(&view)))
        .collect();
    let cordoned = records.iter().filter(|r| r.cordoned).count();
    let untrusted = records
        .iter()
        .filter(|r| matches!(router.cache_view(&r.snapshot()), CacheView::Blended(_)))
        .count();
    axum::Json(json!({
        "total": records.len(),
        "matching": matching.len(),
        "cordoned": cordoned,
        "untrusted": untrusted,
        "offset": query.offset,
        "workers": page,
    }))
    .into_response()
}

/// Each model's index and each worker's share of its cached blocks.
async fn index(State(state): State<WebState>) -> Response {
    let router = state.fleet.router();
    let models: BTreeSet<String> = router
        .workers(None)
        .into_iter()
        .map(|record| record.registration.model)
        .collect();
    let models: Vec<Value> = models
        .into_iter()
        .filter_map(|model| {
            let index = router.index_of(&model)?;
            let stats = index.stats();
            let mut per_worker: BTreeMap<u64, u64> = BTreeMap::new();
            for (target, blocks) in &stats.per_worker {
                *per_worker.entry(target.worker_id).or_default() += blocks;
            }
            let mut shares: Vec<(u64, u64)> = per_worker.into_iter().collect();
            shares.sort_by_key(|share| std::cmp::Reverse(share.1));
            let shown: Vec<Value> = shares
                .iter()
                .take(MAX_PAGE)
                .map(|(worker_id, blocks)| {
                    json!({
                        "worker_id": worker_id,
                        "blocks": blocks,
                        "share": *blocks as f64 / stats.blocks.max(1) as f64,
                    })
                })
                .collect();
            Some(json!({
                "model": model,
                "entries": stats.blocks,
                "nodes": stats.nodes,
                "workers": stats.workers,
                "memory_bytes": stats.bytes_used,
                "events_applied": stats.events_applied,
                "events_rejected": stats.events_rejected,
                "workers_holding": shares.len(),
                "shares": shown,
            }))
        })
        .collect();
    axum::Json(json!({ "models": models })).into_response()
}

#[derive(Deserialize)]
struct DecisionsQuery {
    #[serde(default)]
    after: u64,
    /// At most this many (the newest); 50 unless asked, at most all kept.
    limit: Option<usize>,
}

/// The kept decisions after `after`, newest last: a busy router makes
/// thousands a second, and a page shows the newest few.
async fn decisions(
    State(state): State<WebState>,
    query: Result<Query<DecisionsQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return refused(StatusCode::BAD_REQUEST, "after is a number");
    };
    let kept = state.fleet.router().decisions_after(
        query.after,
        query
            .limit
            .unwrap_or(50)
            .min(crate::router::decisions::KEPT),
    );
    let decisions: Vec<Value> = kept.iter().map(|d| json::decision(d)).collect();
    axum::Json(json!({ "decisions": decisions })).into_response()
}

/// This replica's place in the shared log (cluster mode).
async fn cluster(State(state): State<WebState>) -> Response {
    let Some(replica) = &state.replica else {
        return axum::Json(json!({ "cluster": false })).into_response();
    };
    let cluster = &state.metrics.cluster;
    let lag = &cluster.log_lag;
    let count = lag.get_sample_count();
    axum::Json(json!({
        "cluster": true,
        "replica": replica,
        "connected": cluster.connected.get() == 1,
        "log_position": cluster.log_position.get(),
        "lag_mean_seconds": if count == 0 { 0.0 } else { lag.get_sample_sum() / count as f64 },
        "leases_reaped": cluster.leases_reaped.get(),
        "booking_resyncs": cluster.booking_resyncs.get(),
    }))
    .into_response()
}

/// The auth check the view uses when a policy is loaded (`None` without
/// one: the metrics listener is then open too). Bearer tokens only: the
/// metrics listener does not ask for client certificates.
pub(crate) fn guard_for(
    policy: Option<&Arc<crate::security::Policy>>,
    metrics: &Metrics,
) -> Option<Guard> {
    let mut paths = std::collections::HashSet::new();
    paths.insert(VIEW_PATH.to_owned());
    Some(Guard::new(
        Some(policy?.clone()),
        false,
        metrics.security.auth_decisions.clone(),
        paths,
    ))
}
