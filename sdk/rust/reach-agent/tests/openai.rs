//! `OpenAiProvider` against a local server speaking the OpenAI chat-completions wire format:
//! non-streaming, SSE streaming with tool-call deltas split across chunks, malformed tool
//! arguments repaired by the loop, retries on 429 (honouring `Retry-After`) and 500, no retry
//! on 400, and a timeout.

mod support;

use std::time::Duration;

use reach_agent::provider::{ChatMessage, ChatRequest, FinishReason, ModelError, ModelProvider};
use reach_agent::tool::{Tool, ToolContext, ToolRegistry};
use reach_agent::{Agent, ModelConfig, OpenAiProvider, RunContext, Stopped};
use reach_rpc::errors::reason_of;
use serde_json::{Value, json};
use support::openai_server::{
    FakeOpenAi, Reply, error_body, text_completion, tool_call_completion,
};
use tokio::time::Instant;

fn config(server: &FakeOpenAi) -> ModelConfig {
    let mut config = ModelConfig::new(&server.url, "test-model");
    config.api_key = "sk-test".into();
    config.initial_backoff = Duration::from_millis(10);
    config.max_retries = 2;
    config.timeout = Duration::from_secs(10);
    config
}

fn weather_tool() -> Tool {
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    struct Args {
        /// The city.
        city: String,
        /// Days ahead.
        days: u32,
    }
    Tool::from_fn::<Args, Value, _, _>(
        "weather.forecast",
        "The forecast for a city. Use it for future weather; not for the past.",
        |args: Args, _ctx: ToolContext| async move {
            Ok(json!({"city": args.city, "days": args.days, "sky": "clear"}))
        },
    )
    .unwrap()
}

fn request_with_tools() -> ChatRequest {
    ChatRequest {
        messages: vec![
            ChatMessage::system("be brief"),
            ChatMessage::user("weather?"),
        ],
        tools: ToolRegistry::new().with(weather_tool()).unwrap().specs(),
        ..ChatRequest::default()
    }
}

#[tokio::test]
async fn a_completion_is_parsed_and_the_request_speaks_the_wire_format() {
    let server = FakeOpenAi::start(vec![Reply::Json(200, text_completion("sunny", 12, 3))]).await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let response = provider.chat(request_with_tools()).await.unwrap();
    assert_eq!(response.message.text(), "sunny");
    assert_eq!(response.finish_reason, FinishReason::Stop);
    assert_eq!(
        (response.usage.input_tokens, response.usage.output_tokens),
        (12, 3)
    );
    assert_eq!(response.model, "test-model-2026");

    let body = &server.requests()[0];
    assert_eq!(body["model"], json!("test-model"));
    assert_eq!(
        body["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(body["tools"][0]["type"], json!("function"));
    assert_eq!(
        body["tools"][0]["function"]["name"],
        json!("weather__forecast")
    );
    assert_eq!(body["tool_choice"], json!("auto"));
    assert!(body.get("stream").is_none());
    assert_eq!(server.authorization(0).as_deref(), Some("Bearer sk-test"));
}

#[tokio::test]
async fn a_stream_assembles_tool_call_deltas_split_across_chunks() {
    let chunk = |delta: Value, finish: Value| {
        json!({"id": "c", "object": "chat.completion.chunk", "model": "test-model-2026",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let events = vec![
        chunk(json!({"role": "assistant", "content": null}), Value::Null),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                   "function": {"name": "weather__forecast", "arguments": "{\"ci"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Par"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                   "function": {"name": "weather__forecast", "arguments": "{\"city\": \"Oslo\", "}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "is\", \"days\": 2}"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "\"days\": 1}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        json!({"id": "c", "object": "chat.completion.chunk", "model": "test-model-2026", "choices": [],
               "usage": {"prompt_tokens": 40, "completion_tokens": 22, "total_tokens": 62}}),
    ];
    // 7 bytes at a time: every event is split across reads.
    let server = FakeOpenAi::start(vec![Reply::Sse(events, 7)]).await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let deltas = provider.chat_stream(request_with_tools()).await.unwrap();
    let response = reach_agent::provider::collect_stream(deltas).await.unwrap();
    let calls = &response.message.tool_calls;
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].id, "call_a");
    assert_eq!(calls[0].name, "weather__forecast");
    assert_eq!(calls[0].arguments, "{\"city\": \"Paris\", \"days\": 2}");
    assert_eq!(calls[1].arguments, "{\"city\": \"Oslo\", \"days\": 1}");
    assert_eq!(response.finish_reason, FinishReason::ToolCalls);
    assert_eq!(
        (response.usage.input_tokens, response.usage.output_tokens),
        (40, 22)
    );
    let body = &server.requests()[0];
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["stream_options"], json!({"include_usage": true}));
}

#[tokio::test]
async fn the_loop_repairs_malformed_arguments_and_counts_tokens() {
    let metrics = reach_telemetry::metrics::install().unwrap();
    let server = FakeOpenAi::start(vec![
        Reply::Json(
            200,
            tool_call_completion(
                "call_1",
                "weather__forecast",
                "{'city': 'Paris', days: '3',}",
                30,
                8,
            ),
        ),
        Reply::Json(200, text_completion("Clear skies in Paris.", 50, 6)),
    ])
    .await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let agent = Agent::new(
        std::sync::Arc::new(provider),
        ToolRegistry::new().with(weather_tool()).unwrap(),
    )
    .system("You forecast weather.");
    let outcome = agent
        .run(RunContext::task("task-1"), "Paris in 3 days?")
        .await
        .unwrap();
    assert_eq!(outcome.stopped, Stopped::Final);
    assert_eq!(outcome.answer, "Clear skies in Paris.");
    assert_eq!(outcome.turns, 2);
    assert_eq!(
        (
            outcome.usage.input_tokens,
            outcome.usage.output_tokens,
            outcome.usage.model_calls
        ),
        (80, 14, 2)
    );
    let call = &outcome.tool_calls[0];
    assert_eq!(call.name, "weather.forecast");
    assert!(call.result.is_ok(), "{:?}", call.result);
    assert_eq!(call.result.data.as_ref().unwrap()["days"], json!(3));
    assert!(!call.result.metadata.repairs.is_empty());
    // The tool result went back to the model as a tool message answering the call.
    let second = &server.requests()[1];
    let messages = second["messages"].as_array().unwrap();
    let tool_message = messages.iter().find(|m| m["role"] == "tool").unwrap();
    assert_eq!(tool_message["tool_call_id"], json!("call_1"));
    let content: Value = serde_json::from_str(tool_message["content"].as_str().unwrap()).unwrap();
    assert_eq!(content["status"], json!("ok"));
    assert!(content["metadata"]["repairs"].is_array());
    let assistant = messages.iter().find(|m| m["role"] == "assistant").unwrap();
    assert_eq!(
        assistant["tool_calls"][0]["function"]["name"],
        json!("weather__forecast")
    );
    // Metrics by model.
    let rendered = metrics.render();
    for line in [
        "reach_gen_ai_client_token_usage_total{model=\"test-model\",type=\"input\"}",
        "reach_gen_ai_client_token_usage_total{model=\"test-model\",type=\"output\"}",
        "reach_gen_ai_client_operation_duration_seconds_count{model=\"test-model\"}",
        "reach_gen_ai_client_calls_total{model=\"test-model\"}",
    ] {
        assert!(rendered.contains(line), "{line} missing in\n{rendered}");
    }
}

#[tokio::test]
async fn a_429_is_retried_after_its_retry_after() {
    let server = FakeOpenAi::start(vec![
        Reply::WithHeaders(
            429,
            vec![("retry-after", "1".into())],
            error_body("slow down"),
        ),
        Reply::Json(200, text_completion("ok", 1, 1)),
    ])
    .await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let started = Instant::now();
    let response = provider.chat(request_with_tools()).await.unwrap();
    assert_eq!(response.message.text(), "ok");
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "Retry-After was not honoured"
    );
    assert_eq!(provider.retries(), 1);
    assert_eq!(server.requests().len(), 2);
}

#[tokio::test]
async fn rate_limits_on_every_attempt_end_as_model_rate_limited() {
    let limited = || {
        Reply::WithHeaders(
            429,
            vec![("retry-after", "0".into())],
            error_body("slow down"),
        )
    };
    let server = FakeOpenAi::start(vec![limited(), limited(), limited()]).await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let error = provider.chat(request_with_tools()).await.unwrap_err();
    assert!(
        matches!(error, ModelError::RateLimited { attempts: 3, .. }),
        "{error:?}"
    );
    assert_eq!(server.requests().len(), 3);
    let status = tonic::Status::from(error);
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(reason_of(&status).as_deref(), Some("MODEL_RATE_LIMITED"));
}

#[tokio::test]
async fn a_500_is_retried_with_back_off() {
    let server = FakeOpenAi::start(vec![
        Reply::Json(500, error_body("boom")),
        Reply::Json(200, text_completion("recovered", 1, 1)),
    ])
    .await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let response = provider.chat(request_with_tools()).await.unwrap();
    assert_eq!(response.message.text(), "recovered");
    assert_eq!(provider.retries(), 1);
}

#[tokio::test]
async fn a_400_is_refused_at_once() {
    let server = FakeOpenAi::start(vec![
        Reply::Json(400, error_body("messages: expected an array")),
        Reply::Json(200, text_completion("never", 1, 1)),
    ])
    .await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let error = provider.chat(request_with_tools()).await.unwrap_err();
    match &error {
        ModelError::Refused { status, detail } => {
            assert_eq!(*status, 400);
            assert!(detail.contains("expected an array"), "{detail}");
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(server.requests().len(), 1, "a 400 must not be retried");
    assert_eq!(provider.retries(), 0);
    let status = tonic::Status::from(error);
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert_eq!(reason_of(&status).as_deref(), Some("MODEL_REFUSED"));
}

#[tokio::test]
async fn a_hung_server_is_model_timeout() {
    let server = FakeOpenAi::start(vec![Reply::Hang]).await;
    let mut config = config(&server);
    config.timeout = Duration::from_millis(300);
    let provider = OpenAiProvider::new(config).unwrap();
    let started = Instant::now();
    let error = provider.chat(request_with_tools()).await.unwrap_err();
    assert!(matches!(error, ModelError::Timeout { .. }), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let status = tonic::Status::from(error);
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(reason_of(&status).as_deref(), Some("MODEL_TIMEOUT"));
}

#[tokio::test]
async fn an_oversized_or_malformed_response_is_a_bad_response() {
    let server = FakeOpenAi::start(vec![
        Reply::Json(200, text_completion(&"x".repeat(4096), 1, 1)),
        Reply::Json(200, json!({"choices": []})),
    ])
    .await;
    let mut config = config(&server);
    config.max_response_bytes = 1024;
    let provider = OpenAiProvider::new(config).unwrap();
    let error = provider.chat(request_with_tools()).await.unwrap_err();
    assert!(matches!(error, ModelError::BadResponse { .. }), "{error:?}");
    let error = provider.chat(request_with_tools()).await.unwrap_err();
    assert!(error.to_string().contains("no choices"), "{error}");
    assert_eq!(
        reason_of(&tonic::Status::from(error)).as_deref(),
        Some("MODEL_BAD_RESPONSE")
    );
}

#[tokio::test]
async fn a_streaming_agent_repairs_arguments_split_across_chunks() {
    let chunk = |delta: Value, finish: Value| json!({"model": "test-model-2026", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let tool_events = vec![
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_s", "type": "function",
                   "function": {"name": "weather__forecast", "arguments": "{'city': 'Ro"}}]}),
            Value::Null,
        ),
        chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "me', 'days': 1.0}"}}]}),
            Value::Null,
        ),
        chunk(json!({}), json!("tool_calls")),
        json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}),
    ];
    let text_events = vec![
        chunk(json!({"content": "Sunny "}), Value::Null),
        chunk(json!({"content": "in Rome."}), json!("stop")),
        json!({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 3}}),
    ];
    let server =
        FakeOpenAi::start(vec![Reply::Sse(tool_events, 5), Reply::Sse(text_events, 3)]).await;
    let provider = OpenAiProvider::new(config(&server)).unwrap();
    let agent = Agent::new(
        std::sync::Arc::new(provider),
        ToolRegistry::new().with(weather_tool()).unwrap(),
    )
    .streaming(true);
    let outcome = agent
        .run(RunContext::default(), "Rome tomorrow?")
        .await
        .unwrap();
    assert_eq!(outcome.answer, "Sunny in Rome.");
    let result = &outcome.tool_calls[0].result;
    assert_eq!(
        result.data.as_ref().unwrap()["days"],
        json!(1),
        "{result:?}"
    );
    assert_eq!(
        (outcome.usage.input_tokens, outcome.usage.output_tokens),
        (29, 7)
    );
}

/// Some OpenAI-compatible servers send `content` as an array of text parts, and a refusal
/// comes with `content: null`: both read as the answer, not as an empty one.
#[test]
fn content_parts_and_refusals_are_read_as_the_answer() {
    let parts = serde_json::json!({"choices": [{"message": {"role": "assistant", "content": [
        {"type": "text", "text": "Hello, "}, {"type": "text", "text": "world."}
    ]}, "finish_reason": "stop"}]});
    let response = reach_agent::openai::parse_completion(parts.to_string().as_bytes()).unwrap();
    assert_eq!(response.message.text(), "Hello, world.");
    let refusal = serde_json::json!({"choices": [{"message": {"role": "assistant", "content": null,
        "refusal": "I can't help with that."}, "finish_reason": "stop"}]});
    let response = reach_agent::openai::parse_completion(refusal.to_string().as_bytes()).unwrap();
    assert_eq!(response.message.text(), "I can't help with that.");
}
