//! The HTTP admin router every service serves next to its gRPC port: `GET /metrics`
//! (Prometheus text format), `GET /health` (liveness: the process answers) and `GET /ready`
//! (readiness: what the service's `grpc.health.v1` says, for probes that cannot speak gRPC,
//! such as Kubernetes' HTTPS probes under TLS, and L4 load balancers' health checks);
//! services merge their own JSON routes.

use std::future::Future;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

/// The content type of the Prometheus text exposition format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The paths [`admin_router`] serves (all `GET`), for a startup banner to list.
pub const ADMIN_PATHS: [&str; 3] = ["/health", "/ready", "/metrics"];

/// `GET /metrics` rendering `handle`; `GET /health` answering `{"status":"ok"}` whenever the
/// process answers (liveness); `GET /ready` answering 200 `{"status":"serving"}` while
/// `ready` holds true and 503 `{"status":"not_serving"}` while it holds false (readiness).
///
/// `ready` is the service's gRPC health as one flag
/// ([`reach_rpc::GrpcServer::readiness`]), so `/ready` and `grpc.health.v1` agree; a
/// service with no notion of not serving passes `tokio::sync::watch::channel(true).1`.
/// Extend the router with `.merge(...)` or `.route(...)`:
/// `admin_router(metrics::install()?, server.readiness()).route("/v1/instances", get(list))`.
pub fn admin_router(handle: PrometheusHandle, ready: tokio::sync::watch::Receiver<bool>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let handle = handle.clone();
                async move {
                    handle.run_upkeep();
                    (
                        [(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)],
                        handle.render(),
                    )
                }
            }),
        )
        .route("/health", get(health))
        .route("/ready", get(move || ready_status(ready.clone())))
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({ "status": "ok" }))
}

async fn ready_status(ready: tokio::sync::watch::Receiver<bool>) -> impl IntoResponse {
    if *ready.borrow() {
        (
            StatusCode::OK,
            axum::Json(serde_json::json!({ "status": "serving" })),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ "status": "not_serving" })),
        )
    }
}

/// The most connections an admin port serves at once: scrapers, probes and `reach top` need
/// a few; the rest of the process's file descriptors are for its gRPC port.
pub const ADMIN_MAX_CONNECTIONS: usize = 256;

/// The most connections one peer address holds on an admin port at once: room for a
/// node's kubelet probes and a scraper behind one address, while one peer flooding the port
/// can fill at most a quarter of it (and at either limit a new connection takes the place of
/// the longest-idle one, so probes get through; see [`reach_rpc::ConnectionLimits`]).
pub const ADMIN_MAX_CONNECTIONS_PER_PEER: usize = 64;

/// The limits an admin port holds its connections to: at most [`ADMIN_MAX_CONNECTIONS`] at
/// once and [`ADMIN_MAX_CONNECTIONS_PER_PEER`] per peer address, HTTP/1.1 request headers
/// within 10 s, `grace` on shutdown, the other defaults of [`reach_rpc::ConnectionLimits`].
pub fn admin_limits(grace: std::time::Duration) -> reach_rpc::ConnectionLimits {
    reach_rpc::ConnectionLimits {
        max_connections: ADMIN_MAX_CONNECTIONS,
        max_connections_per_peer: ADMIN_MAX_CONNECTIONS_PER_PEER,
        header_read_timeout: std::time::Duration::from_secs(10),
        shutdown_grace: grace,
        ..reach_rpc::ConnectionLimits::default()
    }
}

/// Serves `router` on a listener the caller bound until `shutdown` resolves, then lets
/// requests in progress finish for at most `grace` (the service's `[server] shutdown_grace`;
/// [`reach_rpc::server::DEFAULT_GRACE`] by default) and returns (see
/// [`reach_rpc::server::serve_http`]: a client that never finishes its request, or stopped
/// reading its response, cannot hold the process up). A failed `accept` is logged and
/// retried, never returned. Held to [`admin_limits`].
pub async fn serve_admin(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) {
    serve_admin_with_trust(
        listener,
        router,
        shutdown,
        grace,
        reach_trust::Trust::disabled(),
    )
    .await;
}

/// [`serve_admin`] with `trust` (see [`reach_rpc::server::serve_http_with_trust`]): TLS when
/// it has certificates, with client certificates optional whatever `[trust.tls] client_auth`
/// says, since probes (Kubernetes HTTPS probes) present none; each request's caller is
/// authenticated, a request without a certificate or bearer token answered 401 except GETs
/// of the policy's open paths (`/health`, `/ready` and `/metrics` by default). The routes authorize
/// what they serve themselves (operators only, by [`reach_trust::Trust::check_operator`]).
pub async fn serve_admin_with_trust(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
    trust: std::sync::Arc<reach_trust::Trust>,
) {
    serve_admin_with_limits(listener, router, shutdown, admin_limits(grace), trust).await;
}

/// [`serve_admin_with_trust`] held to `limits` (its `shutdown_grace` the grace period) instead
/// of [`admin_limits`].
pub async fn serve_admin_with_limits(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    limits: reach_rpc::ConnectionLimits,
    trust: std::sync::Arc<reach_trust::Trust>,
) {
    reach_rpc::server::serve_http_with_client_certificates(
        listener,
        router,
        shutdown,
        limits.shutdown_grace,
        limits,
        reach_rpc::limits::MessageLimits::default(),
        trust,
        reach_rpc::server::ClientCertificates::Optional,
    )
    .await;
}
