//! The HTTP admin port: `GET /metrics` (Prometheus), `GET /health` (liveness) and `GET /ready`
//! (readiness: 503 while the process's gRPC health says NOT_SERVING) from reach-telemetry,
//! `GET /agents` (JSON) and `DELETE /agents/{service}` (drain, then remove), as users of the
//! original gateway expect; `reach dev` adds the orchestrator's `GET /tasks/{id}` and
//! `POST /tasks/{id}/retry`, and the web console under `/console` (`docs/console.md`).
//!
//! With trust on (see [`serve`]), `/health`, `/ready` and `/metrics` stay open to anyone and every
//! other route needs an operator ([`reach_trust::Trust::check_operator`]); a refusal is 403
//! with `{"error": "<message>", "reason": "NOT_AUTHORIZED"}`. With trust on or off, the
//! operator routes and the console answer only requests naming one of the port's hosts
//! (loopback names and `admin.allowed_hosts`) and changes from their own origin
//! ([`reach_console::guard::Guard`]); a refusal is 403 saying what to change.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use reach_registry::Backend;
use reach_trust::{Caller, Trust};

pub use crate::config::AdminConfig;

/// What the `/agents` routes serve from: the local registry, if any, and the trust that
/// authorizes their callers.
#[derive(Clone)]
struct AgentsState {
    registry: Option<Backend>,
    trust: Arc<Trust>,
}

/// 403 with the refusal as JSON.
fn forbidden(denied: &reach_trust::Denied) -> axum::response::Response {
    (
        StatusCode::FORBIDDEN,
        Json(serde_json::json!({"error": denied.to_string(), "reason": "NOT_AUTHORIZED"})),
    )
        .into_response()
}

/// The paths [`routes`] serves when the process runs a registry (without one they answer 404
/// naming the registry's admin port instead).
pub const REGISTRY_PATHS: [&str; 2] = ["/agents", "DELETE /agents/{service}"];

/// The admin port's paths in a process that runs a registry and/or an orchestrator, as the
/// startup banner lists them (`GET` unless a method is given): reach-telemetry's
/// [`ADMIN_PATHS`](reach_telemetry::ADMIN_PATHS), [`REGISTRY_PATHS`] and the orchestrator's
/// [`PATHS`](reach_orchestrator::http::PATHS).
pub fn paths(registry: bool, orchestrator: bool) -> Vec<&'static str> {
    let mut paths = reach_telemetry::ADMIN_PATHS.to_vec();
    if registry {
        paths.extend(REGISTRY_PATHS);
    }
    if orchestrator {
        paths.extend(reach_orchestrator::http::PATHS);
    }
    paths
}

/// The admin routes: `/metrics` (from `metrics`), `/health`, `/ready` (following `ready`, the
/// gRPC server's [`readiness`](reach_rpc::GrpcServer::readiness)), and `/agents` over an
/// optional local registry, for operators only once `trust` is on.
pub fn routes(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    ready: tokio::sync::watch::Receiver<bool>,
    registry: Option<Backend>,
    trust: Arc<Trust>,
) -> Router {
    operator_routes(metrics, ready, registry, trust, None, &[])
}

/// [`routes`], the operator routes answering `allowed_hosts` besides loopback names.
pub fn routes_for(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    ready: tokio::sync::watch::Receiver<bool>,
    registry: Option<Backend>,
    trust: Arc<Trust>,
    allowed_hosts: &[String],
) -> Router {
    operator_routes(metrics, ready, registry, trust, None, allowed_hosts)
}

/// [`routes`], plus `extra` operator routes (the orchestrator's), answering `allowed_hosts`
/// besides loopback names. A page on another site could reach them through a browser —
/// by rebinding a name to the port's address (and reading `/tasks/{id}`), or by posting a
/// form (draining agents, retrying tasks) — with whatever the browser holds: nothing
/// without trust, an operator's client certificate with it. So, trust on or off, they are
/// served only for the port's names and same-origin changes ([`reach_console::guard::Guard`],
/// as the console is). `/health`, `/ready` and `/metrics` stay open to probes and scrapers by
/// any name.
fn operator_routes(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    ready: tokio::sync::watch::Receiver<bool>,
    registry: Option<Backend>,
    trust: Arc<Trust>,
    extra: Option<Router>,
    allowed_hosts: &[String],
) -> Router {
    let mut operator = Router::new()
        .route("/agents", get(agents))
        .route("/agents/{service}", axum::routing::delete(drain_service))
        .with_state(AgentsState { registry, trust });
    if let Some(extra) = extra {
        operator = operator.merge(extra);
    }
    let operator = reach_console::guard::Guard::new(allowed_hosts).layer(operator);
    reach_telemetry::admin_router(metrics, ready).merge(operator)
}

/// The admin routes of `plane`: [`routes`] over its registry and its gRPC server's readiness,
/// and its orchestrator's task routes when it runs one, authorized with its trust.
pub fn plane_routes(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    plane: &crate::control_plane::ControlPlane,
) -> Router {
    plane_routes_for(metrics, plane, &[])
}

/// [`plane_routes`], its operator routes and console answering `allowed_hosts` besides
/// loopback names (`admin.allowed_hosts`).
pub fn plane_routes_for(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    plane: &crate::control_plane::ControlPlane,
    allowed_hosts: &[String],
) -> Router {
    let mut routes = operator_routes(
        metrics,
        plane.readiness(),
        plane.registry().cloned(),
        plane.trust().clone(),
        plane.orchestrator().map(|o| o.admin_router()),
        allowed_hosts,
    );
    if let Some(console) = console_for(plane, allowed_hosts) {
        routes = routes.merge(console.routes());
    }
    routes
}

/// The web console of `plane` (at [`reach_console::BASE`]), calling its own orchestrator
/// and registry over loopback; `None` when it runs neither. With trust on, a person logs in
/// with a bearer token, and the console calls the services with that token alone (over TLS
/// without this process's certificate when the plane serves TLS), so their policy judges the
/// person, never the process.
pub fn console(plane: &crate::control_plane::ControlPlane) -> Option<reach_console::Console> {
    console_for(plane, &[])
}

/// [`console`], answering `allowed_hosts` besides loopback names.
pub fn console_for(
    plane: &crate::control_plane::ControlPlane,
    allowed_hosts: &[String],
) -> Option<reach_console::Console> {
    if plane.orchestrator().is_none() && plane.registry().is_none() {
        return None;
    }
    let trust = plane.trust();
    let channel = match trust.tls() {
        Some(tls) => {
            let anonymous = reach_trust::tls::TlsSource::load(
                &reach_trust::tls::TlsConfig {
                    cert: None,
                    key: None,
                    ..tls.config().clone()
                },
                trust.trust_domain(),
            );
            let anonymous = match anonymous {
                Ok(anonymous) => anonymous,
                Err(e) => {
                    tracing::warn!(error = %e, "the console is off: cannot load the CA for its channel");
                    return None;
                }
            };
            let endpoint = reach_rpc::http2::endpoint(format!("https://{}", plane.addr())).ok()?;
            reach_rpc::http2::channel_lazy(&endpoint, Some(&anonymous), None)
        }
        None => {
            let endpoint = reach_rpc::http2::endpoint(plane.endpoint()).ok()?;
            reach_rpc::http2::channel_lazy(&endpoint, None, None)
        }
    };
    Some(reach_console::Console::new(
        reach_console::ConsoleChannels {
            orchestrator: plane.orchestrator().is_some().then(|| channel.clone()),
            registry: plane.registry().is_some().then_some(channel),
            latency: plane.router().map(|router| {
                let table = router.table().clone();
                reach_console::LatencySource::new(move |instance_id| {
                    let estimate = table
                        .endpoint(instance_id)?
                        .load_tracker()
                        .rtt_estimate_ns()?;
                    Some(std::time::Duration::from_nanos(estimate as u64))
                })
            }),
        },
        reach_console::ConsoleConfig {
            allowed_hosts: allowed_hosts.to_vec(),
            refresh_ms: reach_console::DEFAULT_REFRESH_MS,
            login: trust.is_enabled(),
            ..reach_console::ConsoleConfig::default()
        },
    ))
}

/// Serves `plane`'s admin routes ([`plane_routes`]) on `listener` with its trust (TLS when it
/// has certificates, client certificates optional; see
/// [`reach_telemetry::serve_admin_with_trust`]) until `shutdown` resolves, with the default
/// [`AdminConfig`] and `grace`.
///
/// # Errors
/// [`reach_trust::TrustError::PlaintextListener`] for a non-loopback listener without TLS
/// unless `trust.insecure` is set.
pub fn serve(
    listener: tokio::net::TcpListener,
    metrics: reach_telemetry::metrics::PrometheusHandle,
    plane: &crate::control_plane::ControlPlane,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: std::time::Duration,
) -> Result<tokio::task::JoinHandle<()>, reach_trust::TrustError> {
    let server = reach_rpc::ConnectionLimits {
        shutdown_grace: grace,
        ..reach_rpc::ConnectionLimits::default()
    };
    serve_configured(
        listener,
        metrics,
        plane,
        shutdown,
        &server,
        &AdminConfig::default(),
    )
}

/// [`serve`] as `admin` says (its hosts and connection limits), with `server`'s timeouts
/// and shutdown grace ([`AdminConfig::limits`]).
///
/// # Errors
/// As [`serve`].
pub fn serve_configured(
    listener: tokio::net::TcpListener,
    metrics: reach_telemetry::metrics::PrometheusHandle,
    plane: &crate::control_plane::ControlPlane,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    server: &reach_rpc::ConnectionLimits,
    admin: &AdminConfig,
) -> Result<tokio::task::JoinHandle<()>, reach_trust::TrustError> {
    if let Ok(addr) = listener.local_addr() {
        plane.trust().check_listener(addr)?;
    }
    Ok(tokio::spawn(reach_telemetry::serve_admin_with_limits(
        listener,
        plane_routes_for(metrics, plane, &admin.allowed_hosts),
        shutdown,
        admin.limits(server),
        plane.trust().clone(),
    )))
}

async fn agents(
    State(state): State<AgentsState>,
    extensions: axum::http::Extensions,
) -> impl IntoResponse {
    if let Err(denied) = state
        .trust
        .check_operator(&Caller::of(&extensions), "list", "agents")
    {
        return forbidden(&denied);
    }
    let Some(registry) = state.registry else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "this process runs no registry; ask the registry's admin port"})),
        )
            .into_response();
    };
    let list = registry.view().list("", "");
    let instances: Vec<serde_json::Value> = list
        .instances
        .iter()
        .map(|i| {
            let spec = i.spec.clone().unwrap_or_default();
            serde_json::json!({
                "service": spec.service,
                "instance_id": spec.instance_id,
                "endpoint": spec.endpoint,
                "state": i.state().as_str_name(),
                "in_flight": i.in_flight,
                "model_calls_in_flight": i.model_calls_in_flight,
                "model_slots_free": i.model_slots_free,
                "max_concurrency": spec.max_concurrency,
                "capabilities": spec.capabilities.iter().map(|c| format!("{}@{}", c.name, c.version)).collect::<Vec<_>>(),
                "revision": i.revision,
            })
        })
        .collect();
    Json(serde_json::json!({"revision": list.revision, "instances": instances})).into_response()
}

/// How long `DELETE /agents/{service}` lets in-flight work finish before removing.
const DRAIN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// `DELETE /agents/{service}`: drains every instance of the service (DRAINING now, removed
/// once idle or after 30 s). 202 with the instance ids; 404 when the service has none.
async fn drain_service(
    State(state): State<AgentsState>,
    axum::extract::Path(service): axum::extract::Path<String>,
    extensions: axum::http::Extensions,
) -> axum::response::Response {
    if let Err(denied) = state.trust.check_operator(
        &Caller::of(&extensions),
        "drain",
        &format!("service {service:?}"),
    ) {
        return forbidden(&denied);
    }
    let Some(registry) = state.registry else {
        return (
            StatusCode::NOT_FOUND,
            Json(
                serde_json::json!({"error": "this process runs no registry; ask the registry's admin port"}),
            ),
        )
            .into_response();
    };
    let drained = registry.drain_service(&service, DRAIN_GRACE).await;
    if drained.is_empty() {
        return (
            StatusCode::NOT_FOUND,
            Json(
                serde_json::json!({"error": format!("no instance of service {service:?} is registered; see GET /agents")}),
            ),
        )
            .into_response();
    }
    (
        StatusCode::ACCEPTED,
        Json(
            serde_json::json!({"service": service, "draining": drained, "grace_s": DRAIN_GRACE.as_secs()}),
        ),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_settings_that_cannot_work_are_refused_naming_their_key() {
        assert!(AdminConfig::default().validate().is_ok());
        let none = AdminConfig {
            max_connections: 0,
            ..AdminConfig::default()
        };
        assert!(
            none.validate()
                .unwrap_err()
                .contains("admin.max_connections")
        );
        let bad_host = AdminConfig {
            allowed_hosts: vec!["https://evil.example/".into()],
            ..AdminConfig::default()
        };
        assert!(
            bad_host
                .validate()
                .unwrap_err()
                .contains("admin.allowed_hosts")
        );
    }

    #[test]
    fn the_admin_port_takes_the_servers_timeouts_with_a_header_timeout_of_at_most_10s() {
        let server = reach_rpc::ConnectionLimits {
            handshake_timeout: std::time::Duration::from_secs(3),
            shutdown_grace: std::time::Duration::from_secs(7),
            ..reach_rpc::ConnectionLimits::default()
        };
        let limits = AdminConfig::default().limits(&server);
        assert_eq!(limits.max_connections, 256);
        assert_eq!(limits.max_connections_per_peer, 64);
        assert_eq!(limits.handshake_timeout, server.handshake_timeout);
        assert_eq!(limits.shutdown_grace, server.shutdown_grace);
        assert_eq!(
            limits.header_read_timeout,
            std::time::Duration::from_secs(10)
        );
    }
}
