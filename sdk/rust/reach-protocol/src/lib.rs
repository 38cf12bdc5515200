//! The protocol registry: what the mesh's capabilities are, what their messages look like
//! and how to bridge versions, loaded from `protocol-registry.yaml`.
//!
//! ```yaml
//! capabilities:
//!   complaint.classify:
//!     description: classify a consumer complaint
//!     versions: ["1.0.0", "2.0.0"]
//!     idempotent: true              # the router may retry it after a reset
//!     input: complaint.classify_request
//!     output: complaint.classification
//! message_types:
//!   complaint.classify_request:
//!     schema: {type: object, required: [narrative]}
//! adapters:
//!   - capability: complaint.classify
//!     from: "1.0.0"                 # the version the caller speaks
//!     to: "2.0.0"                   # the version the instance serves (^to matches)
//!     request: '.text = .narrative | del(.narrative)'   # jq, run by jaq
//!     response: '.label = .category | del(.category)'
//! ```
//!
//! Transforms are jq programs run by [jaq](https://github.com/01mf02/jaq): a filter such as
//! `.text = .narrative | del(.narrative)` touches only the fields it names, so every other
//! field passes through untouched.
//!
//! # Layout
//! - [`ProtocolRegistry`]: the loaded file, with lookups (capability, schema, adapter).
//! - [`Transform`]: one compiled jq program.
//! - [`LoadError`]: what is wrong with a file, located (file, line and column, or the path of
//!   the offending entry).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Why a protocol registry file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read protocol registry {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The YAML is malformed or has unknown keys.
    #[error("{path}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// An entry is invalid; `at` is its path in the document.
    #[error("{path}: {at}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Where in the document (for example `adapters[0].request`).
        at: String,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Why a payload or transform failed at run time.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The payload does not match the schema.
    #[error("{detail}")]
    SchemaViolation {
        /// The JSON pointer of the offending property ("" for the root): for a missing
        /// `required` property or an unexpected one (`additionalProperties`,
        /// `unevaluatedProperties`) the property's own pointer, not its object's.
        pointer: String,
        /// The schema keyword that failed (`type`, `required`, `format`, ...).
        keyword: String,
        /// The JSON pointer, within the schema, of that keyword (its `keywordLocation`, JSON
        /// Schema 2020-12 Core §12.4.2), e.g. `/allOf/0/additionalProperties`.
        schema_path: String,
        /// What the schema requires.
        detail: String,
    },
    /// A transform failed or produced no single value.
    #[error("{0}")]
    Transform(String),
}

/// The file's shape.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    capabilities: BTreeMap<String, CapabilitySpec>,
    #[serde(default)]
    message_types: BTreeMap<String, MessageTypeSpec>,
    #[serde(default)]
    adapters: Vec<AdapterSpec>,
}

/// A declared capability.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapabilitySpec {
    /// What it does.
    #[serde(default)]
    pub description: String,
    /// The versions that exist (semver); empty means any.
    #[serde(default)]
    pub versions: Vec<String>,
    /// Whether running it twice has the effect of running it once, so the router may retry
    /// it after an ambiguous failure.
    #[serde(default)]
    pub idempotent: bool,
    /// The message type of its requests.
    #[serde(default)]
    pub input: Option<String>,
    /// The message type of its replies.
    #[serde(default)]
    pub output: Option<String>,
}

/// A declared message type.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessageTypeSpec {
    /// What it carries.
    #[serde(default)]
    pub description: String,
    /// The JSON Schema of its first `data` part.
    #[serde(default)]
    pub schema: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct AdapterSpec {
    capability: String,
    from: String,
    to: String,
    #[serde(default)]
    request: Option<String>,
    #[serde(default)]
    response: Option<String>,
}

/// A version adapter: the caller speaks `from`, the instance serves a version matching `^to`.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// The capability.
    pub capability: String,
    /// The version the caller speaks.
    pub from: semver::Version,
    /// The version the instance serves.
    pub to: semver::Version,
    /// Rewrites a request from `from` to `to` (identity when unset).
    pub request: Option<Transform>,
    /// Rewrites a reply from `to` back to `from` (identity when unset).
    pub response: Option<Transform>,
}

impl Adapter {
    /// Whether an instance at `version` can take adapted requests (`^to`).
    pub fn serves(&self, version: &semver::Version) -> bool {
        version.major == self.to.major
            && (self.to.major != 0 || version.minor == self.to.minor)
            && version >= &self.to
    }

    /// `capability from -> to`, for messages.
    pub fn name(&self) -> String {
        format!("{} {} -> {}", self.capability, self.from, self.to)
    }
}

/// One jq program, checked at load time.
#[derive(Debug, Clone)]
pub struct Transform {
    code: String,
}

impl Transform {
    /// Compiles `code` to check it.
    ///
    /// # Errors
    /// The parser's or compiler's message.
    pub fn new(code: &str) -> Result<Self, String> {
        compile(code)?;
        Ok(Self {
            code: code.to_string(),
        })
    }

    /// The program text.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// Runs the program on `input`; it must produce exactly one value.
    ///
    /// # Errors
    /// [`ProtocolError::Transform`] when the program fails or yields no or several values.
    pub fn apply(&self, input: &serde_json::Value) -> Result<serde_json::Value, ProtocolError> {
        use jaq_core::{Ctx, Vars, data, unwrap_valr};
        // jaq values are reference counted (not Send), so the program is compiled per run;
        // adapters are off the common path.
        let filter = compile(&self.code).map_err(ProtocolError::Transform)?;
        let text = input.to_string();
        let value = jaq_json::read::parse_single(text.as_bytes())
            .map_err(|e| ProtocolError::Transform(format!("cannot read the payload: {e:?}")))?;
        let ctx = Ctx::<data::JustLut<jaq_json::Val>>::new(&filter.lut, Vars::new([]));
        let mut out = filter.id.run((ctx, value)).map(unwrap_valr);
        let first = out
            .next()
            .ok_or_else(|| ProtocolError::Transform("the transform produced no value".into()))?
            .map_err(|e| ProtocolError::Transform(format!("the transform failed: {e}")))?;
        if out.next().is_some() {
            return Err(ProtocolError::Transform(
                "the transform produced several values; it must produce exactly one".into(),
            ));
        }
        serde_json::from_str(&first.to_string()).map_err(|e| {
            ProtocolError::Transform(format!("the transform's output is not JSON: {e}"))
        })
    }
}

fn compile(code: &str) -> Result<jaq_core::Filter<jaq_core::data::JustLut<jaq_json::Val>>, String> {
    use jaq_core::load::{Arena, File, Loader};
    let defs = jaq_core::defs()
        .chain(jaq_std::defs())
        .chain(jaq_json::defs());
    let funs = jaq_core::funs()
        .chain(jaq_std::funs())
        .chain(jaq_json::funs());
    let loader = Loader::new(defs);
    let arena = Arena::default();
    let modules = loader
        .load(&arena, File { code, path: () })
        .map_err(|errors| syntax_errors(code, &errors))?;
    jaq_core::Compiler::default()
        .with_funs(funs)
        .compile(modules)
        .map_err(|errors| format!("jq compile error: {errors:?}"))
}

/// jaq's load errors as one line: what was expected, where (byte offset) and what was found,
/// e.g. `jq syntax error: expected closing parenthesis at byte 5 (found "(")`.
fn syntax_errors(code: &str, errors: &jaq_core::load::Errors<&str, ()>) -> String {
    use jaq_core::load::Error;
    let at = |found: &str| {
        let offset = (found.as_ptr() as usize).saturating_sub(code.as_ptr() as usize);
        let shown: String = found.chars().take(20).collect();
        if shown.is_empty() {
            format!("at byte {offset} (the end)")
        } else {
            format!("at byte {offset} (found {shown:?})")
        }
    };
    let mut described = Vec::new();
    for (_, error) in errors {
        match error {
            Error::Io(failures) => {
                described.extend(failures.iter().map(|(path, why)| format!("{path}: {why}")));
            }
            Error::Lex(failures) => {
                described.extend(failures.iter().map(|(expected, found)| {
                    format!("expected {} {}", expected.as_str(), at(found))
                }))
            }
            Error::Parse(failures) => {
                described.extend(failures.iter().map(|(expected, found)| {
                    format!("expected {} {}", expected.as_str(), at(found))
                }))
            }
        }
    }
    format!("jq syntax error: {}", described.join("; "))
}

/// A loaded protocol registry.
#[derive(Debug)]
pub struct ProtocolRegistry {
    path: PathBuf,
    capabilities: BTreeMap<String, CapabilitySpec>,
    message_types: BTreeMap<String, MessageTypeSpec>,
    validators: BTreeMap<String, jsonschema::Validator>,
    adapters: Vec<Adapter>,
}

impl ProtocolRegistry {
    /// Loads and checks `path`.
    ///
    /// # Errors
    /// [`LoadError`], located in the file.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(path, &text)
    }

    /// Parses and checks `text` (read from `path`, which errors name).
    ///
    /// # Errors
    /// [`LoadError`], located in the text.
    pub fn parse(path: &Path, text: &str) -> Result<Self, LoadError> {
        let file: File = serde_norway::from_str(text).map_err(|e| LoadError::Syntax {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let invalid = |at: String, message: String| LoadError::Invalid {
            path: path.to_path_buf(),
            at,
            message,
        };
        if file.capabilities.is_empty() && file.message_types.is_empty() && file.adapters.is_empty()
        {
            return Err(invalid(
                "(the whole file)".into(),
                "it declares no capabilities, message_types or adapters; point to the protocol registry (see examples/protocol-registry.yaml), or unset the setting for none".into(),
            ));
        }
        for (name, capability) in &file.capabilities {
            for (i, version) in capability.versions.iter().enumerate() {
                semver::Version::parse(version).map_err(|e| {
                    invalid(
                        format!("capabilities.{name}.versions[{i}]"),
                        format!("{version:?} is not a semver version ({e}); write e.g. \"1.2.0\""),
                    )
                })?;
            }
            for (field, message_type) in
                [("input", &capability.input), ("output", &capability.output)]
            {
                if let Some(message_type) = message_type
                    && !file.message_types.contains_key(message_type)
                {
                    return Err(invalid(
                        format!("capabilities.{name}.{field}"),
                        format!(
                            "message type {message_type:?} is not declared; add it under message_types"
                        ),
                    ));
                }
            }
        }
        let mut validators = BTreeMap::new();
        for (name, message_type) in &file.message_types {
            if let Some(schema) = &message_type.schema {
                let validator = compile_schema(schema).map_err(|e| {
                    invalid(
                        format!("message_types.{name}.schema{}", e.instance_path()),
                        format!("not a valid JSON Schema: {e}"),
                    )
                })?;
                validators.insert(name.clone(), validator);
            }
        }
        let mut adapters = Vec::new();
        for (i, spec) in file.adapters.iter().enumerate() {
            if !file.capabilities.contains_key(&spec.capability) {
                return Err(invalid(
                    format!("adapters[{i}].capability"),
                    format!(
                        "capability {:?} is not declared; add it under capabilities",
                        spec.capability
                    ),
                ));
            }
            let version = |field: &str, text: &str| {
                semver::Version::parse(text).map_err(|e| {
                    invalid(
                        format!("adapters[{i}].{field}"),
                        format!("{text:?} is not a semver version ({e}); write e.g. \"1.0.0\""),
                    )
                })
            };
            let transform = |field: &str, code: &Option<String>| {
                code.as_deref()
                    .map(Transform::new)
                    .transpose()
                    .map_err(|e| invalid(format!("adapters[{i}].{field}"), e))
            };
            adapters.push(Adapter {
                capability: spec.capability.clone(),
                from: version("from", &spec.from)?,
                to: version("to", &spec.to)?,
                request: transform("request", &spec.request)?,
                response: transform("response", &spec.response)?,
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            capabilities: file.capabilities,
            message_types: file.message_types,
            validators,
            adapters,
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The declared capability `name`.
    pub fn capability(&self, name: &str) -> Option<&CapabilitySpec> {
        self.capabilities.get(name)
    }

    /// Every declared capability name, sorted.
    pub fn capability_names(&self) -> impl Iterator<Item = &str> {
        self.capabilities.keys().map(String::as_str)
    }

    /// The declared message type `name`.
    pub fn message_type(&self, name: &str) -> Option<&MessageTypeSpec> {
        self.message_types.get(name)
    }

    /// Whether capability `name` is declared idempotent.
    pub fn is_idempotent(&self, name: &str) -> bool {
        self.capabilities.get(name).is_some_and(|c| c.idempotent)
    }

    /// Checks a registration's capability against the file: declared, and (when the file
    /// lists versions) at a declared version.
    ///
    /// # Errors
    /// A message saying what to declare.
    pub fn check_declared(&self, name: &str, version: &str) -> Result<(), String> {
        let Some(capability) = self.capabilities.get(name) else {
            return Err(format!(
                "capability {name:?} is not declared in the protocol registry {}; declare it under capabilities (declared: {})",
                self.path.display(),
                self.capabilities
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        };
        if !capability.versions.is_empty()
            && !version.is_empty()
            && !capability.versions.iter().any(|v| v == version)
        {
            return Err(format!(
                "capability {name:?} version {version:?} is not declared in the protocol registry {}; declared versions: {}",
                self.path.display(),
                capability.versions.join(", ")
            ));
        }
        Ok(())
    }

    /// Validates `value` against the input schema of capability `name` (no schema: valid).
    ///
    /// # Errors
    /// [`ProtocolError::SchemaViolation`] with the pointer of the first bad value.
    pub fn validate_input(
        &self,
        name: &str,
        value: &serde_json::Value,
    ) -> Result<(), ProtocolError> {
        let Some(validator) = self
            .capabilities
            .get(name)
            .and_then(|c| c.input.as_ref())
            .and_then(|t| self.validators.get(t))
        else {
            return Ok(());
        };
        match validator.iter_errors(value).next() {
            None => Ok(()),
            Some(error) => Err(ProtocolError::SchemaViolation {
                pointer: property_pointer(&error),
                keyword: error.kind().keyword().to_string(),
                schema_path: error.schema_path().to_string(),
                detail: error.to_string(),
            }),
        }
    }

    /// The JSON Schema of capability `name`'s requests: the schema of its `input` message
    /// type, when both are declared.
    pub fn input_schema(&self, name: &str) -> Option<&serde_json::Value> {
        let input = self.capabilities.get(name)?.input.as_ref()?;
        self.message_types.get(input)?.schema.as_ref()
    }

    /// The JSON Schema of capability `name`'s replies: the schema of its `output` message
    /// type, when both are declared.
    pub fn output_schema(&self, name: &str) -> Option<&serde_json::Value> {
        let output = self.capabilities.get(name)?.output.as_ref()?;
        self.message_types.get(output)?.schema.as_ref()
    }

    /// Whether capability `name` has an input schema.
    pub fn has_input_schema(&self, name: &str) -> bool {
        self.capabilities
            .get(name)
            .and_then(|c| c.input.as_ref())
            .is_some_and(|t| self.validators.contains_key(t))
    }

    /// The adapters of capability `name` whose caller version satisfies `requirement`, best
    /// (highest `to`) first.
    pub fn adapters_for(&self, name: &str, requirement: &semver::VersionReq) -> Vec<&Adapter> {
        let mut found: Vec<&Adapter> = self
            .adapters
            .iter()
            .filter(|a| a.capability == name && requirement.matches(&a.from))
            .collect();
        found.sort_by(|a, b| b.to.cmp(&a.to));
        found
    }
}

/// Compiles `schema` as a JSON Schema the way the protocol registry does (the draft its
/// `$schema` names, else the latest; `format` asserted, not only annotated). Used for the
/// file's message types and for the schemas agents declare when they register.
///
/// # Errors
/// The compiler's error: the offending keyword's location (`instance_path`) and what is wrong.
pub fn compile_schema(
    schema: &serde_json::Value,
) -> Result<jsonschema::Validator, jsonschema::ValidationError<'static>> {
    // `format` (date-time, email, uri, uuid, ...) is asserted, not only annotated.
    jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
}

/// A schema construct that is valid JSON Schema but refuses what its author meant to accept
/// (see [`schema_pitfall`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaPitfall {
    /// Where it is: the JSON pointer of the offending keyword within the schema.
    pub pointer: String,
    /// What is wrong and how to write it instead.
    pub fix: String,
}

impl std::fmt::Display for SchemaPitfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at {}: {}", self.pointer, self.fix)
    }
}

/// The first pitfall in `schema`, if any: `additionalProperties: false` inside a branch of
/// an `allOf` whose other branches declare properties. Each `allOf` branch is validated on
/// its own, so that branch refuses every property the others declare, and no object that
/// uses them can pass (a well-known JSON Schema trap; 2019-09 added `unevaluatedProperties`,
/// which sees through `allOf`, for exactly this).
pub fn schema_pitfall(schema: &serde_json::Value) -> Option<SchemaPitfall> {
    fn walk(value: &serde_json::Value, at: &mut String) -> Option<SchemaPitfall> {
        match value {
            serde_json::Value::Object(map) => {
                if let Some(serde_json::Value::Array(branches)) = map.get("allOf") {
                    let declares = |branch: &serde_json::Value| {
                        branch
                            .get("properties")
                            .and_then(serde_json::Value::as_object)
                            .is_some_and(|p| !p.is_empty())
                    };
                    for (i, branch) in branches.iter().enumerate() {
                        let closed = branch.get("additionalProperties")
                            == Some(&serde_json::Value::Bool(false));
                        let others_declare = branches
                            .iter()
                            .enumerate()
                            .any(|(j, other)| j != i && declares(other))
                            || declares(value);
                        if closed && others_declare {
                            return Some(SchemaPitfall {
                                pointer: format!("{at}/allOf/{i}/additionalProperties"),
                                fix: "`additionalProperties: false` inside an allOf branch refuses the properties the other branches (or the schema around it) declare, so no object using them passes; remove it and write `unevaluatedProperties: false` next to `allOf` instead".into(),
                            });
                        }
                    }
                }
                for (key, item) in map {
                    let len = at.len();
                    at.push('/');
                    at.push_str(&key.replace('~', "~0").replace('/', "~1"));
                    let found = walk(item, at);
                    at.truncate(len);
                    if found.is_some() {
                        return found;
                    }
                }
                None
            }
            serde_json::Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let len = at.len();
                    at.push_str(&format!("/{i}"));
                    let found = walk(item, at);
                    at.truncate(len);
                    if found.is_some() {
                        return found;
                    }
                }
                None
            }
            _ => None,
        }
    }
    walk(schema, &mut String::new())
}

/// The JSON pointer of the property a validation error is about: the error's instance path,
/// plus the property's name when the error is reported on its enclosing object (a missing
/// `required` property, an unexpected one).
fn property_pointer(error: &jsonschema::ValidationError<'_>) -> String {
    use jsonschema::error::ValidationErrorKind as Kind;
    let object = error.instance_path().to_string();
    let property = match error.kind() {
        Kind::Required { property } => property.as_str().map(str::to_string),
        Kind::AdditionalProperties { unexpected } | Kind::UnevaluatedProperties { unexpected } => {
            unexpected.first().cloned()
        }
        _ => None,
    };
    match property {
        // RFC 6901: `~` is written `~0` and `/` is written `~1` in a reference token.
        Some(name) => format!("{object}/{}", name.replace('~', "~0").replace('/', "~1")),
        None => object,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn additional_properties_false_inside_all_of_is_found_with_its_pointer() {
        let trap = serde_json::json!({
            "type": "object",
            "properties": {"inner": {"allOf": [
                {"properties": {"a": {"type": "string"}}, "additionalProperties": false},
                {"properties": {"b": {"type": "string"}}}
            ]}}
        });
        let found = schema_pitfall(&trap).expect("the trap is found");
        assert_eq!(
            found.pointer,
            "/properties/inner/allOf/0/additionalProperties"
        );
        assert!(found.fix.contains("unevaluatedProperties"), "{found}");
        // What the trap really does: an object using both branches' properties fails.
        let inner = &trap["properties"]["inner"];
        assert!(
            !compile_schema(inner)
                .unwrap()
                .is_valid(&serde_json::json!({"a": "x", "b": "y"}))
        );
        // The fix passes it, and is no pitfall.
        let fixed = serde_json::json!({"allOf": [
            {"properties": {"a": {"type": "string"}}},
            {"properties": {"b": {"type": "string"}}}
        ], "unevaluatedProperties": false});
        assert!(schema_pitfall(&fixed).is_none());
        assert!(
            compile_schema(&fixed)
                .unwrap()
                .is_valid(&serde_json::json!({"a": "x", "b": "y"}))
        );
        assert!(
            !compile_schema(&fixed)
                .unwrap()
                .is_valid(&serde_json::json!({"c": 1}))
        );
        // A closed branch beside branches that declare nothing is fine.
        let alone = serde_json::json!({"allOf": [
            {"properties": {"a": {}}, "additionalProperties": false},
            {"required": ["a"]}
        ]});
        assert!(schema_pitfall(&alone).is_none());
    }

    #[test]
    fn a_violation_names_the_failing_keyword_in_the_schema() {
        let file = r#"
capabilities:
  pick:
    versions: ["1.0.0"]
    input: pick.request
message_types:
  pick.request:
    schema:
      allOf:
        - {type: object, properties: {a: {type: string}}, additionalProperties: false}
"#;
        let registry = ProtocolRegistry::parse(std::path::Path::new("t.yaml"), file).unwrap();
        match registry
            .validate_input("pick", &serde_json::json!({"b": 1}))
            .unwrap_err()
        {
            ProtocolError::SchemaViolation {
                pointer,
                schema_path,
                ..
            } => {
                assert_eq!(pointer, "/b");
                assert_eq!(schema_path, "/allOf/0/additionalProperties");
            }
            other => panic!("{other:?}"),
        }
    }

    const FILE: &str = r#"
capabilities:
  demo.echo:
    versions: ["1.0.0", "2.0.0"]
    idempotent: true
    input: demo.request
message_types:
  demo.request:
    schema:
      type: object
      required: [text]
      properties:
        text: {type: string}
        n: {type: integer}
adapters:
  - capability: demo.echo
    from: "1.0.0"
    to: "2.0.0"
    request: '.body = .text | del(.text)'
    response: '.text = .body | del(.body)'
"#;

    #[test]
    fn a_transform_keeps_fields_it_does_not_name() {
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), FILE).unwrap();
        let adapter = registry.adapters_for("demo.echo", &"^1".parse().unwrap())[0];
        let out = adapter
            .request
            .as_ref()
            .unwrap()
            .apply(&serde_json::json!({"text": "hi", "extra": {"a": [1, 2]}}))
            .unwrap();
        assert_eq!(
            out,
            serde_json::json!({"body": "hi", "extra": {"a": [1, 2]}})
        );
    }

    #[test]
    fn a_schema_violation_names_its_pointer() {
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), FILE).unwrap();
        let err = registry
            .validate_input("demo.echo", &serde_json::json!({"text": "x", "n": "seven"}))
            .unwrap_err();
        match err {
            ProtocolError::SchemaViolation { pointer, .. } => assert_eq!(pointer, "/n"),
            other => panic!("{other:?}"),
        }
    }

    const NESTED: &str = r#"
capabilities:
  demo.contact:
    versions: ["1.0.0"]
    input: demo.contact
message_types:
  demo.contact:
    schema:
      type: object
      required: [customer]
      properties:
        customer:
          type: object
          required: [name, email]
          additionalProperties: false
          properties:
            name: {type: string}
            email: {type: string, format: email}
            since: {type: string, format: date-time}
            site: {type: string, format: uri}
            id: {type: string, format: uuid}
"#;

    /// The pointer and keyword of `value`'s violation of demo.contact's schema.
    fn violation(value: serde_json::Value) -> (String, String) {
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), NESTED).unwrap();
        match registry.validate_input("demo.contact", &value).unwrap_err() {
            ProtocolError::SchemaViolation {
                pointer, keyword, ..
            } => (pointer, keyword),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_violation_names_the_property_and_the_keyword() {
        let ok = serde_json::json!({"customer": {"name": "a", "email": "a@example.com"}});
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), NESTED).unwrap();
        registry.validate_input("demo.contact", &ok).unwrap();
        assert_eq!(
            violation(serde_json::json!({"customer": {"name": 7, "email": "a@example.com"}})),
            ("/customer/name".into(), "type".into())
        );
        assert_eq!(
            violation(serde_json::json!({"customer": {"name": "a"}})),
            ("/customer/email".into(), "required".into())
        );
        assert_eq!(
            violation(
                serde_json::json!({"customer": {"name": "a", "email": "a@example.com", "a/b": 1}})
            ),
            ("/customer/a~1b".into(), "additionalProperties".into())
        );
    }

    #[test]
    fn formats_are_asserted() {
        let with = |field: &str, value: &str| {
            let mut customer = serde_json::json!({"name": "a", "email": "a@example.com"});
            customer[field] = serde_json::json!(value);
            serde_json::json!({ "customer": customer })
        };
        for (field, bad) in [
            ("email", "not-an-email"),
            ("since", "yesterday"),
            ("site", "not a uri"),
            ("id", "1234"),
        ] {
            assert_eq!(
                violation(with(field, bad)),
                (format!("/customer/{field}"), "format".into()),
                "{field} = {bad:?}"
            );
        }
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), NESTED).unwrap();
        let good = [
            ("since", "2024-05-01T12:00:00Z"),
            ("site", "https://example.com/a"),
            ("id", "0190b3a0-7c1e-7d2a-9f3b-6a1c2e4d5f60"),
        ];
        for (field, value) in good {
            registry
                .validate_input("demo.contact", &with(field, value))
                .unwrap();
        }
    }

    #[test]
    fn errors_are_located() {
        let bad = FILE.replace("'.body = .text | del(.text)'", "'.body = ('");
        let err = ProtocolRegistry::parse(Path::new("t.yaml"), &bad).unwrap_err();
        assert!(err.to_string().contains("adapters[0].request"), "{err}");
        // jq's error in words, located in the program.
        assert!(
            err.to_string()
                .contains("expected closing parenthesis at byte 9 (the end)")
                && !err.to_string().contains("File {"),
            "{err}"
        );
        // A file that declares nothing is not taken for a registry.
        for empty in ["", "# nothing here\n", "{}"] {
            let err = ProtocolRegistry::parse(Path::new("t.yaml"), empty).unwrap_err();
            assert!(
                err.to_string().contains("declares no capabilities"),
                "{err}"
            );
        }
        let err =
            ProtocolRegistry::parse(Path::new("t.yaml"), "capabilities: {x: {idempotnt: true}}")
                .unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(registry_declares());
    }

    fn registry_declares() -> bool {
        let registry = ProtocolRegistry::parse(Path::new("t.yaml"), FILE).unwrap();
        registry.check_declared("demo.echo", "1.0.0").is_ok()
            && registry.check_declared("demo.other", "1.0.0").is_err()
    }
}
