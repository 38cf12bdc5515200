//! `reach`: every Reach service as a subcommand, `reach dev` all-in-one, `reach demo`, and
//! the client CLI. Argument parsing only; the work is in the `reach` library.
//!
//! Output goes to stdout through `write!`, never `print!`, whose panic on a closed stdout
//! would bypass [`main`]'s quiet exit when the reader went away (`reach task list | head -1`).
#![warn(clippy::print_stdout)]

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach::demo::{DEFAULT_INPUT, DemoOptions};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tracing::{error, info, warn};

/// mimalloc instead of the system allocator: every routed call allocates and frees message
/// buffers of a few KiB on several threads, where glibc's malloc spends much of its time
/// trimming and re-zeroing pages (measured in `docs/benchmarks.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// EX_USAGE from sysexits.h: the command was used incorrectly (bad configuration).
const EXIT_USAGE: u8 = 64;
/// Exit status after a second SIGINT/SIGTERM cut the shutdown short (128 + SIGINT, as shells
/// report an interrupted command).
const EXIT_INTERRUPTED: i32 = 130;

#[derive(Parser)]
#[command(
    name = "reach",
    version,
    about = "Reach: the agent mesh — registry, router and agents, as one binary"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The demos besides the triage.
#[derive(Subcommand)]
enum DemoJob {
    /// An LLM agent writes a Markdown report of the complaints CSV (by issue, company and
    /// state, with the date range), reading and aggregating it through mesh tools served by
    /// another agent. Uses a scripted model unless --model-base-url is given.
    Report {
        /// The complaints CSV (CFPB export columns).
        #[arg(long, default_value = DEFAULT_INPUT)]
        input: PathBuf,
        /// Where to write the report.
        #[arg(long, default_value = "report.md")]
        output: PathBuf,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// The most model calls the agent makes (at least 1).
        #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(1..))]
        max_turns: u32,
        #[command(flatten)]
        model: ModelArgs,
    },
}

#[derive(Subcommand)]
enum Command {
    /// Run the main job: the example agents triage the CFPB complaints through an embedded mesh, then exit.
    #[command(args_conflicts_with_subcommands = true)]
    Demo {
        /// Another demo instead of the triage.
        #[command(subcommand)]
        job: Option<DemoJob>,
        /// The complaints CSV (CFPB export columns).
        #[arg(long, default_value = DEFAULT_INPUT)]
        input: PathBuf,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Complaints in flight at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Run registry, router, orchestrator and the example agents in one process until Ctrl-C.
    Dev {
        #[command(flatten)]
        service: ServiceArgs,
        /// Start without the example agents.
        #[arg(long)]
        no_agents: bool,
        /// Where the orchestrator keeps its SQLite file; tasks survive restarts of `reach dev`.
        #[arg(long, default_value = ".reach")]
        data_dir: PathBuf,
        /// A directory of flow YAML files, loaded and watched (default: examples/flows when present).
        #[arg(long)]
        flows: Option<PathBuf>,
        /// Where the edges serve HTTP (host:port): A2A JSON-RPC and agent cards, and MCP at
        /// /mcp; "" disables it (A2A over gRPC stays on --listen). Default 127.0.0.1:7072.
        #[arg(long)]
        edge_listen: Option<String>,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Run the orchestrator alone.
    Orchestrator {
        #[command(flatten)]
        service: ServiceArgs,
        /// The task store: sqlite://PATH or postgres://USER@HOST:PORT/DB.
        #[arg(long)]
        store: Option<String>,
        /// The router task nodes call.
        #[arg(long)]
        router: Option<String>,
        /// A directory of flow YAML files, loaded and watched.
        #[arg(long)]
        flows: Option<PathBuf>,
    },
    /// Validate, apply and list flows.
    Flow {
        /// The orchestrator (or `reach dev`) endpoint.
        #[arg(long, global = true, default_value = reach::cli::DEFAULT_ENDPOINT, value_parser = grpc_endpoint)]
        endpoint: String,
        #[command(flatten)]
        args: reach::cli::FlowArgs,
    },
    /// Start, inspect, resume, cancel and retry tasks.
    Task {
        /// The orchestrator (or `reach dev`) endpoint.
        #[arg(long, global = true, default_value = reach::cli::DEFAULT_ENDPOINT, value_parser = grpc_endpoint)]
        endpoint: String,
        #[command(flatten)]
        args: reach::cli::TaskArgs,
    },
    /// Print every message and node event of a task in time order.
    Dump {
        /// The orchestrator (or `reach dev`) endpoint.
        #[arg(long, default_value = reach::cli::DEFAULT_ENDPOINT, value_parser = grpc_endpoint)]
        endpoint: String,
        #[command(flatten)]
        args: reach::cli::DumpArgs,
    },
    /// Run the registry alone.
    Registry {
        #[command(flatten)]
        service: ServiceArgs,
    },
    /// Run the router alone.
    Router {
        #[command(flatten)]
        service: ServiceArgs,
        /// The registry to watch (also REACH_ROUTER__REGISTRY_ENDPOINT).
        #[arg(long)]
        registry: Option<String>,
        /// The largest message accepted, in bytes.
        #[arg(long)]
        max_message_bytes: Option<usize>,
    },
    /// Run the edges alone: lf.a2a.v1.A2AService on --listen; A2A JSON-RPC, agent cards and
    /// MCP (/mcp) on --edge-listen; a mapping onto a registry, router and orchestrator elsewhere.
    Edge {
        #[command(flatten)]
        service: ServiceArgs,
        /// Where A2A JSON-RPC, the agent cards and MCP (/mcp) are served over HTTP
        /// (host:port). Default 127.0.0.1:7072.
        #[arg(long)]
        edge_listen: Option<String>,
        /// The registry the cards come from (also REACH_EDGE__REGISTRY_ENDPOINT).
        #[arg(long)]
        registry: Option<String>,
        /// The router capability calls go through (also REACH_EDGE__ROUTER_ENDPOINT).
        #[arg(long)]
        router: Option<String>,
        /// The orchestrator flows run on (also REACH_EDGE__ORCHESTRATOR_ENDPOINT).
        #[arg(long)]
        orchestrator: Option<String>,
    },
    /// Serve the web console (inbox, tasks, flows, mesh) against any orchestrator and
    /// registry until Ctrl-C; `reach dev` serves it on its admin port already.
    Console {
        /// Where the console listens (host:port). A non-loopback address needs --insecure:
        /// the console serves plain HTTP.
        #[arg(long, default_value = "127.0.0.1:7073")]
        listen: String,
        /// The orchestrator (inbox, tasks, flows, dead letters); "" leaves those pages out.
        #[arg(long, default_value = reach::cli::DEFAULT_ENDPOINT)]
        orchestrator: String,
        /// The registry (mesh page); "" leaves it out.
        #[arg(long, default_value = reach::cli::DEFAULT_ENDPOINT)]
        registry: String,
        /// Host names the console may be addressed by besides loopback (repeatable).
        #[arg(long = "allowed-host")]
        allowed_hosts: Vec<String>,
        /// A URL template for trace ids on task pages, `{trace_id}` replaced.
        #[arg(long, default_value = "")]
        trace_url: String,
        /// How often pages refresh, in milliseconds (0: never).
        #[arg(long, default_value_t = reach_console::DEFAULT_REFRESH_MS)]
        refresh_ms: u64,
        /// Require a login with a bearer token (for a mesh with trust on), forwarded on every
        /// call so the services' policy judges the person.
        #[arg(long)]
        login: bool,
        /// Allow a non-loopback --listen (see --listen).
        #[arg(long)]
        insecure: bool,
    },
    /// A live terminal board: instances, traffic per capability, tasks, failures (q quits).
    Top {
        /// The registry (or `reach dev`) gRPC endpoint.
        #[arg(long, default_value = "http://127.0.0.1:7070", value_parser = grpc_endpoint)]
        endpoint: String,
        /// The admin host:port serving /metrics; default: the gRPC port + 1.
        #[arg(long)]
        admin: Option<String>,
        /// Print one frame as text and exit.
        #[arg(long)]
        once: bool,
    },
    /// Run the example agents (coordinator, two executors per category, ingest) against a
    /// running registry and router until Ctrl-C, then drain them.
    ExampleAgents {
        /// The registry the agents register with.
        #[arg(long, default_value = "http://127.0.0.1:7070", value_parser = grpc_endpoint)]
        registry: String,
        /// The router the agents call other agents through; default: the registry's endpoint
        /// (`reach dev` serves both on one port).
        #[arg(long, value_parser = grpc_endpoint)]
        router: Option<String>,
        /// The address the agents listen on, each on an ephemeral port: 0.0.0.0 in a
        /// container (with --advertise-host).
        #[arg(long, default_value = "127.0.0.1")]
        listen_host: std::net::IpAddr,
        /// The host the agents register for routers to dial (a pod IP); default: the listen
        /// address, which must then not be a wildcard.
        #[arg(long, default_value = "")]
        advertise_host: String,
        /// The lease TTL each agent asks the registry for (`10s`, `1m`); heartbeats go every
        /// third of the TTL granted.
        #[arg(long, default_value = "10s", value_parser = lease_ttl)]
        lease_ttl: std::time::Duration,
        /// A directory of the agents' certificates, as `reach certs init` writes them
        /// (`agent-<service>.pem`, `agent-<service>-key.pem` for each agent's service, and
        /// `ca.pem`): every agent then serves and calls over mutual TLS with its own (the helm
        /// chart mounts them there). Unset: plaintext.
        #[arg(long, env = "REACH_TLS_DIR")]
        tls_dir: Option<PathBuf>,
        /// The trust domain of those certificates.
        #[arg(long, env = "REACH_TRUST_DOMAIN", default_value = reach_trust::DEFAULT_TRUST_DOMAIN)]
        trust_domain: String,
        #[command(flatten)]
        model: ModelArgs,
    },
    /// List the capabilities the mesh knows: versions, instances, descriptions, schemas.
    Capabilities {
        /// The registry (or `reach dev`) endpoint.
        #[arg(long, alias = "registry", default_value = "http://127.0.0.1:7070", value_parser = grpc_endpoint)]
        endpoint: String,
        /// Only capabilities whose name starts with this (for example `complaint.`).
        #[arg(long, default_value = "")]
        prefix: String,
        /// Print JSON (schemas included).
        #[arg(long)]
        json: bool,
        /// Print each capability's input and output schemas under its row.
        #[arg(long)]
        schemas: bool,
    },
    /// Call a capability through the router and print the reply as JSON (a gRPC client of
    /// the mesh in one command, like `grpcurl` but addressed by capability).
    Call {
        /// The capability to call, e.g. `complaint.classify`.
        capability: String,
        /// Send one data part holding this JSON value (usually an object).
        #[arg(long, value_parser = json_value)]
        json: Option<serde_json::Value>,
        /// Send one text part.
        #[arg(long)]
        text: Option<String>,
        /// The payload's message type; default: the capability name (as flows send it).
        #[arg(long = "type")]
        message_type: Option<String>,
        /// A semver requirement on the capability's version, e.g. `^1`.
        #[arg(long)]
        version: Option<String>,
        /// The trace to continue (32 lowercase hex digits); default: a new trace.
        #[arg(long)]
        trace_id: Option<String>,
        /// The call's deadline in milliseconds.
        #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
        timeout_ms: u64,
        /// The router (or `reach dev`) endpoint.
        #[arg(long, alias = "router", default_value = "http://127.0.0.1:7070", value_parser = grpc_endpoint)]
        endpoint: String,
    },
    /// Make the mesh's certificates and token key (a development CA), or issue one more.
    Certs {
        #[command(subcommand)]
        command: reach::cli::CertsCommand,
    },
    /// Sign a bearer token: a join token for an agent, or an operator's token. Prints the
    /// token alone on stdout.
    Token {
        #[command(subcommand)]
        command: reach::cli::TokenCommand,
    },
    /// MCP servers as mesh capabilities (`reach mcp attach`).
    Mcp {
        #[command(subcommand)]
        command: reach::cli::McpCommand,
        /// A TOML config file with `[[mcp.attach]]` entries (see docs/configuration.md).
        #[arg(long, global = true)]
        config: Option<PathBuf>,
    },
    /// List the registered agent instances and their state.
    Agents {
        /// The registry (or `reach dev`) endpoint.
        #[arg(long, default_value = "http://127.0.0.1:7070", value_parser = grpc_endpoint)]
        endpoint: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

impl Command {
    /// Whether the command prints a result and exits (rather than serving).
    fn is_client(&self) -> bool {
        matches!(
            self,
            Command::Demo { .. }
                | Command::Agents { .. }
                | Command::Call { .. }
                | Command::Capabilities { .. }
                | Command::Top { .. }
                | Command::Certs { .. }
                | Command::Token { .. }
        )
    }

    /// The default OpenTelemetry `service.name` (OTEL_SERVICE_NAME overrides it).
    fn service_name(&self) -> &'static str {
        match self {
            Command::Demo { .. } => "reach-demo",
            Command::Dev { .. } => "reach-dev",
            Command::Registry { .. } => "reach-registry",
            Command::Router { .. } => "reach-router",
            Command::Edge { .. } => "reach-edge",
            Command::Orchestrator { .. } => "reach-orchestrator",
            Command::ExampleAgents { .. } => "reach-example-agents",
            Command::Mcp { .. } => "reach-mcp-attach",
            Command::Console { .. } => "reach-console",
            Command::Agents { .. }
            | Command::Call { .. }
            | Command::Capabilities { .. }
            | Command::Top { .. }
            | Command::Flow { .. }
            | Command::Task { .. }
            | Command::Dump { .. }
            | Command::Certs { .. }
            | Command::Token { .. } => "reach-cli",
        }
    }
}

#[derive(Args)]
struct ServiceArgs {
    /// Where gRPC listens (host:port). Default 127.0.0.1:7070.
    #[arg(long)]
    listen: Option<String>,
    /// Where the HTTP admin port listens (host:port); "" disables it. Default 127.0.0.1:7071.
    #[arg(long)]
    admin_listen: Option<String>,
    /// A TOML config file (see docs/configuration.md); REACH_* variables and flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    dump_config: bool,
    /// Allow listening on a non-loopback address without TLS (trust.insecure): only on a
    /// network where everyone who can reach the ports may register agents, call every
    /// capability and run tasks.
    #[arg(long)]
    insecure: bool,
}

/// The coordinator's model (`[agents.model]`), for the commands that start the example agents.
#[derive(Args)]
struct ModelArgs {
    /// An OpenAI-compatible API base URL (e.g. https://api.openai.com/v1) the coordinator's
    /// classifier asks, falling back to the rules when the model fails; unset: the rules alone.
    #[arg(long)]
    model_base_url: Option<String>,
    /// The model to ask for (required with --model-base-url), e.g. gpt-4o-mini.
    #[arg(long)]
    model: Option<String>,
    /// The environment variable holding the API key (default OPENAI_API_KEY); '' sends no key
    /// (a local server that needs none).
    #[arg(long)]
    model_api_key_env: Option<String>,
}

impl ModelArgs {
    /// The `[agents]` settings the flags give (`{"model": {...}}`, empty when none).
    fn overrides(&self) -> Map<String, Value> {
        let mut model = Map::new();
        if let Some(url) = &self.model_base_url {
            model.insert("base_url".into(), json!(url));
        }
        if let Some(name) = &self.model {
            model.insert("model".into(), json!(name));
        }
        if let Some(env) = &self.model_api_key_env {
            model.insert("api_key_env".into(), json!(env));
        }
        let mut agents = Map::new();
        if !model.is_empty() {
            agents.insert("model".into(), Value::Object(model));
        }
        agents
    }

    /// The `[agents]` section from `REACH_AGENTS__*` and these flags (for the commands that
    /// read no config file).
    fn load(&self) -> Result<reach_agents::model_config::AgentsConfig, String> {
        reach::config::load_agents(Value::Object(self.overrides())).map_err(|e| e.to_string())
    }
}

/// The coordinator's classifier from `settings`, the key read from the process environment;
/// logs the model it uses (info) when one is configured. `Err`: the message for stderr
/// (exit 64).
fn classifier(
    settings: &reach_agents::model_config::ModelSettings,
) -> Result<reach_agents::decision::ComplaintClassifier, String> {
    let classifier = settings
        .classifier(|name| std::env::var(name).ok())
        .map_err(|e| e.to_string())?;
    if let Some(model) = classifier.model() {
        info!(model, base_url = %settings.base_url, "the coordinator classifies with a model (the rules when it fails)");
    }
    Ok(classifier)
}

impl ServiceArgs {
    fn overrides(&self) -> Map<String, Value> {
        let mut map = Map::new();
        if let Some(listen) = &self.listen {
            map.insert("listen".into(), json!(listen));
        }
        if let Some(admin) = &self.admin_listen {
            map.insert("admin_listen".into(), json!(admin));
        }
        if self.insecure {
            map.insert("trust".into(), json!({"insecure": true}));
        }
        map
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let config =
        reach_telemetry::TelemetryConfig::from_env(cli.command.service_name()).map(|mut config| {
            // The demo and the client commands print results; their logs stay quiet unless asked.
            if std::env::var_os("REACH_LOG").is_none() && cli.command.is_client() {
                config.log_filter = "warn".into();
            }
            config
        });
    let telemetry = match config
        .map_err(|e| e.to_string())
        .and_then(|config| reach_telemetry::init(&config).map_err(|e| e.to_string()))
    {
        Ok(telemetry) => telemetry,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let code = match run(cli.command).await {
        Ok(code) => code,
        // Whoever read stdout has gone (`reach task get ID | head -1`): there is no one left to
        // tell, so exit quietly and successfully, as `cat` and `grep` users expect.
        Err(error) if is_broken_pipe(&error) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", reach_rpc::errors::chain(error.as_ref()));
            ExitCode::FAILURE
        }
    };
    if let Err(error) = telemetry.shutdown().await {
        eprintln!("warning: spans not flushed: {error}");
    }
    code
}

/// One `agent  INSTANCE  ENDPOINT` line per started example agent.
fn print_fleet(fleet: &reach_agents::fleet::Fleet) -> std::io::Result<()> {
    let mut stdout = std::io::stdout();
    for member in &fleet.members {
        writeln!(
            stdout,
            "agent        {:<24} {}",
            member.agent.instance_id(),
            member.endpoint
        )?;
    }
    Ok(())
}

/// Whether `error`, or an error it wraps, is a write to a pipe whose reader has gone.
fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Checks an `--endpoint`: a URL with its scheme (`http://127.0.0.1:7070`), since a bare
/// `host:port` otherwise fails later as an unexplained transport error.
/// Parses a `--json` flag: any JSON value, with the parser's location on error.
fn json_value(value: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(value).map_err(|e| {
        format!("not JSON ({e}); quote it for the shell, e.g. --json '{{\"key\": 1}}'")
    })
}

/// A lease TTL flag: a duration such as `10s`, above zero.
fn lease_ttl(value: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(value) {
        Ok(ttl) if !ttl.is_zero() => Ok(ttl),
        Ok(_) => Err("a lease TTL must be above zero (for example 10s)".into()),
        Err(error) => Err(format!("{error}; give a duration such as 10s or 1m")),
    }
}

fn grpc_endpoint(value: &str) -> Result<String, String> {
    if value.starts_with("http://") || value.starts_with("https://") {
        Ok(value.to_string())
    } else {
        Err(format!(
            "{value:?} is not a URL; write it with its scheme, such as http://{value}"
        ))
    }
}

/// `reach console`: the console's routes on `listen`, calling `orchestrator` and `registry`
/// (either "" to leave its pages out), until SIGINT/SIGTERM.
async fn serve_console(
    listen: &str,
    orchestrator: &str,
    registry: &str,
    config: reach_console::ConsoleConfig,
    insecure: bool,
) -> anyhow::Result<ExitCode> {
    let channel = |url: &str, flag: &str| -> anyhow::Result<Option<tonic::transport::Channel>> {
        if url.is_empty() {
            return Ok(None);
        }
        grpc_endpoint(url).map_err(|e| anyhow::anyhow!("--{flag}: {e}"))?;
        let endpoint = reach_rpc::http2::endpoint(url.to_string())
            .map_err(|e| anyhow::anyhow!("--{flag} {url:?}: {e}"))?;
        Ok(Some(reach_rpc::http2::channel_lazy(&endpoint, None, None)))
    };
    let channels = reach_console::ConsoleChannels {
        orchestrator: channel(orchestrator, "orchestrator")?,
        registry: channel(registry, "registry")?,
        // A console of its own runs no router: latencies are measured by the mesh's routers.
        latency: None,
    };
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen} for the console: {e}"))?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() && !insecure {
        eprintln!(
            "error: the console would serve {addr}, beyond loopback, over plain HTTP; listen on 127.0.0.1 or pass --insecure"
        );
        return Ok(ExitCode::from(EXIT_USAGE));
    }
    if !addr.ip().is_loopback() {
        if !config.login {
            eprintln!(
                "warning: the console serves {addr} without a login: anyone who can reach it can resume, cancel and retry tasks; pass --login against a mesh with trust on"
            );
        }
        if config.allowed_hosts.is_empty() {
            eprintln!(
                "warning: browsers are answered only when they name the console by a loopback name; pass --allowed-host with the name they use to reach {addr}"
            );
        }
    }
    // The URL a browser can open: by the first allowed name when the address is not one.
    let shown = match config.allowed_hosts.first() {
        Some(host) if !addr.ip().is_loopback() => match reach_rpc::hosts::split_port(host) {
            (_, Some(_)) => host.clone(),
            (_, None) => format!("{host}:{}", addr.port()),
        },
        _ => addr.to_string(),
    };
    let routes = reach_console::Console::new(channels, config).routes();
    writeln!(
        std::io::stdout(),
        "console      http://{shown}{}/inbox",
        reach_console::BASE
    )?;
    std::io::stdout().flush()?;
    axum::serve(listener, routes)
        .with_graceful_shutdown(reach_sdk::signal::terminate())
        .await?;
    Ok(ExitCode::SUCCESS)
}

fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo {
            job:
                Some(DemoJob::Report {
                    input,
                    output,
                    json,
                    max_turns,
                    model,
                }),
            ..
        } => {
            let model = match model.load().and_then(|agents| {
                agents
                    .model
                    .resolve(|name| std::env::var(name).ok())
                    .map_err(|e| e.to_string())
            }) {
                Ok(model) => model,
                Err(message) => {
                    eprintln!("error: {message}");
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let options = reach::demo_report::ReportOptions {
                input,
                output,
                model,
                max_turns,
            };
            let run = reach::demo_report::run(&options).await?;
            let mut stdout = std::io::stdout().lock();
            if json {
                writeln!(stdout, "{}", serde_json::to_string_pretty(&run)?)?;
            } else {
                write!(stdout, "{}", reach::demo_report::render_text(&run))?;
            }
            stdout.flush()?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo {
            job: None,
            input,
            json,
            concurrency,
            model,
        } => {
            let classifier = match model.load().and_then(|agents| classifier(&agents.model)) {
                Ok(classifier) => classifier,
                Err(message) => {
                    eprintln!("error: {message}");
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let report = reach::demo::run(&DemoOptions {
                input,
                concurrency,
                classifier,
            })
            .await?;
            let mut stdout = std::io::stdout().lock();
            if json {
                writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
            } else {
                write!(stdout, "{}", reach::demo::render_text(&report))?;
            }
            stdout.flush()?;
            Ok(if report.failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Dev {
            service,
            no_agents,
            data_dir,
            flows,
            edge_listen,
            model,
        } => {
            // Owner-only (0700): the task store in it holds what flows were given.
            reach::owner_only::create_dir(&data_dir).map_err(|e| {
                anyhow::anyhow!("cannot create --data-dir {}: {e}", data_dir.display())
            })?;
            let mut overrides = service.overrides();
            let mut orchestrator = Map::new();
            orchestrator.insert(
                "store_url".into(),
                json!(format!(
                    "sqlite://{}",
                    data_dir.join("orchestrator.db").display()
                )),
            );
            let flows = flows.or_else(|| {
                let default = PathBuf::from("examples/flows");
                default.is_dir().then_some(default)
            });
            if let Some(flows) = flows {
                orchestrator.insert("flows_dir".into(), json!(flows));
                orchestrator.insert("watch_flows".into(), json!(true));
            }
            overrides.insert("orchestrator".into(), Value::Object(orchestrator));
            if let Some(edge_listen) = edge_listen {
                overrides.insert("edge_listen".into(), json!(edge_listen));
            }
            let agents = model.overrides();
            if !agents.is_empty() {
                overrides.insert("agents".into(), Value::Object(agents));
            }
            // The example fleet's protocol registry describes its capabilities
            // (`reach capabilities`), unless the file, the environment or a flag names another.
            let mut defaults = ReachConfig::default();
            // One machine, one developer: webhooks may reach receivers on loopback.
            defaults.orchestrator.webhook_allowed_networks = ["127.0.0.0/8", "::1/128"]
                .iter()
                .map(|network| network.parse().expect("loopback networks parse"))
                .collect();
            let protocols = PathBuf::from("examples/protocol-registry.yaml");
            if protocols.is_file() {
                defaults.registry.protocol_registry = Some(protocols);
            }
            serve(&service, defaults, overrides, Services::ALL, !no_agents).await
        }
        Command::Registry { service } => {
            let services = Services {
                registry: true,
                router: false,
                orchestrator: false,
                edge: false,
            };
            serve(
                &service,
                ReachConfig::default(),
                service.overrides(),
                services,
                false,
            )
            .await
        }
        Command::Orchestrator {
            service,
            store,
            router,
            flows,
        } => {
            let mut overrides = service.overrides();
            let mut orchestrator = Map::new();
            if let Some(store) = store {
                orchestrator.insert("store_url".into(), json!(store));
            }
            if let Some(router) = router {
                orchestrator.insert("router_endpoint".into(), json!(router));
            }
            if let Some(flows) = flows {
                orchestrator.insert("flows_dir".into(), json!(flows));
                orchestrator.insert("watch_flows".into(), json!(true));
            }
            if !orchestrator.is_empty() {
                overrides.insert("orchestrator".into(), Value::Object(orchestrator));
            }
            let services = Services {
                registry: false,
                router: false,
                orchestrator: true,
                edge: false,
            };
            serve(&service, ReachConfig::default(), overrides, services, false).await
        }
        Command::Flow { endpoint, args } => {
            let code = reach::cli::flow(&endpoint, args, &mut std::io::stdout()).await?;
            Ok(exit_code(code))
        }
        Command::Task { endpoint, args } => {
            let code = reach::cli::task(&endpoint, args, &mut std::io::stdout()).await?;
            Ok(exit_code(code))
        }
        Command::Dump { endpoint, args } => {
            let code = reach::cli::dump(&endpoint, args, &mut std::io::stdout()).await?;
            Ok(exit_code(code))
        }
        Command::Router {
            service,
            registry,
            max_message_bytes,
        } => {
            let mut overrides = service.overrides();
            let mut router = Map::new();
            if let Some(registry) = registry {
                router.insert("registry_endpoint".into(), json!(registry));
            }
            if let Some(bytes) = max_message_bytes {
                router.insert("max_message_bytes".into(), json!(bytes));
            }
            if !router.is_empty() {
                overrides.insert("router".into(), Value::Object(router));
            }
            let services = Services {
                registry: false,
                router: true,
                orchestrator: false,
                edge: false,
            };
            serve(&service, ReachConfig::default(), overrides, services, false).await
        }
        Command::Edge {
            service,
            edge_listen,
            registry,
            router,
            orchestrator,
        } => {
            let mut overrides = service.overrides();
            if let Some(edge_listen) = edge_listen {
                overrides.insert("edge_listen".into(), json!(edge_listen));
            }
            let mut edge = Map::new();
            for (key, value) in [
                ("registry_endpoint", registry),
                ("router_endpoint", router),
                ("orchestrator_endpoint", orchestrator),
            ] {
                if let Some(value) = value {
                    edge.insert(key.into(), json!(value));
                }
            }
            if !edge.is_empty() {
                overrides.insert("edge".into(), Value::Object(edge));
            }
            let services = Services {
                registry: false,
                router: false,
                orchestrator: false,
                edge: true,
            };
            serve(&service, ReachConfig::default(), overrides, services, false).await
        }
        Command::Console {
            listen,
            orchestrator,
            registry,
            allowed_hosts,
            trace_url,
            refresh_ms,
            login,
            insecure,
        } => {
            serve_console(
                &listen,
                &orchestrator,
                &registry,
                reach_console::ConsoleConfig {
                    allowed_hosts,
                    trace_url,
                    refresh_ms,
                    login,
                },
                insecure,
            )
            .await
        }
        Command::Top {
            endpoint,
            admin,
            once,
        } => {
            let options = reach::top::TopOptions {
                endpoint,
                admin,
                once,
                ..Default::default()
            };
            reach::top::run(options).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::ExampleAgents {
            registry,
            router,
            listen_host,
            advertise_host,
            lease_ttl,
            tls_dir,
            trust_domain,
            model,
        } => {
            let router = router.unwrap_or_else(|| registry.clone());
            let classifier = match model.load().and_then(|agents| classifier(&agents.model)) {
                Ok(classifier) => classifier,
                Err(message) => {
                    eprintln!("error: {message}");
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let options = reach_agents::fleet::FleetOptions {
                classifier,
                listen_host,
                advertise_host,
                lease_ttl,
                tls_dir,
                trust_domain,
                ..Default::default()
            };
            let fleet = reach_agents::fleet::Fleet::start(&registry, &router, &options).await?;
            print_fleet(&fleet)?;
            writeln!(
                std::io::stdout(),
                "registered with {registry}; calling through {router}"
            )?;
            reach_sdk::signal::terminate().await;
            tokio::spawn(async {
                reach_sdk::signal::terminate().await;
                warn!("second signal: exiting without finishing the drain");
                std::process::exit(EXIT_INTERRUPTED);
            });
            info!("shutting down: draining agents");
            fleet.drain().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Capabilities {
            endpoint,
            prefix,
            json,
            schemas,
        } => {
            let args = reach::cli::CapabilitiesArgs {
                prefix,
                json,
                schemas,
            };
            reach::cli::capabilities(&endpoint, &args, &mut std::io::stdout()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Certs { command } => {
            reach::cli::certs(command, &mut std::io::stdout())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Token { command } => {
            reach::cli::token(command, &mut std::io::stdout(), &mut std::io::stderr())?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Mcp { command, config } => {
            let reach::cli::McpCommand::Attach(args) = command;
            let loaded = ReachConfig::load(config.as_deref(), Map::new())
                .map_err(|e| e.to_string())
                .and_then(|config| Ok((args.entries(&config.mcp.attach)?, config.trust)));
            let (entries, trust) = match loaded {
                Ok(loaded) => loaded,
                Err(message) => {
                    eprintln!("error: {message}");
                    return Ok(ExitCode::from(EXIT_USAGE));
                }
            };
            let shutdown = async {
                reach_sdk::signal::terminate().await;
                tokio::spawn(async {
                    reach_sdk::signal::terminate().await;
                    warn!("second signal: exiting without finishing the drain");
                    std::process::exit(EXIT_INTERRUPTED);
                });
            };
            reach::cli::mcp_attach(entries, &args, &trust, shutdown).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Agents { endpoint, json } => {
            reach::cli::agents(&endpoint, json, &mut std::io::stdout()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Call {
            capability,
            json,
            text,
            message_type,
            version,
            trace_id,
            timeout_ms,
            endpoint,
        } => {
            let args = reach::cli::CallArgs {
                capability,
                message_type,
                json,
                text,
                timeout: std::time::Duration::from_millis(timeout_ms),
                capability_version: version,
                trace_id,
            };
            reach::cli::call(&endpoint, args, &mut std::io::stdout()).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// File descriptors kept free beyond `server.max_connections`: the process's own outbound
/// connections (instances, the registry watch, the ledger, OTLP), its store and log files.
const FILE_HEADROOM: u64 = 512;

/// Raises the open-file soft limit to the hard limit, as Go's runtime does since 1.19: every
/// connection is a file descriptor, and the usual soft default (1024) is far below
/// `server.max_connections`. Warns when even the raised limit leaves no room for the gRPC
/// port's `max_connections` and the admin port's `admin_connections`, since accepting past it
/// fails (`EMFILE`) instead of refusing cleanly.
fn raise_open_file_limit(max_connections: usize, admin_connections: usize) {
    let reserved = FILE_HEADROOM.saturating_add(admin_connections as u64);
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < reserved.saturating_add(max_connections as u64) => warn!(
            open_file_limit = limit,
            max_connections,
            "the open-file limit leaves no room for the connections the gRPC port may serve \
             (server.max_connections) plus {admin_connections} on the admin port and \
             {FILE_HEADROOM} of the process's own; lower server.max_connections below {} or raise \
             the hard limit (ulimit -Hn, systemd LimitNOFILE=, a container's nofile ulimit)",
            limit.saturating_sub(reserved)
        ),
        Ok(_) => {}
        Err(error) => warn!(%error, "cannot raise the open-file limit"),
    }
}

async fn serve(
    args: &ServiceArgs,
    defaults: ReachConfig,
    overrides: Map<String, Value>,
    services: Services,
    with_agents: bool,
) -> anyhow::Result<ExitCode> {
    let mut config =
        match ReachConfig::load_over(defaults, args.config.as_deref(), Value::Object(overrides)) {
            Ok(config) => config,
            Err(error) => {
                eprintln!("error: {error}");
                return Ok(ExitCode::from(EXIT_USAGE));
            }
        };
    if args.dump_config {
        let mut stdout = std::io::stdout().lock();
        write!(stdout, "{}", toml::to_string_pretty(&config)?)?;
        stdout.flush()?;
        return Ok(ExitCode::SUCCESS);
    }
    // The key variable is read now, before anything starts: a missing one is a usage error.
    let fleet_options = if with_agents {
        match classifier(&config.agents.model) {
            Ok(classifier) => Some(reach_agents::fleet::FleetOptions {
                classifier,
                // With TLS, the example agents use their certificates from the same directory
                // as the control plane's (as `reach certs init` lays them out).
                tls_dir: config
                    .trust
                    .tls
                    .as_ref()
                    .and_then(|tls| tls.ca.parent().map(std::path::Path::to_path_buf)),
                trust_domain: config.trust.trust_domain.clone(),
                ..Default::default()
            }),
            Err(message) => {
                eprintln!("error: {message}");
                return Ok(ExitCode::from(EXIT_USAGE));
            }
        }
    } else {
        None
    };
    raise_open_file_limit(
        config.server.max_connections,
        if config.admin_listen.is_empty() {
            0
        } else {
            config.admin.max_connections
        },
    );
    let listener = TcpListener::bind(&config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e} (use --listen)", config.listen))?;
    // The recorder goes in before the services start, so what they record at once (the
    // orchestrator's task counts) is not lost; without an admin port nothing could read it.
    let metrics = if config.admin_listen.is_empty() {
        None
    } else {
        Some(reach_telemetry::metrics::install()?)
    };
    // The edge's HTTP listener is bound first: its cards advertise its address.
    let edge_listener = if services.edge && !config.edge_listen.is_empty() {
        let edge_listener = TcpListener::bind(&config.edge_listen).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {} for the A2A edge: {e} (use --edge-listen)",
                config.edge_listen
            )
        })?;
        if config.edge.public_url.is_empty() {
            let scheme = if config.trust.tls.is_some() {
                "https"
            } else {
                "http"
            };
            config.edge.public_url = format!("{scheme}://{}", edge_listener.local_addr()?);
        }
        Some(edge_listener)
    } else {
        None
    };
    let plane = match ControlPlane::start(listener, &config, services).await {
        Ok(plane) => plane,
        // A setting that cannot work (an etcd TLS file that cannot be read, say) is a usage
        // error, as the settings validated at load are.
        Err(error) if error.is_configuration() => {
            eprintln!("error: {}", reach_rpc::errors::chain(&error));
            return Ok(ExitCode::from(EXIT_USAGE));
        }
        Err(error) => return Err(error.into()),
    };
    let endpoint = plane.endpoint();
    let shutdown = plane.shutdown_token();
    let edge_http = match (edge_listener, plane.a2a_edge()) {
        (Some(edge_listener), Some(edge)) => {
            plane.trust().check_listener(edge_listener.local_addr()?)?;
            let token = shutdown.clone();
            let url = config.edge.public_url.trim_end_matches('/').to_string();
            writeln!(
                std::io::stdout(),
                "a2a          {url}/.well-known/agent-card.json  (JSON-RPC at {url}/; gRPC lf.a2a.v1.A2AService at {})",
                plane.addr()
            )?;
            let mut routes = reach_edge::a2a::jsonrpc::routes(edge.clone());
            let mut challenges = Vec::new();
            if let Some(mcp) = plane.mcp_edge() {
                let mut authorization_servers = config.edge.mcp.authorization_servers.clone();
                if authorization_servers.is_empty()
                    && let Some(issuer) = config.trust.jwt.as_ref().and_then(|j| j.issuer.clone())
                {
                    authorization_servers.push(issuer);
                }
                let published = reach_edge::mcp::http::Published {
                    base_url: url.clone(),
                    authorization_servers,
                };
                writeln!(
                    std::io::stdout(),
                    "mcp          {}  (Streamable HTTP; tools are the mesh's capabilities)",
                    published.resource()
                )?;
                challenges.push(reach_edge::mcp::http::challenge(&published));
                let guard = config.edge.http_guard();
                routes = routes.merge(reach_edge::mcp::http::routes(
                    mcp.clone(),
                    published,
                    &guard,
                ));
            }
            Some(tokio::spawn(reach_rpc::server::serve_http_with_challenges(
                edge_listener,
                routes,
                async move { token.cancelled().await },
                config.server.shutdown_grace,
                config.server,
                reach_rpc::limits::MessageLimits::default(),
                plane.trust().clone(),
                reach_rpc::server::ClientCertificates::Optional,
                challenges,
            )))
        }
        _ => None,
    };

    let admin = if let Some(metrics) = metrics {
        let admin_listener = TcpListener::bind(&config.admin_listen).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {} for admin: {e} (use --admin-listen)",
                config.admin_listen
            )
        })?;
        let admin_addr = admin_listener.local_addr()?;
        plane.trust().check_listener(admin_addr)?;
        let token = shutdown.clone();
        let scheme = if plane.trust().tls().is_some() {
            "https"
        } else {
            "http"
        };
        let paths = reach::admin::paths(plane.registry().is_some(), plane.orchestrator().is_some());
        writeln!(
            std::io::stdout(),
            "admin http   {scheme}://{admin_addr}  ({})",
            paths.join(", ")
        )?;
        if plane.orchestrator().is_some() || plane.registry().is_some() {
            writeln!(
                std::io::stdout(),
                "console      {scheme}://{admin_addr}{}/inbox{}",
                reach_console::BASE,
                if plane.trust().is_enabled() {
                    "  (log in with a bearer token)"
                } else {
                    ""
                }
            )?;
        }
        Some(reach::admin::serve_configured(
            admin_listener,
            metrics,
            &plane,
            async move { token.cancelled().await },
            &config.server,
            &config.admin,
        )?)
    } else {
        None
    };
    // With TLS the port speaks https: say so, as clients must (`reach agents --endpoint`).
    let shown_endpoint = if plane.trust().tls().is_some() {
        endpoint.replacen("http://", "https://", 1)
    } else {
        endpoint.clone()
    };
    writeln!(
        std::io::stdout(),
        "grpc         {shown_endpoint}  ({}; health and reflection)",
        [
            (services.registry, "reach.v1.RegistryService"),
            (services.router, "reach.v1.RouterService"),
            (services.orchestrator, "reach.v1.OrchestratorService"),
            (services.edge, "lf.a2a.v1.A2AService"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect::<Vec<_>>()
        .join(", ")
    )?;
    let fleet = if let Some(options) = fleet_options {
        let fleet = reach_agents::fleet::Fleet::start(&endpoint, &endpoint, &options).await?;
        print_fleet(&fleet)?;
        // The `try:` line below means "ready": wait for the agents' health probes to pass.
        if services.router
            && !plane
                .wait_routable(fleet.members.len(), std::time::Duration::from_secs(10))
                .await
        {
            warn!("the example agents are not all routable after 10 s; `reach agents` says why");
        }
        Some(fleet)
    } else {
        None
    };
    // `[[mcp.attach]]` entries: their tools become capabilities of this mesh.
    let mcp_stop = tokio_util::sync::CancellationToken::new();
    let mcp = if services.registry && services.router && !config.mcp.attach.is_empty() {
        for entry in &config.mcp.attach {
            writeln!(
                std::io::stdout(),
                "mcp attach   {:<24} {}.<tool>",
                entry.name,
                entry.effective_prefix()
            )?;
        }
        let entries = config.mcp.attach.clone();
        let endpoint = endpoint.clone();
        let stop = mcp_stop.clone();
        let args = reach::cli::AttachArgs {
            registry: endpoint.clone(),
            listen: "127.0.0.1:0".into(),
            max_concurrency: 64,
            ..reach::cli::AttachArgs::default()
        };
        // The dev mesh's own certificate is no attachment's identity: attachments of a dev
        // mesh with TLS need `reach mcp attach` with their own.
        let trust = reach_trust::TrustConfig {
            trust_domain: config.trust.trust_domain.clone(),
            ..reach_trust::TrustConfig::default()
        };
        Some(tokio::spawn(async move {
            if let Err(e) =
                reach::cli::mcp_attach(entries, &args, &trust, stop.cancelled_owned()).await
            {
                error!(error = %e, "mcp attach stopped; its capabilities are deregistered");
            }
        }))
    } else {
        None
    };
    // Listen for the signal before saying so: a supervisor (or test) that signals as soon as
    // it reads the `try:` line must not kill the process before its handler is installed.
    let mut terminated = std::pin::pin!(reach_sdk::signal::terminate());
    let _ = futures::FutureExt::now_or_never(&mut terminated);
    // `reach agents` asks a registry: suggest it only where this process runs one.
    let agents_hint = if services.registry {
        format!("   |   reach agents --endpoint {shown_endpoint}")
    } else {
        String::new()
    };
    // With TLS, the hint presents the CA and an operator certificate as `reach certs init`
    // lays them out next to the CA.
    let grpcurl_flags = match plane.trust().tls() {
        None => "-plaintext".to_string(),
        Some(tls) => {
            let dir = tls
                .config()
                .ca
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default();
            format!(
                "-cacert {} -cert {} -key {}",
                tls.config().ca.display(),
                dir.join("operator-admin.pem").display(),
                dir.join("operator-admin-key.pem").display()
            )
        }
    };
    writeln!(
        std::io::stdout(),
        "try: grpcurl {grpcurl_flags} {} list{agents_hint}",
        plane.addr()
    )?;

    terminated.await;
    // A second signal ends the process at once, without waiting for drains and grace periods.
    tokio::spawn(async {
        reach_sdk::signal::terminate().await;
        warn!("second signal: exiting without finishing the shutdown");
        std::process::exit(EXIT_INTERRUPTED);
    });
    mcp_stop.cancel();
    if let Some(mcp) = mcp {
        let _ = mcp.await;
    }
    if let Some(fleet) = fleet {
        info!("shutting down: draining agents");
        fleet.drain().await;
    } else {
        info!("shutting down");
    }
    shutdown.cancel();
    if let Err(e) = plane.wait().await {
        error!(error = %e, "control plane stopped with an error");
    }
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    if let Some(edge_http) = edge_http {
        let _ = edge_http.await;
    }
    Ok(ExitCode::SUCCESS)
}
