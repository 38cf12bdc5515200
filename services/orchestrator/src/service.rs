//! The `reach.v1.OrchestratorService` implementation and the masked views it returns.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use prost::Message;
use reach_proto::v1 as pb;
use reach_proto::v1::orchestrator_service_server::OrchestratorService;
use reach_trust::{Caller, TaskAction, Trust};
use tonic::{Request, Response, Status};

use crate::egress::EgressPolicy;
use crate::engine::{Engine, StartOptions};
use crate::error::Error;
use crate::event::{Event, NodeOutcome, StoredEvent, TaskState, TaskStatus, TimerPurpose};
use crate::flow::{Flow, NodeKind};
use crate::json;
use crate::mask::Masker;
use crate::store::{TaskSummary, WebhookUpsert};
use crate::webhooks::{Renderers, WebhookRenderer};

/// The gRPC service. Cheap to clone.
#[derive(Clone)]
pub struct OrchestratorApi {
    engine: Engine,
    masker: Masker,
    ledger_dropped: Arc<std::sync::atomic::AtomicU64>,
    trust: Arc<Trust>,
    /// The webhook formats CreateTaskWebhook accepts and the delivery loop renders.
    renderers: Arc<Renderers>,
    /// The addresses webhooks may reach.
    egress: Arc<EgressPolicy>,
    /// The WatchTask streams open per caller, and the most each may have.
    watches: Arc<WatchSlots>,
}

impl OrchestratorApi {
    /// The service over `engine`, masking with `masker`.
    pub fn new(engine: Engine, masker: Masker) -> Self {
        Self {
            engine,
            masker,
            ledger_dropped: Arc::default(),
            trust: Trust::disabled(),
            renderers: Arc::default(),
            egress: Arc::new(EgressPolicy::new(Vec::new())),
            watches: Arc::new(WatchSlots::new(DEFAULT_MAX_WATCHES_PER_CALLER)),
        }
    }

    /// Lets each caller (identity; every anonymous caller together) have at most `limit`
    /// WatchTask streams open at once (default [`DEFAULT_MAX_WATCHES_PER_CALLER`]); one
    /// more is refused with RESOURCE_EXHAUSTED ([`Error::TooManyWatches`]).
    #[must_use]
    pub fn with_watch_limit(mut self, limit: usize) -> Self {
        self.watches = Arc::new(WatchSlots::new(limit.max(1)));
        self
    }

    /// The WatchTask streams `caller` (an identity's name) has open.
    pub fn open_watches(&self, caller: &str) -> usize {
        self.watches.open_by(caller)
    }

    /// Lets webhooks reach what `egress` allows (by default public addresses only).
    #[must_use]
    pub fn with_egress(mut self, egress: EgressPolicy) -> Self {
        self.egress = Arc::new(egress);
        self
    }

    /// The addresses webhooks may reach.
    pub fn egress(&self) -> &Arc<EgressPolicy> {
        &self.egress
    }

    /// Adds a webhook format (see [`crate::Orchestrator::with_webhook_renderer`]).
    pub fn with_webhook_renderer(mut self, renderer: Arc<dyn WebhookRenderer>) -> Self {
        let mut renderers = (*self.renderers).clone();
        renderers.insert(renderer);
        self.renderers = Arc::new(renderers);
        self
    }

    /// The webhook formats this API knows.
    pub fn webhook_renderers(&self) -> &Renderers {
        &self.renderers
    }

    /// Authorizes callers with `trust` ([`Trust::check_task`]); see
    /// [`crate::Orchestrator::with_trust`].
    pub fn with_trust(mut self, trust: Arc<Trust>) -> Self {
        self.trust = trust;
        self
    }

    /// The trust callers are authorized with.
    pub fn trust(&self) -> &Arc<Trust> {
        &self.trust
    }

    /// Loads task `task_id` and checks that `caller` may `action` it.
    ///
    /// A task the caller may not view is answered exactly as an unknown id
    /// ([`Error::TaskNotFound`], same message and details), so neither its existence nor its
    /// flow or starter can be probed; the refusal is still audited. A caller that may view
    /// the task but not `action` it is refused ([`Error::Denied`]). Retrying needs the
    /// policy's `retry` (or an operator): being the task's starter is not enough.
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::Denied`]; [`Error::Store`].
    pub async fn authorized(
        &self,
        caller: &Caller,
        action: TaskAction,
        task_id: &str,
    ) -> Result<TaskState, Error> {
        let state = self.engine.load(task_id).await?;
        self.check_visible(caller, &state)?;
        if action != TaskAction::View {
            let starter = match action {
                TaskAction::Retry => None,
                _ => state.started_by.as_deref(),
            };
            self.trust
                .check_task(caller, action, &state.flow_id, starter)?;
        }
        Ok(state)
    }

    /// [`Error::TaskNotFound`] (as for an unknown id) unless `caller` may view `state`.
    fn check_visible(&self, caller: &Caller, state: &TaskState) -> Result<(), Error> {
        self.trust
            .check_task(
                caller,
                TaskAction::View,
                &state.flow_id,
                state.started_by.as_deref(),
            )
            .map_err(|_| Error::TaskNotFound {
                task_id: state.id.clone(),
            })
    }

    /// Whether `caller` may view each of `tasks` (their starters are read, one event per
    /// task, only for tasks the caller may not view by flow alone).
    async fn viewable(&self, caller: &Caller, tasks: &[TaskSummary]) -> Result<Vec<bool>, Error> {
        let mut keep: Vec<bool> = tasks
            .iter()
            .map(|t| {
                self.trust
                    .allows_task(caller, TaskAction::View, &t.flow_id, None)
            })
            .collect();
        let unsure: Vec<&str> = tasks
            .iter()
            .zip(&keep)
            .filter(|(_, k)| !**k)
            .map(|(t, _)| t.task_id.as_str())
            .collect();
        if unsure.is_empty() {
            return Ok(keep);
        }
        let starters = self.engine.store().starters_of(&unsure).await?;
        for (task, keep) in tasks.iter().zip(keep.iter_mut()) {
            if !*keep && let Some(starter) = starters.get(&task.task_id) {
                *keep = self.trust.allows_task(
                    caller,
                    TaskAction::View,
                    &task.flow_id,
                    starter.as_deref(),
                );
            }
        }
        Ok(keep)
    }

    /// A page of the tasks `caller` may view, newest first, filtered by `status`, `flow`
    /// and `labels`, after `after`: the list is filtered before the page is cut, so the page
    /// holds up to `limit` visible tasks and the cursor of the next page is the last of
    /// them (`None` when no visible task follows). At most [`MAX_SCANNED_TASKS`] rows are
    /// read per page: a page that reaches it ends early, at its last visible task.
    async fn visible_tasks(
        &self,
        caller: &Caller,
        status: Option<TaskStatus>,
        flow: Option<&str>,
        labels: &std::collections::BTreeMap<String, String>,
        limit: u32,
        after: Option<crate::page::Cursor>,
    ) -> Result<(Vec<TaskSummary>, bool), Error> {
        let want = limit as usize;
        let mut page: Vec<TaskSummary> = Vec::with_capacity(want + 1);
        let mut cursor = after.map(|c| (c.created_ms, c.id));
        let mut scanned = 0usize;
        loop {
            let batch = u32::try_from((want + 1 - page.len()).clamp(64, 1000)).unwrap_or(1000);
            let rows = self
                .engine
                .store()
                .list_tasks(status, flow, labels, batch, cursor.clone())
                .await?;
            let exhausted = rows.len() < batch as usize;
            scanned += rows.len();
            if let Some(last) = rows.last() {
                cursor = Some((last.created_ms, last.task_id.clone()));
            }
            let keep = self.viewable(caller, &rows).await?;
            page.extend(
                rows.into_iter()
                    .zip(keep)
                    .filter(|(_, k)| *k)
                    .map(|(t, _)| t),
            );
            if page.len() > want {
                page.truncate(want);
                return Ok((page, true));
            }
            if exhausted {
                return Ok((page, false));
            }
            if scanned >= MAX_SCANNED_TASKS {
                let more = !page.is_empty();
                return Ok((page, more));
            }
        }
    }

    /// Whether `caller` may read the tokens of `state`'s webhooks: its starter and operators
    /// (everyone without trust). Other viewers see webhooks with the token left empty: it
    /// authenticates the orchestrator to the receiver, and a viewer holding it could forge
    /// deliveries.
    fn sees_webhook_tokens(&self, caller: &Caller, state: &TaskState) -> bool {
        !self.trust.is_enabled()
            || self.trust.is_operator(caller)
            || state.started_by.as_deref() == Some(caller.name())
    }

    /// A webhook of `state` as `caller` may see it (see [`Self::sees_webhook_tokens`]).
    fn webhook_view(
        &self,
        caller: &Caller,
        state: &TaskState,
        w: &crate::store::WebhookRow,
    ) -> pb::TaskWebhook {
        let mut view = crate::webhooks::view(w);
        view.last_error = self.masker.mask_text(&view.last_error);
        if !self.sees_webhook_tokens(caller, state) {
            view.token = String::new();
        }
        view
    }

    /// Whether `caller` may see flow `flow_id` (ListFlows, the flows an unknown one is listed
    /// with): an operator, or a caller the policy lets start or view its tasks (everyone
    /// without trust, or with trust and no policy).
    fn sees_flow(&self, caller: &Caller, flow_id: &str) -> bool {
        [TaskAction::Start, TaskAction::View, TaskAction::Apply]
            .into_iter()
            .any(|action| self.trust.allows_task(caller, action, flow_id, None))
    }

    /// Ledger entries routers reported as dropped so far.
    pub fn ledger_dropped(&self) -> u64 {
        self.ledger_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }
}

pub use crate::config::DEFAULT_MAX_WATCHES_PER_CALLER;

/// The WatchTask streams open per caller.
#[derive(Debug)]
struct WatchSlots {
    limit: usize,
    open: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// One open WatchTask stream of a caller; frees its slot when dropped.
struct WatchSlot {
    slots: Arc<WatchSlots>,
    caller: String,
}

impl WatchSlots {
    fn new(limit: usize) -> Self {
        Self {
            limit,
            open: std::sync::Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, usize>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes one of `caller`'s slots.
    fn open(self: &Arc<Self>, caller: &str) -> Result<WatchSlot, Error> {
        let mut open = self.lock();
        let n = open.entry(caller.to_string()).or_default();
        if *n >= self.limit {
            return Err(Error::TooManyWatches {
                identity: caller.to_string(),
                limit: self.limit,
            });
        }
        *n += 1;
        Ok(WatchSlot {
            slots: self.clone(),
            caller: caller.to_string(),
        })
    }

    fn open_by(&self, caller: &str) -> usize {
        self.lock().get(caller).copied().unwrap_or(0)
    }
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut open = self.slots.lock();
        if let Some(n) = open.get_mut(&self.caller) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.caller);
            }
        }
    }
}

fn ts(ms: i64) -> prost_types::Timestamp {
    reach_rpc::time::from_unix_ms(ms)
}

/// What a task in WAITING_HUMAN waits for: its human node, the node's prompt and schema, and
/// when the wait times out. `None` in any other status.
/// The prompt and input schema (as written in the flow) of `node`, when it is a human node.
fn human_node<'f>(
    flow: &'f Flow,
    node: &str,
) -> Option<(Option<&'f str>, Option<&'f serde_json::Value>)> {
    match flow.node(node).map(|n| &n.kind) {
        Some(NodeKind::Human {
            prompt,
            schema_source,
            ..
        }) => Some((prompt.as_deref(), schema_source.as_ref())),
        _ => None,
    }
}

fn human_wait(state: &TaskState, flow: Option<&Flow>) -> Option<pb::HumanWait> {
    if state.status != TaskStatus::WaitingHuman {
        return None;
    }
    let node_id = state.current.clone()?;
    let (prompt, input_schema) = match flow.and_then(|f| human_node(f, &node_id)) {
        Some((prompt, schema)) => (
            prompt.map(str::to_string).unwrap_or_default(),
            schema.map(json::to_proto),
        ),
        None => (String::new(), None),
    };
    let deadline = state
        .timers
        .values()
        .find(|t| {
            t.purpose == TimerPurpose::HumanTimeout && t.node == node_id && !t.fired && !t.cancelled
        })
        .map(|t| ts(t.fire_at_ms));
    Some(pb::HumanWait {
        node_id,
        prompt,
        input_schema,
        deadline,
    })
}

/// The proto value of a status.
pub fn status_to_proto(s: TaskStatus) -> pb::TaskStatus {
    match s {
        TaskStatus::Pending => pb::TaskStatus::Pending,
        TaskStatus::Dispatched => pb::TaskStatus::Dispatched,
        TaskStatus::Processing => pb::TaskStatus::Processing,
        TaskStatus::WaitingHuman => pb::TaskStatus::WaitingHuman,
        TaskStatus::Succeeded => pb::TaskStatus::Succeeded,
        TaskStatus::Failed => pb::TaskStatus::Failed,
        TaskStatus::Partial => pb::TaskStatus::Partial,
        TaskStatus::Cancelled => pb::TaskStatus::Cancelled,
    }
}

/// The status of a proto value (`None` for unspecified).
pub fn status_from_proto(s: pb::TaskStatus) -> Option<TaskStatus> {
    Some(match s {
        pb::TaskStatus::Unspecified => return None,
        pb::TaskStatus::Pending => TaskStatus::Pending,
        pb::TaskStatus::Dispatched => TaskStatus::Dispatched,
        pb::TaskStatus::Processing => TaskStatus::Processing,
        pb::TaskStatus::WaitingHuman => TaskStatus::WaitingHuman,
        pb::TaskStatus::Succeeded => TaskStatus::Succeeded,
        pb::TaskStatus::Failed => TaskStatus::Failed,
        pb::TaskStatus::Partial => TaskStatus::Partial,
        pb::TaskStatus::Cancelled => TaskStatus::Cancelled,
    })
}

/// Token usage as the API shows it: unset when nothing was reported.
fn usage_view(usage: reach_rpc::usage::TokenUsage) -> Option<pb::TokenUsage> {
    (!usage.is_zero()).then_some(pb::TokenUsage {
        input_tokens: usage.input_tokens,
        output_tokens: usage.output_tokens,
        model_calls: usage.model_calls,
    })
}

impl OrchestratorApi {
    fn masked(&self, v: &serde_json::Value) -> Option<prost_types::Value> {
        Some(json::to_proto(&self.masker.mask(v)))
    }

    /// A task with its node history, masked.
    pub fn task_view(&self, state: &TaskState) -> pb::Task {
        let flow = self.engine.flows().get(&state.flow_id, state.flow_version);
        pb::Task {
            task_id: state.id.clone(),
            flow_id: state.flow_id.clone(),
            flow_version: state.flow_version,
            status: status_to_proto(state.status).into(),
            current_node: state.current.clone().unwrap_or_default(),
            input: self.masked(&state.input),
            // An unfinished task has no output yet: the last completed node's output is an
            // intermediate value (shown under `nodes`), not the task's.
            output: if state.status.is_terminal() {
                self.masked(&state.output)
            } else {
                None
            },
            waiting: human_wait(state, flow.as_deref()),
            error: state
                .error
                .as_deref()
                .map(|e| self.masker.mask_text(e))
                .unwrap_or_default(),
            trace_id: state.trace_id.clone(),
            created_at: Some(ts(state.created_ms)),
            updated_at: Some(ts(state.updated_ms)),
            ended_at: state.ended_ms.map(ts),
            failed_node: state.failed_node.clone().unwrap_or_default(),
            nodes: state
                .visits
                .iter()
                .map(|v| pb::NodeRun {
                    node_id: v.node.clone(),
                    node_type: flow
                        .as_ref()
                        .and_then(|f| f.node(&v.node))
                        .map(|n| n.kind.type_name())
                        .unwrap_or("")
                        .to_string(),
                    status: match v.outcome {
                        None => pb::NodeStatus::Running,
                        Some(NodeOutcome::Succeeded) => pb::NodeStatus::Succeeded,
                        Some(NodeOutcome::Partial) => pb::NodeStatus::Partial,
                        Some(NodeOutcome::Failed) => pb::NodeStatus::Failed,
                        Some(NodeOutcome::Cancelled) => pb::NodeStatus::Cancelled,
                    }
                    .into(),
                    attempts: v.attempts,
                    message_id: v.message_id.clone().unwrap_or_default(),
                    input: self.masked(&v.input),
                    output: self.masked(&v.output),
                    error: v
                        .error
                        .as_deref()
                        .map(|e| self.masker.mask_text(e))
                        .unwrap_or_default(),
                    started_at: Some(ts(v.started_ms)),
                    ended_at: v.ended_ms.map(ts),
                    next_node: v.next.clone().unwrap_or_default(),
                    usage: usage_view(v.usage),
                })
                .collect(),
            usage: usage_view(state.usage),
            last_sequence: u64::try_from(state.seq).unwrap_or(0),
            labels: state
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// A task row (no node history), masked.
    pub fn summary_view(&self, s: &TaskSummary) -> pb::Task {
        pb::Task {
            task_id: s.task_id.clone(),
            flow_id: s.flow_id.clone(),
            flow_version: s.flow_version,
            status: status_to_proto(s.status).into(),
            current_node: s.current_node.clone().unwrap_or_default(),
            error: s
                .error
                .as_deref()
                .map(|e| self.masker.mask_text(e))
                .unwrap_or_default(),
            trace_id: s.trace_id.clone(),
            created_at: Some(ts(s.created_ms)),
            updated_at: Some(ts(s.updated_ms)),
            ended_at: s.ended_ms.map(ts),
            failed_node: s.failed_node.clone().unwrap_or_default(),
            last_sequence: u64::try_from(s.seq).unwrap_or(0),
            ..Default::default()
        }
    }

    /// An event, masked, with the status of `state` (the task after it). A `human_waiting`
    /// event's detail also carries the node's input `schema` from the flow version the task
    /// runs, so a watcher (the A2A edge's INPUT_REQUIRED) needs no second call for it.
    pub fn event_view(&self, task_id: &str, e: &StoredEvent, state: &TaskState) -> pb::TaskEvent {
        let status = state.status;
        let mut detail = serde_json::to_value(&e.event).unwrap_or_default();
        if let Event::HumanWaiting { node, .. } = &e.event
            && let Some(flow) = self.engine.flows().get(&state.flow_id, state.flow_version)
            && let Some((_, Some(schema))) = human_node(&flow, node)
        {
            detail["schema"] = schema.clone();
        }
        pb::TaskEvent {
            task_id: task_id.to_string(),
            sequence: u64::try_from(e.seq).unwrap_or(0),
            at: Some(ts(e.at_ms)),
            kind: e.event.kind().to_string(),
            node_id: e.event.node().unwrap_or_default().to_string(),
            detail: self.masked(&detail),
            status: status_to_proto(status).into(),
        }
    }

    /// The views of `events`, each with the status of the task after it, folding from
    /// `state` (a fresh [`TaskState::new`] for a log from sequence 1).
    pub fn events_view(
        &self,
        task_id: &str,
        events: &[StoredEvent],
        mut state: TaskState,
    ) -> Vec<pb::TaskEvent> {
        events
            .iter()
            .map(|e| {
                state.apply(&e.event, e.at_ms);
                self.event_view(task_id, e, &state)
            })
            .collect()
    }

    fn mask_ledger(&self, mut entry: pb::LedgerEntry) -> pb::LedgerEntry {
        entry.status_message = self.masker.mask_text(&entry.status_message);
        if let Some(h) = entry.header.as_mut() {
            for v in h.metadata.values_mut() {
                *v = self.masker.mask_text(v);
            }
        }
        entry
    }

    /// Everything `reach dump --task ID` prints: the task, then messages and events in time
    /// order (events before messages at the same millisecond).
    ///
    /// # Errors
    /// [`Error::TaskNotFound`]; [`Error::Store`].
    pub async fn dump(&self, task_id: &str) -> Result<pb::DumpTaskResponse, Error> {
        let events = self.engine.store().events(task_id, 0).await?;
        if events.is_empty() {
            return Err(Error::TaskNotFound {
                task_id: task_id.to_string(),
            });
        }
        let state = TaskState::fold(task_id, &events);
        let mut records: Vec<(i64, u8, pb::DumpRecord)> = self
            .events_view(task_id, &events, TaskState::new(task_id))
            .into_iter()
            .zip(&events)
            .map(|(v, e)| {
                (
                    e.at_ms,
                    0,
                    pb::DumpRecord {
                        at: Some(ts(e.at_ms)),
                        record: Some(pb::dump_record::Record::Event(v)),
                    },
                )
            })
            .collect();
        for (at, body) in self.engine.store().ledger(task_id).await? {
            if let Ok(entry) = pb::LedgerEntry::decode(body.as_slice()) {
                records.push((
                    at,
                    1,
                    pb::DumpRecord {
                        at: Some(ts(at)),
                        record: Some(pb::dump_record::Record::Message(self.mask_ledger(entry))),
                    },
                ));
            }
        }
        records.sort_by_key(|(at, kind, _)| (*at, *kind));
        Ok(pb::DumpTaskResponse {
            task: Some(self.task_view(&state)),
            records: records.into_iter().map(|(_, _, r)| r).collect(),
        })
    }
}

/// The most task rows one ListTasks or ListDeadLetters page reads while it looks for tasks
/// the caller may view; a page that reaches it ends at its last visible task.
pub const MAX_SCANNED_TASKS: usize = 10_000;

/// The fingerprint of a task list query by `caller` (page tokens are bound to it).
fn task_query(
    list: crate::page::List,
    caller: &Caller,
    status: Option<TaskStatus>,
    flow: Option<&str>,
    labels: &std::collections::BTreeMap<String, String>,
) -> crate::page::Query {
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    crate::page::Query::of(
        list,
        [
            caller.name(),
            status.map_or("", TaskStatus::as_str),
            flow.unwrap_or(""),
        ]
        .into_iter()
        .chain(labels.iter().map(String::as_str)),
    )
}

/// The token of the page after `page` (empty when `more` is false).
fn next_token(
    list: crate::page::List,
    query: crate::page::Query,
    page: &[TaskSummary],
    more: bool,
) -> String {
    match page.last() {
        Some(last) if more => crate::page::encode(
            list,
            query,
            &crate::page::Cursor {
                created_ms: last.created_ms,
                id: last.task_id.clone(),
            },
        ),
        _ => String::new(),
    }
}

fn page_size(n: u32) -> u32 {
    if n == 0 { 50 } else { n.min(1000) }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchTaskResponse, Status>> + Send>>;

#[tonic::async_trait]
impl OrchestratorService for OrchestratorApi {
    async fn start_task(
        &self,
        request: Request<pb::StartTaskRequest>,
    ) -> Result<Response<pb::StartTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        // A caller that is part of a trace (an edge, an agent) has the task continue it.
        let trace_id = request
            .metadata()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(reach_rpc::trace::TraceId::from_traceparent)
            .map(|id| id.to_string());
        let r = request.into_inner();
        validate_labels(&r.labels, MAX_TASK_LABELS)?;
        if r.flow_id.is_empty() {
            return Err(Error::MissingField {
                field: "flow_id",
                hint: "name an applied flow (see ListFlows)",
            }
            .into());
        }
        self.trust
            .check_task(&caller, TaskAction::Start, &r.flow_id, None)
            .map_err(Error::from)?;
        let input = json::from_proto_opt(r.input.as_ref());
        let started_by = self.trust.is_enabled().then(|| caller.name().to_string());
        let started = self
            .engine
            .start_task_with(
                &r.flow_id,
                r.flow_version,
                input,
                StartOptions {
                    task_id: Some(r.task_id),
                    started_by,
                    trace_id,
                    labels: r.labels.into_iter().collect(),
                },
            )
            .await;
        let state = match started {
            Ok(state) => state,
            // The id names a task of another flow: which flow is said only to whom may view it.
            Err(Error::TaskIdInUse { task_id, flow_id }) if self.trust.is_enabled() => {
                let visible = match self.engine.load(&task_id).await {
                    Ok(existing) => self.check_visible(&caller, &existing).is_ok(),
                    Err(_) => false,
                };
                return Err(if visible {
                    Error::TaskIdInUse { task_id, flow_id }
                } else {
                    Error::TaskIdTaken { task_id }
                }
                .into());
            }
            // The flows an unknown one is listed with are those the caller may see.
            Err(Error::FlowNotFound {
                flow_id,
                version,
                known,
            }) => {
                let known = known
                    .into_iter()
                    .filter(|f| self.sees_flow(&caller, f))
                    .collect();
                return Err(Error::FlowNotFound {
                    flow_id,
                    version,
                    known,
                }
                .into());
            }
            Err(e) => return Err(e.into()),
        };
        if self.trust.is_enabled() && state.started_by.as_deref() != Some(caller.name()) {
            // The id named an existing task of this flow: it is returned (idempotent start)
            // only to whom may view it; to anyone else the id is just taken.
            self.check_visible(&caller, &state)
                .map_err(|_| Error::TaskIdTaken {
                    task_id: state.id.clone(),
                })?;
        }
        Ok(Response::new(pb::StartTaskResponse {
            task: Some(self.task_view(&state)),
        }))
    }

    async fn get_task(
        &self,
        request: Request<pb::GetTaskRequest>,
    ) -> Result<Response<pb::GetTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let state = self
            .authorized(&caller, TaskAction::View, &request.into_inner().task_id)
            .await?;
        Ok(Response::new(pb::GetTaskResponse {
            task: Some(self.task_view(&state)),
        }))
    }

    async fn list_tasks(
        &self,
        request: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let status = status_from_proto(
            pb::TaskStatus::try_from(r.status).unwrap_or(pb::TaskStatus::Unspecified),
        );
        let limit = page_size(r.page_size);
        let flow = (!r.flow_id.is_empty()).then_some(r.flow_id.as_str());
        validate_labels(&r.labels, MAX_LABEL_FILTERS)?;
        let filter: std::collections::BTreeMap<String, String> = r.labels.into_iter().collect();
        let list = crate::page::List::Tasks;
        let query = task_query(list, &caller, status, flow, &filter);
        let after = crate::page::decode(&r.page_token, list, query)?;
        let (tasks, more) = self
            .visible_tasks(&caller, status, flow, &filter, limit, after)
            .await?;
        let ids: Vec<&str> = tasks.iter().map(|t| t.task_id.as_str()).collect();
        let mut labels = self
            .engine
            .store()
            .labels_of(&ids)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(pb::ListTasksResponse {
            next_page_token: next_token(list, query, &tasks, more),
            tasks: tasks
                .iter()
                .map(|t| pb::Task {
                    labels: labels
                        .remove(&t.task_id)
                        .unwrap_or_default()
                        .into_iter()
                        .collect(),
                    ..self.summary_view(t)
                })
                .collect(),
        }))
    }

    type WatchTaskStream = WatchStream;

    async fn watch_task(
        &self,
        request: Request<pb::WatchTaskRequest>,
    ) -> Result<Response<Self::WatchTaskStream>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let task_id = r.task_id;
        let mut updates = self.engine.subscribe();
        let first = self
            .engine
            .store()
            .events(&task_id, 0)
            .await
            .map_err(Error::from)?;
        if first.is_empty() {
            return Err(Error::TaskNotFound { task_id }.into());
        }
        self.check_visible(&caller, &TaskState::fold(&task_id, &first))?;
        let slot = self.watches.open(caller.name())?;
        let api = self.clone();
        let after = i64::try_from(r.after_sequence).unwrap_or(0);
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            // Held while the stream is open: the caller's watch slot is freed when it ends.
            let _slot = slot;
            let mut state = TaskState::new(&task_id);
            let mut last = 0i64;
            let mut pending = first;
            loop {
                for e in &pending {
                    state.apply(&e.event, e.at_ms);
                    last = e.seq;
                    if e.seq > after
                        && tx
                            .send(Ok(pb::WatchTaskResponse {
                                event: Some(api.event_view(&task_id, e, &state)),
                            }))
                            .await
                            .is_err()
                    {
                        return;
                    }
                }
                if state.status.is_terminal() {
                    return;
                }
                // Wake on a local append of this task, or poll (appends by other replicas);
                // stop at once when the client goes away.
                let wake = tokio::time::timeout(Duration::from_millis(500), async {
                    loop {
                        match updates.recv().await {
                            Ok(u) if u.0 == task_id => return,
                            Ok(_) => {}
                            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => return,
                            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                                std::future::pending::<()>().await;
                            }
                        }
                    }
                });
                tokio::select! {
                    _ = wake => {}
                    () = tx.closed() => return,
                }
                pending = match api.engine.store().events(&task_id, last).await {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(Err(Status::from(Error::from(e)))).await;
                        return;
                    }
                };
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn resume_task(
        &self,
        request: Request<pb::ResumeTaskRequest>,
    ) -> Result<Response<pb::ResumeTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let reviewer = reviewer_of(request.metadata());
        let r = request.into_inner();
        self.authorized(&caller, TaskAction::Resume, &r.task_id)
            .await?;
        let input = json::from_proto_opt(r.input.as_ref());
        // With trust on, the caller's identity says who resumed; without it, the name the
        // client sent (a console asks its reviewer for one).
        let by = if self.trust.is_enabled() {
            Some(caller.name().to_string())
        } else {
            reviewer
        };
        let state = self
            .engine
            .resume_by(&r.task_id, Some(&r.node_id), input, by)
            .await?;
        Ok(Response::new(pb::ResumeTaskResponse {
            task: Some(self.task_view(&state)),
        }))
    }

    async fn cancel_task(
        &self,
        request: Request<pb::CancelTaskRequest>,
    ) -> Result<Response<pb::CancelTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        self.authorized(&caller, TaskAction::Cancel, &r.task_id)
            .await?;
        let state = self.engine.cancel(&r.task_id, &r.reason).await?;
        Ok(Response::new(pb::CancelTaskResponse {
            task: Some(self.task_view(&state)),
        }))
    }

    async fn retry_task(
        &self,
        request: Request<pb::RetryTaskRequest>,
    ) -> Result<Response<pb::RetryTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let task_id = request.into_inner().task_id;
        self.authorized(&caller, TaskAction::Retry, &task_id)
            .await?;
        let state = self.engine.retry(&task_id).await?;
        Ok(Response::new(pb::RetryTaskResponse {
            task: Some(self.task_view(&state)),
        }))
    }

    async fn list_dead_letters(
        &self,
        request: Request<pb::ListDeadLettersRequest>,
    ) -> Result<Response<pb::ListDeadLettersResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let limit = page_size(r.page_size);
        let flow = (!r.flow_id.is_empty()).then_some(r.flow_id.as_str());
        let list = crate::page::List::DeadLetters;
        let filter = std::collections::BTreeMap::new();
        let status = Some(TaskStatus::Failed);
        let query = task_query(list, &caller, status, flow, &filter);
        let after = crate::page::decode(&r.page_token, list, query)?;
        let (tasks, more) = self
            .visible_tasks(&caller, status, flow, &filter, limit, after)
            .await?;
        Ok(Response::new(pb::ListDeadLettersResponse {
            next_page_token: next_token(list, query, &tasks, more),
            dead_letters: tasks
                .iter()
                .map(|t| pb::DeadLetter {
                    task: Some(self.summary_view(t)),
                    failed_node: t.failed_node.clone().unwrap_or_default(),
                    error: t
                        .error
                        .as_deref()
                        .map(|e| self.masker.mask_text(e))
                        .unwrap_or_default(),
                })
                .collect(),
        }))
    }

    async fn apply_flow(
        &self,
        request: Request<pb::ApplyFlowRequest>,
    ) -> Result<Response<pb::ApplyFlowResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        if self.trust.is_enabled() {
            // The flow's id decides; a flow that does not parse is checked as flow "*" (and
            // then refused by apply with its errors).
            let flow_id = Flow::parse("api", &r.yaml).map_or_else(|_| "*".to_string(), |f| f.id);
            self.trust
                .check_task(&caller, TaskAction::Apply, &flow_id, None)
                .map_err(Error::from)?;
        }
        let source = if r.source.is_empty() {
            "api".to_string()
        } else {
            r.source
        };
        let now = self.engine.clock().now_ms();
        let (flow, changed) = self.engine.flows().apply(&source, &r.yaml, now).await?;
        Ok(Response::new(pb::ApplyFlowResponse {
            flow: Some(flow_summary(&flow, now)),
            changed,
        }))
    }

    async fn list_flows(
        &self,
        request: Request<pb::ListFlowsRequest>,
    ) -> Result<Response<pb::ListFlowsResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let flows = self
            .engine
            .flows()
            .latest_all()
            .into_iter()
            .filter(|e| r.flow_id.is_empty() || e.flow.id == r.flow_id)
            .filter(|e| self.sees_flow(&caller, &e.flow.id))
            .map(|e| {
                let mut summary = flow_summary(&e.flow, e.applied_ms);
                if !r.flow_id.is_empty() {
                    summary.yaml.clone_from(&e.flow.yaml);
                }
                summary
            })
            .collect();
        Ok(Response::new(pb::ListFlowsResponse { flows }))
    }

    async fn record_messages(
        &self,
        request: Request<pb::RecordMessagesRequest>,
    ) -> Result<Response<pb::RecordMessagesResponse>, Status> {
        crate::internal::check_record_messages(&self.trust, &Caller::of(request.extensions()))?;
        let r = request.into_inner();
        if r.dropped > 0 {
            self.ledger_dropped
                .fetch_add(r.dropped, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(dropped = r.dropped, "router dropped ledger entries");
        }
        let now = self.engine.clock().now_ms();
        let rows: Vec<(String, i64, String, Vec<u8>)> = r
            .entries
            .into_iter()
            .filter_map(|e| {
                let h = e.header.as_ref()?;
                if h.task_id.is_empty() {
                    return None;
                }
                let at = e
                    .routed_at
                    .as_ref()
                    .map_or(now, |t| t.seconds * 1000 + i64::from(t.nanos) / 1_000_000);
                Some((
                    h.task_id.clone(),
                    at,
                    h.message_id.clone(),
                    e.encode_to_vec(),
                ))
            })
            .collect();
        let accepted = u32::try_from(rows.len()).unwrap_or(u32::MAX);
        self.engine
            .store()
            .insert_ledger(&rows)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(pb::RecordMessagesResponse { accepted }))
    }

    async fn dump_task(
        &self,
        request: Request<pb::DumpTaskRequest>,
    ) -> Result<Response<pb::DumpTaskResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let task_id = request.into_inner().task_id;
        self.authorized(&caller, TaskAction::View, &task_id).await?;
        Ok(Response::new(self.dump(&task_id).await?))
    }

    // Creating and deleting a webhook need the rights of CancelTask: a webhook receives
    // every event of the task (more than a view shows once, and for as long as the task
    // lives), so viewing is not enough; no new trust action is added.
    async fn create_task_webhook(
        &self,
        request: Request<pb::CreateTaskWebhookRequest>,
    ) -> Result<Response<pb::CreateTaskWebhookResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        self.authorized(&caller, TaskAction::Cancel, &r.task_id)
            .await?;
        let row = crate::webhooks::validate(
            &r,
            &self.renderers,
            &self.egress,
            self.engine.clock().now_ms(),
        )?;
        match self
            .engine
            .store()
            .upsert_webhook(&row, crate::webhooks::MAX_WEBHOOKS_PER_TASK)
            .await
            .map_err(Error::from)?
        {
            WebhookUpsert::Stored(stored) => Ok(Response::new(pb::CreateTaskWebhookResponse {
                webhook: Some(crate::webhooks::view(&stored)),
            })),
            WebhookUpsert::Full => Err(Error::TooManyWebhooks {
                task_id: r.task_id,
                limit: crate::webhooks::MAX_WEBHOOKS_PER_TASK,
            }
            .into()),
        }
    }

    async fn get_task_webhook(
        &self,
        request: Request<pb::GetTaskWebhookRequest>,
    ) -> Result<Response<pb::GetTaskWebhookResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let state = self
            .authorized(&caller, TaskAction::View, &r.task_id)
            .await?;
        let Some(w) = self
            .engine
            .store()
            .webhook(&r.task_id, &r.webhook_id)
            .await
            .map_err(Error::from)?
        else {
            return Err(Error::WebhookNotFound {
                task_id: r.task_id,
                webhook_id: r.webhook_id,
            }
            .into());
        };
        Ok(Response::new(pb::GetTaskWebhookResponse {
            webhook: Some(self.webhook_view(&caller, &state, &w)),
        }))
    }

    async fn list_task_webhooks(
        &self,
        request: Request<pb::ListTaskWebhooksRequest>,
    ) -> Result<Response<pb::ListTaskWebhooksResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        let state = self
            .authorized(&caller, TaskAction::View, &r.task_id)
            .await?;
        let limit = page_size(r.page_size);
        let list = crate::page::List::Webhooks;
        let query = crate::page::Query::of(list, [caller.name(), r.task_id.as_str()]);
        let after = crate::page::decode(&r.page_token, list, query)?;
        let mut hooks = self
            .engine
            .store()
            .list_webhooks(
                &r.task_id,
                limit.saturating_add(1),
                after.map(|c| (c.created_ms, c.id)),
            )
            .await
            .map_err(Error::from)?;
        let more = hooks.len() > limit as usize;
        hooks.truncate(limit as usize);
        let next_page_token = match hooks.last() {
            Some(w) if more => crate::page::encode(
                list,
                query,
                &crate::page::Cursor {
                    created_ms: w.created_ms,
                    id: w.webhook_id.clone(),
                },
            ),
            _ => String::new(),
        };
        Ok(Response::new(pb::ListTaskWebhooksResponse {
            webhooks: hooks
                .iter()
                .map(|w| self.webhook_view(&caller, &state, w))
                .collect(),
            next_page_token,
        }))
    }

    async fn delete_task_webhook(
        &self,
        request: Request<pb::DeleteTaskWebhookRequest>,
    ) -> Result<Response<pb::DeleteTaskWebhookResponse>, Status> {
        let caller = Caller::of(request.extensions());
        let r = request.into_inner();
        self.authorized(&caller, TaskAction::Cancel, &r.task_id)
            .await?;
        if !self
            .engine
            .store()
            .delete_webhook(&r.task_id, &r.webhook_id)
            .await
            .map_err(Error::from)?
        {
            return Err(Error::WebhookNotFound {
                task_id: r.task_id,
                webhook_id: r.webhook_id,
            }
            .into());
        }
        Ok(Response::new(pb::DeleteTaskWebhookResponse {}))
    }
}

/// The proto summary of a flow.
pub fn flow_summary(flow: &crate::flow::Flow, applied_ms: i64) -> pb::FlowSummary {
    pb::FlowSummary {
        flow_id: flow.id.clone(),
        version: flow.version,
        initial: flow.initial.clone(),
        node_count: u32::try_from(flow.nodes.len()).unwrap_or(u32::MAX),
        applied_at: Some(ts(applied_ms)),
        source: flow.source.clone(),
        description: flow.description.clone().unwrap_or_default(),
        yaml: String::new(),
    }
}

/// The most labels a task may have.
const MAX_TASK_LABELS: usize = 16;
/// The most labels a ListTasks filter may name.
const MAX_LABEL_FILTERS: usize = 4;
/// The longest label key, in bytes.
const MAX_LABEL_KEY_BYTES: usize = 63;
/// The longest label value, in bytes.
const MAX_LABEL_VALUE_BYTES: usize = 256;

/// Checks `labels` against the limits: at most `max`, keys of 1 to 63 characters of
/// `A-Za-z0-9._/-`, values of at most 256 bytes.
fn validate_labels(
    labels: &std::collections::HashMap<String, String>,
    max: usize,
) -> Result<(), Error> {
    let invalid = |detail: String| Err(Error::InvalidLabels { detail });
    if labels.len() > max {
        return invalid(format!("{} labels, over the limit of {max}", labels.len()));
    }
    for (key, value) in labels {
        let key_ok = (1..=MAX_LABEL_KEY_BYTES).contains(&key.len())
            && key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-'));
        if !key_ok {
            return invalid(format!(
                "label key {:?} must be 1 to {MAX_LABEL_KEY_BYTES} characters of A-Z a-z 0-9 . _ / -",
                crate::expr::cut(key, 80)
            ));
        }
        if value.len() > MAX_LABEL_VALUE_BYTES {
            return invalid(format!(
                "label {key}'s value is {} bytes, over the limit of {MAX_LABEL_VALUE_BYTES}",
                value.len()
            ));
        }
    }
    Ok(())
}

/// The gRPC metadata key naming the person who resumes a task when the orchestrator runs
/// without trust (with trust the caller's identity is recorded instead): at most
/// [`MAX_REVIEWER_CHARS`] characters, control characters dropped.
pub const REVIEWER_METADATA: &str = "reach-reviewer";
/// The longest reviewer name recorded, in characters.
pub const MAX_REVIEWER_CHARS: usize = 64;

/// The reviewer named by `metadata`'s [`REVIEWER_METADATA`] (trimmed, control characters
/// dropped, cut to [`MAX_REVIEWER_CHARS`]); `None` when absent or empty.
fn reviewer_of(metadata: &tonic::metadata::MetadataMap) -> Option<String> {
    let raw = metadata.get(REVIEWER_METADATA)?.to_str().ok()?;
    let name: String = raw
        .chars()
        .filter(|c| !c.is_control())
        .take(MAX_REVIEWER_CHARS)
        .collect();
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_string())
}
