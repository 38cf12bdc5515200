//! cli placeholder
/// JSON view of a task.
pub fn task_json(_t: &reach_proto::v1::Task) -> serde_json::Value { serde_json::Value::Null }
