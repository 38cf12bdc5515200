//! `reach-orchestrator`: the orchestrator as its own process (the `reach` binary embeds the
//! same library). Flags and `REACH_ORCHESTRATOR_*` environment variables configure it.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// Runs the Reach flow orchestrator.
#[derive(Debug, Parser)]
#[command(name = "reach-orchestrator", version)]
struct Cli {
    /// gRPC listen address.
    #[arg(
        long,
        env = "REACH_ORCHESTRATOR_LISTEN",
        default_value = "127.0.0.1:7072"
    )]
    listen: String,
    /// HTTP admin listen address (GET /tasks/{id}, POST /tasks/{id}/retry); off when unset.
    #[arg(long, env = "REACH_ORCHESTRATOR_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Task store URL: sqlite://PATH or postgres://USER@HOST:PORT/DB.
    #[arg(
        long,
        env = "REACH_ORCHESTRATOR_STORE",
        default_value = "sqlite://.reach/orchestrator.db"
    )]
    store: String,
    /// Flows directory, loaded and watched.
    #[arg(long, env = "REACH_ORCHESTRATOR_FLOWS_DIR")]
    flows_dir: Option<PathBuf>,
    /// Router endpoint that task nodes call.
    #[arg(
        long,
        env = "REACH_ORCHESTRATOR_ROUTER",
        default_value = "http://127.0.0.1:7070"
    )]
    router: String,
    /// Replica id (lease owner).
    #[arg(long, env = "REACH_ORCHESTRATOR_NODE_ID")]
    node_id: Option<String>,
    /// Lease length.
    #[arg(long, env = "REACH_ORCHESTRATOR_LEASE", default_value = "15s", value_parser = humantime::parse_duration)]
    lease: Duration,
    /// Poll interval for other replicas' changes and timers.
    #[arg(long, env = "REACH_ORCHESTRATOR_POLL", default_value = "500ms", value_parser = humantime::parse_duration)]
    poll_interval: Duration,
    /// Context TTL after a task ends.
    #[arg(long, env = "REACH_ORCHESTRATOR_CONTEXT_TTL", default_value = "24h", value_parser = humantime::parse_duration)]
    context_ttl: Duration,
    /// Extra field names to mask (comma separated).
    #[arg(long, env = "REACH_ORCHESTRATOR_REDACT", value_delimiter = ',')]
    redact: Vec<String>,
    /// fsync every SQLite commit (synchronous=FULL).
    #[arg(long, env = "REACH_ORCHESTRATOR_FULL_SYNC")]
    full_sync: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("REACH_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,reach=info,reach_orchestrator=info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let config = reach_orchestrator::OrchestratorConfig {
        store_url: cli.store,
        sqlite_full_sync: cli.full_sync,
        flows_dir: cli.flows_dir,
        router_endpoint: cli.router,
        node_id: cli.node_id,
        lease: cli.lease,
        poll_interval: cli.poll_interval,
        context_ttl: cli.context_ttl,
        redact_fields: cli.redact,
        ..Default::default()
    };
    if let Err(e) = config.validate() {
        eprintln!("invalid configuration: {e}");
        std::process::exit(64);
    }
    let orchestrator = reach_orchestrator::Orchestrator::new(config).await?;
    let listener = tokio::net::TcpListener::bind(&cli.listen).await?;
    // Tests and scripts read the bound address from this line.
    println!("listening on {}", listener.local_addr()?);
    if let Some(addr) = cli.admin_listen {
        let admin = tokio::net::TcpListener::bind(&addr).await?;
        println!("admin listening on {}", admin.local_addr()?);
        let router = orchestrator.admin_router();
        tokio::spawn(async move { axum::serve(admin, router).await });
    }
    orchestrator
        .serve(listener, async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("sigterm handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        })
        .await?;
    Ok(())
}
