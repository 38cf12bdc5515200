//! `reach-bench router`: the router's cost, measured side by side in one run.
//!
//! One process hosts a registry, a router, two agents and the load generator (tonic
//! clients); `nats-server` runs as a child process with an in-process async-nats responder.
//! The broker comparison keeps both ends identical and changes only the path between them:
//! every client is a bare one (a generated tonic client, a bare [`MuxLink`], an async-nats
//! client) and every responder does the same work ([`echo_reply`]: take the decoded
//! `ReachMessage`, answer with a reply envelope). For each payload size and concurrency it
//! drives closed-loop request-reply for a fixed time:
//! - `direct`:     `AgentService.Handle` (unary) on the echo agent's own port;
//! - `direct-mux`: `AgentService.HandleMux`, calls multiplexed on one stream to the echo agent;
//! - `router`:     `RouterService.Call` (unary, as a generated client or grpcurl calls it),
//!   routed by capability to the same echo agent (the router → agent hop is multiplexed);
//! - `router-mux`: `RouterService.CallMux` then `HandleMux`: the same echo agent, calls
//!   multiplexed on both hops;
//! - `nats`:       NATS request-reply through nats-server to a responder doing [`echo_reply`];
//! - `sdk`:        the whole Reach stack, not part of the comparison: the SDK's `MeshClient`
//!   (a span and `traceparent` per call) through the router to an SDK `AgentRuntime` agent (a
//!   span, a dedupe slot and in-flight accounting per message).
//!
//! It prints throughput, p50/p99 latency (HDR histograms), CPU time per request (user +
//! system time of this process, plus nats-server's for NATS, read from `/proc` — the same
//! counters `getrusage` reports), the ratios router/direct and router/NATS, and a
//! bidirectional stream's message rate through the router vs direct. The last line is
//! `router_overhead_p50_us=<n> router_vs_direct_rps=<ratio> router_vs_nats_rps=<ratio>` at
//! concurrency 64 with 4 KiB payloads for the multiplexed path (`router-mux` against
//! `direct-mux` and `nats`), for tracking from run to run. The bidirectional stream goes to
//! the SDK agent.

use std::future::Future;
use std::io::Write as _;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::Stream;
use futures::StreamExt;
use hdrhistogram::Histogram;
use prost::Message as _;
use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallMuxResponse, CallRequest, Capability, HandleMuxRequest, HandleMuxResponse, HandleRequest,
    HandleResponse, HandleStreamRequest, HandleStreamResponse, Header, InstanceSpec, Part, Payload,
    ReachMessage, StreamRequest, header, part,
};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_router::{Router, RouterConfig};
use reach_rpc::GrpcServer;
use reach_rpc::mux::{MuxLink, MuxReply, OutgoingCall};
use reach_rpc::trace::{self, TraceId};
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext, MeshClient};

use crate::mtls::BenchPki;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The capability the echo agent serves (the broker comparison).
const CAPABILITY: &str = "bench.echo";
/// The capability the SDK agent serves (the `sdk` mode and the stream rate).
const SDK_CAPABILITY: &str = "bench.sdk-echo";
/// The NATS subject of the bench responder.
const SUBJECT: &str = "bench.echo";

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The reduced matrix (under a minute): concurrency 1 and 64 at 4 KiB, short cells.
    pub quick: bool,
    /// Skip NATS (when nats-server is not installed).
    pub no_nats: bool,
    /// Measure only these modes (empty: all).
    pub only: Vec<String>,
    /// Measure only these payload sizes, bytes (empty: the matrix's).
    pub payloads: Vec<usize>,
    /// Measure only these concurrencies (empty: the matrix's).
    pub concurrencies: Vec<usize>,
    /// Also run every mode but NATS on a second mesh whose every hop is mutual TLS (SPIFFE
    /// certificates, the router's policy checks on), and print the two side by side.
    pub mtls: bool,
}

/// The modes, in the order they run.
pub const MODES: [&str; 6] = [
    "direct",
    "direct-mux",
    "router-mux",
    "router",
    "nats",
    "sdk",
];

/// One measured cell.
#[derive(Debug, Clone)]
pub struct Cell {
    /// One of [`MODES`].
    pub mode: &'static str,
    /// Payload bytes.
    pub payload: usize,
    /// Closed-loop workers.
    pub concurrency: usize,
    /// Requests completed per second.
    pub rps: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th percentile latency, µs.
    pub p99_us: f64,
    /// CPU time per request, µs (this process, plus nats-server for NATS).
    pub cpu_us: f64,
    /// Failed requests.
    pub errors: u64,
}

/// Runs the benchmark and prints its report to stdout.
///
/// # Errors
/// When the in-process mesh or nats-server cannot start, or stdout cannot be written.
pub async fn run(options: &BenchOptions) -> anyhow::Result<()> {
    // A signal ends the run here, so that nats-server (a child process) is stopped on the way
    // out rather than left behind.
    tokio::select! {
        result = run_until_done(options) => result,
        () = reach_sdk::signal::terminate() => bail!("interrupted; nats-server was stopped"),
    }
}

async fn run_until_done(options: &BenchOptions) -> anyhow::Result<()> {
    if let Some(unknown) = options.only.iter().find(|m| !MODES.contains(&m.as_str())) {
        bail!(
            "unknown bench mode {unknown:?}; the modes are {}",
            MODES.join(", ")
        );
    }
    let wanted = |mode: &str| options.only.is_empty() || options.only.iter().any(|m| m == mode);
    if options.no_nats && !options.only.is_empty() && options.only.iter().all(|m| m == "nats") {
        bail!("--only nats with --no-nats leaves nothing to measure; drop one of them");
    }
    // The Prometheus recorder, as `reach router` and `reach dev` install it: without it every
    // metric update would be a no-op and the router would be measured without its metrics.
    reach_telemetry::metrics::install().context("installing the metrics recorder")?;
    let mesh = Mesh::start(None).await?;
    let nats = if options.no_nats || !wanted("nats") {
        None
    } else {
        Some(Nats::start().await?)
    };
    let (payloads, concurrencies, warmup, duration): (&[usize], &[usize], _, _) = if options.quick {
        (
            &[4096],
            &[1, 64],
            Duration::from_millis(300),
            Duration::from_millis(1500),
        )
    } else {
        (
            &[128, 4096, 65536],
            &[1, 16, 64],
            Duration::from_millis(500),
            Duration::from_secs(2),
        )
    };
    let mut stdout = std::io::stdout();
    writeln!(
        stdout,
        "reach-bench router: {} cores, {} tokio worker threads (TOKIO_WORKER_THREADS), {} per cell after {} warm-up; client, router and agent share this process; REACH_LOG={} (a filter that shows the router's per-call span in log lines costs it throughput)",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        tokio::runtime::Handle::current().metrics().num_workers(),
        humantime::format_duration(duration),
        humantime::format_duration(warmup),
        std::env::var("REACH_LOG")
            .unwrap_or_else(|_| format!("{} (default)", reach_telemetry::DEFAULT_LOG_FILTER)),
    )?;
    let payloads = if options.payloads.is_empty() {
        payloads
    } else {
        &options.payloads
    };
    let concurrencies = if options.concurrencies.is_empty() {
        concurrencies
    } else {
        &options.concurrencies
    };
    let cells = if options.mtls {
        // Plaintext and mTLS cell by cell, alternating, so that whatever else the machine
        // does meanwhile weighs on both sides alike.
        let pki = BenchPki::new()?;
        let secured = Mesh::start(Some(&pki)).await?;
        let (mut plain, mut tls) = (Vec::new(), Vec::new());
        for &payload in payloads {
            for &concurrency in concurrencies {
                let shape = ([payload], [concurrency]);
                plain.extend(
                    measure_all(
                        &mesh,
                        nats.as_ref(),
                        &wanted,
                        &shape.0,
                        &shape.1,
                        (warmup, duration),
                    )
                    .await,
                );
                tls.extend(
                    measure_all(
                        &secured,
                        None,
                        &|mode: &str| wanted(mode) && mode != "nats",
                        &shape.0,
                        &shape.1,
                        (warmup, duration),
                    )
                    .await,
                );
            }
        }
        secured.stop().await;
        write!(stdout, "{}", render_mtls(&plain, &tls))?;
        plain
    } else {
        measure_all(
            &mesh,
            nats.as_ref(),
            &wanted,
            payloads,
            concurrencies,
            (warmup, duration),
        )
        .await
    };
    // The stream comparison runs with the full set of modes only.
    let streams = if options.only.is_empty() {
        (
            stream_rate(&mesh, false, warmup, duration).await?,
            stream_rate(&mesh, true, warmup, duration).await?,
        )
    } else {
        (0.0, 0.0)
    };
    write!(stdout, "{}", render(&cells, streams))?;
    let find = |mode: &str| {
        cells
            .iter()
            .find(|c| c.mode == mode && c.payload == 4096 && c.concurrency == 64)
    };
    let (direct, router) = (find("direct-mux"), find("router-mux"));
    let nats_cell = find("nats");
    let tracking = match (direct, router) {
        (Some(direct), Some(router)) => Some(format!(
            "router_overhead_p50_us={:.0} router_vs_direct_rps={:.2} router_vs_nats_rps={}",
            router.p50_us - direct.p50_us,
            router.rps / direct.rps,
            nats_cell.map_or("n/a".to_string(), |n| format!("{:.2}", router.rps / n.rps)),
        )),
        _ => None,
    };
    drop(nats);
    mesh.stop().await;
    // Last, after the mesh's shutdown logs.
    match tracking {
        Some(line) => writeln!(stdout, "{line}")?,
        None => writeln!(
            stdout,
            "(no tracking line: it needs the direct-mux and router-mux modes at 4 KiB, c=64)"
        )?,
    }
    Ok(())
}

/// One call over a multiplexed link (to the echo agent or the router), checked by [`echoed`].
async fn mux_echo<R: MuxReply>(
    link: &MuxLink<R>,
    message: ReachMessage,
    payload: usize,
) -> Result<(), String> {
    let reply = link
        .call(OutgoingCall {
            message,
            ..OutgoingCall::default()
        })
        .await
        .map_err(|e| tonic::Status::from(e).to_string())?;
    let reply = reach_rpc::mux::outcome_of(reply.into_frame()).map_err(|s| s.to_string())?;
    echoed(Some(reply), payload)
}

/// Whether `reply` carries the echoed payload of `size` bytes: a reply that does not counts
/// as a failed request, so the `errors` column also catches wrong answers.
fn echoed(reply: Option<ReachMessage>, size: usize) -> Result<(), String> {
    let echoed = reply
        .and_then(|m| m.payload)
        .and_then(|p| p.parts.into_iter().next())
        .and_then(|part| match part.content {
            Some(part::Content::Raw(raw)) => Some(raw.len()),
            _ => None,
        });
    match echoed {
        Some(len) if len == size => Ok(()),
        other => Err(format!(
            "the reply does not echo the {size}-byte payload (got {other:?})"
        )),
    }
}

fn message(payload: &Payload) -> ReachMessage {
    ReachMessage {
        header: Some(Header {
            message_id: trace::new_message_id(),
            trace_id: TraceId::random().to_string(),
            source: "bench.client".into(),
            target: Some(header::Target::Capability(CAPABILITY.into())),
            protocol_version: "1.0".into(),
            ..Header::default()
        }),
        payload: Some(payload.clone()),
    }
}

fn payload_of(size: usize) -> Payload {
    Payload {
        r#type: "bench.blob".into(),
        parts: vec![Part {
            content: Some(part::Content::Raw(vec![0xab; size].into())),
            media_type: "application/octet-stream".into(),
            filename: String::new(),
        }],
    }
}

/// CPU ticks (user + system) of a process, from `/proc/<pid>/stat`.
fn cpu_ticks(pid: Option<u32>) -> u64 {
    let path = pid.map_or("/proc/self/stat".to_string(), |p| format!("/proc/{p}/stat"));
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// Linux reports CPU time in clock ticks of 10 ms (USER_HZ = 100).
const TICK_US: f64 = 10_000.0;

/// What one cell measures: payload size, closed-loop workers, warm-up and recorded time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) payload: usize,
    pub(crate) concurrency: usize,
    pub(crate) warmup: Duration,
    pub(crate) duration: Duration,
}

/// Drives `call` from `shape.concurrency` closed-loop workers for `shape.duration` after the
/// warm-up, and reports the cell (HDR latency histograms, throughput, CPU per request).
pub(crate) async fn measure<F, Fut>(
    mode: &'static str,
    shape: Shape,
    extra_pid: Option<u32>,
    call: F,
) -> Cell
where
    F: Fn(ReachMessage) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let Shape {
        payload,
        concurrency,
        warmup,
        duration,
    } = shape;
    let body = payload_of(payload);
    let recording = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let call = call.clone();
            let body = body.clone();
            let recording = recording.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut histogram =
                    Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
                let mut errors = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let m = message(&body);
                    let started = Instant::now();
                    let result = call(m).await;
                    if recording.load(Ordering::Relaxed) {
                        match result {
                            Ok(()) => {
                                let ns =
                                    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                                let _ = histogram.record(ns.max(1));
                            }
                            Err(_) => errors += 1,
                        }
                    }
                }
                (histogram, errors)
            })
        })
        .collect();
    tokio::time::sleep(warmup).await;
    let cpu_before = cpu_ticks(None) + extra_pid.map_or(0, |p| cpu_ticks(Some(p)));
    let started = Instant::now();
    recording.store(true, Ordering::Relaxed);
    tokio::time::sleep(duration).await;
    recording.store(false, Ordering::Relaxed);
    let elapsed = started.elapsed();
    let cpu_after = cpu_ticks(None) + extra_pid.map_or(0, |p| cpu_ticks(Some(p)));
    stop.store(true, Ordering::Relaxed);
    let mut total = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let mut errors = 0;
    for worker in workers {
        if let Ok((histogram, e)) = worker.await {
            let _ = total.add(histogram);
            errors += e;
        }
    }
    let count = total.len().max(1);
    let cell = Cell {
        mode,
        payload,
        concurrency,
        rps: total.len() as f64 / elapsed.as_secs_f64(),
        p50_us: total.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: total.value_at_quantile(0.99) as f64 / 1000.0,
        cpu_us: cpu_after.saturating_sub(cpu_before) as f64 * TICK_US / count as f64,
        errors,
    };
    eprintln!(
        "  {mode:<10} {payload:>6} B  c={concurrency:<3} {:>9.0} req/s  p50 {:>8.1} µs  p99 {:>8.1} µs",
        cell.rps, cell.p50_us, cell.p99_us
    );
    cell
}

/// Messages per second echoed on one bidirectional stream (128 B payloads).
async fn stream_rate(
    mesh: &Mesh,
    through_router: bool,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<f64> {
    let body = payload_of(128);
    let sdk_message = move || {
        let mut m = message(&body);
        if let Some(header) = m.header.as_mut() {
            header.target = Some(header::Target::Capability(SDK_CAPABILITY.into()));
        }
        m
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<ReachMessage>(256);
    let stop = CancellationToken::new();
    let feeder = {
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    sent = tx.send(sdk_message()) => if sent.is_err() { return },
                }
            }
        })
    };
    let inbound = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut replies: futures::stream::BoxStream<'static, Result<(), tonic::Status>> =
        if through_router {
            let mut client = mesh.router.clone();
            let outbound = inbound.map(|m| StreamRequest { message: Some(m) });
            client
                .stream(outbound)
                .await?
                .into_inner()
                .map(|r| r.map(|_| ()))
                .boxed()
        } else {
            let mut client = mesh.sdk_direct.clone();
            let outbound = inbound.map(|m| HandleStreamRequest { message: Some(m) });
            client
                .handle_stream(outbound)
                .await?
                .into_inner()
                .map(|r| r.map(|_| ()))
                .boxed()
        };
    let warm_until = Instant::now() + warmup;
    while Instant::now() < warm_until {
        if replies.next().await.is_none() {
            bail!("the stream ended during warm-up");
        }
    }
    let started = Instant::now();
    let until = started + duration;
    let mut count = 0u64;
    while Instant::now() < until {
        match replies.next().await {
            Some(Ok(())) => count += 1,
            Some(Err(status)) => bail!("stream failed: {status}"),
            None => break,
        }
    }
    let rate = count as f64 / started.elapsed().as_secs_f64();
    stop.cancel();
    drop(replies);
    let _ = feeder.await;
    eprintln!(
        "  stream {:<6} {rate:>9.0} msg/s",
        if through_router { "router" } else { "direct" }
    );
    Ok(rate)
}

fn render(cells: &[Cell], (stream_direct, stream_router): (f64, f64)) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mut table = comfy_table::Table::new();
    table.set_header(vec![
        "payload",
        "conc",
        "mode",
        "req/s",
        "p50 µs",
        "p99 µs",
        "cpu µs/req",
        "errors",
    ]);
    for cell in cells {
        table.add_row(vec![
            size_label(cell.payload),
            cell.concurrency.to_string(),
            cell.mode.to_string(),
            format!("{:.0}", cell.rps),
            format!("{:.1}", cell.p50_us),
            format!("{:.1}", cell.p99_us),
            format!("{:.1}", cell.cpu_us),
            cell.errors.to_string(),
        ]);
    }
    let _ = writeln!(out, "{table}");
    let mut ratios = comfy_table::Table::new();
    ratios.set_header(vec![
        "payload",
        "conc",
        "path",
        "router − direct p50 µs",
        "router/direct req/s",
        "router/nats req/s",
    ]);
    let mut keys: Vec<(usize, usize)> = cells.iter().map(|c| (c.payload, c.concurrency)).collect();
    keys.dedup();
    for (payload, concurrency) in keys {
        let get = |mode: &str| {
            cells
                .iter()
                .find(|c| c.mode == mode && c.payload == payload && c.concurrency == concurrency)
        };
        for (path, direct, router) in [
            ("unary", "direct", "router"),
            ("mux", "direct-mux", "router-mux"),
        ] {
            let (Some(direct), Some(router)) = (get(direct), get(router)) else {
                continue;
            };
            ratios.add_row(vec![
                size_label(payload),
                concurrency.to_string(),
                path.to_string(),
                format!("{:+.1}", router.p50_us - direct.p50_us),
                format!("{:.2}", router.rps / direct.rps),
                get("nats").map_or("n/a".into(), |n| format!("{:.2}", router.rps / n.rps)),
            ]);
        }
    }
    if ratios.row_count() > 0 {
        let _ = writeln!(out, "{ratios}");
    } else {
        let _ = writeln!(
            out,
            "(no ratios: they compare router with direct, or router-mux with direct-mux)"
        );
    }
    if stream_direct > 0.0 {
        let _ = writeln!(
            out,
            "bidi stream, 128 B messages: direct {stream_direct:.0} msg/s, router {stream_router:.0} msg/s, router/direct {:.2}",
            stream_router / stream_direct
        );
    } else {
        let _ = writeln!(out, "bidi stream: not measured (--only)");
    }
    out
}

fn size_label(bytes: usize) -> String {
    if bytes >= 1024 {
        format!("{} KiB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// Registry, router, echo agent and SDK agent, in-process, with a client for each mode.
struct Mesh {
    /// The echo agent's unary `Handle`.
    direct: AgentServiceClient<tonic::transport::Channel>,
    /// The echo agent's `HandleMux`.
    direct_mux: Arc<MuxLink<HandleMuxResponse>>,
    router: RouterServiceClient<tonic::transport::Channel>,
    router_mux: Arc<MuxLink<CallMuxResponse>>,
    /// The SDK client, for the `sdk` mode.
    client: MeshClient,
    /// The SDK agent, for the direct stream.
    sdk_direct: AgentServiceClient<tonic::transport::Channel>,
    /// Renews the echo agent's lease.
    echo_lease: tokio::task::JoinHandle<()>,
    /// The router's registry watch, stopped before the registry.
    watch: tokio::task::JoinHandle<()>,
    stop: CancellationToken,
    agent: reach_sdk::runtime::RunningAgent,
}

impl Mesh {
    /// Starts the mesh: plaintext, or with `pki` every server serving mutual TLS with its own
    /// certificate and every client presenting one.
    async fn start(pki: Option<&BenchPki>) -> anyhow::Result<Self> {
        let trust = |identity: &str| match pki {
            Some(pki) => pki.trust(identity),
            None => Ok(reach_trust::Trust::disabled()),
        };
        let client_trust = trust("agent/bench.client")?;
        let stop = CancellationToken::new();
        let registry = Registry::new(RegistryConfig {
            health_probe: false,
            ..RegistryConfig::default()
        })
        .map_err(anyhow::Error::msg)?;
        tokio::spawn(registry.clone().run_sweeper());
        let registry_listener = TcpListener::bind("127.0.0.1:0").await?;
        let registry_url = format!("http://{}", registry_listener.local_addr()?);
        let token = stop.clone();
        let closing = registry.clone();
        tokio::spawn(
            GrpcServer::new()
                .with_trust(trust("registry")?)
                .add_service(RegistryGrpc::new(registry.clone()).into_server())
                .with_grace(Duration::from_millis(100))
                .serve(registry_listener, async move {
                    token.cancelled().await;
                    closing.close_watches();
                }),
        );

        let router_listener = TcpListener::bind("127.0.0.1:0").await?;
        let router_url = format!("http://{}", router_listener.local_addr()?);
        let router_trust = trust("router")?;
        let router = Router::with_trust(
            RouterConfig {
                registry_endpoint: registry_url.clone(),
                ..RouterConfig::default()
            },
            router_trust.clone(),
        )
        .map_err(anyhow::Error::msg)?;
        let watch = router.spawn_registry_watch();
        let token = stop.clone();
        tokio::spawn(
            GrpcServer::new()
                .with_trust(router_trust)
                .add_service(router.clone().into_server())
                .with_grace(Duration::from_millis(100))
                .serve(router_listener, async move { token.cancelled().await }),
        );

        // The echo agent: a bare AgentService, registered with a renewed lease.
        let echo_listener = TcpListener::bind("127.0.0.1:0").await?;
        let echo_url = format!("http://{}", echo_listener.local_addr()?);
        let echo_closing = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(
            GrpcServer::new()
                .with_trust(trust("agent/bench.echo")?)
                .add_service(
                    AgentServiceServer::new(EchoAgent {
                        closing: echo_closing.clone(),
                    })
                    .max_decoding_message_size(MAX_FRAME_BYTES)
                    .max_encoding_message_size(MAX_FRAME_BYTES),
                )
                .with_grace(Duration::from_millis(100))
                .serve(echo_listener, async move {
                    token.cancelled().await;
                    echo_closing.cancel();
                }),
        );
        let echo_lease = hold_lease(
            registry,
            InstanceSpec {
                service: "bench.echo".into(),
                instance_id: "bench-echo-1".into(),
                endpoint: echo_url.clone(),
                capabilities: vec![Capability {
                    name: CAPABILITY.into(),
                    version: "1.0.0".into(),
                    ..Default::default()
                }],
                max_concurrency: 4096,
                ..InstanceSpec::default()
            },
        )?;

        let agent_listener = TcpListener::bind("127.0.0.1:0").await?;
        let mut config = AgentConfig::new("bench.sdk-echo", registry_url)
            .with_instance_id("bench-sdk-echo-1")
            .with_max_concurrency(4096)
            .with_max_drain(Duration::from_millis(200));
        config.max_message_bytes = MAX_MESSAGE_BYTES;
        if let Some(pki) = pki {
            config = config
                .with_trust_domain(BenchPki::TRUST_DOMAIN)
                .with_tls(pki.tls("agent/bench.sdk-echo")?);
        }
        let (agent, agent_url) =
            AgentRuntime::new(config)
                .handle(
                    SDK_CAPABILITY,
                    "1.0.0",
                    |_ctx: HandlerContext, m: ReachMessage| async move {
                        Ok(m.payload.unwrap_or_default())
                    },
                )
                .handle_stream(
                    SDK_CAPABILITY,
                    "1.0.0",
                    |_ctx: HandlerContext,
                     first: ReachMessage,
                     rest: reach_sdk::handler::InboundMessages| {
                        futures::stream::once(async move { Ok(first) })
                            .chain(rest)
                            .map(|m| m.map(|m| m.payload.unwrap_or_default()))
                    },
                )
                .start(agent_listener)
                .await?;
        tokio::time::timeout(Duration::from_secs(10), async {
            while router.table().instances().len() < 2 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .context("the bench agents did not become routable within 10 s")?;
        let connect = |url: String| {
            let client_trust = client_trust.clone();
            async move {
                reach_rpc::http2::channel(
                    &reach_rpc::http2::endpoint(url)?,
                    client_trust.tls(),
                    None,
                )
                .await
            }
        };
        let echo_channel = connect(echo_url).await?;
        let direct = AgentServiceClient::new(echo_channel.clone())
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        let direct_mux = Arc::new(MuxLink::to_agent(
            "the echo agent",
            echo_channel,
            MAX_MESSAGE_BYTES,
        ));
        let sdk_direct = AgentServiceClient::new(connect(agent_url).await?)
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        let router_channel = connect(router_url).await?;
        let client = MeshClient::new(router_channel.clone(), "bench.client");
        let router_mux = Arc::new(MuxLink::to_router(
            "the router",
            router_channel.clone(),
            MAX_MESSAGE_BYTES,
        ));
        let router = RouterServiceClient::new(router_channel)
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        Ok(Self {
            direct,
            direct_mux,
            router,
            router_mux,
            client,
            sdk_direct,
            echo_lease,
            watch,
            stop,
            agent,
        })
    }

    async fn stop(self) {
        let _ = self.agent.drain().await;
        self.echo_lease.abort();
        self.watch.abort();
        self.stop.cancel();
    }
}

/// The largest bench message, bytes (the SDK agent's limit; the router's default is larger
/// than the largest payload).
const MAX_MESSAGE_BYTES: usize = 16 << 20;
/// The largest frame the bench's clients and echo agent accept, bytes.
const MAX_FRAME_BYTES: usize = MAX_MESSAGE_BYTES + reach_rpc::mux::FRAME_OVERHEAD_BYTES;

/// Registers `spec` with `registry` and renews its lease every 5 s until aborted.
///
/// # Errors
/// When the registry refuses the registration.
fn hold_lease(
    registry: Registry,
    spec: InstanceSpec,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let instance_id = spec.instance_id.clone();
    let lease = registry
        .register(spec, Some(Duration::from_secs(30)))
        .map_err(|e| anyhow::anyhow!("cannot register the echo agent: {e}"))?;
    Ok(tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        loop {
            every.tick().await;
            let _ = registry.heartbeat(
                &instance_id,
                &lease.lease_id,
                reach_proto::v1::InstanceState::Ready,
                0,
            );
        }
    }))
}

/// What every responder of the broker comparison does with a request: answer with a reply
/// envelope (new message id, the request's id as correlation id, its trace id, a timestamp)
/// carrying the request's payload.
fn echo_reply(request: ReachMessage) -> ReachMessage {
    let header = request.header.unwrap_or_default();
    ReachMessage {
        header: Some(Header {
            message_id: trace::new_message_id(),
            correlation_id: header.message_id,
            trace_id: header.trace_id,
            created_at: Some(reach_rpc::time::now()),
            ..Header::default()
        }),
        payload: request.payload,
    }
}

/// The broker comparison's agent: `AgentService` with nothing but [`echo_reply`] — no spans,
/// no dedupe, no accounting — so that it does what the NATS responder does.
struct EchoAgent {
    /// Cancelled at shutdown: open `HandleMux` streams end with the closing status.
    closing: CancellationToken,
}

type BoxedReplies<T> = std::pin::Pin<Box<dyn Stream<Item = Result<T, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for EchoAgent {
    async fn handle(
        &self,
        request: tonic::Request<HandleRequest>,
    ) -> Result<tonic::Response<HandleResponse>, tonic::Status> {
        let message = request.into_inner().message.unwrap_or_default();
        Ok(tonic::Response::new(HandleResponse {
            message: Some(echo_reply(message)),
        }))
    }

    type HandleStreamStream = BoxedReplies<HandleStreamResponse>;

    async fn handle_stream(
        &self,
        _request: tonic::Request<tonic::Streaming<HandleStreamRequest>>,
    ) -> Result<tonic::Response<Self::HandleStreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "the echo agent serves request-reply only; streams go to the SDK agent",
        ))
    }

    type HandleMuxStream = BoxedReplies<HandleMuxResponse>;

    async fn handle_mux(
        &self,
        request: tonic::Request<tonic::Streaming<HandleMuxRequest>>,
    ) -> Result<tonic::Response<Self::HandleMuxStream>, tonic::Status> {
        let inbound = request
            .into_inner()
            .map(|item| item.map(|request| request.frame.unwrap_or_default()));
        let outcomes = reach_rpc::mux::serve(
            inbound,
            |call: reach_rpc::mux::IncomingCall| async move { Ok(echo_reply(call.message)) },
            4096,
            self.closing.clone(),
        );
        Ok(tonic::Response::new(Box::pin(outcomes.map(|item| {
            item.map(|(call_id, outcome)| HandleMuxResponse {
                frame: Some(reach_rpc::mux::reply_frame(call_id, outcome)),
            })
        }))))
    }
}

/// nats-server as a child process plus an in-process responder.
struct Nats {
    _child: KillOnDrop,
    pid: u32,
    client: async_nats::Client,
    _responder: tokio::task::JoinHandle<()>,
}

impl Nats {
    async fn start() -> anyhow::Result<Self> {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
            probe.local_addr()?.port()
        };
        let child = std::process::Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start nats-server (apt-get install nats-server, or pass --no-nats)")?;
        let pid = child.id();
        let child = KillOnDrop(child);
        let url = format!("nats://127.0.0.1:{port}");
        let mut attempt = 0;
        let client = loop {
            match async_nats::connect(&url).await {
                Ok(client) => break client,
                Err(_) if attempt < 100 => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => bail!("nats-server did not accept connections at {url}: {e}"),
            }
        };
        let responder_client = async_nats::connect(&url).await?;
        let mut subscription = responder_client.subscribe(SUBJECT).await?;
        responder_client.flush().await?;
        let responder = tokio::spawn(async move {
            while let Some(request) = subscription.next().await {
                let Some(reply_to) = request.reply else {
                    continue;
                };
                let client = responder_client.clone();
                // The echo agent's work: decode the envelope, answer with a reply envelope.
                let reply = ReachMessage::decode(request.payload)
                    .map(echo_reply)
                    .unwrap_or_default();
                let _ = client.publish(reply_to, reply.encode_to_vec().into()).await;
            }
        });
        Ok(Self {
            _child: child,
            pid,
            client,
            _responder: responder,
        })
    }
}

/// Stops the child process (nats-server) when dropped, also on an early error return.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
/// Measures every wanted mode on `mesh` (and `nats`) for each payload and concurrency.
async fn measure_all(
    mesh: &Mesh,
    nats: Option<&Nats>,
    wanted: &dyn Fn(&str) -> bool,
    payloads: &[usize],
    concurrencies: &[usize],
    (warmup, duration): (Duration, Duration),
) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &payload in payloads {
        for &concurrency in concurrencies {
            let shape = Shape {
                payload,
                concurrency,
                warmup,
                duration,
            };
            if wanted("direct") {
                let direct = mesh.direct.clone();
                cells.push(
                    measure("direct", shape, None, move |m| {
                        let mut client = direct.clone();
                        async move {
                            let reply = client
                                .handle(HandleRequest { message: Some(m) })
                                .await
                                .map_err(|s| s.to_string())?;
                            echoed(reply.into_inner().message, payload)
                        }
                    })
                    .await,
                );
            }
            if wanted("direct-mux") {
                let link = mesh.direct_mux.clone();
                cells.push(
                    measure("direct-mux", shape, None, move |m| {
                        let link = link.clone();
                        async move { mux_echo(&link, m, payload).await }
                    })
                    .await,
                );
            }
            if wanted("router-mux") {
                let link = mesh.router_mux.clone();
                cells.push(
                    measure("router-mux", shape, None, move |m| {
                        let link = link.clone();
                        async move { mux_echo(&link, m, payload).await }
                    })
                    .await,
                );
            }
            if wanted("router") {
                let router = mesh.router.clone();
                cells.push(
                    measure("router", shape, None, move |m| {
                        let mut client = router.clone();
                        async move {
                            let reply = client
                                .call(CallRequest { message: Some(m) })
                                .await
                                .map_err(|s| s.to_string())?;
                            echoed(reply.into_inner().message, payload)
                        }
                    })
                    .await,
                );
            }
            if let Some(nats) = nats {
                let client = nats.client.clone();
                cells.push(
                    measure("nats", shape, Some(nats.pid), move |m| {
                        let client = client.clone();
                        async move {
                            let reply = client
                                .request(SUBJECT, m.encode_to_vec().into())
                                .await
                                .map_err(|e| e.to_string())?;
                            let reply =
                                ReachMessage::decode(reply.payload).map_err(|e| e.to_string())?;
                            echoed(Some(reply), payload)
                        }
                    })
                    .await,
                );
            }
            if wanted("sdk") {
                let client = mesh.client.clone();
                cells.push(
                    measure("sdk", shape, None, move |mut m| {
                        let client = client.clone();
                        if let Some(header) = m.header.as_mut() {
                            header.target = Some(header::Target::Capability(SDK_CAPABILITY.into()));
                        }
                        async move {
                            let reply = client.send(m, None).await.map_err(|s| s.to_string())?;
                            echoed(reply.message, payload)
                        }
                    })
                    .await,
                );
            }
        }
    }
    cells
}

/// The mTLS cells next to the plaintext ones of the same mode, payload and concurrency, with
/// the ratios mTLS / plaintext of throughput, p50 latency and CPU per request.
fn render_mtls(plaintext: &[Cell], mtls: &[Cell]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "\nmutual TLS vs plaintext (every hop TLS 1.3 with client certificates, ECDSA P-256; callers authenticated by certificate, no policy file)\n",
    );
    let _ = writeln!(
        out,
        "{:<11} {:>8} {:>4} | {:>10} {:>10} {:>6} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6}",
        "mode",
        "payload",
        "c",
        "rps plain",
        "rps mtls",
        "ratio",
        "p50 pl",
        "p50 mtls",
        "ratio",
        "cpu pl",
        "cpu mtls",
        "ratio"
    );
    for secured in mtls {
        let Some(plain) = plaintext.iter().find(|c| {
            c.mode == secured.mode
                && c.payload == secured.payload
                && c.concurrency == secured.concurrency
        }) else {
            continue;
        };
        let _ = writeln!(
            out,
            "{:<11} {:>8} {:>4} | {:>10.0} {:>10.0} {:>6.2} | {:>6.0}µs {:>6.0}µs {:>6.2} | {:>6.1}µs {:>6.1}µs {:>6.2}{}",
            secured.mode,
            secured.payload,
            secured.concurrency,
            plain.rps,
            secured.rps,
            secured.rps / plain.rps,
            plain.p50_us,
            secured.p50_us,
            secured.p50_us / plain.p50_us,
            plain.cpu_us,
            secured.cpu_us,
            secured.cpu_us / plain.cpu_us,
            if secured.errors > 0 {
                format!("  ({} errors)", secured.errors)
            } else {
                String::new()
            },
        );
    }
    out
}
