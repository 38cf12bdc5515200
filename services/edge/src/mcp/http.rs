//! The MCP edge's HTTP routes: the Streamable HTTP endpoint at [`MCP_PATH`] and the OAuth 2.0
//! protected resource metadata (RFC 9728) that MCP clients read to find where to get a token.
//!
//! Requests reach these routes authenticated by the edge port's trust layer, which answers
//! 401 with `WWW-Authenticate: Bearer resource_metadata="…"` (see
//! [`reach_rpc::server::Challenge`], built by [`challenge`]). A caller that proved itself
//! only with a client certificate is refused here too: the edge acts with its callers'
//! bearer tokens, never with its own identity on their behalf.

use std::sync::Arc;

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;

use super::McpEdge;

/// Where the MCP endpoint is served on the edge's HTTP port.
pub const MCP_PATH: &str = "/mcp";
/// The protected resource metadata of the MCP endpoint (RFC 9728 §3.1: the well-known
/// prefix, then the resource's path).
pub const RESOURCE_METADATA_PATH: &str = "/.well-known/oauth-protected-resource/mcp";
/// The same document at the well-known path without the resource's path, for clients that
/// look there first.
const RESOURCE_METADATA_ROOT: &str = "/.well-known/oauth-protected-resource";

/// Where the edge is reached from outside, and what it says about authorization.
#[derive(Debug, Clone)]
pub struct Published {
    /// The edge's base URL (`https://mesh.example.com`), without a trailing `/`.
    pub base_url: String,
    /// The authorization servers (issuer URLs) whose tokens the mesh accepts.
    pub authorization_servers: Vec<String>,
}

impl Published {
    /// The MCP endpoint's URL: the resource identifier tokens are for.
    pub fn resource(&self) -> String {
        format!("{}{MCP_PATH}", self.base_url)
    }
}

/// The challenge a 401 under [`MCP_PATH`] carries.
pub fn challenge(published: &Published) -> reach_rpc::server::Challenge {
    reach_rpc::server::Challenge {
        path_prefix: MCP_PATH.to_string(),
        resource_metadata: format!("{}{RESOURCE_METADATA_PATH}", published.base_url),
    }
}

/// The routes: the MCP endpoint and its resource metadata, behind `guard` (the port's Host
/// and Origin checks, which stand for the transport spec's DNS-rebinding defence).
pub fn routes(edge: McpEdge, published: Published, guard: &crate::guard::HttpGuard) -> Router {
    let server = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        // `guard` checks Host and Origin for the whole port.
        .disable_allowed_hosts()
        .with_max_request_body_bytes(edge.limits().max_message_bytes);
    let trust_on = edge.authenticates();
    let refusal = challenge(&published);
    let factory = edge.clone();
    let service = StreamableHttpService::new(
        move || Ok(factory.clone()),
        Arc::new(NeverSessionManager::default()),
        server,
    );
    let metadata = Arc::new(json!({
        "resource": published.resource(),
        "authorization_servers": published.authorization_servers,
        "bearer_methods_supported": ["header"],
        "resource_name": "Reach mesh (MCP)",
    }));
    let document = move || {
        let metadata = metadata.clone();
        async move { axum::Json(metadata.as_ref().clone()) }
    };
    let router = Router::new()
        .route(RESOURCE_METADATA_ROOT, get(document.clone()))
        .route(RESOURCE_METADATA_PATH, get(document))
        .nest_service(
            MCP_PATH,
            tower::ServiceBuilder::new()
                .layer(axum::middleware::from_fn(
                    move |request: axum::extract::Request, next: axum::middleware::Next| {
                        let refused = trust_on && refuse_certificate_only(&request);
                        let response = refused.then(|| unauthorized(&refusal));
                        async move {
                            match response {
                                Some(response) => response,
                                None => next.run(request).await,
                            }
                        }
                    },
                ))
                .layer(axum::middleware::from_fn(explain_refusals))
                .service(service),
        );
    guard.layer(router)
}

/// The largest refusal body of rmcp's that [`explain_refusals`] reads, in bytes.
const MAX_REFUSAL_BYTES: usize = 64 * 1024;

/// Rewrites two of rmcp's refusals into the JSON-RPC errors they stand for, saying what to
/// fix: a body that is not one JSON-RPC request (rmcp answers 415 and plain text) becomes
/// 400 with a PARSE_ERROR (-32700), and a request for a method the edge serves whose
/// params do not fit it (rmcp answers METHOD_NOT_FOUND naming the method) becomes
/// INVALID_PARAMS (-32602). Other responses pass untouched (and unread).
async fn explain_refusals(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    if status != http::StatusCode::UNSUPPORTED_MEDIA_TYPE && status != http::StatusCode::NOT_FOUND {
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_REFUSAL_BYTES).await else {
        return (parts.status, "the request was refused\n").into_response();
    };
    let answer: Option<serde_json::Value> = serde_json::from_slice(&bytes).ok();
    let id = answer
        .as_ref()
        .map_or(serde_json::Value::Null, |a| a["id"].clone());
    let error = |code: i64, message: String| {
        (
            http::StatusCode::BAD_REQUEST,
            axum::Json(
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
            ),
        )
            .into_response()
    };
    if status == http::StatusCode::UNSUPPORTED_MEDIA_TYPE {
        let detail = String::from_utf8_lossy(&bytes);
        return error(
            -32700,
            format!(
                "the body is not one JSON-RPC 2.0 request (an object with \"jsonrpc\": \"2.0\", a string or number \"id\" and a \"method\"; MCP has no batches): {}",
                detail.trim().chars().take(512).collect::<String>()
            ),
        );
    }
    let method = answer
        .as_ref()
        .filter(|a| a["error"]["code"] == -32601)
        .and_then(|a| a["error"]["message"].as_str());
    match method {
        Some(method @ ("tools/call" | "tools/list")) => error(
            -32602,
            format!(
                "the params of {method} do not fit it: \"name\" must be a string, \"arguments\" a JSON object and \"cursor\" a string"
            ),
        ),
        Some(method) => error(
            -32601,
            format!(
                "method not found: {:?}; the edge serves initialize, ping, tools/list and tools/call",
                method.chars().take(128).collect::<String>()
            ),
        ),
        None => Response::from_parts(parts, axum::body::Body::from(bytes)),
    }
}

/// Whether the request's caller proved itself only with a client certificate.
fn refuse_certificate_only(request: &axum::extract::Request) -> bool {
    reach_trust::Caller::of(request.extensions()).via() == reach_trust::Via::Certificate
}

fn unauthorized(challenge: &reach_rpc::server::Challenge) -> Response {
    (
        http::StatusCode::UNAUTHORIZED,
        [(
            http::header::WWW_AUTHENTICATE,
            format!(
                "Bearer resource_metadata=\"{}\"",
                challenge.resource_metadata
            ),
        )],
        "the MCP edge calls the mesh with its callers' bearer tokens, and this request has only a client certificate: send Authorization: Bearer <token>\n",
    )
        .into_response()
}
