//! Durable node transitions per second, on SQLite and (when a URL is given) PostgreSQL.
//!
//! The bench flow is a chain of `condition` nodes (each a CEL evaluation) ending in
//! `succeed`: every node completion is one durable append (the node's completion and the next
//! node's entry, committed before the next node runs). Many tasks run concurrently so that
//! the store's group commit batches their appends; no router is involved, so the figure is
//! the engine and store bound, not the network.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::{Error, Orchestrator, OrchestratorConfig};

/// Figures of one bench run.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// SQLite transitions per second.
    pub sqlite_transitions_per_s: f64,
    /// PostgreSQL transitions per second, when measured.
    pub postgres_transitions_per_s: Option<f64>,
}

const CHAIN: usize = 10;

fn bench_flow() -> String {
    let mut s = String::from("id: bench-chain\nversion: 1\ninitial: n0\nstates:\n");
    for i in 0..CHAIN {
        let next = if i + 1 == CHAIN {
            "done".to_string()
        } else {
            format!("n{}", i + 1)
        };
        s.push_str(&format!("  n{i}:\n    type: condition\n    conditions:\n      - if: \"input.k < 0\"\n        next: done\n    default: {next}\n"));
    }
    s.push_str("  done: {type: succeed}\n");
    s
}

/// Runs `tasks` tasks of the bench flow on `store_url`; returns transitions per second.
///
/// # Errors
/// Store errors.
pub async fn measure(store_url: &str, tasks: usize) -> Result<f64, Error> {
    let config = OrchestratorConfig {
        store_url: store_url.to_string(),
        router_endpoint: "http://127.0.0.1:9".into(),
        max_concurrent_tasks: 2048,
        ..Default::default()
    };
    let orch = Orchestrator::new(config).await?;
    orch.engine()
        .flows()
        .apply("bench", &bench_flow(), orch.engine().clock().now_ms())
        .await?;
    let running = orch.start()?;
    let started = Instant::now();
    let mut starts = Vec::with_capacity(tasks);
    for i in 0..tasks {
        let e = orch.engine().clone();
        starts.push(tokio::spawn(async move {
            e.start_task("bench-chain", 0, serde_json::json!({"k": i}), None)
                .await
        }));
    }
    for s in starts {
        s.await.expect("a start_task task panicked")?;
    }
    while orch.engine().store().count_unfinished().await? > 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    running.shutdown().await;
    orch.engine().store().close().await;
    // Per task: CHAIN condition completions + the succeed node.
    #[allow(clippy::cast_precision_loss)]
    Ok((tasks * (CHAIN + 1)) as f64 / elapsed)
}

/// Measures on a fresh database created on the server of `url`, dropped afterwards.
async fn measure_postgres(url: &str, tasks: usize) -> Result<f64, Error> {
    use sqlx::Connection;
    let db = format!("reach_bench_{}", uuid::Uuid::new_v4().simple());
    let (prefix, _) = url
        .rsplit_once('/')
        .ok_or_else(|| crate::config::ConfigError::StoreUrl {
            url: url.to_string(),
        })?;
    let mut admin = sqlx::PgConnection::connect(url)
        .await
        .map_err(crate::store::StoreError::from)?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await
        .map_err(crate::store::StoreError::from)?;
    let result = measure(&format!("{prefix}/{db}"), tasks).await;
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
    result
}

/// The `reach bench flows` entry point: measures SQLite (in a temporary directory) and, when
/// `postgres_url` is given, PostgreSQL (tables are created in that database). `quick` keeps
/// it well under a minute. Writes one line per figure; the last line is exactly
/// `sqlite_transitions_per_s=<n>`.
///
/// # Errors
/// Store errors, or [`Error::Io`] when no temporary directory can be made.
pub async fn bench_flows(
    quick: bool,
    postgres_url: Option<&str>,
    out: &mut dyn Write,
) -> Result<BenchReport, Error> {
    let tasks = if quick { 2_000 } else { 10_000 };
    let dir = std::env::temp_dir().join(format!("reach-bench-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    let url = format!("sqlite://{}/bench.db", dir.display());
    let sqlite = measure(&url, tasks).await;
    let _ = std::fs::remove_dir_all(&dir);
    let sqlite = sqlite?;
    let postgres = match postgres_url {
        Some(url) => {
            let v = measure_postgres(url, tasks / 2).await?;
            let _ = writeln!(
                out,
                "postgres_transitions_per_s={v:.0} (tasks={}, nodes_per_task={})",
                tasks / 2,
                CHAIN + 1
            );
            Some(v)
        }
        None => None,
    };
    let _ = writeln!(
        out,
        "bench: {tasks} tasks x {} durable transitions, SQLite WAL synchronous=NORMAL, group commit",
        CHAIN + 1
    );
    let _ = writeln!(out, "sqlite_transitions_per_s={sqlite:.0}");
    Ok(BenchReport {
        sqlite_transitions_per_s: sqlite,
        postgres_transitions_per_s: postgres,
    })
}
