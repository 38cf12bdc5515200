//! `reach demo`: the main job on the embedded default. Starts registry, router and the
//! example fleet in this process, sends every complaint of the CSV through the mesh via the
//! ingest agent, prints a per-complaint table and a summary, and stops everything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use reach_agents::fleet::{Fleet, FleetOptions};
use reach_agents::ingest::{INGEST_CAPABILITY, IngestOutcome, IngestReply};
use reach_proto::v1::Payload;
use reach_sdk::{CallOptions, MeshClient};
use serde::Serialize;
use tokio::net::TcpListener;

use crate::config::ReachConfig;
use crate::control_plane::{ControlPlane, Services};

/// The CSV the demo reads when `--input` is not given, relative to the repository root.
pub const DEFAULT_INPUT: &str = "examples/data/cfpb-complaints-sample.csv";

/// What `reach demo` was asked to do.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// The complaints CSV.
    pub input: PathBuf,
    /// How many complaints are in flight at once.
    pub concurrency: usize,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// The demo's summary, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// Complaints read.
    pub total: usize,
    /// Complaints that came back routed or marked for review.
    pub succeeded: usize,
    /// Complaints whose triage failed.
    pub failed: usize,
    /// Complaints marked for human review.
    pub human_review: usize,
    /// Share of complaints whose classified category matches the category of their CSV
    /// `Issue` (mapping: `reach_agents::classifier::category_for_issue`), over all complaints.
    pub accuracy: f64,
    /// End-to-end triage latency per complaint, as the ingest agent measured it.
    pub latency_ms: Latency,
    /// Routed complaints per executor capability.
    pub by_capability: BTreeMap<String, usize>,
    /// Routed complaints per executor instance.
    pub by_instance: BTreeMap<String, usize>,
    /// One trace id per complaint, in file order.
    pub trace_ids: Vec<String>,
    /// Every complaint's outcome, in file order.
    pub complaints: Vec<IngestOutcome>,
}

/// Runs the demo and returns its report.
///
/// # Errors
/// When the input is unreadable or the mesh cannot start.
pub async fn run(options: &DemoOptions) -> anyhow::Result<DemoReport> {
    let input = absolute(&options.input)?;
    // Fail fast, with the file and line, before starting anything.
    let complaints = reach_agents::complaint::load_csv(&input)?;
    if complaints.is_empty() {
        bail!("{} holds no complaints", input.display());
    }

    let config = ReachConfig {
        listen: "127.0.0.1:0".into(),
        ..ReachConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the demo's gRPC port")?;
    let plane = ControlPlane::start(listener, &config, Services::ALL).await?;
    let endpoint = plane.endpoint();
    let fleet = Fleet::start(&endpoint, &endpoint, &FleetOptions::default()).await?;
    let expected = fleet.members.len();
    let router = plane
        .router()
        .expect("the demo runs a router")
        .table()
        .clone();
    tokio::time::timeout(Duration::from_secs(10), async {
        while router.instances().len() < expected {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .context("the example agents did not all become routable within 10 s")?;

    let mesh = MeshClient::connect(&endpoint, "demo.cli").await?;
    let request = serde_json::json!({"path": input.display().to_string(), "concurrency": options.concurrency});
    let reply = mesh
        .call(
            INGEST_CAPABILITY,
            Payload::json("complaint.ingest_request", &request),
            CallOptions {
                timeout: Some(Duration::from_secs(120)),
                ..CallOptions::default()
            },
        )
        .await
        .map_err(|s| anyhow::anyhow!("ingest failed: {:?}: {}", s.code(), s.message()))?;
    let reply: IngestReply = serde_json::from_value(
        reply
            .message
            .and_then(|m| m.payload)
            .and_then(|p| p.first_json())
            .context("the ingest reply had no data part")?,
    )?;

    fleet.drain().await;
    plane.shutdown().await?;
    Ok(summarize(reply.outcomes))
}

fn absolute(path: &Path) -> anyhow::Result<PathBuf> {
    if !path.exists() {
        bail!(
            "input {} does not exist; pass --input <csv> or run from the repository root (default {DEFAULT_INPUT})",
            path.display()
        );
    }
    Ok(std::fs::canonicalize(path)?)
}

/// Builds the report from the outcomes.
pub fn summarize(outcomes: Vec<IngestOutcome>) -> DemoReport {
    let total = outcomes.len();
    let failed = outcomes.iter().filter(|o| o.status == "failed").count();
    let human_review = outcomes
        .iter()
        .filter(|o| o.status == "human_review")
        .count();
    let correct = outcomes
        .iter()
        .filter(|o| o.category.is_some() && o.category == o.expected_category)
        .count();
    // Microseconds, from 1 µs to 1 h, 3 significant figures.
    let mut histogram = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
        .expect("static histogram bounds are valid");
    for o in &outcomes {
        histogram.saturating_record((o.latency_ms * 1e3) as u64);
    }
    let mut by_capability = BTreeMap::new();
    let mut by_instance = BTreeMap::new();
    for o in outcomes.iter().filter(|o| o.status == "routed") {
        if let Some(c) = &o.capability {
            *by_capability.entry(c.clone()).or_insert(0) += 1;
        }
        if let Some(i) = &o.executor_instance {
            *by_instance.entry(i.clone()).or_insert(0) += 1;
        }
    }
    DemoReport {
        total,
        succeeded: total - failed,
        failed,
        human_review,
        accuracy: if total == 0 {
            0.0
        } else {
            correct as f64 / total as f64
        },
        latency_ms: Latency {
            p50: histogram.value_at_quantile(0.5) as f64 / 1e3,
            p99: histogram.value_at_quantile(0.99) as f64 / 1e3,
        },
        by_capability,
        by_instance,
        trace_ids: outcomes.iter().map(|o| o.trace_id.clone()).collect(),
        complaints: outcomes,
    }
}

/// Renders the per-complaint table and the summary for a terminal.
pub fn render_text(report: &DemoReport) -> String {
    use comfy_table::{Table, presets::UTF8_BORDERS_ONLY};
    let mut table = Table::new();
    table.load_preset(UTF8_BORDERS_ONLY).set_header(vec![
        "complaint",
        "label",
        "classified",
        "conf",
        "outcome",
        "executor",
        "priority",
        "company",
        "max $",
        "ms",
    ]);
    for o in &report.complaints {
        let outcome = match o.status.as_str() {
            "routed" => "routed".to_string(),
            "human_review" => "HUMAN REVIEW".to_string(),
            _ => format!("FAILED: {}", o.error.clone().unwrap_or_default()),
        };
        table.add_row(vec![
            o.complaint_id.clone(),
            o.expected_category.clone().unwrap_or_else(|| "?".into()),
            o.category.clone().unwrap_or_default(),
            o.confidence.map(|c| format!("{c:.2}")).unwrap_or_default(),
            outcome,
            o.executor_instance.clone().unwrap_or_default(),
            o.priority.clone().unwrap_or_default(),
            o.company
                .as_deref()
                .map(|c| c.chars().take(24).collect())
                .unwrap_or_default(),
            o.max_amount_usd
                .map(|a| format!("{a:.0}"))
                .unwrap_or_default(),
            format!("{:.1}", o.latency_ms),
        ]);
    }
    let mut out = table.to_string();
    out.push_str(&format!(
        "\n\n{} complaints: {} succeeded ({} routed, {} for human review), {} failed\n",
        report.total,
        report.succeeded,
        report.succeeded - report.human_review,
        report.human_review,
        report.failed
    ));
    out.push_str(&format!(
        "accuracy against the CSV's Issue column: {:.1}%\nlatency: p50 {:.2} ms, p99 {:.2} ms\n",
        report.accuracy * 100.0,
        report.latency_ms.p50,
        report.latency_ms.p99
    ));
    out.push_str("by capability:");
    for (capability, n) in &report.by_capability {
        out.push_str(&format!(" {capability}={n}"));
    }
    out.push_str("\nby instance:  ");
    for (instance, n) in &report.by_instance {
        out.push_str(&format!(" {instance}={n}"));
    }
    out.push('\n');
    out
}
