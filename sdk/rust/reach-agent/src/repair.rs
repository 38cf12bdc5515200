//! Validation and safe repair of tool arguments against the tool's JSON Schema.
//!
//! [`ArgumentSchema::prepare`] reads the model's text ([`crate::arguments`]), then:
//!
//! 1. fills absent properties that declare a non-null `default` (following `allOf` and local
//!    `$ref`s; not inside `anyOf`/`oneOf`, where the branch is ambiguous);
//! 2. validates with the `jsonschema` crate (formats asserted: `date`, `email`, ... fail
//!    validation), and for each failing value tries one safe repair, guided by the schema
//!    node that failed:
//!    - `type`: a string holding an integer, number or boolean (`"3"`, `"2.5"`, `"true"`)
//!      where that type is required; a string holding JSON where an object or array is
//!      required (double-encoded arguments); a number or boolean where a string is required;
//!    - `enum`: a string matching exactly one enum value after trimming or ignoring ASCII
//!      case (`"CELSIUS"` → `"celsius"`); none or several matches: no repair;
//!    - `const`: as `enum` with one value;
//!    - `format`, `pattern`, `minLength`, `maxLength`: surrounding whitespace trimmed;
//!    - `anyOf` / `oneOf`: the repairs above against each branch, kept when exactly one
//!      branch then accepts the value;
//!
//!    and validates again (a few rounds);
//! 3. writes integral floats as integers (`3.0` → `3`): JSON Schema counts `3.0` as an
//!    integer, and so must the tool's Rust types.
//!
//! Never repaired: a missing required property without a default (nothing is invented), a
//! property the schema forbids (`additionalProperties: false`: refused with its pointer, not
//! dropped), anything else. What cannot be repaired becomes [`InvalidArguments`], one
//! [`Violation`] per bad field — its JSON pointer (RFC 6901; for a missing or forbidden
//! property, the property's own pointer) and what was expected — for the model to retry.
//!
//! Every change is a [`Repair`] `{pointer, kind, from, to}`, reported in the tool result's
//! metadata and in the `tool.call` span's `tool.repairs` event.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::arguments::{ArgumentLimits, ArgumentsError, ParseMethod, parse_arguments_with};

/// What a repair did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairKind {
    /// The text was not strict JSON and was read another way (`to` names the way, see
    /// [`ParseMethod::as_str`]; `from` is the text, cut to 200 characters).
    LenientParse,
    /// Empty text taken as `{}` (the schema requires nothing).
    EmptyArguments,
    /// An absent property got the schema's `default`.
    DefaultFilled,
    /// A string became an integer.
    StringToInteger,
    /// A string became a number.
    StringToNumber,
    /// A string became a boolean.
    StringToBoolean,
    /// A string holding JSON became that object or array.
    DecodedJsonString,
    /// A number or boolean became a string.
    ToString,
    /// A string matched an enum value ignoring ASCII case.
    EnumCase,
    /// Surrounding whitespace was trimmed.
    Trimmed,
    /// An integral float became an integer.
    IntegralFloat,
}

/// One change made to the arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Repair {
    /// The JSON pointer of the changed value (`""` for the whole arguments).
    pub pointer: String,
    /// What was done.
    pub kind: RepairKind,
    /// The value before (`null` for a filled default).
    pub from: Value,
    /// The value after.
    pub to: Value,
}

/// One field that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    /// The JSON pointer of the field (`""` for the whole arguments).
    pub pointer: String,
    /// The schema keyword that failed (`type`, `required` — also for a value the model left
    /// out as `?` —, `format`, ...), `syntax` for text that could not be read, or `ambiguous`
    /// for text holding several different objects.
    pub keyword: String,
    /// The JSON pointer of that keyword within the schema (`/allOf/0/additionalProperties`);
    /// empty when the text could not be read at all.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub schema_path: String,
    /// What was expected, for the model.
    pub expected: String,
}

/// Arguments that could not be used, with every bad field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(violations))]
pub struct InvalidArguments {
    /// The bad fields.
    pub violations: Vec<Violation>,
}

fn render(violations: &[Violation]) -> String {
    let fields: Vec<String> = violations
        .iter()
        .map(|v| {
            let at = if v.pointer.is_empty() {
                "(the arguments)"
            } else {
                v.pointer.as_str()
            };
            format!("{at}: {}", v.expected)
        })
        .collect();
    format!(
        "invalid arguments: {}; fix these fields and call the tool again",
        fields.join("; ")
    )
}

/// Arguments ready for the tool, and what was changed to get there.
#[derive(Debug, Clone, PartialEq)]
pub struct Prepared {
    /// The valid arguments.
    pub value: Value,
    /// The repairs made, in order.
    pub repairs: Vec<Repair>,
}

/// Why a schema cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[error("not a valid JSON Schema: {0}")]
pub struct SchemaError(pub String);

/// A tool's input schema, compiled: validates and repairs arguments.
#[derive(Clone)]
pub struct ArgumentSchema {
    schema: Arc<Value>,
    validator: Arc<jsonschema::Validator>,
    limits: ArgumentLimits,
}

impl std::fmt::Debug for ArgumentSchema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArgumentSchema")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// The most validate-and-repair rounds (each repairs every value it can).
const MAX_ROUNDS: usize = 8;

impl ArgumentSchema {
    /// Compiles `schema` (formats asserted).
    ///
    /// # Errors
    /// [`SchemaError`] when it is not a valid JSON Schema, or is one that refuses what it
    /// means to accept (`additionalProperties: false` inside an `allOf` branch; see
    /// [`reach_protocol::schema_pitfall`]).
    pub fn new(schema: Value) -> Result<Self, SchemaError> {
        let validator = compile(&schema)?;
        Ok(Self {
            schema: Arc::new(schema),
            validator: Arc::new(validator),
            limits: ArgumentLimits::default(),
        })
    }

    /// Uses `limits` for argument text.
    pub fn with_limits(mut self, limits: ArgumentLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The schema.
    pub fn schema(&self) -> &Value {
        &self.schema
    }

    /// Whether empty argument text may be taken as `{}`: the schema lists no `required`
    /// property at its root (nor in a root `allOf` member).
    pub fn allows_empty(&self) -> bool {
        fn requires(node: &Value) -> bool {
            node.get("required")
                .and_then(Value::as_array)
                .is_some_and(|r| !r.is_empty())
                || node
                    .get("allOf")
                    .and_then(Value::as_array)
                    .is_some_and(|all| all.iter().any(requires))
        }
        !requires(&self.schema)
    }

    /// Reads, repairs and validates the model's argument text.
    ///
    /// # Errors
    /// [`InvalidArguments`]: unreadable text (keyword `syntax`, pointer `""`), several
    /// different objects (keyword `ambiguous`, pointer `""`), or fields that were left out
    /// (empty text, `?`: keyword `required` at each field's pointer) or could not be repaired.
    pub fn prepare(&self, text: &str) -> Result<Prepared, InvalidArguments> {
        let parsed = match parse_arguments_with(text, self.limits, self.allows_empty()) {
            Ok(parsed) => parsed,
            // Empty text where fields are required: each required field is what is wrong,
            // named by its pointer, as if the model had sent `{}`.
            Err(ArgumentsError::Empty) => {
                let mut prepared = self.repair(Value::Object(serde_json::Map::new()))?;
                prepared.repairs.insert(
                    0,
                    Repair {
                        pointer: String::new(),
                        kind: RepairKind::EmptyArguments,
                        from: Value::String(text.to_string()),
                        to: Value::Object(serde_json::Map::new()),
                    },
                );
                return Ok(prepared);
            }
            Err(ArgumentsError::MissingValues { pointers }) => {
                return Err(InvalidArguments {
                    violations: pointers
                        .into_iter()
                        .map(|pointer| Violation {
                            pointer,
                            keyword: "required".into(),
                            schema_path: String::new(),
                            expected: "a value (the arguments have `?`, `...` or nothing here)"
                                .into(),
                        })
                        .collect(),
                });
            }
            Err(e) => {
                let keyword = match e {
                    ArgumentsError::Ambiguous { .. } => "ambiguous",
                    _ => "syntax",
                };
                return Err(InvalidArguments {
                    violations: vec![Violation {
                        pointer: String::new(),
                        keyword: keyword.into(),
                        schema_path: String::new(),
                        expected: reach_rpc::errors::cut(&e.to_string(), MAX_EXPECTED_CHARS),
                    }],
                });
            }
        };
        let mut repairs = Vec::new();
        match parsed.method {
            ParseMethod::Json => {}
            ParseMethod::Empty => repairs.push(Repair {
                pointer: String::new(),
                kind: RepairKind::EmptyArguments,
                from: Value::String(text.to_string()),
                to: parsed.value.clone(),
            }),
            method => repairs.push(Repair {
                pointer: String::new(),
                kind: RepairKind::LenientParse,
                from: Value::String(text.chars().take(200).collect()),
                to: Value::String(method.as_str().to_string()),
            }),
        }
        let mut prepared = self.repair(parsed.value)?;
        repairs.append(&mut prepared.repairs);
        prepared.repairs = repairs;
        Ok(prepared)
    }

    /// Repairs and validates an already parsed value.
    ///
    /// # Errors
    /// [`InvalidArguments`] naming every field that could not be repaired.
    pub fn repair(&self, mut value: Value) -> Result<Prepared, InvalidArguments> {
        let mut repairs = Vec::new();
        let root = self.schema.as_ref();
        let mut round = 0;
        loop {
            // Again after each round: a repaired value (a decoded JSON string) may lack
            // defaulted properties.
            fill_defaults(root, root, &mut value, "", &mut repairs, 0);
            let failures: Vec<Failure> = self
                .validator
                .iter_errors(&value)
                .map(|e| Failure::of(&e))
                .collect();
            if failures.is_empty() {
                break;
            }
            round += 1;
            let mut changed = false;
            if round <= MAX_ROUNDS {
                for failure in &failures {
                    let Some(node) = parent_location(&failure.schema_path)
                        .and_then(|location| resolve(root, &location))
                    else {
                        continue;
                    };
                    let Some(target) = value.pointer_mut(&failure.instance_path) else {
                        continue;
                    };
                    if let Some((new, kind)) = coerce(root, node, target, &failure.keyword) {
                        repairs.push(Repair {
                            pointer: failure.instance_path.clone(),
                            kind,
                            from: target.clone(),
                            to: new.clone(),
                        });
                        *target = new;
                        changed = true;
                    }
                }
            }
            if !changed {
                return Err(InvalidArguments {
                    violations: failures.into_iter().map(Failure::violation).collect(),
                });
            }
        }
        integral_floats(&mut value, "", &mut repairs);
        Ok(Prepared { value, repairs })
    }

    /// Validates `value` without repairing it.
    ///
    /// # Errors
    /// [`InvalidArguments`] naming every bad field.
    pub fn validate(&self, value: &Value) -> Result<(), InvalidArguments> {
        let violations: Vec<Violation> = self
            .validator
            .iter_errors(value)
            .map(|e| Failure::of(&e).violation())
            .collect();
        if violations.is_empty() {
            Ok(())
        } else {
            Err(InvalidArguments { violations })
        }
    }
}

/// Compiles a schema with formats asserted, refusing a schema that would refuse what it
/// means to accept ([`reach_protocol::schema_pitfall`]).
pub(crate) fn compile(schema: &Value) -> Result<jsonschema::Validator, SchemaError> {
    if let Some(pitfall) = reach_protocol::schema_pitfall(schema) {
        return Err(SchemaError(format!("the schema {pitfall}")));
    }
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .map_err(|e| SchemaError(e.to_string()))
}

/// What one validation error says, owned.
struct Failure {
    instance_path: String,
    schema_path: String,
    keyword: String,
    /// The property a `required` / `additionalProperties` error is about.
    property: Option<String>,
    message: String,
}

impl Failure {
    fn of(error: &jsonschema::ValidationError<'_>) -> Self {
        use jsonschema::error::ValidationErrorKind as Kind;
        let property = match error.kind() {
            Kind::Required { property } => property.as_str().map(str::to_string),
            Kind::AdditionalProperties { unexpected }
            | Kind::UnevaluatedProperties { unexpected } => unexpected.first().cloned(),
            _ => None,
        };
        Self {
            instance_path: error.instance_path().to_string(),
            schema_path: error.schema_path().to_string(),
            keyword: error.kind().keyword().to_string(),
            property,
            message: error.to_string(),
        }
    }

    fn violation(self) -> Violation {
        let (pointer, expected) = match (&self.property, self.keyword.as_str()) {
            (Some(name), "required") => (
                child(&self.instance_path, name),
                "this required property is missing; provide it".to_string(),
            ),
            (Some(name), "additionalProperties" | "unevaluatedProperties") => (
                child(&self.instance_path, name),
                "this property is not allowed by the schema (no additional properties); remove it"
                    .to_string(),
            ),
            // The validator's message quotes the bad value: cut it, so a model that sent a
            // huge value does not get it back twice over in every retry.
            _ => (
                self.instance_path.clone(),
                reach_rpc::errors::cut(&self.message, MAX_EXPECTED_CHARS),
            ),
        };
        Violation {
            pointer,
            keyword: self.keyword,
            schema_path: self.schema_path,
            expected,
        }
    }
}

/// The most characters of a violation's `expected` text (validator messages quote values).
const MAX_EXPECTED_CHARS: usize = 300;

/// `pointer` + `/name`, escaped per RFC 6901.
fn child(pointer: &str, name: &str) -> String {
    format!("{pointer}/{}", name.replace('~', "~0").replace('/', "~1"))
}

/// The schema location without its last segment (the keyword): the node holding it.
fn parent_location(schema_path: &str) -> Option<String> {
    let cut = schema_path.rfind('/')?;
    Some(schema_path[..cut].to_string())
}

/// The schema node at `location` (a JSON pointer into `root`), following local `$ref`s met on
/// the way.
fn resolve<'a>(root: &'a Value, location: &str) -> Option<&'a Value> {
    let mut node = root;
    if location.is_empty() {
        return Some(follow_ref(root, node));
    }
    for raw in location.strip_prefix('/')?.split('/') {
        let segment = raw.replace("~1", "/").replace("~0", "~");
        if segment == "$ref" {
            node = follow_ref(root, node);
            continue;
        }
        node = match node {
            Value::Object(map) => match map.get(&segment) {
                Some(next) => next,
                None => follow_ref(root, node).get(&segment)?,
            },
            Value::Array(items) => items.get(segment.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(follow_ref(root, node))
}

/// `node`, or the node its local `$ref` (`#/...`) points to (up to 16 hops).
fn follow_ref<'a>(root: &'a Value, mut node: &'a Value) -> &'a Value {
    for _ in 0..16 {
        let Some(reference) = node.get("$ref").and_then(Value::as_str) else {
            return node;
        };
        let Some(pointer) = reference.strip_prefix('#') else {
            return node;
        };
        match root.pointer(pointer) {
            Some(next) => node = next,
            None => return node,
        }
    }
    node
}

fn fill_defaults(
    root: &Value,
    node: &Value,
    value: &mut Value,
    pointer: &str,
    repairs: &mut Vec<Repair>,
    depth: usize,
) {
    if depth > 64 {
        return;
    }
    let node = follow_ref(root, node);
    if let Some(all) = node.get("allOf").and_then(Value::as_array) {
        for member in all {
            fill_defaults(root, member, value, pointer, repairs, depth + 1);
        }
    }
    match value {
        Value::Object(map) => {
            let Some(properties) = node.get("properties").and_then(Value::as_object) else {
                return;
            };
            for (name, sub) in properties {
                let sub = follow_ref(root, sub);
                let at = child(pointer, name);
                match map.get_mut(name) {
                    Some(present) => fill_defaults(root, sub, present, &at, repairs, depth + 1),
                    None => {
                        if let Some(default) = sub.get("default").filter(|d| !d.is_null()) {
                            repairs.push(Repair {
                                pointer: at,
                                kind: RepairKind::DefaultFilled,
                                from: Value::Null,
                                to: default.clone(),
                            });
                            map.insert(name.clone(), default.clone());
                        }
                    }
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = node.get("items").filter(|i| i.is_object()) {
                for (i, item) in items.iter_mut().enumerate() {
                    let at = format!("{pointer}/{i}");
                    fill_defaults(root, item_schema, item, &at, repairs, depth + 1);
                }
            }
        }
        _ => {}
    }
}

/// One safe repair of `value`, which failed `keyword` of schema `node`.
fn coerce(root: &Value, node: &Value, value: &Value, keyword: &str) -> Option<(Value, RepairKind)> {
    match keyword {
        "type" => coerce_type(node.get("type")?, value),
        "enum" => match_enum(node.get("enum")?.as_array()?, value),
        "const" => match_enum(std::slice::from_ref(node.get("const")?), value),
        "format" | "pattern" | "minLength" | "maxLength" => trim(value),
        "anyOf" | "oneOf" => {
            let branches = node.get(keyword)?.as_array()?;
            let mut accepted: Vec<(Value, RepairKind)> = Vec::new();
            for branch in branches {
                let branch = follow_ref(root, branch);
                let candidate = ["type", "enum", "const", "format"]
                    .into_iter()
                    .filter(|k| branch.get(*k).is_some())
                    .find_map(|k| coerce(root, branch, value, k));
                if let Some((candidate, kind)) = candidate
                    && compile(branch).is_ok_and(|v| v.is_valid(&candidate))
                    && !accepted.iter().any(|(c, _)| *c == candidate)
                {
                    accepted.push((candidate, kind));
                }
            }
            (accepted.len() == 1).then(|| accepted.remove(0))
        }
        _ => None,
    }
}

fn coerce_type(types: &Value, value: &Value) -> Option<(Value, RepairKind)> {
    let types: Vec<&str> = match types {
        Value::String(t) => vec![t.as_str()],
        Value::Array(list) => list.iter().filter_map(Value::as_str).collect(),
        _ => return None,
    };
    let wants = |t: &str| types.contains(&t);
    match value {
        Value::String(s) => {
            let text = s.trim();
            if wants("integer") {
                if let Ok(n) = text.parse::<i64>() {
                    return Some((Value::from(n), RepairKind::StringToInteger));
                }
                if let Ok(f) = text.parse::<f64>()
                    && f.is_finite()
                    && f.fract() == 0.0
                    && f.abs() < 9.007_199_254_740_992e15
                {
                    return Some((Value::from(f as i64), RepairKind::StringToInteger));
                }
            }
            if wants("number")
                && let Ok(f) = text.parse::<f64>()
                && f.is_finite()
            {
                let number = if f.fract() == 0.0 && f.abs() < 9.007_199_254_740_992e15 {
                    Value::from(f as i64)
                } else {
                    Value::from(f)
                };
                return Some((number, RepairKind::StringToNumber));
            }
            if wants("boolean") {
                match text.to_ascii_lowercase().as_str() {
                    "true" => return Some((Value::Bool(true), RepairKind::StringToBoolean)),
                    "false" => return Some((Value::Bool(false), RepairKind::StringToBoolean)),
                    _ => {}
                }
            }
            if (wants("object") || wants("array"))
                && let Ok(parsed) =
                    crate::arguments::parse_arguments_with(text, ArgumentLimits::default(), false)
                && ((wants("object") && parsed.value.is_object())
                    || (wants("array") && parsed.value.is_array()))
            {
                return Some((parsed.value, RepairKind::DecodedJsonString));
            }
            None
        }
        Value::Number(n) if wants("string") => {
            Some((Value::String(n.to_string()), RepairKind::ToString))
        }
        Value::Bool(b) if wants("string") => {
            Some((Value::String(b.to_string()), RepairKind::ToString))
        }
        _ => None,
    }
}

fn match_enum(options: &[Value], value: &Value) -> Option<(Value, RepairKind)> {
    let text = value.as_str()?;
    let trimmed = text.trim();
    if trimmed != text && options.iter().any(|o| o.as_str() == Some(trimmed)) {
        return Some((Value::String(trimmed.to_string()), RepairKind::Trimmed));
    }
    let matches: Vec<&Value> = options
        .iter()
        .filter(|o| o.as_str().is_some_and(|o| o.eq_ignore_ascii_case(trimmed)))
        .collect();
    match matches.as_slice() {
        [only] => Some(((*only).clone(), RepairKind::EnumCase)),
        _ => None,
    }
}

fn trim(value: &Value) -> Option<(Value, RepairKind)> {
    let text = value.as_str()?;
    let trimmed = text.trim();
    (trimmed != text).then(|| (Value::String(trimmed.to_string()), RepairKind::Trimmed))
}

fn integral_floats(value: &mut Value, pointer: &str, repairs: &mut Vec<Repair>) {
    match value {
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.is_finite() && f.fract() == 0.0 && f.abs() < 9.007_199_254_740_992e15 {
                let to = Value::from(f as i64);
                repairs.push(Repair {
                    pointer: pointer.to_string(),
                    kind: RepairKind::IntegralFloat,
                    from: value.clone(),
                    to: to.clone(),
                });
                *value = to;
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                integral_floats(item, &format!("{pointer}/{i}"), repairs);
            }
        }
        Value::Object(map) => {
            for (name, item) in map.iter_mut() {
                integral_floats(item, &child(pointer, name), repairs);
            }
        }
        _ => {}
    }
}
