//! The webhook delivery loop: POSTs each task's notifications (rendered from its masked event
//! log by the webhook's [`WebhookRenderer`](crate::webhooks::WebhookRenderer)) in order,
//! records each accepted one durably, retries failures with back-off
//! ([`crate::webhooks::backoff`]) and leases webhooks so replicas sharing a store never
//! deliver the same one at once. See [`crate::webhooks`] for the guarantees.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt as _;

use crate::error::Error;
use crate::event::TaskState;
use crate::service::OrchestratorApi;
use crate::store::WebhookRow;
use crate::webhooks::{Rendered, backoff};

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
    // Every connection goes to an address the egress policy allows: names through its
    // resolver, IP literals checked before each POST; no redirect or proxy goes elsewhere.
    let client = reqwest::Client::builder()
        .timeout(POST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .dns_resolver(api.egress().resolver())
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
        // Checked again: the policy may have changed since the webhook was made.
        if let Ok(url) = reqwest::Url::parse(&hook.url) {
            self.api
                .egress()
                .check_url(&url)
                .map_err(|refused| format!("cannot reach the webhook: {refused}"))?;
        }
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
