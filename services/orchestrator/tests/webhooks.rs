//! Task webhooks end to end: a real orchestrator over SQLite (and PostgreSQL when
//! REACH_TEST_POSTGRES_URL is set), a test router, and a tiny HTTP receiver (axum on
//! 127.0.0.1:0) that records what it accepts. Waits are bounded polls of what the receiver or
//! GetTaskWebhook shows, never sleeps followed by asserts.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{REVIEW_V1, TestRouter, eventually, store_url};
use reach_orchestrator::{Orchestrator, OrchestratorConfig, Rendered, WebhookRenderer};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_rpc::errors::{reason, reason_of};
use serde_json::{Value, json};

type Client = OrchestratorServiceClient<tonic::transport::Channel>;

const LIMIT: Duration = Duration::from_secs(30);

// === the receiver ===

/// One accepted POST: its headers of interest and its body.
#[derive(Debug, Clone)]
struct Received {
    token: Option<String>,
    authorization: Option<String>,
    content_type: Option<String>,
    body: Value,
}

#[derive(Default)]
struct ReceiverState {
    accepted: Mutex<Vec<Received>>,
    /// Answer 500 to everything while set.
    refusing: AtomicBool,
    /// Accept at most this many POSTs (500 after); `usize::MAX` for no limit.
    accept_limit: AtomicUsize,
    /// Every POST seen, accepted or not.
    requests: AtomicUsize,
}

#[derive(Clone)]
struct Receiver {
    state: Arc<ReceiverState>,
    url: String,
}

impl Receiver {
    async fn start() -> Self {
        let state = Arc::new(ReceiverState {
            accept_limit: AtomicUsize::new(usize::MAX),
            ..Default::default()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(hook))
            .with_state(state.clone());
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { state, url }
    }

    fn accepted(&self) -> Vec<Received> {
        self.state.accepted.lock().unwrap().clone()
    }

    fn sequences(&self) -> Vec<u64> {
        self.accepted()
            .iter()
            .map(|r| r.body["sequence"].as_u64().unwrap())
            .collect()
    }
}

async fn hook(
    axum::extract::State(state): axum::extract::State<Arc<ReceiverState>>,
    headers: http::HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> http::StatusCode {
    state.requests.fetch_add(1, Ordering::SeqCst);
    let mut accepted = state.accepted.lock().unwrap();
    if state.refusing.load(Ordering::SeqCst)
        || accepted.len() >= state.accept_limit.load(Ordering::SeqCst)
    {
        return http::StatusCode::INTERNAL_SERVER_ERROR;
    }
    let header = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_string())
    };
    accepted.push(Received {
        token: header("x-a2a-notification-token"),
        authorization: header("authorization"),
        content_type: header("content-type"),
        body,
    });
    http::StatusCode::OK
}

// === the orchestrator ===

/// An orchestrator serving gRPC on 127.0.0.1:0; [`Orch::stop`] shuts it down and closes its
/// store (so another may open the same SQLite file).
struct Orch {
    client: Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl Orch {
    /// Fast polls and back-off; webhooks may reach loopback (where the receivers are).
    fn config(store_url: &str, router_url: &str) -> OrchestratorConfig {
        OrchestratorConfig {
            store_url: store_url.to_string(),
            router_endpoint: router_url.to_string(),
            poll_interval: Duration::from_millis(50),
            webhook_interval: Duration::from_millis(20),
            webhook_backoff: Duration::from_millis(10),
            webhook_backoff_max: Duration::from_millis(40),
            webhook_allowed_networks: vec!["127.0.0.0/8".parse().unwrap()],
            ..Default::default()
        }
    }

    async fn start(
        store_url: &str,
        router_url: &str,
        renderer: Option<Arc<dyn WebhookRenderer>>,
    ) -> Self {
        Self::start_with(Self::config(store_url, router_url), renderer).await
    }

    async fn start_with(
        config: OrchestratorConfig,
        renderer: Option<Arc<dyn WebhookRenderer>>,
    ) -> Self {
        let mut orch = Orchestrator::new(config).await.unwrap();
        if let Some(r) = renderer {
            orch = orch.with_webhook_renderer(r);
        }
        orch.engine()
            .flows()
            .apply("test", REVIEW_V1, orch.engine().clock().now_ms())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            orch.serve(listener, async move {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        let client = Client::connect(format!("http://{addr}")).await.unwrap();
        Self {
            client,
            stop: Some(tx),
            done: Some(done),
        }
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(done) = self.done.take() {
            done.await.unwrap();
        }
    }
}

impl Drop for Orch {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

async fn router() -> (TestRouter, String, tokio::sync::oneshot::Sender<()>) {
    let router = TestRouter::default();
    router.handle("test.act", |_| Ok(json!({"acted": true})));
    let (url, stop) = router.serve().await;
    (router, url, stop)
}

async fn start_review(c: &mut Client) -> String {
    c.start_task(pb::StartTaskRequest {
        flow_id: "review".into(),
        input: Some(reach_orchestrator::json::to_proto(&json!({"case": 7}))),
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .task
    .unwrap()
    .task_id
}

async fn wait_status(c: &Client, id: &str, status: pb::TaskStatus) -> pb::Task {
    eventually(&format!("task {id} {status:?}"), LIMIT, || {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            let t = c
                .get_task(pb::GetTaskRequest { task_id: id })
                .await
                .ok()?
                .into_inner()
                .task?;
            (t.status == status as i32).then_some(t)
        }
    })
    .await
}

async fn resume(c: &mut Client, id: &str) {
    c.resume_task(pb::ResumeTaskRequest {
        task_id: id.into(),
        node_id: String::new(),
        input: Some(reach_orchestrator::json::to_proto(
            &json!({"approved": true}),
        )),
    })
    .await
    .unwrap();
}

async fn create(c: &mut Client, r: pb::CreateTaskWebhookRequest) -> pb::TaskWebhook {
    c.create_task_webhook(r)
        .await
        .unwrap()
        .into_inner()
        .webhook
        .unwrap()
}

async fn get_webhook(c: &Client, task_id: &str, webhook_id: &str) -> Option<pb::TaskWebhook> {
    c.clone()
        .get_task_webhook(pb::GetTaskWebhookRequest {
            task_id: task_id.into(),
            webhook_id: webhook_id.into(),
        })
        .await
        .ok()?
        .into_inner()
        .webhook
}

/// Waits until GetTaskWebhook shows `delivered_sequence == seq`.
async fn wait_delivered(c: &Client, task_id: &str, webhook_id: &str, seq: u64) -> pb::TaskWebhook {
    eventually(
        &format!("webhook {webhook_id} delivered up to {seq}"),
        LIMIT,
        || async move {
            let w = get_webhook(c, task_id, webhook_id).await?;
            (w.delivered_sequence == seq).then_some(w)
        },
    )
    .await
}

/// Every event of the task, as WatchTask streams them (the stream ends with the task).
async fn events(c: &mut Client, id: &str) -> Vec<pb::TaskEvent> {
    let mut stream = c
        .watch_task(pb::WatchTaskRequest {
            task_id: id.into(),
            after_sequence: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(r) = stream.message().await.unwrap() {
        out.push(r.event.unwrap());
    }
    out
}

fn one_to(n: u64) -> Vec<u64> {
    (1..=n).collect()
}

macro_rules! both_backends {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                super::$name("sqlite").await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                super::$name("postgres").await;
            }
        }
    };
}

// === tests ===

both_backends!(every_event_arrives_once_in_order_with_the_token);
both_backends!(a_webhook_that_is_down_gets_every_event_later);

/// A webhook created on a running task receives every event of its log from sequence 1 —
/// the ones before it was created too — in order, each exactly once, as the `reach` JSON of
/// the event WatchTask streams, with the token and authorization headers.
async fn every_event_arrives_once_in_order_with_the_token(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store_url(backend, dir.path()).await else {
        return;
    };
    let (_router, router_url, _router_stop) = router().await;
    let receiver = Receiver::start().await;
    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    wait_status(&c, &id, pb::TaskStatus::WaitingHuman).await;
    let created = create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            task_id: id.clone(),
            url: receiver.url.clone(),
            token: "tok-1".into(),
            auth_scheme: "Bearer".into(),
            auth_credentials: "s3cret".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(created.format, "reach");
    assert_eq!(created.auth_credentials, "", "credentials are write-only");
    resume(&mut c, &id).await;
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;
    let hook = wait_delivered(&c, &id, &created.webhook_id, task.last_sequence).await;
    assert_eq!(hook.failed_attempts, 0);
    assert_eq!(hook.last_error, "");
    assert!(hook.next_attempt_at.is_none());

    let accepted = receiver.accepted();
    assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    let watched: Vec<Value> = events(&mut c, &id)
        .await
        .iter()
        .map(reach_orchestrator::json::event_json)
        .collect();
    let bodies: Vec<Value> = accepted.iter().map(|r| r.body.clone()).collect();
    assert_eq!(bodies, watched);
    assert_eq!(bodies[0]["task_id"], id.as_str());
    assert_eq!(bodies.last().unwrap()["status"], "SUCCEEDED");
    for r in &accepted {
        assert_eq!(r.token.as_deref(), Some("tok-1"));
        assert_eq!(r.authorization.as_deref(), Some("Bearer s3cret"));
        assert_eq!(r.content_type.as_deref(), Some("application/json"));
    }
    // An ended task whose events are all delivered is not polled: nothing more is sent.
    assert_eq!(
        receiver.state.requests.load(Ordering::SeqCst),
        accepted.len()
    );
    orch.stop().await;
}

/// A receiver that answers 500 gets nothing recorded as delivered; the failures show in
/// GetTaskWebhook; once it recovers it gets every event, in order, none lost, none twice.
async fn a_webhook_that_is_down_gets_every_event_later(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store_url(backend, dir.path()).await else {
        return;
    };
    let (_router, router_url, _router_stop) = router().await;
    let receiver = Receiver::start().await;
    receiver.state.refusing.store(true, Ordering::SeqCst);
    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    let hook = create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "down".into(),
            url: receiver.url.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(hook.webhook_id, "down");
    let failing = eventually("several failed attempts", LIMIT, || async {
        let w = get_webhook(&c, &id, "down").await?;
        (w.failed_attempts >= 3).then_some(w)
    })
    .await;
    assert_eq!(failing.delivered_sequence, 0);
    assert!(failing.next_attempt_at.is_some(), "a retry is scheduled");
    assert_eq!(
        failing.last_error,
        "the webhook answered HTTP 500 Internal Server Error"
    );
    assert!(receiver.accepted().is_empty());
    resume(&mut c, &id).await;
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;

    receiver.state.refusing.store(false, Ordering::SeqCst);
    let hook = wait_delivered(&c, &id, "down", task.last_sequence).await;
    assert_eq!(hook.failed_attempts, 0);
    assert_eq!(hook.last_error, "");
    assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    assert!(receiver.accepted().iter().all(|r| r.token.is_none()));
    orch.stop().await;
}

/// The webhook and its progress survive a restart on the same SQLite file: delivery goes on
/// from the stored `delivered_sequence`, with nothing sent twice, and events appended after
/// the restart follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_resumes_after_a_restart_from_the_stored_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/o.db", dir.path().display());
    let (_router, router_url, _router_stop) = router().await;
    let receiver = Receiver::start().await;
    receiver.state.accept_limit.store(2, Ordering::SeqCst);

    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    let waiting = wait_status(&c, &id, pb::TaskStatus::WaitingHuman).await;
    assert!(waiting.last_sequence > 2, "{waiting:?}");
    create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "w".into(),
            url: receiver.url.clone(),
            token: "t".into(),
            ..Default::default()
        },
    )
    .await;
    eventually("two accepted, then a failure", LIMIT, || async {
        let w = get_webhook(&c, &id, "w").await?;
        (w.delivered_sequence == 2 && w.failed_attempts >= 1).then_some(())
    })
    .await;
    orch.stop().await;

    receiver
        .state
        .accept_limit
        .store(usize::MAX, Ordering::SeqCst);
    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let hook = get_webhook(&c, &id, "w").await.unwrap();
    assert!(hook.delivered_sequence >= 2);
    assert_eq!(hook.token, "t");
    wait_delivered(&c, &id, "w", waiting.last_sequence).await;
    resume(&mut c, &id).await;
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;
    wait_delivered(&c, &id, "w", task.last_sequence).await;
    assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    orch.stop().await;
}

/// Two replicas on one PostgreSQL store lease each webhook: every event arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_deliver_each_event_once() {
    let Some(url) = common::postgres_url().await else {
        return;
    };
    let (_router, router_url, _router_stop) = router().await;
    let a = Orch::start(&url, &router_url, None).await;
    let b = Orch::start(&url, &router_url, None).await;
    let mut c = a.client.clone();
    let mut receivers = Vec::new();
    let mut ids = Vec::new();
    for i in 0..4 {
        let receiver = Receiver::start().await;
        let id = start_review(&mut c).await;
        create(
            &mut c,
            pb::CreateTaskWebhookRequest {
                task_id: id.clone(),
                webhook_id: format!("w{i}"),
                url: receiver.url.clone(),
                ..Default::default()
            },
        )
        .await;
        receivers.push(receiver);
        ids.push(id);
    }
    for id in &ids {
        wait_status(&c, id, pb::TaskStatus::WaitingHuman).await;
        resume(&mut c, id).await;
    }
    for (i, (id, receiver)) in ids.iter().zip(&receivers).enumerate() {
        let task = wait_status(&c, id, pb::TaskStatus::Succeeded).await;
        wait_delivered(&b.client, id, &format!("w{i}"), task.last_sequence).await;
        assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    }
    a.stop().await;
    b.stop().await;
}

/// A renderer registered on the orchestrator is a format CreateTaskWebhook accepts; its
/// notifications (here: only the one of the event that ends the task) are what is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_renderer_makes_the_bodies() {
    struct Ends;
    impl WebhookRenderer for Ends {
        fn format(&self) -> &'static str {
            "ends"
        }
        fn render(&self, task: &pb::Task, events: &[pb::TaskEvent]) -> Vec<Rendered> {
            events
                .iter()
                .filter(|e| e.kind == "task_ended")
                .map(|e| Rendered {
                    sequence: e.sequence,
                    body: json!({"sequence": e.sequence, "task": task.task_id}),
                })
                .collect()
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/o.db", dir.path().display());
    let (_router, router_url, _router_stop) = router().await;
    let receiver = Receiver::start().await;
    let orch = Orch::start(&url, &router_url, Some(Arc::new(Ends))).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "ends".into(),
            url: receiver.url.clone(),
            format: "ends".into(),
            ..Default::default()
        },
    )
    .await;
    let waiting = wait_status(&c, &id, pb::TaskStatus::WaitingHuman).await;
    // Events that make no notification count as delivered.
    wait_delivered(&c, &id, "ends", waiting.last_sequence).await;
    assert!(receiver.accepted().is_empty());
    resume(&mut c, &id).await;
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;
    wait_delivered(&c, &id, "ends", task.last_sequence).await;
    let bodies: Vec<Value> = receiver.accepted().into_iter().map(|r| r.body).collect();
    assert_eq!(
        bodies,
        [json!({"sequence": task.last_sequence, "task": id})]
    );
    orch.stop().await;
}

/// Bad URLs, unknown formats, unknown tasks and a 17th webhook are refused with their
/// reasons; replacing by id keeps the count and the progress; lists page; delete removes.
/// Webhooks reach public addresses only, unless the operator allows a network: an IP-literal
/// loopback or cloud-metadata URL is refused when it is created, and a name that resolves to
/// loopback is refused on each delivery (the receiver gets nothing; GetTaskWebhook says why).
/// Nothing is lost: once loopback is allowed, the same webhook gets every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_reach_internal_addresses_only_where_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/o.db", dir.path().display());
    let (_router, router_url, _router_stop) = router().await;
    let receiver = Receiver::start().await;
    let public_only = OrchestratorConfig {
        webhook_allowed_networks: Vec::new(),
        ..Orch::config(&url, &router_url)
    };
    let orch = Orch::start_with(public_only, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    let request = |url: &str| pb::CreateTaskWebhookRequest {
        task_id: id.clone(),
        webhook_id: "hook".into(),
        url: url.into(),
        ..Default::default()
    };
    for (literal, range) in [
        (receiver.url.as_str(), "loopback"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),
        ("http://[::ffff:10.0.0.1]:8080/hook", "private"),
    ] {
        let e = c.create_task_webhook(request(literal)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{literal}");
        assert_eq!(reason_of(&e).as_deref(), Some(reason::INVALID_WEBHOOK));
        assert!(
            e.message().starts_with("webhook url is not valid: ")
                && e.message().contains(&format!("is a {range} ("))
                && e.message()
                    .contains("orchestrator.webhook_allowed_networks"),
            "{literal}: {}",
            e.message()
        );
    }

    let by_name = receiver.url.replace("127.0.0.1", "localhost");
    create(&mut c, request(&by_name)).await;
    let refused = eventually("a refused delivery recorded", LIMIT, || {
        let c = c.clone();
        let id = id.clone();
        async move {
            let w = get_webhook(&c, &id, "hook").await?;
            (w.failed_attempts > 0).then_some(w)
        }
    })
    .await;
    assert!(
        refused.last_error.contains("localhost: ")
            && refused
                .last_error
                .contains("is a loopback (RFC 1122) address"),
        "{}",
        refused.last_error
    );
    assert_eq!(refused.delivered_sequence, 0);
    assert_eq!(receiver.state.requests.load(Ordering::SeqCst), 0);
    orch.stop().await;

    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    resume(&mut c, &id).await;
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;
    wait_delivered(&c, &id, "hook", task.last_sequence).await;
    assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    orch.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_requests_are_validated() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/o.db", dir.path().display());
    let (_router, router_url, _router_stop) = router().await;
    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    let request = |webhook_id: &str, url: &str| pb::CreateTaskWebhookRequest {
        task_id: id.clone(),
        webhook_id: webhook_id.into(),
        // Nothing listens on port 9: deliveries fail, which this test does not mind.
        url: url.into(),
        ..Default::default()
    };

    let e = c
        .create_task_webhook(request("", "ftp://example.com/hook"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(reason_of(&e).as_deref(), Some(reason::INVALID_WEBHOOK));
    assert_eq!(
        e.message(),
        "webhook url is not valid: its scheme is \"ftp\"; use http or https"
    );
    let e = c
        .create_task_webhook(pb::CreateTaskWebhookRequest {
            format: "a2a".into(),
            ..request("", "http://127.0.0.1:9/hook")
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(reason_of(&e).as_deref(), Some(reason::INVALID_WEBHOOK));
    assert!(
        e.message().contains("use one of [reach]"),
        "{}",
        e.message()
    );
    let e = c
        .create_task_webhook(pb::CreateTaskWebhookRequest {
            task_id: "nope".into(),
            ..request("", "http://127.0.0.1:9/hook")
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert_eq!(reason_of(&e).as_deref(), Some(reason::TASK_NOT_FOUND));

    for i in 0..16 {
        create(
            &mut c,
            request(&format!("w{i:02}"), "http://127.0.0.1:9/hook"),
        )
        .await;
    }
    let e = c
        .create_task_webhook(request("", "http://127.0.0.1:9/hook"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason_of(&e).as_deref(), Some(reason::TOO_MANY_WEBHOOKS));
    // Replacing an existing id is not a new webhook.
    let replaced = create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            auth_scheme: "Basic".into(),
            auth_credentials: "dXNlcjpwYXNz".into(),
            ..request("w03", "https://example.com/other")
        },
    )
    .await;
    assert_eq!(replaced.url, "https://example.com/other");
    assert_eq!(replaced.auth_credentials, "");
    assert_eq!(replaced.auth_scheme, "Basic");

    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = c
            .list_task_webhooks(pb::ListTaskWebhooksRequest {
                task_id: id.clone(),
                page_size: 5,
                page_token: token.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.webhooks.len() <= 5);
        assert!(page.webhooks.iter().all(|w| w.auth_credentials.is_empty()));
        seen.extend(page.webhooks.into_iter().map(|w| w.webhook_id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    seen.sort();
    let want: Vec<String> = (0..16).map(|i| format!("w{i:02}")).collect();
    assert_eq!(seen, want);

    c.delete_task_webhook(pb::DeleteTaskWebhookRequest {
        task_id: id.clone(),
        webhook_id: "w00".into(),
    })
    .await
    .unwrap();
    let e = c
        .get_task_webhook(pb::GetTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "w00".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert_eq!(reason_of(&e).as_deref(), Some(reason::WEBHOOK_NOT_FOUND));
    let e = c
        .delete_task_webhook(pb::DeleteTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "w00".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    // A slot is free again.
    create(&mut c, request("", "http://127.0.0.1:9/hook")).await;
    // Nothing listens on port 9: the failure says so, and a retry is scheduled.
    let failed = eventually("a connect failure", LIMIT, || async {
        let w = get_webhook(&c, &id, "w01").await?;
        (w.failed_attempts >= 1).then_some(w)
    })
    .await;
    assert!(
        failed.last_error.starts_with("cannot reach the webhook: ")
            && failed.last_error.contains("onnect"),
        "{}",
        failed.last_error
    );
    assert_eq!(failed.delivered_sequence, 0);
    orch.stop().await;
}

both_backends!(a_retried_task_sends_its_new_events);

/// A webhook of a task that ended and was sent everything is parked; RetryTask makes it due
/// again and it is sent the events of the retry, after the ones it had.
async fn a_retried_task_sends_its_new_events(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let Some(url) = store_url(backend, dir.path()).await else {
        return;
    };
    let router = TestRouter::default();
    let broken = Arc::new(AtomicBool::new(true));
    let flag = broken.clone();
    router.handle("test.act", move |_| {
        if flag.load(Ordering::SeqCst) {
            Err(tonic::Status::invalid_argument("not today"))
        } else {
            Ok(json!({"acted": true}))
        }
    });
    let (router_url, _router_stop) = router.serve().await;
    let receiver = Receiver::start().await;
    let orch = Orch::start(&url, &router_url, None).await;
    let mut c = orch.client.clone();
    let id = start_review(&mut c).await;
    create(
        &mut c,
        pb::CreateTaskWebhookRequest {
            task_id: id.clone(),
            webhook_id: "r".into(),
            url: receiver.url.clone(),
            ..Default::default()
        },
    )
    .await;
    wait_status(&c, &id, pb::TaskStatus::WaitingHuman).await;
    resume(&mut c, &id).await;
    let failed = wait_status(&c, &id, pb::TaskStatus::Failed).await;
    wait_delivered(&c, &id, "r", failed.last_sequence).await;
    assert_eq!(receiver.sequences(), one_to(failed.last_sequence));

    broken.store(false, Ordering::SeqCst);
    c.retry_task(pb::RetryTaskRequest {
        task_id: id.clone(),
    })
    .await
    .unwrap();
    let task = wait_status(&c, &id, pb::TaskStatus::Succeeded).await;
    assert!(task.last_sequence > failed.last_sequence);
    wait_delivered(&c, &id, "r", task.last_sequence).await;
    assert_eq!(receiver.sequences(), one_to(task.last_sequence));
    orch.stop().await;
}
