//! CEL expressions over the task context (the `cel` crate, a maintained CEL implementation).
//!
//! Expressions see three variables:
//! - `input`: the task input;
//! - `nodes`: per node id, `{output, input, error}` of its latest visit;
//! - `task`: `{id, flow_id, flow_version, trace_id}`.

use std::sync::Arc;

/// A compiled CEL expression and its source text.
#[derive(Clone)]
pub struct Expr {
    source: String,
    program: Arc<cel::Program>,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Expr({:?})", self.source)
    }
}

/// Why an expression could not be evaluated.
#[derive(Debug, Clone, thiserror::Error)]
#[error("expression `{source_text}` {message}")]
pub struct EvalError {
    /// The expression.
    pub source_text: String,
    /// What went wrong.
    pub message: String,
}

/// The variables an expression is evaluated against.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// `input`.
    pub input: serde_json::Value,
    /// `nodes`.
    pub nodes: serde_json::Value,
    /// `task`.
    pub task: serde_json::Value,
}

impl Scope {
    fn context(&self) -> Result<cel::Context<'static, 'static>, String> {
        let mut ctx = cel::Context::default();
        for (name, value) in [
            ("input", &self.input),
            ("nodes", &self.nodes),
            ("task", &self.task),
        ] {
            let v = cel::to_value(value).map_err(|e| format!("cannot bind `{name}`: {e}"))?;
            ctx.add_variable_from_value(name, v);
        }
        Ok(ctx)
    }
}

impl Expr {
    /// Compiles `source`.
    ///
    /// # Errors
    /// The CEL parser's message, with line and column inside the expression.
    pub fn compile(source: &str) -> Result<Self, String> {
        let program = cel::Program::compile(source).map_err(|e| {
            e.errors
                .iter()
                .map(|e| format!("at {}:{}: {}", e.pos.0, e.pos.1, e.msg))
                .collect::<Vec<_>>()
                .join("; ")
        })?;
        Ok(Self {
            source: source.to_string(),
            program: Arc::new(program),
        })
    }

    /// The source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates to JSON.
    ///
    /// # Errors
    /// [`EvalError`] when a variable or key is missing or an operator does not apply.
    pub fn eval(&self, scope: &Scope) -> Result<serde_json::Value, EvalError> {
        let err = |message: String| EvalError {
            source_text: self.source.clone(),
            message,
        };
        let ctx = scope.context().map_err(err)?;
        let value = self
            .program
            .execute(&ctx)
            .map_err(|e| err(format!("failed: {e}")))?;
        value
            .json()
            .map_err(|e| err(format!("gave a value that is not JSON: {e:?}")))
    }

    /// Evaluates to a boolean.
    ///
    /// # Errors
    /// [`EvalError`] when evaluation fails or the result is not a boolean.
    pub fn eval_bool(&self, scope: &Scope) -> Result<bool, EvalError> {
        match self.eval(scope)? {
            serde_json::Value::Bool(b) => Ok(b),
            other => Err(EvalError {
                source_text: self.source.clone(),
                message: format!("gave {other} where true or false was expected"),
            }),
        }
    }
}

/// A node input built from the task context: a JSON value in which every string is a CEL
/// expression (write literal text as a quoted CEL string: `"'text'"`).
#[derive(Debug, Clone)]
pub enum InputTemplate {
    /// An expression.
    Expr(Expr),
    /// A literal number, boolean or null.
    Literal(serde_json::Value),
    /// A list of templates.
    List(Vec<InputTemplate>),
    /// An object of templates.
    Object(Vec<(String, InputTemplate)>),
}

impl InputTemplate {
    /// Compiles every string of `value` as CEL.
    ///
    /// # Errors
    /// The first expression that does not compile.
    pub fn compile(value: &serde_json::Value) -> Result<Self, String> {
        Ok(match value {
            serde_json::Value::String(s) => {
                InputTemplate::Expr(Expr::compile(s).map_err(|e| format!("`{s}`: {e}"))?)
            }
            serde_json::Value::Array(items) => {
                InputTemplate::List(items.iter().map(Self::compile).collect::<Result<_, _>>()?)
            }
            serde_json::Value::Object(map) => InputTemplate::Object(
                map.iter()
                    .map(|(k, v)| Ok((k.clone(), Self::compile(v)?)))
                    .collect::<Result<_, String>>()?,
            ),
            other => InputTemplate::Literal(other.clone()),
        })
    }

    /// Builds the input.
    ///
    /// # Errors
    /// The first expression that fails.
    pub fn render(&self, scope: &Scope) -> Result<serde_json::Value, EvalError> {
        Ok(match self {
            InputTemplate::Expr(e) => e.eval(scope)?,
            InputTemplate::Literal(v) => v.clone(),
            InputTemplate::List(items) => serde_json::Value::Array(
                items
                    .iter()
                    .map(|t| t.render(scope))
                    .collect::<Result<_, _>>()?,
            ),
            InputTemplate::Object(fields) => serde_json::Value::Object(
                fields
                    .iter()
                    .map(|(k, t)| Ok((k.clone(), t.render(scope)?)))
                    .collect::<Result<_, EvalError>>()?,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn evaluates_over_the_context() {
        let scope = Scope {
            input: json!({"text": "hi"}),
            nodes: json!({"classify": {"output": {"confidence": 0.3, "category": "servicing"}}}),
            task: json!({"id": "t1"}),
        };
        assert!(
            Expr::compile("nodes.classify.output.confidence < 0.5")
                .unwrap()
                .eval_bool(&scope)
                .unwrap()
        );
        assert!(
            Expr::compile("nodes.classify.output.category == 'servicing'")
                .unwrap()
                .eval_bool(&scope)
                .unwrap()
        );
        assert!(
            Expr::compile("nodes.missing.output.x == 1")
                .unwrap()
                .eval_bool(&scope)
                .is_err()
        );
        assert!(Expr::compile("1 +").is_err());
        let t = InputTemplate::compile(
            &json!({"text": "input.text", "n": 3, "c": "nodes.classify.output"}),
        )
        .unwrap();
        assert_eq!(
            t.render(&scope).unwrap(),
            json!({"text": "hi", "n": 3, "c": {"confidence": 0.3, "category": "servicing"}})
        );
    }
}
