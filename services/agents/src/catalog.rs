//! What the example fleet declares about its capabilities when it registers: each one's
//! description and JSON Schemas, from `examples/protocol-registry.yaml` compiled into the
//! binary. The fleet describes itself wherever it runs, so the MCP edge's tools, the A2A
//! edge's skills, the console and `reach capabilities` need no file beside the binary (a
//! registry that loads a protocol registry still has the last word: its declarations win).

use std::path::Path;
use std::sync::LazyLock;

use reach_protocol::ProtocolRegistry;
use reach_sdk::DescribedCapability;

/// The protocol registry the fleet was built with (`examples/protocol-registry.yaml`).
pub const PROTOCOL_REGISTRY_YAML: &str = include_str!("../../../examples/protocol-registry.yaml");

static PROTOCOLS: LazyLock<ProtocolRegistry> = LazyLock::new(|| {
    ProtocolRegistry::parse(
        Path::new("examples/protocol-registry.yaml"),
        PROTOCOL_REGISTRY_YAML,
    )
    .expect("the example protocol registry compiled into the fleet is valid (a test checks it)")
});

/// `capability` at `version` with what the example protocol registry says of it; nothing
/// declared for a capability it does not name.
pub fn described(capability: &str, version: &str) -> DescribedCapability {
    let mut described = DescribedCapability::new(capability, version);
    if let Some(spec) = PROTOCOLS.capability(capability) {
        described = described.description(spec.description.clone());
    }
    if let Some(schema) = PROTOCOLS.input_schema(capability) {
        described = described.input_schema(schema.clone());
    }
    if let Some(schema) = PROTOCOLS.output_schema(capability) {
        described = described.output_schema(schema.clone());
    }
    described
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_capability_of_the_fleet_is_described_within_the_registrys_bounds() {
        for name in PROTOCOLS.capability_names() {
            let capability = described(name, "1.0.0");
            assert_eq!(capability.check(), Ok(()), "{name}");
            assert!(!capability.description.is_empty(), "{name}");
            assert!(
                capability.input_schema.is_some(),
                "{name} has no input schema"
            );
        }
        let classify = described("complaint.classify", "1.0.0");
        assert_eq!(
            classify.input_schema.as_ref().unwrap()["required"],
            serde_json::json!(["complaint_id"])
        );
        assert_eq!(
            described("nope", "1.0.0"),
            DescribedCapability::new("nope", "1.0.0")
        );
    }
}
