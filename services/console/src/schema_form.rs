//! A human node's input JSON Schema as an HTML form: [`Form::of`] reads the schema's
//! top-level properties as [`Field`]s (enums as choices, `required` marked, `description`
//! as help text, `title` as the label), [`Form::input`] turns the posted form back into the
//! JSON the API expects, and [`Form::errors`] places the API's violations (JSON pointers
//! such as `input/category`) next to the field they concern.
//!
//! A schema the form cannot express field by field (no `properties`, or a property that is
//! an object or array) still works: such a property is a JSON text area, and a schema
//! without properties is one JSON text area for the whole input.
//!
//! Bounds: a schema of at most [`MAX_SCHEMA_BYTES`] bytes and [`MAX_SCHEMA_DEPTH`] levels,
//! at most [`MAX_FIELDS`] fields and [`MAX_CHOICES`] choices each, at most
//! [`MAX_VALUE_BYTES`] per posted value.

use std::collections::BTreeMap;

use maud::{Markup, html};
use serde_json::{Map, Value};

/// The largest schema rendered, in bytes of JSON.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The deepest schema rendered (nested objects and arrays).
pub const MAX_SCHEMA_DEPTH: usize = 32;
/// The most fields a form has.
pub const MAX_FIELDS: usize = 64;
/// The most choices a field has.
pub const MAX_CHOICES: usize = 256;
/// The largest posted value of one field, in bytes.
pub const MAX_VALUE_BYTES: usize = 16 * 1024;
/// The prefix of a field's HTML name (`f.category`), apart from the console's own inputs.
pub const FIELD_PREFIX: &str = "f.";
/// The HTML name of the single JSON text area of a schema without properties.
pub const WHOLE_INPUT: &str = "f.";

/// What kind of input a field is.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// One of these values (`enum`, or `const`): a select.
    Choice(Vec<Value>),
    /// `true` or `false`: a select of yes / no.
    Boolean,
    /// An integer (`type: integer`).
    Integer,
    /// A number (`type: number`).
    Number,
    /// A string; `multiline` for long text (no `maxLength` under 120, or `format: textarea`).
    Text {
        /// Whether to render a text area.
        multiline: bool,
    },
    /// Any JSON value, typed as JSON text (objects, arrays, unions).
    Json,
}

/// One field of the form: a top-level property of the schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    /// The property name (the JSON key).
    pub name: String,
    /// The label: the property's `title`, else its name.
    pub label: String,
    /// The input kind.
    pub kind: Kind,
    /// Whether the schema lists it in `required`.
    pub required: bool,
    /// The property's `description`, as help text.
    pub help: Option<String>,
    /// The property's `default`.
    pub default: Option<Value>,
}

/// A form generated from a schema.
#[derive(Debug, Clone, PartialEq)]
pub struct Form {
    /// The fields by property name (the schema reaches the console as a protobuf `Struct`,
    /// which keeps no key order); empty for a whole-input JSON form.
    pub fields: Vec<Field>,
    /// Whether the whole input is one JSON text area (a schema without `properties`, or
    /// none).
    pub whole_json: bool,
}

/// Why a schema cannot be rendered as a form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// The schema is larger than [`MAX_SCHEMA_BYTES`].
    #[error("the node's schema has {0} bytes, more than the console renders ({MAX_SCHEMA_BYTES})")]
    TooLarge(usize),
    /// The schema nests deeper than [`MAX_SCHEMA_DEPTH`].
    #[error("the node's schema nests deeper than {MAX_SCHEMA_DEPTH} levels")]
    TooDeep,
    /// The schema has more than [`MAX_FIELDS`] properties.
    #[error("the node's schema has {0} properties, more than a form shows ({MAX_FIELDS})")]
    TooManyFields(usize),
}

/// The errors of a submitted form: per field name, and those of the form as a whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Errors {
    /// Messages by field name.
    pub fields: BTreeMap<String, Vec<String>>,
    /// Messages about no single field.
    pub form: Vec<String>,
}

impl Errors {
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty() && self.form.is_empty()
    }
}

fn depth(value: &Value) -> usize {
    match value {
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

impl Form {
    /// The form of `schema` (`None`: any input, one JSON text area).
    ///
    /// # Errors
    /// [`SchemaError`] when the schema breaks a bound.
    pub fn of(schema: Option<&Value>) -> Result<Self, SchemaError> {
        let Some(schema) = schema.filter(|s| !s.is_null()) else {
            return Ok(Self {
                fields: Vec::new(),
                whole_json: true,
            });
        };
        let bytes = schema.to_string().len();
        if bytes > MAX_SCHEMA_BYTES {
            return Err(SchemaError::TooLarge(bytes));
        }
        if depth(schema) > MAX_SCHEMA_DEPTH {
            return Err(SchemaError::TooDeep);
        }
        let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
            return Ok(Self {
                fields: Vec::new(),
                whole_json: true,
            });
        };
        if properties.len() > MAX_FIELDS {
            return Err(SchemaError::TooManyFields(properties.len()));
        }
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let fields = properties
            .iter()
            .map(|(name, property)| Field {
                name: name.clone(),
                label: property
                    .get("title")
                    .and_then(Value::as_str)
                    .unwrap_or(name)
                    .to_string(),
                kind: kind_of(property),
                required: required.contains(&name.as_str()),
                help: property
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                default: property.get("default").cloned(),
            })
            .collect();
        Ok(Self {
            fields,
            whole_json: false,
        })
    }

    /// The JSON input of a posted form (`(name, value)` pairs as the browser sent them):
    /// empty fields are left out (so a missing required one is the API's to report), a
    /// choice is the JSON value it stands for, numbers and booleans are parsed.
    ///
    /// # Errors
    /// [`Errors`] naming each field whose text is no value of its kind (a number that does
    /// not parse, JSON that does not parse, an unknown choice, a value over
    /// [`MAX_VALUE_BYTES`]).
    pub fn input(&self, posted: &[(String, String)]) -> Result<Value, Errors> {
        let mut errors = Errors::default();
        let value_of = |name: &str| {
            posted
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        if self.whole_json {
            let text = value_of(WHOLE_INPUT).unwrap_or("").trim();
            if text.is_empty() {
                return Ok(Value::Object(Map::new()));
            }
            if text.len() > MAX_VALUE_BYTES {
                errors
                    .form
                    .push(format!("the input is longer than {MAX_VALUE_BYTES} bytes"));
                return Err(errors);
            }
            return serde_json::from_str(text).map_err(|e| {
                errors.form.push(format!("the input is not JSON: {e}"));
                errors
            });
        }
        let mut input = Map::new();
        for field in &self.fields {
            let Some(text) = value_of(&format!("{FIELD_PREFIX}{}", field.name)) else {
                continue;
            };
            if text.len() > MAX_VALUE_BYTES {
                errors.add(
                    &field.name,
                    format!("longer than {MAX_VALUE_BYTES} bytes; shorten it"),
                );
                continue;
            }
            let trimmed = text.trim();
            if trimmed.is_empty() {
                continue;
            }
            let value = match &field.kind {
                Kind::Choice(choices) => match choices.iter().find(|c| choice_key(c) == trimmed) {
                    Some(c) => c.clone(),
                    None => {
                        errors.add(&field.name, "choose one of the listed values".into());
                        continue;
                    }
                },
                Kind::Boolean => Value::Bool(trimmed == "true"),
                Kind::Integer => match trimmed.parse::<i64>() {
                    Ok(n) => Value::from(n),
                    Err(_) => {
                        errors.add(&field.name, format!("{trimmed:?} is not a whole number"));
                        continue;
                    }
                },
                Kind::Number => match trimmed
                    .parse::<f64>()
                    .ok()
                    .and_then(|n| serde_json::Number::from_f64(n).map(Value::Number))
                {
                    Some(n) => n,
                    None => {
                        errors.add(&field.name, format!("{trimmed:?} is not a number"));
                        continue;
                    }
                },
                Kind::Text { .. } => Value::String(text.to_string()),
                Kind::Json => match serde_json::from_str(trimmed) {
                    Ok(v) => v,
                    Err(e) => {
                        errors.add(&field.name, format!("not JSON: {e}"));
                        continue;
                    }
                },
            };
            input.insert(field.name.clone(), value);
        }
        if errors.is_empty() {
            Ok(Value::Object(input))
        } else {
            Err(errors)
        }
    }

    /// The API's violations (`(field path, description)` of its `google.rpc.BadRequest`:
    /// `input/category`, `input/` for the input as a whole) placed on the fields they
    /// concern: the first pointer segment names the field; a `required` violation of the
    /// whole input names its field in quotes (`"category" is a required property`).
    pub fn errors(&self, violations: &[(String, String)]) -> Errors {
        let mut errors = Errors::default();
        for (path, message) in violations {
            let pointer = path.strip_prefix("input").unwrap_or(path);
            let first = pointer
                .trim_start_matches('/')
                .split('/')
                .next()
                .unwrap_or("")
                .replace("~1", "/")
                .replace("~0", "~");
            let named = if first.is_empty() {
                // The whole input: a missing required property names itself in quotes.
                message
                    .strip_prefix('"')
                    .and_then(|rest| rest.split_once('"'))
                    .filter(|(_, tail)| tail.contains("required"))
                    .map(|(name, _)| name.to_string())
            } else {
                Some(first)
            };
            match named.filter(|n| self.fields.iter().any(|f| &f.name == n)) {
                Some(name) => errors.add(&name, message.clone()),
                None => errors.form.push(message.clone()),
            }
        }
        errors
    }

    /// The form's inputs, `posted` values kept (after an error), else each field's default;
    /// each field's `errors` under it.
    pub fn render(&self, posted: &[(String, String)], errors: &Errors) -> Markup {
        let value_of = |name: &str| {
            posted
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        if self.whole_json {
            let text = value_of(WHOLE_INPUT).unwrap_or_default();
            return html! {
                div.field {
                    label for="f-input" { "Input (JSON)" }
                    textarea id="f-input" name=(WHOLE_INPUT) rows="6" { (text) }
                    p.help { "The node accepts any JSON value; an empty box sends {}." }
                }
            };
        }
        html! {
            @for field in self.fields.iter().take(MAX_FIELDS) {
                @let id = format!("f-{}", field.name);
                @let name = format!("{FIELD_PREFIX}{}", field.name);
                @let current = value_of(&name).or_else(|| field.default.as_ref().map(default_text));
                @let field_errors = errors.fields.get(&field.name);
                div class={ "field" @if field_errors.is_some() { " invalid" } } data-field=(field.name) {
                    label for=(id) {
                        (field.label)
                        @if field.required { span.required title="required" aria-label="required" { " *" } }
                    }
                    @match &field.kind {
                        Kind::Choice(choices) => {
                            select id=(id) name=(name) {
                                option value="" { "— choose —" }
                                @for choice in choices.iter().take(MAX_CHOICES) {
                                    @let key = choice_key(choice);
                                    option value=(key) selected[current.as_deref() == Some(key.as_str())] { (key) }
                                }
                            }
                        }
                        Kind::Boolean => {
                            select id=(id) name=(name) {
                                option value="" { "— choose —" }
                                option value="true" selected[current.as_deref() == Some("true")] { "yes" }
                                option value="false" selected[current.as_deref() == Some("false")] { "no" }
                            }
                        }
                        Kind::Integer => {
                            input id=(id) name=(name) type="number" step="1" value=[current.as_deref()];
                        }
                        Kind::Number => {
                            input id=(id) name=(name) type="number" step="any" value=[current.as_deref()];
                        }
                        Kind::Text { multiline: true } => {
                            textarea id=(id) name=(name) rows="3" { (current.unwrap_or_default()) }
                        }
                        Kind::Text { multiline: false } => {
                            input id=(id) name=(name) type="text" value=[current.as_deref()];
                        }
                        Kind::Json => {
                            textarea id=(id) name=(name) rows="4" placeholder="JSON" { (current.unwrap_or_default()) }
                        }
                    }
                    @if let Some(help) = &field.help { p.help { (help) } }
                    @if let Some(messages) = field_errors {
                        @for message in messages { p.error role="alert" { (message) } }
                    }
                }
            }
        }
    }
}

impl Errors {
    fn add(&mut self, field: &str, message: String) {
        self.fields
            .entry(field.to_string())
            .or_default()
            .push(message);
    }
}

/// The text a choice is posted as: a string itself, anything else as JSON.
fn choice_key(choice: &Value) -> String {
    match choice {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A default value as the text of its input.
fn default_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The input kind of a property schema.
fn kind_of(property: &Value) -> Kind {
    if let Some(choices) = property.get("enum").and_then(Value::as_array) {
        return Kind::Choice(choices.iter().take(MAX_CHOICES).cloned().collect());
    }
    if let Some(constant) = property.get("const") {
        return Kind::Choice(vec![constant.clone()]);
    }
    match property.get("type").and_then(Value::as_str) {
        Some("boolean") => Kind::Boolean,
        Some("integer") => Kind::Integer,
        Some("number") => Kind::Number,
        Some("string") => {
            let short = property
                .get("maxLength")
                .and_then(Value::as_u64)
                .is_some_and(|n| n <= 120);
            let area = property.get("format").and_then(Value::as_str) == Some("textarea");
            Kind::Text {
                multiline: area || !short,
            }
        }
        _ => Kind::Json,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn review() -> Value {
        json!({
            "type": "object",
            "required": ["category"],
            "properties": {
                "category": {"type": "string", "enum": ["servicing", "repayment", "other"], "description": "Where the complaint goes."},
                "note": {"type": "string", "maxLength": 100},
                "score": {"type": "integer", "title": "Score"},
                "tags": {"type": "array"},
                "urgent": {"type": "boolean"}
            }
        })
    }

    fn posted(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    #[test]
    fn properties_become_fields() {
        let form = Form::of(Some(&review())).unwrap();
        assert!(!form.whole_json);
        let names: Vec<_> = form.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["category", "note", "score", "tags", "urgent"]);
        let category = &form.fields[0];
        assert!(category.required);
        assert_eq!(category.help.as_deref(), Some("Where the complaint goes."));
        assert_eq!(
            category.kind,
            Kind::Choice(vec![json!("servicing"), json!("repayment"), json!("other")])
        );
        assert_eq!(form.fields[1].kind, Kind::Text { multiline: false });
        assert_eq!(form.fields[2].label, "Score");
        assert_eq!(form.fields[2].kind, Kind::Integer);
        assert_eq!(form.fields[3].kind, Kind::Json);
        assert_eq!(form.fields[4].kind, Kind::Boolean);
        assert!(Form::of(None).unwrap().whole_json);
        assert!(
            Form::of(Some(&json!({"type": "object"})))
                .unwrap()
                .whole_json
        );
    }

    #[test]
    fn posted_forms_become_json() {
        let form = Form::of(Some(&review())).unwrap();
        let input = form
            .input(&posted(&[
                ("f.category", "repayment"),
                ("f.note", ""),
                ("f.score", "3"),
                ("f.urgent", "true"),
                ("f.tags", "[\"a\"]"),
                ("reviewer", "ana"),
            ]))
            .unwrap();
        assert_eq!(
            input,
            json!({"category": "repayment", "score": 3, "urgent": true, "tags": ["a"]})
        );
        let errors = form
            .input(&posted(&[("f.score", "three"), ("f.category", "nope")]))
            .unwrap_err();
        assert_eq!(
            errors.fields.keys().collect::<Vec<_>>(),
            ["category", "score"]
        );
        let long = "x".repeat(MAX_VALUE_BYTES + 1);
        assert!(form.input(&posted(&[("f.note", &long)])).is_err());
    }

    #[test]
    fn api_pointers_land_on_their_fields() {
        let form = Form::of(Some(&review())).unwrap();
        let errors = form.errors(&[
            (
                "input/".into(),
                "\"category\" is a required property".into(),
            ),
            (
                "input/score".into(),
                "\"x\" is not of type \"integer\"".into(),
            ),
            ("input/".into(), "something about the whole".into()),
            ("input/unknown".into(), "no such field".into()),
        ]);
        assert_eq!(
            errors.fields["category"],
            ["\"category\" is a required property"]
        );
        assert_eq!(errors.fields["score"].len(), 1);
        assert_eq!(errors.form, ["something about the whole", "no such field"]);
    }

    #[test]
    fn rendering_marks_required_and_errors_and_escapes() {
        let schema = json!({
            "type": "object",
            "required": ["category"],
            "properties": {"category": {"enum": ["<b>"], "description": "<i>help</i>"}}
        });
        let form = Form::of(Some(&schema)).unwrap();
        let errors = form.errors(&[("input/category".into(), "bad <value>".into())]);
        let html = form.render(&[], &errors).into_string();
        assert!(html.contains("class=\"required\""), "{html}");
        assert!(html.contains("&lt;b&gt;"), "{html}");
        assert!(html.contains("&lt;i&gt;help&lt;/i&gt;"), "{html}");
        assert!(html.contains("bad &lt;value&gt;"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
    }

    #[test]
    fn schemas_out_of_bounds_are_refused() {
        let mut deep = json!({});
        for _ in 0..40 {
            deep = json!({"items": deep});
        }
        assert_eq!(Form::of(Some(&deep)), Err(SchemaError::TooDeep));
        let many: Map<String, Value> = (0..=MAX_FIELDS)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        assert!(matches!(
            Form::of(Some(&json!({"properties": many}))),
            Err(SchemaError::TooManyFields(_))
        ));
    }
}
