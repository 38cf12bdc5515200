//! `reach-bench registry`: the registry at mesh scale, measured in one run.
//!
//! One process hosts the registry (gRPC on 127.0.0.1, health probing off so that READY follows
//! Register at once and the figures are the registry's own, not a probe's) and the load: `W`
//! Watch streams, each on its own connection as routers hold them, connected before anything
//! registers; then `N` instances over `C` capabilities (instance `i` declares capability
//! `i mod C`, with a description and a small input schema, as agents do) registered by 64
//! concurrent callers, twice, each on a fresh registry: as a burst (every instance at once, as
//! when a whole fleet starts) and paced at a steady 1,000 registrations a second (churn). Both
//! phases run on each backend: in-memory, and etcd (an etcd the bench starts as a child process,
//! a fresh key prefix per phase; skipped, saying so, when `etcd` is not installed or the bench
//! was built without `--features etcd`). It prints, for each, side by side:
//! - Register latency (call to answer), p50 / p99 / max;
//! - register → routable: from sending Register to each watcher receiving the instance's
//!   READY upsert (a router applies it to its routing table on receipt), p50 / p99 / max over
//!   every (instance, watcher) pair;
//! - Watch fan-out: per event, from the first watcher's receipt to the last's, p50 / p99 / max;
//! - the snapshot a new watcher gets with `N` instances: its bytes and how long it takes;
//! - memory: the process's resident set growth per registered instance (the registry's table,
//!   its watch history and the watchers' buffers; `/proc/self/statm`), and on etcd also etcd's
//!   own growth (`/proc/<etcd>/statm`).
//!
//! The last line is `registry_register_to_routable_p99_ms=<n> registry_fanout_p99_ms=<n>
//! registry_bytes_per_instance=<n>` (in-memory: the paced phase's latencies, the burst's
//! memory), followed by `registry_etcd_register_to_routable_p99_ms=<n>
//! registry_etcd_fanout_p99_ms=<n> registry_etcd_etcd_bytes_per_instance=<n>` (etcd's own
//! memory) when etcd ran, for tracking from run to run.

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
use reach_registry::{Backend, RegistryConfig, RegistryGrpc};
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
    /// etcd's own resident growth per instance (etcd phases only).
    etcd_bytes_per_instance: Option<u64>,
}

/// An etcd for the etcd phases: a child process on ephemeral ports.
struct Etcd {
    process: crate::router::ChildProcess,
    url: String,
}

impl Etcd {
    async fn start() -> anyhow::Result<Self> {
        let dir = crate::router::scratch_dir("etcd")?;
        let (client, peer) = (crate::router::free_port()?, crate::router::free_port()?);
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let mut command = std::process::Command::new("etcd");
        command
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--name", "bench", "--quota-backend-bytes", "4294967296"])
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("bench={peer_url}")]);
        let mut process = crate::router::ChildProcess::spawn(
            "etcd",
            "apt-get install etcd-server",
            "nothing (the etcd columns are skipped when etcd is missing)",
            command,
            dir,
            &[],
        )?;
        process.wait_for_port(client).await?;
        Ok(Self { process, url })
    }

    fn resident_bytes(&self) -> anyhow::Result<u64> {
        statm_resident(&format!("/proc/{}/statm", self.process.pid()))
    }
}

/// Runs the benchmark at `scale` and prints the report to stdout.
///
/// # Errors
/// When the registry cannot start, a call fails, or a watcher misses an instance.
pub async fn run(scale: Scale) -> anyhow::Result<()> {
    if scale.instances == 0 || scale.capabilities == 0 || scale.watchers == 0 {
        bail!("instances, capabilities and watchers must each be at least 1");
    }
    let mut phases = vec![
        ("memory, burst", phase(scale, None, None).await?),
        (
            "memory, paced",
            phase(scale, Some(PACED_PER_SECOND), None).await?,
        ),
    ];
    let etcd = match Etcd::start().await {
        Ok(etcd) => Some(etcd),
        Err(error) => {
            println!("etcd columns skipped: {error:#}");
            None
        }
    };
    if let Some(etcd) = &etcd {
        match phase(scale, None, Some(etcd)).await {
            Ok(burst) => {
                phases.push(("etcd, burst", burst));
                phases.push((
                    "etcd, paced",
                    phase(scale, Some(PACED_PER_SECOND), Some(etcd)).await?,
                ));
            }
            Err(error) if format!("{error:#}").contains("--features etcd") => {
                println!("etcd columns skipped: {error:#}");
            }
            Err(error) => return Err(error),
        }
    }
    drop(etcd);

    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "registry: {} instances over {} capabilities, {} watchers, up to {REGISTRARS} registrations in flight; paced: {PACED_PER_SECOND}/s",
        scale.instances, scale.capabilities, scale.watchers
    );
    let header: Vec<String> = phases
        .iter()
        .map(|(name, _)| format!("{name:>24}"))
        .collect();
    println!("{:<36}{}", "", header.join(""));
    let line = |name: &str, cell: &dyn Fn(&Phase) -> String| {
        let cells: Vec<String> = phases
            .iter()
            .map(|(_, phase)| format!("{:>24}", cell(phase)))
            .collect();
        println!("{name:<36}{}", cells.join(""));
    };
    let quantiles = |h: &Histogram<u64>| {
        format!(
            "{:.2} / {:.2} / {:.2}",
            ms(h, 0.5),
            ms(h, 0.99),
            h.max() as f64 / 1000.0
        )
    };
    line("registrations/s", &|p| {
        format!(
            "{:.0}",
            scale.instances as f64 / p.registered_in.as_secs_f64()
        )
    });
    line("register, ms p50 / p99 / max", &|p| quantiles(&p.register));
    line("register -> routable, ms", &|p| quantiles(&p.routable));
    line("watch fan-out (first to last), ms", &|p| {
        quantiles(&p.fanout)
    });
    line(
        &format!("snapshot for a new watcher ({})", scale.instances),
        &|p| {
            format!(
                "{} KiB, {:.1} ms",
                p.snapshot_bytes / 1024,
                p.snapshot_took.as_secs_f64() * 1000.0
            )
        },
    );
    // Only the first phase's growth is the table's: later phases reuse what the allocator kept
    // from the earlier ones (an etcd mirror holds the same table as the in-memory registry).
    let first = phases.first().map(|(name, _)| *name);
    let cells: Vec<String> = phases
        .iter()
        .map(|(name, p)| {
            let cell = if Some(*name) == first {
                p.bytes_per_instance.to_string()
            } else {
                "(reused)".to_string()
            };
            format!("{cell:>24}")
        })
        .collect();
    println!(
        "{:<36}{}",
        "registry memory, bytes/instance",
        cells.join("")
    );
    line("etcd memory, bytes/instance", &|p| {
        p.etcd_bytes_per_instance
            .map_or_else(|| "-".to_string(), |b| b.to_string())
    });
    let find = |name: &str| phases.iter().find(|(n, _)| *n == name).map(|(_, p)| p);
    let mut last = String::new();
    for (prefix, backend) in [("registry", "memory"), ("registry_etcd", "etcd")] {
        if let (Some(burst), Some(paced)) = (
            find(&format!("{backend}, burst")),
            find(&format!("{backend}, paced")),
        ) {
            // The table's memory is the in-memory registry's; on etcd, etcd's own.
            let (memory, bytes) = match burst.etcd_bytes_per_instance {
                Some(etcd) => ("etcd_bytes_per_instance", etcd),
                None => ("bytes_per_instance", burst.bytes_per_instance),
            };
            last.push_str(&format!(
                "{prefix}_register_to_routable_p99_ms={:.1} {prefix}_fanout_p99_ms={:.1} {prefix}_{memory}={bytes} ",
                ms(&paced.routable, 0.99),
                ms(&paced.fanout, 0.99),
            ));
        }
    }
    println!("{}", last.trim_end());
    Ok(())
}

/// One phase on a fresh registry (in memory, or on `etcd` under a fresh prefix):
/// registrations as fast as [`REGISTRARS`] callers go, or `paced` a second.
async fn phase(scale: Scale, paced: Option<u32>, etcd: Option<&Etcd>) -> anyhow::Result<Phase> {
    let rss_before = resident_bytes()?;
    let etcd_before = etcd.map(Etcd::resident_bytes).transpose()?;
    let mut config = RegistryConfig {
        health_probe: false,
        // Leases outlive the run: nothing expires while it measures.
        default_lease_ttl: Duration::from_secs(300),
        ..RegistryConfig::default()
    };
    if let Some(etcd) = etcd {
        config.backend = reach_registry::config::Backend::Etcd;
        config.etcd.endpoints = vec![etcd.url.clone()];
        config.etcd.prefix = format!("/reach/bench/{}/", uuid::Uuid::new_v4().simple());
    }
    let backend = Backend::start(config, None)
        .await
        .context("starting the registry")?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server =
        GrpcServer::new().add_service(RegistryGrpc::with_backend(backend.clone()).into_server());
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
    let etcd_bytes_per_instance = match (etcd, etcd_before) {
        (Some(etcd), Some(before)) => {
            Some(etcd.resident_bytes()?.saturating_sub(before) / scale.instances as u64)
        }
        _ => None,
    };
    shutdown.cancel();
    let _ = serving.await;
    backend.close().await;

    Ok(Phase {
        registered_in,
        register,
        routable,
        fanout,
        snapshot_bytes,
        snapshot_took,
        bytes_per_instance: per_instance,
        etcd_bytes_per_instance,
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
    statm_resident("/proc/self/statm")
}

/// The resident set size in bytes a `statm` file gives (field 2, in pages).
fn statm_resident(path: &str) -> anyhow::Result<u64> {
    let statm = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("{path} has no resident field"))?;
    Ok(pages * 4096)
}
