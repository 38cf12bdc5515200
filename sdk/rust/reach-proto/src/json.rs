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

impl Payload {
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
