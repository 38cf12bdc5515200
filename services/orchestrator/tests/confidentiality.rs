//! Task confidentiality with trust on and a policy, against a real orchestrator server on
//! 127.0.0.1 authenticating bearer tokens: lists and their page tokens show only what the
//! caller may view, a hidden task answers exactly as an unknown id, StartTask does not name
//! another's flow, ListFlows is filtered, RetryTask needs `retry`, webhook tokens are shown
//! only to the task's starter and operators, and WatchTask streams are capped per caller.

mod common;

use std::time::Duration;

use common::{REVIEW_V1, TestRouter, eventually};
use reach_orchestrator::{Orchestrator, OrchestratorConfig};
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_rpc::errors::{metadata_of, reason_of};
use reach_trust::TrustConfig;
use reach_trust::token::JwtConfig;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Status};

const TD: &str = "reach.local";

const FAILS: &str = r#"
id: fails
version: 1
initial: act
states:
  act: {type: task, capability: test.missing, retry: {max_attempts: 1}, next: done}
  done: {type: succeed}
"#;

const SECRET: &str = r#"
id: secret-flow
version: 1
initial: done
states:
  done: {type: succeed}
"#;

/// alice may start and view `review` and `fails`; bob may view `review`; carol may only
/// start `review` (she sees her own tasks as their starter); dave has no rule.
const POLICY: &str = r#"
tasks:
  - identities: ["spiffe://reach.local/user/alice"]
    flows: ["review", "fails"]
    actions: [start, view]
  - identities: ["spiffe://reach.local/user/bob"]
    flows: ["review"]
    actions: [view]
  - identities: ["spiffe://reach.local/user/carol"]
    flows: ["review"]
    actions: [start]
"#;

/// Sends `authorization: Bearer <token>` with every call.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        request
            .metadata_mut()
            .insert("authorization", self.0.clone());
        Ok(request)
    }
}

type Client = OrchestratorServiceClient<InterceptedService<Channel, Bearer>>;

struct Mesh {
    orch: std::sync::Arc<Orchestrator>,
    channel: Channel,
    key: String,
    _router: TestRouter,
    _stops: Vec<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Mesh {
    async fn start(max_watches: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (private, public) = reach_trust::issue::token_signing_key().unwrap();
        let key_path = dir.path().join("token.pub");
        std::fs::write(&key_path, public).unwrap();
        let policy = dir.path().join("policy.yaml");
        std::fs::write(&policy, POLICY).unwrap();
        let flows = dir.path().join("flows");
        std::fs::create_dir_all(&flows).unwrap();
        for (name, yaml) in [("review", REVIEW_V1), ("fails", FAILS), ("secret", SECRET)] {
            std::fs::write(flows.join(format!("{name}.yaml")), yaml).unwrap();
        }
        let trust = reach_trust::Trust::load(&TrustConfig {
            trust_domain: TD.into(),
            policy: Some(policy),
            jwt: Some(JwtConfig::new(vec![key_path])),
            ..TrustConfig::default()
        })
        .unwrap();
        let router = TestRouter::default();
        let (router_url, router_stop) = router.serve().await;
        let config = OrchestratorConfig {
            store_url: format!("sqlite://{}/o.db", dir.path().display()),
            router_endpoint: router_url,
            poll_interval: Duration::from_millis(50),
            flows_dir: Some(flows),
            watch_flows: false,
            max_watches_per_caller: max_watches,
            webhook_allowed_networks: vec!["127.0.0.0/8".parse().unwrap()],
            ..Default::default()
        };
        let orch = std::sync::Arc::new(
            Orchestrator::with_trust(config, trust.clone())
                .await
                .unwrap(),
        );
        let running = orch.start().unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = orch.grpc_service();
        tokio::spawn(async move {
            reach_rpc::GrpcServer::new()
                .with_trust(trust)
                .add_service(svc)
                .serve(listener, async move {
                    let _ = rx.await;
                })
                .await
                .unwrap();
            running.shutdown().await;
        });
        let channel = Channel::from_shared(endpoint)
            .unwrap()
            .connect()
            .await
            .unwrap();
        Self {
            orch,
            channel,
            key: private,
            _router: router,
            _stops: vec![tx, router_stop],
            _dir: dir,
        }
    }

    /// A client calling as `subject` (a user name, or a SPIFFE id).
    fn client(&self, subject: &str) -> Client {
        let claims = reach_trust::token::claims(subject, "reach", None, Duration::from_secs(600));
        let token = reach_trust::token::sign(self.key.as_bytes(), &claims.into()).unwrap();
        OrchestratorServiceClient::with_interceptor(
            self.channel.clone(),
            Bearer(format!("Bearer {token}").parse().unwrap()),
        )
    }

    fn operator(&self) -> Client {
        self.client("spiffe://reach.local/operator/ops")
    }
}

async fn start(c: &mut Client, flow: &str, task_id: &str) -> pb::Task {
    c.start_task(pb::StartTaskRequest {
        flow_id: flow.into(),
        task_id: task_id.into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("start {task_id}: {e:?}"))
    .into_inner()
    .task
    .unwrap()
}

async fn wait_status(c: &mut Client, id: &str, status: pb::TaskStatus) {
    eventually(&format!("{id} {status:?}"), Duration::from_secs(20), || {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            let t = c
                .get_task(pb::GetTaskRequest { task_id: id })
                .await
                .ok()?
                .into_inner()
                .task?;
            (t.status == status as i32).then_some(())
        }
    })
    .await;
}

/// Every task id `c` sees paging ListTasks `page_size` at a time, and the tokens it was given.
async fn page_all(c: &mut Client, page_size: u32) -> (Vec<String>, Vec<String>) {
    let (mut ids, mut tokens) = (Vec::new(), Vec::new());
    let mut token = String::new();
    for _ in 0..100 {
        let page = c
            .list_tasks(pb::ListTasksRequest {
                page_size,
                page_token: token.clone(),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.tasks.len() <= page_size as usize);
        ids.extend(page.tasks.into_iter().map(|t| t.task_id));
        if page.next_page_token.is_empty() {
            return (ids, tokens);
        }
        tokens.push(page.next_page_token.clone());
        token = page.next_page_token;
    }
    panic!("paging never ended");
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

fn assert_refused(
    result: Result<impl std::fmt::Debug, Status>,
    code: Code,
    reason: &str,
) -> Status {
    let status = result.expect_err("refused");
    assert_eq!(status.code(), code, "{status:?}");
    assert_eq!(reason_of(&status).as_deref(), Some(reason), "{status:?}");
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_and_their_page_tokens_show_only_visible_tasks() {
    let mesh = Mesh::start(8).await;
    let (mut alice, mut carol, mut dave) = (
        mesh.client("alice"),
        mesh.client("carol"),
        mesh.client("dave"),
    );
    for i in 0..3 {
        start(&mut alice, "review", &format!("alice-{i}")).await;
    }
    for i in 0..2 {
        start(&mut carol, "review", &format!("carol-{i}")).await;
    }
    start(&mut alice, "fails", "alice-fails").await;
    wait_status(&mut alice, "alice-fails", pb::TaskStatus::Failed).await;

    // dave may view nothing: no task and no token, whatever the page size; the same for
    // dead letters.
    for page_size in [1, 50] {
        let page = dave
            .list_tasks(pb::ListTasksRequest {
                page_size,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(page.tasks.is_empty(), "{page:?}");
        assert_eq!(
            page.next_page_token, "",
            "no token for a caller who sees nothing"
        );
        let dead = dave
            .list_dead_letters(pb::ListDeadLettersRequest {
                page_size,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(dead.dead_letters.is_empty());
        assert_eq!(dead.next_page_token, "");
    }

    // carol pages one at a time through her own two tasks, and nothing else.
    let (ids, tokens) = page_all(&mut carol, 1).await;
    assert_eq!(sorted(ids), ["carol-0", "carol-1"]);
    assert_eq!(tokens.len(), 1, "a token only where a visible task follows");
    for token in &tokens {
        for id in ["alice-", "carol-", ":"] {
            assert!(!token.contains(id), "token {token} is opaque");
        }
    }
    // alice (view on the flow) sees all six, one page at a time.
    let (ids, _) = page_all(&mut alice, 1).await;
    assert_eq!(ids.len(), 6, "{ids:?}");
    // alice's dead letters: hers; carol's: none.
    let dead = alice
        .list_dead_letters(pb::ListDeadLettersRequest::default())
        .await
        .unwrap()
        .into_inner();
    let dead: Vec<_> = dead
        .dead_letters
        .into_iter()
        .map(|d| d.task.unwrap().task_id)
        .collect();
    assert_eq!(dead, ["alice-fails"]);

    // A token is good only for the query and caller it was issued to; raw cursors and
    // garbage are refused, not answered with an empty page.
    let token = tokens[0].clone();
    let forged = [
        (mesh.client("alice"), token.clone(), String::new()),
        (mesh.client("carol"), token.clone(), "fails".to_string()),
        (
            mesh.client("carol"),
            "1764000000000:alice-0".into(),
            String::new(),
        ),
        (mesh.client("carol"), "AAAA".into(), String::new()),
    ];
    for (mut c, page_token, flow_id) in forged {
        assert_refused(
            c.list_tasks(pb::ListTasksRequest {
                page_size: 1,
                page_token,
                flow_id,
                ..Default::default()
            })
            .await,
            Code::InvalidArgument,
            "INVALID_PAGE_TOKEN",
        );
    }
    assert_refused(
        carol
            .list_dead_letters(pb::ListDeadLettersRequest {
                page_size: 1,
                page_token: token,
                ..Default::default()
            })
            .await,
        Code::InvalidArgument,
        "INVALID_PAGE_TOKEN",
    );
}

/// `status` with every occurrence of `from` replaced by `to` (same length) in its message
/// and details: the answer about one id made comparable with the answer about another.
fn renamed(status: &Status, from: &str, to: &str) -> (Code, String, Vec<u8>) {
    assert_eq!(from.len(), to.len());
    let details = status.details().to_vec();
    let mut out = Vec::with_capacity(details.len());
    let mut i = 0;
    while i < details.len() {
        if details[i..].starts_with(from.as_bytes()) {
            out.extend_from_slice(to.as_bytes());
            i += from.len();
        } else {
            out.push(details[i]);
            i += 1;
        }
    }
    (status.code(), status.message().replace(from, to), out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hidden_task_answers_exactly_as_an_unknown_id() {
    let mesh = Mesh::start(8).await;
    let (mut alice, mut carol) = (mesh.client("alice"), mesh.client("carol"));
    let (hidden, unknown) = ("hidden-0001", "hidden-0002");
    start(&mut alice, "review", hidden).await;
    wait_status(&mut alice, hidden, pb::TaskStatus::WaitingHuman).await;

    // Each RPC naming a task, as carol (who may not view alice's task) sends it.
    async fn ask(c: &mut Client, rpc: &str, id: &str) -> Status {
        let id = id.to_string();
        let result: Result<(), Status> = match rpc {
            "GetTask" => c
                .get_task(pb::GetTaskRequest { task_id: id })
                .await
                .map(drop),
            "WatchTask" => c
                .watch_task(pb::WatchTaskRequest {
                    task_id: id,
                    after_sequence: 0,
                })
                .await
                .map(drop),
            "DumpTask" => c
                .dump_task(pb::DumpTaskRequest { task_id: id })
                .await
                .map(drop),
            "ResumeTask" => c
                .resume_task(pb::ResumeTaskRequest {
                    task_id: id,
                    ..Default::default()
                })
                .await
                .map(drop),
            "CancelTask" => c
                .cancel_task(pb::CancelTaskRequest {
                    task_id: id,
                    reason: "probe".into(),
                })
                .await
                .map(drop),
            "RetryTask" => c
                .retry_task(pb::RetryTaskRequest { task_id: id })
                .await
                .map(drop),
            "ListTaskWebhooks" => c
                .list_task_webhooks(pb::ListTaskWebhooksRequest {
                    task_id: id,
                    ..Default::default()
                })
                .await
                .map(drop),
            "GetTaskWebhook" => c
                .get_task_webhook(pb::GetTaskWebhookRequest {
                    task_id: id,
                    webhook_id: "w".into(),
                })
                .await
                .map(drop),
            "CreateTaskWebhook" => c
                .create_task_webhook(pb::CreateTaskWebhookRequest {
                    task_id: id,
                    url: "http://127.0.0.1:9/hook".into(),
                    ..Default::default()
                })
                .await
                .map(drop),
            "DeleteTaskWebhook" => c
                .delete_task_webhook(pb::DeleteTaskWebhookRequest {
                    task_id: id,
                    webhook_id: "w".into(),
                })
                .await
                .map(drop),
            other => unreachable!("{other}"),
        };
        result.expect_err(rpc)
    }
    for rpc in [
        "GetTask",
        "WatchTask",
        "DumpTask",
        "ResumeTask",
        "CancelTask",
        "RetryTask",
        "ListTaskWebhooks",
        "GetTaskWebhook",
        "CreateTaskWebhook",
        "DeleteTaskWebhook",
    ] {
        let of_hidden = ask(&mut carol, rpc, hidden).await;
        let of_unknown = ask(&mut carol, rpc, unknown).await;
        assert_eq!(of_unknown.code(), Code::NotFound, "{rpc}: {of_unknown:?}");
        assert_eq!(reason_of(&of_unknown).as_deref(), Some("TASK_NOT_FOUND"));
        assert_eq!(
            renamed(&of_hidden, hidden, unknown),
            renamed(&of_unknown, unknown, unknown),
            "{rpc}: the hidden task's answer differs from an unknown id's"
        );
        assert!(
            !of_hidden.message().contains("alice"),
            "{rpc}: {of_hidden:?}"
        );
    }

    // StartTask with alice's id: taken, without her flow; carol's own id is idempotent.
    let taken = assert_refused(
        carol
            .start_task(pb::StartTaskRequest {
                flow_id: "review".into(),
                task_id: hidden.into(),
                ..Default::default()
            })
            .await,
        Code::AlreadyExists,
        "TASK_ID_IN_USE",
    );
    assert!(!taken.message().contains("review"), "{taken:?}");
    assert!(!taken.message().contains("alice"), "{taken:?}");
    assert_eq!(
        metadata_of(&taken).keys().collect::<Vec<_>>(),
        ["task_id"],
        "{taken:?}"
    );
    let first = start(&mut carol, "review", "carol-own").await;
    let again = start(&mut carol, "review", "carol-own").await;
    assert_eq!(first.task_id, again.task_id);
    assert_eq!(first.created_at, again.created_at);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_retry_and_webhook_tokens_follow_the_policy() {
    let mesh = Mesh::start(8).await;
    let (mut alice, mut bob, mut carol, mut dave, mut ops) = (
        mesh.client("alice"),
        mesh.client("bob"),
        mesh.client("carol"),
        mesh.client("dave"),
        mesh.operator(),
    );

    // ListFlows: what the caller may start or view; operators see all.
    async fn flows(c: &mut Client) -> Vec<String> {
        let mut ids: Vec<String> = c
            .list_flows(pb::ListFlowsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .flows
            .into_iter()
            .map(|f| f.flow_id)
            .collect();
        ids.sort();
        ids
    }
    assert_eq!(flows(&mut alice).await, ["fails", "review"]);
    assert_eq!(flows(&mut carol).await, ["review"]);
    assert!(flows(&mut dave).await.is_empty());
    assert_eq!(flows(&mut ops).await, ["fails", "review", "secret-flow"]);
    let one = dave
        .list_flows(pb::ListFlowsRequest {
            flow_id: "secret-flow".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(one.flows.is_empty(), "no YAML of a flow dave may not see");

    // RetryTask: alice started the failed task and may view it, but `retry` is not hers.
    start(&mut alice, "fails", "alice-fails").await;
    wait_status(&mut alice, "alice-fails", pb::TaskStatus::Failed).await;
    let denied = assert_refused(
        alice
            .retry_task(pb::RetryTaskRequest {
                task_id: "alice-fails".into(),
            })
            .await,
        Code::PermissionDenied,
        "NOT_AUTHORIZED",
    );
    assert!(denied.message().contains("retry"), "{denied:?}");
    ops.retry_task(pb::RetryTaskRequest {
        task_id: "alice-fails".into(),
    })
    .await
    .expect("an operator retries");

    // Webhook tokens: the starter and operators see them; bob, a viewer, does not.
    start(&mut alice, "review", "hooked").await;
    let created = alice
        .create_task_webhook(pb::CreateTaskWebhookRequest {
            task_id: "hooked".into(),
            webhook_id: "w1".into(),
            url: "http://127.0.0.1:9/hook".into(),
            token: "s3cr3t-webhook-token".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .webhook
        .unwrap();
    assert_eq!(created.token, "s3cr3t-webhook-token");
    let get = |c: &mut Client| {
        let mut c = c.clone();
        async move {
            let one = c
                .get_task_webhook(pb::GetTaskWebhookRequest {
                    task_id: "hooked".into(),
                    webhook_id: "w1".into(),
                })
                .await
                .unwrap()
                .into_inner()
                .webhook
                .unwrap();
            let listed = c
                .list_task_webhooks(pb::ListTaskWebhooksRequest {
                    task_id: "hooked".into(),
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner()
                .webhooks;
            assert_eq!(listed.len(), 1);
            (one.token, listed[0].token.clone(), one.url)
        }
    };
    let (one, listed, url) = get(&mut bob).await;
    assert_eq!(
        (one.as_str(), listed.as_str()),
        ("", ""),
        "hidden from a viewer"
    );
    assert_eq!(url, "http://127.0.0.1:9/hook", "the rest is shown");
    for c in [&mut alice, &mut ops] {
        let (one, listed, _) = get(c).await;
        assert_eq!(
            (one.as_str(), listed.as_str()),
            ("s3cr3t-webhook-token", "s3cr3t-webhook-token")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_streams_are_capped_per_caller_and_freed_when_dropped() {
    let mesh = Mesh::start(2).await;
    let (mut alice, mut carol) = (mesh.client("alice"), mesh.client("carol"));
    start(&mut carol, "review", "carol-w").await;
    let watch = |c: &mut Client| {
        let mut c = c.clone();
        async move {
            c.watch_task(pb::WatchTaskRequest {
                task_id: "carol-w".into(),
                after_sequence: 0,
            })
            .await
        }
    };
    let first = watch(&mut carol).await.unwrap().into_inner();
    let _second = watch(&mut carol).await.unwrap().into_inner();
    let refused = assert_refused(
        watch(&mut carol).await,
        Code::ResourceExhausted,
        "TOO_MANY_WATCHES",
    );
    let meta = metadata_of(&refused);
    assert_eq!(meta["identity"], "spiffe://reach.local/user/carol");
    assert_eq!(meta["limit"], "2");
    assert!(
        refused.message().contains("max_watches_per_caller"),
        "{refused:?}"
    );
    // Another caller has its own slots.
    let _alices = watch(&mut alice).await.expect("alice has her own slots");
    // Dropping a stream frees its slot.
    drop(first);
    let api = mesh.orch.api().clone();
    eventually(
        "the dropped watch's slot is freed",
        Duration::from_secs(10),
        || {
            let open = api.open_watches("spiffe://reach.local/user/carol");
            async move { (open == 1).then_some(()) }
        },
    )
    .await;
    let _third = watch(&mut carol).await.expect("a slot is free again");
}
