//! A scripted OpenAI chat-completions server on 127.0.0.1:0 (axum): each request to
//! `POST /v1/chat/completions` takes the next [`Reply`] and is recorded.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt;
use serde_json::{Value, json};

/// What the server answers to one request.
pub enum Reply {
    /// A JSON body with a status.
    Json(u16, Value),
    /// A status with headers and a JSON body.
    WithHeaders(u16, Vec<(&'static str, String)>, Value),
    /// An SSE stream of these `data:` payloads (then `[DONE]`), written `chunk` bytes at a
    /// time so events are split across reads.
    Sse(Vec<Value>, usize),
    /// Never answers.
    Hang,
}

#[derive(Clone, Default)]
struct Shared {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    requests: Arc<Mutex<Vec<(HeaderMap, Value)>>>,
}

/// The running server.
pub struct FakeOpenAi {
    /// The base URL (`http://127.0.0.1:PORT/v1`).
    pub url: String,
    shared: Shared,
}

impl FakeOpenAi {
    /// Starts with `replies`, answered in order (500 after the last).
    pub async fn start(replies: Vec<Reply>) -> Self {
        let shared = Shared::default();
        shared.replies.lock().unwrap().extend(replies);
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(handle))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, shared }
    }

    /// The request bodies received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.shared
            .requests
            .lock()
            .unwrap()
            .iter()
            .map(|(_, b)| b.clone())
            .collect()
    }

    /// The `authorization` header of request `i`.
    pub fn authorization(&self, i: usize) -> Option<String> {
        self.shared.requests.lock().unwrap()[i]
            .0
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

async fn handle(State(shared): State<Shared>, headers: HeaderMap, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    shared.requests.lock().unwrap().push((headers, body));
    let reply = shared.replies.lock().unwrap().pop_front();
    match reply {
        None => (StatusCode::INTERNAL_SERVER_ERROR, "script exhausted").into_response(),
        Some(Reply::Json(status, body)) => json_response(status, Vec::new(), body),
        Some(Reply::WithHeaders(status, headers, body)) => json_response(status, headers, body),
        Some(Reply::Hang) => {
            futures::future::pending::<()>().await;
            unreachable!()
        }
        Some(Reply::Sse(events, chunk)) => {
            let mut text = String::new();
            for event in events {
                text.push_str(&format!("data: {event}\n\n"));
            }
            text.push_str("data: [DONE]\n\n");
            let bytes = text.into_bytes();
            let chunks: Vec<Vec<u8>> = bytes.chunks(chunk.max(1)).map(<[u8]>::to_vec).collect();
            let stream = futures::stream::iter(chunks).then(|c| async move {
                tokio::task::yield_now().await;
                Ok::<_, Infallible>(c)
            });
            Response::builder()
                .status(200)
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .unwrap()
        }
    }
}

fn json_response(status: u16, headers: Vec<(&'static str, String)>, body: Value) -> Response {
    let mut builder = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    for (name, value) in headers {
        builder = builder.header(name, value);
    }
    builder.body(Body::from(body.to_string())).unwrap()
}

/// A completion with text.
pub fn text_completion(text: &str, input: u64, output: u64) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "test-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}
    })
}

/// A completion requesting one tool call.
pub fn tool_call_completion(
    id: &str,
    name: &str,
    arguments: &str,
    input: u64,
    output: u64,
) -> Value {
    json!({
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "model": "test-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}
        ]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output}
    })
}

/// An OpenAI error body.
pub fn error_body(message: &str) -> Value {
    json!({"error": {"message": message, "type": "invalid_request_error"}})
}
