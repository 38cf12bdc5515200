//! [`OpenAiProvider`]: any server speaking the OpenAI chat-completions API
//! (`POST {base_url}/chat/completions`), non-streaming and streaming (server-sent events,
//! `stream: true` with `stream_options.include_usage`).
//!
//! Retries: 429 and 5xx answers and connection failures are retried up to
//! `max_retries` times; the delay is the server's `Retry-After` (seconds; capped at
//! `max_backoff`) or else a doubling back-off from `initial_backoff`
//! ([`reach_rpc::backoff`]). Other 4xx are not retried ([`ModelError::Refused`]). Timeouts
//! are not retried either: each attempt may take `timeout` (body or stream included), and a
//! model that let one pass is given up on ([`ModelError::Timeout`]). Bodies over
//! `max_response_bytes` are refused ([`ModelError::BadResponse`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use eventsource_stream::Eventsource;
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use reach_rpc::backoff::Backoff;
use reach_telemetry::metrics::names;
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::config::{ConfigError, ModelConfig};
use crate::provider::{
    ChatDelta, ChatMessage, ChatRequest, ChatResponse, ChatStream, FinishReason, ModelError,
    ModelProvider, Role, ToolCall, Usage,
};

/// A model provider over the OpenAI chat-completions API.
#[derive(Clone)]
pub struct OpenAiProvider {
    config: Arc<ModelConfig>,
    http: reqwest::Client,
    url: String,
    retries: Arc<AtomicU64>,
}

impl std::fmt::Debug for OpenAiProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiProvider")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl OpenAiProvider {
    /// A provider for `config`.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for invalid settings or when the HTTP client cannot be built.
    pub fn new(config: ModelConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let http = reqwest::Client::builder()
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| ConfigError::Invalid {
                field: "model".into(),
                message: format!("cannot build the HTTP client: {e}"),
            })?;
        let url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
        Ok(Self {
            config: Arc::new(config),
            http,
            url,
            retries: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The settings.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// HTTP attempts retried so far (429, 5xx, connection failures), over all calls.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// The request body.
    pub fn body(&self, request: &ChatRequest, stream: bool) -> Value {
        let mut body = json!({
            "model": self.config.model,
            "messages": request.messages.iter().map(wire_message).collect::<Vec<_>>(),
        });
        let map = body.as_object_mut().expect("an object");
        if !request.tools.is_empty() {
            map.insert(
                "tools".into(),
                request.tools.iter().map(|t| t.to_openai()).collect(),
            );
            map.insert("tool_choice".into(), request.tool_choice.to_openai());
            if let Some(parallel) = request.parallel_tool_calls {
                map.insert("parallel_tool_calls".into(), parallel.into());
            }
        }
        if let Some(t) = request.temperature.or(self.config.temperature) {
            map.insert("temperature".into(), json!(t));
        }
        if let Some(n) = request.max_output_tokens.or(self.config.max_output_tokens) {
            map.insert("max_tokens".into(), json!(n));
        }
        if stream {
            map.insert("stream".into(), true.into());
            map.insert("stream_options".into(), json!({"include_usage": true}));
        }
        body
    }

    /// Sends `body` until an attempt gets a 2xx (returned) or the retries run out.
    async fn send(
        &self,
        body: &Value,
        deadline_of: impl Fn() -> Instant,
    ) -> Result<(reqwest::Response, Instant), ModelError> {
        let config = &self.config;
        let mut backoff = Backoff::doubling(config.initial_backoff, config.max_backoff);
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let deadline = deadline_of();
            let mut builder = self.http.post(&self.url).json(body);
            if !config.api_key.is_empty() {
                builder = builder.bearer_auth(&config.api_key);
            }
            let sent = tokio::time::timeout_at(deadline, builder.send()).await;
            let (retry_reason, error) = match sent {
                Err(_) => {
                    return Err(ModelError::Timeout {
                        timeout: config.timeout,
                        attempts,
                    });
                }
                Ok(Err(e)) if e.is_timeout() => {
                    return Err(ModelError::Timeout {
                        timeout: config.timeout,
                        attempts,
                    });
                }
                Ok(Err(e)) => (
                    ("connect", None),
                    ModelError::Unavailable {
                        status: None,
                        detail: e.to_string(),
                        attempts,
                    },
                ),
                Ok(Ok(response)) => {
                    let status = response.status().as_u16();
                    if response.status().is_success() {
                        return Ok((response, deadline));
                    }
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(Duration::from_secs);
                    let detail = error_text(response, deadline, 64 * 1024).await;
                    match status {
                        429 => (
                            ("rate_limited", retry_after),
                            ModelError::RateLimited {
                                status,
                                retry_after,
                                attempts,
                            },
                        ),
                        500..=599 => (
                            ("server_error", retry_after),
                            ModelError::Unavailable {
                                status: Some(status),
                                detail: format!("HTTP {status}: {detail}"),
                                attempts,
                            },
                        ),
                        _ => return Err(ModelError::Refused { status, detail }),
                    }
                }
            };
            if attempts > config.max_retries {
                return Err(error);
            }
            let (reason, retry_after) = retry_reason;
            self.retries.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(
                names::GEN_AI_RETRIES,
                "model" => config.model.clone(),
                "reason" => reason
            )
            .increment(1);
            let delay = match retry_after {
                Some(delay) => delay.min(config.max_backoff),
                None => backoff.next_delay(),
            };
            tracing::debug!(
                attempt = attempts,
                ?delay,
                reason,
                "retrying the model call"
            );
            tokio::time::sleep(delay).await;
        }
    }
}

/// The error text of a failed response: `error.message` of an OpenAI error body, else the
/// body's first bytes.
async fn error_text(response: reqwest::Response, deadline: Instant, limit: usize) -> String {
    let body = match read_body(response, deadline, limit).await {
        Ok(body) => body,
        Err(_) => return "(no readable body)".into(),
    };
    let parsed: Option<Value> = serde_json::from_slice(&body).ok();
    if let Some(message) = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/message"))
        .and_then(Value::as_str)
    {
        return message.to_string();
    }
    String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned()
}

/// Reads the body within `deadline` and `limit` bytes.
async fn read_body(
    mut response: reqwest::Response,
    deadline: Instant,
    limit: usize,
) -> Result<Vec<u8>, ModelError> {
    let mut body = Vec::new();
    loop {
        let chunk = tokio::time::timeout_at(deadline, response.chunk())
            .await
            .map_err(|_| ModelError::Timeout {
                timeout: Duration::ZERO,
                attempts: 1,
            })?
            .map_err(|e| ModelError::BadResponse {
                detail: format!("reading the body failed: {e}"),
            })?;
        let Some(chunk) = chunk else {
            return Ok(body);
        };
        if body.len() + chunk.len() > limit {
            return Err(ModelError::BadResponse {
                detail: format!(
                    "the response is over the limit of {limit} bytes (model.max_response_bytes)"
                ),
            });
        }
        body.extend_from_slice(&chunk);
    }
}

fn wire_message(message: &ChatMessage) -> Value {
    match message.role {
        Role::System | Role::User => json!({
            "role": message.role.as_str(),
            "content": message.text(),
        }),
        Role::Assistant => {
            let mut m = json!({
                "role": "assistant",
                "content": message.content,
            });
            if !message.tool_calls.is_empty() {
                m["tool_calls"] = message
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        })
                    })
                    .collect();
            }
            m
        }
        Role::Tool => json!({
            "role": "tool",
            "tool_call_id": message.tool_call_id.clone().unwrap_or_default(),
            "content": message.text(),
        }),
    }
}

fn bad(detail: impl Into<String>) -> ModelError {
    ModelError::BadResponse {
        detail: detail.into(),
    }
}

/// Arguments as text: servers send a string; a few send the object itself.
fn arguments_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

fn usage_of(value: &Value) -> Usage {
    Usage {
        input_tokens: value
            .get("prompt_tokens")
            .or_else(|| value.get("input_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
        output_tokens: value
            .get("completion_tokens")
            .or_else(|| value.get("output_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0),
    }
}

/// A completion message's text: `content` as a string, or the text of its parts when a
/// server sends `content` as an array of `{type: "text", text}` parts (as some
/// OpenAI-compatible servers do), else its `refusal` — so a refusal reads as the answer
/// rather than as an empty one.
fn message_text(message: &Value) -> Option<String> {
    match message.get("content") {
        Some(Value::String(text)) => return Some(text.clone()),
        Some(Value::Array(parts)) => {
            let text: Vec<&str> = parts
                .iter()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect();
            if !text.is_empty() {
                return Some(text.concat());
            }
        }
        _ => {}
    }
    message
        .get("refusal")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Decodes a response body (or stream chunk) as JSON. A `\uD800`–`\uDFFF` escape that is
/// not half of a surrogate pair (which some models emit, cutting an emoji in two) makes
/// strict JSON fail as a whole (RFC 8259 §8.2 leaves such strings' meaning open); each is
/// replaced by U+FFFD, the replacement is recorded as a `warn` event (`repair =
/// "unpaired_surrogate"`, `count`) on the current span, and the body decoded again.
fn decode_json(body: &[u8]) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(body) {
        Ok(value) => Ok(value),
        Err(error) => {
            let Some((fixed, count)) = std::str::from_utf8(body)
                .ok()
                .and_then(replace_unpaired_surrogates)
            else {
                return Err(error);
            };
            let value = serde_json::from_str(&fixed)?;
            tracing::warn!(
                repair = "unpaired_surrogate",
                count,
                "the model's response held unpaired UTF-16 surrogate escapes; each was replaced by U+FFFD"
            );
            Ok(value)
        }
    }
}

/// `text` with every `\uXXXX` escape of a lone UTF-16 surrogate (a high one not followed by
/// a low one's escape, or a low one alone) replaced by `\uFFFD`, and how many were; `None`
/// when there was none.
fn replace_unpaired_surrogates(text: &str) -> Option<(String, usize)> {
    fn escape_at(bytes: &[u8], i: usize) -> Option<u16> {
        let hex = bytes.get(i..i + 6)?;
        if hex[0] != b'\\' || hex[1] != b'u' {
            return None;
        }
        u16::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut count = 0;
    let mut i = 0;
    let mut copied = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            i += 1;
            continue;
        }
        let Some(unit) = escape_at(bytes, i) else {
            // Another escape (`\\`, `\"`, ...): skip both bytes.
            i += 2;
            continue;
        };
        let high = (0xD800..=0xDBFF).contains(&unit);
        let low = (0xDC00..=0xDFFF).contains(&unit);
        if high && escape_at(bytes, i + 6).is_some_and(|next| (0xDC00..=0xDFFF).contains(&next)) {
            i += 12;
        } else if high || low {
            out.push_str(&text[copied..i]);
            out.push_str("\\uFFFD");
            count += 1;
            i += 6;
            copied = i;
        } else {
            i += 6;
        }
    }
    if count == 0 {
        return None;
    }
    out.push_str(&text[copied..]);
    Some((out, count))
}

/// Parses a (non-streaming) chat completion.
///
/// # Errors
/// [`ModelError::BadResponse`] when it is not one.
pub fn parse_completion(body: &[u8]) -> Result<ChatResponse, ModelError> {
    let value = decode_json(body).map_err(|e| bad(format!("the body is not JSON: {e}")))?;
    let choice = value
        .pointer("/choices/0")
        .ok_or_else(|| bad("the completion has no choices"))?;
    let message = choice
        .get("message")
        .ok_or_else(|| bad("choices[0] has no message"))?;
    let content = message_text(message);
    let calls = match message.get("tool_calls") {
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let name = c
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("tool_calls[{i}] has no function name")))?;
                Ok(ToolCall {
                    id: c
                        .get("id")
                        .and_then(Value::as_str)
                        .map_or_else(|| format!("call_{i}"), str::to_string),
                    name: name.to_string(),
                    arguments: arguments_text(c.pointer("/function/arguments")),
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?,
        _ => Vec::new(),
    };
    let finish_reason = choice.get("finish_reason").and_then(Value::as_str).map_or(
        if calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        },
        FinishReason::parse,
    );
    Ok(ChatResponse {
        message: ChatMessage::assistant_tool_calls(content, calls),
        finish_reason,
        usage: value.get("usage").map(usage_of).unwrap_or_default(),
        model: value
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    })
}

/// The deltas of one streamed chunk (`chat.completion.chunk`).
///
/// # Errors
/// [`ModelError::BadResponse`] when it is not JSON.
pub fn parse_chunk(data: &str) -> Result<Vec<ChatDelta>, ModelError> {
    let value = decode_json(data.as_bytes())
        .map_err(|e| bad(format!("a stream chunk is not JSON: {e}")))?;
    if let Some(message) = value.pointer("/error/message").and_then(Value::as_str) {
        return Err(bad(format!("the stream carried an error: {message}")));
    }
    let mut deltas = Vec::new();
    if let Some(model) = value.get("model").and_then(Value::as_str) {
        deltas.push(ChatDelta::Model(model.to_string()));
    }
    if let Some(choice) = value.pointer("/choices/0") {
        if let Some(delta) = choice.get("delta") {
            if let Some(text) = delta.get("content").and_then(Value::as_str)
                && !text.is_empty()
            {
                deltas.push(ChatDelta::Content(text.to_string()));
            }
            if let Some(Value::Array(calls)) = delta.get("tool_calls") {
                for (i, call) in calls.iter().enumerate() {
                    let index = call
                        .get("index")
                        .and_then(Value::as_u64)
                        .map_or(i, |n| usize::try_from(n).unwrap_or(usize::MAX));
                    deltas.push(ChatDelta::ToolCall {
                        index,
                        id: call.get("id").and_then(Value::as_str).map(str::to_string),
                        name: call
                            .pointer("/function/name")
                            .and_then(Value::as_str)
                            .map(str::to_string),
                        arguments: arguments_text(call.pointer("/function/arguments")),
                    });
                }
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            deltas.push(ChatDelta::Finish(FinishReason::parse(reason)));
        }
    }
    if let Some(usage) = value.get("usage").filter(|u| u.is_object()) {
        deltas.push(ChatDelta::Usage(usage_of(usage)));
    }
    Ok(deltas)
}

/// The deltas of an SSE body, within `deadline` and `limit` bytes, ending at `[DONE]` (or
/// the end of the body).
fn sse_deltas(
    response: reqwest::Response,
    deadline: Instant,
    limit: usize,
    timeout: Duration,
) -> impl Stream<Item = Result<ChatDelta, ModelError>> + Send + 'static {
    let mut seen = 0usize;
    let bytes = response.bytes_stream().map(move |chunk| {
        let chunk = chunk?;
        seen += chunk.len();
        Ok::<_, reqwest::Error>(chunk).map(|c| (c, seen))
    });
    let over = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = over.clone();
    let limited = bytes
        .take_while(move |item| {
            let fine = match item {
                Ok((_, seen)) => *seen <= limit,
                Err(_) => true,
            };
            if !fine {
                flag.store(true, Ordering::Relaxed);
            }
            futures::future::ready(fine)
        })
        .map(|item| item.map(|(c, _)| c));
    let events = limited.eventsource();
    futures::stream::unfold(
        (Box::pin(events), false, over),
        move |(mut events, done, over)| async move {
            if done {
                return None;
            }
            loop {
                let next = match tokio::time::timeout_at(deadline, events.next()).await {
                    Err(_) => {
                        return Some((
                            vec![Err(ModelError::Timeout {
                                timeout,
                                attempts: 1,
                            })],
                            (events, true, over),
                        ));
                    }
                    Ok(next) => next,
                };
                match next {
                    None => {
                        if over.load(Ordering::Relaxed) {
                            return Some((
                                vec![Err(bad(format!(
                                    "the streamed response is over the limit of {limit} bytes (model.max_response_bytes)"
                                )))],
                                (events, true, over),
                            ));
                        }
                        return None;
                    }
                    Some(Err(e)) => {
                        return Some((
                            vec![Err(bad(format!("the event stream broke: {e}")))],
                            (events, true, over),
                        ));
                    }
                    Some(Ok(event)) => {
                        let data = event.data.trim();
                        if data.is_empty() {
                            continue;
                        }
                        if data == "[DONE]" {
                            return None;
                        }
                        return match parse_chunk(data) {
                            Ok(deltas) => {
                                Some((deltas.into_iter().map(Ok).collect(), (events, false, over)))
                            }
                            Err(e) => Some((vec![Err(e)], (events, true, over))),
                        };
                    }
                }
            }
        },
    )
    .flat_map(futures::stream::iter)
}

impl ModelProvider for OpenAiProvider {
    fn provider_name(&self) -> &str {
        &self.config.provider_name
    }

    fn model(&self) -> &str {
        &self.config.model
    }

    fn chat(&self, request: ChatRequest) -> BoxFuture<'_, Result<ChatResponse, ModelError>> {
        Box::pin(async move {
            let body = self.body(&request, false);
            let timeout = self.config.timeout;
            let (response, deadline) = self.send(&body, || Instant::now() + timeout).await?;
            let bytes = read_body(response, deadline, self.config.max_response_bytes)
                .await
                .map_err(|e| match e {
                    ModelError::Timeout { .. } => ModelError::Timeout {
                        timeout,
                        attempts: 1,
                    },
                    other => other,
                })?;
            parse_completion(&bytes)
        })
    }

    fn chat_stream(&self, request: ChatRequest) -> BoxFuture<'_, Result<ChatStream, ModelError>> {
        Box::pin(async move {
            let body = self.body(&request, true);
            let timeout = self.config.timeout;
            let (response, deadline) = self.send(&body, || Instant::now() + timeout).await?;
            let is_sse = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            if !is_sse {
                // Some servers ignore `stream` and answer with one completion.
                let bytes = read_body(response, deadline, self.config.max_response_bytes)
                    .await
                    .map_err(|e| match e {
                        ModelError::Timeout { .. } => ModelError::Timeout {
                            timeout,
                            attempts: 1,
                        },
                        other => other,
                    })?;
                let deltas = crate::provider::response_deltas(parse_completion(&bytes)?);
                return Ok(futures::stream::iter(deltas.into_iter().map(Ok)).boxed());
            }
            Ok(sse_deltas(response, deadline, self.config.max_response_bytes, timeout).boxed())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unpaired_surrogate_is_replaced_and_the_rest_kept() {
        let body = br#"{"model": "m", "choices": [{"message": {"content": "ok \ud83d then \ud83d\ude00 and \\ud800"}}]}"#;
        let response = parse_completion(body).unwrap();
        assert_eq!(
            response.message.content.as_deref(),
            Some("ok \u{FFFD} then \u{1F600} and \\ud800")
        );
        let lone_low = r#"{"choices": [{"delta": {"content": "\udc00!"}}]}"#;
        assert_eq!(
            parse_chunk(lone_low).unwrap(),
            vec![ChatDelta::Content("\u{FFFD}!".into())]
        );
        assert!(parse_completion(b"{not json").is_err());
    }
}
