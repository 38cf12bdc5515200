//! The coordinator: classifies a complaint and dispatches it to the capability of its
//! category, or marks it for human review when the classifier is unsure.

use std::time::Duration;

use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::{CallOptions, HandlerContext, MeshClient};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::Status;

use crate::classifier::{Classification, classify};
use crate::executor::{Suggestion, read_input};

/// Below this confidence the coordinator asks a person instead of dispatching.
pub const DEFAULT_REVIEW_THRESHOLD: f64 = 0.4;

/// The classification as the `complaint.classify` capability returns it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClassifyOutput {
    /// The category name (`credit_report`).
    pub category: String,
    /// The confidence in 0..=1.
    pub confidence: f64,
    /// The capability that handles the category.
    pub capability: String,
}

/// What triage decided.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TriageResult {
    /// Dispatched to an executor, which answered.
    Routed {
        /// The classification.
        classification: Classification,
        /// The executor's suggestion.
        suggestion: Suggestion,
    },
    /// Confidence too low: a person must look.
    HumanReview {
        /// The classification.
        classification: Classification,
        /// Why it needs a person.
        reason: String,
    },
}

/// `complaint.classify`: classify only.
pub async fn classify_handler(
    _ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let input = read_input(&message)?;
    let classification = classify(&input.narrative);
    let output = ClassifyOutput {
        category: classification.category.name().to_string(),
        confidence: classification.confidence,
        capability: classification.category.capability().to_string(),
    };
    Ok(Payload::json(
        crate::COMPLAINT_CLASSIFICATION,
        &serde_json::to_value(output).map_err(|e| Status::internal(e.to_string()))?,
    ))
}

/// `complaint.classify` as a stream: one classification per complaint sent, in order, until
/// the caller half-closes. A malformed complaint ends the stream with INVALID_ARGUMENT.
pub fn classify_stream(
    _ctx: HandlerContext,
    first: ReachMessage,
    rest: reach_sdk::handler::InboundMessages,
) -> impl futures::Stream<Item = Result<Payload, Status>> + Send + 'static {
    use futures::StreamExt;
    futures::stream::once(async move { Ok(first) })
        .chain(rest)
        .then(|message| async move {
            let message = message?;
            let input = read_input(&message)?;
            let classification = classify(&input.narrative);
            let output = serde_json::json!({
                "complaint_id": input.complaint_id,
                "category": classification.category.name(),
                "confidence": classification.confidence,
                "capability": classification.category.capability(),
            });
            Ok(Payload::json(crate::COMPLAINT_CLASSIFICATION, &output))
        })
        .scan(false, |failed, item: Result<Payload, Status>| {
            // Stop after the first error: it is the stream's final status.
            if *failed {
                return futures::future::ready(None);
            }
            *failed = item.is_err();
            futures::future::ready(Some(item))
        })
}

/// `complaint.triage`: classify, then dispatch through the mesh or mark for review.
pub async fn triage_handler(
    mesh: MeshClient,
    threshold: f64,
    ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let input = read_input(&message)?;
    let classification = classify(&input.narrative);
    let result = if classification.confidence < threshold {
        TriageResult::HumanReview {
            reason: format!(
                "confidence {:.2} is below the review threshold {threshold:.2}",
                classification.confidence
            ),
            classification,
        }
    } else {
        let timeout = ctx
            .deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
            .or(Some(Duration::from_secs(10)));
        let options = CallOptions {
            timeout,
            trace_id: Some(ctx.trace_id.clone()),
            task_id: Some(ctx.task_id.clone()),
            ..CallOptions::default()
        };
        let payload = message.payload.clone().unwrap_or_default();
        let forwarded = Payload::json(
            crate::COMPLAINT_SUBMITTED,
            &payload.first_json().unwrap_or_default(),
        );
        let reply = tokio::select! {
            _ = ctx.cancellation.cancelled() => return Err(Status::cancelled("triage cancelled by the caller")),
            reply = mesh.call(classification.category.capability(), forwarded, options) => reply?,
        };
        let suggestion: Suggestion = reply
            .message
            .and_then(|m| m.payload)
            .and_then(|p| p.first_json())
            .ok_or_else(|| Status::internal("the executor's reply had no data part"))
            .and_then(|v| {
                serde_json::from_value(v).map_err(|e| {
                    Status::internal(format!("the executor's reply is malformed: {e}"))
                })
            })?;
        TriageResult::Routed {
            classification,
            suggestion,
        }
    };
    Ok(Payload::json(
        crate::COMPLAINT_TRIAGE,
        &serde_json::to_value(result).map_err(|e| Status::internal(e.to_string()))?,
    ))
}
