//! A task's trace is one tree: its span (exported when it ends, with an id derived from the
//! task id) is the one root, and every node span hangs under it — checked with the real
//! Python OTLP receiver of reach-telemetry's tests (`<repo>/.venv/bin/python`).

mod common;
/// The OTLP receiver harness, shared with the other crates' trace tests.
#[path = "../../../sdk/rust/reach-telemetry/tests/support/otlp.rs"]
mod otlp;

use std::time::{Duration, Instant};

use common::{server, wait_for};
use otlp::OtlpReceiver;
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::{Value, json};

const TWO: &str = "id: two\nversion: 1\ninitial: first\nstates:\n  first: {type: task, capability: test.first, next: second}\n  second: {type: task, capability: test.second, next: done}\n  done: {type: succeed}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_node_task_is_one_trace_with_the_task_span_as_its_only_root() {
    let receiver = OtlpReceiver::start(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."),
        false,
    );
    let endpoint = receiver.endpoint.clone();
    let config = reach_telemetry::TelemetryConfig::from_vars(
        "reach-orchestrator-test",
        [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("REACH_LOG", "warn"),
        ],
    )
    .unwrap();
    let telemetry = reach_telemetry::init(&config).unwrap();

    let s = server(|_, _| {}).await;
    s.router.handle("test.first", |_| Ok(json!({"n": 1})));
    s.router.handle("test.second", |_| Ok(json!({"n": 2})));
    let mut c = OrchestratorServiceClient::connect(s.endpoint.clone())
        .await
        .unwrap();
    c.apply_flow(pb::ApplyFlowRequest {
        yaml: TWO.into(),
        source: "two.yaml".into(),
    })
    .await
    .unwrap();
    let task = c
        .start_task(pb::StartTaskRequest {
            flow_id: "two".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .task
        .unwrap();
    let done = wait_for(&s.endpoint, &task.task_id, pb::TaskStatus::Succeeded).await;
    // The envelope's trace id is the task's.
    let deliveries = s.router.deliveries();
    assert_eq!(deliveries.len(), 2);
    assert!(deliveries.iter().all(|d| d.trace_id == done.trace_id));

    telemetry.flush().await.unwrap();
    let start = Instant::now();
    let spans = loop {
        let spans: Vec<Value> = receiver
            .spans()
            .into_iter()
            .filter(|s| s["trace_id"] == done.trace_id.as_str())
            .collect();
        let names = |n: &str| spans.iter().filter(|s| s["name"] == n).count();
        if names("orchestrator.task") == 1 && names("orchestrator.node") == 2 {
            break spans;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "spans never arrived: {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = telemetry.flush().await;
    };
    let roots: Vec<&Value> = spans.iter().filter(|s| s["parent_span_id"] == "").collect();
    assert_eq!(roots.len(), 1, "{spans:#?}");
    assert_eq!(roots[0]["name"], "orchestrator.task");
    let task_span = hex(&reach_orchestrator::engine::task_span_id(&task.task_id));
    assert_eq!(roots[0]["span_id"], task_span.as_str());
    for node in spans.iter().filter(|s| s["name"] == "orchestrator.node") {
        assert_eq!(node["parent_span_id"], task_span.as_str(), "{node:#}");
    }
    // Every other span's parent is in the trace: one tree.
    let ids: Vec<&str> = spans.iter().filter_map(|s| s["span_id"].as_str()).collect();
    for span in &spans {
        let parent = span["parent_span_id"].as_str().unwrap();
        assert!(parent.is_empty() || ids.contains(&parent), "{span:#}");
    }
    let _ = telemetry.shutdown().await;
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
