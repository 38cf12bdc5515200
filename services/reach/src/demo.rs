//! `reach demo`: the main job on the embedded default. Starts registry, router, orchestrator
//! (SQLite in a temporary directory) and the example fleet in this process, runs every
//! complaint of the CSV as a task of `complaint-flow`, prints a per-complaint table and a
//! summary, and stops everything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use reach_agents::classifier::Category;
use reach_agents::complaint::Complaint;
use reach_agents::decision::ComplaintClassifier;
use reach_agents::fleet::{Fleet, FleetOptions};
use reach_agents::ingest::IngestOutcome;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::{
    ApplyFlowRequest, GetTaskRequest, StartTaskRequest, Task, TaskStatus, WatchTaskRequest,
};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::transport::Channel;

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
    /// The coordinator's classifier: the rules, or a model with the rules as its fallback.
    pub classifier: ComplaintClassifier,
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
    /// Complaints whose task waits for a person (the flow's `human_review` node).
    pub human_review: usize,
    /// The same count under the flow's name for it: tasks in WAITING_HUMAN.
    pub waiting_human: usize,
    /// Share of complaints whose classified category matches the category of their CSV
    /// `Issue` (mapping: `reach_agents::classifier::category_for_issue`), over all complaints.
    pub accuracy: f64,
    /// Per complaint, from StartTask until the task ended or waited for a person.
    pub latency_ms: Latency,
    /// Routed complaints per executor capability.
    pub by_capability: BTreeMap<String, usize>,
    /// Routed complaints per executor instance.
    pub by_instance: BTreeMap<String, usize>,
    /// Classified complaints per classifier that decided (`model`, `rules`).
    pub by_classifier: BTreeMap<String, usize>,
    /// One trace id per complaint, in file order.
    pub trace_ids: Vec<String>,
    /// Every complaint's outcome, in file order.
    pub complaints: Vec<IngestOutcome>,
}

/// The flow every complaint runs as (a copy of `examples/flows/complaint-flow.yaml`, embedded
/// so the demo runs from any directory).
pub const COMPLAINT_FLOW: &str = include_str!("../../../examples/flows/complaint-flow.yaml");

/// Runs the demo and returns its report: every complaint becomes a task of `complaint-flow`
/// (classify → the category's executor, or a human review node when unsure), run by the
/// orchestrator through the router.
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

    let data_dir = std::env::temp_dir().join(format!("reach-demo-{}", uuid_like()));
    std::fs::create_dir_all(&data_dir)?;
    let mut config = ReachConfig {
        listen: "127.0.0.1:0".into(),
        ..ReachConfig::default()
    };
    config.orchestrator.store_url =
        format!("sqlite://{}", data_dir.join("orchestrator.db").display());
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding the demo's gRPC port")?;
    let plane = ControlPlane::start(listener, &config, Services::ALL).await?;
    let endpoint = plane.endpoint();
    let fleet_options = FleetOptions {
        classifier: options.classifier.clone(),
        ..FleetOptions::default()
    };
    let fleet = Fleet::start(&endpoint, &endpoint, &fleet_options).await?;
    let expected = fleet.members.len();
    if !plane.wait_routable(expected, Duration::from_secs(10)).await {
        bail!("the example agents did not all become routable within 10 s");
    }

    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())?
        .connect()
        .await?;
    let orchestrator = OrchestratorServiceClient::new(channel);
    orchestrator
        .clone()
        .apply_flow(ApplyFlowRequest {
            yaml: COMPLAINT_FLOW.to_string(),
            source: "examples/flows/complaint-flow.yaml".into(),
        })
        .await
        .map_err(|s| anyhow::anyhow!("applying complaint-flow failed: {}", s.message()))?;

    let outcomes: Vec<IngestOutcome> = futures::stream::iter(complaints)
        .map(|complaint| run_task(orchestrator.clone(), complaint))
        .buffered(options.concurrency.max(1))
        .collect()
        .await;

    fleet.drain().await;
    plane.shutdown().await?;
    let _ = std::fs::remove_dir_all(&data_dir);
    Ok(summarize(outcomes))
}

fn uuid_like() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        reach_rpc::trace::TraceId::random()
    )
}

/// Starts one complaint's task and follows it until it ends or waits for a person.
async fn run_task(
    mut orchestrator: OrchestratorServiceClient<Channel>,
    complaint: Complaint,
) -> IngestOutcome {
    let started = Instant::now();
    let mut outcome = IngestOutcome::pending(&complaint);
    let task = match follow_task(&mut orchestrator, &complaint).await {
        Ok(task) => task,
        Err(status) => {
            outcome.error = Some(format!("{:?}: {}", status.code(), status.message()));
            outcome.latency_ms = started.elapsed().as_secs_f64() * 1e3;
            return outcome;
        }
    };
    outcome.latency_ms = started.elapsed().as_secs_f64() * 1e3;
    outcome.trace_id = task.trace_id.clone();
    let node_output = |id: &str| {
        task.nodes
            .iter()
            .rev()
            .find(|n| n.node_id == id)
            .and_then(|n| n.output.as_ref())
            .map(reach_proto::json::from_proto)
    };
    if let Some(classification) = node_output("classify") {
        outcome.category = classification["category"].as_str().map(str::to_string);
        outcome.confidence = classification["confidence"].as_f64();
        let text = |key: &str| classification[key].as_str().map(str::to_string);
        outcome.classifier = text("classifier");
        outcome.model = text("model");
        outcome.fallback = text("fallback");
    }
    match task.status() {
        TaskStatus::WaitingHuman => outcome.status = "human_review".into(),
        TaskStatus::Succeeded => {
            let executor = Category::ALL
                .into_iter()
                .find_map(|c| node_output(c.name()).map(|output| (c, output)));
            if let Some((category, suggestion)) = executor {
                outcome.status = "routed".into();
                outcome.capability = Some(category.capability().to_string());
                outcome.department = suggestion["department"].as_str().map(str::to_string);
                outcome.priority = suggestion["priority"].as_str().map(str::to_string);
                outcome.executor_instance = suggestion["handled_by"].as_str().map(str::to_string);
                outcome.company = suggestion["fields"]["company"].as_str().map(str::to_string);
                outcome.max_amount_usd = suggestion["fields"]["max_amount_usd"].as_f64();
            } else {
                outcome.error = Some("the task succeeded without an executor node".into());
            }
        }
        other => {
            outcome.error = Some(format!("task ended {other:?}: {}", task.error));
        }
    }
    outcome
}

/// Starts the task, then watches its events until it ends or waits for a person, and returns
/// the task as it is then.
async fn follow_task(
    orchestrator: &mut OrchestratorServiceClient<Channel>,
    complaint: &Complaint,
) -> Result<Task, tonic::Status> {
    let input = serde_json::json!({
        "complaint_id": complaint.complaint_id,
        "narrative": complaint.narrative,
        "company": complaint.company,
        "state": complaint.state,
    });
    let task_id = format!("complaint-{}", complaint.complaint_id);
    orchestrator
        .start_task(StartTaskRequest {
            flow_id: "complaint-flow".into(),
            flow_version: 0,
            input: Some(reach_proto::json::to_proto(&input)),
            task_id: task_id.clone(),
            ..Default::default()
        })
        .await?;
    let settled = |status: TaskStatus| {
        matches!(
            status,
            TaskStatus::WaitingHuman
                | TaskStatus::Succeeded
                | TaskStatus::Failed
                | TaskStatus::Partial
                | TaskStatus::Cancelled
        )
    };
    let mut events = orchestrator
        .watch_task(WatchTaskRequest {
            task_id: task_id.clone(),
            after_sequence: 0,
        })
        .await?
        .into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let event = tokio::time::timeout_at(deadline, events.message())
            .await
            .map_err(|_| {
                tonic::Status::deadline_exceeded("the task did not settle within 60 s")
            })??;
        match event.and_then(|e| e.event) {
            Some(event) if settled(event.status()) => break,
            Some(_) => {}
            None => break,
        }
    }
    let task = orchestrator
        .get_task(GetTaskRequest { task_id })
        .await?
        .into_inner()
        .task
        .ok_or_else(|| tonic::Status::internal("GetTask returned no task"))?;
    if settled(task.status()) {
        Ok(task)
    } else {
        Err(tonic::Status::internal(format!(
            "the task stopped watching while {:?}",
            task.status()
        )))
    }
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
    let mut by_classifier = BTreeMap::new();
    for o in &outcomes {
        if let Some(c) = &o.classifier {
            *by_classifier.entry(c.clone()).or_insert(0) += 1;
        }
    }
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
        waiting_human: human_review,
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
        by_classifier,
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
            o.confidence.map(confidence_text).unwrap_or_default(),
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
        "\n\n{} complaints as tasks of complaint-flow: {} routed to an executor, {} waiting for a person (confidence below {REVIEW_BELOW}), {} failed\n",
        report.total,
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
    out.push_str("\nclassified by:");
    for (classifier, n) in &report.by_classifier {
        out.push_str(&format!(" {classifier}={n}"));
    }
    out.push('\n');
    out
}

/// complaint-flow's review threshold: a classification whose confidence is below it goes to
/// the `human` node (`examples/flows/complaint-flow.yaml`, `confidence < 0.5`).
const REVIEW_BELOW: f64 = 0.5;

/// A confidence for the table: two decimals, or every digit where two would put it on the
/// other side of [`REVIEW_BELOW`] (0.4996 reads "0.50", yet goes to review).
fn confidence_text(confidence: f64) -> String {
    let short = format!("{confidence:.2}");
    let reads_above = short.parse::<f64>().is_ok_and(|c| c >= REVIEW_BELOW);
    if reads_above == (confidence >= REVIEW_BELOW) {
        short
    } else {
        confidence.to_string()
    }
}

#[cfg(test)]
mod confidence_tests {
    use super::*;

    #[test]
    fn a_confidence_never_reads_on_the_wrong_side_of_the_review_threshold() {
        assert_eq!(confidence_text(0.87), "0.87");
        assert_eq!(confidence_text(0.4996), "0.4996");
        assert_eq!(confidence_text(0.5), "0.50");
        let flow = include_str!("../../../examples/flows/complaint-flow.yaml");
        assert!(
            flow.contains(&format!("confidence < {REVIEW_BELOW}")),
            "the flow's threshold is {REVIEW_BELOW}"
        );
    }
}
