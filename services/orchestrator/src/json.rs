//! Conversions between `serde_json::Value` and `google.protobuf.Value`.

use prost_types::value::Kind;

/// A JSON value as a protobuf `Value` (numbers become doubles, as protobuf JSON does).
pub fn to_proto(value: &serde_json::Value) -> prost_types::Value {
    let kind = match value {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(to_proto).collect(),
        }),
        serde_json::Value::Object(map) => Kind::StructValue(prost_types::Struct {
            fields: map.iter().map(|(k, v)| (k.clone(), to_proto(v))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// A protobuf `Value` as JSON. Whole doubles within ±2^53 become integers, so ids and counts
/// read naturally; an unset value is `null`.
pub fn from_proto(value: &prost_types::Value) -> serde_json::Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => number(*n),
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

/// An optional protobuf value as JSON (`null` when absent).
pub fn from_proto_opt(value: Option<&prost_types::Value>) -> serde_json::Value {
    value.map(from_proto).unwrap_or(serde_json::Value::Null)
}

fn number(n: f64) -> serde_json::Value {
    const LIMIT: f64 = 9_007_199_254_740_992.0;
    if n.fract() == 0.0 && n.abs() <= LIMIT {
        #[allow(clippy::cast_possible_truncation)]
        return serde_json::Value::from(n as i64);
    }
    serde_json::Number::from_f64(n)
        .map(serde_json::Value::Number)
        .unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let v = serde_json::json!({"a": [1, 2.5, "x", null, true], "b": {"c": -3}});
        assert_eq!(from_proto(&to_proto(&v)), v);
    }
}
