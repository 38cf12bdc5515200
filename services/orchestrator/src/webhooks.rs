//! Task webhooks: the delivery half of push notifications, from the durable event log.
//!
//! A webhook (a row of `reach_webhooks`, see [`crate::store::WebhookRow`]) names a task, a
//! URL and a `format`. The [`WebhookRenderer`] registered for that format turns the task's
//! whole masked event log (the `pb::TaskEvent`s WatchTask streams, from sequence 1) into
//! notifications, each tagged with the sequence number of the event it came from; the
//! delivery loop ([`spawn`]) POSTs those after the webhook's `delivered_seq`, in order, and
//! advances `delivered_seq` durably after each accepted one. A webhook that fails (connect
//! error, timeout, non-2xx) is retried with exponential back-off and gets every event later,
//! none lost. Replicas sharing a PostgreSQL store lease webhooks
//! ([`crate::store::Store::claim_webhooks`]), so two never deliver the same webhook at once.
//!
//! A webhook whose task ended and that was sent every event is parked: kept (GetTaskWebhook
//! shows it until the task is purged with its webhooks) but not polled; RetryTask makes it due
//! again.
//!
//! Delivery is at least once: a replica that crashes after a POST was accepted but before it
//! recorded it sends that notification again. Receivers deduplicate by sequence number.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt as _;
use reach_proto::v1 as pb;

use crate::error::Error;
use crate::event::TaskState;
use crate::service::OrchestratorApi;
use crate::store::{WEBHOOK_PARKED_MS, WebhookRow};

/// The most webhooks one task may have.
pub const MAX_WEBHOOKS_PER_TASK: usize = 16;
/// The longest webhook URL, in bytes.
pub const MAX_URL_BYTES: usize = 2048;
/// The longest `token` or `auth_credentials`, in bytes.
pub const MAX_SECRET_BYTES: usize = 4096;
/// The longest `auth_scheme`, in bytes.
pub const MAX_SCHEME_BYTES: usize = 64;
/// The format of webhooks created without one.
pub const DEFAULT_FORMAT: &str = "reach";
/// How long one POST may take before it counts as failed.
pub const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a replica holds a webhook it delivers to (renewed after every accepted POST).
pub const LEASE: Duration = Duration::from_secs(30);
/// The most webhooks one delivery turn claims.
pub const MAX_WEBHOOKS_PER_TURN: u32 = 64;
/// The most POSTs one delivery turn makes (over all its webhooks).
pub const MAX_POSTS_PER_TURN: usize = 256;
/// Tasks whose webhooks are delivered to at the same time within a turn, and webhooks of
/// one task at the same time: at most 8 × 4 POSTs in flight, so a few slow receivers do not
/// hold up the others, and the store's small pool is not drained by delivery bookkeeping.
const CONCURRENT_TASKS: usize = 8;
const CONCURRENT_WEBHOOKS_PER_TASK: usize = 4;

/// One notification a renderer made.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The sequence number of the event it came from: the webhook's `delivered_seq` becomes
    /// this once it is accepted.
    pub sequence: u64,
    /// The JSON body POSTed.
    pub body: serde_json::Value,
}

/// Makes the notification bodies of one webhook `format` (`reach` is built in; the A2A
/// edge registers `a2a`). Register one with [`crate::Orchestrator::with_webhook_renderer`].
pub trait WebhookRenderer: Send + Sync + 'static {
    /// The format name webhooks ask for (`CreateTaskWebhookRequest.format`).
    fn format(&self) -> &'static str;

    /// The notifications of a task, in order: `task` is the task as GetTask shows it now,
    /// `events` its whole event log from sequence 1 (masked, as WatchTask streams them).
    /// Each [`Rendered`] carries the sequence of the event it came from, non-decreasing;
    /// an event may give none. It must be a pure function of `events` (and of the parts of
    /// `task` that only change with them) so that a redelivery after a crash or a failure
    /// sends the same bodies.
    fn render(&self, task: &pb::Task, events: &[pb::TaskEvent]) -> Vec<Rendered>;
}

/// The built-in `reach` format: one notification per event, the event as JSON
/// ([`crate::json::event_json`]: `task_id`, `sequence`, `kind`, `node_id`, `status`,
/// `detail`, `at`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ReachRenderer;

impl WebhookRenderer for ReachRenderer {
    fn format(&self) -> &'static str {
        DEFAULT_FORMAT
    }

    fn render(&self, _task: &pb::Task, events: &[pb::TaskEvent]) -> Vec<Rendered> {
        events
            .iter()
            .map(|e| Rendered {
                sequence: e.sequence,
                body: crate::json::event_json(e),
            })
            .collect()
    }
}

/// The renderers an orchestrator knows, by format; `reach` always among them.
#[derive(Clone)]
pub struct Renderers {
    by_format: HashMap<&'static str, Arc<dyn WebhookRenderer>>,
}

impl Default for Renderers {
    fn default() -> Self {
        let mut by_format: HashMap<&'static str, Arc<dyn WebhookRenderer>> = HashMap::new();
        by_format.insert(DEFAULT_FORMAT, Arc::new(ReachRenderer));
        Self { by_format }
    }
}

impl std::fmt::Debug for Renderers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.formats()).finish()
    }
}

impl Renderers {
    /// Adds `renderer` under its format, replacing one registered before under that name.
    pub fn insert(&mut self, renderer: Arc<dyn WebhookRenderer>) {
        self.by_format.insert(renderer.format(), renderer);
    }

    /// The renderer of `format`.
    pub fn get(&self, format: &str) -> Option<&Arc<dyn WebhookRenderer>> {
        self.by_format.get(format)
    }

    /// The known formats, sorted.
    pub fn formats(&self) -> Vec<&'static str> {
        let mut formats: Vec<_> = self.by_format.keys().copied().collect();
        formats.sort_unstable();
        formats
    }
}

// === validation and views ===

fn invalid(field: &'static str, detail: impl Into<String>) -> Error {
    Error::InvalidWebhook {
        field,
        detail: detail.into(),
    }
}

/// Whether `s` is an HTTP header value: visible ASCII and spaces.
fn header_safe(s: &str) -> bool {
    http::HeaderValue::from_str(s).is_ok()
}

/// Checks a CreateTaskWebhook request and returns the row to store (id made when empty,
/// format defaulted to `reach`), created at `now_ms`.
///
/// # Errors
/// [`Error::InvalidWebhook`] naming the field: an id that is not 1 to 128 characters of
/// `A-Z a-z 0-9 . _ : -`; a URL that does not parse, is not `http`/`https`, has no host or
/// is longer than [`MAX_URL_BYTES`]; a token or credentials longer than [`MAX_SECRET_BYTES`]
/// or not header-safe; credentials without a scheme; a format `renderers` does not know.
pub fn validate(
    r: &pb::CreateTaskWebhookRequest,
    renderers: &Renderers,
    now_ms: i64,
) -> Result<WebhookRow, Error> {
    let webhook_id = if r.webhook_id.is_empty() {
        uuid::Uuid::now_v7().to_string()
    } else if r.webhook_id.len() <= 128
        && r.webhook_id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._:-".contains(c))
    {
        r.webhook_id.clone()
    } else {
        return Err(invalid(
            "webhook_id",
            "use 1 to 128 characters of A-Z a-z 0-9 . _ : -, or leave it empty to have one made",
        ));
    };
    if r.url.len() > MAX_URL_BYTES {
        return Err(invalid(
            "url",
            format!("it is {} bytes; use at most {MAX_URL_BYTES}", r.url.len()),
        ));
    }
    let url = reqwest::Url::parse(&r.url).map_err(|e| {
        invalid(
            "url",
            format!("it does not parse ({e}); use http://HOST/PATH or https://HOST/PATH"),
        )
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid(
            "url",
            format!("its scheme is {:?}; use http or https", url.scheme()),
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(invalid(
            "url",
            "it has no host; use http://HOST/PATH or https://HOST/PATH",
        ));
    }
    for (field, value) in [
        ("token", &r.token),
        ("auth_credentials", &r.auth_credentials),
    ] {
        if value.len() > MAX_SECRET_BYTES {
            return Err(invalid(
                field,
                format!(
                    "it is {} bytes; use at most {MAX_SECRET_BYTES}",
                    value.len()
                ),
            ));
        }
        if !header_safe(value) {
            return Err(invalid(
                field,
                "it must be visible ASCII (a header value: no control characters)",
            ));
        }
    }
    let scheme_ok = r.auth_scheme.len() <= MAX_SCHEME_BYTES
        && r.auth_scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c));
    if !scheme_ok {
        return Err(invalid(
            "auth_scheme",
            "use an HTTP authentication scheme name such as Bearer or Basic (at most 64 characters, no spaces)",
        ));
    }
    if r.auth_scheme.is_empty() && !r.auth_credentials.is_empty() {
        return Err(invalid(
            "auth_scheme",
            "it is required with auth_credentials; for example Bearer",
        ));
    }
    let format = if r.format.is_empty() {
        DEFAULT_FORMAT.to_string()
    } else {
        r.format.clone()
    };
    if renderers.get(&format).is_none() {
        return Err(invalid(
            "format",
            format!(
                "{format:?} is not a known format; use one of [{}]",
                renderers.formats().join(", ")
            ),
        ));
    }
    Ok(WebhookRow {
        webhook_id,
        task_id: r.task_id.clone(),
        url: r.url.clone(),
        token: r.token.clone(),
        auth_scheme: r.auth_scheme.clone(),
        auth_credentials: r.auth_credentials.clone(),
        format,
        delivered_seq: 0,
        created_ms: now_ms,
        failed_attempts: 0,
        last_error: String::new(),
        next_attempt_ms: 0,
        lease_owner: None,
        lease_until_ms: 0,
    })
}

/// A webhook as the API shows it: `auth_credentials` always empty (write-only).
pub fn view(w: &WebhookRow) -> pb::TaskWebhook {
    pb::TaskWebhook {
        webhook_id: w.webhook_id.clone(),
        task_id: w.task_id.clone(),
        url: w.url.clone(),
        token: w.token.clone(),
        auth_scheme: w.auth_scheme.clone(),
        auth_credentials: String::new(),
        format: w.format.clone(),
        delivered_sequence: u64::try_from(w.delivered_seq).unwrap_or(0),
        created_at: Some(crate::service::timestamp(w.created_ms)),
        failed_attempts: u32::try_from(w.failed_attempts).unwrap_or(u32::MAX),
        last_error: w.last_error.clone(),
        next_attempt_at: (w.next_attempt_ms > 0 && w.next_attempt_ms != WEBHOOK_PARKED_MS)
            .then(|| crate::service::timestamp(w.next_attempt_ms)),
    }
}

/// The wait before attempt `failures + 1` after `failures` failures in a row: `base`
/// doubled per failure after the first, capped at `max`, of which a random half to all is
/// taken (jitter, so webhooks that failed together do not retry together).
pub fn backoff(failures: i64, base: Duration, max: Duration) -> Duration {
    let failures = u32::try_from(failures.max(1)).unwrap_or(u32::MAX);
    let full = reach_rpc::backoff::Exponential::doubling(base, max).delay(failures);
    let factor: f64 = rand::Rng::random_range(&mut rand::rng(), 0.5..=1.0);
    full.mul_f64(factor)
}

// === the delivery loop ===

/// How the delivery loop runs (from [`crate::OrchestratorConfig`]).
#[derive(Debug, Clone)]
pub struct WebhookSettings {
    /// This replica's id: the owner of its webhook leases.
    pub owner: String,
    /// How often the store is checked for undelivered events.
    pub interval: Duration,
    /// The wait after the first failure (doubling after each further one).
    pub backoff: Duration,
    /// The longest wait between retries.
    pub backoff_max: Duration,
}

/// Starts the delivery loop of `api`'s webhooks; it ends when the engine stops.
///
/// # Errors
/// [`Error::Config`] when no HTTP client can be made (no TLS roots).
pub fn spawn(
    api: OrchestratorApi,
    settings: WebhookSettings,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let client = reqwest::Client::builder()
        .timeout(POST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("reach-orchestrator/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| crate::config::ConfigError::WebhookClient {
            detail: e.to_string(),
        })?;
    let delivery = Delivery {
        api,
        settings,
        client,
    };
    Ok(tokio::spawn(delivery.run()))
}

struct Delivery {
    api: OrchestratorApi,
    settings: WebhookSettings,
    client: reqwest::Client,
}

/// How one webhook's turn ended.
enum Outcome {
    /// Everything rendered was delivered (or the turn's POST budget ran out).
    Done,
    /// A POST failed; the failure is recorded and the lease released.
    Failed,
    /// The lease is gone (deleted, or another replica took it): nothing more to record.
    Lost,
}

impl Delivery {
    async fn run(self) {
        let engine = self.api.engine().clone();
        let mut stop = engine.inner.stop_receiver();
        let mut appends = engine.subscribe();
        let store = engine.store();
        // An SQLite store is this process's alone: leases a previous process left are void.
        if store.is_exclusive()
            && let Err(e) = store.release_webhooks(None).await
        {
            tracing::warn!(error = %e, "cannot release the webhook leases of a previous process");
        }
        match store.unpark_webhooks(None).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(count = n, "resumed the webhooks of retried tasks"),
            Err(e) => tracing::warn!(error = %e, "cannot resume the webhooks of retried tasks"),
        }
        loop {
            if *stop.borrow() {
                return;
            }
            // Stopping cuts a turn short: a POST accepted but not yet recorded is sent
            // again later (delivery is at least once).
            tokio::select! {
                result = self.turn() => {
                    if let Err(e) = result {
                        tracing::warn!(error = %e, "webhook delivery turn failed");
                    }
                }
                _ = stop.changed() => {}
            }
            if *stop.borrow() {
                self.release().await;
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(self.settings.interval) => {}
                // A local append: its webhooks may be due now. Appends coalesce: the turn
                // reads the log from the store.
                r = appends.recv() => {
                    if matches!(r, Err(tokio::sync::broadcast::error::RecvError::Closed)) {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    while appends.try_recv().is_ok() {}
                }
                _ = stop.changed() => {
                    self.release().await;
                    return;
                }
            }
        }
    }

    /// Releases this replica's webhook leases (stopping cleanly: others take over at once).
    async fn release(&self) {
        let store = self.api.engine().store();
        if !store.is_exclusive()
            && let Err(e) = store.release_webhooks(Some(&self.settings.owner)).await
        {
            tracing::warn!(error = %e, "cannot release webhook leases");
        }
    }

    /// Claims the due webhooks and delivers their pending notifications, within the turn's
    /// bounds.
    async fn turn(&self) -> Result<(), Error> {
        let store = self.api.engine().store();
        let clock = self.api.engine().clock();
        let now = clock.now_ms();
        let claimed = store
            .claim_webhooks(
                &self.settings.owner,
                now,
                now + crate::engine::clock::ms(LEASE),
                MAX_WEBHOOKS_PER_TURN,
            )
            .await?;
        if claimed.is_empty() {
            return Ok(());
        }
        let mut by_task: HashMap<String, Vec<WebhookRow>> = HashMap::new();
        for w in claimed {
            by_task.entry(w.task_id.clone()).or_default().push(w);
        }
        let budget = AtomicUsize::new(MAX_POSTS_PER_TURN);
        futures::stream::iter(by_task)
            .for_each_concurrent(CONCURRENT_TASKS, |(task_id, hooks)| {
                let budget = &budget;
                async move {
                    if let Err(e) = self.task_turn(&task_id, hooks, budget).await {
                        tracing::warn!(task_id = %task_id, error = %e, "webhook delivery failed");
                    }
                }
            })
            .await;
        Ok(())
    }

    /// Delivers to the claimed webhooks of one task (the log is read and viewed once).
    async fn task_turn(
        &self,
        task_id: &str,
        hooks: Vec<WebhookRow>,
        budget: &AtomicUsize,
    ) -> Result<(), Error> {
        let store = self.api.engine().store();
        let owner = &self.settings.owner;
        let stored = store.events(task_id, 0).await?;
        let last_seq = stored.last().map_or(0, |e| e.seq);
        let state = TaskState::fold(task_id, &stored);
        let task = self.api.task_view(&state);
        let events = self
            .api
            .events_view(task_id, &stored, TaskState::new(task_id));
        let mut rendered: HashMap<String, Arc<Vec<Rendered>>> = HashMap::new();
        let renderers = self.api.webhook_renderers();
        futures::stream::iter(hooks)
            .for_each_concurrent(CONCURRENT_WEBHOOKS_PER_TASK, |hook| {
                let notes = renderers.get(&hook.format).map(|r| {
                    rendered
                        .entry(hook.format.clone())
                        .or_insert_with(|| Arc::new(r.render(&task, &events)))
                        .clone()
                });
                async move {
                    let result = match notes {
                        Some(notes) => self.deliver(&hook, &notes, last_seq, budget).await,
                        None => {
                            let error = format!(
                                "format {:?} is not registered in this orchestrator",
                                hook.format
                            );
                            self.failed(&hook, &error).await.map(|()| Outcome::Failed)
                        }
                    };
                    let released = match result {
                        // Parked when its task ended and it has everything; else free for
                        // the next turn.
                        Ok(Outcome::Done) => match store
                            .park_webhook(&hook.task_id, &hook.webhook_id, owner)
                            .await
                        {
                            Ok(true) => Ok(()),
                            Ok(false) => store
                                .release_webhook(&hook.task_id, &hook.webhook_id, owner)
                                .await
                                .map_err(Error::from),
                            Err(e) => Err(e.into()),
                        },
                        Ok(Outcome::Failed | Outcome::Lost) => Ok(()),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = released {
                        tracing::warn!(task_id = %hook.task_id, webhook_id = %hook.webhook_id, error = %e, "webhook delivery failed");
                    }
                }
            })
            .await;
        Ok(())
    }

    /// POSTs the notifications of `notes` after the webhook's `delivered_seq`, in order,
    /// recording each accepted one; stops at the first failure.
    async fn deliver(
        &self,
        hook: &WebhookRow,
        notes: &[Rendered],
        last_seq: i64,
        budget: &AtomicUsize,
    ) -> Result<Outcome, Error> {
        let store = self.api.engine().store();
        let clock = self.api.engine().clock();
        let owner = &self.settings.owner;
        let delivered = u64::try_from(hook.delivered_seq).unwrap_or(0);
        let mut pending: Vec<&Rendered> = notes.iter().filter(|n| n.sequence > delivered).collect();
        // In sequence order whatever the renderer did (stable: a sequence's notifications
        // keep their order).
        pending.sort_by_key(|n| n.sequence);
        for (i, note) in pending.iter().enumerate() {
            let spent =
                budget.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
            if spent.is_err() {
                return Ok(Outcome::Done);
            }
            if let Err(error) = self.post(hook, &note.body).await {
                crate::metrics::webhook_delivery(false);
                tracing::debug!(task_id = %hook.task_id, webhook_id = %hook.webhook_id, %error, "webhook notification failed");
                self.failed(hook, &error).await?;
                return Ok(Outcome::Failed);
            }
            crate::metrics::webhook_delivery(true);
            // A sequence is recorded once every notification made from its event is in.
            let last_of_its_event = pending
                .get(i + 1)
                .is_none_or(|n| n.sequence != note.sequence);
            if last_of_its_event {
                let now = clock.now_ms();
                let seq = i64::try_from(note.sequence).unwrap_or(i64::MAX);
                if !store
                    .webhook_delivered(
                        &hook.task_id,
                        &hook.webhook_id,
                        owner,
                        seq,
                        now + crate::engine::clock::ms(LEASE),
                    )
                    .await?
                {
                    return Ok(Outcome::Lost);
                }
            }
        }
        // Events that made no notification (or whose notifications are all in) count as
        // delivered, so the webhook is not claimed again for them.
        let rendered_up_to = notes.iter().map(|n| n.sequence).max().unwrap_or(0);
        if last_seq > hook.delivered_seq
            && u64::try_from(last_seq).unwrap_or(0) >= rendered_up_to
            && !store
                .webhook_delivered(
                    &hook.task_id,
                    &hook.webhook_id,
                    owner,
                    last_seq,
                    clock.now_ms() + crate::engine::clock::ms(LEASE),
                )
                .await?
        {
            return Ok(Outcome::Lost);
        }
        Ok(Outcome::Done)
    }

    /// Records a failed attempt of `hook` and schedules the next with back-off.
    async fn failed(&self, hook: &WebhookRow, error: &str) -> Result<(), Error> {
        let wait = backoff(
            hook.failed_attempts + 1,
            self.settings.backoff,
            self.settings.backoff_max,
        );
        let next = self.api.engine().clock().now_ms() + crate::engine::clock::ms(wait);
        self.api
            .engine()
            .store()
            .webhook_failed(
                &hook.task_id,
                &hook.webhook_id,
                &self.settings.owner,
                &crate::expr::cut(error, 500),
                next,
            )
            .await?;
        Ok(())
    }

    /// POSTs one notification; `Err` says why it was not accepted.
    async fn post(&self, hook: &WebhookRow, body: &serde_json::Value) -> Result<(), String> {
        let mut request = self.client.post(&hook.url).json(body);
        if !hook.token.is_empty() {
            request = request.header("X-A2A-Notification-Token", &hook.token);
        }
        if !hook.auth_credentials.is_empty() {
            request = request.header(
                http::header::AUTHORIZATION,
                format!("{} {}", hook.auth_scheme, hook.auth_credentials),
            );
        }
        match request.send().await {
            Ok(response) if response.status().is_success() => Ok(()),
            Ok(response) => Err(format!("the webhook answered HTTP {}", response.status())),
            Err(e) if e.is_timeout() => Err(format!(
                "the webhook did not answer within {}s",
                POST_TIMEOUT.as_secs()
            )),
            Err(e) => {
                // The URL is left out (it may carry secrets); the causes say what failed.
                let e = e.without_url();
                let mut text = e.to_string();
                let mut source = std::error::Error::source(&e);
                while let Some(cause) = source {
                    text.push_str(": ");
                    text.push_str(&cause.to_string());
                    source = cause.source();
                }
                Err(format!("cannot reach the webhook: {text}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(url: &str) -> pb::CreateTaskWebhookRequest {
        pb::CreateTaskWebhookRequest {
            task_id: "t".into(),
            url: url.into(),
            ..Default::default()
        }
    }

    fn field_of(e: Error) -> &'static str {
        match e {
            Error::InvalidWebhook { field, .. } => field,
            other => panic!("not an invalid webhook: {other}"),
        }
    }

    #[test]
    fn validation_names_the_field() {
        let r = Renderers::default();
        let ok = validate(&request("https://example.com/hook"), &r, 5).unwrap();
        assert_eq!(ok.format, "reach");
        assert_eq!(ok.created_ms, 5);
        assert_eq!(
            uuid::Uuid::parse_str(&ok.webhook_id)
                .unwrap()
                .get_version_num(),
            7
        );
        for (req, field) in [
            (request("ftp://example.com/x"), "url"),
            (request("not a url"), "url"),
            (
                request(&format!("https://e.com/{}", "a".repeat(2048))),
                "url",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    webhook_id: "a b".into(),
                    ..request("http://e.com")
                },
                "webhook_id",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    token: "x".repeat(4097),
                    ..request("http://e.com")
                },
                "token",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    token: "a\nb".into(),
                    ..request("http://e.com")
                },
                "token",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    auth_credentials: "secret".into(),
                    ..request("http://e.com")
                },
                "auth_scheme",
            ),
            (
                pb::CreateTaskWebhookRequest {
                    format: "a2a".into(),
                    ..request("http://e.com")
                },
                "format",
            ),
        ] {
            assert_eq!(
                field_of(validate(&req, &r, 0).unwrap_err()),
                field,
                "{req:?}"
            );
        }
        let e = validate(
            &pb::CreateTaskWebhookRequest {
                format: "a2a".into(),
                ..request("http://e.com")
            },
            &r,
            0,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "webhook format is not valid: \"a2a\" is not a known format; use one of [reach]"
        );
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_with_jitter() {
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(300);
        for (failures, full) in [(1, 1), (2, 2), (3, 4), (9, 256), (10, 300), (60, 300)] {
            let d = backoff(failures, base, max);
            let full = Duration::from_secs(full);
            assert!(
                d >= full / 2 && d <= full,
                "{failures}: {d:?} not in [{full:?}/2, {full:?}]"
            );
        }
    }

    #[test]
    fn credentials_are_never_shown() {
        let r = Renderers::default();
        let w = validate(
            &pb::CreateTaskWebhookRequest {
                auth_scheme: "Bearer".into(),
                auth_credentials: "s3cret".into(),
                ..request("http://e.com")
            },
            &r,
            0,
        )
        .unwrap();
        let v = view(&w);
        assert_eq!(v.auth_credentials, "");
        assert_eq!(v.auth_scheme, "Bearer");
        assert!(v.next_attempt_at.is_none());
    }
}
