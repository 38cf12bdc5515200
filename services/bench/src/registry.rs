//! `reach-bench registry`: the registry at mesh scale, measured in one run.
//!
//! One process hosts the registry (gRPC on 127.0.0.1, health probing off so that READY follows
//! Register at once and the figures are the registry's own, not a probe's) and the load: `W`
//! Watch streams, each on its own connection as routers hold them, connected before anything
//! registers; then `N` instances over `C` capabilities (instance `i` declares capability
//! `i mod C`, with a description and a small input schema, as agents do) registered by 64
//! concurrent callers, twice, each on a fresh registry: as a burst (every instance at once, as
//! when a whole fleet starts) and paced at a steady 1,000 registrations a second (churn). It
//! prints, for each, side by side:
//! - Register latency (call to answer), p50 / p99 / max;
//! - register → routable: from sending Register to each watcher receiving the instance's
//!   READY upsert (a router applies it to its routing table on receipt), p50 / p99 / max over
//!   every (instance, watcher) pair;
//! - Watch fan-out: per event, from the first watcher's receipt to the last's, p50 / p99 / max;
//! - the snapshot a new watcher gets with `N` instances: its bytes and how long it takes;
//! - memory: the process's resident set growth per registered instance (the registry's table,
//!   its watch history and the watchers' buffers; `/proc/self/statm`).
//!
//! The last line is `registry_register_to_routable_p99_ms=<n> registry_fanout_p99_ms=<n>
//! registry_bytes_per_instance=<n>` (the paced phase's latencies, the burst's memory) for
//! tracking from run to run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use hdrhistogram::Histogram;
use prost::Message as _;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::{
    Capability, InstanceSpec, InstanceState, RegisterRequest, WatchRequest, watch_response,
};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_rpc::GrpcServer;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::transport::Channel;

/// How many Register calls are in flight at once (at most).
const REGISTRARS: usize = 64;
/// The paced phase's registrations per second.
const PACED_PER_SECOND: u32 = 1_000;

/// The scale to measure at.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    /// Instances registered.
    pub instances: usize,
    /// Distinct capabilities they declare.
    pub capabilities: usize,
    /// Concurrent Watch streams.
    pub watchers: usize,
}

impl Scale {
    /// The issue's scale: 10,000 instances over 1,000 capabilities, 100 watchers.
    pub const FULL: Self = Self {
        instances: 10_000,
        capabilities: 1_000,
        watchers: 100,
    };
    /// A tenth of it in every dimension (seconds).
    pub const QUICK: Self = Self {
        instances: 1_000,
        capabilities: 100,
        watchers: 10,
    };
}

/// One phase's figures.
struct Phase {
    registered_in: Duration,
    register: Histogram<u64>,
    routable: Histogram<u64>,
    fanout: Histogram<u64>,
    snapshot_bytes: usize,
    snapshot_took: Duration,
    bytes_per_instance: u64,
}

/// Runs the benchmark at `scale` and prints the report to stdout.
///
/// # Errors
/// When the registry cannot start, a call fails, or a watcher misses an instance.
pub async fn run(scale: Scale) -> anyhow::Result<()> {
    if scale.instances == 0 || scale.capabilities == 0 || scale.watchers == 0 {
        bail!("instances, capabilities and watchers must each be at least 1");
    }
    let burst = phase(scale, None).await?;
    let paced = phase(scale, Some(PACED_PER_SECOND)).await?;
    let phases = [("burst", &burst), ("paced", &paced)];

    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "registry (in-memory): {} instances over {} capabilities, {} watchers, up to {REGISTRARS} registrations in flight",
        scale.instances, scale.capabilities, scale.watchers
    );
    for (name, phase) in phases {
        println!(
            "{name}: registered in {:.2} s ({:.0} registrations/s)",
            phase.registered_in.as_secs_f64(),
            scale.instances as f64 / phase.registered_in.as_secs_f64()
        );
    }
    println!(
        "{:<34} {:>27} {:>27}",
        "ms: p50 / p99 / max", "burst", "paced (1,000/s)"
    );
    let cell = |h: &Histogram<u64>| {
        format!(
            "{:.2} / {:.2} / {:.2}",
            ms(h, 0.5),
            ms(h, 0.99),
            h.max() as f64 / 1000.0
        )
    };
    let row = |name: &str, of: fn(&Phase) -> &Histogram<u64>| {
        println!(
            "{name:<34} {:>27} {:>27}",
            cell(of(&burst)),
            cell(of(&paced))
        );
    };
    row("register (call to answer)", |p| &p.register);
    row("register -> routable (per watcher)", |p| &p.routable);
    row("watch fan-out (first to last)", |p| &p.fanout);
    println!(
        "snapshot for a new watcher: {} instances, {} KiB, {:.1} ms",
        scale.instances,
        burst.snapshot_bytes / 1024,
        burst.snapshot_took.as_secs_f64() * 1000.0
    );
    println!(
        "resident memory: {} bytes per instance (table, watch history, watchers' buffers)",
        burst.bytes_per_instance
    );
    println!(
        "registry_register_to_routable_p99_ms={:.1} registry_fanout_p99_ms={:.1} registry_bytes_per_instance={}",
        ms(&paced.routable, 0.99),
        ms(&paced.fanout, 0.99),
        burst.bytes_per_instance
    );
    Ok(())
}

/// One phase on a fresh registry: registrations as fast as [`REGISTRARS`] callers go, or
/// `paced` a second.
async fn phase(scale: Scale, paced: Option<u32>) -> anyhow::Result<Phase> {
    let rss_before = resident_bytes()?;
    let registry = Registry::new(RegistryConfig {
        health_probe: false,
        // Leases outlive the run: nothing expires while it measures.
        default_lease_ttl: Duration::from_secs(300),
        ..RegistryConfig::default()
    })?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = GrpcServer::new().add_service(RegistryGrpc::new(registry.clone()).into_server());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let serving = tokio::spawn(server.serve(listener, shutdown.clone().cancelled_owned()));

    // When each instance's Register was sent (ns since `epoch`), and when watchers first and
    // last received its READY upsert.
    let epoch = Instant::now();
    let sent: Arc<Vec<AtomicU64>> = Arc::new(times(scale.instances, 0));
    let first_seen: Arc<Vec<AtomicU64>> = Arc::new(times(scale.instances, u64::MAX));
    let last_seen: Arc<Vec<AtomicU64>> = Arc::new(times(scale.instances, 0));

    let mut watchers = Vec::with_capacity(scale.watchers);
    for _ in 0..scale.watchers {
        let channel = Channel::from_shared(url.clone())?.connect().await?;
        let mut stream = RegistryServiceClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .watch(WatchRequest::default())
            .await?
            .into_inner();
        // The (empty) snapshot first: the watcher is live before registration starts.
        stream
            .message()
            .await?
            .context("the watch ended before its snapshot")?;
        let (sent, first_seen, last_seen) = (sent.clone(), first_seen.clone(), last_seen.clone());
        let expected = scale.instances;
        watchers.push(tokio::spawn(async move {
            let mut delays = histogram();
            let mut seen = 0;
            while seen < expected {
                let Some(event) = stream.next().await else {
                    bail!("a watch ended after {seen} of {expected} instances");
                };
                let Some(watch_response::Event::Upserted(instance)) = event?.event else {
                    continue;
                };
                if instance.state() != InstanceState::Ready {
                    continue;
                }
                let at = nanos_since(epoch);
                let index = index_of(&instance.spec.unwrap_or_default().instance_id)?;
                delays.record(at.saturating_sub(sent[index].load(Ordering::Relaxed)) / 1000)?;
                first_seen[index].fetch_min(at, Ordering::Relaxed);
                last_seen[index].fetch_max(at, Ordering::Relaxed);
                seen += 1;
            }
            anyhow::Ok(delays)
        }));
    }

    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let mut registrars = Vec::with_capacity(REGISTRARS);
    for _ in 0..REGISTRARS {
        let channel = Channel::from_shared(url.clone())?.connect().await?;
        let (next, sent) = (next.clone(), sent.clone());
        registrars.push(tokio::spawn(async move {
            let mut client = RegistryServiceClient::new(channel);
            let mut latencies = histogram();
            loop {
                let index = usize::try_from(next.fetch_add(1, Ordering::Relaxed))?;
                if index >= scale.instances {
                    return anyhow::Ok(latencies);
                }
                let request = RegisterRequest {
                    instance: Some(spec(index, scale.capabilities)),
                    lease_ttl: None,
                };
                if let Some(per_second) = paced {
                    let due = Duration::from_secs(1) * u32::try_from(index)? / per_second;
                    tokio::time::sleep_until(started + due).await;
                }
                sent[index].store(nanos_since(epoch), Ordering::Relaxed);
                let call = Instant::now();
                client
                    .register(request)
                    .await
                    .with_context(|| format!("registering instance {index}"))?;
                latencies.record(micros(call.elapsed()))?;
            }
        }));
    }
    let mut register = histogram();
    for registrar in registrars {
        register.add(registrar.await??)?;
    }
    let registered_in = started.elapsed();
    let mut routable = histogram();
    for watcher in watchers {
        routable.add(
            tokio::time::timeout(Duration::from_secs(120), watcher)
                .await
                .context("a watcher did not see every instance within 120 s")???,
        )?;
    }
    let mut fanout = histogram();
    for (first, last) in first_seen.iter().zip(last_seen.iter()) {
        let (first, last) = (first.load(Ordering::Relaxed), last.load(Ordering::Relaxed));
        fanout.record(last.saturating_sub(first) / 1000)?;
    }

    // A new watcher (a router starting) at full size: the snapshot's size and time.
    let channel = Channel::from_shared(url.clone())?.connect().await?;
    let asked = Instant::now();
    let snapshot = RegistryServiceClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .watch(WatchRequest::default())
        .await?
        .into_inner()
        .message()
        .await?
        .context("the watch ended before its snapshot")?;
    let snapshot_took = asked.elapsed();
    let snapshot_bytes = snapshot.encoded_len();

    let rss_after = resident_bytes()?;
    let per_instance = rss_after.saturating_sub(rss_before) / scale.instances as u64;
    shutdown.cancel();
    let _ = serving.await;

    Ok(Phase {
        registered_in,
        register,
        routable,
        fanout,
        snapshot_bytes,
        snapshot_took,
        bytes_per_instance: per_instance,
    })
}

/// Instance `index`'s registration: service `bench-<index mod 100>`, one capability.
fn spec(index: usize, capabilities: usize) -> InstanceSpec {
    let capability = index % capabilities;
    InstanceSpec {
        service: format!("bench-{}", index % 100),
        instance_id: format!("i{index}"),
        endpoint: format!("http://127.0.0.1:{}", 20_000 + index % 40_000),
        capabilities: vec![Capability {
            name: format!("bench.capability{capability:04}"),
            version: "1.0.0".into(),
            description: format!("benchmark capability {capability}"),
            input_schema: r#"{"type":"object","properties":{"text":{"type":"string","maxLength":1000}},"required":["text"]}"#.into(),
            output_schema: String::new(),
        }],
        max_concurrency: 16,
        ..InstanceSpec::default()
    }
}

/// The index in an instance id `i<index>`.
fn index_of(instance_id: &str) -> anyhow::Result<usize> {
    instance_id
        .strip_prefix('i')
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("unexpected instance id {instance_id:?}"))
}

fn times(n: usize, value: u64) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(value)).collect()
}

fn nanos_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

/// Microsecond values from 1 µs to 10 min, 3 significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid histogram bounds")
}

/// This process's resident set size in bytes (`/proc/self/statm`, field 2, in pages).
fn resident_bytes() -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").context("reading /proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .context("/proc/self/statm has no resident field")?;
    Ok(pages * 4096)
}
