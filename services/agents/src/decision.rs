//! Which classifier decides a complaint: the model when one is configured and its answer is
//! usable, the deterministic rules ([`crate::classifier::classify`]) otherwise — and the
//! record of that choice ([`Provenance`]) that the coordinator's outputs carry.
//!
//! A model that fails (see [`crate::model_classifier::Fallback`]) never fails the complaint:
//! the rules decide it, a warning is logged, and the decision says why
//! (`"fallback": "invalid_arguments"`, ...). Each decision is counted in
//! `reach_complaint_classifications_total{classifier="model"|"rules", fallback}` (`fallback`
//! is `none` when no model was asked or it answered), and recorded on a
//! `complaint.classify` span (`classifier`, `classifier.model`, `classifier.fallback`,
//! `classifier.repairs`).

use std::sync::Arc;

use reach_agent::repair::Repair;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tracing::Instrument;

use crate::classifier::{Classification, classify};
use crate::model_classifier::ModelClassifier;

/// The counter of classifications, by classifier and fallback reason.
pub const CLASSIFICATIONS_METRIC: &str = "reach_complaint_classifications_total";

/// Which classifier decided.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClassifierKind {
    /// The deterministic weighted-term rules.
    #[default]
    Rules,
    /// The model.
    Model,
}

impl ClassifierKind {
    /// `rules` or `model`.
    pub fn as_str(self) -> &'static str {
        match self {
            ClassifierKind::Rules => "rules",
            ClassifierKind::Model => "model",
        }
    }
}

/// How a classification was made; flattened into the coordinator's outputs as the fields
/// `classifier` (always), `model`, `reason`, `fallback` and `repairs` (each only when set).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Provenance {
    /// `model` or `rules`.
    #[serde(default)]
    pub classifier: ClassifierKind,
    /// The configured model (`gen_ai.request.model`), whenever one was asked, also when the
    /// rules decided after it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The model's one-sentence reason (model decisions only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Why the rules decided although a model is configured (a
    /// [`crate::model_classifier::Fallback::label`]: `invalid_arguments`, `model_timeout`,
    /// ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// Repairs made to the model's arguments (`{pointer, kind, from, to}`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repairs: Vec<Repair>,
}

/// A classification and how it was made. Serialises as the classification's fields
/// (`category`, `confidence`, `scores`) followed by the [`Provenance`] fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// The classification. When the model decided, `scores` holds only its category with its
    /// confidence (a model gives no per-category scores).
    #[serde(flatten)]
    pub classification: Classification,
    /// How it was made.
    #[serde(flatten)]
    pub provenance: Provenance,
}

/// The coordinator's classifier: the rules, optionally preceded by a model. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ComplaintClassifier {
    model: Option<Arc<ModelClassifier>>,
}

impl ComplaintClassifier {
    /// The deterministic rules only (no model configured).
    pub fn rules() -> Self {
        Self::default()
    }

    /// The model first, the rules when it fails.
    pub fn with_model(model: ModelClassifier) -> Self {
        Self {
            model: Some(Arc::new(model)),
        }
    }

    /// The configured model's name, when there is one.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref().map(ModelClassifier::model)
    }

    /// Classifies `narrative`: asks the model (by `deadline`, holding one of `slots`) when
    /// one is configured, and uses the rules when there is none or its answer is unusable.
    /// Never fails.
    pub async fn classify(
        &self,
        narrative: &str,
        deadline: Option<Instant>,
        slots: &reach_sdk::ModelSlots,
    ) -> Decision {
        let span = tracing::info_span!(
            "complaint.classify",
            classifier = tracing::field::Empty,
            classifier.model = tracing::field::Empty,
            classifier.fallback = tracing::field::Empty,
            classifier.repairs = tracing::field::Empty,
        );
        let decision = match &self.model {
            None => rules(narrative, Provenance::default()),
            Some(model) => {
                span.record("classifier.model", model.model());
                // Leave the rules (and the reply) a tenth of the time left.
                let deadline = deadline.map(|d| {
                    let now = Instant::now();
                    now + d.saturating_duration_since(now).mul_f64(0.9)
                });
                let answer = model
                    .classify(narrative, deadline, slots)
                    .instrument(span.clone())
                    .await;
                match answer {
                    Ok(verdict) => Decision {
                        classification: Classification {
                            category: verdict.category,
                            confidence: verdict.confidence,
                            scores: vec![(verdict.category, verdict.confidence)],
                        },
                        provenance: Provenance {
                            classifier: ClassifierKind::Model,
                            model: Some(model.model().to_string()),
                            reason: Some(verdict.reason),
                            fallback: None,
                            repairs: verdict.repairs,
                        },
                    },
                    Err(fallback) => {
                        let label = fallback.label();
                        tracing::warn!(
                            parent: &span,
                            model = %model.model(),
                            fallback = %label,
                            error = %fallback,
                            "the model's classification is unusable; the rules decide"
                        );
                        rules(
                            narrative,
                            Provenance {
                                model: Some(model.model().to_string()),
                                fallback: Some(label),
                                ..Provenance::default()
                            },
                        )
                    }
                }
            }
        };
        let provenance = &decision.provenance;
        span.record("classifier", provenance.classifier.as_str());
        span.record("classifier.repairs", provenance.repairs.len());
        if let Some(fallback) = &provenance.fallback {
            span.record("classifier.fallback", fallback.as_str());
        }
        metrics::counter!(
            CLASSIFICATIONS_METRIC,
            "classifier" => provenance.classifier.as_str(),
            "fallback" => provenance.fallback.clone().unwrap_or_else(|| "none".into())
        )
        .increment(1);
        decision
    }
}

fn rules(narrative: &str, provenance: Provenance) -> Decision {
    Decision {
        classification: classify(narrative),
        provenance,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rules_decision_keeps_the_classification_shape_and_adds_the_classifier() {
        let decision = rules("late fee on my autopay", Provenance::default());
        let value = serde_json::to_value(&decision).unwrap();
        assert_eq!(value["category"], "servicing");
        assert_eq!(value["classifier"], "rules");
        assert!(value["scores"].is_array());
        assert!(value.get("model").is_none() && value.get("fallback").is_none());
        let back: Decision = serde_json::from_value(value).unwrap();
        assert_eq!(back, decision);
    }
}
