//! The ingest (gateway) role: turns each complaint into a message to `complaint.triage`,
//! one task and one fresh trace per complaint, and collects the outcomes.

use std::time::Duration;

use futures::StreamExt;
use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::{CallOptions, HandlerContext, MeshClient};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::Status;

use crate::classifier::category_for_issue;
use crate::complaint::{Complaint, parse_csv};
use crate::coordinator::TriageResult;
use crate::decision::Decision;

/// The capability that triages one complaint.
pub const TRIAGE_CAPABILITY: &str = "complaint.triage";
/// The capability of the ingest agent: triage every complaint of a CSV file.
pub const INGEST_CAPABILITY: &str = "complaint.ingest";

/// How one complaint fared.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IngestOutcome {
    /// The complaint id.
    pub complaint_id: String,
    /// The consumer's `Issue` (the label).
    pub issue: String,
    /// The category the label maps to.
    pub expected_category: Option<String>,
    /// `routed`, `human_review` or `failed`.
    pub status: String,
    /// The classified category (absent when failed).
    pub category: Option<String>,
    /// The classifier's confidence.
    pub confidence: Option<f64>,
    /// Which classifier decided: `model` or `rules` (absent when failed).
    pub classifier: Option<String>,
    /// The model asked, when one is configured (also when the rules decided after it
    /// failed; then `fallback` says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Why the rules decided although a model is configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// The capability the complaint was dispatched to (routed only).
    pub capability: Option<String>,
    /// The department suggested (routed only).
    pub department: Option<String>,
    /// The priority suggested (routed only).
    pub priority: Option<String>,
    /// The executor instance that handled it (routed only).
    pub executor_instance: Option<String>,
    /// The company and the largest amount found, for display.
    pub company: Option<String>,
    /// The largest dollar amount in the narrative.
    pub max_amount_usd: Option<f64>,
    /// The error, when failed.
    pub error: Option<String>,
    /// End-to-end latency of the triage call, in milliseconds.
    pub latency_ms: f64,
    /// The trace id of the complaint's task.
    pub trace_id: String,
}

impl IngestOutcome {
    /// A `failed` outcome for `complaint` with nothing filled in yet; callers fill in what
    /// they learn.
    pub fn pending(complaint: &Complaint) -> Self {
        Self {
            expected_category: category_for_issue(&complaint.issue).map(|c| c.name().to_string()),
            complaint_id: complaint.complaint_id.clone(),
            issue: complaint.issue.clone(),
            status: "failed".into(),
            category: None,
            confidence: None,
            classifier: None,
            model: None,
            fallback: None,
            capability: None,
            department: None,
            priority: None,
            executor_instance: None,
            company: None,
            max_amount_usd: None,
            error: None,
            latency_ms: 0.0,
            trace_id: String::new(),
        }
    }

    /// Fills in the category, confidence and classifier of `decision`.
    pub fn record(&mut self, decision: &Decision) {
        self.category = Some(decision.classification.category.name().into());
        self.confidence = Some(decision.classification.confidence);
        self.classifier = Some(decision.provenance.classifier.as_str().into());
        self.model = decision.provenance.model.clone();
        self.fallback = decision.provenance.fallback.clone();
    }
}

/// The ingest agent's request: the CSV content itself (the agent reads no files on a
/// caller's behalf).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IngestRequest {
    /// The CSV text, CFPB export columns with a header row.
    pub csv: String,
    /// How many complaints are in flight at once (default 16, at most 64).
    #[serde(default)]
    pub concurrency: Option<usize>,
}

/// The ingest agent's reply.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IngestReply {
    /// One outcome per complaint, in file order.
    pub outcomes: Vec<IngestOutcome>,
}

/// Triages every complaint through the mesh, `concurrency` at a time, each within `timeout`.
/// Outcomes come back in input order.
pub async fn triage_all(
    mesh: &MeshClient,
    complaints: Vec<Complaint>,
    concurrency: usize,
    timeout: Duration,
) -> Vec<IngestOutcome> {
    futures::stream::iter(complaints)
        .map(|complaint| triage_one(mesh, complaint, timeout))
        .buffered(concurrency.max(1))
        .collect()
        .await
}

async fn triage_one(mesh: &MeshClient, complaint: Complaint, timeout: Duration) -> IngestOutcome {
    let payload = Payload::json(
        crate::COMPLAINT_SUBMITTED,
        &serde_json::json!({
            "complaint_id": complaint.complaint_id,
            "narrative": complaint.narrative,
            "company": complaint.company,
            "state": complaint.state,
        }),
    );
    let options = CallOptions {
        timeout: Some(timeout),
        task_id: Some(format!("complaint-{}", complaint.complaint_id)),
        ..CallOptions::default()
    };
    let message = mesh.message_to_capability(TRIAGE_CAPABILITY, payload, &options);
    let trace_id = message
        .header
        .as_ref()
        .map(|h| h.trace_id.clone())
        .unwrap_or_default();
    let started = Instant::now();
    let reply = mesh.send(message, options.timeout).await;
    let latency_ms = started.elapsed().as_secs_f64() * 1e3;
    let mut outcome = IngestOutcome::pending(&complaint);
    outcome.latency_ms = latency_ms;
    outcome.trace_id = trace_id;
    let parsed = reply.and_then(|r| {
        r.message
            .and_then(|m| m.payload)
            .and_then(|p| p.first_json())
            .ok_or_else(|| Status::internal("the triage reply had no data part"))
            .and_then(|v| {
                serde_json::from_value::<TriageResult>(v)
                    .map_err(|e| Status::internal(format!("the triage reply is malformed: {e}")))
            })
    });
    match parsed {
        Ok(TriageResult::Routed {
            classification,
            suggestion,
        }) => {
            outcome.status = "routed".into();
            outcome.record(&classification);
            outcome.capability = Some(classification.classification.category.capability().into());
            outcome.department = Some(suggestion.department);
            outcome.priority = serde_json::to_value(suggestion.priority)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string));
            outcome.executor_instance = Some(suggestion.handled_by);
            outcome.company = suggestion.fields.company;
            outcome.max_amount_usd = suggestion.fields.max_amount_usd;
        }
        Ok(TriageResult::HumanReview { classification, .. }) => {
            outcome.status = "human_review".into();
            outcome.record(&classification);
        }
        Err(status) => {
            outcome.error = Some(format!("{:?}: {}", status.code(), status.message()));
        }
    }
    outcome
}

/// The largest CSV the ingest agent accepts, in bytes.
pub const MAX_CSV_BYTES: usize = 2 * 1024 * 1024;

/// `complaint.ingest`: parses the CSV in the request and triages every complaint.
pub async fn ingest_handler(
    mesh: MeshClient,
    _ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let request: IngestRequest = message
        .payload
        .as_ref()
        .and_then(Payload::first_json)
        .ok_or_else(|| {
            Status::invalid_argument("the payload needs a data part {\"csv\": \"<CSV text>\"}")
        })
        .and_then(|v| {
            serde_json::from_value(v).map_err(|e| {
                Status::invalid_argument(format!(
                    "malformed ingest request: {e}; send {{\"csv\": \"<CSV text>\"}}"
                ))
            })
        })?;
    if request.csv.len() > MAX_CSV_BYTES {
        return Err(Status::invalid_argument(format!(
            "the CSV is {} bytes; the limit is {MAX_CSV_BYTES} bytes: split it",
            request.csv.len()
        )));
    }
    let complaints = parse_csv(&request.csv, "request.csv")
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    let concurrency = request.concurrency.unwrap_or(16).clamp(1, 64);
    let outcomes = triage_all(&mesh, complaints, concurrency, Duration::from_secs(30)).await;
    Ok(Payload::json(
        "complaint.ingest_result",
        &serde_json::to_value(IngestReply { outcomes })
            .map_err(|e| Status::internal(e.to_string()))?,
    ))
}
