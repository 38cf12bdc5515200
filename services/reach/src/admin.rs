//! The HTTP admin port: `GET /metrics` (Prometheus) and `GET /health` from reach-telemetry,
//! `GET /agents` (JSON) and `DELETE /agents/{service}` (drain, then remove), as users of the
//! original gateway expect; `reach dev` adds the orchestrator's `GET /tasks/{id}` and
//! `POST /tasks/{id}/retry`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use reach_registry::Registry;

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

/// The admin routes: `/metrics` and `/health` (from `metrics`), and `/agents` over an
/// optional local registry.
pub fn routes(
    metrics: reach_telemetry::metrics::PrometheusHandle,
    registry: Option<Registry>,
) -> Router {
    reach_telemetry::admin_router(metrics).merge(
        Router::new()
            .route("/agents", get(agents))
            .route("/agents/{service}", axum::routing::delete(drain_service))
            .with_state(registry),
    )
}

async fn agents(State(registry): State<Option<Registry>>) -> impl IntoResponse {
    let Some(registry) = registry else {
        return (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": "this process runs no registry; ask the registry's admin port"})),
        )
            .into_response();
    };
    let list = registry.list("", "");
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
    State(registry): State<Option<Registry>>,
    axum::extract::Path(service): axum::extract::Path<String>,
) -> impl IntoResponse {
    let Some(registry) = registry else {
        return (
            StatusCode::NOT_FOUND,
            Json(
                serde_json::json!({"error": "this process runs no registry; ask the registry's admin port"}),
            ),
        );
    };
    let drained = registry.drain_service(&service, DRAIN_GRACE);
    if drained.is_empty() {
        return (
            StatusCode::NOT_FOUND,
            Json(
                serde_json::json!({"error": format!("no instance of service {service:?} is registered; see GET /agents")}),
            ),
        );
    }
    (
        StatusCode::ACCEPTED,
        Json(
            serde_json::json!({"service": service, "draining": drained, "grace_s": DRAIN_GRACE.as_secs()}),
        ),
    )
}
