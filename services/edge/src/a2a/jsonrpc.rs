//! The A2A JSON-RPC binding and the agent cards, over HTTP (axum), on the edge's HTTP port:
//!
//! - `GET /.well-known/agent-card.json`: the mesh's card; `GET
//!   /agents/{service}/.well-known/agent-card.json`: one service's card (404 when no routable
//!   instance serves it).
//! - `POST /` (the mesh) and `POST /agents/{service}/` (one service): JSON-RPC 2.0 requests
//!   whose `method` is an A2A v1 method (`SendMessage`, `GetTask`, …) and whose `params` are
//!   the method's request message as proto3 JSON. Answers are JSON-RPC responses (HTTP 200,
//!   errors included, as JSON-RPC does); `SendStreamingMessage` and `SubscribeToTask` answer
//!   with Server-Sent Events, one JSON-RPC response per event, each with `id:` the event's
//!   sequence number so a client resumes with `Last-Event-ID`.
//!
//! Headers: `A2A-Version` (refused unless 1.x), `Authorization` and `traceparent` (passed
//! into the mesh), `Last-Event-ID`.

use std::convert::Infallible;

use axum::Router;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::edge::{A2aEdge, EventStream, RequestContext};
use super::error::A2aError;
use super::mapping::SEQUENCE_KEY;
use super::proto::{StreamResponse, stream_response};

/// The longest JSON-RPC request id echoed back, in bytes.
const MAX_ID_BYTES: usize = 256;

/// The routes of the JSON-RPC binding and the cards, for the edge's HTTP port.
pub fn routes(edge: A2aEdge) -> Router {
    let limit = edge.config().max_message_bytes;
    let guard = edge.config().http_guard();
    let router = Router::new()
        .route("/.well-known/agent-card.json", get(mesh_card))
        .route(
            "/agents/{service}/.well-known/agent-card.json",
            get(service_card),
        )
        .route("/", post(mesh_rpc))
        .route("/agents/{service}", post(service_rpc))
        .route("/agents/{service}/", post(service_rpc))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(edge);
    // Browsers and rebinding names reach 127.0.0.1 too: the port's Host and Origin checks.
    guard.layer(router)
}

fn context(headers: &HeaderMap, tenant: &str) -> Result<RequestContext, A2aError> {
    RequestContext::from_headers(headers, tenant)
}

fn card_error(error: &A2aError) -> Response {
    let status = match error {
        A2aError::InvalidParams(_) => StatusCode::NOT_FOUND,
        A2aError::VersionNotSupported(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    };
    (status, axum::Json(json!({"error": error.to_json_rpc()}))).into_response()
}

async fn mesh_card(State(edge): State<A2aEdge>, headers: HeaderMap) -> Response {
    card(edge, headers, None).await
}

async fn service_card(
    State(edge): State<A2aEdge>,
    Path(service): Path<String>,
    headers: HeaderMap,
) -> Response {
    card(edge, headers, Some(service)).await
}

async fn card(edge: A2aEdge, headers: HeaderMap, service: Option<String>) -> Response {
    let cx = match context(&headers, "") {
        Ok(cx) => cx,
        Err(error) => return card_error(&error),
    };
    match edge.card(&cx, service.as_deref()).await {
        Ok(card) => axum::Json(card).into_response(),
        Err(error) => card_error(&error),
    }
}

async fn mesh_rpc(
    State(edge): State<A2aEdge>,
    caller: Option<Extension<reach_trust::Caller>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Some(refused) = refused(caller) {
        return refused;
    }
    match body {
        Ok(body) => rpc(edge, headers, String::new(), body).await,
        Err(rejection) => body_refused(&edge, &rejection),
    }
}

async fn service_rpc(
    State(edge): State<A2aEdge>,
    caller: Option<Extension<reach_trust::Caller>>,
    Path(service): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Some(refused) = refused(caller) {
        return refused;
    }
    match body {
        Ok(body) => rpc(edge, headers, service, body).await,
        Err(rejection) => body_refused(&edge, &rejection),
    }
}

/// A body that could not be read (over the limit, or cut off): a JSON-RPC error with the
/// rejection's HTTP status, closing the connection (the rest of the body is not read).
fn body_refused(edge: &A2aEdge, rejection: &BytesRejection) -> Response {
    let status = rejection.status();
    let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
        format!(
            "the request body is over the edge's limit of {} bytes ([edge] max_message_bytes): send large content by url",
            edge.config().max_message_bytes
        )
    } else {
        format!(
            "the request body could not be read: {}",
            rejection.body_text()
        )
    };
    (
        status,
        [(axum::http::header::CONNECTION, "close")],
        axum::Json(json!({
            "jsonrpc": "2.0",
            "id": Value::Null,
            "error": A2aError::InvalidRequest(message).to_json_rpc(),
        })),
    )
        .into_response()
}

/// A 401 for a caller the edge may not act for ([`RequestContext::check_caller`]).
fn refused(caller: Option<Extension<reach_trust::Caller>>) -> Option<Response> {
    let Extension(caller) = caller?;
    let error = RequestContext::check_caller(&caller).err()?;
    Some(
        (
            StatusCode::UNAUTHORIZED,
            [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
            axum::Json(json!({"jsonrpc": "2.0", "id": Value::Null, "error": error.to_json_rpc()})),
        )
            .into_response(),
    )
}

fn rpc_error(id: &Value, error: &A2aError) -> Response {
    axum::Json(json!({"jsonrpc": "2.0", "id": id, "error": error.to_json_rpc()})).into_response()
}

fn rpc_result(id: &Value, result: &impl Serialize) -> Response {
    match serde_json::to_value(result) {
        Ok(result) => {
            axum::Json(json!({"jsonrpc": "2.0", "id": id, "result": result})).into_response()
        }
        Err(error) => rpc_error(id, &A2aError::InvalidAgentResponse(error.to_string())),
    }
}

fn params<T: DeserializeOwned + Default>(method: &str, params: Value) -> Result<T, A2aError> {
    if params.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(params).map_err(|e| {
        A2aError::InvalidParams(format!(
            "params of {method} are not a valid {method} request (proto3 JSON of the A2A v1 message): {e}"
        ))
    })
}

/// One JSON-RPC request: the envelope checked, the method dispatched.
async fn rpc(edge: A2aEdge, headers: HeaderMap, tenant: String, body: Bytes) -> Response {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return rpc_error(&Value::Null, &A2aError::ParseError(e.to_string())),
    };
    let Value::Object(mut request) = request else {
        return rpc_error(
            &Value::Null,
            &A2aError::InvalidRequest(
                "a JSON-RPC request is an object {\"jsonrpc\": \"2.0\", \"id\", \"method\", \"params\"}; batches are not served".into(),
            ),
        );
    };
    let id = request.remove("id").unwrap_or(Value::Null);
    if matches!(&id, Value::String(text) if text.len() > MAX_ID_BYTES) {
        return rpc_error(
            &Value::Null,
            &A2aError::InvalidRequest(format!(
                "the JSON-RPC id is longer than {MAX_ID_BYTES} bytes: use a short string or a number"
            )),
        );
    }
    if !matches!(id, Value::String(_) | Value::Number(_) | Value::Null) {
        return rpc_error(
            &Value::Null,
            &A2aError::InvalidRequest("the JSON-RPC id must be a string, a number or null".into()),
        );
    }
    if request.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return rpc_error(
            &id,
            &A2aError::InvalidRequest("set \"jsonrpc\": \"2.0\"".into()),
        );
    }
    let Some(method) = request
        .get("method")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return rpc_error(
            &id,
            &A2aError::InvalidRequest("the request has no method (a string)".into()),
        );
    };
    let cx = match context(&headers, &tenant) {
        Ok(cx) => cx,
        Err(error) => return rpc_error(&id, &error),
    };
    let params_json = request.remove("params").unwrap_or(Value::Null);
    let outcome = dispatch(&edge, &cx, &method, params_json, &id).await;
    match outcome {
        Ok(response) => response,
        Err(error) => rpc_error(&id, &error),
    }
}

async fn dispatch(
    edge: &A2aEdge,
    cx: &RequestContext,
    method: &str,
    json: Value,
    id: &Value,
) -> Result<Response, A2aError> {
    // A tenant in params (gRPC-style) also scopes the request, unless the path did.
    let mut cx = cx.clone();
    if cx.tenant.is_empty()
        && let Some(tenant) = json.get("tenant").and_then(Value::as_str)
    {
        cx.tenant = tenant.to_string();
    }
    let cx = &cx;
    Ok(match method {
        "SendMessage" => rpc_result(id, &edge.send_message(cx, params(method, json)?).await?),
        "SendStreamingMessage" => sse(
            id.clone(),
            edge.send_streaming_message(cx, params(method, json)?)
                .await?,
        ),
        "GetTask" => rpc_result(id, &edge.get_task(cx, params(method, json)?).await?),
        "ListTasks" => rpc_result(id, &edge.list_tasks(cx, params(method, json)?).await?),
        "CancelTask" => rpc_result(id, &edge.cancel_task(cx, params(method, json)?).await?),
        "SubscribeToTask" => sse(id.clone(), edge.subscribe(cx, params(method, json)?).await?),
        "GetExtendedAgentCard" => {
            let service = cx.tenant.clone();
            rpc_result(id, &edge.card(cx, Some(service.as_str())).await?)
        }
        "CreateTaskPushNotificationConfig" => rpc_result(
            id,
            &edge.create_push_config(cx, params(method, json)?).await?,
        ),
        "GetTaskPushNotificationConfig" => {
            rpc_result(id, &edge.get_push_config(cx, params(method, json)?).await?)
        }
        "ListTaskPushNotificationConfigs" => rpc_result(
            id,
            &edge.list_push_configs(cx, params(method, json)?).await?,
        ),
        "DeleteTaskPushNotificationConfig" => {
            edge.delete_push_config(cx, params(method, json)?).await?;
            rpc_result(id, &Value::Null)
        }
        other => {
            return Err(A2aError::MethodNotFound(reach_rpc::errors::cut(other, 64)));
        }
    })
}

/// The event's sequence number (its `metadata["reach.sequence"]`), for the SSE `id:`.
fn sequence_of(event: &StreamResponse) -> Option<u64> {
    let metadata = match event.payload.as_ref()? {
        // A snapshot reflects events up to its sequence, but replayed events older than it
        // may follow (a resume): an `id:` on it would move an EventSource's last id past
        // events it has not received yet.
        stream_response::Payload::Task(_) => None,
        stream_response::Payload::StatusUpdate(update) => update.metadata.as_ref(),
        stream_response::Payload::ArtifactUpdate(update) => update.metadata.as_ref(),
        stream_response::Payload::Message(_) => None,
    }?;
    match metadata.fields.get(SEQUENCE_KEY)?.kind.as_ref()? {
        pbjson_types::value::Kind::NumberValue(n) => Some(*n as u64),
        _ => None,
    }
}

fn sse(id: Value, events: EventStream) -> Response {
    let stream = events.map(move |item| {
        let (body, sequence) = match item {
            Ok(event) => {
                let sequence = sequence_of(&event);
                let result = serde_json::to_value(&event).unwrap_or(Value::Null);
                (
                    json!({"jsonrpc": "2.0", "id": id, "result": result}),
                    sequence,
                )
            }
            Err(error) => (
                json!({"jsonrpc": "2.0", "id": id, "error": error.to_json_rpc()}),
                None,
            ),
        };
        let event = Event::default().data(body.to_string());
        Ok::<_, Infallible>(match sequence {
            Some(sequence) => event.id(sequence.to_string()),
            None => event,
        })
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}
