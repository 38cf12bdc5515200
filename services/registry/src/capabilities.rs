//! Capability descriptors: checking the description and JSON Schemas an instance registers
//! with each capability, and merging them with the protocol registry's into the list
//! `ListCapabilities` serves.
//!
//! Merge rules, per capability name:
//! - the capability is listed when the protocol registry declares it or a live instance
//!   registered it;
//! - the protocol registry's description and schemas (its `input`/`output` message types'
//!   schemas) win when it declares any of them;
//! - otherwise the most recently registered live instance that declared a non-empty
//!   description or schema gives all three (so a description and a schema never come from
//!   two different agent builds);
//! - `versions` is the union of the declared and the served versions, in semver order.

use std::collections::{BTreeMap, BTreeSet};

use reach_proto::v1::{
    Capability, CapabilityDescriptor, DescriptorSource, Instance, InstanceState,
};

/// The most bytes a capability's description may hold.
pub const MAX_DESCRIPTION_BYTES: usize = 1024;
/// The most bytes a capability's input or output schema (JSON text) may hold.
pub const MAX_SCHEMA_BYTES: usize = 64 * 1024;
/// The deepest a schema may nest objects and arrays (the root object is depth 1).
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// What is wrong with one capability's descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorProblem {
    /// The field at fault: `description`, `input_schema` or `output_schema`.
    pub field: &'static str,
    /// What is wrong and how to fix it, lowercase.
    pub detail: String,
}

/// Checks the description and schemas `capability` declares: bounded sizes, schemas that
/// parse as JSON, nest at most [`MAX_SCHEMA_DEPTH`] deep and compile as JSON Schemas.
///
/// # Errors
/// The first [`DescriptorProblem`] found.
pub fn check_descriptor(capability: &Capability) -> Result<(), DescriptorProblem> {
    if capability.description.len() > MAX_DESCRIPTION_BYTES {
        return Err(DescriptorProblem {
            field: "description",
            detail: format!(
                "is {} bytes, over the limit of {MAX_DESCRIPTION_BYTES} bytes; say in a few sentences what it does and when to use it",
                capability.description.len()
            ),
        });
    }
    for (field, text) in [
        ("input_schema", &capability.input_schema),
        ("output_schema", &capability.output_schema),
    ] {
        check_schema(text).map_err(|detail| DescriptorProblem { field, detail })?;
    }
    Ok(())
}

/// Checks one schema's JSON text ("" declares none).
fn check_schema(text: &str) -> Result<(), String> {
    if text.is_empty() {
        return Ok(());
    }
    if text.len() > MAX_SCHEMA_BYTES {
        return Err(format!(
            "is {} bytes, over the limit of {MAX_SCHEMA_BYTES} bytes; move shared definitions out or simplify the schema",
            text.len()
        ));
    }
    // serde_json refuses nesting past 128 on its own, so parsing cannot exhaust the stack.
    let schema: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| format!("is not JSON ({e}); send a JSON Schema document as JSON text"))?;
    let depth = depth(&schema);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!(
            "nests {depth} levels deep, over the limit of {MAX_SCHEMA_DEPTH}; flatten it with $defs and $ref"
        ));
    }
    reach_protocol::compile_schema(&schema).map_err(|e| {
        let at = e.instance_path().to_string();
        format!(
            "is not a valid JSON Schema at {:?}: {e}",
            if at.is_empty() { "/" } else { at.as_str() }
        )
    })?;
    Ok(())
}

/// How deep `value` nests objects and arrays (a scalar is 0, `{}` is 1), found iteratively.
pub fn depth(value: &serde_json::Value) -> usize {
    let mut deepest = 0;
    let mut pending = vec![(value, 1usize)];
    while let Some((value, level)) = pending.pop() {
        let children: Box<dyn Iterator<Item = &serde_json::Value>> = match value {
            serde_json::Value::Object(map) => Box::new(map.values()),
            serde_json::Value::Array(items) => Box::new(items.iter()),
            _ => continue,
        };
        deepest = deepest.max(level);
        pending.extend(children.map(|child| (child, level + 1)));
    }
    deepest
}

/// One live instance's view of the capabilities, as [`merge`] reads it.
pub struct Registered<'a> {
    /// The instance.
    pub instance: &'a Instance,
    /// When it registered, as an increasing sequence (the registry revision of its
    /// registration): higher is more recent.
    pub registered: u64,
}

/// Merges the protocol registry's declarations with what live instances registered, into
/// descriptors sorted by name, keeping those whose name starts with `prefix`.
pub fn merge(
    protocols: Option<&reach_protocol::ProtocolRegistry>,
    instances: &[Registered<'_>],
    prefix: &str,
) -> Vec<CapabilityDescriptor> {
    #[derive(Default)]
    struct Merged {
        versions: BTreeSet<String>,
        instances: u32,
        routable: u32,
        /// The most recent registration with a description or schema: (sequence, capability).
        latest: Option<(u64, Capability)>,
    }
    let mut merged: BTreeMap<String, Merged> = BTreeMap::new();
    if let Some(protocols) = protocols {
        for name in protocols
            .capability_names()
            .filter(|n| n.starts_with(prefix))
        {
            let entry = merged.entry(name.to_string()).or_default();
            if let Some(spec) = protocols.capability(name) {
                entry.versions.extend(spec.versions.iter().cloned());
            }
        }
    }
    for registered in instances {
        let Some(spec) = registered.instance.spec.as_ref() else {
            continue;
        };
        let routable = matches!(
            registered.instance.state(),
            InstanceState::Ready | InstanceState::Busy
        );
        let mut seen = BTreeSet::new();
        for capability in spec
            .capabilities
            .iter()
            .filter(|c| c.name.starts_with(prefix))
        {
            let entry = merged.entry(capability.name.clone()).or_default();
            if seen.insert(capability.name.as_str()) {
                entry.instances += 1;
                entry.routable += u32::from(routable);
            }
            entry.versions.insert(if capability.version.is_empty() {
                "0.0.0".to_string()
            } else {
                capability.version.clone()
            });
            let declares = !capability.description.is_empty()
                || !capability.input_schema.is_empty()
                || !capability.output_schema.is_empty();
            if declares
                && entry
                    .latest
                    .as_ref()
                    .is_none_or(|(at, _)| registered.registered > *at)
            {
                entry.latest = Some((registered.registered, capability.clone()));
            }
        }
    }
    merged
        .into_iter()
        .map(|(name, merged)| {
            let declared = protocols.and_then(|p| p.capability(&name).map(|spec| (p, spec)));
            let schema_text = |schema: Option<&serde_json::Value>| {
                schema.map(ToString::to_string).unwrap_or_default()
            };
            let from_file = declared.map(|(p, spec)| {
                (
                    spec.description.clone(),
                    schema_text(p.input_schema(&name)),
                    schema_text(p.output_schema(&name)),
                )
            });
            let (description, input_schema, output_schema, source) =
                match (from_file, merged.latest) {
                    (Some((d, i, o)), _) if !(d.is_empty() && i.is_empty() && o.is_empty()) => {
                        (d, i, o, DescriptorSource::ProtocolRegistry)
                    }
                    (_, Some((_, c))) => (
                        c.description,
                        c.input_schema,
                        c.output_schema,
                        DescriptorSource::Registration,
                    ),
                    _ => (
                        String::new(),
                        String::new(),
                        String::new(),
                        DescriptorSource::None,
                    ),
                };
            let mut versions: Vec<String> = merged.versions.into_iter().collect();
            versions.sort_by(
                |a, b| match (semver::Version::parse(a), semver::Version::parse(b)) {
                    (Ok(a), Ok(b)) => a.cmp(&b),
                    _ => a.cmp(b),
                },
            );
            CapabilityDescriptor {
                idempotent: declared.is_some_and(|(_, spec)| spec.idempotent),
                name,
                description,
                versions,
                input_schema,
                output_schema,
                routable_instances: merged.routable,
                instances: merged.instances,
                source: source as i32,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use reach_proto::v1::InstanceSpec;

    use super::*;

    fn capability(name: &str, version: &str, description: &str, input: &str) -> Capability {
        Capability {
            name: name.into(),
            version: version.into(),
            description: description.into(),
            input_schema: input.into(),
            output_schema: String::new(),
        }
    }

    fn instance(id: &str, state: InstanceState, capabilities: Vec<Capability>) -> Instance {
        Instance {
            spec: Some(InstanceSpec {
                service: "svc".into(),
                instance_id: id.into(),
                capabilities,
                ..Default::default()
            }),
            state: state as i32,
            ..Default::default()
        }
    }

    fn protocols() -> reach_protocol::ProtocolRegistry {
        reach_protocol::ProtocolRegistry::parse(
            Path::new("protocol-registry.yaml"),
            r"
capabilities:
  doc.classify:
    description: classify a document; not for summaries
    versions: ['1.0.0', '2.0.0']
    idempotent: true
    input: doc.request
  doc.bare:
    versions: ['1.0.0']
message_types:
  doc.request:
    schema: {type: object, required: [text]}
",
        )
        .unwrap()
    }

    #[test]
    fn the_protocol_registry_wins_and_versions_are_the_union_in_semver_order() {
        let protocols = protocols();
        let a = instance(
            "a",
            InstanceState::Ready,
            vec![capability(
                "doc.classify",
                "10.0.0",
                "mine",
                r#"{"type":"string"}"#,
            )],
        );
        let b = instance(
            "b",
            InstanceState::Registered,
            vec![capability("doc.classify", "2.0.0", "", "")],
        );
        let list = merge(
            Some(&protocols),
            &[
                Registered {
                    instance: &a,
                    registered: 5,
                },
                Registered {
                    instance: &b,
                    registered: 6,
                },
            ],
            "",
        );
        let names: Vec<&str> = list.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["doc.bare", "doc.classify"]);
        let classify = &list[1];
        assert_eq!(
            classify.description,
            "classify a document; not for summaries"
        );
        let schema: serde_json::Value = serde_json::from_str(&classify.input_schema).unwrap();
        assert_eq!(
            schema,
            serde_json::json!({"type": "object", "required": ["text"]})
        );
        assert_eq!(classify.output_schema, "");
        assert_eq!(classify.versions, ["1.0.0", "2.0.0", "10.0.0"]);
        assert!(classify.idempotent);
        assert_eq!((classify.routable_instances, classify.instances), (1, 2));
        assert_eq!(classify.source(), DescriptorSource::ProtocolRegistry);
        // Declared but unserved, with nothing described: listed by name only.
        let bare = &list[0];
        assert_eq!(bare.source(), DescriptorSource::None);
        assert_eq!((bare.routable_instances, bare.instances), (0, 0));
    }

    #[test]
    fn otherwise_the_latest_registration_that_describes_it_wins_whole() {
        let older = instance(
            "older",
            InstanceState::Ready,
            vec![capability(
                "x.tool",
                "1.0.0",
                "old words",
                r#"{"type":"object"}"#,
            )],
        );
        let newer = instance(
            "newer",
            InstanceState::Busy,
            vec![capability("x.tool", "1.1.0", "new words", "")],
        );
        // The most recent registration declares nothing: it does not erase the description.
        let newest = instance(
            "newest",
            InstanceState::Draining,
            vec![capability("x.tool", "", "", "")],
        );
        let registered = [
            Registered {
                instance: &newer,
                registered: 7,
            },
            Registered {
                instance: &newest,
                registered: 9,
            },
            Registered {
                instance: &older,
                registered: 3,
            },
        ];
        let list = merge(None, &registered, "x.");
        assert_eq!(list.len(), 1);
        let tool = &list[0];
        assert_eq!(tool.source(), DescriptorSource::Registration);
        assert_eq!(tool.description, "new words");
        assert_eq!(
            tool.input_schema, "",
            "the newer registration's schemas come with its description"
        );
        assert_eq!(tool.versions, ["0.0.0", "1.0.0", "1.1.0"]);
        assert_eq!((tool.routable_instances, tool.instances), (2, 3));
        assert!(!tool.idempotent);
        assert!(merge(None, &registered, "y.").is_empty());
    }

    #[test]
    fn a_declared_capability_without_words_takes_the_registration_s() {
        let protocols = protocols();
        let a = instance(
            "a",
            InstanceState::Ready,
            vec![capability(
                "doc.bare",
                "1.0.0",
                "bare, described by its agent",
                "",
            )],
        );
        let list = merge(
            Some(&protocols),
            &[Registered {
                instance: &a,
                registered: 1,
            }],
            "doc.b",
        );
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].description, "bare, described by its agent");
        assert_eq!(list[0].source(), DescriptorSource::Registration);
    }

    #[test]
    fn descriptors_are_bounded_and_schemas_must_compile() {
        let check = |description: &str, input: &str| {
            check_descriptor(&capability("x", "", description, input)).map_err(|p| {
                assert!(!p.detail.ends_with('.'), "{}", p.detail);
                (p.field, p.detail)
            })
        };
        assert_eq!(check("fine", r#"{"type":"object"}"#), Ok(()));
        assert_eq!(check("", ""), Ok(()));
        let (field, detail) = check(&"x".repeat(1025), "").unwrap_err();
        assert_eq!(field, "description");
        assert!(detail.contains("1025 bytes"), "{detail}");
        let (field, detail) = check("", "{not json").unwrap_err();
        assert_eq!(field, "input_schema");
        assert!(detail.contains("is not JSON"), "{detail}");
        let (_, detail) = check("", r#"{"type": 12}"#).unwrap_err();
        assert!(detail.contains("not a valid JSON Schema"), "{detail}");
        let deep = format!("{}{}", "[".repeat(33), "]".repeat(33));
        let (_, detail) = check("", &deep).unwrap_err();
        assert!(detail.contains("33 levels"), "{detail}");
        let fine = format!("{}{}", "[".repeat(32), "]".repeat(32));
        assert!(
            check("", &fine)
                .unwrap_err()
                .1
                .contains("not a valid JSON Schema")
        );
        let big = format!(r#"{{"description": "{}"}}"#, "x".repeat(MAX_SCHEMA_BYTES));
        let (_, detail) = check("", &big).unwrap_err();
        assert!(detail.contains("over the limit of 65536 bytes"), "{detail}");
        let output = Capability {
            output_schema: "[]".into(),
            ..capability("x", "", "", "")
        };
        assert_eq!(
            check_descriptor(&output).unwrap_err().field,
            "output_schema"
        );
    }

    #[test]
    fn depth_counts_containers_without_recursion() {
        assert_eq!(depth(&serde_json::json!(1)), 0);
        assert_eq!(depth(&serde_json::json!({})), 1);
        assert_eq!(depth(&serde_json::json!({"a": [1, {"b": []}]})), 4);
    }
}
