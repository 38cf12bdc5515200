//! Prints durable transitions per second: `cargo run --release -p reach-orchestrator
//! --example bench_flows [-- --full]` (PostgreSQL too when REACH_TEST_POSTGRES_URL is set).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let quick = !std::env::args().any(|a| a == "--full");
    let pg = std::env::var("REACH_TEST_POSTGRES_URL").ok();
    reach_orchestrator::bench::bench_flows(quick, pg.as_deref(), &mut std::io::stdout()).await?;
    Ok(())
}
