//! Traces, logs and metrics of a real run: `reach demo` exporting to the Python OTLP
//! receiver (sdk/rust/reach-telemetry/tests/otlp_receiver.py).

/// The OTLP receiver harness, shared with the other crates' trace tests.
#[path = "../../../sdk/rust/reach-telemetry/tests/support/otlp.rs"]
mod otlp;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use otlp::OtlpReceiver;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn demo(envs: &[(&str, &str)]) -> (serde_json::Value, String, Duration) {
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["demo", "--json"])
        .current_dir(repo_root())
        .envs(envs.iter().copied())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    (
        serde_json::from_slice(&output.stdout).unwrap(),
        String::from_utf8_lossy(&output.stderr).to_string(),
        started.elapsed(),
    )
}

fn attr<'a>(span: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
    span["attributes"].get(key)
}

#[test]
fn one_complaint_task_is_one_trace_across_orchestrator_coordinator_and_executor() {
    let receiver = OtlpReceiver::start(&repo_root(), false);
    let (report, _, _) = demo(&[
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint),
        ("OTEL_SERVICE_NAME", "reach-e2e"),
    ]);
    let complaint = &report["complaints"][0];
    assert_eq!(
        complaint["status"], "routed",
        "the first complaint is routed to an executor"
    );
    let trace_id = complaint["trace_id"].as_str().unwrap().to_string();
    let task_id = format!("complaint-{}", complaint["complaint_id"].as_str().unwrap());

    // The demo flushed on exit; the receiver wrote every span.
    let spans: Vec<serde_json::Value> = receiver
        .spans()
        .into_iter()
        .filter(|s| s["trace_id"] == trace_id)
        .collect();
    let names: Vec<&str> = spans.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let count = |n: &str| names.iter().filter(|x| **x == n).count();
    assert_eq!(
        count("orchestrator.node"),
        2,
        "two task nodes call through the mesh: {names:?}"
    );
    assert_eq!(count("router.call"), 2, "two routed hops: {names:?}");
    assert_eq!(
        count("agent.handle"),
        2,
        "coordinator and executor handle it: {names:?}"
    );

    // One tree: the task's span (exported when the task ended) is the only root, and the
    // parent of both node spans; every other span's parent is in the trace.
    let ids: HashSet<&str> = spans
        .iter()
        .map(|s| s["span_id"].as_str().unwrap())
        .collect();
    let roots: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| s["parent_span_id"].as_str().is_none_or(|p| p.is_empty()))
        .collect();
    assert!(
        roots.len() == 1 && roots[0]["name"] == "orchestrator.task",
        "only the task's span is a root: {roots:#?}"
    );
    assert_eq!(attr(roots[0], "task_id").unwrap(), task_id.as_str());
    for node in spans.iter().filter(|s| s["name"] == "orchestrator.node") {
        assert_eq!(node["parent_span_id"], roots[0]["span_id"], "{node:#?}");
    }
    for span in &spans {
        if let Some(parent) = span["parent_span_id"].as_str().filter(|p| !p.is_empty()) {
            assert!(
                ids.contains(parent),
                "parent of {} is in the trace",
                span["name"]
            );
        }
    }

    // Attributes: task, capability, instance, message type, status.
    let handles: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| s["name"] == "agent.handle")
        .collect();
    let by_capability: HashMap<&str, &serde_json::Value> = handles
        .iter()
        .map(|s| (attr(s, "capability").unwrap().as_str().unwrap(), *s))
        .collect();
    let coordinator = by_capability["complaint.classify"];
    assert_eq!(attr(coordinator, "instance").unwrap(), "coordinator-1");
    let executor_capability = complaint["capability"].as_str().unwrap();
    let executor = by_capability[executor_capability];
    assert_eq!(
        attr(executor, "instance").unwrap(),
        &complaint["executor_instance"]
    );
    for span in spans
        .iter()
        .filter(|s| s["name"] == "agent.handle" || s["name"] == "router.call")
    {
        assert_eq!(
            attr(span, "task_id").unwrap(),
            task_id.as_str(),
            "{span:#?}"
        );
        assert_eq!(attr(span, "trace_id").unwrap(), trace_id.as_str());
        assert!(attr(span, "message.type").is_some());
        assert_eq!(
            attr(span, "rpc.grpc.status_code").and_then(|c| c.as_i64()),
            Some(0)
        );
    }
    assert!(spans.iter().all(|s| s["service.name"] == "reach-e2e"));
}

#[test]
fn a_black_holed_collector_slows_nothing_and_shutdown_is_bounded() {
    let receiver = OtlpReceiver::start(&repo_root(), true);
    let (report, _, elapsed) = demo(&[("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)]);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["total"], 87);
    // Export runs off the request path: the demo's own latency stays in its usual range (a
    // generous bound, not a benchmark), and exit waits at most the flush limit (5 s).
    assert!(
        report["latency_ms"]["p99"].as_f64().unwrap() < 2_000.0,
        "{}",
        report["latency_ms"]
    );
    assert!(
        elapsed < Duration::from_secs(30),
        "reach demo took {elapsed:?} to exit"
    );
}

#[test]
fn every_log_line_of_a_handled_message_carries_its_trace_and_task() {
    let (report, stderr, _) = demo(&[
        ("REACH_LOG", "warn,reach=info,reach_sdk=debug"),
        ("REACH_LOG_FORMAT", "json"),
    ]);
    let traces: HashSet<&str> = report["trace_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let handled: Vec<serde_json::Value> = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["message"] == "message handled")
        .collect();
    // 87 classifications + one executor message per routed complaint.
    let routed = report["by_capability"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap() as usize)
        .sum::<usize>();
    assert!(handled.len() >= 87 + routed, "{} lines", handled.len());
    let mut complaint_lines = 0;
    for line in &handled {
        let text = line.to_string();
        let trace = line["span"]["trace_id"]
            .as_str()
            .or(line["trace_id"].as_str());
        let trace = trace.unwrap_or_else(|| panic!("no trace_id in {text}"));
        assert!(
            line["span"]["task_id"].is_string() || line["task_id"].is_string(),
            "task_id in {text}"
        );
        if traces.contains(trace) {
            complaint_lines += 1;
        }
    }
    assert!(
        complaint_lines >= 87 + routed,
        "the lines belong to the complaints' traces"
    );
}
