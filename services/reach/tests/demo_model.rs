//! `reach demo` with the coordinator's classifier pointed at a local server speaking the
//! OpenAI chat-completions wire format: the model's categories (answered by keyword in the
//! narrative, some in the wrong case and padded) decide the complaints, an invalid category
//! falls back to the rules, and the run exits 0.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use reach_agents::complaint::load_csv;
use serde_json::{Value, json};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The category the fake model writes for a narrative: `None` for the answer outside the
/// enum (`"fraud"`), else what the demo must report.
fn model_category(narrative: &str) -> (&'static str, Option<&'static str>) {
    let text = narrative.to_lowercase();
    if text.contains("identity theft") {
        ("fraud", None)
    } else if text.contains("credit report") {
        ("CREDIT_REPORT ", Some("credit_report"))
    } else if text.contains("forgive") {
        ("repayment", Some("repayment"))
    } else {
        ("Origination", Some("origination"))
    }
}

type Requests = Arc<Mutex<usize>>;

async fn complete(State(requests): State<Requests>, body: String) -> axum::Json<Value> {
    *requests.lock().unwrap() += 1;
    let body: Value = serde_json::from_str(&body).unwrap();
    let narrative = body["messages"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    let (category, _) = model_category(narrative);
    let arguments = json!({"category": category, "confidence": 0.95, "reason": "keyword"});
    axum::Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "fake-model-2026",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "complaint__set_category", "arguments": arguments.to_string()}}
        ]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 200, "completion_tokens": 20, "total_tokens": 220}
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_a_model_uses_its_categories_and_falls_back_per_complaint() {
    let requests = Requests::default();
    let app = axum::Router::new()
        .route("/v1/chat/completions", post(complete))
        .with_state(requests.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });

    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .current_dir(repo_root())
        .args([
            "demo",
            "--json",
            "--model-base-url",
            &url,
            "--model",
            "fake-model",
        ])
        .args(["--model-api-key-env", ""])
        .env("REACH_AGENTS__MODEL__MAX_RETRIES", "0")
        .output()
        .await
        .expect("reach demo runs");
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["total"], 87);
    assert_eq!(report["failed"], 0);

    let complaints = load_csv(&repo_root().join("examples/data/cfpb-complaints-sample.csv"))
        .expect("the sample loads");
    let outcomes = report["complaints"].as_array().unwrap();
    assert_eq!(outcomes.len(), complaints.len());
    let (mut by_model, mut by_rules) = (0, 0);
    for (complaint, outcome) in complaints.iter().zip(outcomes) {
        assert_eq!(outcome["complaint_id"], complaint.complaint_id.as_str());
        match model_category(&complaint.narrative).1 {
            Some(category) => {
                by_model += 1;
                assert_eq!(outcome["classifier"], "model", "{outcome}");
                assert_eq!(outcome["model"], "fake-model");
                assert_eq!(outcome["category"], category, "{outcome}");
                assert_eq!(outcome["confidence"], 0.95);
                assert_eq!(outcome["status"], "routed", "{outcome}");
            }
            None => {
                by_rules += 1;
                assert_eq!(outcome["classifier"], "rules", "{outcome}");
                assert_eq!(outcome["fallback"], "invalid_arguments", "{outcome}");
                assert_eq!(outcome["model"], "fake-model");
            }
        }
    }
    assert!(by_rules >= 1, "the sample has an identity-theft complaint");
    assert_eq!(
        report["by_classifier"],
        json!({"model": by_model, "rules": by_rules})
    );
    assert!(
        *requests.lock().unwrap() >= 87,
        "one model call per complaint"
    );
}

#[test]
fn a_base_url_without_its_key_variable_is_a_usage_error_naming_it() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .current_dir(repo_root())
        .args([
            "demo",
            "--model-base-url",
            "http://127.0.0.1:9/v1",
            "--model",
            "m",
        ])
        .args(["--model-api-key-env", "REACH_TEST_NO_SUCH_KEY"])
        .env_remove("REACH_TEST_NO_SUCH_KEY")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("REACH_TEST_NO_SUCH_KEY"), "{stderr}");
}
