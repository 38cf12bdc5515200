//! A Python grpcio client, generated from proto/ by sdk/python/generate.sh, calls the router.

use std::process::Command;
use std::time::Duration;

use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::{AgentRuntime, HandlerContext};
use reach_tests::{Sandbox, repo_root, venv_python};

#[tokio::test]
async fn a_generated_python_client_calls_an_agent_through_the_router() {
    let python = venv_python();
    // Removed when dropped at the end of the test, passed or not.
    let generated_dir = tempfile::Builder::new()
        .prefix("reach-python-")
        .tempdir()
        .unwrap();
    let generated = generated_dir.path();
    let status = Command::new(repo_root().join("sdk/python/generate.sh"))
        .arg(generated)
        .env("PYTHON", &python)
        .status()
        .expect("run generate.sh");
    assert!(status.success(), "generating the Python client failed");

    let sandbox = Sandbox::start().await;
    let agent = AgentRuntime::new(sandbox.agent_config("summer", "summer-1")).handle(
        "math.sum",
        "1.0.0",
        |_ctx: HandlerContext, message: ReachMessage| async move {
            let numbers = message
                .payload
                .unwrap_or_default()
                .first_json()
                .unwrap_or_default();
            let sum: f64 = numbers["numbers"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_f64())
                .sum();
            Ok(Payload::json(
                "math.sum_result",
                &serde_json::json!({"sum": sum}),
            ))
        },
    );
    let _agent = sandbox.start_agent(agent).await;
    let endpoint = sandbox.plane.addr().to_string();

    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(&python)
            .arg(repo_root().join("sdk/python/examples/call_router.py"))
            .args([
                "--endpoint",
                &endpoint,
                "--capability",
                "math.sum",
                "--json",
                r#"{"numbers": [1, 2, 3.5]}"#,
            ])
            .env("PYTHONPATH", generated)
            .output(),
    )
    .await
    .expect("python finished")
    .expect("python ran");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "python failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reply: serde_json::Value = serde_json::from_str(stdout.trim()).expect("json output");
    assert_eq!(reply["route"]["instance_id"], "summer-1");
    assert_eq!(reply["message"]["payload"]["parts"][0]["data"]["sum"], 6.5);
    let trace_id = reply["route"]["trace_id"].as_str().unwrap();
    assert_eq!(
        reply["message"]["header"]["trace_id"], trace_id,
        "the reply carries the assigned trace id"
    );

    // Errors come back as gRPC statuses Python can branch on.
    let output = tokio::process::Command::new(&python)
        .arg(repo_root().join("sdk/python/examples/call_router.py"))
        .args([
            "--endpoint",
            &endpoint,
            "--capability",
            "math.nothing",
            "--text",
            "x",
        ])
        .env("PYTHONPATH", generated)
        .output()
        .await
        .unwrap();
    let error: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(error["code"], "NOT_FOUND");
    sandbox.stop().await;
}
