//! Conversions between `serde_json::Value` and `google.protobuf.Value`: the shared ones of
//! `reach_proto::json`, plus an optional-value helper.

pub use reach_proto::json::{from_proto, to_proto};

/// An optional protobuf value as JSON (`null` when absent).
pub fn from_proto_opt(value: Option<&prost_types::Value>) -> serde_json::Value {
    value.map(from_proto).unwrap_or(serde_json::Value::Null)
}
