//! [`ScriptedProvider`]: a deterministic model for tests and for demos without a model
//! endpoint — replies and tool calls from a script (a list of steps, or a function of the
//! conversation), with token usage.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

use crate::provider::{
    ChatMessage, ChatRequest, ChatResponse, FinishReason, ModelError, ModelProvider, ToolCall,
    Usage,
};

/// One scripted model answer.
#[derive(Debug, Clone)]
pub enum Step {
    /// A final text answer.
    Reply(String),
    /// Tool calls: `(name, arguments text)`; a dotted name is mapped to its function name.
    ToolCalls(Vec<(String, String)>),
    /// A failure.
    Fail(ModelError),
}

impl Step {
    /// A final answer.
    pub fn reply(text: impl Into<String>) -> Self {
        Step::Reply(text.into())
    }

    /// One tool call of `name` with `arguments` written as given (malformed on purpose, if
    /// you like).
    pub fn tool_call(name: impl Into<String>, arguments: impl Into<String>) -> Self {
        Step::ToolCalls(vec![(name.into(), arguments.into())])
    }
}

type ScriptFn = dyn Fn(&ChatRequest) -> Result<Step, ModelError> + Send + Sync;

enum Script {
    Steps(Mutex<VecDeque<Step>>),
    Function(Box<ScriptFn>),
}

/// A model that answers from a script. Each answer's usage is the fixed usage when set
/// ([`ScriptedProvider::with_usage`]), else a deterministic estimate: a quarter of the
/// characters of the request's messages (input) and of the answer (output), rounded up.
pub struct ScriptedProvider {
    script: Script,
    model: String,
    usage: Option<Usage>,
    requests: Mutex<Vec<ChatRequest>>,
    next_call: std::sync::atomic::AtomicU64,
}

impl ScriptedProvider {
    /// Answers with `steps` in order; after the last, every call fails with
    /// MODEL_BAD_RESPONSE ("the script has no more steps").
    pub fn new(steps: impl IntoIterator<Item = Step>) -> Self {
        Self::with_script(Script::Steps(Mutex::new(steps.into_iter().collect())))
    }

    /// Answers with whatever `f` says about the request (the conversation so far).
    pub fn from_fn(
        f: impl Fn(&ChatRequest) -> Result<Step, ModelError> + Send + Sync + 'static,
    ) -> Self {
        Self::with_script(Script::Function(Box::new(f)))
    }

    fn with_script(script: Script) -> Self {
        Self {
            script,
            model: "scripted".into(),
            usage: None,
            requests: Mutex::new(Vec::new()),
            next_call: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// Names the model (`gen_ai.request.model` and `gen_ai.response.model`).
    pub fn with_model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }

    /// Reports `usage` for every answer.
    pub fn with_usage(mut self, input_tokens: u64, output_tokens: u64) -> Self {
        self.usage = Some(Usage {
            input_tokens,
            output_tokens,
        });
        self
    }

    /// Into an `Arc<dyn ModelProvider>`.
    pub fn shared(self) -> Arc<dyn ModelProvider> {
        Arc::new(self)
    }

    /// The requests received so far, in order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.requests.lock().expect("requests lock").clone()
    }

    fn answer(&self, request: ChatRequest) -> Result<ChatResponse, ModelError> {
        let step = match &self.script {
            Script::Steps(steps) => {
                steps
                    .lock()
                    .expect("script lock")
                    .pop_front()
                    .ok_or_else(|| ModelError::BadResponse {
                        detail: "the script has no more steps".into(),
                    })?
            }
            Script::Function(f) => f(&request)?,
        };
        let input_chars: usize = request
            .messages
            .iter()
            .map(|m| {
                m.text().len()
                    + m.tool_calls
                        .iter()
                        .map(|c| c.arguments.len() + c.name.len())
                        .sum::<usize>()
            })
            .sum();
        self.requests.lock().expect("requests lock").push(request);
        let (message, finish_reason) = match step {
            Step::Fail(error) => return Err(error),
            Step::Reply(text) => (ChatMessage::assistant(text), FinishReason::Stop),
            Step::ToolCalls(calls) => {
                let calls = calls
                    .into_iter()
                    .map(|(name, arguments)| {
                        let n = self
                            .next_call
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        ToolCall {
                            id: format!("call_{n}"),
                            name: crate::tool::function_name(&name).unwrap_or(name),
                            arguments,
                        }
                    })
                    .collect();
                (
                    ChatMessage::assistant_tool_calls(None, calls),
                    FinishReason::ToolCalls,
                )
            }
        };
        let output_chars = message.text().len()
            + message
                .tool_calls
                .iter()
                .map(|c| c.arguments.len() + c.name.len())
                .sum::<usize>();
        let usage = self.usage.unwrap_or(Usage {
            input_tokens: input_chars.div_ceil(4) as u64,
            output_tokens: output_chars.div_ceil(4) as u64,
        });
        Ok(ChatResponse {
            message,
            finish_reason,
            usage,
            model: self.model.clone(),
        })
    }
}

impl ModelProvider for ScriptedProvider {
    fn provider_name(&self) -> &str {
        "scripted"
    }

    fn model(&self) -> &str {
        &self.model
    }

    fn chat(&self, request: ChatRequest) -> BoxFuture<'_, Result<ChatResponse, ModelError>> {
        let answer = self.answer(request);
        Box::pin(async move { answer })
    }
}
