//! `reach-bench router`: the router's cost, measured side by side in one run.
//!
//! One process hosts a registry, a router, two agents and the load generator (tonic
//! clients); `nats-server`, nginx and HAProxy run as child processes ([`ChildProcess`]), with
//! an in-process async-nats responder for NATS. The comparison keeps both ends identical and
//! changes only the path between them: every client is a bare one (a generated tonic client,
//! a bare [`MuxLink`], an async-nats client) and every responder does the same work
//! ([`echo_reply`]: take the decoded `ReachMessage`, answer with a reply envelope). For each
//! payload size and concurrency it drives closed-loop request-reply for a fixed time:
//! - `direct`:     `AgentService.Handle` (unary) on the echo agent's own port;
//! - `direct-mux`: `AgentService.HandleMux`, calls multiplexed on one stream to the echo agent;
//! - `router`:     `RouterService.Call` (unary, as a generated client or grpcurl calls it),
//!   routed by capability to the same echo agent (the router → agent hop is multiplexed);
//! - `router-mux`: `RouterService.CallMux` then `HandleMux`: the same echo agent, calls
//!   multiplexed on both hops;
//! - `nginx`:      `AgentService.Handle` (unary, the `direct` client) through nginx
//!   (`grpc_pass`, h2c on both sides, upstream keepalive) to the same echo agent;
//! - `haproxy`:    the same through HAProxy (`mode http`, `proto h2` on both sides);
//! - `nats`:       NATS request-reply through nats-server to a responder doing [`echo_reply`];
//! - `sdk`:        the whole Reach stack, not part of the comparison: the SDK's `MeshClient`
//!   (a span and `traceparent` per call) through the router to an SDK `AgentRuntime` agent (a
//!   span, a dedupe slot and in-flight accounting per message).
//!
//! It prints throughput, p50/p99 latency (HDR histograms), CPU time per request (user +
//! system time of this process, plus the child's for `nats`, `nginx` and `haproxy`, read from
//! `/proc` — the same counters `getrusage` reports), the ratios router/direct, router/NATS,
//! router/nginx and router/HAProxy, one line per payload comparing the unary hop of the
//! router with nginx's and HAProxy's (p50 over `direct` at c=1, req/s at c=8 and c=64), and a
//! bidirectional stream's message rate through the router vs direct. The last line is
//! `router_overhead_p50_us=<n> router_vs_direct_rps=<ratio> router_vs_nats_rps=<ratio>
//! router_vs_nginx_rps=<ratio> router_vs_haproxy_rps=<ratio>` at concurrency 64 with 4 KiB
//! payloads: the first three for the multiplexed path (`router-mux` against `direct-mux` and
//! `nats`), the proxies' for the unary one (`router` against `nginx` and `haproxy`, both
//! unary), `n/a` when a mode was skipped; for tracking from run to run. The bidirectional
//! stream goes to the SDK agent.

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
    /// The reduced matrix (under a minute): concurrency 1, 8 and 64 at 4 KiB, short cells.
    pub quick: bool,
    /// Skip NATS (when nats-server is not installed).
    pub no_nats: bool,
    /// Skip the `nginx` and `haproxy` modes (when nginx-light or haproxy is not installed).
    pub no_proxies: bool,
    /// Measure only these modes (empty: all).
    pub only: Vec<String>,
    /// Measure only these payload sizes, bytes (empty: the matrix's).
    pub payloads: Vec<usize>,
    /// Measure only these concurrencies (empty: the matrix's).
    pub concurrencies: Vec<usize>,
    /// Also run every mode but NATS on a second mesh whose every hop is mutual TLS (SPIFFE
    /// certificates, the router's policy checks on), and print the two side by side.
    pub mtls: bool,
    /// On the mutual-TLS mesh, the echo agent does not check that its callers are routers
    /// (the check every SDK agent serving TLS makes, [`reach_sdk::DirectCallers`]): run with
    /// and without it to measure what the check costs. Default false: it checks, as agents do.
    pub no_agent_check: bool,
}

/// The modes, in the order they run.
pub const MODES: [&str; 8] = [
    "direct",
    "direct-mux",
    "router-mux",
    "router",
    "nginx",
    "haproxy",
    "nats",
    "sdk",
];

/// The modes that need a child process, with the flag that skips them.
const CHILD_MODES: [(&str, &str); 3] = [
    ("nats", "--no-nats"),
    ("nginx", "--no-proxies"),
    ("haproxy", "--no-proxies"),
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
    /// CPU time per request, µs (this process, plus the child process — nats-server, nginx,
    /// HAProxy — for the modes that go through one).
    pub cpu_us: f64,
    /// Failed requests.
    pub errors: u64,
}

/// Runs the benchmark and prints its report to stdout.
///
/// # Errors
/// When the in-process mesh or a child process (nats-server, nginx, HAProxy: the error names
/// the package to install and the flag that skips it) cannot start, or stdout cannot be
/// written.
pub async fn run(options: &BenchOptions) -> anyhow::Result<()> {
    // A signal ends the run here, so that the child processes (nats-server, nginx, HAProxy)
    // are stopped on the way out rather than left behind.
    tokio::select! {
        result = run_until_done(options) => result,
        () = reach_sdk::signal::terminate() => {
            bail!("interrupted; the child processes (nats-server, nginx, haproxy) were stopped")
        }
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
    let skipped = |flag: &str| match flag {
        "--no-nats" => options.no_nats,
        _ => options.no_proxies,
    };
    if !options.only.is_empty()
        && options.only.iter().all(|m| {
            CHILD_MODES
                .iter()
                .any(|(mode, flag)| m == mode && skipped(flag))
        })
    {
        bail!(
            "--only {} with {} leaves nothing to measure; drop one of them",
            options.only.join(","),
            if options.no_nats && options.no_proxies {
                "--no-nats --no-proxies"
            } else if options.no_nats {
                "--no-nats"
            } else {
                "--no-proxies"
            }
        );
    }
    // The Prometheus recorder, as `reach router` and `reach dev` install it: without it every
    // metric update would be a no-op and the router would be measured without its metrics.
    reach_telemetry::metrics::install().context("installing the metrics recorder")?;
    let mesh = Mesh::start(None, false).await?;
    let nats = if options.no_nats || !wanted("nats") {
        None
    } else {
        Some(Nats::start().await?)
    };
    let proxy = |kind: ProxyKind| {
        let run = !options.no_proxies && wanted(kind.mode());
        let upstream = mesh.echo_addr;
        async move {
            if run {
                Proxy::start(kind, upstream).await.map(Some)
            } else {
                Ok(None)
            }
        }
    };
    let nginx = proxy(ProxyKind::Nginx).await?;
    let haproxy = proxy(ProxyKind::Haproxy).await?;
    let peers = Peers {
        nats: nats.as_ref(),
        nginx: nginx.as_ref(),
        haproxy: haproxy.as_ref(),
    };
    let (payloads, concurrencies, warmup, duration): (&[usize], &[usize], _, _) = if options.quick {
        (
            &[4096],
            &[1, 8, 64],
            Duration::from_millis(300),
            Duration::from_millis(1500),
        )
    } else {
        (
            &[128, 4096, 65536],
            &[1, 8, 16, 64],
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
        let secured = Mesh::start(Some(&pki), !options.no_agent_check).await?;
        let (mut plain, mut tls) = (Vec::new(), Vec::new());
        for &payload in payloads {
            for &concurrency in concurrencies {
                let shape = ([payload], [concurrency]);
                plain.extend(
                    measure_all(
                        &mesh,
                        peers,
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
                        Peers::default(),
                        &|mode: &str| wanted(mode) && !CHILD_MODES.iter().any(|(m, _)| *m == mode),
                        &shape.0,
                        &shape.1,
                        (warmup, duration),
                    )
                    .await,
                );
            }
        }
        secured.stop().await;
        write!(
            stdout,
            "{}",
            render_mtls(&plain, &tls, !options.no_agent_check)
        )?;
        plain
    } else {
        measure_all(
            &mesh,
            peers,
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
    // The proxies are unary: they are compared with the unary router path.
    let versus_unary = |proxy: &str| match (find("router"), find(proxy)) {
        (Some(router), Some(proxy)) => format!("{:.2}", router.rps / proxy.rps),
        _ => "n/a".to_string(),
    };
    let tracking = match (direct, router) {
        (Some(direct), Some(router)) => Some(format!(
            "router_overhead_p50_us={:.0} router_vs_direct_rps={:.2} router_vs_nats_rps={} router_vs_nginx_rps={} router_vs_haproxy_rps={}",
            router.p50_us - direct.p50_us,
            router.rps / direct.rps,
            nats_cell.map_or("n/a".to_string(), |n| format!("{:.2}", router.rps / n.rps)),
            versus_unary("nginx"),
            versus_unary("haproxy"),
        )),
        _ => None,
    };
    drop((nats, nginx, haproxy));
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
        "nginx − direct p50 µs",
        "router/nginx req/s",
        "haproxy − direct p50 µs",
        "router/haproxy req/s",
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
            let mut row = vec![
                size_label(payload),
                concurrency.to_string(),
                path.to_string(),
                format!("{:+.1}", router.p50_us - direct.p50_us),
                format!("{:.2}", router.rps / direct.rps),
                get("nats").map_or("n/a".into(), |n| format!("{:.2}", router.rps / n.rps)),
            ];
            // The proxies are unary: compared on the unary row only.
            for proxy in ["nginx", "haproxy"] {
                match get(proxy) {
                    Some(proxy) if path == "unary" => row.extend([
                        format!("{:+.1}", proxy.p50_us - direct.p50_us),
                        format!("{:.2}", router.rps / proxy.rps),
                    ]),
                    _ => row.extend(["n/a".to_string(), "n/a".to_string()]),
                }
            }
            ratios.add_row(row);
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
    let _ = write!(out, "{}", render_proxy_goal(cells));
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

/// One line per payload comparing the unary hop of the router with nginx's and HAProxy's:
/// p50 over `direct` at c=1, req/s at c=8 and c=64, and whether the router is at least as good
/// as each proxy on all three (the goal: its c=1 p50 hop no more than either proxy's, its
/// req/s at least theirs at c=8 and c=64). Empty without a proxy's cells.
fn render_proxy_goal(cells: &[Cell]) -> String {
    use std::fmt::Write as _;
    const COMPARED: [&str; 3] = ["router", "nginx", "haproxy"];
    let mut out = String::new();
    let mut payloads: Vec<usize> = cells.iter().map(|c| c.payload).collect();
    payloads.dedup();
    for payload in payloads {
        let get = |mode: &str, concurrency: usize| {
            cells
                .iter()
                .find(|c| c.mode == mode && c.payload == payload && c.concurrency == concurrency)
        };
        if !["nginx", "haproxy"].iter().any(|proxy| {
            cells
                .iter()
                .any(|c| c.mode == *proxy && c.payload == payload)
        }) {
            continue;
        }
        let hop = |mode: &str| match (get(mode, 1), get("direct", 1)) {
            (Some(cell), Some(direct)) => Some(cell.p50_us - direct.p50_us),
            _ => None,
        };
        let rps = |mode: &str, concurrency: usize| get(mode, concurrency).map(|c| c.rps);
        let mut line = format!("unary hop vs proxies, {}:", size_label(payload));
        let list = |figure: &dyn Fn(&str) -> Option<f64>, unit: &dyn Fn(f64) -> String| {
            COMPARED
                .iter()
                .map(|mode| format!("{mode} {}", figure(mode).map_or("n/a".to_string(), unit)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = write!(
            line,
            " p50 over direct at c=1: {};",
            list(&hop, &|v| format!("{v:+.0} µs"))
        );
        for concurrency in [8, 64] {
            let _ = write!(
                line,
                " req/s at c={concurrency}: {};",
                list(&|mode| rps(mode, concurrency), &|v| format!("{v:.0}"))
            );
        }
        // The goal, per proxy: a comparison whose cells are missing is neither met nor missed.
        let mut verdicts = Vec::new();
        for proxy in ["nginx", "haproxy"] {
            let mut missed = Vec::new();
            let mut unknown = false;
            match (hop("router"), hop(proxy)) {
                (Some(router), Some(other)) if router > other => missed.push("c=1 p50".to_string()),
                (Some(_), Some(_)) => {}
                _ => unknown = true,
            }
            for concurrency in [8, 64] {
                match (rps("router", concurrency), rps(proxy, concurrency)) {
                    (Some(router), Some(other)) if router < other => {
                        missed.push(format!("c={concurrency} req/s"));
                    }
                    (Some(_), Some(_)) => {}
                    _ => unknown = true,
                }
            }
            verdicts.push(if !missed.is_empty() {
                format!("vs {proxy} not met ({})", missed.join(", "))
            } else if unknown {
                format!("vs {proxy} not measured in full")
            } else {
                format!("vs {proxy} met")
            });
        }
        let _ = writeln!(out, "{line} goal: {}", verdicts.join("; "));
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
    /// The echo agent's plaintext listener, the upstream of the `nginx` and `haproxy` modes.
    echo_addr: std::net::SocketAddr,
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
    /// certificate and every client presenting one. The clients that call agents directly
    /// (the `direct` modes, the direct stream) stand in for the router and present its
    /// identity, which agents serving TLS require; with `agent_check` the echo agent checks it
    /// (as SDK agents do), without it the echo agent answers any certificate of the CA.
    async fn start(pki: Option<&BenchPki>, agent_check: bool) -> anyhow::Result<Self> {
        let trust = |identity: &str| match pki {
            Some(pki) => pki.trust(identity),
            None => Ok(reach_trust::Trust::disabled()),
        };
        let client_trust = trust("agent/bench.client")?;
        let direct_trust = trust("router")?;
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
        let echo_addr = echo_listener.local_addr()?;
        let echo_url = format!("http://{echo_addr}");
        let echo_closing = CancellationToken::new();
        let token = stop.clone();
        let mut echo_server = GrpcServer::new().with_trust(trust("agent/bench.echo")?);
        if pki.is_some() && agent_check {
            echo_server = echo_server.with_admission(
                reach_sdk::DirectCallers::defaults(BenchPki::TRUST_DOMAIN)?.admission(),
            );
        }
        tokio::spawn(
            echo_server
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
        let connect = |url: String, trust: &Arc<reach_trust::Trust>| {
            let trust = trust.clone();
            async move {
                reach_rpc::http2::channel(&reach_rpc::http2::endpoint(url)?, trust.tls(), None)
                    .await
            }
        };
        let echo_channel = connect(echo_url, &direct_trust).await?;
        let direct = AgentServiceClient::new(echo_channel.clone())
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        let direct_mux = Arc::new(MuxLink::to_agent(
            "the echo agent",
            echo_channel,
            MAX_MESSAGE_BYTES,
        ));
        let sdk_direct = AgentServiceClient::new(connect(agent_url, &direct_trust).await?)
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        let router_channel = connect(router_url, &client_trust).await?;
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
            echo_addr,
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

// === impl Nats ===

/// nats-server as a child process plus an in-process responder.
struct Nats {
    /// nats-server, killed when this is dropped.
    process: ChildProcess,
    client: async_nats::Client,
    _responder: tokio::task::JoinHandle<()>,
}

impl Nats {
    async fn start() -> anyhow::Result<Self> {
        let dir = scratch_dir("nats")?;
        let port = free_port()?;
        let mut command = std::process::Command::new(find_program("nats-server"));
        command.args(["-a", "127.0.0.1", "-p", &port.to_string()]);
        let mut process = ChildProcess::spawn(
            "nats-server",
            "apt-get install nats-server",
            "--no-nats",
            command,
            dir,
            &[],
        )?;
        process.wait_for_port(port).await?;
        let url = format!("nats://127.0.0.1:{port}");
        let client = async_nats::connect(&url)
            .await
            .with_context(|| format!("cannot connect to nats-server at {url}"))?;
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
            process,
            client,
            _responder: responder,
        })
    }
}

// === impl Proxy ===

/// The gRPC reverse proxies the unary router hop is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProxyKind {
    /// nginx (Debian `nginx-light`): `grpc_pass` with an upstream keepalive pool.
    Nginx,
    /// HAProxy (Debian `haproxy`): `mode http`, HTTP/2 on both sides.
    Haproxy,
}

impl ProxyKind {
    /// The bench mode measured through this proxy.
    fn mode(self) -> &'static str {
        match self {
            Self::Nginx => "nginx",
            Self::Haproxy => "haproxy",
        }
    }

    /// How to install it, for the error when its binary is missing.
    fn install(self) -> &'static str {
        match self {
            Self::Nginx => "DEBIAN_FRONTEND=noninteractive apt-get install -y nginx-light",
            Self::Haproxy => "DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy",
        }
    }
}

/// A gRPC reverse proxy (nginx or HAProxy) in front of the echo agent, as a child process,
/// with the bare tonic client of the `direct` mode pointed at it.
struct Proxy {
    kind: ProxyKind,
    /// The proxy: one process holding all of its work (nginx with `master_process off`,
    /// HAProxy with `-db`), so that its `/proc/<pid>/stat` counts all of its CPU time.
    process: ChildProcess,
    /// `AgentService` through the proxy, built as `direct`'s client is.
    client: AgentServiceClient<tonic::transport::Channel>,
}

impl Proxy {
    /// Starts `kind` on a free 127.0.0.1 port, forwarding to the echo agent at `upstream`,
    /// and connects a client once the port accepts connections.
    ///
    /// # Errors
    /// When the binary is missing (the error names the package), the proxy exits or does not
    /// listen within 10 s (the error carries its log), or the client cannot connect.
    async fn start(kind: ProxyKind, upstream: std::net::SocketAddr) -> anyhow::Result<Self> {
        let dir = scratch_dir(kind.mode())?;
        let port = free_port()?;
        let (command, logs) = match kind {
            ProxyKind::Nginx => {
                let conf = dir.path().join("nginx.conf");
                let error_log = dir.path().join("error.log");
                std::fs::write(
                    &conf,
                    nginx_config(dir.path(), port, upstream, running_as_root()),
                )
                .with_context(|| format!("cannot write {}", conf.display()))?;
                let mut command = std::process::Command::new(find_program("nginx"));
                // `-e`: the log nginx writes before it has read the configuration (the
                // package's default is not writable without root).
                command
                    .arg("-p")
                    .arg(dir.path())
                    .arg("-c")
                    .arg(&conf)
                    .arg("-e")
                    .arg(&error_log)
                    .args(["-g", "daemon off;"]);
                (command, vec![error_log])
            }
            ProxyKind::Haproxy => {
                let conf = dir.path().join("haproxy.cfg");
                std::fs::write(&conf, haproxy_config(port, upstream))
                    .with_context(|| format!("cannot write {}", conf.display()))?;
                let mut command = std::process::Command::new(find_program("haproxy"));
                // `-db`: foreground, no master process: one process, `nbthread` threads.
                command.arg("-db").arg("-f").arg(&conf);
                (command, Vec::new())
            }
        };
        let mut process = ChildProcess::spawn(
            kind.mode(),
            kind.install(),
            "--no-proxies",
            command,
            dir,
            &logs,
        )?;
        process.wait_for_port(port).await?;
        let channel = reach_rpc::http2::channel(
            &reach_rpc::http2::endpoint(format!("http://127.0.0.1:{port}"))?,
            None,
            None,
        )
        .await
        .with_context(|| format!("cannot connect to {} on 127.0.0.1:{port}", kind.mode()))?;
        let client = AgentServiceClient::new(channel)
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES);
        Ok(Self {
            kind,
            process,
            client,
        })
    }
}

/// nginx's configuration: an h2c (prior knowledge) listener on 127.0.0.1:`port` passing every
/// call to `upstream` with `grpc_pass` over a keepalive pool; every path inside `dir`.
fn nginx_config(
    dir: &std::path::Path,
    port: u16,
    upstream: std::net::SocketAddr,
    as_root: bool,
) -> String {
    let dir = dir.display();
    // As root the `user` directive (default `nobody`) would own the temp paths; keep them
    // the bench's. Without root nginx cannot switch users, and the directive only warns.
    let user = if as_root { "user root;\n" } else { "" };
    format!(
        r#"# Generated by reach-bench router for the `nginx` mode.
# One process, one event loop: the client opens one HTTP/2 connection (as in every mode), and
# nginx serves a connection's streams on the worker that accepted it, so a second worker would
# sit idle while the two cores are shared with the load generator and the echo agent (as the
# router shares them). `master_process off` keeps that worker in the one process the bench
# starts, kills and reads the CPU time of.
master_process off;
worker_processes 1;
{user}pid "{dir}/nginx.pid";
error_log "{dir}/error.log" warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    client_body_temp_path "{dir}/client_body";
    proxy_temp_path "{dir}/proxy";
    fastcgi_temp_path "{dir}/fastcgi";
    uwsgi_temp_path "{dir}/uwsgi";
    scgi_temp_path "{dir}/scgi";
    client_max_body_size 0;
    # The bench's one client connection stays open for the whole run (the default closes it
    # after 1000 requests).
    keepalive_requests 1000000000;
    keepalive_timeout 600s;
    http2_max_concurrent_streams 1024;
    upstream echo {{
        server {upstream};
        # nginx sends one call per upstream connection: keep enough of them open for the
        # highest concurrency, and never close them for their request count or idleness.
        keepalive 1024;
        keepalive_requests 1000000000;
        keepalive_timeout 600s;
    }}
    server {{
        listen 127.0.0.1:{port} http2;
        location / {{
            grpc_pass grpc://echo;
        }}
    }}
}}
"#
    )
}

/// HAProxy's configuration: an h2c frontend on 127.0.0.1:`port` and one h2c server,
/// `upstream`, whose connections are shared by concurrent calls.
fn haproxy_config(port: u16, upstream: std::net::SocketAddr) -> String {
    format!(
        r#"# Generated by reach-bench router for the `haproxy` mode.
global
    # One thread, as nginx has one worker: the client's one connection is served by the
    # thread that accepted it.
    nbthread 1
    tune.h2.max-concurrent-streams 1024
defaults
    mode http
    timeout connect 5s
    timeout client 600s
    timeout server 600s
frontend grpc
    bind 127.0.0.1:{port} proto h2
    default_backend echo
backend echo
    http-reuse always
    server echo {upstream} proto h2
"#
    )
}

// === impl ChildProcess ===

/// A child process of the bench (nats-server, nginx, HAProxy) with its scratch directory
/// (configuration, logs, pid and temp files). Dropping it — also on an early error return or
/// a signal — kills the process, reaps it and removes the directory.
pub(crate) struct ChildProcess {
    child: std::process::Child,
    /// For errors: what the process is.
    name: &'static str,
    /// The logs quoted when it fails to start: its stderr, plus any it writes itself.
    logs: Vec<std::path::PathBuf>,
    /// Removed after the process is killed (fields drop after [`Drop::drop`]).
    _dir: tempfile::TempDir,
}

impl ChildProcess {
    /// Spawns `command` with stdout discarded and stderr into `dir`'s `stderr.log`.
    ///
    /// # Errors
    /// When the binary is not installed (the error says `install` and `skip`, the flag that
    /// skips its modes) or cannot be started.
    pub(crate) fn spawn(
        name: &'static str,
        install: &str,
        skip: &str,
        mut command: std::process::Command,
        dir: tempfile::TempDir,
        logs: &[std::path::PathBuf],
    ) -> anyhow::Result<Self> {
        let stderr_path = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&stderr_path)
            .with_context(|| format!("cannot create {}", stderr_path.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| {
                let program = command.get_program().to_string_lossy().into_owned();
                if e.kind() == std::io::ErrorKind::NotFound {
                    anyhow::anyhow!(
                        "{name} is not installed ({program} not found): {install}, or pass {skip}"
                    )
                } else {
                    anyhow::Error::new(e).context(format!("cannot start {name} ({program})"))
                }
            })?;
        let mut all_logs = vec![stderr_path];
        all_logs.extend_from_slice(logs);
        Ok(Self {
            child,
            name,
            logs: all_logs,
            _dir: dir,
        })
    }

    /// The process id, for its CPU time.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits, at most 10 s, until 127.0.0.1:`port` accepts connections.
    ///
    /// # Errors
    /// When the process exits first or the port is still closed after 10 s; the error quotes
    /// the process's logs.
    pub(crate) async fn wait_for_port(&mut self, port: u16) -> anyhow::Result<()> {
        const PATIENCE: Duration = Duration::from_secs(10);
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before it accepted connections on 127.0.0.1:{port}{}",
                    self.name,
                    self.log_text()
                );
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not accept connections on 127.0.0.1:{port} within {}{}",
                    self.name,
                    humantime::format_duration(PATIENCE),
                    self.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The non-empty logs, each under its path, for an error message.
    fn log_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        for path in &self.logs {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            if !text.trim().is_empty() {
                let _ = write!(out, "\n{}:\n{}", path.display(), text.trim_end());
            }
        }
        out
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh scratch directory for a child process (`reach-bench-<name>-…` in the temp dir).
pub(crate) fn scratch_dir(name: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("reach-bench-{name}-"))
        .tempdir()
        .with_context(|| format!("cannot create a scratch directory for {name}"))
}

/// A 127.0.0.1 port free a moment ago, for a child process to listen on.
pub(crate) fn free_port() -> anyhow::Result<u16> {
    let probe = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(probe.local_addr()?.port())
}

/// `name` on `PATH`, else in the sbin directories a non-root `PATH` leaves out (Debian
/// installs nginx and HAProxy in `/usr/sbin`); `name` itself when nowhere, so that spawning
/// it reports it missing.
fn find_program(name: &str) -> std::path::PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(std::path::PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| name.into())
}

/// Whether this process runs with effective user id 0 (the `Uid:` line of
/// `/proc/self/status`: real, effective, saved, filesystem).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|euid| euid == "0"))
        })
        .unwrap_or(false)
}

/// The child processes a run compares the mesh with; `None` for those not started.
#[derive(Clone, Copy, Default)]
struct Peers<'a> {
    nats: Option<&'a Nats>,
    nginx: Option<&'a Proxy>,
    haproxy: Option<&'a Proxy>,
}

/// Measures every wanted mode on `mesh` (and `peers`) for each payload and concurrency.
async fn measure_all(
    mesh: &Mesh,
    peers: Peers<'_>,
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
                cells.push(measure_handle("direct", shape, None, &mesh.direct).await);
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
            for proxy in [peers.nginx, peers.haproxy].into_iter().flatten() {
                let (mode, pid) = (proxy.kind.mode(), proxy.process.pid());
                cells.push(measure_handle(mode, shape, Some(pid), &proxy.client).await);
            }
            if let Some(nats) = peers.nats {
                let client = nats.client.clone();
                cells.push(
                    measure("nats", shape, Some(nats.process.pid()), move |m| {
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

/// Measures unary `AgentService.Handle` calls on `client` (to the echo agent, directly or
/// through a proxy whose CPU time `proxy_pid` adds to the cell's).
async fn measure_handle(
    mode: &'static str,
    shape: Shape,
    proxy_pid: Option<u32>,
    client: &AgentServiceClient<tonic::transport::Channel>,
) -> Cell {
    let client = client.clone();
    let payload = shape.payload;
    measure(mode, shape, proxy_pid, move |m| {
        let mut client = client.clone();
        async move {
            let reply = client
                .handle(HandleRequest { message: Some(m) })
                .await
                .map_err(|s| s.to_string())?;
            echoed(reply.into_inner().message, payload)
        }
    })
    .await
}

/// The mTLS cells next to the plaintext ones of the same mode, payload and concurrency, with
/// the ratios mTLS / plaintext of throughput, p50 latency and CPU per request.
fn render_mtls(plaintext: &[Cell], mtls: &[Cell], agent_check: bool) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "\nmutual TLS vs plaintext (every hop TLS 1.3 with client certificates, ECDSA P-256; callers authenticated by certificate, no policy file; agents {} their callers are routers)\n",
        if agent_check {
            "check"
        } else {
            "do not check (--no-agent-check)"
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(mode: &'static str, concurrency: usize, rps: f64, p50_us: f64) -> Cell {
        Cell {
            mode,
            payload: 4096,
            concurrency,
            rps,
            p50_us,
            p99_us: p50_us * 2.0,
            cpu_us: 10.0,
            errors: 0,
        }
    }

    #[test]
    fn nginx_config_listens_h2c_and_names_a_user_only_as_root() {
        let upstream: std::net::SocketAddr = "127.0.0.1:4321".parse().unwrap();
        let dir = std::path::Path::new("/tmp/scratch");
        let conf = nginx_config(dir, 1234, upstream, true);
        assert!(conf.contains("listen 127.0.0.1:1234 http2;"), "{conf}");
        assert!(conf.contains("server 127.0.0.1:4321;"), "{conf}");
        assert!(conf.contains("grpc_pass grpc://echo;"), "{conf}");
        assert!(conf.contains("\nuser root;\n"), "{conf}");
        assert!(conf.contains("pid \"/tmp/scratch/nginx.pid\";"), "{conf}");
        let conf = nginx_config(dir, 1234, upstream, false);
        assert!(!conf.contains("user "), "{conf}");
    }

    #[test]
    fn haproxy_config_speaks_h2_on_both_sides() {
        let upstream: std::net::SocketAddr = "127.0.0.1:4321".parse().unwrap();
        let conf = haproxy_config(1234, upstream);
        assert!(conf.contains("bind 127.0.0.1:1234 proto h2"), "{conf}");
        assert!(
            conf.contains("server echo 127.0.0.1:4321 proto h2"),
            "{conf}"
        );
        assert!(conf.contains("mode http"), "{conf}");
    }

    #[test]
    fn the_proxy_goal_line_names_what_is_missed() {
        let cells = [
            cell("direct", 1, 10_000.0, 100.0),
            cell("router", 1, 5_000.0, 200.0),
            cell("nginx", 1, 6_000.0, 150.0),
            cell("haproxy", 1, 4_000.0, 250.0),
            cell("router", 8, 9_000.0, 0.0),
            cell("nginx", 8, 8_000.0, 0.0),
            cell("haproxy", 8, 7_000.0, 0.0),
            cell("router", 64, 9_000.0, 0.0),
            cell("nginx", 64, 9_500.0, 0.0),
            cell("haproxy", 64, 7_000.0, 0.0),
        ];
        let line = render_proxy_goal(&cells);
        assert!(
            line.contains("p50 over direct at c=1: router +100 µs, nginx +50 µs, haproxy +150 µs"),
            "{line}"
        );
        assert!(
            line.contains("vs nginx not met (c=1 p50, c=64 req/s)"),
            "{line}"
        );
        assert!(line.contains("vs haproxy met"), "{line}");
        assert!(render_proxy_goal(&cells[..2]).is_empty());
    }

    #[test]
    fn a_missing_proxy_binary_names_its_package() {
        let dir = scratch_dir("missing").unwrap();
        let command = std::process::Command::new("/nonexistent/reach-bench-no-such-proxy");
        let error = ChildProcess::spawn(
            "nginx",
            ProxyKind::Nginx.install(),
            "--no-proxies",
            command,
            dir,
            &[],
        )
        .err()
        .expect("a missing binary fails to spawn")
        .to_string();
        assert!(
            error.contains("nginx-light") && error.contains("--no-proxies"),
            "{error}"
        );
    }
}
