//! [`ConsoleError`]: why a page could not be shown or an action not done, answered as an
//! HTML page with the HTTP status of its cause.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;

/// Why a console page or action failed.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The console was started without this service (`orchestrator` or `registry`).
    #[error("this console has no {0} to ask; start it with --{0} URL")]
    NoService(&'static str),
    /// A call of the orchestrator or registry failed.
    #[error("{}", .0.message())]
    Rpc(#[from] tonic::Status),
    /// The request itself is wrong (a path segment, a query or form value out of bounds).
    #[error("{0}")]
    BadRequest(String),
}

impl ConsoleError {
    /// The HTTP status the error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ConsoleError::NoService(_) => StatusCode::SERVICE_UNAVAILABLE,
            // The console's own call deadline ends a call as CANCELLED ("Timeout expired"):
            // to the browser the service it called did not answer in time.
            ConsoleError::Rpc(status) if status.code() == tonic::Code::Cancelled => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ConsoleError::Rpc(status) => reach_rpc::errors::http_status(status.code()),
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
        }
    }
}

impl IntoResponse for ConsoleError {
    /// A page naming the error, with [`ConsoleError::status`].
    fn into_response(self) -> Response {
        let status = self.status();
        let title = status.canonical_reason().unwrap_or("Error");
        let body = html! {
            div.notice.error role="alert" {
                strong { (title) } ": " (self.to_string())
            }
            @if status == StatusCode::UNAUTHORIZED {
                p { a href={ (crate::BASE) "/login" } #login-again { "Log in again" } }
            }
        };
        (
            status,
            crate::layout::page(title, crate::layout::Nav::None, body),
        )
            .into_response()
    }
}
