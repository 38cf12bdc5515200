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
//! Schema) and refuses the registration with INVALID_ARGUMENT otherwise; the runtime then
//! logs the refusal and retries, so check schemas in the agent's own tests.

use reach_proto::v1::Capability;

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

#[cfg(test)]
mod tests {
    use super::*;

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
