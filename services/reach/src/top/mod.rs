//! `reach top`: a terminal board refreshing every second from a Reach endpoint.
//!
//! It reads `RegistryService.ListInstances` over gRPC and scrapes the admin `/metrics`
//! (in `reach dev`, the gRPC port + 1): instances with state, load and p99 latency; traffic
//! per capability; tasks by status and those waiting for a person (when an orchestrator
//! reports metrics); the most frequent failing message types with their last error.
//!
//! The data ([`model`]: [`Board`] builds a [`Snapshot`]) is separate from drawing
//! ([`render()`]), so tests draw snapshots on ratatui's `TestBackend`; [`run`] with
//! `once: true` prints one frame as text and exits (through `write!`, never `print!`, so a
//! closed stdout is an error the caller sees rather than a panic).
#![warn(clippy::print_stdout)]

pub mod model;
pub mod render;

use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use reach_proto::v1::ListInstancesRequest;
use reach_proto::v1::registry_service_client::RegistryServiceClient;

pub use model::{Board, Snapshot};
pub use render::render;

/// Where `reach top` reads from and how it shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct TopOptions {
    /// The gRPC endpoint serving `RegistryService` (`http://127.0.0.1:7070`).
    pub endpoint: String,
    /// The admin `host:port` serving `/metrics`; `None` means the endpoint's port + 1.
    pub admin: Option<String>,
    /// Time between refreshes.
    pub interval: Duration,
    /// Print one frame as text to stdout and exit, instead of the live board.
    pub once: bool,
    /// Frame size for `once` (columns, rows); 0 rows means as many as the content needs.
    pub size: (u16, u16),
}

impl Default for TopOptions {
    fn default() -> Self {
        Self {
            endpoint: "http://127.0.0.1:7070".to_string(),
            admin: None,
            interval: Duration::from_secs(1),
            once: false,
            size: (120, 0),
        }
    }
}

/// Why the board could not run or fetch.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    /// The endpoint is not a `scheme://host:port` URL.
    #[error("endpoint {0:?} is not a URL with a host and port")]
    Endpoint(String),
    /// `--once` reached neither the registry nor the admin port.
    #[error(
        "nothing answered at {endpoint}: registry: {registry}; metrics: {metrics}. Is `reach dev` (or the registry) running there? Pass --endpoint / --admin"
    )]
    Unreachable {
        /// The gRPC endpoint tried.
        endpoint: String,
        /// Why the registry could not be read.
        registry: String,
        /// Why the metrics could not be read.
        metrics: String,
    },
    /// The HTTP request failed.
    #[error("GET {url}: {reason}")]
    Http {
        /// The URL requested.
        url: String,
        /// What went wrong.
        reason: String,
    },
    /// The metrics text could not be parsed.
    #[error("cannot parse metrics: {0}")]
    Metrics(std::io::Error),
    /// The terminal could not be driven.
    #[error("terminal: {0}")]
    Terminal(#[from] std::io::Error),
    /// The `--once` frame could not be written to stdout (for example, its reader went away:
    /// the error's source is the `std::io::Error`, kind `BrokenPipe`).
    #[error("cannot write the frame to stdout")]
    Output(#[source] std::io::Error),
    /// There is no terminal to draw on (output piped, no TTY).
    #[error("the live board needs a terminal ({0}); use --once to print one frame as text instead")]
    NoTerminal(std::io::Error),
}

/// GETs `path` from `authority` (`host:port`) over HTTP/1.1 and returns the body; fails on
/// a non-2xx status or after 3 seconds.
///
/// # Errors
/// [`TopError::Http`] says which URL failed and why.
pub async fn http_get(authority: &str, path: &str) -> Result<String, TopError> {
    let url = format!("http://{authority}{path}");
    let fail = |reason: String| TopError::Http {
        url: url.clone(),
        reason,
    };
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| fail(e.to_string()))?;
        tokio::spawn(connection);
        let request = http::Request::get(path)
            .header(http::header::HOST, authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| fail(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| fail(e.to_string()))?;
        if !response.status().is_success() {
            return Err(fail(format!("status {}", response.status())));
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| fail(e.to_string()))?
            .to_bytes();
        String::from_utf8(body.to_vec()).map_err(|e| fail(e.to_string()))
    };
    tokio::time::timeout(Duration::from_secs(3), fetch)
        .await
        .map_err(|_| fail("timed out after 3s".to_string()))?
}

/// Parses the Prometheus text format.
///
/// # Errors
/// [`TopError::Metrics`] when the text is not the Prometheus format.
pub fn parse_metrics(text: &str) -> Result<prometheus_parse::Scrape, TopError> {
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string())))
        .map_err(TopError::Metrics)
}

/// The admin `host:port` of a `reach dev` endpoint: the same host, the next port.
///
/// # Errors
/// [`TopError::Endpoint`] when the endpoint has no host or port.
pub fn admin_authority(endpoint: &str) -> Result<String, TopError> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|_| TopError::Endpoint(endpoint.to_string()))?;
    let host = uri
        .host()
        .ok_or_else(|| TopError::Endpoint(endpoint.to_string()))?;
    let port = uri
        .port_u16()
        .and_then(|p| p.checked_add(1))
        .ok_or_else(|| TopError::Endpoint(endpoint.to_string()))?;
    Ok(format!("{host}:{port}"))
}

/// Reads the endpoint once and updates `board`; failures of either source are shown in the
/// snapshot, not returned.
pub async fn fetch(
    board: &mut Board,
    registry: &mut RegistryServiceClient<tonic::transport::Channel>,
    endpoint: &str,
    admin: &str,
    elapsed: Option<Duration>,
) -> Snapshot {
    let (instances, metrics) = tokio::join!(
        async {
            let mut request = tonic::Request::new(ListInstancesRequest::default());
            request.set_timeout(Duration::from_secs(2));
            registry
                .list_instances(request)
                .await
                .map(tonic::Response::into_inner)
                .map_err(|s| {
                    format!(
                        "{}: {}",
                        reach_telemetry::metrics::code_label(s.code()),
                        s.message()
                    )
                })
        },
        async {
            let text = http_get(admin, "/metrics")
                .await
                .map_err(|e| e.to_string())?;
            parse_metrics(&text).map_err(|e| e.to_string())
        }
    );
    board.update(endpoint, instances, metrics, elapsed)
}

/// Draws `snapshot` on a `width` × `height` `TestBackend` and returns the frame as text,
/// one line per row, trailing spaces trimmed, without the live board's "(q to quit)".
pub fn render_to_string(snapshot: &Snapshot, width: u16, height: u16) -> String {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).expect("test backend");
    terminal
        .draw(|frame| render::draw(frame, snapshot, false))
        .expect("drawing on a test backend");
    let buffer = terminal.backend().buffer();
    let mut out = String::new();
    for y in 0..buffer.area.height {
        let mut line = String::new();
        for x in 0..buffer.area.width {
            line.push_str(buffer[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Runs the board: with `once`, prints one frame to stdout and returns; otherwise takes over
/// the terminal, refreshes every `interval` and returns when `q`, Esc or Ctrl-C is pressed.
///
/// # Errors
/// [`TopError::Endpoint`] for a malformed endpoint, [`TopError::Terminal`] when the terminal
/// cannot be driven, [`TopError::Output`] when `once` cannot write its frame,
/// [`TopError::Unreachable`] when `once` reached neither the registry nor the admin port. In
/// the live board an unreachable endpoint is not an error: it shows why.
pub async fn run(options: TopOptions) -> Result<(), TopError> {
    let admin = match &options.admin {
        Some(admin) => admin.clone(),
        None => admin_authority(&options.endpoint)?,
    };
    let channel = tonic::transport::Endpoint::from_shared(options.endpoint.clone())
        .map_err(|_| TopError::Endpoint(options.endpoint.clone()))?
        .connect_timeout(Duration::from_secs(1))
        .connect_lazy();
    let mut registry = RegistryServiceClient::new(channel)
        .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES);
    let mut board = Board::new();

    if options.once {
        let snapshot = fetch(&mut board, &mut registry, &options.endpoint, &admin, None).await;
        let height = match options.size.1 {
            0 => render::content_height(&snapshot),
            rows => rows,
        };
        {
            use std::io::Write as _;
            let mut stdout = std::io::stdout().lock();
            stdout
                .write_all(render_to_string(&snapshot, options.size.0, height).as_bytes())
                .and_then(|()| stdout.flush())
                .map_err(TopError::Output)?;
        }
        // A one-shot board that reached nothing is a failure a script must see.
        if let (Some(registry), Some(metrics)) = (&snapshot.registry_error, &snapshot.metrics_error)
        {
            return Err(TopError::Unreachable {
                endpoint: options.endpoint.clone(),
                registry: registry.clone(),
                metrics: metrics.clone(),
            });
        }
        return Ok(());
    }

    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    let mut terminal = ratatui::try_init().map_err(TopError::NoTerminal)?;
    let result = async {
        let mut last: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let elapsed = last.map(|l| now - l);
            last = Some(now);
            let snapshot = fetch(
                &mut board,
                &mut registry,
                &options.endpoint,
                &admin,
                elapsed,
            )
            .await;
            terminal.draw(|frame| render(frame, &snapshot))?;
            let interval = options.interval;
            let quit = tokio::task::spawn_blocking(move || -> std::io::Result<bool> {
                let deadline = Instant::now() + interval;
                while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                    if !event::poll(left)? {
                        break;
                    }
                    if let Event::Key(key) = event::read()? {
                        let ctrl_c = key.code == KeyCode::Char('c')
                            && key.modifiers.contains(KeyModifiers::CONTROL);
                        if key.kind == KeyEventKind::Press
                            && (matches!(key.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                        {
                            return Ok(true);
                        }
                    }
                }
                Ok(false)
            })
            .await
            .map_err(std::io::Error::other)??;
            if quit {
                return Ok::<(), TopError>(());
            }
        }
    }
    .await;
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use prometheus_parse::HistogramCount;
    use reach_proto::v1::{Instance, InstanceSpec, InstanceState, ListInstancesResponse};

    use super::model::quantile;
    use super::*;

    fn instance(
        service: &str,
        id: &str,
        state: InstanceState,
        in_flight: u32,
        max: u32,
    ) -> Instance {
        // Each instance registers its service's name as a capability, and `<service>.admin`,
        // which gets no traffic.
        let capability = |name: String| reach_proto::v1::Capability {
            name,
            version: "1.0.0".to_string(),
            ..Default::default()
        };
        Instance {
            spec: Some(InstanceSpec {
                service: service.to_string(),
                instance_id: id.to_string(),
                max_concurrency: max,
                capabilities: vec![
                    capability(service.to_string()),
                    capability(format!("{service}.admin")),
                ],
                ..Default::default()
            }),
            state: state as i32,
            in_flight,
            ..Default::default()
        }
    }

    fn instances() -> ListInstancesResponse {
        ListInstancesResponse {
            instances: vec![
                instance("executor.servicing", "exec-2", InstanceState::Busy, 8, 8),
                instance("echo", "echo-1", InstanceState::Ready, 3, 8),
            ],
            revision: 7,
        }
    }

    /// A scrape in the exposition format the Prometheus exporter writes.
    fn metrics(echo_ok: u32, failures_timeout: u32, failures_unavailable: u32) -> String {
        format!(
            "# TYPE reach_router_requests_total counter
reach_router_requests_total{{capability=\"echo\",code=\"OK\"}} {echo_ok}
reach_router_requests_total{{capability=\"echo\",code=\"UNAVAILABLE\"}} 2
reach_router_requests_total{{capability=\"complaint.servicing\",code=\"OK\"}} 1
# TYPE reach_router_in_flight gauge
reach_router_in_flight{{capability=\"echo\"}} 3
# TYPE reach_router_instance_duration_seconds histogram
reach_router_instance_duration_seconds_bucket{{service=\"echo\",instance=\"echo-1\",le=\"0.001\"}} 50
reach_router_instance_duration_seconds_bucket{{service=\"echo\",instance=\"echo-1\",le=\"0.01\"}} 99
reach_router_instance_duration_seconds_bucket{{service=\"echo\",instance=\"echo-1\",le=\"0.1\"}} 100
reach_router_instance_duration_seconds_bucket{{service=\"echo\",instance=\"echo-1\",le=\"+Inf\"}} 100
reach_router_instance_duration_seconds_sum{{service=\"echo\",instance=\"echo-1\"}} 0.3
reach_router_instance_duration_seconds_count{{service=\"echo\",instance=\"echo-1\"}} 100
# TYPE reach_router_message_failures_total counter
reach_router_message_failures_total{{message_type=\"complaint.classify\",reason=\"DEADLINE_EXCEEDED\"}} {failures_timeout}
reach_router_message_failures_total{{message_type=\"complaint.classify\",reason=\"INSTANCE_UNAVAILABLE\"}} {failures_unavailable}
reach_router_message_failures_total{{message_type=\"echo.request\",reason=\"UNAVAILABLE\"}} 2
# TYPE reach_orchestrator_tasks gauge
reach_orchestrator_tasks{{status=\"processing\"}} 4
reach_orchestrator_tasks{{status=\"waiting_human\"}} 2
# TYPE reach_orchestrator_dead_letters_total counter
reach_orchestrator_dead_letters_total 1
"
        )
    }

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let buckets = |counts: &[(f64, f64)]| -> Vec<HistogramCount> {
            counts
                .iter()
                .map(|&(less_than, count)| HistogramCount { less_than, count })
                .collect()
        };
        assert_eq!(
            quantile(0.99, &buckets(&[(1.0, 0.0), (f64::INFINITY, 0.0)])),
            None
        );
        let b = buckets(&[(0.1, 50.0), (0.2, 100.0), (f64::INFINITY, 100.0)]);
        assert!((quantile(0.5, &b).unwrap() - 0.1).abs() < 1e-9);
        assert!((quantile(0.99, &b).unwrap() - 0.198).abs() < 1e-9);
        // Everything above the last finite bound: the bound.
        let b = buckets(&[(0.1, 0.0), (f64::INFINITY, 10.0)]);
        assert_eq!(quantile(0.99, &b), Some(0.1));
    }

    #[test]
    fn the_board_builds_rows_rates_and_last_errors() {
        let mut board = Board::new();
        let first = board.update(
            "http://127.0.0.1:7070",
            Ok(instances()),
            Ok(parse_metrics(&metrics(10, 5, 1)).unwrap()),
            None,
        );
        assert_eq!(first.instances[0].instance_id, "echo-1");
        assert_eq!(first.instances[0].state, "ready");
        let p99 = first.instances[0].p99.unwrap();
        assert!(
            p99 > Duration::from_millis(9) && p99 <= Duration::from_millis(10),
            "{p99:?}"
        );
        assert_eq!(first.instances[1].p99, None);
        let echo = &first.capabilities[0];
        assert_eq!(
            (echo.capability.as_str(), echo.requests, echo.errors),
            ("echo", 12.0, 2.0)
        );
        assert_eq!(echo.rate, None);
        assert_eq!(echo.in_flight, 3.0);
        let classify = &first.failures[0];
        assert_eq!(classify.message_type, "complaint.classify");
        assert_eq!(classify.count, 6.0);
        assert_eq!(classify.last_error, "DEADLINE_EXCEEDED");
        let tasks = first.tasks.as_ref().unwrap();
        assert_eq!(tasks.waiting_human, 2.0);
        assert_eq!(tasks.dead_letters, 1.0);

        // A second refresh: 20 more echo calls in 2 s, and the newest failure is another.
        let second = board.update(
            "http://127.0.0.1:7070",
            Ok(instances()),
            Ok(parse_metrics(&metrics(30, 5, 2)).unwrap()),
            Some(Duration::from_secs(2)),
        );
        assert_eq!(second.capabilities[0].rate, Some(10.0));
        assert_eq!(second.failures[0].last_error, "INSTANCE_UNAVAILABLE");
    }

    #[test]
    fn a_frame_shows_every_panel() {
        let mut board = Board::new();
        let snapshot = board.update(
            "http://127.0.0.1:7070",
            Ok(instances()),
            Ok(parse_metrics(&metrics(10, 5, 1)).unwrap()),
            None,
        );
        let text = render_to_string(&snapshot, 120, 36);
        for expected in [
            "reach top — http://127.0.0.1:7070",
            // echo, echo.admin, executor.servicing, executor.servicing.admin registered; the
            // router counted calls for echo and complaint.servicing.
            "instances 2  capabilities 4 (2 with traffic)",
            "instances",
            "echo-1",
            "ready",
            "3/8",
            "exec-2",
            "busy",
            "8/8",
            "traffic",
            "complaint.servicing",
            "waiting for a person: 2",
            "processing",
            "dead letters",
            "complaint.classify",
            "DEADLINE_EXCEEDED",
        ] {
            assert!(text.contains(expected), "{expected:?} missing from\n{text}");
        }
        // Tasks waiting for a person are shown once, in their own line.
        assert!(!text.contains("waiting_human"), "{text}");
        // A printed frame cannot be quit.
        assert!(!text.contains("q to quit"), "{text}");
        assert_eq!(text.matches("waiting for a person").count(), 1, "{text}");
    }

    #[test]
    fn a_frame_of_content_height_shows_every_instance() {
        let mut board = Board::new();
        let mut many = instances();
        many.instances = (1..=10)
            .map(|n| instance("executor", &format!("exec-{n}"), InstanceState::Ready, 0, 8))
            .collect();
        let snapshot = board.update(
            "http://127.0.0.1:7070",
            Ok(many),
            Ok(parse_metrics(&metrics(10, 5, 1)).unwrap()),
            None,
        );
        let text = render_to_string(&snapshot, 120, render::content_height(&snapshot));
        for n in 1..=10 {
            assert!(
                text.lines()
                    .any(|line| line.contains(&format!("exec-{n} "))),
                "exec-{n} missing from\n{text}"
            );
        }
    }

    #[test]
    fn a_small_terminal_keeps_names_apart_and_says_what_it_hides() {
        let mut board = Board::new();
        let mut many = instances();
        many.instances = (1..=12)
            .map(|n| {
                instance(
                    "executor.credit_report",
                    &format!("executor.credit_report-4f9c2a7e-{n:02}"),
                    InstanceState::Ready,
                    0,
                    8,
                )
            })
            .collect();
        let snapshot = board.update(
            "http://127.0.0.1:7070",
            Ok(many),
            Ok(parse_metrics(&metrics(10, 5, 1)).unwrap()),
            None,
        );
        let text = render_to_string(&snapshot, 80, 24);
        let shown: Vec<&str> = text
            .lines()
            .filter(|line| line.contains("ready"))
            .filter_map(|line| line.split_whitespace().nth(1))
            .collect();
        assert!(
            shown.len() >= 3 && shown.iter().all(|id| id.contains('…')),
            "{text}"
        );
        let distinct: std::collections::HashSet<&&str> = shown.iter().collect();
        assert_eq!(distinct.len(), shown.len(), "cut names collide:\n{text}");
        assert!(text.contains("of 12 shown"), "{text}");
    }

    #[test]
    fn a_frame_degrades_when_sources_are_missing() {
        let mut board = Board::new();
        let snapshot = board.update(
            "http://127.0.0.1:7070",
            Err("UNAVAILABLE: connection refused".to_string()),
            Err("GET http://127.0.0.1:7071/metrics: connection refused".to_string()),
            None,
        );
        let text = render_to_string(&snapshot, 160, 30);
        assert!(
            text.contains("registry: UNAVAILABLE: connection refused"),
            "{text}"
        );
        assert!(text.contains("metrics: GET"), "{text}");
        assert!(text.contains("no orchestrator metrics"), "{text}");
    }

    #[test]
    fn the_admin_port_is_the_next_one() {
        assert_eq!(
            admin_authority("http://127.0.0.1:7070").unwrap(),
            "127.0.0.1:7071"
        );
        assert!(admin_authority("not a url").is_err());
    }
}
