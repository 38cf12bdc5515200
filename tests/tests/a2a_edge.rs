//! The A2A edge against hostile and malformed input, over both bindings: every bad request
//! gets the A2A error the specification maps it to, with a message saying what to fix, and
//! nothing the edge reads is unbounded. (The a2a-sdk client suites in
//! `sdk/python/tests/test_a2a_edge.py` cover what a well-behaved client does.)

use std::time::Duration;

use reach_edge::a2a::proto::a2a_service_client::A2aServiceClient;
use reach_edge::a2a::proto::{
    GetTaskRequest, Message, Part, SendMessageRequest, SubscribeToTaskRequest, part,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tonic_types::StatusExt;

/// The largest JSON-RPC body the test edge accepts, in bytes.
const LIMIT: usize = 64 * 1024;

struct Edge {
    /// The JSON-RPC URL (`http://127.0.0.1:PORT/`).
    url: String,
    /// The gRPC endpoint.
    grpc: String,
    _plane: reach::control_plane::ControlPlane,
    _dir: tempfile::TempDir,
}

async fn edge() -> Edge {
    let dir = tempfile::tempdir().unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", http.local_addr().unwrap());
    let mut config = reach::config::ReachConfig::default();
    config.orchestrator.store_url = format!("sqlite://{}/o.db", dir.path().display());
    config.edge.public_url = url.clone();
    config.edge.max_message_bytes = LIMIT;
    let plane = reach::control_plane::ControlPlane::start(
        TcpListener::bind("127.0.0.1:0").await.unwrap(),
        &config,
        reach::control_plane::Services::ALL,
    )
    .await
    .unwrap();
    let routes = reach_edge::a2a::jsonrpc::routes(plane.a2a_edge().unwrap().clone());
    tokio::spawn(reach_rpc::server::serve_http(
        http,
        routes,
        std::future::pending(),
        Duration::from_secs(1),
        reach_rpc::ConnectionLimits::default(),
    ));
    Edge {
        url: format!("{url}/"),
        grpc: plane.endpoint(),
        _plane: plane,
        _dir: dir,
    }
}

/// POSTs `body` with `headers`; the HTTP status and the JSON answer.
async fn post(url: &str, body: impl Into<reqwest::Body>, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn rpc(method: &str, params: Value) -> String {
    json!({"jsonrpc": "2.0", "id": 7, "method": method, "params": params}).to_string()
}

/// A JSON object nested `depth` levels deep (`{"a": {"a": … {}}}`).
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!({}), |inner, _| json!({ "a": inner }))
}

/// The JSON-RPC error's code and ErrorInfo reason, and its message.
fn error_of(answer: &Value) -> (i64, String, String) {
    let error = &answer["error"];
    (
        error["code"].as_i64().unwrap_or_default(),
        error["data"][0]["reason"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        error["message"].as_str().unwrap_or_default().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_rpc_requests_get_the_json_rpc_error_for_them() {
    let edge = edge().await;
    let cases: Vec<(&str, String, i64, &str, &str)> = vec![
        (
            "not json",
            "{".into(),
            -32700,
            "INVALID_REQUEST",
            "not JSON",
        ),
        ("a batch", "[]".into(), -32600, "INVALID_REQUEST", "batches"),
        (
            "no jsonrpc",
            json!({"id": 1, "method": "GetTask"}).to_string(),
            -32600,
            "INVALID_REQUEST",
            "2.0",
        ),
        (
            "an object id",
            json!({"jsonrpc": "2.0", "id": {}, "method": "GetTask"}).to_string(),
            -32600,
            "INVALID_REQUEST",
            "id",
        ),
        (
            "an unknown method",
            rpc(&"Nope".repeat(100), json!({})),
            -32601,
            "METHOD_NOT_FOUND",
            "SendMessage",
        ),
        (
            "params of the wrong shape",
            rpc("GetTask", json!({"id": 5})),
            -32602,
            "INVALID_PARAMS",
            "GetTask",
        ),
        (
            "a message without parts",
            rpc(
                "SendMessage",
                json!({"message": {"messageId": "m", "role": "ROLE_USER"}}),
            ),
            -32602,
            "INVALID_PARAMS",
            "parts",
        ),
        (
            "a message naming no skill",
            rpc(
                "SendMessage",
                json!({"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}}),
            ),
            -32602,
            "INVALID_PARAMS",
            "skill",
        ),
        (
            "data nested deeper than the mesh carries",
            rpc(
                "SendMessage",
                json!({"message": {"messageId": "m", "role": "ROLE_USER",
                    "metadata": {"skill": "complaint.classify"},
                    "parts": [{"data": nested(40)}]}}),
            ),
            -32602,
            "INVALID_PARAMS",
            "levels deep",
        ),
        (
            "an id longer than echoed",
            json!({"jsonrpc": "2.0", "id": "i".repeat(10_000), "method": "GetTask"}).to_string(),
            -32600,
            "INVALID_REQUEST",
            "id",
        ),
        (
            "a tenant that is no service",
            rpc("GetTask", json!({"tenant": "nobody", "id": "x"})),
            -32602,
            "INVALID_PARAMS",
            "nobody",
        ),
        (
            "an unknown task",
            rpc("GetTask", json!({"id": "no-such-task"})),
            -32001,
            "TASK_NOT_FOUND",
            "no-such-task",
        ),
        (
            "a push config of an unknown task",
            rpc(
                "CreateTaskPushNotificationConfig",
                json!({"taskId": "t", "url": "http://127.0.0.1:9/"}),
            ),
            -32001,
            "TASK_NOT_FOUND",
            "\"t\"",
        ),
        (
            "a push config without a task",
            rpc(
                "CreateTaskPushNotificationConfig",
                json!({"url": "http://127.0.0.1:9/"}),
            ),
            -32602,
            "INVALID_PARAMS",
            "taskId",
        ),
    ];
    for (what, body, code, reason, hint) in cases {
        let (status, answer) = post(&edge.url, body, &[]).await;
        assert_eq!(status, 200, "{what}: {answer}");
        let (got_code, got_reason, message) = error_of(&answer);
        assert_eq!(
            (got_code, got_reason.as_str()),
            (code, reason),
            "{what}: {answer}"
        );
        assert!(
            message.contains(hint),
            "{what}: {message:?} should mention {hint:?}"
        );
        assert!(
            message.len() < 1024,
            "{what}: an unbounded message: {message}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_deeply_nested_bodies_are_refused_without_harm() {
    let edge = edge().await;
    // Over the body limit: refused before it is parsed, as a JSON-RPC error, closing the
    // connection (the rest of the body is never read).
    let response = reqwest::Client::new()
        .post(&edge.url)
        .header("content-type", "application/json")
        .body("x".repeat(LIMIT + 1))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 413);
    assert_eq!(
        response
            .headers()
            .get("connection")
            .map(|v| v.to_str().unwrap()),
        Some("close")
    );
    let answer: Value = response.json().await.unwrap();
    let (code, _, message) = error_of(&answer);
    assert_eq!(code, -32600, "{answer}");
    assert!(message.contains("max_message_bytes"), "{message}");
    // Nesting deeper than the JSON parser's recursion limit is a parse error, not a crash.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let (status, answer) = post(&edge.url, deep, &[]).await;
    assert_eq!((status, error_of(&answer).0), (200, -32700), "{answer}");
    // The edge still answers.
    let (_, answer) = post(&edge.url, rpc("GetTask", json!({"id": "x"})), &[]).await;
    assert_eq!(error_of(&answer).0, -32001, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_and_resume_points_are_checked_on_both_bindings() {
    let edge = edge().await;
    for (header, value, code, reason) in [
        ("a2a-version", "0.3", -32009, "VERSION_NOT_SUPPORTED"),
        ("a2a-version", "2.0", -32009, "VERSION_NOT_SUPPORTED"),
        ("a2a-version", "1.banana", -32009, "VERSION_NOT_SUPPORTED"),
        ("last-event-id", "yesterday", -32602, "INVALID_PARAMS"),
    ] {
        let (_, answer) = post(
            &edge.url,
            rpc("SubscribeToTask", json!({"id": "x"})),
            &[(header, value)],
        )
        .await;
        let (got_code, got_reason, _) = error_of(&answer);
        assert_eq!(
            (got_code, got_reason.as_str()),
            (code, reason),
            "{header}: {value}: {answer}"
        );
    }

    let mut client = A2aServiceClient::connect(edge.grpc.clone()).await.unwrap();
    let mut request = tonic::Request::new(GetTaskRequest {
        id: "x".into(),
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("a2a-version", "0.3".parse().unwrap());
    let refused = client.get_task(request).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let info = refused.get_error_details().error_info().cloned().unwrap();
    assert_eq!(
        (info.domain.as_str(), info.reason.as_str()),
        ("a2a-protocol.org", "VERSION_NOT_SUPPORTED")
    );

    let mut request = tonic::Request::new(SubscribeToTaskRequest {
        id: "x".into(),
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("last-event-id", "-1".parse().unwrap());
    let refused = client.subscribe_to_task(request).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    // A message with more parts than the limit is refused, naming it.
    let parts = vec![
        Part {
            content: Some(part::Content::Text("x".into())),
            ..Default::default()
        };
        reach_edge::a2a::edge::MAX_MESSAGE_PARTS + 1
    ];
    let refused = client
        .send_message(SendMessageRequest {
            message: Some(Message {
                message_id: "m".into(),
                role: 1,
                parts,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(
        refused.message().contains("over the limit"),
        "{}",
        refused.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_card_for_a_service_that_is_not_there_is_not_found() {
    let edge = edge().await;
    let base = edge.url.trim_end_matches('/');
    let response = reqwest::get(format!("{base}/agents/nobody/.well-known/agent-card.json"))
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 404);
    let card: Value = reqwest::get(format!("{base}/.well-known/agent-card.json"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(card["name"], "Reach mesh");
    assert_eq!(card["supportedInterfaces"][0]["url"], format!("{base}/"));
    // No instances and no flows yet: an agent with no skills, still a valid card.
    assert_eq!(card["skills"], json!(null));
}
