//! Tools: declared from a Rust argument type and an async function (schemas generated with
//! `schemars`), or dynamically from JSON Schemas (mesh tools); held by a [`ToolRegistry`]
//! that lists them in the OpenAI `tools` format.
//!
//! ```
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use reach_agent::tool::{Tool, ToolContext, ToolRegistry};
//!
//! /// Arguments of `weather.current`.
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Args {
//!     /// The city, e.g. "Paris".
//!     city: String,
//! }
//! #[derive(serde::Serialize, schemars::JsonSchema)]
//! struct Out { celsius: f64 }
//!
//! let tool = Tool::from_fn::<Args, Out, _, _>(
//!     "weather.current",
//!     "The current temperature in a city. Use it for today's weather; not for forecasts.",
//!     |args: Args, _ctx: ToolContext| async move { Ok(Out { celsius: 21.5 }) },
//! )?;
//! let tools = ToolRegistry::new().with(tool)?;
//! assert_eq!(tools.specs()[0].name, "weather__current");
//! # Ok(()) }
//! ```
//!
//! # Names
//! OpenAI function names must match `^[a-zA-Z0-9_-]{1,64}$`; capabilities are dotted
//! (`complaint.classify`). [`function_name`] maps a dot to `__` (`complaint__classify`) and
//! [`capability_name`] maps back. So the mapping is reversible, a dotted name's segments may
//! not start or end with `_` nor contain `__`, and an undotted name may not contain `__`;
//! other characters than `A-Z a-z 0-9 _ - .` are refused, as is a mapped name over 64
//! characters.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::time::Instant;
use tracing::Instrument;

use crate::provider::ToolSpec;
use crate::repair::{ArgumentSchema, Prepared};
use crate::result::{ToolError, ToolErrorCode, ToolResult, json_safe};

/// What a tool's handler knows about the call: the agent's trace and task (mesh tools
/// continue them), its deadline, and the model's call id.
#[derive(Debug, Clone, Default)]
pub struct ToolContext {
    /// The W3C trace id (32 lowercase hex) of the agent's task; "" when none.
    pub trace_id: String,
    /// The task id; "" when none.
    pub task_id: String,
    /// When the call must be done by (the agent's deadline); `None`: no deadline.
    pub deadline: Option<Instant>,
    /// The envelope `turn` a mesh call made by the tool carries: the run's incoming turn
    /// plus the loop turn that asked for the call (see [`crate::RunContext::turn`]).
    pub turn: u32,
    /// The model's tool call id ("" outside a model loop).
    pub call_id: String,
    /// The tool's name (dotted capability form).
    pub tool: String,
}

impl ToolContext {
    /// The time left before the deadline (`None` without one; zero when past).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }
}

/// A dynamic tool's handler: valid arguments in, JSON data out.
pub type ToolHandler =
    Arc<dyn Fn(Value, ToolContext) -> BoxFuture<'static, Result<Value, ToolError>> + Send + Sync>;

/// Why a tool cannot be declared or registered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ToolDefinitionError {
    /// The name cannot be an OpenAI function name.
    #[error("tool name {name:?} is invalid: {reason}")]
    InvalidName {
        /// The name.
        name: String,
        /// Why.
        reason: String,
    },
    /// A schema does not compile.
    #[error("tool {name:?}: the {which} schema is not a valid JSON Schema: {detail}")]
    Schema {
        /// The tool.
        name: String,
        /// `input` or `output`.
        which: &'static str,
        /// The compiler's message.
        detail: String,
    },
    /// Two tools have the same name.
    #[error(
        "a tool named {name:?} (function {function:?}) is already registered; tool names must be unique"
    )]
    Duplicate {
        /// The name.
        name: String,
        /// Its function name.
        function: String,
    },
}

/// A tool: name, description, input and output schemas, and a handler.
///
/// Cheap to clone.
#[derive(Clone)]
pub struct Tool {
    name: String,
    function: String,
    description: String,
    input: ArgumentSchema,
    output_schema: Option<Value>,
    output_validator: Option<Arc<jsonschema::Validator>>,
    handler: ToolHandler,
}

impl std::fmt::Debug for Tool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.name)
            .field("function", &self.function)
            .finish_non_exhaustive()
    }
}

/// The JSON Schema (draft 2020-12, subschemas inlined where possible) of `T`: doc comments
/// become `description`s, `Option` fields are not `required` and accept `null`,
/// `#[serde(default)]` fields carry their `default`, unit enums become `enum`s,
/// `deny_unknown_fields` becomes `additionalProperties: false`.
pub fn schema_for<T: JsonSchema>() -> Value {
    let generator = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    generator.into_root_schema_for::<T>().to_value()
}

impl Tool {
    /// A tool from an argument type `A`, an output type `O` and an async function. The input
    /// schema is `schema_for::<A>()`, the output schema `schema_for::<O>()`; `description`
    /// should say what it does, when to use it and when not (see [`Tool::with_usage`]).
    ///
    /// The handler gets `A` deserialised from the validated, repaired arguments; its output
    /// is made JSON ([`json_safe`]) and validated against the output schema.
    ///
    /// # Errors
    /// [`ToolDefinitionError`] for an invalid name or schema.
    pub fn from_fn<A, O, F, Fut>(
        name: impl Into<String>,
        description: impl Into<String>,
        f: F,
    ) -> Result<Tool, ToolDefinitionError>
    where
        A: DeserializeOwned + JsonSchema + Send + 'static,
        O: Serialize + JsonSchema + Send + 'static,
        F: Fn(A, ToolContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, ToolError>> + Send + 'static,
    {
        let f = Arc::new(f);
        let handler: ToolHandler = Arc::new(move |value: Value, ctx: ToolContext| {
            let f = f.clone();
            Box::pin(async move {
                let args: A = serde_json::from_value(value).map_err(|e| {
                    ToolError::new(
                        ToolErrorCode::InvalidArguments,
                        format!("the arguments do not fit the tool's types: {e}"),
                    )
                })?;
                let out = f(args, ctx).await?;
                json_safe(&out)
            })
        });
        Self::dynamic_with(
            name.into(),
            description.into(),
            schema_for::<A>(),
            Some(schema_for::<O>()),
            handler,
        )
    }

    /// A tool from JSON Schemas and a handler over JSON (used for mesh tools).
    ///
    /// # Errors
    /// [`ToolDefinitionError`] for an invalid name or schema.
    pub fn dynamic<F, Fut>(
        name: impl Into<String>,
        description: impl Into<String>,
        input_schema: Value,
        output_schema: Option<Value>,
        handler: F,
    ) -> Result<Tool, ToolDefinitionError>
    where
        F: Fn(Value, ToolContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, ToolError>> + Send + 'static,
    {
        let handler: ToolHandler = Arc::new(move |value, ctx| Box::pin(handler(value, ctx)));
        Self::dynamic_with(
            name.into(),
            description.into(),
            input_schema,
            output_schema,
            handler,
        )
    }

    fn dynamic_with(
        name: String,
        description: String,
        input_schema: Value,
        output_schema: Option<Value>,
        handler: ToolHandler,
    ) -> Result<Tool, ToolDefinitionError> {
        let function = function_name(&name)?;
        let input = ArgumentSchema::new(input_schema).map_err(|e| ToolDefinitionError::Schema {
            name: name.clone(),
            which: "input",
            detail: e.0,
        })?;
        let output_validator = match &output_schema {
            Some(schema) => Some(Arc::new(crate::repair::compile(schema).map_err(|e| {
                ToolDefinitionError::Schema {
                    name: name.clone(),
                    which: "output",
                    detail: e.0,
                }
            })?)),
            None => None,
        };
        Ok(Tool {
            name,
            function,
            description,
            input,
            output_schema,
            output_validator,
            handler,
        })
    }

    /// Appends "Use it when: ... Do not use it when: ..." to the description.
    pub fn with_usage(mut self, use_when: &str, avoid_when: &str) -> Self {
        self.description = format!(
            "{} Use it when: {use_when}. Do not use it when: {avoid_when}.",
            self.description.trim_end()
        );
        self
    }

    /// The name (dotted capability form allowed).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OpenAI function name ([`function_name`] of the name).
    pub fn function_name(&self) -> &str {
        &self.function
    }

    /// The description.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The input JSON Schema.
    pub fn input_schema(&self) -> &Value {
        self.input.schema()
    }

    /// The compiled input schema (validation and repair).
    pub fn arguments(&self) -> &ArgumentSchema {
        &self.input
    }

    /// The output JSON Schema, when declared.
    pub fn output_schema(&self) -> Option<&Value> {
        self.output_schema.as_ref()
    }

    /// The OpenAI function definition (the input schema without `$schema`).
    pub fn spec(&self) -> ToolSpec {
        let mut parameters = self.input.schema().clone();
        if let Some(map) = parameters.as_object_mut() {
            map.remove("$schema");
        }
        ToolSpec {
            name: self.function.clone(),
            description: self.description.clone(),
            parameters,
        }
    }

    /// Runs the tool on the model's argument text: reads, repairs and validates it, calls the
    /// handler (within the context's deadline) and validates the output. Never fails: every
    /// outcome is a [`ToolResult`]. Runs in a `tool.call` span (fields `gen_ai.tool.name`,
    /// `gen_ai.tool.call.id`, `tool.status`, `tool.repairs`; a `tool.repairs` event lists
    /// the repairs), which handlers' own spans (mesh calls) are children of.
    pub async fn call(&self, arguments: &str, ctx: ToolContext) -> ToolResult {
        let span = self.span(&ctx);
        let started = Instant::now();
        let prepared = span.in_scope(|| self.input.prepare(arguments));
        self.finish(prepared.map_err(ToolError::from), ctx, started, span)
            .await
    }

    /// Like [`Tool::call`] for arguments already parsed (a mesh request's data part).
    pub async fn call_value(&self, arguments: Value, ctx: ToolContext) -> ToolResult {
        let span = self.span(&ctx);
        let started = Instant::now();
        let prepared = span.in_scope(|| self.input.repair(arguments));
        self.finish(prepared.map_err(ToolError::from), ctx, started, span)
            .await
    }

    fn span(&self, ctx: &ToolContext) -> tracing::Span {
        tracing::info_span!(
            "tool.call",
            otel.name = %format!("execute_tool {}", self.name),
            gen_ai.operation.name = "execute_tool",
            gen_ai.tool.name = %self.name,
            gen_ai.tool.call.id = %ctx.call_id,
            task_id = %ctx.task_id,
            tool.status = tracing::field::Empty,
            tool.repairs = tracing::field::Empty,
            otel.status_code = tracing::field::Empty,
        )
    }

    async fn finish(
        &self,
        prepared: Result<Prepared, ToolError>,
        mut ctx: ToolContext,
        started: Instant,
        span: tracing::Span,
    ) -> ToolResult {
        let elapsed =
            |started: Instant| u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let prepared = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                span.record("tool.status", "error");
                span.record("otel.status_code", "ERROR");
                tracing::debug!(parent: &span, tool = %self.name, error = %error.message, "tool arguments refused");
                return ToolResult::error(error, elapsed(started));
            }
        };
        span.record("tool.repairs", prepared.repairs.len());
        if !prepared.repairs.is_empty() {
            let repairs = serde_json::to_string(&prepared.repairs).unwrap_or_default();
            tracing::info!(name: "tool.repairs", parent: &span, repairs = %repairs, count = prepared.repairs.len(), "tool arguments repaired");
        }
        if ctx.tool.is_empty() {
            ctx.tool = self.name.clone();
        }
        let deadline = ctx.deadline;
        let run = (self.handler)(prepared.value, ctx).instrument(span.clone());
        let outcome = match deadline {
            Some(deadline) => match tokio::time::timeout_at(deadline, run).await {
                Ok(outcome) => outcome,
                Err(_) => Err(ToolError::new(
                    ToolErrorCode::Timeout,
                    "the tool did not finish before the agent's deadline",
                )),
            },
            None => run.await,
        };
        let outcome = outcome.and_then(|data| self.check_output(data));
        let mut result = match outcome {
            Ok(data) => ToolResult::ok(data, elapsed(started)),
            Err(error) => ToolResult::error(error, elapsed(started)),
        };
        result.metadata.repairs = prepared.repairs;
        let status = if result.is_ok() { "ok" } else { "error" };
        span.record("tool.status", status);
        if !result.is_ok() {
            span.record("otel.status_code", "ERROR");
        }
        result
    }

    fn check_output(&self, data: Value) -> Result<Value, ToolError> {
        let Some(validator) = &self.output_validator else {
            return Ok(data);
        };
        let problems: Vec<crate::repair::Violation> = validator
            .iter_errors(&data)
            .map(|e| {
                let null_number = e.instance().is_null() && e.kind().keyword() == "type";
                crate::repair::Violation {
                    pointer: e.instance_path().to_string(),
                    keyword: e.kind().keyword().to_string(),
                    schema_path: e.schema_path().to_string(),
                    expected: if null_number {
                        format!("{e} (a non-finite float, NaN or infinity, is written as null)")
                    } else {
                        e.to_string()
                    },
                }
            })
            .collect();
        if problems.is_empty() {
            return Ok(data);
        }
        let fields: Vec<String> = problems
            .iter()
            .map(|v| format!("{}: {}", v.pointer, v.expected))
            .collect();
        Err(ToolError {
            code: ToolErrorCode::InvalidOutput,
            message: format!(
                "the tool's output does not match its output schema: {}",
                fields.join("; ")
            ),
            violations: problems,
        })
    }
}

// === names ===

/// The OpenAI function name of a tool or capability name: dots become `__`
/// (`complaint.classify` → `complaint__classify`). See the module docs for the rules.
///
/// # Errors
/// [`ToolDefinitionError::InvalidName`] saying which rule the name breaks.
pub fn function_name(name: &str) -> Result<String, ToolDefinitionError> {
    let invalid = |reason: &str| ToolDefinitionError::InvalidName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() {
        return Err(invalid("it is empty"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(invalid(&format!(
            "{c:?} is not allowed; use A-Z a-z 0-9 _ - and dots"
        )));
    }
    if name.contains('.') {
        for segment in name.split('.') {
            if segment.is_empty() {
                return Err(invalid("it has an empty dotted segment"));
            }
            if segment.starts_with('_') || segment.ends_with('_') || segment.contains("__") {
                return Err(invalid(
                    "a dotted name's segments may not start or end with '_' nor contain \"__\" (\"__\" stands for '.' in function names)",
                ));
            }
        }
    } else if name.contains("__") {
        return Err(invalid(
            "\"__\" is reserved: it stands for '.' in function names",
        ));
    }
    let function = name.replace('.', "__");
    if function.len() > 64 {
        return Err(invalid(&format!(
            "its function name {function:?} is {} characters, over OpenAI's 64",
            function.len()
        )));
    }
    Ok(function)
}

/// The tool or capability name of an OpenAI function name: `__` becomes a dot.
pub fn capability_name(function: &str) -> String {
    function.replace("__", ".")
}

// === registry ===

/// The tools an agent offers, by name and function name.
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: Vec<Tool>,
    by_function: HashMap<String, usize>,
}

impl ToolRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `tool` (builder form).
    ///
    /// # Errors
    /// [`ToolDefinitionError::Duplicate`] when its name is taken.
    pub fn with(mut self, tool: Tool) -> Result<Self, ToolDefinitionError> {
        self.add(tool)?;
        Ok(self)
    }

    /// Adds `tool`.
    ///
    /// # Errors
    /// [`ToolDefinitionError::Duplicate`] when its name is taken.
    pub fn add(&mut self, tool: Tool) -> Result<(), ToolDefinitionError> {
        if self.by_function.contains_key(tool.function_name()) {
            return Err(ToolDefinitionError::Duplicate {
                name: tool.name.clone(),
                function: tool.function.clone(),
            });
        }
        self.by_function
            .insert(tool.function.clone(), self.tools.len());
        self.tools.push(tool);
        Ok(())
    }

    /// The tool with this function name or (dotted) name.
    pub fn get(&self, name: &str) -> Option<&Tool> {
        let index = self.by_function.get(name).or_else(|| {
            function_name(name)
                .ok()
                .and_then(|f| self.by_function.get(&f))
        })?;
        self.tools.get(*index)
    }

    /// The tools in registration order.
    pub fn iter(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter()
    }

    /// How many tools.
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// The function definitions, in registration order.
    pub fn specs(&self) -> Vec<ToolSpec> {
        self.tools.iter().map(Tool::spec).collect()
    }

    /// The OpenAI `tools` array:
    /// `[{"type":"function","function":{"name","description","parameters"}}]`.
    pub fn openai_tools(&self) -> Value {
        Value::Array(self.specs().iter().map(ToolSpec::to_openai).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways_and_bad_ones_are_refused() {
        for name in ["complaint.classify", "get_weather", "a-b.c-d", "x.y.z"] {
            let f = function_name(name).unwrap();
            assert_eq!(capability_name(&f), name);
        }
        assert_eq!(
            function_name("complaint.classify").unwrap(),
            "complaint__classify"
        );
        for bad in ["a__b", "a._b", "a_.b", "a..b", "has space", "", "a/b"] {
            assert!(function_name(bad).is_err(), "{bad}");
        }
        assert!(function_name(&"x".repeat(65)).is_err());
    }
}
