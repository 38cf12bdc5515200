//! Overload is refused, never mishandled: many more callers than an agent's slots, each
//! giving up at its deadline, against an agent whose handler ignores cancellation. A bounded
//! load test on 127.0.0.1 (a fixed number of calls, each with a 500 ms deadline). It asserts
//! how calls end, never how long they took: the longest shed and the longest call are printed.

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use futures::{Stream, StreamExt};
use reach_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{
    CallRequest, HandleMuxRequest, HandleMuxResponse, HandleRequest, HandleResponse,
    HandleStreamRequest, HandleStreamResponse, InstanceSpec, Payload, ReachMessage,
};
use reach_router::RouterConfig;
use reach_router::config::AdmissionConfig;
use reach_rpc::GrpcServer;
use reach_rpc::mux;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::{Code, Request, Response, Status, Streaming};

/// How long the agent's handler takes, whatever happens to its caller.
const HANDLER_TIME: Duration = Duration::from_secs(1);
/// The agent's concurrency limit, as registered.
const MAX_CONCURRENCY: u32 = 4;

/// Handlers running now and the most seen at once.
#[derive(Default)]
struct Concurrency {
    now: AtomicUsize,
    max: AtomicUsize,
}

impl Concurrency {
    /// Runs one handler: counted for [`HANDLER_TIME`], cancellation ignored.
    async fn run(&self) -> ReachMessage {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(HANDLER_TIME).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        ReachMessage {
            header: None,
            payload: Some(Payload::text("done", "")),
        }
    }
}

/// An agent written without the SDK whose handler finishes its work however its caller
/// went away: a cancel frame is acknowledged only when the handler is done
/// (`mux::OnCancel::Tell`, the handler never looks at its token), and a unary call's handler
/// runs in a task of its own.
#[derive(Clone)]
struct StubbornAgent {
    seen: Arc<Concurrency>,
}

#[tonic::async_trait]
impl AgentService for StubbornAgent {
    async fn handle(
        &self,
        _request: Request<HandleRequest>,
    ) -> Result<Response<HandleResponse>, Status> {
        let seen = self.seen.clone();
        let message = tokio::spawn(async move { seen.run().await }).await.unwrap();
        Ok(Response::new(HandleResponse {
            message: Some(message),
        }))
    }

    type HandleMuxStream = Pin<Box<dyn Stream<Item = Result<HandleMuxResponse, Status>> + Send>>;

    async fn handle_mux(
        &self,
        request: Request<Streaming<HandleMuxRequest>>,
    ) -> Result<Response<Self::HandleMuxStream>, Status> {
        let inbound = request
            .into_inner()
            .map(|item| item.map(|r| r.frame.unwrap_or_default()));
        let seen = self.seen.clone();
        let outcomes = mux::serve_with(
            inbound,
            move |_call: mux::IncomingCall| {
                let seen = seen.clone();
                async move { Ok(seen.run().await) }
            },
            1024,
            CancellationToken::new(),
            mux::OnCancel::Tell,
        );
        Ok(Response::new(Box::pin(outcomes.map(|item| {
            item.map(|(call_id, outcome)| HandleMuxResponse {
                frame: Some(mux::reply_frame(call_id, outcome)),
            })
        }))))
    }

    type HandleStreamStream =
        Pin<Box<dyn Stream<Item = Result<HandleStreamResponse, Status>> + Send>>;

    async fn handle_stream(
        &self,
        _request: Request<Streaming<HandleStreamRequest>>,
    ) -> Result<Response<Self::HandleStreamStream>, Status> {
        Err(Status::unimplemented("no streams"))
    }
}

/// How one call ended.
#[derive(Debug)]
enum Outcome {
    Ok,
    DeadlineExceeded,
    /// UNAVAILABLE / OVERLOADED with a RetryInfo hint.
    Overloaded,
    Other(Status),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_callers_giving_up_at_their_deadlines_are_refused_or_timed_out_never_broken() {
    const CALLERS: usize = 200;
    const CALLS_EACH: usize = 3;
    // Deadlines far longer than max_wait and far shorter than the handler: a call either is
    // shed after max_wait or is delivered and abandoned mid-handler, however slowly a busy
    // machine schedules the processes.
    let deadline = Duration::from_millis(500);
    let max_wait = Duration::from_millis(10);

    let registry = registry().await;
    let seen = Arc::new(Concurrency::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        GrpcServer::new()
            .add_service(AgentServiceServer::new(StubbornAgent {
                seen: seen.clone(),
            }))
            .serve(listener, futures::future::pending()),
    );
    registry
        .registry
        .register(
            InstanceSpec {
                service: "stubborn".into(),
                instance_id: "stubborn-1".into(),
                endpoint,
                capabilities: vec![reach_proto::v1::Capability {
                    name: "slow.work".into(),
                    version: "1.0.0".into(),
                    ..Default::default()
                }],
                protocol_version: "1.0".into(),
                weight: 1,
                max_concurrency: MAX_CONCURRENCY,
                ..InstanceSpec::default()
            },
            Some(Duration::from_secs(60)),
        )
        .unwrap();
    let config = RouterConfig {
        admission: AdmissionConfig {
            max_wait,
            ..AdmissionConfig::default()
        },
        ..RouterConfig::default()
    };
    let router = router(&registry.url, config).await;
    router.wait_routable(1).await;
    let mesh = router.client().await;

    // Unary Calls (what generated clients send), every caller on one connection: each call
    // that gives up resets its HTTP/2 stream.
    let channel = tonic::transport::Endpoint::from_shared(router.url.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let client = RouterServiceClient::new(channel.clone());
            let message = mesh.message_to_capability(
                "slow.work",
                Payload::text("t", ""),
                &reach_sdk::CallOptions::default(),
            );
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                for _ in 0..CALLS_EACH {
                    let mut message = message.clone();
                    if let Some(header) = message.header.as_mut() {
                        header.message_id = reach_rpc::trace::new_message_id();
                    }
                    let mut request = Request::new(CallRequest {
                        message: Some(message),
                    });
                    request.set_timeout(deadline);
                    let began = Instant::now();
                    let result = RouterServiceClient::clone(&client).call(request).await;
                    let took = began.elapsed();
                    let outcome = match result {
                        Ok(_) => Outcome::Ok,
                        Err(status) => {
                            let status = reach_rpc::deadline::normalize_client_status(status);
                            match status.code() {
                                Code::DeadlineExceeded => Outcome::DeadlineExceeded,
                                Code::Unavailable
                                    if reason(&status) == "OVERLOADED"
                                        && reach_rpc::errors::retry_after_of(&status).is_some() =>
                                {
                                    Outcome::Overloaded
                                }
                                _ => Outcome::Other(status),
                            }
                        }
                    };
                    outcomes.push((outcome, took));
                }
                outcomes
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for caller in callers {
        outcomes.extend(caller.await.unwrap());
    }
    let elapsed = started.elapsed();

    let count = |f: fn(&Outcome) -> bool| outcomes.iter().filter(|(o, _)| f(o)).count();
    let ok = count(|o| matches!(o, Outcome::Ok));
    let timed_out = count(|o| matches!(o, Outcome::DeadlineExceeded));
    let overloaded = count(|o| matches!(o, Outcome::Overloaded));
    let others: Vec<_> = outcomes
        .iter()
        .filter_map(|(o, _)| match o {
            Outcome::Other(status) => Some(status),
            _ => None,
        })
        .collect();
    let longest_shed = outcomes
        .iter()
        .filter(|(o, _)| matches!(o, Outcome::Overloaded))
        .map(|(_, took)| *took)
        .max()
        .unwrap_or_default();
    let longest = outcomes
        .iter()
        .map(|(_, took)| *took)
        .max()
        .unwrap_or_default();
    let max_seen = seen.max.load(Ordering::SeqCst);
    let total = outcomes.len();
    let correct = ok + timed_out + overloaded;
    println!(
        "overload: {total} calls ({CALLERS} callers x {CALLS_EACH}, {deadline:?} deadlines, \
         handler {HANDLER_TIME:?}, max_concurrency {MAX_CONCURRENCY}, admission.max_wait \
         {max_wait:?}) in {elapsed:?}: ok {ok}, DEADLINE_EXCEEDED {timed_out}, \
         UNAVAILABLE/OVERLOADED {overloaded}, other {}; correctly ended {:.1} % (refused \
         with OVERLOADED + RetryInfo {:.1} %); agent max concurrency {max_seen}; longest \
         shed call {longest_shed:?}, longest call {longest:?}",
        others.len(),
        100.0 * correct as f64 / total as f64,
        100.0 * overloaded as f64 / total as f64,
    );
    assert!(
        others.is_empty(),
        "every failure is DEADLINE_EXCEEDED or UNAVAILABLE/OVERLOADED with RetryInfo, never a \
         broken connection: {} others, first {:?}",
        others.len(),
        others.first()
    );
    assert!(
        max_seen <= MAX_CONCURRENCY as usize,
        "the agent saw {max_seen} calls at once, over its max_concurrency of {MAX_CONCURRENCY}"
    );
    assert!(overloaded > 0, "the load was enough to shed calls");
}
