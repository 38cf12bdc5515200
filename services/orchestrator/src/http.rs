//! HTTP admin routes as an `axum::Router`: `GET /tasks/{id}` (the task with its node history,
//! masked, as JSON) and `POST /tasks/{id}/retry`. The `reach` binary merges them with its own
//! `/health`, `/ready`, `/metrics` and `/agents` routes.
//!
//! With trust on, both need an operator ([`reach_trust::Trust::check_operator`]): a refusal
//! is 403 with the message as JSON.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::error::Error;
use crate::service::OrchestratorApi;

/// The paths [`router`] serves, for a startup banner to list (`GET` unless a method is
/// given).
pub const PATHS: [&str; 2] = ["/tasks/{id}", "POST /tasks/{id}/retry"];

/// The admin routes over `api`: [`PATHS`].
pub fn router(api: OrchestratorApi) -> Router {
    Router::new()
        .route("/tasks/{id}", get(get_task))
        .route("/tasks/{id}/retry", post(retry_task))
        .with_state(api)
}

struct HttpError(Error);

impl IntoResponse for HttpError {
    /// The HTTP status of the error's gRPC code, with a body
    /// `{"error": "<message>", "reason": "<ErrorInfo reason or null>"}`.
    fn into_response(self) -> Response {
        let status = tonic::Status::from(self.0);
        let body = serde_json::json!({
            "error": status.message(),
            "reason": reach_rpc::errors::reason_of(&status),
        });
        (reach_rpc::errors::http_status(status.code()), Json(body)).into_response()
    }
}

async fn get_task(
    State(api): State<OrchestratorApi>,
    Path(id): Path<String>,
    extensions: axum::http::Extensions,
) -> Result<Json<serde_json::Value>, HttpError> {
    let caller = reach_trust::Caller::of(&extensions);
    api.trust()
        .check_operator(&caller, "view", &format!("task {id:?}"))
        .map_err(|denied| HttpError(denied.into()))?;
    let state = api.engine().load(&id).await.map_err(HttpError)?;
    Ok(Json(crate::json::task_json(&api.task_view(&state))))
}

async fn retry_task(
    State(api): State<OrchestratorApi>,
    Path(id): Path<String>,
    extensions: axum::http::Extensions,
) -> Result<Json<serde_json::Value>, HttpError> {
    let caller = reach_trust::Caller::of(&extensions);
    api.trust()
        .check_operator(&caller, "retry", &format!("task {id:?}"))
        .map_err(|denied| HttpError(denied.into()))?;
    let state = api.engine().retry(&id).await.map_err(HttpError)?;
    Ok(Json(crate::json::task_json(&api.task_view(&state))))
}
