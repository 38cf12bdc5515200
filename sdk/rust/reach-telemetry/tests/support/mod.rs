//! Test fixtures: the Python OTLP receiver, a captured log writer, a tiny traced agent.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::{
    HandleMuxRequest, HandleMuxResponse, HandleRequest, HandleResponse, HandleStreamRequest,
    HandleStreamResponse, Header, Payload, ReachMessage, header::Target,
};
use reach_telemetry::grpc::GrpcClientTrace;
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

/// The repository root (three levels above this crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../..")
        .canonicalize()
        .expect("repo root exists")
}

/// `<repo>/.venv/bin/python`, or a panic saying how to create it.
pub fn venv_python() -> PathBuf {
    let python = repo_root().join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/python-env.sh at the repository root to create the Python \
         venv these tests use (grpcio, opentelemetry-proto)",
        python.display()
    );
    python
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "reach-telemetry-{}-{}-{name}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The Python OTLP receiver (`tests/otlp_receiver.py`) as a child process.
pub struct Receiver {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
    out: PathBuf,
}

impl Receiver {
    /// Starts the receiver on an ephemeral port; `blackhole` makes it never answer.
    pub fn start(blackhole: bool) -> Self {
        let out = temp_path("spans.jsonl");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/otlp_receiver.py");
        let mut command = Command::new(venv_python());
        command
            .arg(script)
            .args(["--port", "0", "--out"])
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if blackhole {
            command.arg("--blackhole");
        }
        let mut child = command.spawn().expect("start otlp_receiver.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the receiver's port");
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver printed {line:?}, not PORT <n>"));
        Self { child, port, out }
    }

    /// The endpoint URL to export to.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("receiver writes JSON lines"))
            .collect()
    }

    /// Waits (up to 20 s) until `ready` holds for the received spans, and returns them.
    pub async fn wait_for(
        &self,
        ready: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Vec<serde_json::Value> {
        let start = Instant::now();
        loop {
            let spans = self.spans();
            if ready(&spans) {
                return spans;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "spans never arrived; got {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.out);
    }
}

/// A `MakeWriter` that keeps every log line in memory.
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Capture {
    /// The captured lines.
    pub fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// One write handle of [`Capture`].
pub struct CaptureWriter(Arc<Mutex<Vec<u8>>>);

impl Write for CaptureWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Capture {
    type Writer = CaptureWriter;

    fn make_writer(&'a self) -> Self::Writer {
        CaptureWriter(self.0.clone())
    }
}

/// A traced agent client.
pub type Client = AgentServiceClient<GrpcClientTrace<Channel>>;

/// A test agent: logs inside its message span, replies with the trace id it ran in, and
/// forwards the message to `next` first when it has one.
#[derive(Clone)]
pub struct Agent {
    pub name: &'static str,
    pub next: Option<Client>,
}

#[tonic::async_trait]
impl AgentService for Agent {
    async fn handle(
        &self,
        request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        let message = request.into_inner().message.unwrap_or_default();
        let span = reach_telemetry::message_span("agent.handle", &message);
        let this = self.clone();
        async move {
            tracing::info!(agent = this.name, "handling message");
            {
                let _work = tracing::info_span!("agent.work").entered();
                tracing::info!("inner step");
            }
            let fails = message
                .payload
                .as_ref()
                .is_some_and(|p| p.r#type == "echo.fail");
            if fails {
                let status = Status::unavailable("agent is overloaded");
                tracing::warn!("refusing message");
                reach_telemetry::record_status(
                    &tracing::Span::current(),
                    status.code(),
                    status.message(),
                );
                return Err(status);
            }
            if let Some(mut next) = this.next.clone() {
                next.handle(HandleRequest {
                    message: Some(message.clone()),
                })
                .await?;
            }
            let mut reply = message;
            if let Some(header) = reply.header.as_mut() {
                header.trace_id = reach_telemetry::current_trace_id()
                    .map(|t| t.to_string())
                    .unwrap_or_default();
            }
            Ok(Response::new(HandleResponse {
                message: Some(reply),
            }))
        }
        .instrument(span)
        .await
    }

    type HandleStreamStream = tokio_stream::Empty<Result<HandleStreamResponse, Status>>;

    async fn handle_stream(
        &self,
        _request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        Err(Status::unimplemented(
            "streams are not part of this test agent",
        ))
    }

    type HandleMuxStream = tokio_stream::Empty<Result<HandleMuxResponse, Status>>;

    async fn handle_mux(
        &self,
        _request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        Err(Status::unimplemented(
            "multiplexed calls are not part of this test agent",
        ))
    }
}

/// A running agent server; stops when dropped.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serves `agent` (traced) with reach-rpc's GrpcServer on 127.0.0.1:0.
pub async fn serve(agent: Agent) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let server = reach_rpc::GrpcServer::new()
        .add_service(reach_telemetry::traced(AgentServiceServer::new(agent)));
    tokio::spawn(
        async move {
            server
                .serve(listener, async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        }
        .in_current_span(),
    );
    Server {
        addr,
        stop: Some(stop),
    }
}

/// A channel to `addr`.
pub async fn channel(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A traced client for `addr`.
pub async fn client(addr: SocketAddr) -> Client {
    AgentServiceClient::new(reach_telemetry::traced_channel(channel(addr).await))
}

/// A message for capability `echo` in `trace_id` / `task_id`.
pub fn message(trace_id: &str, task_id: &str) -> ReachMessage {
    ReachMessage {
        header: Some(Header {
            message_id: reach_rpc::trace::new_message_id(),
            trace_id: trace_id.to_string(),
            task_id: task_id.to_string(),
            source: "test.edge".to_string(),
            target: Some(Target::Capability("echo".to_string())),
            ..Default::default()
        }),
        payload: Some(Payload {
            r#type: "echo.request".to_string(),
            parts: Vec::new(),
        }),
    }
}
