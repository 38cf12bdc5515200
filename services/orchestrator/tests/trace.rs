//! A task's trace is one tree: its span (exported when it ends, with an id derived from the
//! task id) is the one root, and every node span hangs under it — checked with the real
//! Python OTLP receiver of reach-telemetry's tests (`<repo>/.venv/bin/python`).

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{server, wait_for};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use serde_json::{Value, json};

/// `tests/otlp_receiver.py` of reach-telemetry as a child process.
struct Receiver {
    child: Child,
    port: u16,
    out: PathBuf,
}

impl Receiver {
    fn start() -> Self {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let python = root.join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} is missing: run scripts/python-env.sh at the repository root",
            python.display()
        );
        let out = std::env::temp_dir().join(format!(
            "reach-orchestrator-trace-{}.jsonl",
            std::process::id()
        ));
        let mut child = Command::new(python)
            .arg(root.join("sdk/rust/reach-telemetry/tests/otlp_receiver.py"))
            .args(["--port", "0", "--out"])
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start otlp_receiver.py");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver printed {line:?}"));
        Self { child, port, out }
    }

    fn spans(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.out);
    }
}

const TWO: &str = "id: two\nversion: 1\ninitial: first\nstates:\n  first: {type: task, capability: test.first, next: second}\n  second: {type: task, capability: test.second, next: done}\n  done: {type: succeed}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_node_task_is_one_trace_with_the_task_span_as_its_only_root() {
    let receiver = Receiver::start();
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
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
