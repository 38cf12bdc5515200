//! CEL expressions over the task context (the `cel` crate, a maintained CEL implementation).
//!
//! Expressions see three variables:
//! - `input`: the task input;
//! - `nodes`: per node id, `{output, input, error}` of its latest visit;
//! - `task`: `{id, flow_id, flow_version, trace_id}`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cel::common::ast::{Expr as Ast, IdedExpr};
use cel::common::types::{CelBytes, CelList, CelMap, CelString};
use cel::common::value::CowVal;
use serde::{Deserialize, Serialize};

/// The bounds on every expression: its size and nesting (checked when a flow is loaded,
/// before the CEL parser, which is recursive, sees the text) and the work one evaluation may
/// do (checked while it runs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ExprLimits {
    /// The longest expression, in bytes. Default 4096.
    pub max_bytes: usize,
    /// The deepest nesting, counted conservatively: every open `(` `[` `{` and every
    /// operator (`.`, `+`, `&&`, `?`, ...) on the way to a token adds one; a `,` ends an
    /// element's operators. Default 32.
    pub max_depth: usize,
    /// The most steps (function and operator calls, comprehension iterations) one
    /// evaluation may take. Default 100000.
    pub max_steps: u64,
    /// The longest one evaluation may run. Default 1s.
    #[serde(with = "humantime_serde")]
    pub max_time: Duration,
    /// The longest string or bytes (in bytes) or list or map (in entries) an evaluation may
    /// build. Default 1000000.
    pub max_value_len: usize,
}

impl Default for ExprLimits {
    fn default() -> Self {
        Self {
            max_bytes: 4096,
            max_depth: 32,
            max_steps: 100_000,
            max_time: Duration::from_secs(1),
            max_value_len: 1_000_000,
        }
    }
}

/// Why an expression is refused before it is parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// Longer than [`ExprLimits::max_bytes`].
    #[error("expression is {bytes} bytes; the limit is {limit}")]
    TooLong {
        /// Its length.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// Nested deeper than [`ExprLimits::max_depth`].
    #[error("expression is nested {depth} deep; the limit is {limit}")]
    TooDeep {
        /// The depth reached (counting stops just past the limit).
        depth: usize,
        /// The limit.
        limit: usize,
    },
}

/// Checks `source` against the size and nesting limits with a scanner of its own (the CEL
/// parser recurses once per nesting level and per chained operator, so a long `1 + 1 + ...`
/// would overflow the stack inside it).
///
/// # Errors
/// [`LimitError::TooLong`] or [`LimitError::TooDeep`].
pub fn check_limits(source: &str, limits: &ExprLimits) -> Result<(), LimitError> {
    if source.len() > limits.max_bytes {
        return Err(LimitError::TooLong {
            bytes: source.len(),
            limit: limits.max_bytes,
        });
    }
    let depth = nesting(source, limits.max_depth);
    if depth > limits.max_depth {
        return Err(LimitError::TooDeep {
            depth,
            limit: limits.max_depth,
        });
    }
    Ok(())
}

/// The conservative nesting depth of `source` (see [`ExprLimits::max_depth`]), counted up to
/// just past `stop`.
fn nesting(source: &str, stop: usize) -> usize {
    let b = source.as_bytes();
    // Operators seen in each open bracket (the outermost level first).
    let mut frames: Vec<usize> = vec![0];
    let mut depth = 0usize;
    let mut max = 0usize;
    let mut i = 0;
    while i < b.len() && max <= stop {
        let c = b[i];
        match c {
            b'"' | b'\'' => {
                let raw = i > 0 && matches!(b[i - 1], b'r' | b'R');
                i = skip_string(b, i, raw);
                continue;
            }
            b'(' | b'[' | b'{' => {
                frames.push(0);
                depth += 1;
            }
            b')' | b']' | b'}' if frames.len() > 1 => {
                let ops = frames.pop().unwrap_or(0);
                depth = depth.saturating_sub(ops + 1);
            }
            b',' => {
                if let Some(ops) = frames.last_mut() {
                    depth = depth.saturating_sub(*ops);
                    *ops = 0;
                }
            }
            b'0'..=b'9' => {
                // A number literal, `.` and exponent sign included.
                i += 1;
                while i < b.len()
                    && (b[i].is_ascii_alphanumeric()
                        || b[i] == b'.'
                        || (matches!(b[i], b'+' | b'-') && matches!(b[i - 1], b'e' | b'E')))
                {
                    i += 1;
                }
                continue;
            }
            b'.' | b'+' | b'-' | b'*' | b'/' | b'%' | b'!' | b'<' | b'>' | b'=' | b'&' | b'|'
            | b'?' | b':' => {
                // A two-character operator (`&&`, `==`, `<=`, ...) counts once.
                if i + 1 < b.len()
                    && matches!(
                        (c, b[i + 1]),
                        (b'&', b'&') | (b'|', b'|') | (b'=' | b'!' | b'<' | b'>', b'=')
                    )
                {
                    i += 1;
                }
                if let Some(ops) = frames.last_mut() {
                    *ops += 1;
                }
                depth += 1;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                if &b[start..i] == b"in" {
                    if let Some(ops) = frames.last_mut() {
                        *ops += 1;
                    }
                    depth += 1;
                    max = max.max(depth);
                }
                continue;
            }
            _ => {}
        }
        max = max.max(depth);
        i += 1;
    }
    max
}

/// The index just past the string literal opening at `b[i]` (single, double or triple
/// quoted; escapes skipped unless `raw`).
fn skip_string(b: &[u8], i: usize, raw: bool) -> usize {
    let q = b[i];
    let triple = i + 2 < b.len() && b[i + 1] == q && b[i + 2] == q;
    let mut j = if triple { i + 3 } else { i + 1 };
    while j < b.len() {
        if b[j] == b'\\' && !raw {
            j += 2;
            continue;
        }
        if b[j] == q {
            if !triple {
                return j + 1;
            }
            if j + 2 < b.len() && b[j + 1] == q && b[j + 2] == q {
                return j + 3;
            }
        }
        j += 1;
    }
    b.len()
}

/// The name of the function every call and comprehension iteration passes through, counting
/// steps (not writable in CEL source: `@` is not an identifier character).
const STEP: &str = "@reach_step";

/// A compiled CEL expression and its source text.
#[derive(Clone)]
pub struct Expr {
    source: String,
    /// The parsed expression, every call wrapped in [`STEP`].
    ast: Arc<IdedExpr>,
    limits: ExprLimits,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Expr({:?})", self.source)
    }
}

/// Why an expression could not be evaluated.
#[derive(Debug, Clone, thiserror::Error)]
#[error("expression `{}` {message}", snippet(source_text))]
pub struct EvalError {
    /// The expression.
    pub source_text: String,
    /// What went wrong.
    pub message: String,
    /// Whether it ran out of its budget ([`ExprLimits`]) rather than failing.
    pub exhausted: bool,
}

/// `text` cut to 200 characters with `…` when longer: the form user text is echoed in
/// messages (an expression, a name), so a message stays small whatever the input.
pub fn snippet(text: &str) -> String {
    cut(text, 200)
}

/// `text` cut to `max` characters with `…` when longer.
pub use reach_rpc::errors::cut;

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

/// What one evaluation has spent, shared with the [`STEP`] function.
struct Budget {
    steps: AtomicU64,
    max_steps: u64,
    deadline: Instant,
    max_time: Duration,
    max_value_len: usize,
    /// Set once the budget is spent: the reason, kept so a swallowed error (`error || true`)
    /// still fails the evaluation.
    exceeded: std::sync::Mutex<Option<String>>,
    /// Whether `exceeded` is set: every later step fails at once.
    spent: std::sync::atomic::AtomicBool,
}

impl Budget {
    fn exceed(&self, why: String) -> cel::ExecutionError {
        self.spent.store(true, Ordering::Relaxed);
        let mut exceeded = self.exceeded.lock().expect("budget lock");
        let why = exceeded.get_or_insert(why).clone();
        cel::ExecutionError::function_error(STEP, why)
    }

    fn step(&self, value: &CowVal<'_, '_>) -> Result<(), cel::ExecutionError> {
        if self.spent.load(Ordering::Relaxed) {
            return Err(self.exceed(String::new()));
        }
        let n = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
        if n > self.max_steps {
            return Err(self.exceed(format!("{} steps", self.max_steps)));
        }
        if n.is_multiple_of(64) && Instant::now() > self.deadline {
            return Err(self.exceed(humantime::format_duration(self.max_time).to_string()));
        }
        let len = value
            .downcast_ref::<CelString>()
            .map(|s| s.inner().len())
            .or_else(|| value.downcast_ref::<CelBytes>().map(|b| b.inner().len()))
            .or_else(|| value.downcast_ref::<CelList>().map(|l| l.inner().len()))
            .or_else(|| value.downcast_ref::<CelMap>().map(|m| m.inner().len()))
            .unwrap_or(0);
        if len > self.max_value_len {
            return Err(self.exceed(format!(
                "values of {} bytes or entries (one had {len})",
                self.max_value_len
            )));
        }
        Ok(())
    }
}

type StepFunction = Box<
    dyn for<'c, 'a> Fn(
            &mut cel::FunctionContext<'c, 'a>,
        ) -> Result<CowVal<'c, 'a>, cel::ExecutionError>
        + Send
        + Sync,
>;

impl Scope {
    fn context(&self, budget: &Arc<Budget>) -> Result<cel::Context<'static, 'static>, String> {
        let mut ctx = cel::Context::default();
        for (name, value) in [
            ("input", &self.input),
            ("nodes", &self.nodes),
            ("task", &self.task),
        ] {
            let v = cel::to_value(value).map_err(|e| format!("cannot bind `{name}`: {e}"))?;
            ctx.add_variable_from_value(name, v);
        }
        let budget = budget.clone();
        let step: StepFunction = Box::new(move |ftx| {
            let value = ftx
                .args
                .pop()
                .ok_or_else(|| cel::ExecutionError::function_error(STEP, "no argument"))?;
            budget.step(&value)?;
            Ok(value)
        });
        ctx.add_function(STEP, step)
            .map_err(|e| format!("cannot set up the step budget: {e:?}"))?;
        Ok(ctx)
    }
}

// === instrumentation ===

/// Wraps `e` in a [`STEP`] call.
fn wrap(e: &mut IdedExpr, next_id: &mut u64) {
    if matches!(&e.expr, Ast::Call(c) if c.func_name == STEP) {
        return;
    }
    *next_id += 1;
    let inner = std::mem::take(e);
    *e = IdedExpr {
        id: *next_id,
        expr: Ast::Call(cel::common::ast::CallExpr {
            func_name: STEP.to_string(),
            target: None,
            args: vec![inner],
        }),
    };
}

/// Makes every call of `e` (and every comprehension iteration) pass through [`STEP`].
fn instrument(e: &mut IdedExpr, next_id: &mut u64) {
    match &mut e.expr {
        Ast::Call(call) => {
            if let Some(t) = call.target.as_deref_mut() {
                instrument(t, next_id);
            }
            for a in &mut call.args {
                instrument(a, next_id);
            }
            wrap(e, next_id);
        }
        Ast::Comprehension(c) => {
            instrument(&mut c.iter_range, next_id);
            instrument(&mut c.accu_init, next_id);
            // A literal condition (`map`, `filter`) is what the interpreter's in-place append
            // recognises: leave it, and count iterations in the step instead.
            if !matches!(c.loop_cond.expr, Ast::Literal(_)) {
                instrument(&mut c.loop_cond, next_id);
                wrap(&mut c.loop_cond, next_id);
            }
            let accu = c.accu_var.clone();
            instrument_step(&mut c.loop_step, &accu, next_id);
            instrument(&mut c.result, next_id);
        }
        Ast::List(l) => {
            for x in &mut l.elements {
                instrument(x, next_id);
            }
        }
        Ast::Map(m) => {
            for entry in &mut m.entries {
                match &mut entry.expr {
                    cel::common::ast::EntryExpr::MapEntry(me) => {
                        instrument(&mut me.key, next_id);
                        instrument(&mut me.value, next_id);
                    }
                    cel::common::ast::EntryExpr::StructField(f) => {
                        instrument(&mut f.value, next_id)
                    }
                }
            }
        }
        Ast::Struct(st) => {
            for entry in &mut st.entries {
                match &mut entry.expr {
                    cel::common::ast::EntryExpr::MapEntry(me) => {
                        instrument(&mut me.key, next_id);
                        instrument(&mut me.value, next_id);
                    }
                    cel::common::ast::EntryExpr::StructField(f) => {
                        instrument(&mut f.value, next_id)
                    }
                }
            }
        }
        Ast::Select(s) => instrument(&mut s.operand, next_id),
        Ast::Ident(_) | Ast::Literal(_) | Ast::Unspecified => {}
    }
}

/// Instruments a comprehension's loop step, keeping the shape the interpreter's fast paths
/// recognise (`@result && x`, `@result + [x]`, `c ? @result + [x] : @result`): a call that
/// takes the accumulator itself is left unwrapped, and what it combines the accumulator with
/// is wrapped, so every iteration counts.
fn instrument_step(e: &mut IdedExpr, accu: &str, next_id: &mut u64) {
    let is_accu = |x: &IdedExpr| matches!(&x.expr, Ast::Ident(n) if n == accu);
    let mentions = |x: &IdedExpr| match &x.expr {
        Ast::Call(c) => c.args.iter().any(|a| match &a.expr {
            Ast::Ident(n) => n == accu,
            Ast::Call(inner) => inner
                .args
                .iter()
                .any(|a| matches!(&a.expr, Ast::Ident(n) if n == accu)),
            _ => false,
        }),
        _ => false,
    };
    if !mentions(e) {
        instrument(e, next_id);
        wrap(e, next_id);
        return;
    }
    let Ast::Call(call) = &mut e.expr else { return };
    for a in &mut call.args {
        if is_accu(a) {
            continue;
        }
        if let Ast::List(l) = &mut a.expr {
            for x in &mut l.elements {
                instrument(x, next_id);
                wrap(x, next_id);
            }
        } else {
            instrument_step(a, accu, next_id);
        }
    }
}

fn max_id(e: &IdedExpr) -> u64 {
    let mut max = e.id;
    let mut visit = |x: &IdedExpr| max = max.max(max_id(x));
    match &e.expr {
        Ast::Call(c) => {
            if let Some(t) = &c.target {
                visit(t);
            }
            c.args.iter().for_each(&mut visit);
        }
        Ast::Comprehension(c) => {
            for x in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                visit(x);
            }
        }
        Ast::List(l) => l.elements.iter().for_each(&mut visit),
        Ast::Map(m) => {
            for entry in &m.entries {
                if let cel::common::ast::EntryExpr::MapEntry(me) = &entry.expr {
                    visit(&me.key);
                    visit(&me.value);
                }
            }
        }
        Ast::Select(s) => visit(&s.operand),
        Ast::Struct(_) | Ast::Ident(_) | Ast::Literal(_) | Ast::Unspecified => {}
    }
    max
}

impl Expr {
    /// Compiles `source` with the default [`ExprLimits`].
    ///
    /// # Errors
    /// As [`Expr::compile_with`].
    pub fn compile(source: &str) -> Result<Self, String> {
        Self::compile_with(source, &ExprLimits::default())
    }

    /// Compiles `source`, refusing it first when it is longer or nested deeper than
    /// `limits` allow; evaluations then spend at most `limits`' steps, time and value size.
    ///
    /// # Errors
    /// The limit exceeded ([`LimitError`]'s message), or the CEL parser's message with line
    /// and column inside the expression.
    pub fn compile_with(source: &str, limits: &ExprLimits) -> Result<Self, String> {
        check_limits(source, limits).map_err(|e| e.to_string())?;
        let mut ast = cel::parser::Parser::default().parse(source).map_err(|e| {
            e.errors
                .iter()
                .take(5)
                .map(|e| format!("at {}:{}: {}", e.pos.0, e.pos.1, snippet(&e.msg)))
                .collect::<Vec<_>>()
                .join("; ")
        })?;
        let mut next_id = max_id(&ast);
        instrument(&mut ast, &mut next_id);
        Ok(Self {
            source: source.to_string(),
            ast: Arc::new(ast),
            limits: *limits,
        })
    }

    /// The source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates to JSON, within the budget of its [`ExprLimits`].
    ///
    /// # Errors
    /// [`EvalError`] when a variable or key is missing or an operator does not apply, and
    /// with `exhausted` set when the evaluation ran out of steps, time or value size.
    pub fn eval(&self, scope: &Scope) -> Result<serde_json::Value, EvalError> {
        let err = |message: String| EvalError {
            source_text: self.source.clone(),
            message,
            exhausted: false,
        };
        let budget = Arc::new(Budget {
            steps: AtomicU64::new(0),
            max_steps: self.limits.max_steps,
            deadline: Instant::now() + self.limits.max_time,
            max_time: self.limits.max_time,
            max_value_len: self.limits.max_value_len,
            exceeded: std::sync::Mutex::new(None),
            spent: std::sync::atomic::AtomicBool::new(false),
        });
        let ctx = scope.context(&budget).map_err(err)?;
        let value = cel::Value::resolve(&self.ast, &ctx);
        if let Some(why) = budget.exceeded.lock().expect("budget lock").clone() {
            return Err(EvalError {
                source_text: self.source.clone(),
                message: format!("exceeded its evaluation budget of {why}"),
                exhausted: true,
            });
        }
        let value = value.map_err(|e| err(format!("failed: {}", snippet(&e.to_string()))))?;
        value.json().map_err(|e| {
            err(format!(
                "gave a value that is not JSON: {}",
                snippet(&format!("{e:?}"))
            ))
        })
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
                message: format!(
                    "gave {} where true or false was expected",
                    snippet(&other.to_string())
                ),
                exhausted: false,
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

/// The first string of a template `value` that is longer or nested deeper than `limits`
/// allow.
pub fn template_limit_error(value: &serde_json::Value, limits: &ExprLimits) -> Option<LimitError> {
    match value {
        serde_json::Value::String(s) => check_limits(s, limits).err(),
        serde_json::Value::Array(items) => {
            items.iter().find_map(|v| template_limit_error(v, limits))
        }
        serde_json::Value::Object(map) => {
            map.values().find_map(|v| template_limit_error(v, limits))
        }
        _ => None,
    }
}

impl InputTemplate {
    /// Compiles every string of `value` as CEL with the default [`ExprLimits`].
    ///
    /// # Errors
    /// The first expression that does not compile.
    pub fn compile(value: &serde_json::Value) -> Result<Self, String> {
        Self::compile_with(value, &ExprLimits::default())
    }

    /// Compiles every string of `value` as CEL within `limits` ([`Expr::compile_with`]).
    ///
    /// # Errors
    /// The first expression that does not compile, echoed at most 200 characters long.
    pub fn compile_with(value: &serde_json::Value, limits: &ExprLimits) -> Result<Self, String> {
        Ok(match value {
            serde_json::Value::String(s) => InputTemplate::Expr(
                Expr::compile_with(s, limits).map_err(|e| format!("`{}`: {e}", snippet(s)))?,
            ),
            serde_json::Value::Array(items) => InputTemplate::List(
                items
                    .iter()
                    .map(|v| Self::compile_with(v, limits))
                    .collect::<Result<_, _>>()?,
            ),
            serde_json::Value::Object(map) => InputTemplate::Object(
                map.iter()
                    .map(|(k, v)| Ok((k.clone(), Self::compile_with(v, limits)?)))
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

    /// Size and nesting are refused before the (recursive) CEL parser sees the text: ten
    /// thousand chained terms would overflow its stack.
    #[test]
    fn long_or_deep_expressions_are_refused_before_parsing() {
        let limits = ExprLimits::default();
        let long = "1 + ".repeat(10_000) + "1";
        assert_eq!(
            Expr::compile(&long).unwrap_err(),
            "expression is 40001 bytes; the limit is 4096"
        );
        let wide = ExprLimits {
            max_bytes: 1 << 20,
            ..limits
        };
        let err = Expr::compile_with(&long, &wide).unwrap_err();
        assert_eq!(err, "expression is nested 33 deep; the limit is 32");
        let parens = "(".repeat(40) + "1" + &")".repeat(40);
        assert!(
            Expr::compile(&parens)
                .unwrap_err()
                .contains("nested 33 deep")
        );
        let bangs = "!".repeat(40) + "true";
        assert!(Expr::compile(&bangs).unwrap_err().contains("nested"));
        // Within the limits: operators in strings and number literals do not count, and a
        // list's elements do not add up.
        let list = format!("[{}].size() > 2", vec!["1.5e+3 + 1"; 300].join(", "));
        assert!(Expr::compile(&list).is_ok());
        assert!(Expr::compile(&format!("'{}' == input.s", "+ ".repeat(100))).is_ok());
        let chain = ["input.n == 1"; 10].join(" || ");
        assert!(Expr::compile(&chain).is_ok(), "{chain}");
    }

    /// A condition that would take 10⁹ steps stops at its budget, and says so.
    #[test]
    fn evaluations_stop_at_their_budget() {
        let list = format!(
            "[{}]",
            (0..1000)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let source = format!("{list}.all(x, {list}.all(y, {list}.all(z, true)))");
        // Time generous enough that the steps run out first, even on a loaded machine.
        let limits = ExprLimits {
            max_bytes: 1 << 20,
            max_time: Duration::from_secs(60),
            ..ExprLimits::default()
        };
        let e = Expr::compile_with(&source, &limits).unwrap();
        let started = Instant::now();
        let err = e.eval_bool(&Scope::default()).unwrap_err();
        assert!(err.exhausted, "{err}");
        assert!(
            err.message == "exceeded its evaluation budget of 100000 steps",
            "{}",
            err.message
        );
        assert!(started.elapsed() < Duration::from_secs(30));
        // An error swallowed by `||` still fails the evaluation.
        let e = Expr::compile_with(
            &format!("{list}.all(x, {list}.all(y, true)) || true"),
            &limits,
        )
        .unwrap();
        assert!(e.eval_bool(&Scope::default()).unwrap_err().exhausted);
        // Time: a budget of steps too large to matter, and a short time.
        let timed = ExprLimits {
            max_steps: u64::MAX,
            max_time: Duration::from_millis(50),
            ..limits
        };
        let e = Expr::compile_with(&source, &timed).unwrap();
        let err = e.eval_bool(&Scope::default()).unwrap_err();
        assert_eq!(err.message, "exceeded its evaluation budget of 50ms");
        // Values: a string doubled past the limit.
        let small = ExprLimits {
            max_value_len: 1000,
            ..limits
        };
        let e = Expr::compile_with("[1, 2, 3].map(x, input.s + input.s)", &small).unwrap();
        let scope = Scope {
            input: json!({"s": "x".repeat(600)}),
            ..Scope::default()
        };
        let err = e.eval(&scope).unwrap_err();
        assert!(
            err.exhausted && err.message.contains("one had 1200"),
            "{err}"
        );
        // Budgets do not change results: map, filter, exists and friends.
        let scope = Scope {
            input: json!({"items": [1, 2, 3, 4]}),
            ..Scope::default()
        };
        for (source, want) in [
            (
                "input.items.map(x, x > 2)",
                json!([false, false, true, true]),
            ),
            ("input.items.filter(x, x > 2)", json!([3, 4])),
            ("input.items.exists(x, x > 3)", json!(true)),
            ("input.items.exists_one(x, x > 3)", json!(true)),
            ("input.items.all(x, x > 0) && has(input.items)", json!(true)),
            ("size(input.items) == 4 ? 'four' : 'other'", json!("four")),
        ] {
            assert_eq!(
                Expr::compile(source).unwrap().eval(&scope).unwrap(),
                want,
                "{source}"
            );
        }
    }

    #[test]
    fn snippets_are_cut_at_200_characters() {
        assert_eq!(snippet("short"), "short");
        let cut = snippet(&"é".repeat(300));
        assert_eq!(cut.chars().count(), 201);
        assert!(cut.ends_with('…'));
    }
}
