//! The model provider interface: chat messages, tool calls, responses, streamed deltas, and
//! [`ModelError`] with its gRPC statuses.
//!
//! The shapes follow the OpenAI chat-completions API (`POST /chat/completions`: `messages`
//! with roles `system` / `user` / `assistant` (optionally with `tool_calls`) / `tool`,
//! `tools`, `tool_choice`, `finish_reason`, `usage`), which most model servers speak.
//! Token counts use the OpenTelemetry GenAI names: input (prompt) and output (completion)
//! tokens.

use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use reach_rpc::errors::{reason, status_with_reason, status_with_retry};
use serde::{Deserialize, Serialize};
use tonic::{Code, Status};

// === messages ===

/// Who wrote a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions for the model.
    System,
    /// The user's (or calling agent's) words.
    User,
    /// The model's reply, possibly requesting tool calls.
    Assistant,
    /// A tool's result, answering one tool call by its id.
    Tool,
}

impl Role {
    /// The wire name (`system`, `user`, `assistant`, `tool`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A tool call the model requested: the function `name` (an OpenAI function name, see
/// [`crate::tool::function_name`]) and its `arguments` exactly as the model wrote them (a
/// JSON object as text, by the API's contract — in practice sometimes malformed, which
/// [`crate::arguments`] and [`crate::repair`] deal with).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, echoed by the tool message that answers it.
    pub id: String,
    /// The function name.
    pub name: String,
    /// The arguments as the model wrote them.
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote it.
    pub role: Role,
    /// Its text (`None` for an assistant message that only calls tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The tool calls an assistant message requests (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The tool call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The function name a tool message answers for (informational; not sent to OpenAI).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    fn new(role: Role, content: Option<String>) -> Self {
        Self {
            role,
            content,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// A system message.
    pub fn system(text: impl Into<String>) -> Self {
        Self::new(Role::System, Some(text.into()))
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::new(Role::User, Some(text.into()))
    }

    /// An assistant message with text only.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new(Role::Assistant, Some(text.into()))
    }

    /// An assistant message requesting `calls` (with optional text).
    pub fn assistant_tool_calls(content: Option<String>, calls: Vec<ToolCall>) -> Self {
        Self {
            tool_calls: calls,
            ..Self::new(Role::Assistant, content)
        }
    }

    /// A tool message answering call `call_id` of function `name` with `content`.
    pub fn tool(
        call_id: impl Into<String>,
        name: impl Into<String>,
        content: impl Into<String>,
    ) -> Self {
        Self {
            tool_call_id: Some(call_id.into()),
            name: Some(name.into()),
            ..Self::new(Role::Tool, Some(content.into()))
        }
    }

    /// The text ("" when none).
    pub fn text(&self) -> &str {
        self.content.as_deref().unwrap_or_default()
    }
}

/// A tool offered to the model: an OpenAI function definition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The function name (`^[a-zA-Z0-9_-]{1,64}$`).
    pub name: String,
    /// When to use it and when not.
    pub description: String,
    /// The JSON Schema of its arguments object.
    pub parameters: serde_json::Value,
}

impl ToolSpec {
    /// The OpenAI `tools` entry: `{"type":"function","function":{"name","description","parameters"}}`.
    pub fn to_openai(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            }
        })
    }
}

/// Whether and which tools the model may call (OpenAI `tool_choice`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (`"auto"`, the default).
    #[default]
    Auto,
    /// No tool calls (`"none"`).
    None,
    /// At least one tool call (`"required"`).
    Required,
    /// This function (`{"type":"function","function":{"name":...}}`).
    Function(String),
}

impl ToolChoice {
    /// The wire value.
    pub fn to_openai(&self) -> serde_json::Value {
        match self {
            ToolChoice::Auto => "auto".into(),
            ToolChoice::None => "none".into(),
            ToolChoice::Required => "required".into(),
            ToolChoice::Function(name) => {
                serde_json::json!({"type": "function", "function": {"name": name}})
            }
        }
    }
}

/// One chat request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<ChatMessage>,
    /// The tools the model may call (none: the field is left out).
    pub tools: Vec<ToolSpec>,
    /// Whether it may call them.
    pub tool_choice: ToolChoice,
    /// Sampling temperature, when set.
    pub temperature: Option<f32>,
    /// The most output tokens, when set (`max_tokens`).
    pub max_output_tokens: Option<u32>,
    /// Whether the model may request several tool calls in one message
    /// (`parallel_tool_calls`); `None` leaves the server's default.
    pub parallel_tool_calls: Option<bool>,
}

impl ChatRequest {
    /// A request of `messages` with no tools.
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            ..Self::default()
        }
    }
}

/// Why the model stopped (OpenAI `finish_reason`; OTel `gen_ai.response.finish_reasons`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A natural end (`stop`).
    Stop,
    /// It requested tool calls (`tool_calls`).
    ToolCalls,
    /// It hit the token limit (`length`).
    Length,
    /// Output was filtered (`content_filter`).
    ContentFilter,
    /// Anything else the server said.
    Other(String),
}

impl FinishReason {
    /// Parses the wire value.
    pub fn parse(text: &str) -> Self {
        match text {
            "stop" => FinishReason::Stop,
            "tool_calls" | "function_call" => FinishReason::ToolCalls,
            "length" => FinishReason::Length,
            "content_filter" => FinishReason::ContentFilter,
            other => FinishReason::Other(other.to_string()),
        }
    }

    /// The wire value.
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Length => "length",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Other(other) => other,
        }
    }
}

/// Tokens one model call spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Input (prompt) tokens (`usage.prompt_tokens`).
    pub input_tokens: u64,
    /// Output (completion) tokens (`usage.completion_tokens`).
    pub output_tokens: u64,
}

/// The model's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    /// The assistant message (text and/or tool calls).
    pub message: ChatMessage,
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// What it cost.
    pub usage: Usage,
    /// The model that answered, as the server names it (`gen_ai.response.model`).
    pub model: String,
}

// === streaming ===

/// One piece of a streamed response.
#[derive(Debug, Clone, PartialEq)]
pub enum ChatDelta {
    /// More text.
    Content(String),
    /// Part of tool call number `index`: the id and name arrive in its first delta, the
    /// arguments in pieces to be concatenated.
    ToolCall {
        /// The call's position in the message.
        index: usize,
        /// Its id (first delta).
        id: Option<String>,
        /// Its function name (first delta).
        name: Option<String>,
        /// A piece of its arguments.
        arguments: String,
    },
    /// Why the model stopped.
    Finish(FinishReason),
    /// What the call cost (sent last, with `stream_options.include_usage`).
    Usage(Usage),
    /// The model that answers.
    Model(String),
}

/// A stream of deltas.
pub type ChatStream = BoxStream<'static, Result<ChatDelta, ModelError>>;

/// Assembles deltas into a [`ChatResponse`]: text concatenated, tool-call pieces joined by
/// index.
#[derive(Debug, Default)]
pub struct StreamAssembler {
    content: String,
    calls: Vec<ToolCall>,
    finish: Option<FinishReason>,
    usage: Usage,
    model: String,
}

impl StreamAssembler {
    /// Takes one delta.
    ///
    /// # Errors
    /// [`ModelError::BadResponse`] for a tool-call index far beyond the calls seen (a
    /// server bug that would otherwise allocate without bound).
    pub fn push(&mut self, delta: ChatDelta) -> Result<(), ModelError> {
        match delta {
            ChatDelta::Content(text) => self.content.push_str(&text),
            ChatDelta::ToolCall {
                index,
                id,
                name,
                arguments,
            } => {
                if index > self.calls.len() + 64 {
                    return Err(ModelError::BadResponse {
                        detail: format!("tool call delta index {index} skips too many calls"),
                    });
                }
                while self.calls.len() <= index {
                    self.calls.push(ToolCall {
                        id: String::new(),
                        name: String::new(),
                        arguments: String::new(),
                    });
                }
                let call = &mut self.calls[index];
                if let Some(id) = id
                    && !id.is_empty()
                {
                    call.id = id;
                }
                if let Some(name) = name {
                    call.name.push_str(&name);
                }
                call.arguments.push_str(&arguments);
            }
            ChatDelta::Finish(reason) => self.finish = Some(reason),
            ChatDelta::Usage(usage) => self.usage = usage,
            ChatDelta::Model(model) => self.model = model,
        }
        Ok(())
    }

    /// The assembled response. Calls without an id get `call_<index>`.
    pub fn finish(self) -> ChatResponse {
        let mut calls = self.calls;
        for (i, call) in calls.iter_mut().enumerate() {
            if call.id.is_empty() {
                call.id = format!("call_{i}");
            }
        }
        let finish_reason = self.finish.unwrap_or(if calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        });
        let content = (!self.content.is_empty()).then_some(self.content);
        ChatResponse {
            message: ChatMessage::assistant_tool_calls(content, calls),
            finish_reason,
            usage: self.usage,
            model: self.model,
        }
    }
}

/// Drains `stream` into one response.
///
/// # Errors
/// The stream's first error.
pub async fn collect_stream(mut stream: ChatStream) -> Result<ChatResponse, ModelError> {
    let mut assembler = StreamAssembler::default();
    while let Some(delta) = stream.next().await {
        assembler.push(delta?)?;
    }
    Ok(assembler.finish())
}

/// The deltas that make up `response` (for providers that do not stream natively).
pub fn response_deltas(response: ChatResponse) -> Vec<ChatDelta> {
    let mut deltas = vec![ChatDelta::Model(response.model)];
    if let Some(text) = response.message.content {
        deltas.push(ChatDelta::Content(text));
    }
    for (index, call) in response.message.tool_calls.into_iter().enumerate() {
        deltas.push(ChatDelta::ToolCall {
            index,
            id: Some(call.id),
            name: Some(call.name),
            arguments: call.arguments,
        });
    }
    deltas.push(ChatDelta::Finish(response.finish_reason));
    deltas.push(ChatDelta::Usage(response.usage));
    deltas
}

// === the trait ===

/// A chat model with tool calling.
///
/// Implementations: [`crate::openai::OpenAiProvider`] (any OpenAI-compatible server) and
/// [`crate::scripted::ScriptedProvider`] (deterministic, for tests and demos).
pub trait ModelProvider: Send + Sync + 'static {
    /// The provider's name for `gen_ai.provider.name` (`openai`, `scripted`, ...).
    fn provider_name(&self) -> &str;

    /// The model requests ask for (`gen_ai.request.model`).
    fn model(&self) -> &str;

    /// One non-streaming chat call.
    fn chat(&self, request: ChatRequest) -> BoxFuture<'_, Result<ChatResponse, ModelError>>;

    /// One streaming chat call: deltas as they arrive ([`collect_stream`] assembles them).
    /// The default runs [`ModelProvider::chat`] and replays its response as deltas.
    fn chat_stream(&self, request: ChatRequest) -> BoxFuture<'_, Result<ChatStream, ModelError>> {
        Box::pin(async move {
            let response = self.chat(request).await?;
            let deltas = response_deltas(response).into_iter().map(Ok);
            Ok(futures::stream::iter(deltas).boxed())
        })
    }
}

// === errors ===

/// Why a model call failed. Each variant maps to one gRPC status with an ErrorInfo reason
/// (`impl From<ModelError> for Status`, one arm per variant).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    /// The server answered 429 on every attempt.
    #[error(
        "the model server rate-limited the call (HTTP {status}) on all {attempts} attempts{}; retry later or lower the request rate",
        retry_hint(*retry_after)
    )]
    RateLimited {
        /// The HTTP status (429).
        status: u16,
        /// The last `Retry-After` the server sent.
        retry_after: Option<Duration>,
        /// Attempts made.
        attempts: u32,
    },
    /// No (complete) answer within the configured timeout.
    #[error(
        "the model did not answer within {timeout:?} ({attempts} attempts); raise model.timeout or check the server"
    )]
    Timeout {
        /// The per-attempt timeout.
        timeout: Duration,
        /// Attempts made.
        attempts: u32,
    },
    /// The server could not be reached or answered 5xx on every attempt.
    #[error("the model server is unavailable after {attempts} attempts: {detail}")]
    Unavailable {
        /// The last HTTP status, when the server answered.
        status: Option<u16>,
        /// What happened last.
        detail: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The server answered with something that is not a chat completion (or too large).
    #[error("the model server's response is unusable: {detail}")]
    BadResponse {
        /// What is wrong with it.
        detail: String,
    },
    /// The server refused the request (a 4xx other than 429): not retried.
    #[error("the model server refused the request with HTTP {status}: {detail}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The server's error message.
        detail: String,
    },
}

fn retry_hint(retry_after: Option<Duration>) -> String {
    retry_after.map_or_else(String::new, |d| {
        format!(" (it asked to wait {}s)", d.as_secs())
    })
}

impl ModelError {
    /// The ErrorInfo reason of this error.
    pub fn reason(&self) -> &'static str {
        match self {
            ModelError::RateLimited { .. } => reason::MODEL_RATE_LIMITED,
            ModelError::Timeout { .. } => reason::MODEL_TIMEOUT,
            ModelError::Unavailable { .. } => reason::MODEL_UNAVAILABLE,
            ModelError::BadResponse { .. } => reason::MODEL_BAD_RESPONSE,
            ModelError::Refused { .. } => reason::MODEL_REFUSED,
        }
    }

    /// A short label for metrics (`error.type`): the reason in lower case.
    pub fn error_type(&self) -> String {
        self.reason().to_ascii_lowercase()
    }
}

impl From<ModelError> for Status {
    fn from(error: ModelError) -> Status {
        let message = error.to_string();
        match error {
            ModelError::RateLimited {
                status,
                retry_after,
                attempts,
            } => {
                let metadata = [
                    ("http_status".to_string(), status.to_string()),
                    ("attempts".to_string(), attempts.to_string()),
                ];
                match retry_after {
                    Some(delay) => status_with_retry(
                        Code::ResourceExhausted,
                        message,
                        reason::MODEL_RATE_LIMITED,
                        metadata,
                        delay,
                    ),
                    None => status_with_reason(
                        Code::ResourceExhausted,
                        message,
                        reason::MODEL_RATE_LIMITED,
                        metadata,
                    ),
                }
            }
            ModelError::Timeout { timeout, attempts } => status_with_reason(
                Code::DeadlineExceeded,
                message,
                reason::MODEL_TIMEOUT,
                [
                    ("timeout_ms".to_string(), timeout.as_millis().to_string()),
                    ("attempts".to_string(), attempts.to_string()),
                ],
            ),
            ModelError::Unavailable {
                status, attempts, ..
            } => status_with_reason(
                Code::Unavailable,
                message,
                reason::MODEL_UNAVAILABLE,
                status
                    .map(|s| ("http_status".to_string(), s.to_string()))
                    .into_iter()
                    .chain([("attempts".to_string(), attempts.to_string())]),
            ),
            ModelError::BadResponse { .. } => {
                status_with_reason(Code::Unavailable, message, reason::MODEL_BAD_RESPONSE, [])
            }
            ModelError::Refused { status, .. } => {
                let code = match status {
                    400 | 413 | 422 => Code::InvalidArgument,
                    401 => Code::Unauthenticated,
                    403 => Code::PermissionDenied,
                    404 => Code::NotFound,
                    _ => Code::FailedPrecondition,
                };
                status_with_reason(
                    code,
                    message,
                    reason::MODEL_REFUSED,
                    [("http_status".to_string(), status.to_string())],
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_assemble_by_index() {
        let mut a = StreamAssembler::default();
        for d in [
            ChatDelta::ToolCall {
                index: 0,
                id: Some("a".into()),
                name: Some("f".into()),
                arguments: "{\"x\":".into(),
            },
            ChatDelta::ToolCall {
                index: 1,
                id: Some("b".into()),
                name: Some("g".into()),
                arguments: "{}".into(),
            },
            ChatDelta::ToolCall {
                index: 0,
                id: None,
                name: None,
                arguments: "1}".into(),
            },
        ] {
            a.push(d).unwrap();
        }
        let r = a.finish();
        assert_eq!(r.message.tool_calls[0].arguments, "{\"x\":1}");
        assert_eq!(r.message.tool_calls[1].name, "g");
        assert_eq!(r.finish_reason, FinishReason::ToolCalls);
    }

    #[test]
    fn errors_map_to_codes_and_reasons() {
        let s: Status = ModelError::Timeout {
            timeout: Duration::from_secs(1),
            attempts: 1,
        }
        .into();
        assert_eq!(s.code(), Code::DeadlineExceeded);
        assert_eq!(
            reach_rpc::errors::reason_of(&s).as_deref(),
            Some("MODEL_TIMEOUT")
        );
        let s: Status = ModelError::RateLimited {
            status: 429,
            retry_after: Some(Duration::from_secs(2)),
            attempts: 3,
        }
        .into();
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert_eq!(
            reach_rpc::errors::retry_after_of(&s),
            Some(Duration::from_secs(2))
        );
        let s: Status = ModelError::Refused {
            status: 400,
            detail: "bad".into(),
        }
        .into();
        assert_eq!(s.code(), Code::InvalidArgument);
    }
}
