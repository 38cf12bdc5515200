//! Observed model calls: one span per call with the OpenTelemetry GenAI semantic-convention
//! attributes, and Prometheus metrics by model.
//!
//! Span `chat {model}` (`tracing` name `gen_ai.chat`), attributes per the OpenTelemetry
//! *Semantic Conventions for GenAI client spans*: `gen_ai.operation.name` = `chat`,
//! `gen_ai.provider.name`, `gen_ai.request.model`, `gen_ai.response.model`,
//! `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`,
//! `gen_ai.response.finish_reasons` (a JSON array, e.g. `["tool_calls"]`), `error.type` on
//! failure, and `duration_ms` (the call's latency; the span's own timing says the same).
//!
//! Metrics (names in `reach_telemetry::metrics::names`): `reach_gen_ai_client_calls_total`,
//! `reach_gen_ai_client_errors_total{error_type}`,
//! `reach_gen_ai_client_token_usage_total{type=input|output}` and
//! `reach_gen_ai_client_operation_duration_seconds`, all labelled `model` (the request
//! model: bounded, unlike response model snapshots).

use reach_telemetry::metrics::names;
use tokio::time::Instant;
use tracing::Instrument;

use crate::provider::{ChatRequest, ChatResponse, ModelError, ModelProvider, collect_stream};

/// Calls `provider` (streaming when `stream`, the deltas assembled) inside a GenAI span and
/// records the metrics.
///
/// # Errors
/// The provider's [`ModelError`].
pub async fn observed_chat(
    provider: &dyn ModelProvider,
    request: ChatRequest,
    stream: bool,
) -> Result<ChatResponse, ModelError> {
    let model = provider.model().to_string();
    let span = tracing::info_span!(
        "gen_ai.chat",
        otel.name = %format!("chat {model}"),
        otel.kind = "client",
        gen_ai.operation.name = "chat",
        gen_ai.provider.name = %provider.provider_name(),
        gen_ai.request.model = %model,
        gen_ai.response.model = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        gen_ai.response.finish_reasons = tracing::field::Empty,
        error.type = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        duration_ms = tracing::field::Empty,
    );
    let started = Instant::now();
    let result = async {
        if stream {
            let deltas = provider.chat_stream(request).await?;
            collect_stream(deltas).await
        } else {
            provider.chat(request).await
        }
    }
    .instrument(span.clone())
    .await;
    let elapsed = started.elapsed();
    span.record("duration_ms", elapsed.as_secs_f64() * 1000.0);
    let labels = [("model", model.clone())];
    metrics::counter!(names::GEN_AI_CALLS, &labels).increment(1);
    metrics::histogram!(names::GEN_AI_OPERATION_DURATION, &labels).record(elapsed.as_secs_f64());
    match &result {
        Ok(response) => {
            span.record("gen_ai.response.model", response.model.as_str());
            span.record("gen_ai.usage.input_tokens", response.usage.input_tokens);
            span.record("gen_ai.usage.output_tokens", response.usage.output_tokens);
            span.record(
                "gen_ai.response.finish_reasons",
                format!("[\"{}\"]", response.finish_reason.as_str()),
            );
            metrics::counter!(
                names::GEN_AI_TOKEN_USAGE,
                "model" => model.clone(),
                "type" => "input"
            )
            .increment(response.usage.input_tokens);
            metrics::counter!(
                names::GEN_AI_TOKEN_USAGE,
                "model" => model,
                "type" => "output"
            )
            .increment(response.usage.output_tokens);
        }
        Err(error) => {
            span.record("error.type", error.error_type().as_str());
            span.record("otel.status_code", "ERROR");
            metrics::counter!(
                names::GEN_AI_ERRORS,
                "model" => model,
                "error_type" => error.error_type()
            )
            .increment(1);
            tracing::warn!(parent: &span, error = %error, "model call failed");
        }
    }
    result
}
