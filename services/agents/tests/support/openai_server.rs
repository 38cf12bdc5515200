//! A fake OpenAI chat-completions server on 127.0.0.1:0 (axum): every request to
//! `POST /v1/chat/completions` is recorded and answered by a function of its body, so
//! answers can depend on the complaint (keywords in the narrative) and stay deterministic.
//! (The minimal parts of `sdk/rust/reach-agent/tests/support/openai_server.rs`.)

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

/// How the server answers a request body: an HTTP status and a JSON body.
pub type Answer = Arc<dyn Fn(&Value) -> (u16, Value) + Send + Sync>;

#[derive(Clone)]
struct Shared {
    answer: Answer,
    requests: Arc<Mutex<Vec<Value>>>,
}

/// The running server.
pub struct FakeOpenAi {
    /// The base URL (`http://127.0.0.1:PORT/v1`).
    pub url: String,
    requests: Arc<Mutex<Vec<Value>>>,
}

impl FakeOpenAi {
    /// Starts a server answering every request with `answer`.
    pub async fn start(answer: impl Fn(&Value) -> (u16, Value) + Send + Sync + 'static) -> Self {
        let shared = Shared {
            answer: Arc::new(answer),
            requests: Arc::default(),
        };
        let requests = shared.requests.clone();
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(handle))
            .with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self { url, requests }
    }

    /// The request bodies received, in order.
    pub fn requests(&self) -> Vec<Value> {
        self.requests.lock().unwrap().clone()
    }
}

async fn handle(State(shared): State<Shared>, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    shared.requests.lock().unwrap().push(body.clone());
    let (status, reply) = (shared.answer)(&body);
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(reply.to_string()))
        .unwrap()
}

/// The user message (the narrative) of a request body.
pub fn narrative(body: &Value) -> String {
    body["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// A completion calling `name` with `arguments` (text, as a model writes it).
pub fn tool_call_completion(name: &str, arguments: &str) -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "fake-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
        ]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 20, "total_tokens": 140}
    })
}

/// A completion with text only (no tool call).
pub fn text_completion(text: &str) -> Value {
    json!({
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "model": "fake-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 5, "total_tokens": 125}
    })
}

/// An OpenAI error body.
pub fn error_body(message: &str) -> Value {
    json!({"error": {"message": message, "type": "server_error"}})
}
