//! The coordinator: classifies a complaint and dispatches it to the capability of its
//! category, or marks it for human review when the classifier is unsure.
//!
//! The classifier is a [`ComplaintClassifier`]: the rules, or a model with the rules as its
//! fallback. Every output records which one decided (`"classifier": "model"|"rules"`, and
//! `model`, `reason`, `fallback`, `repairs` when set; see [`Provenance`]).

use std::time::Duration;

use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::{CallOptions, HandlerContext, MeshClient};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tonic::Status;

use crate::decision::{ComplaintClassifier, Decision, Provenance};
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
    /// Which classifier decided (`classifier`, and `model`, `reason`, `fallback`, `repairs`
    /// when set), flattened into the object.
    #[serde(flatten)]
    pub provenance: Provenance,
}

impl ClassifyOutput {
    /// The output for `decision`.
    pub fn of(decision: Decision) -> Self {
        let category = decision.classification.category;
        Self {
            category: category.name().to_string(),
            confidence: decision.classification.confidence,
            capability: category.capability().to_string(),
            provenance: decision.provenance,
        }
    }
}

/// What triage decided.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum TriageResult {
    /// Dispatched to an executor, which answered.
    Routed {
        /// The classification and which classifier made it.
        classification: Decision,
        /// The executor's suggestion.
        suggestion: Suggestion,
    },
    /// Confidence too low: a person must look.
    HumanReview {
        /// The classification and which classifier made it.
        classification: Decision,
        /// Why it needs a person.
        reason: String,
    },
}

/// `complaint.classify`: classify only. Replies with a [`ClassifyOutput`].
///
/// # Errors
/// INVALID_ARGUMENT for a malformed complaint (a model failure is not an error: the rules
/// decide).
pub async fn classify_handler(
    classifier: ComplaintClassifier,
    ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let input = read_input(&message)?;
    let decision = classifier
        .classify(&input.narrative, ctx.deadline, &ctx.model_slots)
        .await;
    Ok(Payload::json(
        crate::COMPLAINT_CLASSIFICATION,
        &serde_json::to_value(ClassifyOutput::of(decision))
            .map_err(|e| Status::internal(e.to_string()))?,
    ))
}

/// `complaint.classify` as a stream: one classification per complaint sent, in order, until
/// the caller half-closes (each a [`ClassifyOutput`] with the `complaint_id`). A malformed
/// complaint ends the stream with INVALID_ARGUMENT.
pub fn classify_stream(
    classifier: ComplaintClassifier,
    ctx: HandlerContext,
    first: ReachMessage,
    rest: reach_sdk::handler::InboundMessages,
) -> impl futures::Stream<Item = Result<Payload, Status>> + Send + 'static {
    use futures::StreamExt;
    futures::stream::once(async move { Ok(first) })
        .chain(rest)
        .then(move |message| {
            let (classifier, ctx) = (classifier.clone(), ctx.clone());
            async move {
                let message = message?;
                let input = read_input(&message)?;
                let decision = classifier
                    .classify(&input.narrative, ctx.deadline, &ctx.model_slots)
                    .await;
                let mut output = serde_json::to_value(ClassifyOutput::of(decision))
                    .map_err(|e| Status::internal(e.to_string()))?;
                output["complaint_id"] = input.complaint_id.into();
                Ok(Payload::json(crate::COMPLAINT_CLASSIFICATION, &output))
            }
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
    classifier: ComplaintClassifier,
    threshold: f64,
    ctx: HandlerContext,
    message: ReachMessage,
) -> Result<Payload, Status> {
    let input = read_input(&message)?;
    let classification = classifier
        .classify(&input.narrative, ctx.deadline, &ctx.model_slots)
        .await;
    let confidence = classification.classification.confidence;
    let category = classification.classification.category;
    let result = if confidence < threshold {
        TriageResult::HumanReview {
            reason: format!(
                "confidence {confidence:.2} is below the review threshold {threshold:.2}"
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
            reply = mesh.call(category.capability(), forwarded, options) => reply?,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classifier::{Category, Classification};
    use crate::decision::ClassifierKind;

    #[test]
    fn a_triage_result_carries_the_provenance_and_reads_back() {
        let result = TriageResult::HumanReview {
            classification: Decision {
                classification: Classification {
                    category: Category::Repayment,
                    confidence: 0.3,
                    scores: vec![(Category::Repayment, 0.3)],
                },
                provenance: Provenance {
                    classifier: ClassifierKind::Model,
                    model: Some("m".into()),
                    reason: Some("unsure".into()),
                    ..Provenance::default()
                },
            },
            reason: "low confidence".into(),
        };
        let value = serde_json::to_value(&result).unwrap();
        assert_eq!(value["status"], "human_review");
        assert_eq!(value["classification"]["category"], "repayment");
        assert_eq!(value["classification"]["classifier"], "model");
        assert_eq!(value["classification"]["model"], "m");
        let back: TriageResult = serde_json::from_value(value).unwrap();
        let TriageResult::HumanReview { classification, .. } = back else {
            panic!("the variant survives");
        };
        assert_eq!(classification.provenance.classifier, ClassifierKind::Model);
        assert_eq!(classification.classification.category, Category::Repayment);
    }
}
