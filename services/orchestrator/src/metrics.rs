//! The orchestrator's Prometheus metrics, recorded through the `metrics` facade under the
//! names in [`reach_telemetry::metrics::names`] (the telemetry crate installs the recorder
//! and describes them).

use std::time::Duration;

use reach_telemetry::metrics::names;

use crate::event::TaskStatus;

/// Sets gauge `reach_orchestrator_tasks{status}` to `count` tasks in `status`.
pub fn tasks(status: TaskStatus, count: usize) {
    #[allow(clippy::cast_precision_loss)]
    let count = count as f64;
    ::metrics::gauge!(names::ORCHESTRATOR_TASKS, "status" => status_label(status)).set(count);
}

/// Counts one transition into `status` (`reach_orchestrator_transitions_total{status}`).
pub fn transition(status: TaskStatus) {
    ::metrics::counter!(names::ORCHESTRATOR_TRANSITIONS, "status" => status_label(status))
        .increment(1);
}

/// Records how late a timer fired (`reach_orchestrator_timer_lag_seconds`, seconds).
pub fn timer_lag(lag: Duration) {
    ::metrics::histogram!(names::ORCHESTRATOR_TIMER_LAG).record(lag.as_secs_f64());
}

/// Counts one task moved to the dead-letter list (`reach_orchestrator_dead_letters_total`).
pub fn dead_letter() {
    ::metrics::counter!(names::ORCHESTRATOR_DEAD_LETTERS).increment(1);
}

/// Counts one webhook notification POSTed (`reach_webhook_deliveries_total{outcome}`):
/// `delivered` when the webhook answered 2xx, `failed` otherwise.
pub fn webhook_delivery(delivered: bool) {
    let outcome = if delivered { "delivered" } else { "failed" };
    ::metrics::counter!(names::WEBHOOK_DELIVERIES, "outcome" => outcome).increment(1);
}

/// The metric label of a task status: its name in lower case (`waiting_human`, ...).
pub fn status_label(status: TaskStatus) -> &'static str {
    match status {
        TaskStatus::Pending => "pending",
        TaskStatus::Dispatched => "dispatched",
        TaskStatus::Processing => "processing",
        TaskStatus::WaitingHuman => "waiting_human",
        TaskStatus::Succeeded => "succeeded",
        TaskStatus::Failed => "failed",
        TaskStatus::Partial => "partial",
        TaskStatus::Cancelled => "cancelled",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_lower_case_status_names() {
        for status in TaskStatus::ALL {
            assert_eq!(status_label(status), status.as_str().to_ascii_lowercase());
        }
    }
}
