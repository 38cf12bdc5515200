//! HTTP admin routes as an `axum::Router`: `GET /tasks/{id}` (the task with its node history,
//! masked, as JSON) and `POST /tasks/{id}/retry`. The `reach` binary merges them with its own
//! `/health`, `/metrics` and `/agents` routes.

use axum::extract::{Path, State};
use axum::http::StatusCode;
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
    fn into_response(self) -> Response {
        let code = match &self.0 {
            Error::NotFound(_) => StatusCode::NOT_FOUND,
            Error::InvalidArgument { .. } | Error::InvalidFlow(_) => StatusCode::BAD_REQUEST,
            Error::FailedPrecondition(_) | Error::AlreadyExists(_) => StatusCode::CONFLICT,
            Error::Unavailable(_) | Error::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Config(_) | Error::Serve(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(serde_json::json!({"error": self.0.to_string()}))).into_response()
    }
}

async fn get_task(
    State(api): State<OrchestratorApi>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, HttpError> {
    let state = api.engine().load(&id).await.map_err(HttpError)?;
    Ok(Json(crate::json::task_json(&api.task_view(&state))))
}

async fn retry_task(
    State(api): State<OrchestratorApi>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, HttpError> {
    let state = api.engine().retry(&id).await.map_err(HttpError)?;
    Ok(Json(crate::json::task_json(&api.task_view(&state))))
}
