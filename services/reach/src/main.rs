//! `reach`: every Reach service as a subcommand, `reach dev` all-in-one, `reach demo`, and
//! the client CLI. Argument parsing only; the work is in the `reach` library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use reach::config::ReachConfig;
use reach::control_plane::{ControlPlane, Services};
use reach::demo::{DEFAULT_INPUT, DemoOptions};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tracing::{error, info};

/// EX_USAGE from sysexits.h: the command was used incorrectly (bad configuration).
const EXIT_USAGE: u8 = 64;

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

#[derive(Subcommand)]
enum Command {
    /// Run the main job: the example agents triage the CFPB complaints through an embedded mesh, then exit.
    Demo {
        /// The complaints CSV (CFPB export columns).
        #[arg(long, default_value = DEFAULT_INPUT)]
        input: PathBuf,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Complaints in flight at once.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
    },
    /// Run registry, router and the example agents in one process until Ctrl-C.
    Dev {
        #[command(flatten)]
        service: ServiceArgs,
        /// Start without the example agents.
        #[arg(long)]
        no_agents: bool,
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
        /// The registry to watch.
        #[arg(long, env = "REACH_REGISTRY_ENDPOINT")]
        registry: Option<String>,
        /// The largest message accepted, in bytes.
        #[arg(long)]
        max_message_bytes: Option<usize>,
    },
    /// Measure a component's cost side by side with its alternatives.
    Bench {
        #[command(subcommand)]
        target: BenchTarget,
    },
    /// List the registered agent instances and their state.
    Agents {
        /// The registry (or `reach dev`) endpoint.
        #[arg(long, default_value = "http://127.0.0.1:7070")]
        endpoint: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum BenchTarget {
    /// Unary request-reply direct, through the router and through NATS; stream message rate.
    Router {
        /// The reduced matrix (under a minute), ending with the tracking line.
        #[arg(long)]
        quick: bool,
        /// Skip the NATS comparison.
        #[arg(long)]
        no_nats: bool,
    },
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
        map
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(message) = reach::telemetry::init_logs() {
        eprintln!("error: {message}");
        return ExitCode::from(EXIT_USAGE);
    }
    match run(cli.command).await {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Demo {
            input,
            json,
            concurrency,
        } => {
            let report = reach::demo::run(&DemoOptions { input, concurrency }).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", reach::demo::render_text(&report));
            }
            Ok(if report.failed == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Dev { service, no_agents } => {
            serve(&service, service.overrides(), Services::ALL, !no_agents).await
        }
        Command::Registry { service } => {
            let services = Services {
                registry: true,
                router: false,
            };
            serve(&service, service.overrides(), services, false).await
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
            };
            serve(&service, overrides, services, false).await
        }
        Command::Bench {
            target: BenchTarget::Router { quick, no_nats },
        } => {
            reach::bench::run(&reach::bench::BenchOptions { quick, no_nats }).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Agents { endpoint, json } => {
            reach::cli::agents(&endpoint, json, &mut std::io::stdout()).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn serve(
    args: &ServiceArgs,
    overrides: Map<String, Value>,
    services: Services,
    with_agents: bool,
) -> anyhow::Result<ExitCode> {
    let config = match ReachConfig::load(args.config.as_deref(), Value::Object(overrides)) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("error: {error}");
            return Ok(ExitCode::from(EXIT_USAGE));
        }
    };
    if args.dump_config {
        print!("{}", toml::to_string_pretty(&config)?);
        return Ok(ExitCode::SUCCESS);
    }
    let listener = TcpListener::bind(&config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e} (use --listen)", config.listen))?;
    let plane = ControlPlane::start(listener, &config, services).await?;
    let endpoint = plane.endpoint();
    let shutdown = plane.shutdown_token();

    let admin = if config.admin_listen.is_empty() {
        None
    } else {
        let admin_listener = TcpListener::bind(&config.admin_listen).await.map_err(|e| {
            anyhow::anyhow!(
                "cannot listen on {} for admin: {e} (use --admin-listen)",
                config.admin_listen
            )
        })?;
        let admin_addr = admin_listener.local_addr()?;
        let routes = reach::admin::routes(plane.registry().cloned());
        let token = shutdown.clone();
        println!("admin http   http://{admin_addr}  (/health, /agents)");
        Some(tokio::spawn(reach::admin::serve(
            admin_listener,
            routes,
            token,
        )))
    };
    println!(
        "grpc         {endpoint}  ({}; health and reflection)",
        match (services.registry, services.router) {
            (true, true) => "reach.v1.RegistryService, reach.v1.RouterService",
            (true, false) => "reach.v1.RegistryService",
            _ => "reach.v1.RouterService",
        }
    );
    let fleet = if with_agents {
        let fleet =
            reach_agents::fleet::Fleet::start(&endpoint, &endpoint, &Default::default()).await?;
        for member in &fleet.members {
            println!(
                "agent        {:<24} {}",
                member.agent.instance_id(),
                member.endpoint
            );
        }
        Some(fleet)
    } else {
        None
    };
    println!(
        "try: grpcurl -plaintext {} list   |   reach agents --endpoint {endpoint}",
        plane.addr()
    );

    reach_sdk::signal::terminate().await;
    info!("shutting down: draining agents");
    if let Some(fleet) = fleet {
        fleet.drain().await;
    }
    shutdown.cancel();
    if let Err(e) = plane.wait().await {
        error!(error = %e, "control plane stopped with an error");
    }
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    Ok(ExitCode::SUCCESS)
}
