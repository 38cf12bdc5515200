//! Overload: far more callers than an agent's slots, each giving up at its deadline, through
//! a real `reach dev` process. Every call must end as a success, its caller's own deadline, or
//! a refusal a client can act on (UNAVAILABLE + `OVERLOADED` + RetryInfo, within
//! `admission.max_wait`); the agent must never see more calls at once than its limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_proto::v1::{CallRequest, Header, Payload, ReachMessage, header};
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext};
use tonic::Code;

use crate::mesh::Service;

/// The agent's concurrency limit.
pub const LIMIT: usize = 4;
/// Callers at once.
const CALLERS: usize = 200;
/// Calls each caller makes, one after the other.
const CALLS_EACH: usize = 5;
/// The callers' deadlines, one round each: shorter than the agent's work (every delivered
/// call is abandoned mid-handler, the storm of cancellations that once broke connections and
/// overfilled the agent), then longer than `admission.max_wait` (calls are shed instead).
const DEADLINES: [Duration; 2] = [Duration::from_millis(50), Duration::from_secs(1)];
/// The router's `admission.max_wait`.
pub const MAX_WAIT: Duration = Duration::from_millis(100);
/// How long the agent's handler works, ignoring cancellation.
const WORK: Duration = Duration::from_millis(100);

/// What the overload run measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Calls made.
    pub calls: usize,
    /// Calls answered.
    pub ok: usize,
    /// Calls that ended at their caller's deadline.
    pub deadline: usize,
    /// Calls refused with UNAVAILABLE + OVERLOADED + RetryInfo.
    pub refused_correctly: usize,
    /// The longest a correct refusal took, as the client saw it: a figure, not a goal. The
    /// router sheds a call after `admission.max_wait`; on a busy machine the client sees the
    /// refusal later than that by however long the processes waited for a CPU, which no test
    /// controls.
    pub slowest_refusal: Duration,
    /// Everything else (transport errors, GOAWAY, refusals without a hint or too late): what
    /// each was.
    pub wrong: Vec<String>,
    /// The most calls the agent had at once (handled or waiting for a handler slot, as its
    /// runtime counts them), sampled every millisecond.
    pub max_concurrency: usize,
}

impl Report {
    /// Counts one call's outcome.
    fn record(&mut self, result: Result<(), tonic::Status>, elapsed: Duration, deadline: Duration) {
        self.calls += 1;
        match result {
            Ok(()) => self.ok += 1,
            Err(status) if status.code() == Code::DeadlineExceeded => self.deadline += 1,
            // The client's own timer (tonic answers CANCELLED "Timeout expired").
            Err(status) if status.code() == Code::Cancelled && elapsed >= deadline => {
                self.deadline += 1
            }
            Err(status)
                if status.code() == Code::Unavailable
                    && reach_rpc::errors::reason_of(&status).as_deref()
                        == Some(reach_rpc::errors::reason::OVERLOADED)
                    && reach_rpc::errors::retry_after_of(&status).is_some() =>
            {
                self.refused_correctly += 1;
                self.slowest_refusal = self.slowest_refusal.max(elapsed);
            }
            Err(status) => self.wrong.push(format!(
                "{:?} after {elapsed:?}: {}",
                status.code(),
                status.message()
            )),
        }
    }

    /// The share of the calls that did not succeed that ended correctly (goal 1.0).
    pub fn correctly_refused_share(&self) -> f64 {
        let failed = self.calls - self.ok;
        if failed == 0 {
            1.0
        } else {
            (self.deadline + self.refused_correctly) as f64 / failed as f64
        }
    }
}

/// Runs the scenario against a fresh `reach dev --no-agents` process.
pub async fn run(logs: &std::path::Path) -> Report {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let data = logs.join("overload-data");
    let mut dev = Service::new(
        "overload-dev",
        vec![
            "dev".into(),
            "--no-agents".into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--admin-listen".into(),
            String::new(),
            "--edge-listen".into(),
            String::new(),
            "--data-dir".into(),
            data.display().to_string(),
        ],
        logs,
        "try:",
    )
    .with_env("REACH_ROUTER__ADMISSION__MAX_WAIT", "100ms");
    dev.start();
    let endpoint = format!("http://127.0.0.1:{port}");

    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (agent, _) = {
        let (running, peak) = (running.clone(), peak.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        AgentRuntime::new(
            AgentConfig::new("fault.slow", endpoint.clone())
                .with_instance_id("fault.slow-1")
                .with_max_concurrency(LIMIT),
        )
        .handle(
            "fault.slow",
            "1.0.0",
            move |_ctx: HandlerContext, _message: ReachMessage| {
                let (running, peak) = (running.clone(), peak.clone());
                async move {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    // Works to the end whatever the caller does.
                    tokio::time::sleep(WORK).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok(Payload::text("fault.done", "done"))
                }
            },
        )
        .start(listener)
        .await
        .expect("the slow agent starts")
    };
    wait_routable(&endpoint).await;

    let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut report = Report::default();
    for deadline in DEADLINES {
        let callers = (0..CALLERS).map(|_| {
            let mut router = RouterServiceClient::new(channel.clone());
            tokio::spawn(async move {
                let mut outcomes = Vec::with_capacity(CALLS_EACH);
                for _ in 0..CALLS_EACH {
                    let started = Instant::now();
                    let mut request = tonic::Request::new(call());
                    request.set_timeout(deadline);
                    let result = router.call(request).await;
                    outcomes.push((result.map(drop), started.elapsed()));
                }
                outcomes
            })
        });
        // Meanwhile, what the agent sees: calls delivered to it and not yet finished.
        let all = futures::future::join_all(callers);
        tokio::pin!(all);
        let results = loop {
            tokio::select! {
                results = &mut all => break results,
                () = tokio::time::sleep(Duration::from_millis(1)) => {
                    report.max_concurrency =
                        report.max_concurrency.max(agent.in_flight() as usize);
                }
            }
        };
        for caller in results {
            for (result, elapsed) in caller.unwrap() {
                report.record(result, elapsed, deadline);
            }
        }
    }
    // Handlers still running for callers that left finish on their own.
    let started = Instant::now();
    while running.load(Ordering::SeqCst) > 0 && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    report.max_concurrency = report.max_concurrency.max(peak.load(Ordering::SeqCst));
    let _ = agent.drain().await;
    dev.kill();
    report
}

/// Waits (at most 10 s) until a call to `fault.slow` is answered.
async fn wait_routable(endpoint: &str) {
    let started = Instant::now();
    loop {
        if let Ok(mut router) = RouterServiceClient::connect(endpoint.to_string()).await
            && router.call(call()).await.is_ok()
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "fault.slow never became routable"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn call() -> CallRequest {
    CallRequest {
        message: Some(ReachMessage {
            header: Some(Header {
                target: Some(header::Target::Capability("fault.slow".into())),
                ..Default::default()
            }),
            payload: Some(Payload::text("fault.work", "work")),
        }),
    }
}
