//! `reach demo report`: the report agent's Markdown matches counts computed here,
//! independently, from the same CSV; its data tools ran on another agent, through the router.

use std::collections::BTreeMap;
use std::path::Path;
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
        markdown.contains(&format!("{total} complaints from `cfpb-complaints-sample.csv`")),
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
        markdown.contains(&format!(
            "received {} to {}",
            days[0],
            days[days.len() - 1]
        )),
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
    assert!(stderr.contains("$REACH_TEST_UNSET_KEY"), "{stderr}");
}
