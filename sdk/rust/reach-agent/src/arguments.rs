//! Lenient parsing of the arguments a model wrote for a tool call.
//!
//! Models are asked for a JSON object and mostly write one; when they do not, the text is
//! tried, in this order, as:
//!
//! 1. strict JSON (RFC 8259, `serde_json`);
//! 2. the outermost `{...}` object inside a Markdown code fence or surrounding prose
//!    (fence first, then the first balanced object in the text), as strict JSON;
//! 3. relaxed JSON — JSON5: trailing commas, single quotes, unquoted keys, comments — with the
//!    `json5` crate, on the whole text and on the extracted object;
//! 4. Python literals: `True`, `False`, `None` outside string literals replaced by `true`,
//!    `false`, `null` (whole identifiers only; `"None of them"` is left alone), then JSON5;
//! 5. YAML (`serde_norway`), accepted only when it yields a mapping or a sequence (YAML
//!    reads any prose as a string scalar, which is never taken for arguments).
//!
//! Text none of these read is an error ([`ArgumentsError::Unparsable`], carrying the strict
//! JSON parser's message with its line and column) — never an empty object.
//!
//! **Never a guess.** Text holding two or more different objects (`{"path": "a.txt"}
//! {"path": "b.txt"}`, or two code fences) is [`ArgumentsError::Ambiguous`], naming the first
//! two: taking the first would run the tool on what the model may not have meant. A value the
//! model left out — `?`, `...` or nothing after a key (`{"path": ?}`, `{"path": }`) — is
//! [`ArgumentsError::MissingValues`], naming each such field's JSON pointer (`/path`), before
//! YAML is tried (which would read `?` as syntax of its own).
//!
//! **Empty arguments** (`""` or whitespace only, which some models send for tools without
//! parameters): `{}` when the caller says the tool's schema has no required property
//! (`empty_is_object`), otherwise [`ArgumentsError::Empty`]. A schema with required fields
//! never gets `{}`.
//!
//! **Bounds**: at most [`ArgumentLimits::max_bytes`] bytes (default 1 MiB) and
//! [`ArgumentLimits::max_depth`] levels of nesting (default 64), checked before any parser
//! runs (brackets outside strings) and again on the parsed value (YAML block nesting).

use serde_json::Value;

/// Size and nesting bounds on argument text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgumentLimits {
    /// The most bytes of argument text.
    pub max_bytes: usize,
    /// The deepest nesting of objects and arrays.
    pub max_depth: usize,
}

impl Default for ArgumentLimits {
    fn default() -> Self {
        Self {
            max_bytes: 1 << 20,
            max_depth: 64,
        }
    }
}

/// Which reading of the text succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParseMethod {
    /// Strict JSON as written.
    Json,
    /// Strict JSON after taking the object out of a code fence or prose.
    Extracted,
    /// JSON5 (trailing commas, single quotes, unquoted keys, comments).
    Json5,
    /// Python literals replaced, then JSON5.
    PythonLiterals,
    /// YAML.
    Yaml,
    /// Empty text taken as `{}`.
    Empty,
}

impl ParseMethod {
    /// The name (`json`, `extracted`, `json5`, `python_literals`, `yaml`, `empty`).
    pub fn as_str(self) -> &'static str {
        match self {
            ParseMethod::Json => "json",
            ParseMethod::Extracted => "extracted",
            ParseMethod::Json5 => "json5",
            ParseMethod::PythonLiterals => "python_literals",
            ParseMethod::Yaml => "yaml",
            ParseMethod::Empty => "empty",
        }
    }
}

/// Parsed arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    /// The value read.
    pub value: Value,
    /// How it was read.
    pub method: ParseMethod,
}

/// Why argument text could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArgumentsError {
    /// Over the size bound.
    #[error(
        "the arguments are {size} bytes, over the limit of {limit} bytes; pass large content by reference"
    )]
    TooLarge {
        /// Their size, in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// Nested deeper than the bound.
    #[error("the arguments nest {depth} levels deep, over the limit of {limit}")]
    TooDeep {
        /// The depth found (at least `limit + 1`).
        depth: usize,
        /// The limit.
        limit: usize,
    },
    /// Empty text for a tool whose schema has required properties.
    #[error(
        "the arguments are empty, but the tool requires properties; send a JSON object with them"
    )]
    Empty,
    /// Two or more different top-level values: which one the model meant is a guess.
    #[error(
        "the arguments hold {count} separate JSON values ({first} and {second}); a tool call takes one object: send only the one you mean"
    )]
    Ambiguous {
        /// How many values were found (at least 2).
        count: usize,
        /// The first, cut to 100 characters.
        first: String,
        /// The second, cut to 100 characters.
        second: String,
    },
    /// Fields whose value the model left out (`?`, `...`, or nothing).
    #[error(
        "no value at {} (the arguments have `?`, `...` or nothing there); write each value",
        pointers.join(", ")
    )]
    MissingValues {
        /// The fields' JSON pointers (RFC 6901), sorted.
        pointers: Vec<String>,
    },
    /// No reading succeeded.
    #[error("the arguments are not a JSON object: {detail}; send one JSON object")]
    Unparsable {
        /// The strict JSON parser's message (with line and column).
        detail: String,
    },
}

/// Reads `text` with the default [`ArgumentLimits`]; see the module docs for the order.
///
/// # Errors
/// [`ArgumentsError`].
pub fn parse_arguments(text: &str, empty_is_object: bool) -> Result<Parsed, ArgumentsError> {
    parse_arguments_with(text, ArgumentLimits::default(), empty_is_object)
}

/// Reads `text` within `limits`.
///
/// # Errors
/// [`ArgumentsError`].
pub fn parse_arguments_with(
    text: &str,
    limits: ArgumentLimits,
    empty_is_object: bool,
) -> Result<Parsed, ArgumentsError> {
    if text.len() > limits.max_bytes {
        return Err(ArgumentsError::TooLarge {
            size: text.len(),
            limit: limits.max_bytes,
        });
    }
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return if empty_is_object {
            Ok(Parsed {
                value: Value::Object(serde_json::Map::new()),
                method: ParseMethod::Empty,
            })
        } else {
            Err(ArgumentsError::Empty)
        };
    }
    let depth = bracket_depth(trimmed);
    if depth > limits.max_depth {
        return Err(ArgumentsError::TooDeep {
            depth,
            limit: limits.max_depth,
        });
    }
    let parsed = read(trimmed)?;
    let depth = value_depth(&parsed.value);
    if depth > limits.max_depth {
        return Err(ArgumentsError::TooDeep {
            depth,
            limit: limits.max_depth,
        });
    }
    Ok(parsed)
}

fn read(text: &str) -> Result<Parsed, ArgumentsError> {
    let strict_error = match serde_json::from_str::<Value>(text) {
        Ok(value) => {
            return Ok(Parsed {
                value,
                method: ParseMethod::Json,
            });
        }
        Err(e) => e.to_string(),
    };
    check_single_value(text)?;
    let extracted = extract_object(text).filter(|e| *e != text);
    if let Some(inner) = extracted
        && let Ok(value) = serde_json::from_str::<Value>(inner)
    {
        return Ok(Parsed {
            value,
            method: ParseMethod::Extracted,
        });
    }
    let candidates: Vec<&str> = std::iter::once(text).chain(extracted).collect();
    for candidate in &candidates {
        if let Ok(value) = json5::from_str::<Value>(candidate) {
            return Ok(Parsed {
                value,
                method: ParseMethod::Json5,
            });
        }
    }
    for candidate in &candidates {
        if let Some(replaced) = replace_python_literals(candidate)
            && let Ok(value) = json5::from_str::<Value>(&replaced)
        {
            return Ok(Parsed {
                value,
                method: ParseMethod::PythonLiterals,
            });
        }
    }
    for candidate in &candidates {
        let Some(marked) = mark_missing_values(candidate) else {
            continue;
        };
        let value = serde_json::from_str::<Value>(&marked)
            .ok()
            .or_else(|| json5::from_str::<Value>(&marked).ok())
            .or_else(|| {
                replace_python_literals(&marked).and_then(|r| json5::from_str::<Value>(&r).ok())
            });
        if let Some(value) = value {
            let mut pointers = Vec::new();
            missing_pointers(&value, &mut String::new(), &mut pointers);
            if !pointers.is_empty() {
                pointers.sort();
                return Err(ArgumentsError::MissingValues { pointers });
            }
        }
    }
    for candidate in &candidates {
        if let Ok(value) = serde_norway::from_str::<Value>(candidate)
            && (value.is_object() || value.is_array())
        {
            return Ok(Parsed {
                value,
                method: ParseMethod::Yaml,
            });
        }
    }
    Err(ArgumentsError::Unparsable {
        detail: strict_error,
    })
}

/// The bodies of the text's Markdown code fences (trimmed, non-empty), in order.
fn fence_bodies(text: &str) -> Vec<&str> {
    let mut bodies = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("```") {
        let after = &rest[start + 3..];
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        let Some(end) = body.find("```") else { break };
        let inner = body[..end].trim();
        if !inner.is_empty() {
            bodies.push(inner);
        }
        rest = &body[end + 3..];
    }
    bodies
}

/// Every balanced top-level `{...}` of `text`, outside string literals, in order.
fn top_level_objects(text: &str) -> Vec<&str> {
    let mut objects = Vec::new();
    let mut depth = 0usize;
    let mut start = 0usize;
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for (i, &b) in text.as_bytes().iter().enumerate() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == q {
                quote = None;
            }
            continue;
        }
        match b {
            b'"' | b'\'' if depth > 0 => quote = Some(b),
            b'{' | b'[' => {
                if depth == 0 {
                    start = i;
                }
                depth += 1;
            }
            b'}' | b']' if depth > 0 => {
                depth -= 1;
                if depth == 0 && text.as_bytes()[start] == b'{' {
                    objects.push(&text[start..=i]);
                }
            }
            _ => {}
        }
    }
    objects
}

/// [`ArgumentsError::Ambiguous`] when `text` holds two or more different code fences, or
/// (in its one fence, or in the whole text without one) two or more different top-level
/// objects that read as JSON, JSON5 or Python literals.
fn check_single_value(text: &str) -> Result<(), ArgumentsError> {
    let ambiguous = |values: &[&str]| {
        let first = values[0];
        match values.iter().find(|v| **v != first) {
            None => Ok(()),
            Some(second) => Err(ArgumentsError::Ambiguous {
                count: values.len(),
                first: first.chars().take(100).collect(),
                second: second.chars().take(100).collect(),
            }),
        }
    };
    let fences = fence_bodies(text);
    if fences.len() > 1 {
        ambiguous(&fences)?;
    }
    let region = fences.first().copied().unwrap_or(text);
    // Braces in prose (`{you}`, a template) are not values: only objects that read count.
    let objects: Vec<&str> = top_level_objects(region)
        .into_iter()
        .filter(|object| {
            serde_json::from_str::<Value>(object).is_ok()
                || json5::from_str::<Value>(object).is_ok()
                || replace_python_literals(object)
                    .is_some_and(|r| json5::from_str::<Value>(&r).is_ok())
        })
        .collect();
    if objects.len() > 1 {
        ambiguous(&objects)?;
    }
    Ok(())
}

/// What [`mark_missing_values`] writes where a value was left out: a JSON string no model
/// writes (it starts with U+0000).
const MISSING: &str = "\u{0}reach:missing-value";

/// `text` with every left-out value after a key — `?` (or `??`...), `...`, `…`, or nothing
/// before the next `,` or `}` — replaced by the [`MISSING`] string, outside string literals;
/// `None` when there was none.
fn mark_missing_values(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len() + 32);
    let mut marked = false;
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut chars = text.char_indices().peekable();
    while let Some((_, c)) = chars.next() {
        out.push(c);
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => quote = Some(c),
            ':' => {
                while let Some(&(_, w)) = chars.peek() {
                    if w.is_whitespace() {
                        out.push(w);
                        chars.next();
                    } else {
                        break;
                    }
                }
                let rest = chars.peek().map_or("", |&(j, _)| &text[j..]);
                let token = rest
                    .char_indices()
                    .find(|(_, t)| t.is_whitespace() || matches!(t, ',' | '}' | ']'))
                    .map_or(rest, |(end, _)| &rest[..end]);
                let left_out = token.is_empty() && rest.starts_with([',', '}'])
                    || (!token.is_empty() && token.chars().all(|t| t == '?'))
                    || token == "..."
                    || token == "\u{2026}";
                if left_out {
                    out.push_str(&serde_json::Value::String(MISSING.into()).to_string());
                    for _ in token.chars() {
                        chars.next();
                    }
                    marked = true;
                }
            }
            _ => {}
        }
    }
    marked.then_some(out)
}

/// Appends the JSON pointer (RFC 6901) of every [`MISSING`] string in `value` to `found`.
fn missing_pointers(value: &Value, at: &mut String, found: &mut Vec<String>) {
    match value {
        Value::String(s) if s == MISSING => found.push(at.clone()),
        Value::Object(map) => {
            for (key, item) in map {
                let len = at.len();
                at.push('/');
                at.push_str(&key.replace('~', "~0").replace('/', "~1"));
                missing_pointers(item, at, found);
                at.truncate(len);
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let len = at.len();
                at.push_str(&format!("/{i}"));
                missing_pointers(item, at, found);
                at.truncate(len);
            }
        }
        _ => {}
    }
}

/// The content of the first Markdown code fence, else the first balanced `{...}` in the
/// text (brackets inside string literals, single- or double-quoted, are skipped).
pub fn extract_object(text: &str) -> Option<&str> {
    if let Some(start) = text.find("```") {
        let after = &text[start + 3..];
        // The info string (`json`, `yaml`, ...) runs to the end of the fence's line.
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        if let Some(end) = body.find("```") {
            let inner = body[..end].trim();
            if !inner.is_empty() {
                return Some(inner);
            }
        }
    }
    let start = text.find('{')?;
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == q {
                quote = None;
            }
            continue;
        }
        match b {
            b'"' | b'\'' => quote = Some(b),
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(&text[start..=i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `text` with the Python literals `True`, `False` and `None` outside string literals
/// replaced by their JSON spellings; `None` when there was nothing to replace.
pub fn replace_python_literals(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut replaced = false;
    let mut chars = text.char_indices().peekable();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    while let Some((i, c)) = chars.next() {
        if let Some(q) = quote {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        if c == '"' || c == '\'' {
            quote = Some(c);
            out.push(c);
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' {
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            let word = &text[i..end];
            let json = match word {
                "True" => Some("true"),
                "False" => Some("false"),
                "None" => Some("null"),
                _ => None,
            };
            match json {
                Some(j) => {
                    out.push_str(j);
                    replaced = true;
                }
                None => out.push_str(word),
            }
            continue;
        }
        out.push(c);
    }
    replaced.then_some(out)
}

/// The deepest bracket nesting outside string literals.
fn bracket_depth(text: &str) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for &b in text.as_bytes() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == q {
                quote = None;
            }
            continue;
        }
        match b {
            b'"' | b'\'' => quote = Some(b),
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// The nesting depth of a value (a scalar is 0, `{}` is 1).
pub fn value_depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(value_depth).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(value_depth).max().unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_literals_are_replaced_outside_strings_only() {
        assert_eq!(
            replace_python_literals("{'a': True, 'b': 'None of it', c: None}").unwrap(),
            "{'a': true, 'b': 'None of it', c: null}"
        );
        assert!(replace_python_literals("{\"Trueish\": 1}").is_none());
    }

    #[test]
    fn readings_in_order() {
        let p = parse_arguments("{\"a\": 1}", false).unwrap();
        assert_eq!(p.method, ParseMethod::Json);
        let p = parse_arguments("Sure:\n```json\n{\"a\": 1}\n```", false).unwrap();
        assert_eq!(
            (p.value, p.method),
            (json!({"a": 1}), ParseMethod::Extracted)
        );
        let p = parse_arguments("{a: 1,}", false).unwrap();
        assert_eq!(p.method, ParseMethod::Json5);
        let p = parse_arguments("a: 1\nb: [x, y]", false).unwrap();
        assert_eq!(
            (p.value, p.method),
            (json!({"a": 1, "b": ["x", "y"]}), ParseMethod::Yaml)
        );
        assert!(matches!(
            parse_arguments("just words", true),
            Err(ArgumentsError::Unparsable { .. })
        ));
    }

    #[test]
    fn several_objects_are_ambiguous_and_name_both() {
        let two = r#"{"path":"a.txt"} {"path":"b.txt"}"#;
        match parse_arguments(two, false) {
            Err(ArgumentsError::Ambiguous {
                count,
                first,
                second,
            }) => {
                assert_eq!(count, 2);
                assert_eq!(first, r#"{"path":"a.txt"}"#);
                assert_eq!(second, r#"{"path":"b.txt"}"#);
            }
            other => panic!("{other:?}"),
        }
        let fences = "```json\n{\"a\": 1}\n```\nor\n```json\n{\"a\": 2}\n```";
        assert!(matches!(
            parse_arguments(fences, false),
            Err(ArgumentsError::Ambiguous { .. })
        ));
        let prose = r#"Calling with {"a": 1}, then maybe {'a': 2}"#;
        assert!(matches!(
            parse_arguments(prose, false),
            Err(ArgumentsError::Ambiguous { .. })
        ));
        // One object, said twice, or with braces inside its strings, is no guess.
        let same = r#"{"a": 1} {"a": 1}"#;
        assert_eq!(parse_arguments(same, false).unwrap().value, json!({"a": 1}));
        let braces = r#"Here: {"note": "} {"}"#;
        assert_eq!(
            parse_arguments(braces, false).unwrap().value,
            json!({"note": "} {"})
        );
    }

    #[test]
    fn left_out_values_are_named_by_pointer() {
        for (text, pointers) in [
            (r#"{"path": ?}"#, vec!["/path"]),
            (r#"{"path": ??, "mode": "w"}"#, vec!["/path"]),
            (r#"{"path": , "mode": ...}"#, vec!["/mode", "/path"]),
            (r#"{"outer": {"a/b": ?}}"#, vec!["/outer/a~1b"]),
            ("{path: ?}", vec!["/path"]),
        ] {
            match parse_arguments(text, false) {
                Err(ArgumentsError::MissingValues { pointers: got }) => {
                    assert_eq!(got, pointers, "{text}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
        // A `?` inside a string is a value.
        assert_eq!(
            parse_arguments(r#"{"q": "?"}"#, false).unwrap().value,
            json!({"q": "?"})
        );
    }

    #[test]
    fn bounds_hold() {
        let deep = "[".repeat(100) + &"]".repeat(100);
        assert!(matches!(
            parse_arguments(&deep, false),
            Err(ArgumentsError::TooDeep { .. })
        ));
        let big = format!("{{\"a\": \"{}\"}}", "x".repeat(2 << 20));
        assert!(matches!(
            parse_arguments(&big, false),
            Err(ArgumentsError::TooLarge { .. })
        ));
    }
}
