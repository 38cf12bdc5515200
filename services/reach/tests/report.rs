//! `reach demo report`: the report agent's Markdown matches counts computed here,
//! independently, from the same CSV; its data tools ran on another agent, through the router.

/// The OTLP receiver harness, shared with the other crates' trace tests.
#[path = "../../../sdk/rust/reach-telemetry/tests/support/otlp.rs"]
mod otlp;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const CSV: &str = "../../examples/data/cfpb-complaints-sample.csv";

/// Rows per value of `column`, and the total, read with the csv crate.
fn counts(column: &str) -> (usize, BTreeMap<String, u64>) {
    let mut reader = csv::Reader::from_path(CSV).unwrap();
    let index = reader
        .headers()
        .unwrap()
        .iter()
        .position(|h| h == column)
        .unwrap();
    let mut counts = BTreeMap::new();
    let mut total = 0;
    for record in reader.records() {
        let record = record.unwrap();
        let value = match record[index].trim() {
            "" => "(blank)".to_string(),
            v => v.to_string(),
        };
        *counts.entry(value).or_insert(0) += 1;
        total += 1;
    }
    (total, counts)
}

/// The `| key | value |` rows of the table under `## {heading}`.
fn table(markdown: &str, heading: &str) -> BTreeMap<String, u64> {
    let start = markdown
        .find(&format!("## {heading}\n"))
        .unwrap_or_else(|| panic!("no {heading} section in\n{markdown}"));
    markdown[start..]
        .lines()
        .skip(4)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split(" | ").map(str::trim).collect();
            (cells[0].replace("\\|", "|"), cells[1].parse().unwrap())
        })
        .collect()
}

#[test]
fn the_report_agent_writes_the_counts_of_the_csv() {
    let dir = tempfile::tempdir().unwrap();
    let output = dir.path().join("out/report.md");
    let run = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["demo", "report", "--json", "--input", CSV, "--output"])
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(
        Path::new(summary["report"].as_str().unwrap()),
        output.canonicalize().unwrap()
    );
    assert_eq!(summary["completed"], true);
    assert!(summary["input_tokens"].as_u64().unwrap() > 0);
    // The data tools are mesh tools (another agent, through the router); writing is local.
    let calls = summary["tool_calls"].as_array().unwrap();
    for call in calls {
        assert_eq!(call["status"], "ok", "{call}");
        let local = call["name"] == "report.write_report";
        assert_eq!(call["mesh"], !local, "{call}");
    }
    assert!(calls.iter().any(|c| c["name"] == "report.read_csv"));
    assert_eq!(
        calls
            .iter()
            .filter(|c| c["name"] == "report.aggregate")
            .count(),
        5
    );

    let markdown = std::fs::read_to_string(&output).unwrap();
    let (total, by_issue) = counts("Issue");
    assert_eq!(total, 87);
    assert!(
        markdown.contains(&format!(
            "{total} complaints from `cfpb-complaints-sample.csv`"
        )),
        "{markdown}"
    );
    assert_eq!(table(&markdown, "By issue"), by_issue);
    assert_eq!(table(&markdown, "By company"), counts("Company").1);
    assert_eq!(table(&markdown, "By state"), counts("State").1);
    // The date range: the earliest and latest `Date received`, as days.
    let mut reader = csv::Reader::from_path(CSV).unwrap();
    let mut days: Vec<String> = reader
        .records()
        .map(|r| r.unwrap()[1][..10].to_string())
        .collect();
    days.sort();
    assert!(
        markdown.contains(&format!("received {} to {}", days[0], days[days.len() - 1])),
        "{markdown}"
    );
}

#[test]
fn a_model_endpoint_without_its_key_is_refused_naming_the_variable() {
    let run = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args([
            "demo",
            "report",
            "--model-base-url",
            "http://127.0.0.1:9/v1",
            "--model",
            "m",
            "--model-api-key-env",
            "REACH_TEST_UNSET_KEY",
        ])
        .env_remove("REACH_TEST_UNSET_KEY")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("REACH_TEST_UNSET_KEY"), "{stderr}");
}

/// The model calls are spans with the OpenTelemetry GenAI attributes, in the report task's
/// trace, and what they say they spent is what the task record sums.
#[test]
fn token_usage_is_on_the_model_spans_and_summed_in_the_task_record() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let receiver = otlp::OtlpReceiver::start(&root, false);
    let dir = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["demo", "report", "--json", "--input", CSV, "--output"])
        .arg(dir.path().join("report.md"))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &receiver.endpoint)
        .env("OTEL_SERVICE_NAME", "reach-report")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let trace_id = summary["trace_id"].as_str().unwrap().to_string();
    let spans: Vec<serde_json::Value> = receiver
        .spans()
        .into_iter()
        .filter(|s| s["trace_id"] == trace_id)
        .collect();
    let chats: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| s["attributes"]["gen_ai.operation.name"] == "chat")
        .collect();
    assert_eq!(
        chats.len() as u64,
        summary["model_calls"].as_u64().unwrap(),
        "one chat span per model call in the task record"
    );
    let sum = |key: &str| -> u64 {
        chats
            .iter()
            .map(|s| {
                let v = &s["attributes"][key];
                v.as_u64()
                    .or_else(|| v.as_str().and_then(|t| t.parse().ok()))
                    .unwrap_or_else(|| panic!("{key} on {s:#}"))
            })
            .sum()
    };
    assert!(summary["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        sum("gen_ai.usage.input_tokens"),
        summary["input_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        sum("gen_ai.usage.output_tokens"),
        summary["output_tokens"].as_u64().unwrap()
    );
    for chat in &chats {
        assert_eq!(
            chat["attributes"]["gen_ai.request.model"], "scripted-analyst",
            "{chat:#}"
        );
    }
    // The mesh tools' calls reached the data agent inside the same trace.
    let names: HashSet<&str> = spans.iter().map(|s| s["name"].as_str().unwrap()).collect();
    for expected in [
        "orchestrator.task",
        "orchestrator.node",
        "router.call",
        "agent.handle",
    ] {
        assert!(names.contains(expected), "{expected} in {names:?}");
    }
    // Each tool call is an `execute_tool` span in the report agent, and a mesh tool's call
    // is one again in the data agent that served it: both in the task's trace.
    let tool_spans = |tool: &str| {
        spans
            .iter()
            .filter(|s| s["name"] == format!("execute_tool {tool}"))
            .count()
    };
    assert_eq!(tool_spans("report.write_report"), 1, "local: {names:?}");
    assert_eq!(
        tool_spans("report.read_csv"),
        2,
        "caller and server: {names:?}"
    );
    assert_eq!(
        tool_spans("report.aggregate"),
        10,
        "five, each twice: {names:?}"
    );
}
