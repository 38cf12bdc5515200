//! Test harness: an in-test RouterService (the orchestrator's real boundary), stores on
//! SQLite or PostgreSQL, and helpers.
#![allow(dead_code, missing_docs)]

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reach_orchestrator::{Orchestrator, OrchestratorConfig};
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::router_service_server::{RouterService, RouterServiceServer};
use reach_proto::v1::{self as pb, CallRequest, CallResponse, Part, Payload, ReachMessage, part};
use serde_json::Value;
use tonic::{Request, Response, Status};

pub type Handler = Arc<dyn Fn(&Delivery) -> Result<Value, Status> + Send + Sync>;

/// One delivery the router saw.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub capability: String,
    pub message_id: String,
    pub task_id: String,
    pub trace_id: String,
    pub node: String,
    pub input: Value,
    /// The attempt number the orchestrator sent.
    pub attempt: u32,
    /// How many times this message id was delivered before.
    pub redelivery: usize,
}

#[derive(Default)]
pub struct RouterState {
    pub handlers: Mutex<HashMap<String, Handler>>,
    /// Token usage a capability's replies report in their header metadata, as an LLM
    /// agent's would.
    pub usage: Mutex<HashMap<String, reach_rpc::usage::TokenUsage>>,
    pub deliveries: Mutex<Vec<Delivery>>,
    seen: Mutex<HashMap<String, usize>>,
}

#[derive(Clone, Default)]
pub struct TestRouter {
    pub state: Arc<RouterState>,
}

impl TestRouter {
    pub fn handle(
        &self,
        capability: &str,
        f: impl Fn(&Delivery) -> Result<Value, Status> + Send + Sync + 'static,
    ) {
        self.state
            .handlers
            .lock()
            .unwrap()
            .insert(capability.to_string(), Arc::new(f));
    }

    /// Makes `capability`'s replies report `usage` (`reach.gen_ai.*` header metadata).
    pub fn report_usage(&self, capability: &str, usage: reach_rpc::usage::TokenUsage) {
        self.state
            .usage
            .lock()
            .unwrap()
            .insert(capability.to_string(), usage);
    }

    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state.deliveries.lock().unwrap().clone()
    }

    /// Distinct message ids delivered for (task, node): the side effects an SDK that drops
    /// redelivered ids would perform.
    pub fn effects(&self, task_id: &str, node: &str) -> usize {
        self.deliveries()
            .iter()
            .filter(|d| d.task_id == task_id && d.node == node)
            .map(|d| d.message_id.clone())
            .collect::<HashSet<_>>()
            .len()
    }

    /// Serves on 127.0.0.1:0; returns the endpoint URL and a shutdown sender.
    pub async fn serve(&self) -> (String, tokio::sync::oneshot::Sender<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.serve_on(listener)
    }

    /// Serves on `listener`; returns the endpoint URL and a shutdown sender.
    pub fn serve_on(
        &self,
        listener: tokio::net::TcpListener,
    ) -> (String, tokio::sync::oneshot::Sender<()>) {
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = RouterServiceServer::new(self.clone());
        tokio::spawn(async move {
            reach_rpc::GrpcServer::new()
                .add_service(svc)
                .serve(listener, async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        (format!("http://{addr}"), tx)
    }
}

#[tonic::async_trait]
impl RouterService for TestRouter {
    async fn publish(
        &self,
        _request: Request<pb::PublishRequest>,
    ) -> Result<Response<pb::PublishResponse>, Status> {
        Err(Status::unimplemented("the test router does not publish"))
    }

    async fn reply(
        &self,
        _request: Request<pb::ReplyRequest>,
    ) -> Result<Response<pb::ReplyResponse>, Status> {
        Err(Status::unimplemented(
            "the test router takes no asynchronous replies",
        ))
    }

    async fn call(&self, request: Request<CallRequest>) -> Result<Response<CallResponse>, Status> {
        let msg = request.into_inner().message.unwrap_or_default();
        let h = msg.header.clone().unwrap_or_default();
        let capability = match &h.target {
            Some(pb::header::Target::Capability(c)) => c.clone(),
            _ => return Err(Status::invalid_argument("no capability")),
        };
        let input = msg
            .payload
            .as_ref()
            .and_then(|p| p.parts.first())
            .and_then(|p| match &p.content {
                Some(part::Content::Data(v)) => Some(reach_orchestrator::json::from_proto(v)),
                _ => None,
            })
            .unwrap_or(Value::Null);
        let redelivery = {
            let mut seen = self.state.seen.lock().unwrap();
            let n = seen.entry(h.message_id.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        let d = Delivery {
            capability: capability.clone(),
            message_id: h.message_id.clone(),
            task_id: h.task_id.clone(),
            trace_id: h.trace_id.clone(),
            node: h.metadata.get("node_id").cloned().unwrap_or_default(),
            input,
            attempt: h
                .metadata
                .get("attempt")
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
            redelivery,
        };
        self.state.deliveries.lock().unwrap().push(d.clone());
        let handler = self
            .state
            .handlers
            .lock()
            .unwrap()
            .get(&capability)
            .cloned();
        let Some(handler) = handler else {
            return Err(Status::not_found(format!("no handler for {capability}")));
        };
        // Handlers may ask to be slow by returning Status::aborted("sleep:<ms>") first.
        let out = match handler(&d) {
            Err(s) if s.message().starts_with("sleep:") => {
                let ms: u64 = s.message()[6..].parse().unwrap_or(0);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(Value::Null)
            }
            other => other,
        }?;
        let mut metadata = HashMap::new();
        if let Some(usage) = self.state.usage.lock().unwrap().get(&capability) {
            usage.write(&mut metadata);
        }
        Ok(Response::new(CallResponse {
            message: Some(ReachMessage {
                header: Some(pb::Header {
                    trace_id: h.trace_id,
                    correlation_id: h.message_id,
                    metadata,
                    ..Default::default()
                }),
                payload: Some(Payload {
                    r#type: format!("{capability}.reply"),
                    parts: vec![Part {
                        content: Some(part::Content::Data(reach_orchestrator::json::to_proto(
                            &out,
                        ))),
                        ..Default::default()
                    }],
                }),
            }),
            route: None,
        }))
    }

    type CallMuxStream = futures::stream::Empty<Result<pb::CallMuxResponse, Status>>;

    async fn call_mux(
        &self,
        _request: Request<tonic::Streaming<pb::CallMuxRequest>>,
    ) -> Result<Response<Self::CallMuxStream>, Status> {
        // The orchestrator calls unary Call; clients fall back to it on UNIMPLEMENTED.
        Err(Status::unimplemented(
            "the test router serves unary Call only",
        ))
    }

    type StreamStream = futures::stream::Empty<Result<pb::StreamResponse, Status>>;

    async fn stream(
        &self,
        _request: Request<tonic::Streaming<pb::StreamRequest>>,
    ) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented("not in tests"))
    }
}

/// The PostgreSQL URL for tests: a fresh database on the server in REACH_TEST_POSTGRES_URL.
/// `None` (with a loud message) when unset outside CI; panics when unset with CI=true.
pub async fn postgres_url() -> Option<String> {
    let Ok(base) = std::env::var("REACH_TEST_POSTGRES_URL") else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!(
                "REACH_TEST_POSTGRES_URL is not set but CI=true: start PostgreSQL with scripts/start-postgres.sh and export the URL it prints"
            );
        }
        eprintln!(
            "\n!!!!! SKIPPING PostgreSQL test: REACH_TEST_POSTGRES_URL is not set. Run `eval $(scripts/start-postgres.sh)` first. !!!!!\n"
        );
        return None;
    };
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(&base)
        .await
        .expect("connect to REACH_TEST_POSTGRES_URL");
    let db = format!("reach_test_{}", uuid::Uuid::new_v4().simple());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut conn)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    Some(format!("{prefix}/{db}"))
}

/// A store URL for `backend` (`sqlite` in `dir`, or `postgres`); `None` to skip.
pub async fn store_url(backend: &str, dir: &std::path::Path) -> Option<String> {
    match backend {
        "sqlite" => Some(format!("sqlite://{}/orch.db", dir.display())),
        _ => postgres_url().await,
    }
}

/// Polls `f` until it returns Some, up to `limit` (a convergence bound, not a timing assertion).
pub async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = std::time::Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if start.elapsed() > limit {
            panic!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A flow whose `ask` node waits for a person's `{approved: bool}`, then calls `test.act`;
/// cancelling it ends in `withdrawn`.
pub const REVIEW_V1: &str = r#"
id: review
version: 1
initial: ask
states:
  ask:
    type: human
    schema: {type: object, required: [approved], properties: {approved: {type: boolean}}}
    on_cancel: withdrawn
    next: act
  act: {type: task, capability: test.act, next: done}
  withdrawn: {type: fail, error: withdrawn}
  done: {type: succeed}
"#;

/// A real orchestrator gRPC server on 127.0.0.1:0 over a SQLite store in a temporary
/// directory, calling a [`TestRouter`]; stops when dropped.
pub struct Server {
    pub endpoint: String,
    pub router: TestRouter,
    pub orch: std::sync::Arc<Orchestrator>,
    _router_stop: tokio::sync::oneshot::Sender<()>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The temporary directory holding the store (and any flows a test writes).
    pub dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts a [`Server`]; `tweak` adjusts the configuration (given the temporary directory).
pub async fn server(tweak: impl FnOnce(&mut OrchestratorConfig, &std::path::Path)) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let router = TestRouter::default();
    let (router_url, router_stop) = router.serve().await;
    let mut config = OrchestratorConfig {
        store_url: format!("sqlite://{}/o.db", dir.path().display()),
        router_endpoint: router_url,
        poll_interval: Duration::from_millis(50),
        redact_fields: vec!["customer_name".into()],
        ..Default::default()
    };
    tweak(&mut config, dir.path());
    let orch = std::sync::Arc::new(Orchestrator::new(config).await.unwrap());
    let running = orch.start().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let svc = orch.grpc_service();
    tokio::spawn(async move {
        reach_rpc::GrpcServer::new()
            .add_service(svc)
            .serve(listener, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        running.shutdown().await;
    });
    Server {
        endpoint,
        router,
        orch,
        _router_stop: router_stop,
        stop: Some(tx),
        dir,
    }
}

/// The task `id` as GetTask returns it; `None` when the call fails.
pub async fn status_of(endpoint: &str, id: &str) -> Option<pb::Task> {
    let mut c = OrchestratorServiceClient::connect(endpoint.to_string())
        .await
        .ok()?;
    match c.get_task(pb::GetTaskRequest { task_id: id.into() }).await {
        Ok(r) => r.into_inner().task,
        Err(e) => {
            eprintln!("get_task {id}: {e}");
            None
        }
    }
}

/// Polls GetTask until task `id` has `status`; panics when it ends otherwise or after 30 s.
pub async fn wait_for(endpoint: &str, id: &str, status: pb::TaskStatus) -> pb::Task {
    let start = std::time::Instant::now();
    loop {
        let task = status_of(endpoint, id).await;
        if let Some(t) = &task
            && t.status == status as i32
        {
            return t.clone();
        }
        let ended = task.as_ref().is_some_and(|t| {
            [
                pb::TaskStatus::Succeeded,
                pb::TaskStatus::Failed,
                pb::TaskStatus::Partial,
                pb::TaskStatus::Cancelled,
            ]
            .iter()
            .any(|s| *s as i32 == t.status)
        });
        assert!(
            start.elapsed() < Duration::from_secs(30) && !ended,
            "task {id} never reached {status:?}; last seen: {:#?}",
            task.map(|t| reach_orchestrator::json::task_json(&t))
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
