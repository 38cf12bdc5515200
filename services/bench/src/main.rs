//! `reach-bench`: runs one of Reach's benchmarks and prints its report to stdout.
//!
//! ```text
//! reach-bench router [--quick] [--no-nats] [--no-proxies] [--mtls [--no-agent-check]] [--only MODES] [--payloads BYTES] [--concurrency N]
//! reach-bench flows [--quick] [--postgres URL]
//! reach-bench mcp [--quick]
//! reach-bench registry [--quick]
//! ```

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The same allocator as the `reach` binary, so the figures are the ones a deployment sees.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Reach's benchmarks (`docs/benchmarks.md`).
#[derive(Parser)]
#[command(name = "reach-bench", version)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Request-reply direct to an agent, through the router (unary and multiplexed), through
    /// nginx and HAProxy (unary gRPC proxies) and through NATS, with the same client and
    /// responder work on each; the whole SDK stack; a stream's message rate.
    Router {
        /// The reduced matrix (under a minute); the last line is
        /// `router_overhead_p50_us=<n> router_vs_direct_rps=<ratio> router_vs_nats_rps=<ratio>
        /// router_vs_nginx_rps=<ratio> router_vs_haproxy_rps=<ratio>`.
        #[arg(long)]
        quick: bool,
        /// Skip the NATS comparison (when nats-server is not installed).
        #[arg(long)]
        no_nats: bool,
        /// Skip the nginx and HAProxy comparison (when nginx-light or haproxy is not
        /// installed).
        #[arg(long)]
        no_proxies: bool,
        /// Measure only these modes (comma-separated), for profiling one path.
        #[arg(
            long,
            value_delimiter = ',',
            value_parser = clap::builder::PossibleValuesParser::new(reach_bench::router::MODES),
        )]
        only: Vec<String>,
        /// Measure only these payload sizes in bytes (comma-separated, e.g. `65536`) instead
        /// of the matrix's.
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=4_000_000))]
        payloads: Vec<u32>,
        /// Measure only these concurrencies (comma-separated, e.g. `1,64`) instead of the
        /// matrix's.
        #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u16).range(1..=4096))]
        concurrency: Vec<u16>,
        /// Also measure the same modes (but NATS and the proxies) on a mesh whose every hop is mutual TLS,
        /// printed side by side with the plaintext cells.
        #[arg(long)]
        mtls: bool,
        /// With --mtls: the echo agent of the mutual-TLS mesh does not check that its
        /// callers are routers (the check every SDK agent serving TLS makes). Run with and
        /// without to measure what the check costs.
        #[arg(long, requires = "mtls")]
        no_agent_check: bool,
    },
    /// A tool call through the MCP edge next to the same call through the router (c=1, c=16).
    Mcp {
        /// A reduced run (seconds); the last line is
        /// `mcp_overhead_p50_us=<n> mcp_vs_router_rps=<ratio>`.
        #[arg(long)]
        quick: bool,
    },
    /// The registry at mesh scale: 10,000 instances over 1,000 capabilities registered while
    /// 100 watchers follow; register → routable, Watch fan-out, memory per instance.
    Registry {
        /// A tenth of the scale (seconds); the same last line,
        /// `registry_register_to_routable_p99_ms=<n> registry_fanout_p99_ms=<n> registry_bytes_per_instance=<n>`.
        #[arg(long)]
        quick: bool,
    },
    /// Durable flow transitions per second on SQLite (and PostgreSQL with --postgres).
    Flows {
        /// A reduced run (under a minute); the last line is `sqlite_transitions_per_s=<n>`.
        #[arg(long)]
        quick: bool,
        /// Also measure PostgreSQL at this URL (a fresh database is created there).
        #[arg(long, env = "REACH_TEST_POSTGRES_URL")]
        postgres: Option<String>,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let telemetry = match reach_telemetry::TelemetryConfig::from_env("reach-bench")
        .map(|mut config| {
            // The report is the output: the services' per-task logs stay quiet unless asked.
            if std::env::var_os("REACH_LOG").is_none() {
                config.log_filter = "warn".into();
            }
            config
        })
        .map_err(|e| e.to_string())
        .and_then(|config| reach_telemetry::init(&config).map_err(|e| e.to_string()))
    {
        Ok(telemetry) => telemetry,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(64);
        }
    };
    let result = match cli.bench {
        Bench::Router {
            quick,
            no_nats,
            no_proxies,
            only,
            payloads,
            concurrency,
            mtls,
            no_agent_check,
        } => {
            reach_bench::router::run(&reach_bench::router::BenchOptions {
                quick,
                no_nats,
                no_proxies,
                only,
                payloads: payloads.into_iter().map(|b| b as usize).collect(),
                concurrencies: concurrency.into_iter().map(usize::from).collect(),
                mtls,
                no_agent_check,
            })
            .await
        }
        Bench::Mcp { quick } => reach_bench::mcp::run(quick).await,
        Bench::Registry { quick } => {
            use reach_bench::registry::{Scale, run};
            run(if quick { Scale::QUICK } else { Scale::FULL }).await
        }
        Bench::Flows { quick, postgres } => {
            reach_bench::flows::bench_flows(quick, postgres.as_deref(), &mut std::io::stdout())
                .await
                .map(drop)
        }
    };
    let _ = telemetry.shutdown().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
