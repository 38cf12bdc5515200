//! The flow model, its YAML loader and validation.
//!
//! A flow is one YAML file: `id`, `version`, `initial`, `states` (a map of node id to node).
//! Every node has a `type` (`task`, `condition`, `human`, `parallel`, `wait`, `succeed`,
//! `fail`) and the fields that type uses; `timeout`, `retry` and `catch` apply per node.
//! [`Flow::parse`] reports every problem at once, each with the file, line and column and
//! what to change ([`FlowErrors`]); a flow that fails validation is never returned.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use reach_rpc::backoff::Exponential;
use serde::Deserialize;
use tonic::Code;

use crate::expr::{
    Expr, ExprLimits, InputTemplate, check_limits, cut, snippet, template_limit_error,
};
use crate::failure::{code_from_name, code_name};

/// gRPC codes a retry policy retries when it lists none.
pub const DEFAULT_RETRY_CODES: [Code; 6] = [
    Code::Unavailable,
    Code::DeadlineExceeded,
    Code::ResourceExhausted,
    Code::Aborted,
    Code::Unknown,
    Code::Internal,
];

/// A validated flow. Immutable; shared as `Arc<Flow>`.
#[derive(Debug)]
pub struct Flow {
    /// The flow id (`[a-z0-9._-]+`).
    pub id: String,
    /// The version; tasks keep the version they started with.
    pub version: u32,
    /// The first node.
    pub initial: String,
    /// A free-form description.
    pub description: Option<String>,
    /// The nodes by id.
    pub nodes: BTreeMap<String, Node>,
    /// Where the flow came from (a file name or `api`).
    pub source: String,
    /// The YAML text it was parsed from (stored, so restarts rebuild the same flow).
    pub yaml: String,
}

/// One node of a flow.
#[derive(Debug)]
pub struct Node {
    /// The node id.
    pub id: String,
    /// What the node does.
    pub kind: NodeKind,
    /// Per attempt for `task` and `parallel` branches, for the whole wait in `human`.
    pub timeout: Option<Duration>,
    /// How failed attempts of `task` / `parallel` branches are retried.
    pub retry: RetryPolicy,
    /// Where to go when the node fails for good; without it the task fails.
    pub catch: Option<String>,
}

/// The node types.
#[derive(Debug)]
pub enum NodeKind {
    /// Calls `capability` through the router and stores the reply's first data part.
    Task {
        /// The capability to call.
        capability: String,
        /// How to build the input; `None` sends the task input.
        input: Option<InputTemplate>,
        /// The node after success.
        next: String,
    },
    /// Goes to the `next` of the first `if` that holds, else to `default`.
    Condition {
        /// `(expression, next)` in order.
        branches: Vec<(Expr, String)>,
        /// The node when no expression holds.
        default: String,
    },
    /// Pauses until ResumeTask.
    Human {
        /// The node after resume.
        next: String,
        /// The JSON Schema the resume input must satisfy.
        schema: Option<Arc<jsonschema::Validator>>,
        /// That schema as the flow gives it, to show the person (GetTask's `waiting`).
        schema_source: Option<serde_json::Value>,
        /// A message for the person.
        prompt: Option<String>,
        /// Where to go when the task is cancelled while waiting here.
        on_cancel: Option<String>,
    },
    /// Runs branches concurrently.
    Parallel {
        /// The branches.
        branches: Vec<Branch>,
        /// How many branches must succeed for PARTIAL (all succeeding is SUCCEEDED).
        success_threshold: u32,
        /// The node after SUCCEEDED (and after PARTIAL without `on_partial`).
        next: String,
        /// The node after PARTIAL.
        on_partial: Option<String>,
        /// The node after FAILED; without it `catch` applies, then the task fails.
        on_failure: Option<String>,
    },
    /// Waits for `duration` (a durable timer).
    Wait {
        /// How long.
        duration: Duration,
        /// The node after the wait.
        next: String,
    },
    /// Ends the task successfully (PARTIAL when a parallel node ended PARTIAL on the way).
    Succeed,
    /// Ends the task as FAILED.
    Fail {
        /// The error recorded.
        error: String,
    },
}

/// One branch of a parallel node: a capability call with its own attempts.
#[derive(Debug)]
pub struct Branch {
    /// The branch name, unique in the node.
    pub name: String,
    /// The capability to call.
    pub capability: String,
    /// How to build the input; `None` sends the task input.
    pub input: Option<InputTemplate>,
}

/// Retry policy of a node: exponential back-off with jitter.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in total, the first included (1 = no retry).
    pub max_attempts: u32,
    /// The delay after the first failure.
    pub initial_interval: Duration,
    /// The factor each further delay grows by.
    pub multiplier: f64,
    /// The cap on a delay.
    pub max_interval: Duration,
    /// Relative jitter in `[0, 1]`: a delay `d` becomes uniform in `[d(1-j), d(1+j)]`.
    pub jitter: f64,
    /// The gRPC codes that are retried (the flow file names them: `retry_on: [UNAVAILABLE]`).
    pub retry_on: HashSet<Code>,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 1,
            initial_interval: Duration::from_secs(1),
            multiplier: 2.0,
            max_interval: Duration::from_secs(60),
            jitter: 0.2,
            retry_on: DEFAULT_RETRY_CODES.into_iter().collect(),
        }
    }
}

impl RetryPolicy {
    /// The nominal delay (no jitter) after failed attempt `attempt` (1-based), capped at
    /// `max_interval`.
    pub fn nominal_delay(&self, attempt: u32) -> Duration {
        self.schedule().delay(attempt)
    }

    /// The delay after failed attempt `attempt` with jitter drawn from `unit` (in `[-1, 1]`).
    pub fn delay(&self, attempt: u32, unit: f64) -> Duration {
        self.schedule()
            .delay_with_jitter(attempt, self.jitter, unit)
    }

    /// The back-off schedule this policy's delays follow.
    fn schedule(&self) -> Exponential {
        Exponential {
            initial: self.initial_interval,
            multiplier: self.multiplier,
            max: self.max_interval,
        }
    }

    /// Whether a failure with `code` after attempt `attempt` (1-based) is retried.
    pub fn retries(&self, attempt: u32, code: Code) -> bool {
        attempt < self.max_attempts && self.retry_on.contains(&code)
    }
}

impl Flow {
    /// Parses and validates a flow. `source` names the file in error locations.
    ///
    /// # Errors
    /// [`FlowErrors`] lists every problem found, each located.
    pub fn parse(source: &str, yaml: &str) -> Result<Flow, FlowErrors> {
        Self::parse_with(source, yaml, &ExprLimits::default())
    }

    /// [`Flow::parse`] with explicit expression limits: an expression longer or nested
    /// deeper than `limits` allow is a located error (checked before the CEL parser runs),
    /// and evaluations of the flow's expressions spend at most `limits`' budget.
    ///
    /// # Errors
    /// [`FlowErrors`] lists every problem found, each located.
    pub fn parse_with(source: &str, yaml: &str, limits: &ExprLimits) -> Result<Flow, FlowErrors> {
        let refuse = |line: usize, message: String, hint: &str| FlowErrors {
            errors: vec![FlowError {
                source: source.to_string(),
                line,
                column: 1,
                message,
                hint: hint.into(),
            }],
        };
        if yaml.len() > MAX_FLOW_BYTES {
            return Err(refuse(
                1,
                format!(
                    "the flow file is {} bytes; the limit is {MAX_FLOW_BYTES}",
                    yaml.len()
                ),
                "split it into smaller flows; large data belongs in the task input, not the flow",
            ));
        }
        let raw: RawFlow = match serde_norway::from_str(yaml) {
            Ok(raw) => raw,
            Err(err) => {
                let (line, column) = err
                    .location()
                    .map(|l| (l.line(), l.column()))
                    .unwrap_or((1, 1));
                let text = err.to_string();
                let message = snippet(text.split(" at line ").next().unwrap_or(&text));
                let hint = if message.contains("did not find expected") {
                    "an inline map `{...}` or list `[...]` is not closed on this line or the one before it"
                } else if message.contains("unknown field") {
                    "remove or rename the field; see docs/orchestrator.md for the fields of each node type"
                } else {
                    "fix the YAML: a flow has `id`, `version`, `initial` and `states` (node id to node)"
                };
                return Err(FlowErrors {
                    errors: vec![FlowError {
                        source: source.to_string(),
                        line,
                        column,
                        message,
                        hint: hint.into(),
                    }],
                });
            }
        };
        if raw.states.0.len() > MAX_NODES {
            let line = yaml
                .lines()
                .position(|l| l.starts_with("states:"))
                .map_or(1, |i| i + 1);
            return Err(refuse(
                line,
                format!(
                    "the flow has {} nodes; the limit is {MAX_NODES}",
                    raw.states.0.len()
                ),
                "split it into smaller flows that start one another through task nodes",
            ));
        }
        Validator {
            source,
            text: yaml,
            errors: Vec::new(),
            unreported: 0,
            limits,
        }
        .build(raw, yaml)
    }

    /// The node with `id`.
    pub fn node(&self, id: &str) -> Option<&Node> {
        self.nodes.get(id)
    }
}

impl NodeKind {
    /// The YAML type name.
    pub fn type_name(&self) -> &'static str {
        match self {
            NodeKind::Task { .. } => "task",
            NodeKind::Condition { .. } => "condition",
            NodeKind::Human { .. } => "human",
            NodeKind::Parallel { .. } => "parallel",
            NodeKind::Wait { .. } => "wait",
            NodeKind::Succeed => "succeed",
            NodeKind::Fail { .. } => "fail",
        }
    }

    /// Every node this node can go to.
    pub fn successors(&self) -> Vec<&str> {
        match self {
            NodeKind::Task { next, .. } | NodeKind::Wait { next, .. } => vec![next],
            NodeKind::Human {
                next, on_cancel, ..
            } => std::iter::once(next.as_str())
                .chain(on_cancel.as_deref())
                .collect(),
            NodeKind::Condition { branches, default } => branches
                .iter()
                .map(|(_, n)| n.as_str())
                .chain(std::iter::once(default.as_str()))
                .collect(),
            NodeKind::Parallel {
                next,
                on_partial,
                on_failure,
                ..
            } => std::iter::once(next.as_str())
                .chain(on_partial.as_deref())
                .chain(on_failure.as_deref())
                .collect(),
            NodeKind::Succeed | NodeKind::Fail { .. } => vec![],
        }
    }
}

// === errors ===

/// One located problem in a flow file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowError {
    /// The file (or `api`).
    pub source: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// What is wrong.
    pub message: String,
    /// What to change.
    pub hint: String,
}

impl fmt::Display for FlowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}; {}",
            self.source, self.line, self.column, self.message, self.hint
        )
    }
}

/// Every problem found in a flow, in file order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct FlowErrors {
    /// The problems; never empty.
    pub errors: Vec<FlowError>,
}

impl fmt::Display for FlowErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

// === raw YAML shape ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFlow {
    id: String,
    version: u32,
    #[serde(default)]
    initial: Option<String>,
    #[serde(default)]
    description: Option<String>,
    states: indexmap_like::OrderedMap<RawNode>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawNode {
    #[serde(rename = "type")]
    kind: Option<String>,
    capability: Option<String>,
    input: Option<serde_json::Value>,
    next: Option<String>,
    timeout: Option<String>,
    retry: Option<RawRetry>,
    catch: Option<String>,
    conditions: Option<Vec<RawCondition>>,
    default: Option<String>,
    schema: Option<serde_json::Value>,
    prompt: Option<String>,
    on_cancel: Option<String>,
    branches: Option<Vec<RawBranch>>,
    success_threshold: Option<u32>,
    on_partial: Option<String>,
    on_failure: Option<String>,
    duration: Option<String>,
    error: Option<String>,
    description: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRetry {
    max_attempts: Option<u32>,
    initial_interval: Option<String>,
    multiplier: Option<f64>,
    max_interval: Option<String>,
    jitter: Option<f64>,
    retry_on: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCondition {
    #[serde(rename = "if")]
    when: String,
    next: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBranch {
    name: String,
    capability: String,
    input: Option<serde_json::Value>,
}

/// A map that keeps YAML order (states are reported in file order).
mod indexmap_like {
    use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
    use std::fmt;
    use std::marker::PhantomData;

    pub struct OrderedMap<V>(pub Vec<(String, V)>);

    impl<'de, V: Deserialize<'de>> Deserialize<'de> for OrderedMap<V> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V2<V>(PhantomData<V>);
            impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
                type Value = OrderedMap<V>;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a map of node id to node")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                    let mut out = Vec::new();
                    while let Some((k, v)) = map.next_entry::<String, V>()? {
                        if out.iter().any(|(seen, _): &(String, V)| *seen == k) {
                            return Err(serde::de::Error::custom(format!(
                                "node `{k}` is defined twice"
                            )));
                        }
                        out.push((k, v));
                    }
                    Ok(OrderedMap(out))
                }
            }
            d.deserialize_map(V2(PhantomData))
        }
    }
}

// === validation ===

struct Validator<'a> {
    source: &'a str,
    text: &'a str,
    errors: Vec<FlowError>,
    /// Problems found past [`MAX_REPORTED_ERRORS`]: counted, not located.
    unreported: usize,
    limits: &'a ExprLimits,
}

/// The most nodes a flow may have; more is refused before validation (whose location search
/// and "did you mean" suggestions grow with nodes × errors).
pub const MAX_NODES: usize = 1000;
/// The largest flow file, in bytes; a larger one is refused before it is parsed.
pub const MAX_FLOW_BYTES: usize = 256 << 10;
/// The most problems reported for one flow, each located; the rest are counted in one more.
pub const MAX_REPORTED_ERRORS: usize = 100;

/// What to do about an expression over the limits.
const LIMIT_HINT: &str = "split the expression, move the computation into a task node, or raise `orchestrator.expressions.max_bytes` / `max_depth`";

const NODE_TYPES: &[&str] = &[
    "task",
    "condition",
    "human",
    "parallel",
    "wait",
    "succeed",
    "fail",
];

impl Validator<'_> {
    fn err(
        &mut self,
        state: Option<&str>,
        field: Option<&str>,
        message: String,
        hint: impl Into<String>,
    ) {
        if self.errors.len() >= MAX_REPORTED_ERRORS {
            self.unreported += 1;
            return;
        }
        let (line, column) = locate(self.text, state, field);
        // Names and values are echoed from the file: a message stays small whatever it holds.
        self.errors.push(FlowError {
            source: self.source.to_string(),
            line,
            column,
            message: cut(&message, 600),
            hint: cut(&hint.into(), 400),
        });
    }

    fn duration(&mut self, state: &str, field: &str, text: Option<&str>) -> Option<Duration> {
        let text = text?;
        match humantime::parse_duration(text.trim()) {
            Ok(d) => Some(d),
            Err(e) => {
                self.err(
                    Some(state),
                    Some(field),
                    format!(
                        "node `{state}`: `{field}: {}` is not a duration ({e})",
                        snippet(text)
                    ),
                    "write a number with a unit, for example `500ms`, `10s`, `5m` or `2h`",
                );
                None
            }
        }
    }

    fn template(
        &mut self,
        state: &str,
        field: &str,
        value: Option<serde_json::Value>,
    ) -> Option<InputTemplate> {
        let value = value?;
        if let Some(e) = template_limit_error(&value, self.limits) {
            self.err(
                Some(state),
                Some(field),
                format!("node `{state}`: {e}"),
                LIMIT_HINT,
            );
            return None;
        }
        match InputTemplate::compile_with(&value, self.limits) {
            Ok(t) => Some(t),
            Err(e) => {
                self.err(
                    Some(state),
                    Some(field),
                    format!("node `{state}`: `{field}` has an expression that does not compile: {e}"),
                    "every string in `input` is a CEL expression over `input`, `nodes` and `task`; write literal text as a quoted CEL string, for example \"'text'\"",
                );
                None
            }
        }
    }

    fn build(mut self, raw: RawFlow, yaml: &str) -> Result<Flow, FlowErrors> {
        let id_ok = !raw.id.is_empty()
            && raw
                .id
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-".contains(c));
        if !id_ok {
            self.err(
                None,
                Some("id"),
                format!("flow id `{}` is not valid", raw.id),
                "use lowercase letters, digits, `.`, `_` and `-`, for example `complaint-flow`",
            );
        }
        if raw.version == 0 {
            self.err(
                None,
                Some("version"),
                "flow version 0 is not valid".into(),
                "versions start at 1; bump it on every change",
            );
        }
        if raw.states.0.is_empty() {
            self.err(
                None,
                Some("states"),
                "the flow has no states".into(),
                "add at least one node under `states`, ending in a `succeed` node",
            );
        }
        let names: Vec<String> = raw.states.0.iter().map(|(k, _)| k.clone()).collect();
        let initial = match raw.initial.clone() {
            None => {
                let first = names.first().cloned().unwrap_or_else(|| "start".into());
                self.err(
                    None,
                    Some("states"),
                    "the flow has no `initial` node".into(),
                    format!(
                        "add `initial: {first}` (the node the task starts at) at the top level"
                    ),
                );
                String::new()
            }
            Some(initial) => {
                if !names.contains(&initial) {
                    let hint = suggest(&initial, &names);
                    self.err(
                        None,
                        Some("initial"),
                        format!("`initial: {initial}` names no node in `states`"),
                        hint,
                    );
                }
                initial
            }
        };

        let mut nodes = BTreeMap::new();
        for (name, node) in raw.states.0 {
            if let Some(n) = self.node(&name, node, &names) {
                nodes.insert(name, n);
            }
        }

        // Reachability, only when the references themselves are sound.
        if self.errors.is_empty() {
            let mut seen = BTreeSet::new();
            let mut queue = VecDeque::from([initial.clone()]);
            while let Some(n) = queue.pop_front() {
                if !seen.insert(n.clone()) {
                    continue;
                }
                if let Some(node) = nodes.get(&n) {
                    for s in node.kind.successors() {
                        queue.push_back(s.to_string());
                    }
                    if let Some(c) = &node.catch {
                        queue.push_back(c.clone());
                    }
                }
            }
            for name in &names {
                if !seen.contains(name) {
                    self.err(
                        Some(name),
                        None,
                        format!("node `{name}` is unreachable from `initial: {initial}`"),
                        "point a `next`, `default`, `catch` or `on_*` of another node at it, or remove it",
                    );
                }
            }
            let ends = nodes
                .values()
                .any(|n| matches!(n.kind, NodeKind::Succeed | NodeKind::Fail { .. }));
            if !ends && !nodes.is_empty() {
                self.err(
                    None,
                    Some("states"),
                    "the flow has no `succeed` or `fail` node, so no task can end".into(),
                    "add a node `done: {type: succeed}` and point the last `next` at it",
                );
            }
        }

        if !self.errors.is_empty() {
            self.errors.sort_by_key(|e| (e.line, e.column));
            if self.unreported > 0 {
                let last_line = self.errors.last().map_or(1, |e| e.line);
                self.errors.push(FlowError {
                    source: self.source.to_string(),
                    line: last_line,
                    column: 1,
                    message: format!(
                        "and {} more problems not shown (at most {MAX_REPORTED_ERRORS} are reported)",
                        self.unreported
                    ),
                    hint: "fix the ones above and validate again".into(),
                });
            }
            return Err(FlowErrors {
                errors: self.errors,
            });
        }
        Ok(Flow {
            id: raw.id,
            version: raw.version,
            initial,
            description: raw.description,
            nodes,
            source: self.source.to_string(),
            yaml: yaml.to_string(),
        })
    }

    fn reference(
        &mut self,
        state: &str,
        field: &str,
        target: Option<String>,
        names: &[String],
        required: bool,
    ) -> Option<String> {
        match target {
            None => {
                if required {
                    self.err(
                        Some(state),
                        Some("type"),
                        format!("node `{state}` has no `{field}`"),
                        format!("add `{field}: <node id>` naming the node that follows"),
                    );
                }
                None
            }
            Some(t) if names.contains(&t) => Some(t),
            Some(t) => {
                let hint = suggest(&t, names);
                self.err(
                    Some(state),
                    Some(field),
                    format!("node `{state}`: `{field}: {t}` names no node in `states`"),
                    hint,
                );
                None
            }
        }
    }

    fn forbid(&mut self, state: &str, kind: &str, fields: &[(&str, bool)]) {
        for (field, present) in fields {
            if *present {
                self.err(
                    Some(state),
                    Some(field),
                    format!("node `{state}`: field `{field}` is not used by a `{kind}` node"),
                    format!("remove `{field}` or change the node's `type`"),
                );
            }
        }
    }

    fn retry(&mut self, state: &str, raw: Option<RawRetry>) -> RetryPolicy {
        let Some(raw) = raw else {
            return RetryPolicy::default();
        };
        let mut p = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        if let Some(n) = raw.max_attempts {
            if n == 0 {
                self.err(
                    Some(state),
                    Some("max_attempts"),
                    format!("node `{state}`: `max_attempts: 0` allows no attempt"),
                    "use 1 (no retry) or more",
                );
            }
            p.max_attempts = n.max(1);
        }
        if let Some(d) = self.duration(state, "initial_interval", raw.initial_interval.as_deref()) {
            p.initial_interval = d;
        }
        if let Some(d) = self.duration(state, "max_interval", raw.max_interval.as_deref()) {
            p.max_interval = d;
        }
        if let Some(m) = raw.multiplier {
            if !(m >= 1.0 && m.is_finite()) {
                self.err(
                    Some(state),
                    Some("multiplier"),
                    format!("node `{state}`: `multiplier: {m}` must be at least 1"),
                    "use 1 for a constant delay or 2 to double it each time",
                );
            }
            p.multiplier = m;
        }
        if let Some(j) = raw.jitter {
            if !(0.0..=1.0).contains(&j) {
                self.err(
                    Some(state),
                    Some("jitter"),
                    format!("node `{state}`: `jitter: {j}` is outside [0, 1]"),
                    "use a fraction such as 0.2 (±20%)",
                );
            }
            p.jitter = j;
        }
        if let Some(codes) = raw.retry_on {
            let mut set = HashSet::new();
            for c in codes {
                if let Some(code) = code_from_name(&c) {
                    set.insert(code);
                } else {
                    let names: Vec<&str> = DEFAULT_RETRY_CODES.into_iter().map(code_name).collect();
                    self.err(
                        Some(state),
                        Some("retry_on"),
                        format!("node `{state}`: `{c}` is not a gRPC code"),
                        format!("use code names such as {}", names.join(", ")),
                    );
                }
            }
            p.retry_on = set;
        }
        p
    }

    fn node(&mut self, name: &str, raw: RawNode, names: &[String]) -> Option<Node> {
        let _ = raw.description;
        let Some(kind) = raw.kind.clone() else {
            self.err(
                Some(name),
                None,
                format!("node `{name}` has no `type`"),
                format!("add `type:` with one of {}", NODE_TYPES.join(", ")),
            );
            return None;
        };
        let timeout = self.duration(name, "timeout", raw.timeout.as_deref());
        if timeout == Some(Duration::ZERO) {
            self.err(
                Some(name),
                Some("timeout"),
                format!("node `{name}`: `timeout` must be more than zero"),
                "remove it for no timeout, or give a positive duration",
            );
        }
        let catch = self.reference(name, "catch", raw.catch.clone(), names, false);
        let has_retry = raw.retry.is_some();
        let retry = self.retry(name, raw.retry);
        let kind = match kind.as_str() {
            "task" => {
                self.forbid(
                    name,
                    "task",
                    &[
                        ("conditions", raw.conditions.is_some()),
                        ("default", raw.default.is_some()),
                        ("branches", raw.branches.is_some()),
                        ("duration", raw.duration.is_some()),
                        ("schema", raw.schema.is_some()),
                        ("on_cancel", raw.on_cancel.is_some()),
                        ("success_threshold", raw.success_threshold.is_some()),
                    ],
                );
                let capability = raw.capability.clone().filter(|c| !c.is_empty());
                if capability.is_none() {
                    self.err(
                        Some(name),
                        Some("type"),
                        format!("task node `{name}` has no `capability`"),
                        "add `capability: <name>`, for example `capability: complaint.classify`",
                    );
                }
                let input = self.template(name, "input", raw.input);
                let next = self.reference(name, "next", raw.next, names, true);
                NodeKind::Task {
                    capability: capability?,
                    input,
                    next: next?,
                }
            }
            "condition" => {
                self.forbid(
                    name,
                    "condition",
                    &[
                        ("capability", raw.capability.is_some()),
                        ("next", raw.next.is_some()),
                        ("retry", has_retry),
                        ("timeout", raw.timeout.is_some()),
                        ("branches", raw.branches.is_some()),
                    ],
                );
                let mut branches = Vec::new();
                let conditions = raw.conditions.unwrap_or_default();
                if conditions.is_empty() {
                    self.err(
                        Some(name),
                        Some("type"),
                        format!("condition node `{name}` has no `conditions`"),
                        "add `conditions:` with items `{if: <CEL expression>, next: <node>}`",
                    );
                }
                let mut ok = true;
                for c in conditions {
                    let next = self.reference(name, "next", Some(c.next), names, true);
                    if let Err(e) = check_limits(&c.when, self.limits) {
                        ok = false;
                        self.err(
                            Some(name),
                            Some("if"),
                            format!("node `{name}`: {e}"),
                            LIMIT_HINT,
                        );
                        continue;
                    }
                    match Expr::compile_with(&c.when, self.limits) {
                        Ok(e) => {
                            if let Some(next) = next {
                                branches.push((e, next));
                            } else {
                                ok = false;
                            }
                        }
                        Err(e) => {
                            ok = false;
                            self.err(Some(name), Some("if"), format!("node `{name}`: `if: {}` does not compile: {e}", snippet(&c.when)), "write a CEL expression over `input`, `nodes` and `task`, for example `nodes.classify.output.confidence < 0.5`");
                        }
                    }
                }
                let default = self.reference(name, "default", raw.default, names, true);
                if !ok {
                    return None;
                }
                NodeKind::Condition {
                    branches,
                    default: default?,
                }
            }
            "human" => {
                self.forbid(
                    name,
                    "human",
                    &[
                        ("capability", raw.capability.is_some()),
                        ("retry", has_retry),
                        ("branches", raw.branches.is_some()),
                        ("conditions", raw.conditions.is_some()),
                    ],
                );
                let schema_source = raw.schema;
                let schema = match &schema_source {
                    None => None,
                    Some(s) => match jsonschema::validator_for(s) {
                        Ok(v) => Some(Arc::new(v)),
                        Err(e) => {
                            self.err(Some(name), Some("schema"), format!("node `{name}`: `schema` is not a valid JSON Schema: {e}"), "fix the schema, for example `{type: object, required: [approved], properties: {approved: {type: boolean}}}`");
                            None
                        }
                    },
                };
                let next = self.reference(name, "next", raw.next, names, true);
                let on_cancel = self.reference(name, "on_cancel", raw.on_cancel, names, false);
                NodeKind::Human {
                    next: next?,
                    schema,
                    schema_source,
                    prompt: raw.prompt,
                    on_cancel,
                }
            }
            "parallel" => {
                self.forbid(
                    name,
                    "parallel",
                    &[
                        ("capability", raw.capability.is_some()),
                        ("conditions", raw.conditions.is_some()),
                        ("duration", raw.duration.is_some()),
                    ],
                );
                let raw_branches = raw.branches.unwrap_or_default();
                if raw_branches.is_empty() {
                    self.err(
                        Some(name),
                        Some("type"),
                        format!("parallel node `{name}` has no `branches`"),
                        "add `branches:` with items `{name: <branch>, capability: <capability>}`",
                    );
                }
                let mut branches = Vec::new();
                let mut seen = BTreeSet::new();
                for b in raw_branches {
                    if !seen.insert(b.name.clone()) || b.name.is_empty() || b.name.contains('/') {
                        self.err(Some(name), Some("branches"), format!("node `{name}`: branch name `{}` is empty, repeated or contains `/`", b.name), "give every branch a unique name without `/`");
                    }
                    let input = self.template(name, "input", b.input);
                    branches.push(Branch {
                        name: b.name,
                        capability: b.capability,
                        input,
                    });
                }
                let n = u32::try_from(branches.len()).unwrap_or(u32::MAX);
                let success_threshold = raw.success_threshold.unwrap_or(n);
                if n > 0 && (success_threshold == 0 || success_threshold > n) {
                    self.err(Some(name), Some("success_threshold"), format!("node `{name}`: `success_threshold: {success_threshold}` must be between 1 and the {n} branches"), "say how many branches must succeed for PARTIAL");
                }
                let next = self.reference(name, "next", raw.next, names, true);
                let on_partial = self.reference(name, "on_partial", raw.on_partial, names, false);
                let on_failure = self.reference(name, "on_failure", raw.on_failure, names, false);
                NodeKind::Parallel {
                    branches,
                    success_threshold,
                    next: next?,
                    on_partial,
                    on_failure,
                }
            }
            "wait" => {
                self.forbid(
                    name,
                    "wait",
                    &[
                        ("capability", raw.capability.is_some()),
                        ("retry", has_retry),
                        ("conditions", raw.conditions.is_some()),
                    ],
                );
                if raw.duration.is_none() {
                    self.err(
                        Some(name),
                        Some("type"),
                        format!("wait node `{name}` has no `duration`"),
                        "add `duration: 2s` (any humantime duration)",
                    );
                }
                let duration = self.duration(name, "duration", raw.duration.as_deref());
                let next = self.reference(name, "next", raw.next, names, true);
                NodeKind::Wait {
                    duration: duration?,
                    next: next?,
                }
            }
            "succeed" | "fail" => {
                self.forbid(
                    name,
                    &kind,
                    &[
                        ("next", raw.next.is_some()),
                        ("capability", raw.capability.is_some()),
                        ("retry", has_retry),
                        ("timeout", raw.timeout.is_some()),
                        ("catch", raw.catch.is_some()),
                    ],
                );
                if kind == "succeed" {
                    NodeKind::Succeed
                } else {
                    NodeKind::Fail {
                        error: raw
                            .error
                            .unwrap_or_else(|| format!("the flow reached fail node `{name}`")),
                    }
                }
            }
            other => {
                self.err(
                    Some(name),
                    Some("type"),
                    format!("node `{name}` has unknown type `{other}`"),
                    format!("use one of {}", NODE_TYPES.join(", ")),
                );
                return None;
            }
        };
        Some(Node {
            id: name.to_string(),
            kind,
            timeout,
            retry,
            catch,
        })
    }
}

fn suggest(target: &str, names: &[String]) -> String {
    let best = names
        .iter()
        .map(|n| (edit_distance(target, n), n))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, n)) if d <= 3 => format!("did you mean `{n}`? known nodes: {}", names.join(", ")),
        _ => format!("use one of the nodes under `states`: {}", names.join(", ")),
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Finds where `state` (under `states:`) and its `field` are written; falls back to the state,
/// then to the top-level field, then to 1:1.
fn locate(text: &str, state: Option<&str>, field: Option<&str>) -> (usize, usize) {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let key_at = |line: &str, key: &str| -> Option<usize> {
        for candidate in [
            format!("{key}:"),
            format!("\"{key}\":"),
            format!("'{key}':"),
        ] {
            let mut from = 0;
            while let Some(pos) = line[from..].find(&candidate) {
                let at = from + pos;
                let before = line[..at].chars().last();
                if before.is_none_or(|c| c == ' ' || c == '{' || c == ',' || c == '-') {
                    return Some(at);
                }
                from = at + candidate.len();
            }
        }
        None
    };
    let Some(state) = state else {
        let key = field.unwrap_or("id");
        for (i, l) in lines.iter().enumerate() {
            if indent(l) == 0 && key_at(l, key) == Some(0) {
                return (i + 1, 1);
            }
        }
        return (1, 1);
    };
    let states_line = lines
        .iter()
        .position(|l| indent(l) == 0 && l.starts_with("states:"))
        .unwrap_or(0);
    let mut state_pos = None;
    for (i, l) in lines.iter().enumerate().skip(states_line + 1) {
        if indent(l) > 0 && key_at(l, state) == Some(indent(l)) {
            state_pos = Some((i, indent(l)));
            break;
        }
    }
    let Some((si, sindent)) = state_pos else {
        return (states_line + 1, 1);
    };
    let Some(field) = field else {
        return (si + 1, sindent + 1);
    };
    // Same line (flow style) first, then the block below the state.
    // `get`: a quoted or non-ASCII key may not end where its unquoted length says.
    if let Some(at) = lines[si]
        .get(sindent + state.len()..)
        .and_then(|rest| key_at(rest, field))
    {
        return (si + 1, sindent + state.len() + at + 1);
    }
    for (i, l) in lines.iter().enumerate().skip(si + 1) {
        if l.trim().is_empty() || l.trim_start().starts_with('#') {
            continue;
        }
        if indent(l) <= sindent {
            break;
        }
        if let Some(at) = key_at(l, field) {
            return (i + 1, at + 1);
        }
    }
    (si + 1, sindent + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "id: demo\nversion: 1\ninitial: classify\nstates:\n  classify:\n    type: task\n    capability: complaint.classify\n    timeout: 10s\n    retry: {max_attempts: 3, initial_interval: 200ms, multiplier: 2}\n    next: route\n  route:\n    type: condition\n    conditions:\n      - if: \"nodes.classify.output.confidence < 0.5\"\n        next: review\n    default: done\n  review: {type: human, next: done}\n  done: {type: succeed}\n";

    #[test]
    fn parses_a_good_flow() {
        let flow = Flow::parse("demo.yaml", GOOD).unwrap();
        assert_eq!(flow.nodes.len(), 4);
        assert_eq!(flow.nodes["classify"].retry.max_attempts, 3);
        assert_eq!(
            flow.nodes["classify"].timeout,
            Some(Duration::from_secs(10))
        );
    }

    #[test]
    fn locates_unknown_reference_and_bad_duration() {
        let bad = GOOD
            .replace("default: done", "default: dnoe")
            .replace("timeout: 10s", "timeout: 10 parsecs");
        let errs = Flow::parse("demo.yaml", &bad).unwrap_err();
        let text = errs.to_string();
        assert!(
            text.contains(
                "demo.yaml:8:5: node `classify`: `timeout: 10 parsecs` is not a duration"
            ),
            "{text}"
        );
        assert!(
            text.contains("demo.yaml:16:5: node `route`: `default: dnoe` names no node"),
            "{text}"
        );
        assert!(text.contains("did you mean `done`"), "{text}");
    }

    #[test]
    fn locates_cel_errors_unreachable_and_missing_initial() {
        let bad = GOOD.replace("confidence < 0.5", "confidence <<< 0.5");
        let text = Flow::parse("f.yaml", &bad).unwrap_err().to_string();
        assert!(text.contains("f.yaml:14:9: node `route`: `if:"), "{text}");

        let unreachable = GOOD.replace("next: review", "next: done");
        let text = Flow::parse("f.yaml", &unreachable).unwrap_err().to_string();
        assert!(
            text.contains("f.yaml:17:3: node `review` is unreachable"),
            "{text}"
        );

        let no_initial = GOOD.replace("initial: classify\n", "");
        let text = Flow::parse("f.yaml", &no_initial).unwrap_err().to_string();
        assert!(
            text.contains("f.yaml:3:1: the flow has no `initial` node; add `initial: classify`"),
            "{text}"
        );
    }

    #[test]
    fn a_quoted_non_ascii_node_name_is_located_not_a_panic() {
        let yaml = "id: utf8\nversion: 1\ninitial: \"é\"\nstates:\n  \"é\": {type: task, capability: x, next: done, timeout: nonsense}\n  done: {type: succeed}\n";
        let errors = Flow::parse("u.yaml", yaml).unwrap_err();
        assert_eq!(errors.errors.len(), 1, "{errors}");
        assert_eq!(errors.errors[0].line, 5, "{errors}");
        assert!(
            errors.errors[0].message.contains("is not a duration"),
            "{errors}"
        );
    }

    #[test]
    fn many_problems_are_reported_up_to_the_cap_and_counted() {
        let mut yaml = String::from("id: many\nversion: 1\ninitial: n0\nstates:\n");
        for i in 0..MAX_NODES - 1 {
            yaml.push_str(&format!(
                "  n{i}: {{type: task, capability: x, next: missing{i}}}\n"
            ));
        }
        yaml.push_str("  done: {type: succeed}\n");
        let errors = Flow::parse("m.yaml", &yaml).unwrap_err();
        assert_eq!(errors.errors.len(), MAX_REPORTED_ERRORS + 1);
        let last = &errors.errors[MAX_REPORTED_ERRORS].message;
        assert!(
            last.contains(&format!(
                "and {} more problems",
                MAX_NODES - 1 - MAX_REPORTED_ERRORS
            )),
            "{last}"
        );
    }

    #[test]
    fn oversized_flows_are_refused_before_validation() {
        let mut yaml = String::from("id: big\nversion: 1\ninitial: n0\nstates:\n");
        for i in 0..=MAX_NODES {
            yaml.push_str(&format!("  n{i}: {{type: succeed}}\n"));
        }
        let errors = Flow::parse("b.yaml", &yaml).unwrap_err();
        assert_eq!(errors.errors.len(), 1);
        assert_eq!(errors.errors[0].line, 4);
        assert!(
            errors.errors[0].message.contains("limit is 1000"),
            "{errors}"
        );

        let huge = format!("id: big\nversion: 1\n# {}\n", "x".repeat(MAX_FLOW_BYTES));
        let errors = Flow::parse("h.yaml", &huge).unwrap_err();
        assert!(
            errors.errors[0].message.contains("bytes; the limit is"),
            "{errors}"
        );
    }

    #[test]
    fn locates_yaml_syntax_errors() {
        let text = Flow::parse(
            "f.yaml",
            "id: x\nversion: 1\nstates:\n  a: {type: succeed\n",
        )
        .unwrap_err()
        .to_string();
        assert!(text.starts_with("f.yaml:"), "{text}");
        let text = Flow::parse(
            "f.yaml",
            "id: x\nversion: 1\nstates:\n  a: {type: succeed, nxt: b}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(text.contains("unknown field `nxt`"), "{text}");
    }

    /// The loader takes outside input: no edit of a flow file may make it panic.
    #[test]
    fn never_panics_on_mangled_input() {
        let text = format!("{GOOD}  état: {{type: succeed}}\n");
        let chars: Vec<char> = text.chars().collect();
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..3000 {
            let mut mangled = chars.clone();
            for _ in 0..(next() % 4 + 1) {
                let i = usize::try_from(next() % mangled.len() as u64).unwrap();
                match next() % 3 {
                    0 => {
                        mangled.remove(i);
                    }
                    1 => mangled.insert(
                        i,
                        [':', '{', '}', '-', ' ', '\n', '\'', 'é']
                            [usize::try_from(next() % 8).unwrap()],
                    ),
                    _ => {
                        let j = usize::try_from(next() % mangled.len() as u64).unwrap();
                        let last = mangled.len() - 1;
                        mangled.swap(i.min(last), j);
                    }
                }
            }
            let s: String = mangled.into_iter().collect();
            let _ = Flow::parse("m.yaml", &s);
        }
    }

    #[test]
    fn backoff_grows_and_caps() {
        let p = RetryPolicy {
            max_attempts: 5,
            initial_interval: Duration::from_millis(200),
            multiplier: 2.0,
            max_interval: Duration::from_millis(500),
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(p.nominal_delay(1), Duration::from_millis(200));
        assert_eq!(p.nominal_delay(2), Duration::from_millis(400));
        assert_eq!(p.nominal_delay(3), Duration::from_millis(500));
        assert!(p.retries(4, Code::Unavailable));
        assert!(!p.retries(5, Code::Unavailable));
        assert!(!p.retries(1, Code::InvalidArgument));
    }

    /// `retry_on` names parse to codes at load; an unknown name is a located error.
    #[test]
    fn retry_on_parses_code_names_with_located_errors() {
        let flow = GOOD.replace(
            "multiplier: 2}",
            "multiplier: 2, retry_on: [UNAVAILABLE, resource_exhausted]}",
        );
        let flow = Flow::parse("f.yaml", &flow).unwrap();
        assert_eq!(
            flow.nodes["classify"].retry.retry_on,
            HashSet::from([Code::Unavailable, Code::ResourceExhausted])
        );
        let bad = GOOD.replace("multiplier: 2}", "multiplier: 2, retry_on: [UNAVAILABEL]}");
        let text = Flow::parse("f.yaml", &bad).unwrap_err().to_string();
        assert!(
            text.contains(
                "f.yaml:9:70: node `classify`: `UNAVAILABEL` is not a gRPC code; use code names such as UNAVAILABLE, DEADLINE_EXCEEDED"
            ),
            "{text}"
        );
    }
}
