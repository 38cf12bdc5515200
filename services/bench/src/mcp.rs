//! `reach-bench mcp`: a tool call through the MCP edge next to the same call through the
//! router, side by side in one run.
//!
//! One process hosts a registry, a router, an SDK agent serving capability `bench.tool`
//! (input schema: an object with a string `text`; the handler answers its data part), the
//! MCP edge on its own HTTP port, and the load generator. Closed-loop workers call it for a
//! fixed time:
//! - `router`: `RouterService.Call` (unary) with the arguments as the data part — the call
//!   the edge makes;
//! - `mcp`:    `tools/call` over Streamable HTTP (stateless JSON-RPC POSTs on kept-alive
//!   HTTP/1.1 connections, as an MCP client sends them), which the edge checks against the
//!   schema and sends as that router call.
//!
//! It prints throughput and p50/p99 latency for each at c=1 and c=16, and the ratios
//! mcp/router. The last line is `mcp_overhead_p50_us=<n> mcp_vs_router_rps=<ratio>` at c=16.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{CallRequest, Payload, ReachMessage};
use reach_registry::{Registry, RegistryConfig, RegistryGrpc};
use reach_router::{Router, RouterConfig};
use reach_rpc::GrpcServer;
use reach_sdk::{AgentConfig, AgentRuntime, CallOptions, DescribedCapability, HandlerContext};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::router::{Cell, Shape, measure};

/// The capability (and tool) measured.
const TOOL: &str = "bench.tool";
/// The tool's arguments, on both paths.
const TEXT: &str = "a complaint about a late fee charged although autopay was set up";

/// Runs the benchmark and prints its report to stdout.
///
/// # Errors
/// When the in-process mesh cannot start, or stdout cannot be written.
pub async fn run(quick: bool) -> anyhow::Result<()> {
    reach_telemetry::metrics::install().context("installing the metrics recorder")?;
    let (warmup, duration) = if quick {
        (Duration::from_millis(300), Duration::from_millis(1500))
    } else {
        (Duration::from_millis(500), Duration::from_secs(3))
    };
    let stop = CancellationToken::new();
    let mesh = start(&stop).await?;
    let mut stdout = std::io::stdout();
    writeln!(
        stdout,
        "reach-bench mcp: {} cores, {} per cell after {} warm-up; client, edge, router and agent share this process",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        humantime::format_duration(duration),
        humantime::format_duration(warmup),
    )?;
    let mut cells = Vec::new();
    for concurrency in [1, 16] {
        let shape = Shape {
            payload: TEXT.len(),
            concurrency,
            warmup,
            duration,
        };
        let router = mesh.router.clone();
        let mesh_client = mesh.envelopes.clone();
        cells.push(
            measure("router", shape, None, move |_: ReachMessage| {
                let mut router = router.clone();
                let message = mesh_client.message_to_capability(
                    TOOL,
                    Payload::json(TOOL, &json!({ "text": TEXT })),
                    &CallOptions::default(),
                );
                async move {
                    let reply = router
                        .call(CallRequest {
                            message: Some(message),
                        })
                        .await
                        .map_err(|s| s.to_string())?;
                    let text = reply
                        .into_inner()
                        .message
                        .and_then(|m| m.payload)
                        .and_then(|p| p.parts.into_iter().next())
                        .and_then(|p| p.as_json())
                        .and_then(|v| v["text"].as_str().map(str::to_string));
                    (text.as_deref() == Some(TEXT))
                        .then_some(())
                        .ok_or_else(|| "unexpected reply".to_string())
                }
            })
            .await,
        );
        let (http, url) = (mesh.http.clone(), mesh.mcp_url.clone());
        cells.push(
            measure("mcp", shape, None, move |_: ReachMessage| {
                let request = http.post(&url).json(&tools_call());
                async move { checked(request).await }
            })
            .await,
        );
    }
    write!(stdout, "{}", render(&cells))?;
    let at = |mode: &str| cells.iter().find(|c| c.mode == mode && c.concurrency == 16);
    let tracking = match (at("router"), at("mcp")) {
        (Some(router), Some(mcp)) => format!(
            "mcp_overhead_p50_us={:.0} mcp_vs_router_rps={:.2}",
            mcp.p50_us - router.p50_us,
            mcp.rps / router.rps
        ),
        _ => "(no tracking line)".to_string(),
    };
    let _ = mesh.agent.drain().await;
    stop.cancel();
    writeln!(stdout, "{tracking}")?;
    Ok(())
}

/// A stateless `tools/call` request of [`TOOL`] (2026-07-28: protocol metadata in `_meta`).
fn tools_call() -> serde_json::Value {
    json!({
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": TOOL,
            "arguments": { "text": TEXT },
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": "2026-07-28",
                "io.modelcontextprotocol/clientCapabilities": {},
            },
        },
    })
}

/// Sends `request` and checks that the tool answered the arguments as structured content.
async fn checked(request: reqwest::RequestBuilder) -> Result<(), String> {
    let response = request.send().await.map_err(|e| e.to_string())?;
    let body: serde_json::Value = response.json().await.map_err(|e| e.to_string())?;
    (body["result"]["structuredContent"]["text"] == TEXT)
        .then_some(())
        .ok_or_else(|| format!("unexpected answer: {body}"))
}

fn render(cells: &[Cell]) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header([
        "concurrency",
        "router req/s",
        "mcp req/s",
        "mcp/router req/s",
        "router p50 µs",
        "mcp p50 µs",
        "router p99 µs",
        "mcp p99 µs",
    ]);
    for concurrency in [1, 16] {
        let find = |mode: &str| {
            cells
                .iter()
                .find(|c| c.mode == mode && c.concurrency == concurrency)
        };
        if let (Some(router), Some(mcp)) = (find("router"), find("mcp")) {
            table.add_row([
                concurrency.to_string(),
                format!("{:.0}", router.rps),
                format!("{:.0}", mcp.rps),
                format!("{:.2}", mcp.rps / router.rps),
                format!("{:.0}", router.p50_us),
                format!("{:.0}", mcp.p50_us),
                format!("{:.0}", router.p99_us),
                format!("{:.0}", mcp.p99_us),
            ]);
        }
    }
    let errors: u64 = cells.iter().map(|c| c.errors).sum();
    format!("{table}\nerrors: {errors}\n")
}

/// The in-process mesh and the clients of both paths.
struct Mesh {
    router: RouterServiceClient<tonic::transport::Channel>,
    /// Builds the router path's envelopes (as the edge builds them).
    envelopes: Arc<reach_sdk::MeshClient>,
    http: reqwest::Client,
    mcp_url: String,
    agent: reach_sdk::runtime::RunningAgent,
}

async fn start(stop: &CancellationToken) -> anyhow::Result<Mesh> {
    let registry = Registry::new(RegistryConfig {
        health_probe: false,
        ..RegistryConfig::default()
    })
    .map_err(anyhow::Error::msg)?;
    tokio::spawn(registry.clone().run_sweeper());
    let registry_listener = TcpListener::bind("127.0.0.1:0").await?;
    let registry_url = format!("http://{}", registry_listener.local_addr()?);
    let token = stop.clone();
    tokio::spawn(
        GrpcServer::new()
            .add_service(RegistryGrpc::new(registry.clone()).into_server())
            .with_grace(Duration::from_millis(100))
            .serve(registry_listener, async move { token.cancelled().await }),
    );
    let router_listener = TcpListener::bind("127.0.0.1:0").await?;
    let router_url = format!("http://{}", router_listener.local_addr()?);
    let router = Router::new(RouterConfig {
        registry_endpoint: registry_url.clone(),
        ..RouterConfig::default()
    })
    .map_err(anyhow::Error::msg)?;
    router.spawn_registry_watch();
    let token = stop.clone();
    tokio::spawn(
        GrpcServer::new()
            .add_service(router.clone().into_server())
            .with_grace(Duration::from_millis(100))
            .serve(router_listener, async move { token.cancelled().await }),
    );
    let mut capability = DescribedCapability::new(TOOL, "1.0.0");
    capability.description = "answers its arguments".into();
    capability.input_schema = Some(json!({
        "type": "object",
        "required": ["text"],
        "properties": { "text": { "type": "string" } },
    }));
    let (agent, _) = AgentRuntime::new(
        AgentConfig::new("bench.tool", registry_url.clone())
            .with_instance_id("bench-tool-1")
            .with_max_concurrency(4096)
            .with_max_drain(Duration::from_millis(200)),
    )
    .handle_described(
        capability,
        |_ctx: HandlerContext, m: ReachMessage| async move { Ok(m.payload.unwrap_or_default()) },
    )
    .start(TcpListener::bind("127.0.0.1:0").await?)
    .await?;
    tokio::time::timeout(Duration::from_secs(10), async {
        while router.table().instances().is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .context("the bench agent did not become routable within 10 s")?;

    let connect = |url: String| async move {
        reach_rpc::http2::channel(&reach_rpc::http2::endpoint(url)?, None, None).await
    };
    let router_channel = connect(router_url).await?;
    let edge = reach_edge::mcp::McpEdge::new(
        reach_edge::mcp::McpConfig::default(),
        reach_edge::mcp::McpLimits {
            call_timeout: Duration::from_secs(30),
            max_message_bytes: 4 << 20,
        },
        reach_edge::mcp::McpChannels {
            registry: connect(registry_url).await?,
            router: router_channel.clone(),
            as_caller: None,
        },
        reach_trust::Trust::disabled(),
    );
    let edge_listener = TcpListener::bind("127.0.0.1:0").await?;
    let base_url = format!("http://{}", edge_listener.local_addr()?);
    let published = reach_edge::mcp::http::Published {
        base_url,
        authorization_servers: Vec::new(),
    };
    let mcp_url = published.resource();
    let guard = reach_edge::guard::HttpGuard::new(&[], &[], &published.base_url);
    let token = stop.clone();
    tokio::spawn(reach_rpc::server::serve_http_with_client_certificates(
        edge_listener,
        reach_edge::mcp::http::routes(edge, published, &guard),
        async move { token.cancelled().await },
        Duration::from_millis(100),
        reach_rpc::limits::ConnectionLimits::default(),
        reach_rpc::limits::MessageLimits::default(),
        reach_trust::Trust::disabled(),
        reach_rpc::server::ClientCertificates::Optional,
    ));
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in [
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2026-07-28"),
        ("mcp-method", "tools/call"),
        ("mcp-name", TOOL),
    ] {
        headers.insert(name, reqwest::header::HeaderValue::from_static(value));
    }
    headers.insert(
        reqwest::header::CONTENT_TYPE,
        reqwest::header::HeaderValue::from_static("application/json"),
    );
    let http = reqwest::Client::builder()
        .default_headers(headers)
        .pool_max_idle_per_host(64)
        .build()?;
    // The first call proves both paths before anything is measured.
    checked(http.post(&mcp_url).json(&tools_call()))
        .await
        .map_err(anyhow::Error::msg)
        .context("the MCP edge did not answer a tools/call")?;
    Ok(Mesh {
        router: RouterServiceClient::new(router_channel.clone()),
        envelopes: Arc::new(reach_sdk::MeshClient::new(router_channel, "bench.client")),
        http,
        mcp_url,
        agent,
    })
}
