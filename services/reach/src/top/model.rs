//! The board's data: a [`Snapshot`] built from `RegistryService.ListInstances` and a parsed
//! `/metrics` scrape, with rates and "last error" derived from the previous refresh.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use prometheus_parse::{HistogramCount, Scrape, Value};
use reach_proto::v1::{InstanceState, ListInstancesResponse};

use reach_telemetry::metrics::names;

/// One instance row.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceRow {
    /// The service the instance belongs to.
    pub service: String,
    /// The instance id.
    pub instance_id: String,
    /// Its lifecycle state, lower-case (`ready`, `busy`, ...).
    pub state: String,
    /// Messages in flight at its last heartbeat.
    pub in_flight: u32,
    /// Its concurrency limit; 0 means unlimited.
    pub max_concurrency: u32,
    /// p99 latency of the router's calls to it, when the router has seen any.
    pub p99: Option<Duration>,
}

/// Traffic of one capability, from the router's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct CapabilityRow {
    /// The capability.
    pub capability: String,
    /// Calls finished since the router started.
    pub requests: f64,
    /// Calls per second since the previous refresh (`None` on the first).
    pub rate: Option<f64>,
    /// Calls that did not end `OK`.
    pub errors: f64,
    /// In flight now.
    pub in_flight: f64,
    /// p99 latency over every code.
    pub p99: Option<Duration>,
}

/// A message type that fails, from the router's metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct FailureRow {
    /// The message type.
    pub message_type: String,
    /// Failures since the router started.
    pub count: f64,
    /// The reason (ErrorInfo reason or gRPC code) of the most recent failure seen.
    pub last_error: String,
}

/// Tasks by status, from the orchestrator's metrics.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskSummary {
    /// Count per status (lower-case), sorted by status; includes `waiting_human`.
    pub by_status: BTreeMap<String, f64>,
    /// Tasks waiting for a person (the `waiting_human` status, which the board shows in this
    /// line of its own rather than among the other statuses).
    pub waiting_human: f64,
    /// Tasks in the dead-letter list since the orchestrator started.
    pub dead_letters: f64,
}

/// Everything one frame shows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// The gRPC endpoint the board reads.
    pub endpoint: String,
    /// Instances, ordered by service then id.
    pub instances: Vec<InstanceRow>,
    /// Every capability name some listed instance registered (whatever its state), sorted,
    /// each once: what the header counts.
    pub registered_capabilities: Vec<String>,
    /// Traffic per capability, busiest first; only capabilities the router has counted calls
    /// or streams for since it started.
    pub capabilities: Vec<CapabilityRow>,
    /// Tasks, when an orchestrator reports metrics.
    pub tasks: Option<TaskSummary>,
    /// Failing message types, most frequent first (at most 10).
    pub failures: Vec<FailureRow>,
    /// Why the instance list is missing, if it is.
    pub registry_error: Option<String>,
    /// Why the metrics are missing, if they are.
    pub metrics_error: Option<String>,
}

/// Builds snapshots, remembering the previous refresh for rates and last errors.
#[derive(Debug, Default)]
pub struct Board {
    previous_requests: HashMap<String, f64>,
    previous_failures: HashMap<(String, String), f64>,
    last_error: HashMap<String, String>,
}

impl Board {
    /// A board with no history.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds the snapshot of one refresh. `elapsed` is the time since the previous one;
    /// either source may have failed (the error text is shown instead).
    pub fn update(
        &mut self,
        endpoint: &str,
        instances: Result<ListInstancesResponse, String>,
        metrics: Result<Scrape, String>,
        elapsed: Option<Duration>,
    ) -> Snapshot {
        let mut snapshot = Snapshot {
            endpoint: endpoint.to_string(),
            ..Snapshot::default()
        };
        let empty = Scrape {
            docs: HashMap::new(),
            samples: Vec::new(),
        };
        let scrape = match metrics {
            Ok(scrape) => scrape,
            Err(e) => {
                snapshot.metrics_error = Some(e);
                empty
            }
        };
        let instance_p99 = histogram_p99_by(&scrape, names::ROUTER_INSTANCE_DURATION, "instance");
        match instances {
            Ok(list) => {
                let names: std::collections::BTreeSet<String> = list
                    .instances
                    .iter()
                    .flat_map(|i| i.spec.iter().flat_map(|s| &s.capabilities))
                    .map(|c| c.name.clone())
                    .collect();
                snapshot.registered_capabilities = names.into_iter().collect();
                snapshot.instances = list
                    .instances
                    .into_iter()
                    .map(|i| {
                        let spec = i.spec.unwrap_or_default();
                        InstanceRow {
                            p99: instance_p99.get(&spec.instance_id).copied().flatten(),
                            service: spec.service,
                            instance_id: spec.instance_id,
                            state: state_name(i.state),
                            in_flight: i.in_flight,
                            max_concurrency: spec.max_concurrency,
                        }
                    })
                    .collect();
                snapshot.instances.sort_by(|a, b| {
                    (&a.service, &a.instance_id).cmp(&(&b.service, &b.instance_id))
                });
            }
            Err(e) => snapshot.registry_error = Some(e),
        }
        snapshot.capabilities = self.capabilities(&scrape, elapsed);
        snapshot.failures = self.failures(&scrape);
        snapshot.tasks = tasks(&scrape);
        snapshot
    }

    fn capabilities(&mut self, scrape: &Scrape, elapsed: Option<Duration>) -> Vec<CapabilityRow> {
        let mut rows: BTreeMap<String, CapabilityRow> = BTreeMap::new();
        let row = |rows: &mut BTreeMap<String, CapabilityRow>, capability: &str| {
            rows.entry(capability.to_string())
                .or_insert_with(|| CapabilityRow {
                    capability: capability.to_string(),
                    requests: 0.0,
                    rate: None,
                    errors: 0.0,
                    in_flight: 0.0,
                    p99: None,
                })
                .clone()
        };
        for sample in &scrape.samples {
            let Some(capability) = sample.labels.get("capability") else {
                continue;
            };
            if sample.metric == names::ROUTER_REQUESTS {
                let value = scalar(&sample.value);
                let mut r = row(&mut rows, capability);
                r.requests += value;
                if sample.labels.get("code") != Some("OK") {
                    r.errors += value;
                }
                rows.insert(capability.to_string(), r);
            } else if sample.metric == names::ROUTER_IN_FLIGHT {
                let mut r = row(&mut rows, capability);
                r.in_flight += scalar(&sample.value);
                rows.insert(capability.to_string(), r);
            }
        }
        let p99 = histogram_p99_by(scrape, names::ROUTER_REQUEST_DURATION, "capability");
        let mut out: Vec<CapabilityRow> = rows
            .into_values()
            .map(|mut r| {
                r.p99 = p99.get(&r.capability).copied().flatten();
                if let (Some(before), Some(elapsed)) =
                    (self.previous_requests.get(&r.capability), elapsed)
                    && elapsed > Duration::ZERO
                {
                    r.rate = Some(((r.requests - before).max(0.0)) / elapsed.as_secs_f64());
                }
                r
            })
            .collect();
        self.previous_requests = out
            .iter()
            .map(|r| (r.capability.clone(), r.requests))
            .collect();
        out.sort_by(|a, b| {
            b.requests
                .total_cmp(&a.requests)
                .then(a.capability.cmp(&b.capability))
        });
        out
    }

    fn failures(&mut self, scrape: &Scrape) -> Vec<FailureRow> {
        let mut counts: BTreeMap<String, f64> = BTreeMap::new();
        let mut current: HashMap<(String, String), f64> = HashMap::new();
        for sample in scrape
            .samples
            .iter()
            .filter(|s| s.metric == names::ROUTER_MESSAGE_FAILURES)
        {
            let message_type = sample.labels.get("message_type").unwrap_or("").to_string();
            let reason = sample.labels.get("reason").unwrap_or("").to_string();
            let value = scalar(&sample.value);
            *counts.entry(message_type.clone()).or_default() += value;
            current.insert((message_type, reason), value);
        }
        // The reason whose count grew the most since the last refresh is the latest error;
        // with no history, the most frequent one.
        let mut best: HashMap<String, (f64, String)> = HashMap::new();
        for ((message_type, reason), value) in &current {
            let grew = value
                - self
                    .previous_failures
                    .get(&(message_type.clone(), reason.clone()))
                    .copied()
                    .unwrap_or(0.0);
            let entry = best
                .entry(message_type.clone())
                .or_insert((f64::MIN, String::new()));
            if grew > entry.0 || (grew == entry.0 && reason < &entry.1) {
                *entry = (grew, reason.clone());
            }
        }
        for (message_type, (grew, reason)) in best {
            if grew > 0.0 || !self.last_error.contains_key(&message_type) {
                self.last_error.insert(message_type, reason);
            }
        }
        self.previous_failures = current;
        let mut rows: Vec<FailureRow> = counts
            .into_iter()
            .filter(|(_, count)| *count > 0.0)
            .map(|(message_type, count)| FailureRow {
                last_error: self
                    .last_error
                    .get(&message_type)
                    .cloned()
                    .unwrap_or_default(),
                message_type,
                count,
            })
            .collect();
        rows.sort_by(|a, b| {
            b.count
                .total_cmp(&a.count)
                .then(a.message_type.cmp(&b.message_type))
        });
        rows.truncate(10);
        rows
    }
}

fn tasks(scrape: &Scrape) -> Option<TaskSummary> {
    let mut summary = TaskSummary::default();
    let mut seen = false;
    for sample in &scrape.samples {
        if sample.metric == names::ORCHESTRATOR_TASKS {
            seen = true;
            let status = sample.labels.get("status").unwrap_or("").to_string();
            let value = scalar(&sample.value);
            if status == "waiting_human" {
                summary.waiting_human += value;
            }
            *summary.by_status.entry(status).or_default() += value;
        } else if sample.metric == names::ORCHESTRATOR_DEAD_LETTERS {
            seen = true;
            summary.dead_letters += scalar(&sample.value);
        }
    }
    seen.then_some(summary)
}

fn state_name(state: i32) -> String {
    match InstanceState::try_from(state) {
        Ok(InstanceState::Registered) => "registered",
        Ok(InstanceState::Ready) => "ready",
        Ok(InstanceState::Busy) => "busy",
        Ok(InstanceState::Draining) => "draining",
        Ok(InstanceState::Offline) => "offline",
        Ok(InstanceState::Unspecified) | Err(_) => "unknown",
    }
    .to_string()
}

fn scalar(value: &Value) -> f64 {
    match value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => *v,
        Value::Histogram(_) | Value::Summary(_) => 0.0,
    }
}

/// p99 of a histogram metric per value of `label`, merging every other label.
fn histogram_p99_by(
    scrape: &Scrape,
    metric: &str,
    label: &str,
) -> HashMap<String, Option<Duration>> {
    let mut merged: HashMap<String, BTreeMap<u64, (f64, f64)>> = HashMap::new();
    for sample in scrape.samples.iter().filter(|s| s.metric == metric) {
        let (Some(key), Value::Histogram(buckets)) = (sample.labels.get(label), &sample.value)
        else {
            continue;
        };
        let entry = merged.entry(key.to_string()).or_default();
        for b in buckets {
            // Key buckets by their bound's bits so equal bounds merge.
            let slot = entry
                .entry(b.less_than.to_bits())
                .or_insert((b.less_than, 0.0));
            slot.1 += b.count;
        }
    }
    merged
        .into_iter()
        .map(|(key, buckets)| {
            let mut buckets: Vec<HistogramCount> = buckets
                .into_values()
                .map(|(less_than, count)| HistogramCount { less_than, count })
                .collect();
            buckets.sort_by(|a, b| a.less_than.total_cmp(&b.less_than));
            (key, quantile(0.99, &buckets).map(Duration::from_secs_f64))
        })
        .collect()
}

/// The `q` quantile of cumulative buckets, interpolated linearly inside the bucket it falls
/// in (as Prometheus' `histogram_quantile` does); `None` without observations.
pub fn quantile(q: f64, buckets: &[HistogramCount]) -> Option<f64> {
    let total = buckets.last()?.count;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower_bound = 0.0;
    let mut lower_count = 0.0;
    for b in buckets {
        if b.count >= rank {
            if b.less_than.is_infinite() {
                return Some(lower_bound);
            }
            let in_bucket = b.count - lower_count;
            if in_bucket <= 0.0 {
                return Some(b.less_than);
            }
            return Some(
                lower_bound + (b.less_than - lower_bound) * (rank - lower_count) / in_bucket,
            );
        }
        lower_bound = b.less_than;
        lower_count = b.count;
    }
    Some(lower_bound)
}
