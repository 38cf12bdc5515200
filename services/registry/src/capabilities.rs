//! Capability descriptors: checking the description and JSON Schemas an instance registers
//! with each capability, and merging them with the protocol registry's into the list
//! `ListCapabilities` serves.
//!
//! Merge rules, per capability name:
//! - the capability is listed when the protocol registry declares it or a live instance
//!   registered it;
//! - the protocol registry's description and schemas (its `input`/`output` message types'
//!   schemas) win when it declares any of them;
//! - otherwise the most recently registered live *routable* (READY or BUSY) instance that
//!   declared a non-empty description or schema gives all three (so a description and a
//!   schema never come from two different agent builds, and a never-probed instance cannot
//!   replace a working one's descriptor); only when no routable instance declares one does
//!   the most recently registered non-routable one's count;
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
/// The most bytes a `pattern` string or a `patternProperties` key in a schema may hold
/// (regular expressions are compiled at registration; long alternations are slow to).
pub const MAX_PATTERN_BYTES: usize = 1024;
/// The most bytes of descriptions and schemas all of one instance's capabilities may hold
/// together.
pub const MAX_DESCRIPTOR_BYTES_PER_INSTANCE: usize = 256 * 1024;
/// The most bytes of descriptions and schemas a ListCapabilities page holds before it ends
/// early (a page always holds at least one descriptor, itself at most 1 KiB + 2 × 64 KiB).
pub const MAX_PAGE_BYTES: usize = 2 * 1024 * 1024;
/// The most bytes of a value (a pattern, a schema excerpt) an error message echoes.
pub const MAX_ECHO_BYTES: usize = 200;

/// `text` cut to at most [`MAX_ECHO_BYTES`] bytes (on a character boundary), with `…` when
/// it was cut: what error messages echo of a caller's value.
pub fn clip(text: &str) -> String {
    clip_to(text, MAX_ECHO_BYTES)
}

/// `text` cut to at most `max` bytes (on a character boundary), with `…` when cut.
fn clip_to(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Whether `c` is a bidirectional override or isolate character (U+202A to U+202E, U+2066
/// to U+2069), which reorders the text a terminal shows.
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// The bytes of descriptions and schemas `capabilities` declare together.
pub fn descriptor_bytes(capabilities: &[Capability]) -> usize {
    capabilities
        .iter()
        .map(|c| c.description.len() + c.input_schema.len() + c.output_schema.len())
        .sum()
}

/// `capability` without its descriptor (description and schemas): what Watch and
/// ListInstances carry.
pub fn without_descriptor(capability: &Capability) -> Capability {
    Capability {
        name: capability.name.clone(),
        version: capability.version.clone(),
        ..Capability::default()
    }
}

/// What is wrong with one capability's descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DescriptorProblem {
    /// The field at fault: `description`, `input_schema` or `output_schema`.
    pub field: &'static str,
    /// What is wrong and how to fix it, lowercase.
    pub detail: String,
}

/// Checks the description and schemas `capability` declares: bounded sizes, a description
/// of plain text (no control characters but `\n` and `\t`, no bidirectional overrides),
/// schemas that parse as JSON, nest at most [`MAX_SCHEMA_DEPTH`] deep, hold no `pattern`
/// longer than [`MAX_PATTERN_BYTES`] and compile as JSON Schemas.
///
/// CPU-bound (schemas are compiled): the gRPC service runs it off the async workers.
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
    if let Some(c) = capability
        .description
        .chars()
        .find(|&c| (c.is_control() && c != '\n' && c != '\t') || is_bidi_control(c))
    {
        let kind = if c.is_control() {
            "a control character"
        } else {
            "a bidirectional override or isolate character"
        };
        return Err(DescriptorProblem {
            field: "description",
            detail: format!(
                "contains U+{:04X} ({kind}); send plain text: only \\n and \\t are allowed besides printable characters",
                u32::from(c)
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
    let schema: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        format!(
            "is not JSON ({}); send a JSON Schema document as JSON text",
            clip(&e.to_string())
        )
    })?;
    let shape = walk(&schema);
    if shape.depth > MAX_SCHEMA_DEPTH {
        return Err(format!(
            "nests {} levels deep, over the limit of {MAX_SCHEMA_DEPTH}; flatten it with $defs and $ref",
            shape.depth
        ));
    }
    if let Some((pointer, bytes)) = shape.long_pattern {
        return Err(format!(
            "has a pattern of {bytes} bytes at {:?}, over the limit of {MAX_PATTERN_BYTES} bytes; use a shorter regular expression or an enum",
            clip(&pointer)
        ));
    }
    reach_protocol::compile_schema(&schema).map_err(|e| {
        let at = e.instance_path().to_string();
        format!(
            "is not a valid JSON Schema at {:?}: {}",
            clip(if at.is_empty() { "/" } else { at.as_str() }),
            clip(&e.to_string())
        )
    })?;
    // After the depth check: the search recurses.
    if let Some(pitfall) = reach_protocol::schema_pitfall(&schema) {
        return Err(format!("refuses what it declares, {pitfall}"));
    }
    Ok(())
}

/// What [`walk`] finds in a schema.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Shape {
    /// How deep it nests objects and arrays (a scalar is 0, `{}` is 1).
    pub depth: usize,
    /// The first `pattern` string or `patternProperties` key over [`MAX_PATTERN_BYTES`]:
    /// its JSON pointer (for a key, the pointer of the key's entry) and its length.
    pub long_pattern: Option<(String, usize)>,
}

/// Walks `value` iteratively (no recursion, so no stack to exhaust): how deep it nests and
/// the first over-long `pattern` string or `patternProperties` key. Pointers are built only
/// for what is reported (from parent links), so a deep schema with many leaves costs no
/// more than its size.
pub fn walk(value: &serde_json::Value) -> Shape {
    enum Token<'a> {
        Key(&'a str),
        Index(usize),
    }
    // Each visited value: its parent's index and its token under the parent.
    let mut nodes: Vec<(usize, Token<'_>)> = vec![(0, Token::Index(0))];
    let pointer = |nodes: &[(usize, Token<'_>)], mut at: usize, last: &[&str]| {
        let mut tokens: Vec<String> = last.iter().rev().map(|t| escape_pointer(t)).collect();
        while at != 0 {
            let (parent, token) = &nodes[at];
            tokens.push(match token {
                Token::Key(key) => escape_pointer(key),
                Token::Index(i) => i.to_string(),
            });
            at = *parent;
        }
        tokens.iter().rev().fold(String::new(), |mut out, t| {
            out.push('/');
            out.push_str(t);
            out
        })
    };
    let mut shape = Shape::default();
    let mut pending = vec![(value, 1usize, 0usize)];
    while let Some((value, level, node)) = pending.pop() {
        match value {
            serde_json::Value::Object(map) => {
                shape.depth = shape.depth.max(level);
                if shape.long_pattern.is_none() {
                    if let Some(serde_json::Value::String(pattern)) = map.get("pattern")
                        && pattern.len() > MAX_PATTERN_BYTES
                    {
                        shape.long_pattern =
                            Some((pointer(&nodes, node, &["pattern"]), pattern.len()));
                    } else if let Some(serde_json::Value::Object(properties)) =
                        map.get("patternProperties")
                        && let Some(key) = properties.keys().find(|k| k.len() > MAX_PATTERN_BYTES)
                    {
                        shape.long_pattern = Some((
                            pointer(&nodes, node, &["patternProperties", key]),
                            key.len(),
                        ));
                    }
                }
                for (key, child) in map {
                    nodes.push((node, Token::Key(key)));
                    pending.push((child, level + 1, nodes.len() - 1));
                }
            }
            serde_json::Value::Array(items) => {
                shape.depth = shape.depth.max(level);
                for (i, child) in items.iter().enumerate() {
                    nodes.push((node, Token::Index(i)));
                    pending.push((child, level + 1, nodes.len() - 1));
                }
            }
            _ => {}
        }
    }
    shape
}

/// One JSON pointer reference token (RFC 6901: `~` is `~0`, `/` is `~1`).
fn escape_pointer(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// How deep `value` nests objects and arrays (a scalar is 0, `{}` is 1), found iteratively.
pub fn depth(value: &serde_json::Value) -> usize {
    walk(value).depth
}

/// One live instance's view of the capabilities, as [`merge`] reads it.
pub struct Registered<'a> {
    /// The instance (its state is read; its capabilities may have been stripped of their
    /// descriptors).
    pub instance: &'a Instance,
    /// The capabilities it registered, descriptors included.
    pub capabilities: &'a [Capability],
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
    merge_page(protocols, instances, prefix, "", usize::MAX).0
}

/// One page of [`merge`]: at most `limit` descriptors whose names sort after `after` ("" for
/// the first page) and about [`MAX_PAGE_BYTES`] of descriptors, and whether more follow.
/// Only the page's descriptors (and at most one past it) are copied.
pub fn merge_page(
    protocols: Option<&reach_protocol::ProtocolRegistry>,
    instances: &[Registered<'_>],
    prefix: &str,
    after: &str,
    limit: usize,
) -> (Vec<CapabilityDescriptor>, bool) {
    #[derive(Default)]
    struct Merged<'a> {
        versions: BTreeSet<&'a str>,
        instances: u32,
        routable: u32,
        /// The most recent routable registration with a description or schema:
        /// (sequence, capability).
        latest_routable: Option<(u64, &'a Capability)>,
        /// The most recent registration in any state with a description or schema.
        latest_any: Option<(u64, &'a Capability)>,
    }
    let wanted = |name: &str| name.starts_with(prefix) && name > after;
    let mut merged: BTreeMap<&str, Merged<'_>> = BTreeMap::new();
    if let Some(protocols) = protocols {
        for name in protocols.capability_names().filter(|n| wanted(n)) {
            let entry = merged.entry(name).or_default();
            if let Some(spec) = protocols.capability(name) {
                entry
                    .versions
                    .extend(spec.versions.iter().map(String::as_str));
            }
        }
    }
    for registered in instances {
        let routable = matches!(
            registered.instance.state(),
            InstanceState::Ready | InstanceState::Busy
        );
        let mut seen = BTreeSet::new();
        for capability in registered.capabilities.iter().filter(|c| wanted(&c.name)) {
            let entry = merged.entry(capability.name.as_str()).or_default();
            if seen.insert(capability.name.as_str()) {
                entry.instances += 1;
                entry.routable += u32::from(routable);
            }
            entry.versions.insert(if capability.version.is_empty() {
                "0.0.0"
            } else {
                capability.version.as_str()
            });
            let declares = !capability.description.is_empty()
                || !capability.input_schema.is_empty()
                || !capability.output_schema.is_empty();
            if !declares {
                continue;
            }
            let newer = |latest: &Option<(u64, &Capability)>| {
                latest
                    .as_ref()
                    .is_none_or(|(at, _)| registered.registered > *at)
            };
            if newer(&entry.latest_any) {
                entry.latest_any = Some((registered.registered, capability));
            }
            if routable && newer(&entry.latest_routable) {
                entry.latest_routable = Some((registered.registered, capability));
            }
        }
    }
    let total = merged.len();
    let mut bytes = 0usize;
    let page: Vec<CapabilityDescriptor> = merged
        .into_iter()
        .take(limit)
        .map(|(name, merged)| {
            let declared = protocols.and_then(|p| p.capability(name).map(|spec| (p, spec)));
            let schema_text = |schema: Option<&serde_json::Value>| {
                schema.map(ToString::to_string).unwrap_or_default()
            };
            let from_file = declared.map(|(p, spec)| {
                (
                    spec.description.clone(),
                    schema_text(p.input_schema(name)),
                    schema_text(p.output_schema(name)),
                )
            });
            let latest = merged.latest_routable.or(merged.latest_any);
            let (description, input_schema, output_schema, source) = match (from_file, latest) {
                (Some((d, i, o)), _) if !(d.is_empty() && i.is_empty() && o.is_empty()) => {
                    (d, i, o, DescriptorSource::ProtocolRegistry)
                }
                (_, Some((_, c))) => (
                    c.description.clone(),
                    c.input_schema.clone(),
                    c.output_schema.clone(),
                    DescriptorSource::Registration,
                ),
                _ => (
                    String::new(),
                    String::new(),
                    String::new(),
                    DescriptorSource::None,
                ),
            };
            let mut versions: Vec<String> =
                merged.versions.into_iter().map(str::to_string).collect();
            versions.sort_by(
                |a, b| match (semver::Version::parse(a), semver::Version::parse(b)) {
                    (Ok(a), Ok(b)) => a.cmp(&b),
                    _ => a.cmp(b),
                },
            );
            CapabilityDescriptor {
                idempotent: declared.is_some_and(|(_, spec)| spec.idempotent),
                name: name.to_string(),
                description,
                versions,
                input_schema,
                output_schema,
                routable_instances: merged.routable,
                instances: merged.instances,
                source: source as i32,
            }
        })
        // A page also ends once it holds MAX_PAGE_BYTES of descriptors (at least one
        // descriptor, however large), so a page always fits a client's 4 MiB decode limit.
        .take_while(|d: &CapabilityDescriptor| {
            let fits = bytes < MAX_PAGE_BYTES;
            bytes += d.description.len() + d.input_schema.len() + d.output_schema.len();
            fits
        })
        .collect();
    let more = total > page.len();
    (page, more)
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

    fn registered(instance: &Instance, at: u64) -> Registered<'_> {
        Registered {
            instance,
            capabilities: &instance.spec.as_ref().unwrap().capabilities,
            registered: at,
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
            &[registered(&a, 5), registered(&b, 6)],
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
            registered(&newer, 7),
            registered(&newest, 9),
            registered(&older, 3),
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
        let list = merge(Some(&protocols), &[registered(&a, 1)], "doc.b");
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
        // A schema that refuses what it declares is refused with its pointer and the fix.
        let trap = r#"{"allOf": [{"properties": {"a": {}}, "additionalProperties": false}, {"properties": {"b": {}}}]}"#;
        let (_, detail) = check("", trap).unwrap_err();
        assert!(
            detail.contains("/allOf/0/additionalProperties")
                && detail.contains("unevaluatedProperties"),
            "{detail}"
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
    fn a_never_probed_instance_does_not_replace_a_routable_one_s_descriptor() {
        let good = instance(
            "good",
            InstanceState::Ready,
            vec![capability(
                "x.tool",
                "1.0.0",
                "good words",
                r#"{"type":"object"}"#,
            )],
        );
        let hijacker = instance(
            "hijacker",
            InstanceState::Registered,
            vec![capability(
                "x.tool",
                "1.0.0",
                "evil words",
                r#"{"type":"string"}"#,
            )],
        );
        let list = merge(None, &[registered(&good, 1), registered(&hijacker, 2)], "");
        assert_eq!(list[0].description, "good words");
        assert_eq!(list[0].input_schema, r#"{"type":"object"}"#);
        assert_eq!((list[0].routable_instances, list[0].instances), (1, 2));
        // With no routable instance describing it, the newest non-routable one counts.
        let draining = instance(
            "draining",
            InstanceState::Draining,
            vec![capability("x.tool", "1.0.0", "old words", "")],
        );
        let list = merge(
            None,
            &[registered(&draining, 1), registered(&hijacker, 2)],
            "",
        );
        assert_eq!(list[0].description, "evil words");
        assert_eq!(list[0].source(), DescriptorSource::Registration);
    }

    #[test]
    fn pages_continue_after_the_last_name_with_no_gap_or_overlap() {
        let caps = (0..7)
            .map(|i| capability(&format!("p.c{i}"), "", "", ""))
            .collect();
        let one = instance("a", InstanceState::Ready, caps);
        let all = [registered(&one, 1)];
        let (first, more) = merge_page(None, &all, "p.", "", 3);
        assert!(more);
        let names =
            |page: &[CapabilityDescriptor]| page.iter().map(|d| d.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&first), ["p.c0", "p.c1", "p.c2"]);
        let (second, more) = merge_page(None, &all, "p.", "p.c2", 3);
        assert!(more);
        assert_eq!(names(&second), ["p.c3", "p.c4", "p.c5"]);
        let (last, more) = merge_page(None, &all, "p.", "p.c5", 3);
        assert!(!more);
        assert_eq!(names(&last), ["p.c6"]);
        let (exact, more) = merge_page(None, &all, "p.", "p.c3", 3);
        assert!(!more, "exactly a page left: no further page");
        assert_eq!(exact.len(), 3);
    }

    #[test]
    fn a_page_ends_early_at_its_byte_bound() {
        let schema = serde_json::json!({"description": "d".repeat(60_000)}).to_string();
        let caps = (0..40)
            .map(|i| capability(&format!("b.c{i:02}"), "", "", &schema))
            .collect();
        let one = instance("a", InstanceState::Ready, caps);
        let all = [registered(&one, 1)];
        let (first, more) = merge_page(None, &all, "", "", 500);
        assert!(more);
        let bytes: usize = first.iter().map(|d| d.input_schema.len()).sum();
        assert!(
            first.len() < 40 && bytes < MAX_PAGE_BYTES + 70_000,
            "{}",
            first.len()
        );
        let (rest, more) = merge_page(None, &all, "", &first.last().unwrap().name, 500);
        assert!(!more);
        assert_eq!(first.len() + rest.len(), 40);
    }

    #[test]
    fn descriptions_are_plain_text() {
        let check = |description: &str| {
            check_descriptor(&capability("x", "", description, "")).map_err(|p| p.detail)
        };
        assert_eq!(check("two lines\n\tand a tab"), Ok(()));
        assert_eq!(check("naïve – ünïcode ✓"), Ok(()));
        for (text, point) in [
            ("red \u{1b}[31m", "U+001B"),
            ("over\rwrite", "U+000D"),
            ("nul\0", "U+0000"),
            ("del\u{7f}", "U+007F"),
            ("c1 \u{9b}", "U+009B"),
            ("abc\u{202e}fed", "U+202E"),
            ("\u{202a}x", "U+202A"),
            ("iso\u{2066}late", "U+2066"),
            ("iso\u{2069}late", "U+2069"),
        ] {
            let detail = check(text).unwrap_err();
            assert!(detail.contains(point), "{text:?}: {detail}");
        }
    }

    #[test]
    fn patterns_are_bounded_where_the_depth_is_checked() {
        let check = |schema: serde_json::Value| {
            check_descriptor(&capability("x", "", "", &schema.to_string())).map_err(|p| p.detail)
        };
        let fine = "a".repeat(MAX_PATTERN_BYTES);
        let long = "a".repeat(MAX_PATTERN_BYTES + 1);
        assert_eq!(
            check(serde_json::json!({"properties": {"a": {"pattern": fine}}})),
            Ok(())
        );
        let detail =
            check(serde_json::json!({"properties": {"a/b": {"pattern": long}}})).unwrap_err();
        assert!(
            detail.contains("pattern of 1025 bytes at \"/properties/a~1b/pattern\""),
            "{detail}"
        );
        let detail =
            check(serde_json::json!({"items": [{}, {"patternProperties": {long.clone(): {}}}]}))
                .unwrap_err();
        assert!(
            detail.contains("at \"/items/1/patternProperties/aaaa"),
            "{detail}"
        );
        assert!(detail.len() < 600, "the key is cut: {}", detail.len());
        assert_eq!(
            walk(&serde_json::json!({"pattern": {"not": "a string"}})),
            Shape {
                depth: 2,
                long_pattern: None
            }
        );
    }

    #[test]
    fn echoed_values_are_clipped() {
        assert_eq!(clip("short"), "short");
        let cut = clip(&"é".repeat(300));
        assert!(
            cut.len() <= MAX_ECHO_BYTES + '…'.len_utf8(),
            "{}",
            cut.len()
        );
        assert!(cut.ends_with('…'));
        // A schema keyword with a huge wrong value: the error names it without repeating it.
        let huge = serde_json::json!({"minLength": "x".repeat(60_000)}).to_string();
        let detail = check_descriptor(&capability("x", "", "", &huge))
            .unwrap_err()
            .detail;
        assert!(detail.contains("not a valid JSON Schema"), "{detail}");
        assert!(detail.len() < 600, "{} bytes: {detail}", detail.len());
    }

    #[test]
    fn depth_counts_containers_without_recursion() {
        assert_eq!(depth(&serde_json::json!(1)), 0);
        assert_eq!(depth(&serde_json::json!({})), 1);
        assert_eq!(depth(&serde_json::json!({"a": [1, {"b": []}]})), 4);
    }
}
