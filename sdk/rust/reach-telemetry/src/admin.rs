//! The HTTP admin router every service serves next to its gRPC port: `GET /metrics`
//! (Prometheus text format) and `GET /health`; services merge their own JSON routes.

use std::future::Future;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;

/// The content type of the Prometheus text exposition format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The paths [`admin_router`] serves (both `GET`), for a startup banner to list.
pub const ADMIN_PATHS: [&str; 2] = ["/health", "/metrics"];

/// `GET /metrics` rendering `handle`, and `GET /health` answering `{"status":"ok"}`.
/// Extend it with `.merge(...)` or `.route(...)`:
/// `admin_router(metrics::install()?).route("/v1/instances", get(list))`.
pub fn admin_router(handle: PrometheusHandle) -> Router {
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
}

async fn health() -> impl IntoResponse {
    axum::Json(serde_json::json!({ "status": "ok" }))
}

/// The most connections an admin port serves at once: scrapers, probes and `reach top` need
/// a few; the rest of the process's file descriptors are for its gRPC port.
pub const ADMIN_MAX_CONNECTIONS: usize = 256;

/// Serves `router` on a listener the caller bound until `shutdown` resolves, then lets
/// requests in progress finish for at most `grace` (the service's `[server] shutdown_grace`;
/// [`reach_rpc::server::DEFAULT_GRACE`] by default) and returns (see
/// [`reach_rpc::server::serve_http`]: a client that never finishes its request, or stopped
/// reading its response, cannot hold the process up). A failed `accept` is logged and
/// retried, never returned. At most [`ADMIN_MAX_CONNECTIONS`] connections at once, with the
/// other default [`reach_rpc::ConnectionLimits`].
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
/// of the policy's open paths (`/health` and `/metrics` by default). The routes authorize
/// what they serve themselves (operators only, by [`reach_trust::Trust::check_operator`]).
pub async fn serve_admin_with_trust(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
    trust: std::sync::Arc<reach_trust::Trust>,
) {
    reach_rpc::server::serve_http_with_client_certificates(
        listener,
        router,
        shutdown,
        grace,
        reach_rpc::ConnectionLimits {
            max_connections: ADMIN_MAX_CONNECTIONS,
            shutdown_grace: grace,
            ..reach_rpc::ConnectionLimits::default()
        },
        reach_rpc::limits::MessageLimits::default(),
        trust,
        reach_rpc::server::ClientCertificates::Optional,
    )
    .await;
}
