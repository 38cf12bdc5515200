//! The `reach` binary as a user runs it: `reach demo`, `reach dev` with grpcurl, `reach
//! agents`, and bad configuration.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

fn reach() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_reach"));
    command.current_dir(repo_root());
    command
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn demo_json_triages_all_87_complaints_without_failure() {
    let output = reach()
        .args(["demo", "--json"])
        .output()
        .expect("reach demo runs");
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["total"], 87);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["succeeded"], 87);
    let human = report["human_review"].as_u64().unwrap();
    let routed: u64 = report["by_capability"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(
        routed + human,
        87,
        "every complaint is routed or waits for a person"
    );
    let accuracy = report["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy));
    assert!(report["latency_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(
        report["latency_ms"]["p99"].as_f64().unwrap()
            >= report["latency_ms"]["p50"].as_f64().unwrap()
    );
    let traces: Vec<&str> = report["trace_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(traces.len(), 87);
    assert_eq!(
        traces.iter().collect::<HashSet<_>>().len(),
        87,
        "one fresh trace per complaint"
    );
    assert!(
        traces
            .iter()
            .all(|t| t.len() == 32 && t.bytes().all(|b| b.is_ascii_hexdigit()))
    );
    // Both executors of the busiest capability took work.
    let by_instance = report["by_instance"].as_object().unwrap();
    assert!(
        by_instance.contains_key("executor.servicing-1")
            && by_instance.contains_key("executor.servicing-2"),
        "{by_instance:?}"
    );
}

#[test]
fn demo_reports_a_missing_input_clearly() {
    let output = reach()
        .args(["demo", "--input", "no/such.csv"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no/such.csv") && stderr.contains("--input"),
        "{stderr}"
    );
}

#[test]
fn top_once_fails_when_nothing_answers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let output = reach()
        .args(["top", "--once", "--endpoint", &endpoint])
        .output()
        .unwrap();
    assert!(!output.status.success(), "a script must see the failure");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("nothing answered") && stderr.contains(&endpoint),
        "{stderr}"
    );
}

/// Without a terminal (output piped, as in scripts and CI) the live board says so and points
/// to `--once`.
#[test]
fn top_without_a_terminal_points_to_once() {
    let output = reach()
        .args(["top", "--endpoint", "http://127.0.0.1:1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("needs a terminal") && stderr.contains("--once"),
        "{stderr}"
    );
}

#[test]
fn an_endpoint_without_its_scheme_is_refused_with_the_fix() {
    for args in [
        &["agents", "--endpoint", "127.0.0.1:7070"][..],
        &["task", "list", "--endpoint", "127.0.0.1:7070"][..],
    ] {
        let output = reach().args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("http://127.0.0.1:7070"), "{stderr}");
    }
}

#[test]
fn a_bad_config_exits_64_naming_the_key() {
    let output = reach()
        .args([
            "router",
            "--listen",
            "127.0.0.1:0",
            "--max-message-bytes",
            "10",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("max_message_bytes"), "{stderr}");

    // So are connection limits no message could get through.
    let output = reach()
        .args(["router", "--listen", "127.0.0.1:0"])
        .env("REACH_SERVER__MAX_BUFFERED_BYTES_PER_CONNECTION", "1000")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("server.max_buffered_bytes_per_connection")
            && stderr.contains("router.max_message_bytes"),
        "{stderr}"
    );

    // A protocol registry that cannot be read is a configuration mistake too.
    let output = reach()
        .args(["router", "--listen", "127.0.0.1:0"])
        .env(
            "REACH_ROUTER__PROTOCOL_REGISTRY",
            "/nonexistent/protocol-registry.yaml",
        )
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("router.protocol_registry")
            && stderr.contains("/nonexistent/protocol-registry.yaml"),
        "{stderr}"
    );

    // Values that would spin a core, never connect or never probe are refused too.
    for (key, value, named) in [
        ("REACH_ORCHESTRATOR__POLL_INTERVAL", "0s", "poll_interval"),
        (
            "REACH_ORCHESTRATOR__DEFAULT_CALL_TIMEOUT",
            "0s",
            "default_call_timeout",
        ),
        (
            "REACH_ROUTER__CONNECT_TIMEOUT",
            "0s",
            "router.connect_timeout",
        ),
        (
            "REACH_ROUTER__LEDGER_SAMPLE_RATE",
            "7",
            "router.ledger_sample_rate",
        ),
        (
            "REACH_REGISTRY__PROBE_TIMEOUT",
            "0s",
            "registry.probe_timeout",
        ),
    ] {
        let output = reach()
            .args(["dev", "--dump-config"])
            .env(key, value)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{key}={value}: {stderr}");
        assert!(stderr.contains(named), "{key}={value}: {stderr}");
    }
}

/// A registry setting found unusable only as the registry starts (an etcd TLS file that cannot
/// be read) is a configuration error too: exit 64, naming the setting and the file.
#[test]
fn an_unusable_etcd_tls_file_exits_64_naming_the_setting_and_the_file() {
    let output = reach()
        .args(["registry", "--listen", "127.0.0.1:0", "--admin-listen", ""])
        .env("REACH_REGISTRY__BACKEND", "etcd")
        .env(
            "REACH_REGISTRY__ETCD__ENDPOINTS",
            r#"["https://127.0.0.1:1"]"#,
        )
        .env("REACH_REGISTRY__ETCD__TLS__CA", "/nonexistent/etcd-ca.pem")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(64), "{stderr}");
    if cfg!(feature = "etcd") {
        assert!(
            stderr.contains("registry.etcd.tls.ca") && stderr.contains("/nonexistent/etcd-ca.pem"),
            "{stderr}"
        );
    } else {
        // Without the etcd backend built in, the setting cannot work at all.
        assert!(stderr.contains("--features etcd"), "{stderr}");
    }
}

/// A reader that goes away early (`reach ... | head -1`) ends `reach` quietly, whatever the
/// command: exit status 0 and no "Broken pipe" error or panic on stderr.
#[test]
fn a_closed_stdout_ends_reach_quietly() {
    for args in [
        &["router", "--dump-config"][..],
        &["flow", "validate", "examples/flows/complaint-flow.yaml"][..],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let output = reach().args(args).stdout(writer).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && stderr.is_empty(),
            "reach {args:?}: {:?}: {stderr}",
            output.status
        );
    }
}

/// The TOML blocks of docs/configuration.md, taken together, are the whole configuration
/// with its defaults: every key `--dump-config` prints is documented with the value it prints,
/// and the blocks name nothing else (settings unset by default are commented out there).
#[test]
fn the_configuration_doc_lists_every_setting_with_its_default() {
    let mut command = reach();
    command.args(["registry", "--dump-config"]);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("REACH_") {
            command.env_remove(name);
        }
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dumped: toml::Table = toml::from_str(&String::from_utf8_lossy(&output.stdout)).unwrap();
    let doc = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    // Each block holds whole sections (or top-level keys), so they join into one document.
    let blocks: Vec<&str> = doc
        .split("```toml\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect();
    assert!(
        !blocks.is_empty(),
        "docs/configuration.md has no ```toml block"
    );
    let documented: toml::Table = toml::from_str(&blocks.join("\n"))
        .unwrap_or_else(|e| panic!("the TOML blocks of docs/configuration.md: {e}"));
    let mut differences = Vec::new();
    compare_settings("", &dumped, &documented, &mut differences);
    assert!(
        differences.is_empty(),
        "docs/configuration.md disagrees with `reach registry --dump-config`:\n{}",
        differences.join("\n")
    );
}

/// Appends to `out` every difference between the settings `dumped` and those `documented`,
/// each named by its dotted path under `prefix`.
fn compare_settings(
    prefix: &str,
    dumped: &toml::Table,
    documented: &toml::Table,
    out: &mut Vec<String>,
) {
    let path = |key: &str| {
        if prefix.is_empty() {
            key.to_string()
        } else {
            format!("{prefix}.{key}")
        }
    };
    for (key, value) in dumped {
        match (value, documented.get(key)) {
            (_, None) => out.push(format!("{} = {value} is not documented", path(key))),
            (toml::Value::Table(d), Some(toml::Value::Table(doc))) => {
                compare_settings(&path(key), d, doc, out)
            }
            (d, Some(doc)) if d != doc => out.push(format!(
                "{} is documented as {doc}; its default is {d}",
                path(key)
            )),
            _ => {}
        }
    }
    for key in documented.keys().filter(|k| !dumped.contains_key(*k)) {
        out.push(format!(
            "{} is documented but --dump-config has no such key (comment it out if it is unset by default)",
            path(key)
        ));
    }
}

fn grpcurl() -> PathBuf {
    let path = repo_root().join(".venv/bin/grpcurl");
    assert!(
        path.exists(),
        "{} is missing: run scripts/python-env.sh",
        path.display()
    );
    path
}

/// grpcurl streaming `RouterService.Stream` on `grpc` (`HOST:PORT`), its first message (a
/// `complaint.classify` request) sent; the caller holds stdin to send more, or drops it to
/// end the stream.
fn open_classify_stream(grpc: &str) -> (std::process::Child, std::process::ChildStdin) {
    use std::io::Write as _;
    let mut streaming = Command::new(grpcurl())
        .args([
            "-plaintext",
            "-d",
            "@",
            grpc,
            "reach.v1.RouterService/Stream",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = streaming.stdin.take().unwrap();
    writeln!(stdin, r#"{{"message":{{"header":{{"capability":"complaint.classify"}},"payload":{{"parts":[{{"data":{{"complaint_id":"1","narrative":"late fee on my autopay"}}}}]}}}}}}"#).unwrap();
    stdin.flush().unwrap();
    (streaming, stdin)
}

/// A running `reach dev`, as [`start_dev`] returns it.
struct Dev {
    child: tokio::process::Child,
    /// Its stdout, kept open so it can go on printing.
    _stdout: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    /// The gRPC address it printed (`HOST:PORT`).
    grpc: String,
    /// The admin address it printed (`HOST:PORT`), unless the admin port is off.
    admin: Option<String>,
    /// The admin paths its banner lists (`/health`, `DELETE /agents/{service}`, ...).
    admin_paths: Vec<String>,
    /// Its data directory, removed when dropped.
    _data_dir: tempfile::TempDir,
}

/// `reach dev ARGS` with a data directory of its own (not the user's `./.reach`), once it
/// printed its `try:` line.
async fn start_dev(args: &[&str]) -> Dev {
    start_dev_in(&repo_root(), args).await
}

/// [`start_dev`] with `cwd` as the working directory.
async fn start_dev_in(cwd: &std::path::Path, args: &[&str]) -> Dev {
    let data_dir = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .arg("dev")
        .args(args)
        // Tests run at once: no fixed port for the A2A edge's HTTP listener.
        .args(["--edge-listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data_dir.path())
        .current_dir(cwd)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut grpc = None;
    let mut admin = None;
    let mut admin_paths = Vec::new();
    let address = |rest: &str| {
        rest.split_whitespace()
            .next()
            .map(|u| u.trim_start_matches("http://").to_string())
    };
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
    {
        if let Some(rest) = line.strip_prefix("grpc") {
            grpc = address(rest);
        }
        if let Some(rest) = line.strip_prefix("admin http") {
            admin = address(rest);
            // `admin http   http://HOST:PORT  (/health, /metrics, ...)`
            admin_paths = rest
                .split_once('(')
                .and_then(|(_, list)| list.strip_suffix(')'))
                .map(|list| list.split(", ").map(str::to_string).collect())
                .unwrap_or_default();
        }
        if line.starts_with("try:") {
            break;
        }
    }
    let grpc = grpc.expect("reach dev printed its gRPC address");
    Dev {
        child,
        _stdout: lines,
        grpc,
        admin,
        admin_paths,
        _data_dir: data_dir,
    }
}

#[tokio::test]
async fn dev_serves_every_service_on_one_port_for_grpcurl_and_reach_agents() {
    let dev = start_dev(&["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]).await;
    let Dev {
        mut child,
        grpc,
        admin,
        admin_paths,
        ..
    } = dev;
    let admin = admin.expect("reach dev printed its admin address");
    // What the services record as they start (the orchestrator's task counts, published once
    // at start and then every 2 s) is on /metrics at once: the recorder was installed first.
    let first_scrape = Command::new("curl")
        .args(["-sf", &format!("http://{admin}/metrics")])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&first_scrape.stdout).contains("reach_orchestrator_tasks{"),
        "no task counts on /metrics right after start:\n{}",
        String::from_utf8_lossy(&first_scrape.stdout)
    );
    // The banner lists every admin path (each is requested below), as the README does.
    assert_eq!(
        admin_paths,
        [
            "/health",
            "/ready",
            "/metrics",
            "/agents",
            "DELETE /agents/{service}",
            "/tasks/{id}",
            "POST /tasks/{id}/retry"
        ],
        "the admin paths of the banner"
    );
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    for path in &admin_paths {
        assert!(
            readme.contains(&format!("`{path}`")),
            "README.md does not list the admin path {path}"
        );
    }

    let list = Command::new(grpcurl())
        .args(["-plaintext", &grpc, "list"])
        .output()
        .unwrap();
    let services = String::from_utf8_lossy(&list.stdout);
    for service in [
        "reach.v1.RegistryService",
        "reach.v1.RouterService",
        "grpc.health.v1.Health",
    ] {
        assert!(
            services.contains(service),
            "grpcurl list shows {service}: {services}"
        );
    }
    assert!(
        !services.contains("reach.v1.AgentService"),
        "the control plane lists only what it serves: {services}"
    );
    let describe = Command::new(grpcurl())
        .args(["-plaintext", &grpc, "describe", "reach.v1.RouterService"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&describe.stdout).contains("rpc Call"),
        "describe works"
    );

    // The agents register within moments; then a call through grpcurl reaches one.
    let mut classified = String::new();
    for _ in 0..100 {
        let call = Command::new(grpcurl())
            .args([
                "-plaintext",
                "-d",
                r#"{"message": {"header": {"capability": "complaint.classify"}, "payload": {"type": "complaint.submitted", "parts": [{"data": {"complaint_id": "1", "narrative": "Equifax shows a derogatory tradeline on my credit report"}}]}}}"#,
                &grpc,
                "reach.v1.RouterService/Call",
            ])
            .output()
            .unwrap();
        classified = String::from_utf8_lossy(&call.stdout).to_string();
        if call.status.success() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        classified.contains("credit_report"),
        "grpcurl call classified the complaint: {classified}"
    );

    let agents = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["agents", "--endpoint", &format!("http://{grpc}")])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&agents.stdout);
    assert!(
        table.contains("executor.servicing-2") && table.contains("READY"),
        "{table}"
    );
    // `reach dev` describes the example fleet's capabilities from its protocol registry.
    let capabilities = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["capabilities", "--endpoint", &format!("http://{grpc}")])
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&capabilities.stdout);
    let classify = listed
        .lines()
        .find(|l| l.trim_start().starts_with("complaint.classify "))
        .unwrap_or_else(|| panic!("no complaint.classify row:\n{listed}"));
    assert!(
        classify.contains("protocol_registry")
            && classify.contains("classify a complaint narrative"),
        "{classify}"
    );

    let agents_json = Command::new("curl")
        .args(["-sf", &format!("http://{admin}/agents")])
        .output()
        .expect("curl runs");
    assert!(
        String::from_utf8_lossy(&agents_json.stdout).contains("coordinator-1"),
        "GET /agents lists the instances"
    );
    // Without trust nothing authenticates the operator routes: a page on another site must
    // not reach them through a browser here, by a rebound name or a cross-site form; probes
    // and scrapers reach /health, /ready and /metrics by any name.
    let status_of = |args: &[&str]| -> String {
        let out = Command::new("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .args(args)
            .output()
            .expect("curl runs");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let agents_url = format!("http://{admin}/agents");
    assert_eq!(status_of(&["-H", "Host: evil.example", &agents_url]), "403");
    assert_eq!(
        status_of(&[
            "-X",
            "DELETE",
            "-H",
            "Origin: http://evil.example",
            &format!("{agents_url}/ingest"),
        ]),
        "403",
        "a cross-site form cannot drain an agent"
    );
    assert_eq!(
        status_of(&[
            "-H",
            "Host: 10.1.2.3:7071",
            &format!("http://{admin}/health")
        ]),
        "200"
    );
    // Ready: every service's gRPC health says SERVING (the router has its registry view).
    assert_eq!(
        status_of(&[
            "-H",
            "Host: 10.1.2.3:7071",
            &format!("http://{admin}/ready")
        ]),
        "200"
    );

    // Prometheus metrics on the admin port move with the calls made.
    let scrape = || {
        let out = Command::new("curl")
            .args(["-sf", &format!("http://{admin}/metrics")])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let routed = |text: &str| -> f64 {
        text.lines()
            .find(|l| {
                l.starts_with("reach_router_requests_total{")
                    && l.contains("capability=\"complaint.classify\"")
                    && l.contains("code=\"OK\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let before = routed(&scrape());
    assert!(before >= 1.0, "the grpcurl call was counted");
    assert!(Command::new(grpcurl())
        .args(["-plaintext", "-d", r#"{"message": {"header": {"capability": "complaint.classify"}, "payload": {"parts": [{"data": {"complaint_id": "9", "narrative": "late fee"}}]}}}"#, &grpc, "reach.v1.RouterService/Call"])
        .output()
        .unwrap()
        .status
        .success());
    let metrics = scrape();
    assert_eq!(routed(&metrics), before + 1.0, "the counter moved by one");

    // A routed stream through grpcurl is counted when it ends.
    let (streaming, stdin) = open_classify_stream(&grpc);
    let open_streams = |text: &str| -> Option<f64> {
        text.lines()
            .find(|l| {
                l.starts_with("reach_router_open_streams{")
                    && l.contains("capability=\"complaint.classify\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    };
    {
        use std::io::Write as _;
        let mut stdin = stdin;
        // While the stream is open, the gauge counts it.
        let started = std::time::Instant::now();
        while open_streams(&scrape()) != Some(1.0) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "reach_router_open_streams never counted the open stream"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        writeln!(stdin, r#"{{"message":{{"payload":{{"parts":[{{"data":{{"complaint_id":"2","narrative":"my PSLF forgiveness was denied"}}}}]}}}}}}"#).unwrap();
    }
    let streamed = streaming.wait_with_output().unwrap();
    assert!(streamed.status.success());
    assert_eq!(
        String::from_utf8_lossy(&streamed.stdout)
            .matches("complaint.classification")
            .count(),
        2,
        "one classification per message sent"
    );
    let metrics = scrape();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("reach_router_streams_total{")
                && l.contains("capability=\"complaint.classify\"")
                && l.contains("code=\"OK\"")),
        "the finished stream is counted"
    );
    assert_eq!(
        open_streams(&metrics),
        Some(0.0),
        "the ended stream is no longer open"
    );

    // A stream refused before it opens is counted too, with its code, under the unrouted label.
    let refused = Command::new(grpcurl())
        .args([
            "-plaintext",
            "-d",
            r#"{"message": {"header": {"capability": "no.such"}}}"#,
            &grpc,
            "reach.v1.RouterService/Stream",
        ])
        .output()
        .unwrap();
    assert!(!refused.status.success(), "a stream to no.such is refused");
    assert!(
        scrape()
            .lines()
            .any(|l| l.starts_with("reach_router_streams_total{")
                && l.contains("capability=\"(unrouted)\"")
                && l.contains("code=\"NOT_FOUND\"")),
        "the refused stream is counted"
    );

    // A failed call's ErrorInfo is decoded by grpcurl (reflection serves google.rpc).
    let unknown = Command::new(grpcurl())
        .args([
            "-plaintext",
            "-d",
            r#"{"message": {"header": {"capability": "no.such"}}}"#,
            &grpc,
            "reach.v1.RouterService/Call",
        ])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&unknown.stderr).to_string()
        + &String::from_utf8_lossy(&unknown.stdout);
    assert!(!unknown.status.success());
    assert!(
        shown.contains(r#""reason":"ROUTE_NOT_FOUND""#),
        "grpcurl decodes the ErrorInfo: {shown}"
    );
    assert!(
        metrics.contains("reach_registry_instances{state=\"ready\"} 10"),
        "instances by state"
    );
    assert!(
        metrics.contains("reach_sdk_handler_duration_seconds_bucket"),
        "SDK handler latency"
    );

    // Flows: a complaint task runs through the example agents; a low-confidence one waits for
    // a person, who resumes it; the orchestrator's metrics move.
    let endpoint = format!("http://{grpc}");
    let task = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_reach"))
            .arg("task")
            .args(args)
            .args(["--endpoint", &endpoint])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "reach task {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let run_id = std::process::id();
    let routed_id = format!("cli-routed-{run_id}");
    let started = task(&[
        "start",
        "--flow",
        "complaint-flow",
        "--id",
        &routed_id,
        "--input",
        r#"{"complaint_id": "c1", "narrative": "Equifax and Experian report a derogatory tradeline on my credit report; the FCRA dispute was ignored"}"#,
    ]);
    assert!(
        started.starts_with(&format!("task {routed_id}  "))
            && started.contains(&format!(
                "follow it:  reach task watch {routed_id} --endpoint {endpoint}"
            )),
        "task start says which task and how to follow it: {started}"
    );
    let review_id = format!("cli-review-{run_id}");
    task(&[
        "start",
        "--flow",
        "complaint-flow",
        "--id",
        &review_id,
        "--input",
        r#"{"complaint_id": "c2", "narrative": "hello"}"#,
    ]);
    let status_of = |id: &str| -> String {
        let json: serde_json::Value =
            serde_json::from_str(&task(&["get", id, "--json"])).expect("task get --json");
        json["status"].as_str().unwrap_or_default().to_string()
    };
    let mut statuses = (String::new(), String::new());
    for _ in 0..200 {
        statuses = (status_of(&routed_id), status_of(&review_id));
        if statuses.0.contains("SUCCEEDED") && statuses.1.contains("WAITING_HUMAN") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        statuses.0.contains("SUCCEEDED"),
        "routed task: {statuses:?}"
    );
    assert!(
        statuses.1.contains("WAITING_HUMAN"),
        "low confidence waits for a person: {statuses:?}"
    );
    // It says what it waits for, and shows no output of the classifier's as its own.
    let waiting = task(&["get", &review_id]);
    assert!(
        waiting.contains("waiting   for a person, at human node human_review")
            && waiting.contains("prompt    Classify this complaint")
            && waiting.contains(&format!("resume    reach task resume {review_id} --input"))
            && !waiting.lines().any(|l| l.starts_with("output")),
        "{waiting}"
    );
    // A reader that stops early (`reach task get ID | head -1`) ends reach quietly.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let piped = Command::new(env!("CARGO_BIN_EXE_reach"))
        .args(["task", "get", &review_id, "--endpoint", &endpoint])
        .stdout(writer)
        .output()
        .unwrap();
    assert!(
        piped.status.success() && piped.stderr.is_empty(),
        "{:?}: {}",
        piped.status,
        String::from_utf8_lossy(&piped.stderr)
    );

    // reach top --once: the header counts every registered capability (not only those with
    // traffic yet), and tasks waiting for a person show once.
    let agents: serde_json::Value = serde_json::from_slice(
        &Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(["agents", "--json", "--endpoint", &endpoint])
            .output()
            .unwrap()
            .stdout,
    )
    .expect("reach agents --json");
    let registered: HashSet<&str> = agents
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|i| i["capabilities"].as_array().unwrap())
        .map(|c| c.as_str().unwrap().split('@').next().unwrap())
        .collect();
    let top_once = || {
        let top = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(["top", "--once", "--endpoint", &endpoint, "--admin", &admin])
            .output()
            .unwrap();
        assert!(top.status.success(), "{top:?}");
        String::from_utf8_lossy(&top.stdout).to_string()
    };
    // The orchestrator's first task counts, published as it starts, are not lost.
    let frame = top_once();
    assert!(!frame.contains("no orchestrator metrics"), "{frame}");
    assert!(
        frame.contains(&format!(
            "instances {}  capabilities {} (",
            agents.as_array().unwrap().len(),
            registered.len()
        )),
        "{} registered capabilities ({registered:?}):\n{frame}",
        registered.len()
    );
    assert!(
        frame.contains("waiting for a person:") && !frame.contains("waiting_human"),
        "{frame}"
    );
    task(&[
        "resume",
        &review_id,
        "--input",
        r#"{"category": "servicing", "note": "looked at it"}"#,
    ]);
    for _ in 0..200 {
        if status_of(&review_id).contains("SUCCEEDED") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        status_of(&review_id).contains("SUCCEEDED"),
        "resumed task finishes"
    );
    // The router's ledger sink flushes in batches (every 200 ms): wait for its lines.
    let run_dump = || {
        let out = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(["dump", "--task", &routed_id, "--endpoint", &endpoint])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mut dump = run_dump();
    for _ in 0..100 {
        if dump.lines().filter(|l| l.contains(" message ")).count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        dump = run_dump();
    }
    assert!(
        dump.contains("classify") && dump.contains("credit_report"),
        "reach dump shows the node history: {dump}"
    );
    assert!(
        dump.lines().any(|l| l.contains(" message ")
            && l.contains("capability:complaint.classify")
            && l.contains("coordinator-1")),
        "the router's ledger records each routed message of the task: {dump}"
    );
    assert!(
        scrape().contains("reach_orchestrator_transitions_total"),
        "orchestrator transitions are counted"
    );

    // The admin port shows a task, and drains a whole service for good.
    let task_json = Command::new("curl")
        .args(["-sf", &format!("http://{admin}/tasks/{routed_id}")])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&task_json.stdout).contains("SUCCEEDED"),
        "GET /tasks/{{id}}"
    );
    let drained = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "DELETE",
            &format!("http://{admin}/agents/executor.origination"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&drained.stdout), "202");
    let listed = || {
        let out = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(["agents", "--endpoint", &endpoint])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    for _ in 0..100 {
        if !listed().contains("executor.origination") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !listed().contains("executor.origination"),
        "drained and removed"
    );
    // The drained agents learn it from their next heartbeat (within a third of the 10 s
    // lease): refused with INSTANCE_DRAINED (FAILED_PRECONDITION). Once both were told, they
    // stop renewing and must not register again.
    let registry_ops = |text: &str, operation: &str, code: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with("reach_registry_operations_total{")
                    && l.contains(&format!("operation=\"{operation}\""))
                    && l.contains(&format!("code=\"{code}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let registered_before = registry_ops(&scrape(), "register", "OK");
    let started = std::time::Instant::now();
    while registry_ops(&scrape(), "heartbeat", "FAILED_PRECONDITION") < 2.0 {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "both drained agents were refused at their next heartbeat"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        registry_ops(&scrape(), "register", "OK"),
        registered_before,
        "and the agents do not register again"
    );
    assert!(!listed().contains("executor.origination"));
    // Every admin path the banner lists is served: the handler answers (with a body), not
    // the router's empty 404 or 405 for a path or method it does not serve.
    for listed in &admin_paths {
        let (method, path) = listed.split_once(' ').unwrap_or(("GET", listed));
        let path = path
            .replace("{service}", "no.such.service")
            .replace("{id}", &routed_id);
        let answer = Command::new("curl")
            .args(["-s", "-w", "\n%{http_code}", "-X", method])
            .arg(format!("http://{admin}{path}"))
            .output()
            .unwrap();
        let answer = String::from_utf8_lossy(&answer.stdout).to_string();
        let (body, code) = answer.rsplit_once('\n').unwrap_or_default();
        assert!(
            !body.trim().is_empty() && code != "405",
            "{method} {path} is not served: {code} {body:?}"
        );
    }
    let missing = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "DELETE",
            &format!("http://{admin}/agents/no.such.service"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&missing.stdout), "404");

    // SIGTERM drains the agents and exits cleanly.
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("reach dev exits")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// A shutdown held up by an open stream (the agents drain it for up to `max_drain`) is cut
/// short by a second signal: `reach dev` exits at once with status 130.
#[tokio::test]
async fn a_second_signal_ends_a_slow_shutdown_at_once() {
    let dev = start_dev(&["--listen", "127.0.0.1:0", "--admin-listen", ""]).await;
    let Dev {
        mut child, grpc, ..
    } = dev;
    // A routed stream left open: its agent counts it in flight while it drains.
    let (mut streaming, stdin) = open_classify_stream(&grpc);
    let mut first_reply = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(streaming.stdout.as_mut().unwrap()),
        &mut first_reply,
    )
    .unwrap();
    assert!(!first_reply.is_empty(), "the stream is open and answering");

    let pid = child.id().unwrap().to_string();
    let signal = || {
        assert!(
            Command::new("kill")
                .args(["-INT", &pid])
                .status()
                .unwrap()
                .success()
        )
    };
    signal();
    // The drain has begun once the registry lists the agents as DRAINING; the agent with the
    // open stream keeps reach dev running while it waits for the stream to end.
    let started = std::time::Instant::now();
    loop {
        let agents = Command::new(env!("CARGO_BIN_EXE_reach"))
            .args(["agents", "--endpoint", &format!("http://{grpc}")])
            .output()
            .unwrap();
        if String::from_utf8_lossy(&agents.stdout).contains("DRAINING") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the first signal starts a drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first signal starts a drain that waits for the open stream"
    );
    signal();
    let status = tokio::time::timeout(Duration::from_secs(3), child.wait())
        .await
        .expect("the second signal ends reach dev at once")
        .unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    drop(stdin);
    let _ = streaming.kill();
    let _ = streaming.wait();
}

#[test]
fn settings_layer_file_then_env_then_flags() {
    let dir = tempfile::Builder::new()
        .prefix("reach-cli-config-")
        .tempdir()
        .unwrap();
    let file = dir.path().join("reach.toml");
    std::fs::write(
        &file,
        "listen = \"127.0.0.1:9100\"\n[router]\nmax_message_bytes = 2048\nconnect_timeout = \"250ms\"\n",
    )
    .unwrap();
    let output = reach()
        .args(["router", "--dump-config", "--config"])
        .arg(&file)
        .args(["--listen", "127.0.0.1:9200"])
        .env("REACH_ROUTER__MAX_MESSAGE_BYTES", "8192")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dumped = String::from_utf8_lossy(&output.stdout);
    assert!(
        dumped.contains("listen = \"127.0.0.1:9200\""),
        "the flag wins: {dumped}"
    );
    assert!(
        dumped.contains("max_message_bytes = 8192"),
        "env beats the file: {dumped}"
    );
    assert!(
        dumped.contains("connect_timeout = \"250ms\""),
        "the file beats defaults: {dumped}"
    );

    let bad = reach()
        .args(["registry", "--dump-config"])
        .env("REACH_REGISTRY__DEFAULT_LEASE_TTL", "forever")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(64));
    let stderr = String::from_utf8_lossy(&bad.stderr).to_lowercase();
    assert!(
        stderr.contains("default_lease_ttl") && stderr.contains("forever"),
        "{stderr}"
    );
}

/// `[server] shutdown_grace` bounds the exit: `reach registry` with peers that connected and
/// never finished a request (on the admin port, HTTP/1.1 headers that never end, which a
/// graceful shutdown waits for) exits within the grace it was given, not the 10 s default.
#[tokio::test]
async fn the_shutdown_grace_setting_bounds_the_exit() {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .args([
            "registry",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("REACH_SERVER__SHUTDOWN_GRACE", "200ms")
        .current_dir(repo_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addresses = Vec::new();
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
    {
        for prefix in ["grpc", "admin http"] {
            if let Some(rest) = line.strip_prefix(prefix)
                && let Some(url) = rest.split_whitespace().next()
            {
                addresses.push(url.trim_start_matches("http://").to_string());
            }
        }
        if line.starts_with("try:") {
            break;
        }
    }
    assert_eq!(addresses.len(), 2, "reach registry printed both addresses");
    let mut silent = Vec::new();
    for address in &addresses {
        let mut peer = tokio::net::TcpStream::connect(address).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut peer, b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        silent.push(peer);
    }
    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(Duration::from_secs(4), child.wait())
        .await
        .expect("reach registry did not exit within its 200 ms grace + 3.8 s")
        .unwrap();
    assert!(status.success(), "{status:?}");
    drop(silent);
}

/// A registry on 127.0.0.1:0 in this process, loaded with the example protocol registry,
/// with one instance registered by hand: it describes `kit.search` and reports model load.
async fn registry_with_a_described_instance() -> (String, reach_registry::Registry) {
    use reach_proto::v1::{Capability, InstanceSpec, InstanceState};
    let registry = reach_registry::Registry::new(reach_registry::RegistryConfig {
        health_probe: false,
        protocol_registry: Some(repo_root().join("examples/protocol-registry.yaml")),
        ..reach_registry::RegistryConfig::default()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = reach_rpc::GrpcServer::new()
        .add_service(reach_registry::RegistryGrpc::new(registry.clone()).into_server());
    tokio::spawn(server.serve(listener, futures::future::pending()));
    let spec = InstanceSpec {
        service: "kit.search".into(),
        instance_id: "search-1".into(),
        endpoint: "http://127.0.0.1:9".into(),
        capabilities: vec![
            Capability {
                name: "kit.search".into(),
                version: "1.2.0".into(),
                description: "search the knowledge base; not for live data".into(),
                input_schema: r#"{"type":"object","required":["query"]}"#.into(),
                output_schema: String::new(),
            },
            Capability {
                name: "complaint.classify".into(),
                version: "1.0.0".into(),
                ..Default::default()
            },
        ],
        max_concurrency: 8,
        ..Default::default()
    };
    let lease = registry.register(spec, None).unwrap().lease_id;
    let load = reach_registry::store::Load {
        in_flight: 1,
        model_calls_in_flight: 2,
        model_slots_free: 0,
    };
    registry
        .heartbeat_load("search-1", &lease, InstanceState::Ready, load)
        .unwrap();
    (url, registry)
}

/// Runs `reach ARGS` to completion off the runtime's threads; returns its stdout.
async fn run_reach(args: Vec<String>) -> String {
    let output = tokio::task::spawn_blocking(move || reach().args(&args).output().unwrap())
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "reach {:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_lists_the_merged_descriptors_as_a_table_and_json() {
    let (url, _registry) = registry_with_a_described_instance().await;
    let args = |extra: &[&str]| {
        let mut args = vec!["capabilities".to_string(), "--endpoint".into(), url.clone()];
        args.extend(extra.iter().map(ToString::to_string));
        args
    };

    let table = run_reach(args(&[])).await;
    let header = table.lines().next().unwrap();
    for column in [
        "CAPABILITY",
        "VERSIONS",
        "INSTANCES",
        "SOURCE",
        "DESCRIPTION",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let row = |name: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{table}"))
            .to_string()
    };
    let search = row("kit.search");
    assert!(
        search.contains("1.2.0")
            && search.contains("1/1")
            && search.contains("registration")
            && search.contains("search the knowledge base; not for live data"),
        "{search}"
    );
    // The instance is BUSY (its model slots are full), which is routable.
    let classify = row("complaint.classify");
    assert!(
        classify.contains("1/1") && classify.contains("protocol_registry"),
        "{classify}"
    );
    assert!(
        row("complaint.ingest").contains("0/0"),
        "declared, not served"
    );
    assert!(!table.contains("required"), "no schemas without --schemas");
    assert!(
        table.contains("capabilities at registry revision"),
        "{table}"
    );

    let with_schemas = run_reach(args(&["--schemas", "--prefix", "kit."])).await;
    assert!(
        with_schemas.contains(r#"{"type":"object","required":["query"]}"#),
        "{with_schemas}"
    );
    assert!(!with_schemas.contains("complaint."), "{with_schemas}");

    let json: serde_json::Value =
        serde_json::from_str(&run_reach(args(&["--json", "--prefix", "kit."])).await).unwrap();
    assert_eq!(
        json,
        serde_json::json!([{
            "name": "kit.search",
            "description": "search the knowledge base; not for live data",
            "versions": ["1.2.0"],
            "idempotent": false,
            "routable_instances": 1,
            "instances": 1,
            "source": "registration",
            "input_schema": {"type": "object", "required": ["query"]},
            "output_schema": null,
        }])
    );
}

/// Outside a checkout (no `examples/protocol-registry.yaml` to load), `reach dev`'s example
/// agents still describe their capabilities when they register, so ListCapabilities (and
/// with it the MCP edge's tools and the A2A edge's skills) has their descriptions and schemas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_agents_describe_their_capabilities_outside_a_checkout() {
    let elsewhere = tempfile::tempdir().unwrap();
    let dev = start_dev_in(
        elsewhere.path(),
        &["--listen", "127.0.0.1:0", "--admin-listen", ""],
    )
    .await;
    let endpoint = format!("http://{}", dev.grpc);
    let listed = eventually_described(&endpoint, "complaint.classify").await;
    assert_eq!(listed["source"], "registration", "{listed}");
    assert_eq!(
        listed["description"],
        "classify a complaint narrative into a servicing category"
    );
    assert_eq!(
        listed["input_schema"]["required"],
        serde_json::json!(["complaint_id"])
    );
    for served in [
        "complaint.triage",
        "complaint.ingest",
        "complaint.servicing",
    ] {
        let listed = eventually_described(&endpoint, served).await;
        assert!(listed["input_schema"].is_object(), "{listed}");
    }
}

/// `reach capabilities --json`'s entry for `name` once an instance serving it registered.
async fn eventually_described(endpoint: &str, name: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let listed: serde_json::Value = serde_json::from_str(
            &run_reach(vec![
                "capabilities".into(),
                "--endpoint".into(),
                endpoint.into(),
                "--json".into(),
            ])
            .await,
        )
        .unwrap();
        let entry = listed
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name && c["instances"].as_u64() > Some(0))
            .cloned();
        match entry {
            Some(entry) => return entry,
            None if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            None => panic!("no instance of {name} registered in 30s: {listed}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_shows_the_model_load() {
    let (url, _registry) = registry_with_a_described_instance().await;
    let table = run_reach(vec!["agents".into(), "--endpoint".into(), url.clone()]).await;
    let header = table.lines().next().unwrap();
    assert!(header.contains("MODEL"), "{header}");
    let row = table.lines().find(|l| l.contains("search-1")).unwrap();
    assert!(row.contains("BUSY") && row.contains("2/2"), "{row}");
    let json: serde_json::Value = serde_json::from_str(
        &run_reach(vec![
            "agents".into(),
            "--json".into(),
            "--endpoint".into(),
            url,
        ])
        .await,
    )
    .unwrap();
    assert_eq!(json[0]["model_calls_in_flight"], 2);
    assert_eq!(json[0]["model_slots_free"], 0);
}

/// A registry (not Reach's) that lists capabilities whose descriptions hold terminal escapes
/// and bidi overrides, two to a page.
struct HostileRegistry;

#[tonic::async_trait]
impl reach_proto::v1::registry_service_server::RegistryService for HostileRegistry {
    async fn register(
        &self,
        _: tonic::Request<reach_proto::v1::RegisterRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::RegisterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("hostile"))
    }

    async fn heartbeat(
        &self,
        _: tonic::Request<reach_proto::v1::HeartbeatRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::HeartbeatResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("hostile"))
    }

    async fn deregister(
        &self,
        _: tonic::Request<reach_proto::v1::DeregisterRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::DeregisterResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("hostile"))
    }

    async fn list_instances(
        &self,
        _: tonic::Request<reach_proto::v1::ListInstancesRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::ListInstancesResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("hostile"))
    }

    type WatchStream = tokio_stream::Empty<Result<reach_proto::v1::WatchResponse, tonic::Status>>;

    async fn watch(
        &self,
        _: tonic::Request<reach_proto::v1::WatchRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("hostile"))
    }

    async fn list_capabilities(
        &self,
        request: tonic::Request<reach_proto::v1::ListCapabilitiesRequest>,
    ) -> Result<tonic::Response<reach_proto::v1::ListCapabilitiesResponse>, tonic::Status> {
        let all = [
            ("h.a", "red \u{1b}[31malert\u{1b}[0m \u{1b}]0;title\u{7}"),
            ("h.b", "over\rwritten"),
            ("h.c", "nul\0byte"),
            ("h.d", "abc\u{202e}fed \u{2066}iso\u{2069}"),
            ("h.e", "fine\twith a tab"),
        ];
        let after = request.into_inner().page_token;
        let rest: Vec<_> = all
            .iter()
            .filter(|(name, _)| after.is_empty() || *name > after.as_str())
            .collect();
        let page: Vec<_> = rest.iter().take(2).collect();
        let next_page_token = if rest.len() > 2 {
            page.last().unwrap().0.to_string()
        } else {
            String::new()
        };
        Ok(tonic::Response::new(
            reach_proto::v1::ListCapabilitiesResponse {
                capabilities: page
                    .iter()
                    .map(
                        |(name, description)| reach_proto::v1::CapabilityDescriptor {
                            name: (*name).to_string(),
                            description: (*description).to_string(),
                            versions: vec!["1.0.0".into()],
                            ..Default::default()
                        },
                    )
                    .collect(),
                revision: 7,
                next_page_token,
            },
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capabilities_reads_every_page_and_prints_no_terminal_controls() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let server = reach_rpc::GrpcServer::new().add_service(
        reach_proto::v1::registry_service_server::RegistryServiceServer::new(HostileRegistry),
    );
    tokio::spawn(server.serve(listener, futures::future::pending()));
    let table = run_reach(vec!["capabilities".into(), "--endpoint".into(), url]).await;
    for name in ["h.a", "h.b", "h.c", "h.d", "h.e"] {
        assert!(table.contains(name), "{name} missing:\n{table}");
    }
    assert!(
        table.contains("5 capabilities at registry revision 7"),
        "{table}"
    );
    for bad in [
        '\u{1b}', '\r', '\0', '\u{7}', '\t', '\u{202e}', '\u{2066}', '\u{2069}',
    ] {
        assert!(!table.contains(bad), "{bad:?} printed raw:\n{table:?}");
    }
    assert!(table.contains("red \u{fffd}[31malert"), "{table}");
    assert!(table.contains("fine with a tab"), "{table}");
}

/// Runs `reach ARGS` to completion off the runtime's threads; returns exit code and stderr.
async fn run_reach_failing(args: Vec<String>) -> (Option<i32>, String) {
    let output = tokio::task::spawn_blocking(move || reach().args(&args).output().unwrap())
        .await
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_prints_the_reply_and_agents_says_why_an_instance_is_not_ready() {
    let dev = start_dev(&["--listen", "127.0.0.1:0", "--admin-listen", ""]).await;
    let endpoint = format!("http://{}", dev.grpc);
    // `reach call` reaches the example coordinator and prints the reply as JSON.
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let reply: serde_json::Value = serde_json::from_str(
        &run_reach(vec![
            "call".into(),
            "complaint.classify".into(),
            "--json".into(),
            r#"{"complaint_id": "7", "narrative": "my PSLF forgiveness was denied"}"#.into(),
            "--trace-id".into(),
            trace.into(),
            "--endpoint".into(),
            endpoint.clone(),
        ])
        .await,
    )
    .unwrap();
    assert_eq!(reply["trace_id"], trace);
    assert_eq!(reply["service"], "coordinator");
    assert_eq!(reply["type"], "complaint.classification");
    let category = reply["parts"][0]["data"]["category"].as_str().unwrap();
    assert!(
        ["servicing", "repayment", "credit_report", "origination"].contains(&category),
        "{reply}"
    );
    // An unknown capability: exit 1, the code, reason and the router's message.
    let (code, stderr) = run_reach_failing(vec![
        "call".into(),
        "complaint.nothing".into(),
        "--text".into(),
        "x".into(),
        "--endpoint".into(),
        endpoint.clone(),
    ])
    .await;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("NOT_FOUND [ROUTE_NOT_FOUND]: no routable instance serves capability \"complaint.nothing\""),
        "{stderr}"
    );
    // An instance whose endpoint nothing listens on stays REGISTERED; `reach agents` says why.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let mut registry =
        reach_proto::v1::registry_service_client::RegistryServiceClient::connect(endpoint.clone())
            .await
            .unwrap();
    registry
        .register(reach_proto::v1::RegisterRequest {
            instance: Some(reach_proto::v1::InstanceSpec {
                service: "absent".into(),
                instance_id: "absent-1".into(),
                endpoint: closed_endpoint.clone(),
                ..Default::default()
            }),
            lease_ttl: None,
        })
        .await
        .unwrap();
    let mut table = String::new();
    for _ in 0..200 {
        table = run_reach(vec!["agents".into(), "--endpoint".into(), endpoint.clone()]).await;
        if table.contains("not READY yet:") {
            break;
        }
    }
    let line = table
        .lines()
        .find(|l| l.trim_start().starts_with("absent-1:"))
        .unwrap_or_else(|| panic!("no reason for absent-1 in:\n{table}"));
    assert!(
        line.contains(&format!(
            "health probe: reach.v1.AgentService on {closed_endpoint}: cannot connect"
        )),
        "{line}"
    );
    let json: serde_json::Value = serde_json::from_str(
        &run_reach(vec![
            "agents".into(),
            "--json".into(),
            "--endpoint".into(),
            endpoint,
        ])
        .await,
    )
    .unwrap();
    let absent = json
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["instance_id"] == "absent-1")
        .unwrap();
    assert_eq!(absent["state"], "REGISTERED");
    assert!(
        absent["health_probe_error"]
            .as_str()
            .unwrap()
            .contains("cannot connect"),
        "{absent}"
    );
    drop(dev);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_agents_listen_on_a_wildcard_only_with_an_advertised_host() {
    let dev = start_dev(&[
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "",
        "--no-agents",
    ])
    .await;
    let endpoint = format!("http://{}", dev.grpc);
    // A wildcard listener without an advertised host would register an address nobody can
    // dial: refused, saying what to set.
    let refused = tokio::task::spawn_blocking({
        let endpoint = endpoint.clone();
        move || {
            reach()
                .args([
                    "example-agents",
                    "--registry",
                    &endpoint,
                    "--listen-host",
                    "0.0.0.0",
                ])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("wildcard address the router cannot dial: set agent.advertise_host"),
        "{stderr}"
    );
    // As in a pod: listen on every interface, register the advertised host.
    let _agents = tokio::process::Command::new(env!("CARGO_BIN_EXE_reach"))
        .args([
            "example-agents",
            "--registry",
            &endpoint,
            "--listen-host",
            "0.0.0.0",
            "--advertise-host",
            "127.0.0.1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut registry =
        reach_proto::v1::registry_service_client::RegistryServiceClient::connect(endpoint.clone())
            .await
            .unwrap();
    let mut ready = Vec::new();
    for _ in 0..1000 {
        let list = registry
            .list_instances(reach_proto::v1::ListInstancesRequest::default())
            .await
            .unwrap()
            .into_inner();
        ready = list
            .instances
            .into_iter()
            .filter(|i| i.state() == reach_proto::v1::InstanceState::Ready)
            .map(|i| i.spec.unwrap().endpoint)
            .collect();
        if ready.len() == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ready.len(), 10, "every example agent READY: {ready:?}");
    assert!(
        ready.iter().all(|e| e.starts_with("http://127.0.0.1:")),
        "{ready:?}"
    );
    let reply = run_reach(vec![
        "call".into(),
        "complaint.classify".into(),
        "--json".into(),
        r#"{"complaint_id": "1", "narrative": "late fee on my autopay"}"#.into(),
        "--endpoint".into(),
        endpoint,
    ])
    .await;
    assert!(reply.contains("\"service\": \"coordinator\""), "{reply}");
    drop(dev);
}

#[test]
fn a_store_that_cannot_be_opened_is_reported_once_not_once_per_cause() {
    let output = reach()
        .args([
            "orchestrator",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "",
            "--store",
            "sqlite:///dev/null/tasks.db",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line in:\n{stderr}"));
    assert!(line.contains("task store"), "{line}");
    assert_eq!(
        line.matches("unable to open database file").count(),
        1,
        "{line}"
    );
}

/// `reach mcp attach` with nothing to attach, or a bad `[[mcp.attach]]` entry, is a usage
/// error (64) saying what to pass.
#[test]
fn mcp_attach_without_a_server_or_with_a_bad_entry_is_a_usage_error() {
    let output = reach().args(["mcp", "attach"]).output().unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("nothing to attach"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("reach.toml");
    std::fs::write(
        &config,
        "[[mcp.attach]]\nname = \"both\"\ncommand = [\"x\"]\nurl = \"http://127.0.0.1:1/mcp\"\n",
    )
    .unwrap();
    let output = reach()
        .args(["mcp", "attach", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("mcp.attach[0]") && stderr.contains("both command and url"),
        "{stderr}"
    );

    let output = reach()
        .args(["mcp", "attach", "--name", "a b", "--", "true"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("dotted name"),
        "{output:?}"
    );
}

/// `reach agents` lists a registry whose ListInstances answer is past gRPC's default 4 MiB
/// decoding limit (here 90 instances of about 58 KiB; 40,000 ordinary ones are as large).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_lists_a_registry_larger_than_grpcs_default_message_limit() {
    use reach_proto::v1::InstanceSpec;
    let (url, registry) = registry_with_a_described_instance().await;
    for i in 0..90 {
        let spec = InstanceSpec {
            service: "svc.wide".into(),
            instance_id: format!("wide-{i}"),
            endpoint: "http://127.0.0.1:9".into(),
            labels: [("note".to_string(), "x".repeat(15 * 1024))].into(),
            grpc_services: (0..170)
                .map(|s| format!("svc{s}.{}", "s".repeat(240)))
                .collect(),
            ..Default::default()
        };
        registry.register(spec, None).unwrap();
    }
    let json = run_reach(vec![
        "agents".into(),
        "--json".into(),
        "--endpoint".into(),
        url,
    ])
    .await;
    let listed = (0..90)
        .filter(|i| json.contains(&format!("\"wide-{i}\"")))
        .count();
    assert_eq!(listed, 90);
}
