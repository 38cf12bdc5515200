//! A complaint classifier that asks a chat model, through the agent kit's
//! [`ModelProvider`] ([`reach_agent::OpenAiProvider`] or [`reach_agent::ScriptedProvider`]).
//!
//! One request per complaint: a system prompt naming the categories, the narrative as the
//! user message, and one tool, `complaint.set_category` (function `complaint__set_category`),
//! whose arguments are [`SetCategory`] — `category` (an `enum` of [`Category`] names),
//! `confidence` (a number in 0..=1) and a short `reason` — with `tool_choice` forcing that
//! function. The model's argument text goes through [`Tool::call`]: lenient parsing
//! ([`reach_agent::arguments`]) and schema repair ([`reach_agent::repair`]), so
//! `"Servicing "` or `"SERVICING"` become `"servicing"` and are recorded as repairs.
//!
//! What the model cannot be trusted with becomes a [`Fallback`] (the caller then uses the
//! deterministic classifier): a model error after the provider's retries, the deadline, a
//! reply without the tool call, or arguments that cannot be repaired (a category outside the
//! enum, a confidence outside 0..=1, a missing field).

use std::sync::Arc;

use reach_agent::provider::{ChatMessage, ChatRequest, ModelError, ModelProvider, ToolChoice};
use reach_agent::repair::Repair;
use reach_agent::tool::{Tool, ToolContext};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::classifier::Category;

/// The tool's name (dotted capability form); its OpenAI function name is
/// `complaint__set_category`.
pub const SET_CATEGORY_TOOL: &str = "complaint.set_category";

/// The arguments of `complaint.set_category`: the model's classification of one complaint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetCategory {
    /// The complaint's category: one of servicing, repayment, credit_report, origination.
    #[schemars(schema_with = "category_schema")]
    pub category: Category,
    /// How sure you are, from 0 (a guess) to 1 (certain).
    #[schemars(range(min = 0.0, max = 1.0))]
    pub confidence: f64,
    /// Why, in one short sentence.
    pub reason: String,
}

/// `{"type": "string", "enum": [every category name]}`: the model sees the names, not
/// schemars' `oneOf` of documented constants.
fn category_schema(_generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let names: Vec<&str> = Category::ALL.iter().map(|c| c.name()).collect();
    schemars::json_schema!({
        "type": "string",
        "enum": names,
        "description": "The complaint's category.",
    })
}

/// What the model decided for one complaint, after repair.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelVerdict {
    /// The category.
    pub category: Category,
    /// The model's confidence, in 0..=1.
    pub confidence: f64,
    /// The model's reason (as written, at most 300 characters kept).
    pub reason: String,
    /// The repairs made to the model's arguments (empty when they were valid as written).
    pub repairs: Vec<Repair>,
}

/// Why the model's answer was not used (the caller falls back to the rules).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Fallback {
    /// The model call failed after the provider's retries (timeout, rate limit, 5xx, a
    /// response that is not a completion, a refusal).
    #[error("the model call failed: {0}")]
    Model(#[from] ModelError),
    /// The caller's deadline left no time for the model.
    #[error("the deadline passed before the model answered")]
    Deadline,
    /// The model answered without calling `complaint__set_category`.
    #[error("the model did not call {SET_CATEGORY_TOOL}")]
    NoToolCall,
    /// The tool-call arguments could not be read or repaired.
    #[error("the model's arguments could not be repaired: {0}")]
    InvalidArguments(String),
}

impl Fallback {
    /// A bounded label for metrics and span attributes: `model_timeout`,
    /// `model_rate_limited`, `model_unavailable`, `model_bad_response`, `model_refused`
    /// (from [`ModelError::error_type`]), `deadline`, `no_tool_call` or `invalid_arguments`.
    pub fn label(&self) -> String {
        match self {
            Fallback::Model(error) => error.error_type(),
            Fallback::Deadline => "deadline".into(),
            Fallback::NoToolCall => "no_tool_call".into(),
            Fallback::InvalidArguments(_) => "invalid_arguments".into(),
        }
    }
}

/// The model-backed classifier. Cheap to clone.
#[derive(Clone)]
pub struct ModelClassifier {
    provider: Arc<dyn ModelProvider>,
    tool: Tool,
}

impl std::fmt::Debug for ModelClassifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelClassifier")
            .field("provider", &self.provider.provider_name())
            .field("model", &self.provider.model())
            .finish_non_exhaustive()
    }
}

/// The most characters of the model's reason kept.
const MAX_REASON_CHARS: usize = 300;

impl ModelClassifier {
    /// A classifier asking `provider`.
    pub fn new(provider: Arc<dyn ModelProvider>) -> Self {
        let tool = Tool::from_fn::<SetCategory, SetCategory, _, _>(
            SET_CATEGORY_TOOL,
            "Records the category of the consumer complaint. Call it exactly once.",
            |args: SetCategory, _ctx: ToolContext| async move { Ok(args) },
        )
        .expect("complaint.set_category is a valid tool name and its schema compiles");
        Self { provider, tool }
    }

    /// The model requests ask for (`gen_ai.request.model`).
    pub fn model(&self) -> &str {
        self.provider.model()
    }

    /// The `complaint.set_category` tool (its schema and repair).
    pub fn tool(&self) -> &Tool {
        &self.tool
    }

    /// The chat request for `narrative`: the system prompt, the narrative, the one tool and
    /// `tool_choice` forcing it, temperature 0.
    pub fn request(&self, narrative: &str) -> ChatRequest {
        let categories: Vec<String> = Category::ALL
            .iter()
            .map(|c| format!("- {}: {}", c.name(), c.description()))
            .collect();
        let system = format!(
            "You triage consumer complaints about student loans. Read the complaint and call \
             {} once with its category, your confidence (0 to 1) and a one-sentence reason. \
             The categories:\n{}",
            self.tool.function_name(),
            categories.join("\n")
        );
        ChatRequest {
            messages: vec![ChatMessage::system(system), ChatMessage::user(narrative)],
            tools: vec![self.tool.spec()],
            tool_choice: ToolChoice::Function(self.tool.function_name().to_string()),
            temperature: Some(0.0),
            parallel_tool_calls: Some(false),
            ..ChatRequest::default()
        }
    }

    /// Asks the model to classify `narrative`, by `deadline` when given, holding one of
    /// `slots` during the call (so the instance's heartbeats report the model's load).
    ///
    /// # Errors
    /// A [`Fallback`] saying why the model's answer cannot be used.
    pub async fn classify(
        &self,
        narrative: &str,
        deadline: Option<Instant>,
        slots: &reach_sdk::ModelSlots,
    ) -> Result<ModelVerdict, Fallback> {
        let request = self.request(narrative);
        let call = async {
            let _slot = slots.acquire().await;
            reach_agent::gen_ai::observed_chat(self.provider.as_ref(), request, false).await
        };
        let response = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, call)
                .await
                .map_err(|_| Fallback::Deadline)??,
            None => call.await?,
        };
        let Some(call) = response
            .message
            .tool_calls
            .iter()
            .find(|c| c.name == self.tool.function_name() || c.name == SET_CATEGORY_TOOL)
        else {
            return Err(Fallback::NoToolCall);
        };
        let ctx = ToolContext {
            call_id: call.id.clone(),
            deadline,
            ..ToolContext::default()
        };
        let result = self.tool.call(&call.arguments, ctx).await;
        if let Some(error) = result.error {
            return Err(Fallback::InvalidArguments(error.message));
        }
        let args: SetCategory = result
            .data
            .ok_or_else(|| Fallback::InvalidArguments("the tool returned no data".into()))
            .and_then(|data| {
                serde_json::from_value(data).map_err(|e| Fallback::InvalidArguments(e.to_string()))
            })?;
        Ok(ModelVerdict {
            category: args.category,
            confidence: args.confidence,
            reason: args.reason.chars().take(MAX_REASON_CHARS).collect(),
            repairs: result.metadata.repairs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tool_offers_the_categories_as_an_enum_and_forces_itself() {
        let classifier = ModelClassifier::new(reach_agent::ScriptedProvider::new([]).shared());
        let request = classifier.request("late fee");
        assert_eq!(request.tools[0].name, "complaint__set_category");
        assert_eq!(
            request.tools[0].parameters["properties"]["category"]["enum"],
            serde_json::json!(["servicing", "repayment", "credit_report", "origination"])
        );
        assert_eq!(
            request.tool_choice,
            ToolChoice::Function("complaint__set_category".into())
        );
        let confidence = &request.tools[0].parameters["properties"]["confidence"];
        assert_eq!(
            (
                confidence["minimum"].as_f64(),
                confidence["maximum"].as_f64()
            ),
            (Some(0.0), Some(1.0))
        );
    }
}
