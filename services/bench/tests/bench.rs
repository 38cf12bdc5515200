//! The benchmarks run end to end: each path reaches its agent (each watcher every instance)
//! and the report holds its rows and its tracking line. Not a performance check: a debug
//! build's figures mean nothing.

use std::process::Command;

/// Runs `reach-bench ARGS`, asserts that it succeeded and returns its stdout.
fn bench(args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_reach-bench"))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[test]
fn bench_router_quick_measures_every_requested_path_without_errors() {
    // Not a performance check: the figures of a debug build on a shared machine mean
    // nothing. It checks that each path really reaches its agent and that the report holds.
    let stdout = bench(&[
        "router",
        "--quick",
        "--no-nats",
        "--no-proxies",
        "--only",
        "direct-mux,router-mux,router,sdk",
    ]);
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| 4 KiB"))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    for mode in ["direct-mux", "router-mux", "router", "sdk"] {
        for concurrency in ["1", "64"] {
            let row = rows
                .iter()
                .find(|r| r[2] == concurrency && r[3] == mode)
                .unwrap_or_else(|| panic!("no {mode} c={concurrency} row in\n{stdout}"));
            let rps: f64 = row[4].parse().unwrap();
            assert!(
                rps > 0.0,
                "{mode} c={concurrency} completed nothing: {row:?}"
            );
            assert_eq!(
                row[8], "0",
                "{mode} c={concurrency} had failed requests: {row:?}"
            );
        }
    }
    let tracking = stdout.lines().last().unwrap_or_default();
    assert!(
        tracking.starts_with("router_overhead_p50_us=")
            && tracking.contains(" router_vs_direct_rps=")
            && tracking.contains(" router_vs_nats_rps=n/a ")
            && tracking.ends_with("router_vs_nginx_rps=n/a router_vs_haproxy_rps=n/a"),
        "the last line is the tracking line: {tracking}"
    );
}

#[test]
fn bench_registry_quick_sees_every_instance_at_every_watcher() {
    // The bench fails unless every watcher receives every instance's READY upsert.
    let stdout = bench(&["registry", "--quick"]);
    assert!(
        stdout.contains("1000 instances over 100 capabilities, 10 watchers")
            && stdout.contains("snapshot for a new watcher (1000)"),
        "{stdout}"
    );
    let tracking = stdout.lines().last().unwrap_or_default();
    assert!(
        tracking.starts_with("registry_register_to_routable_p99_ms=")
            && tracking.contains(" registry_fanout_p99_ms=")
            && tracking.contains(" registry_bytes_per_instance="),
        "the last line is the tracking line: {tracking}"
    );
    // On etcd too, side by side, unless etcd (or the etcd build) is missing, which CI has.
    let etcd_ran = !stdout.contains("etcd columns skipped");
    assert!(
        etcd_ran || std::env::var("CI").is_err(),
        "CI runs the etcd columns: {stdout}"
    );
    if etcd_ran {
        assert!(
            stdout.contains("etcd, burst")
                && tracking.contains(" registry_etcd_register_to_routable_p99_ms=")
                && tracking.contains(" registry_etcd_etcd_bytes_per_instance="),
            "{stdout}"
        );
    }
}
