//! The router's metrics: recording helpers with the right labels for every
//! `reach_router_*` metric (names and label sets in [`reach_telemetry::metrics::names`]).
//!
//! Durations are recorded in seconds; `code` labels are gRPC code names (`OK`,
//! `UNAVAILABLE`, ...). Route labels are route names the registry knows (or
//! [`UNROUTED_LABEL`]), instance labels instance ids: both bounded.

use std::time::Duration;

use reach_telemetry::metrics::{GaugeGuard, code_label, names};

/// The metrics label of calls to a name no instance serves: such names come from callers,
/// unbounded, and would each make metric series of their own.
pub const UNROUTED_LABEL: &str = "(unrouted)";

/// Records one finished routed call: counter and latency histogram.
pub fn request(capability: &str, code: tonic::Code, elapsed: Duration) {
    let labels = [
        ("capability", capability.to_string()),
        ("code", code_label(code).to_string()),
    ];
    ::metrics::counter!(names::ROUTER_REQUESTS, &labels).increment(1);
    ::metrics::histogram!(names::ROUTER_REQUEST_DURATION, &labels).record(elapsed.as_secs_f64());
}

/// Sets how many instances are kept routable, unconfirmed, through a registry restart.
pub fn unconfirmed_instances(count: usize) {
    ::metrics::gauge!(names::ROUTER_UNCONFIRMED_INSTANCES).set(count as f64);
}

/// Counts a call in flight until the guard drops.
pub fn in_flight(capability: &str) -> GaugeGuard {
    GaugeGuard::raise(
        ::metrics::gauge!(names::ROUTER_IN_FLIGHT, "capability" => capability.to_string()),
    )
}

/// One route's call metrics (`reach_router_in_flight`, and `reach_router_requests_total`
/// and `reach_router_request_duration_seconds` for its OK calls), with the metric handles
/// looked up once instead of on every call (a lookup hashes the name and labels under the
/// registry's lock). Before [`reach_telemetry::metrics::install`] it falls back to per-call lookups.
#[derive(Debug)]
pub struct RouteMetrics {
    label: String,
    handles: std::sync::OnceLock<RouteHandles>,
}

#[derive(Debug)]
struct RouteHandles {
    in_flight: ::metrics::Gauge,
    ok: ::metrics::Counter,
    ok_duration: ::metrics::Histogram,
}

impl RouteMetrics {
    /// The metrics of the route labelled `capability` (its name, or `(unrouted)`).
    pub fn new(capability: &str) -> Self {
        Self {
            label: capability.to_string(),
            handles: std::sync::OnceLock::new(),
        }
    }

    /// The route's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    fn handles(&self) -> Option<&RouteHandles> {
        if !reach_telemetry::metrics::installed() {
            return None;
        }
        Some(self.handles.get_or_init(|| {
            let ok = [
                ("capability", self.label.clone()),
                ("code", code_label(tonic::Code::Ok).to_string()),
            ];
            RouteHandles {
                in_flight: ::metrics::gauge!(
                    names::ROUTER_IN_FLIGHT,
                    "capability" => self.label.clone()
                ),
                ok: ::metrics::counter!(names::ROUTER_REQUESTS, &ok),
                ok_duration: ::metrics::histogram!(names::ROUTER_REQUEST_DURATION, &ok),
            }
        }))
    }

    /// Counts a call of this route in flight until the guard drops.
    pub fn in_flight(&self) -> GaugeGuard {
        match self.handles() {
            Some(handles) => GaugeGuard::raise(handles.in_flight.clone()),
            None => in_flight(&self.label),
        }
    }

    /// Records one finished call of this route: its code and end-to-end latency.
    pub fn request(&self, code: tonic::Code, elapsed: Duration) {
        match self.handles() {
            Some(handles) if code == tonic::Code::Ok => {
                handles.ok.increment(1);
                handles.ok_duration.record(elapsed.as_secs_f64());
            }
            _ => request(&self.label, code, elapsed),
        }
    }
}

/// Counts an open routed stream until the guard drops.
pub fn open_stream(capability: &str) -> GaugeGuard {
    GaugeGuard::raise(
        ::metrics::gauge!(names::ROUTER_OPEN_STREAMS, "capability" => capability.to_string()),
    )
}

/// Records one finished routed stream: its final code and how long it lived.
pub fn stream(capability: &str, code: tonic::Code, lived: Duration) {
    let labels = [
        ("capability", capability.to_string()),
        ("code", code_label(code).to_string()),
    ];
    ::metrics::counter!(names::ROUTER_STREAMS, &labels).increment(1);
    ::metrics::histogram!(names::ROUTER_STREAM_DURATION, &labels).record(lived.as_secs_f64());
}

/// Records the latency of one call to an upstream instance.
pub fn instance_latency(service: &str, instance: &str, elapsed: Duration) {
    ::metrics::histogram!(
        names::ROUTER_INSTANCE_DURATION,
        "service" => service.to_string(),
        "instance" => instance.to_string()
    )
    .record(elapsed.as_secs_f64());
}

/// One upstream instance's latency histogram (`reach_router_instance_duration_seconds`),
/// with the handle looked up once instead of on every call, as [`RouteMetrics`] does.
/// Before [`reach_telemetry::metrics::install`] it falls back to per-call lookups.
#[derive(Debug)]
pub struct InstanceMetrics {
    service: String,
    instance: String,
    latency: std::sync::OnceLock<::metrics::Histogram>,
}

impl InstanceMetrics {
    /// The metrics of instance `instance` of `service`.
    pub fn new(service: &str, instance: &str) -> Self {
        Self {
            service: service.to_string(),
            instance: instance.to_string(),
            latency: std::sync::OnceLock::new(),
        }
    }

    /// Records the latency of one call (one attempt) to the instance.
    pub fn latency(&self, elapsed: Duration) {
        if !reach_telemetry::metrics::installed() {
            instance_latency(&self.service, &self.instance, elapsed);
            return;
        }
        self.latency
            .get_or_init(|| {
                ::metrics::histogram!(
                    names::ROUTER_INSTANCE_DURATION,
                    "service" => self.service.clone(),
                    "instance" => self.instance.clone()
                )
            })
            .record(elapsed.as_secs_f64());
    }
}

/// Counts one retried attempt.
pub fn retry(capability: &str) {
    ::metrics::counter!(names::ROUTER_RETRIES, "capability" => capability.to_string()).increment(1);
}

/// Counts one call refused because of overload.
pub fn shed(capability: &str, reason: &'static str) {
    ::metrics::counter!(
        names::ROUTER_SHED,
        "capability" => capability.to_string(),
        "reason" => reason
    )
    .increment(1);
}

/// Counts one ejection of an instance from balancing.
pub fn ejection(service: &str, instance: &str) {
    ::metrics::counter!(
        names::ROUTER_EJECTIONS,
        "service" => service.to_string(),
        "instance" => instance.to_string()
    )
    .increment(1);
}

/// Counts one failed call of `message_type`; `reason` is the ErrorInfo reason when the
/// status has one, else the code name.
pub fn message_failure(message_type: &str, status: &tonic::Status) {
    let reason = reach_rpc::errors::reason_of(status)
        .unwrap_or_else(|| code_label(status.code()).to_string());
    ::metrics::counter!(
        names::ROUTER_MESSAGE_FAILURES,
        "message_type" => bounded_message_type(message_type),
        "reason" => reason
    )
    .increment(1);
}

/// Distinct `message_type` label values kept; later ones are counted as `other`.
const MAX_MESSAGE_TYPES: usize = 256;
/// The longest `message_type` label value kept, in bytes; longer ones are `other`.
const MAX_MESSAGE_TYPE_BYTES: usize = 128;

/// A caller's `payload.type` as a label value: the first [`MAX_MESSAGE_TYPES`] distinct
/// types of at most [`MAX_MESSAGE_TYPE_BYTES`] bytes are kept, the rest are `other`, so a
/// caller inventing types cannot grow the metrics without bound. Called on failures only.
fn bounded_message_type(message_type: &str) -> String {
    static SEEN: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    let known = message_type.len() <= MAX_MESSAGE_TYPE_BYTES
        && (seen.contains(message_type)
            || (seen.len() < MAX_MESSAGE_TYPES && seen.insert(message_type.to_string())));
    if known {
        message_type.to_string()
    } else {
        "other".into()
    }
}
