//! JSON conversions for `google.protobuf.Value` and helpers for message parts.
//!
//! `google.protobuf.Value` is the protobuf JSON value (see `struct.proto`); the mapping is the
//! canonical one: numbers are f64, so integers above 2^53 lose precision, as in JSON itself.

use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value};

use crate::v1::{Part, Payload, part};

/// A JSON value as a `google.protobuf.Value`.
pub fn to_proto(value: &serde_json::Value) -> Value {
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(f64::NAN)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(to_proto).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(Struct {
            fields: map.iter().map(|(k, v)| (k.clone(), to_proto(v))).collect(),
        }),
    };
    Value { kind: Some(kind) }
}

/// A `google.protobuf.Value` as JSON. Whole numbers within ±2^53 become JSON integers;
/// non-finite numbers become null.
pub fn from_proto(value: &Value) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            const EXACT: f64 = 9_007_199_254_740_992.0;
            if n.fract() == 0.0 && n.abs() <= EXACT {
                serde_json::Value::from(*n as i64)
            } else {
                serde_json::Number::from_f64(*n)
                    .map_or(serde_json::Value::Null, serde_json::Value::Number)
            }
        }
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(list)) => {
            serde_json::Value::Array(list.values.iter().map(from_proto).collect())
        }
        Some(Kind::StructValue(s)) => serde_json::Value::Object(
            s.fields
                .iter()
                .map(|(k, v)| (k.clone(), from_proto(v)))
                .collect(),
        ),
    }
}

impl Part {
    /// A text part.
    pub fn text(text: impl Into<String>) -> Self {
        Part {
            content: Some(part::Content::Text(text.into())),
            media_type: "text/plain".into(),
            filename: String::new(),
        }
    }

    /// A structured data part holding `value`.
    pub fn data(value: &serde_json::Value) -> Self {
        Part {
            content: Some(part::Content::Data(to_proto(value))),
            media_type: "application/json".into(),
            filename: String::new(),
        }
    }

    /// The part's data as JSON, if it is a data part.
    pub fn as_json(&self) -> Option<serde_json::Value> {
        match &self.content {
            Some(part::Content::Data(value)) => Some(from_proto(value)),
            _ => None,
        }
    }

    /// The part's text, if it is a text part.
    pub fn as_text(&self) -> Option<&str> {
        match &self.content {
            Some(part::Content::Text(text)) => Some(text),
            _ => None,
        }
    }
}

/// The deepest a data part's JSON value may nest: each object or list is one level, a scalar
/// none (`{"a": [1]}` nests 2). The router refuses deeper messages (INVALID_ARGUMENT /
/// INVALID_PAYLOAD) and the SDKs refuse to send deeper data or replies. An object level costs
/// three protobuf message levels (`Value`, `Struct` and its map entry), a list level two, and
/// the data's first `Value` is the fifth message of a `CallMuxRequest` or `HandleMuxRequest`:
/// 31 object levels end at the 98th, under protobuf's decoding limit of 100 (prost, upb).
/// Without a bound at the edge, a message the router could still decode would be undecodable
/// once wrapped, and end the stream every other call to that instance shares.
pub const MAX_DATA_DEPTH: usize = 31;

/// How deep `value` nests: 0 for a scalar, 1 + its deepest element for a list or struct.
/// Walks with an explicit stack, so any value is safe to measure.
pub fn depth(value: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(value, 0usize)];
    while let Some((value, at)) = stack.pop() {
        match &value.kind {
            Some(Kind::ListValue(list)) => {
                deepest = deepest.max(at + 1);
                stack.extend(list.values.iter().map(|v| (v, at + 1)));
            }
            Some(Kind::StructValue(s)) => {
                deepest = deepest.max(at + 1);
                stack.extend(s.fields.values().map(|v| (v, at + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// Whether `value` nests at most `levels` levels: recursion no deeper than `levels` + 1 and
/// no allocation, so the router's request path checks every message cheaply; [`depth`]
/// measures only the ones that fail.
fn within(value: &Value, levels: usize) -> bool {
    match &value.kind {
        Some(Kind::ListValue(list)) => {
            levels > 0 && list.values.iter().all(|v| within(v, levels - 1))
        }
        Some(Kind::StructValue(s)) => {
            levels > 0 && s.fields.values().all(|v| within(v, levels - 1))
        }
        _ => true,
    }
}

impl Payload {
    /// The first data part nesting deeper than [`MAX_DATA_DEPTH`], as (part index, depth).
    pub fn too_deep(&self) -> Option<(usize, usize)> {
        self.parts
            .iter()
            .enumerate()
            .find_map(|(index, part)| match &part.content {
                Some(part::Content::Data(value)) if !within(value, MAX_DATA_DEPTH) => {
                    Some((index, depth(value)))
                }
                _ => None,
            })
    }

    /// A payload of `message_type` with one data part.
    pub fn json(message_type: impl Into<String>, value: &serde_json::Value) -> Self {
        Payload {
            r#type: message_type.into(),
            parts: vec![Part::data(value)],
        }
    }

    /// A payload of `message_type` with one text part.
    pub fn text(message_type: impl Into<String>, text: impl Into<String>) -> Self {
        Payload {
            r#type: message_type.into(),
            parts: vec![Part::text(text)],
        }
    }

    /// The first data part, as JSON.
    pub fn first_json(&self) -> Option<serde_json::Value> {
        self.parts.iter().find_map(Part::as_json)
    }

    /// The first text part.
    pub fn first_text(&self) -> Option<&str> {
        self.parts.iter().find_map(Part::as_text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips() {
        let value = serde_json::json!({"a": 1, "b": [true, null, "x", 2.5], "c": {"d": -3}});
        assert_eq!(from_proto(&to_proto(&value)), value);
    }
}
