//! [`DescribedCapability`]: a capability with the description and JSON Schemas an agent
//! registers for it, so the registry's `ListCapabilities` (and a model choosing tools) can
//! say what it does and what it takes.
//!
//! ```no_run
//! # fn declare() {
//! use reach_sdk::DescribedCapability;
//!
//! let classify = DescribedCapability::new("complaint.classify", "1.0.0")
//!     .description("classify a complaint narrative into a servicing category; not for summaries")
//!     .input_schema(serde_json::json!({
//!         "type": "object",
//!         "required": ["narrative"],
//!         "properties": {"narrative": {"type": "string"}}
//!     }));
//! # let _ = classify;
//! # }
//! ```
//!
//! The registry checks what is declared at registration (description at most 1024 bytes,
//! each schema at most 64 KiB of JSON nesting at most 32 deep that compiles as a JSON
//! Schema) and refuses the registration with INVALID_ARGUMENT otherwise.
//! [`AgentRuntime::start`](crate::AgentRuntime::start) checks the bounds itself
//! ([`DescribedCapability::check`]) and fails at once; that a schema compiles only the
//! registry checks (a refused registration is logged and retried), so check schemas in the
//! agent's own tests.

use reach_proto::v1::Capability;

/// The most bytes a description may hold (the registry's bound).
pub const MAX_DESCRIPTION_BYTES: usize = 1024;
/// The most bytes of JSON text a schema may hold (the registry's bound).
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The deepest a schema may nest objects and arrays (the registry's bound).
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// A capability an agent serves, with what it declares about it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DescribedCapability {
    /// The capability name, dotted (`complaint.classify`).
    pub name: String,
    /// The semver version served (`1.2.0`); empty means `0.0.0`.
    pub version: String,
    /// What it does, when to use it and when not to (at most 1024 bytes); empty: none.
    pub description: String,
    /// The JSON Schema of a request's first `data` part; `None`: none declared.
    pub input_schema: Option<serde_json::Value>,
    /// The JSON Schema of a reply's first `data` part; `None`: none declared.
    pub output_schema: Option<serde_json::Value>,
}

impl DescribedCapability {
    /// `name` at `version`, with nothing declared yet.
    pub fn new(name: impl Into<String>, version: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            version: version.into(),
            ..Self::default()
        }
    }

    /// Sets the description.
    #[must_use]
    pub fn description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }

    /// Sets the input JSON Schema.
    #[must_use]
    pub fn input_schema(mut self, schema: serde_json::Value) -> Self {
        self.input_schema = Some(schema);
        self
    }

    /// Sets the output JSON Schema.
    #[must_use]
    pub fn output_schema(mut self, schema: serde_json::Value) -> Self {
        self.output_schema = Some(schema);
        self
    }

    /// Checks the registry's bounds: description at most [`MAX_DESCRIPTION_BYTES`], each
    /// schema at most [`MAX_SCHEMA_BYTES`] of JSON text nesting at most
    /// [`MAX_SCHEMA_DEPTH`] deep and an object or a boolean (what a JSON Schema is).
    ///
    /// # Errors
    /// What is wrong, naming the capability and the field.
    pub fn check(&self) -> Result<(), String> {
        if self.description.len() > MAX_DESCRIPTION_BYTES {
            return Err(format!(
                "capability {:?}: the description is {} bytes, over the limit of {MAX_DESCRIPTION_BYTES}",
                self.name,
                self.description.len()
            ));
        }
        for (field, schema) in [
            ("input_schema", &self.input_schema),
            ("output_schema", &self.output_schema),
        ] {
            let Some(schema) = schema else { continue };
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(format!(
                    "capability {:?}: the {field} must be a JSON object or a boolean (a JSON Schema)",
                    self.name
                ));
            }
            let size = schema.to_string().len();
            if size > MAX_SCHEMA_BYTES {
                return Err(format!(
                    "capability {:?}: the {field} is {size} bytes of JSON, over the limit of {MAX_SCHEMA_BYTES}",
                    self.name
                ));
            }
            let depth = depth(schema);
            if depth > MAX_SCHEMA_DEPTH {
                return Err(format!(
                    "capability {:?}: the {field} nests {depth} levels deep, over the limit of {MAX_SCHEMA_DEPTH}; flatten it with $defs and $ref",
                    self.name
                ));
            }
        }
        Ok(())
    }

    /// The registration's `Capability` (schemas as compact JSON text).
    pub fn to_proto(&self) -> Capability {
        let text = |schema: &Option<serde_json::Value>| {
            schema.as_ref().map(ToString::to_string).unwrap_or_default()
        };
        Capability {
            name: self.name.clone(),
            version: self.version.clone(),
            description: self.description.clone(),
            input_schema: text(&self.input_schema),
            output_schema: text(&self.output_schema),
        }
    }
}

/// How deep `value` nests objects and arrays (a scalar is 0), found iteratively.
fn depth(value: &serde_json::Value) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(value, 1usize)];
    while let Some((value, level)) = pending.pop() {
        match value {
            serde_json::Value::Object(map) => {
                deepest = deepest.max(level);
                pending.extend(map.values().map(|child| (child, level + 1)));
            }
            serde_json::Value::Array(items) => {
                deepest = deepest.max(level);
                pending.extend(items.iter().map(|child| (child, level + 1)));
            }
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_s_bounds_are_checked_before_registering() {
        let fine = DescribedCapability::new("x", "1.0.0").input_schema(serde_json::json!({}));
        assert_eq!(fine.check(), Ok(()));
        let long = DescribedCapability::new("x", "").description("d".repeat(1025));
        assert!(long.check().unwrap_err().contains("1025 bytes"));
        let list = DescribedCapability::new("x", "").output_schema(serde_json::json!([]));
        assert!(list.check().unwrap_err().contains("output_schema must be"));
        let mut deep = serde_json::json!({});
        for _ in 0..32 {
            deep = serde_json::json!({ "not": deep });
        }
        let error = DescribedCapability::new("x", "").input_schema(deep).check();
        assert!(error.unwrap_err().contains("33 levels"));
    }

    #[test]
    fn schemas_go_as_json_text_and_absent_ones_as_empty() {
        let capability = DescribedCapability::new("x.tool", "1.0.0")
            .description("does x")
            .input_schema(serde_json::json!({"type": "object"}))
            .to_proto();
        assert_eq!(capability.input_schema, r#"{"type":"object"}"#);
        assert_eq!(capability.output_schema, "");
        assert_eq!(capability.description, "does x");
    }
}
