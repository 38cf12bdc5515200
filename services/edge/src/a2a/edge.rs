//! [`A2aEdge`]: the A2A operations as calls of registry, router and orchestrator, shared by
//! the gRPC binding ([`super::grpc`]) and the JSON-RPC binding ([`super::jsonrpc`]).

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use reach_proto::v1 as reach;
use reach_proto::v1::orchestrator_service_client::OrchestratorServiceClient;
use reach_proto::v1::registry_service_client::RegistryServiceClient;
use reach_proto::v1::router_service_client::RouterServiceClient;
use reach_sdk::{CallOptions, MeshClient};
use tonic::transport::Channel;
use tonic::{Code, Request};

use super::card::{self, Catalogue, Interfaces, Security, Skill};
use super::config::EdgeConfig;
use super::error::{A2aError, task_error};
use super::mapping::{self, CONTEXT_LABEL, EventMapper, context_of};
use super::proto::{
    AgentCard, AuthenticationInfo, CancelTaskRequest, DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest, GetTaskRequest, ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse, ListTasksRequest, ListTasksResponse, Message,
    SendMessageRequest, SendMessageResponse, StreamResponse, SubscribeToTaskRequest, Task,
    TaskPushNotificationConfig, TaskState, send_message_response, stream_response,
};

/// The orchestrator webhook format of A2A push notifications (rendered by
/// [`mapping::push_notifications`]).
pub const PUSH_FORMAT: &str = "a2a";

/// A stream of A2A events, ending after the task ends or needs input.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<StreamResponse, A2aError>> + Send>>;

/// The most registry pages read for one card (100 capabilities each).
const MAX_CATALOGUE_PAGES: usize = 20;
/// How many tasks of a ListTasks page are read at once.
const LIST_READS_AT_ONCE: usize = 8;
/// The most parts a message may carry.
pub const MAX_MESSAGE_PARTS: usize = 64;
/// The longest skill id or task id accepted, in bytes.
const MAX_ID_BYTES: usize = 256;

/// What a request carries besides its message: from gRPC metadata or HTTP headers.
#[derive(Debug, Clone, Default)]
pub struct RequestContext {
    /// The tenant: a service name scopes the request to that service's agent.
    pub tenant: String,
    /// The caller's `authorization` header, passed to the mesh so the trust policy applies
    /// to the caller, not to the edge.
    pub authorization: Option<String>,
    /// The caller's W3C `traceparent`, continued by the call into the mesh.
    pub traceparent: Option<String>,
    /// `Last-Event-ID` / `last-event-id`: resume a stream after this event sequence number.
    pub last_event_id: Option<u64>,
}

impl RequestContext {
    /// The context of a request with `headers` (HTTP headers, or gRPC metadata as them) for
    /// `tenant`: `A2A-Version` checked, `Authorization`, `traceparent` and `Last-Event-ID`
    /// read.
    ///
    /// # Errors
    /// [`A2aError::VersionNotSupported`]; [`A2aError::InvalidParams`] for a bad
    /// `Last-Event-ID`.
    pub fn from_headers(headers: &http::HeaderMap, tenant: &str) -> Result<Self, A2aError> {
        let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        Self::check_version(text("a2a-version"))?;
        Ok(Self {
            tenant: tenant.to_string(),
            authorization: text("authorization").map(str::to_string),
            traceparent: text("traceparent").map(str::to_string),
            last_event_id: Self::parse_last_event_id(text("last-event-id"))?,
        })
    }

    /// The `A2A-Version` check: absent, or 1.x, is served.
    ///
    /// # Errors
    /// [`A2aError::VersionNotSupported`] for any other version.
    pub fn check_version(version: Option<&str>) -> Result<(), A2aError> {
        let Some(version) = version.map(str::trim).filter(|v| !v.is_empty()) else {
            return Ok(());
        };
        // `Major.Minor` (a patch tolerated, as the official SDKs ignore it), numbers only.
        let mut numbers = version.split('.');
        let served = numbers.next() == Some("1")
            && numbers.clone().count() <= 2
            && numbers.all(|n| (1..=4).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()));
        if served {
            Ok(())
        } else {
            Err(A2aError::VersionNotSupported(reach_rpc::errors::cut(
                version, 32,
            )))
        }
    }

    /// Whether the edge may act for `caller`. It passes the caller's `authorization` into the
    /// mesh, so the trust policy judges the caller; a caller known only by its client
    /// certificate cannot be passed on and would act with the edge's own identity (a confused
    /// deputy), so it is refused. Anonymous callers (no trust) and bearer callers pass.
    ///
    /// # Errors
    /// [`A2aError::BearerRequired`].
    pub fn check_caller(caller: &reach_trust::Caller) -> Result<(), A2aError> {
        match caller.via() {
            reach_trust::Via::Certificate => Err(A2aError::BearerRequired),
            _ => Ok(()),
        }
    }

    /// The `last-event-id` value as a sequence number.
    ///
    /// # Errors
    /// [`A2aError::InvalidParams`] when it is not a number.
    pub fn parse_last_event_id(value: Option<&str>) -> Result<Option<u64>, A2aError> {
        value
            .map(|v| {
                // `reach.sequence` reaches JSON clients as a number (`11.0` in some).
                let v = v.trim();
                let integral = v.strip_suffix(".0").unwrap_or(v);
                integral.parse::<u64>().map_err(|_| {
                    A2aError::InvalidParams(format!(
                        "Last-Event-ID {:?} is not an event sequence number: send the metadata[\"reach.sequence\"] of the last event received",
                        reach_rpc::errors::cut(v, 32)
                    ))
                })
            })
            .transpose()
    }

    fn request<T>(&self, message: T) -> Request<T> {
        crate::forward::request(
            message,
            self.authorization.as_deref(),
            self.traceparent.as_deref(),
        )
    }

    /// The trace id of the caller's `traceparent`, when it is a valid one (W3C Trace
    /// Context).
    fn trace_id(&self) -> Option<String> {
        crate::forward::trace_id(self.traceparent.as_deref())
    }
}

/// The A2A edge: cards from the registry, messages to capabilities through the router, and
/// flows as orchestrator tasks. Cheap to clone.
#[derive(Clone)]
pub struct A2aEdge {
    inner: Arc<Inner>,
}

struct Inner {
    config: EdgeConfig,
    interfaces: Interfaces,
    security: Security,
    registry: RegistryServiceClient<Channel>,
    router: RouterServiceClient<Channel>,
    orchestrator: OrchestratorServiceClient<Channel>,
    as_caller: Option<(
        RouterServiceClient<Channel>,
        OrchestratorServiceClient<Channel>,
    )>,
    mesh: MeshClient,
}

/// The channels an [`A2aEdge`] calls the mesh on.
#[derive(Debug, Clone)]
pub struct MeshChannels {
    /// The registry (cards).
    pub registry: Channel,
    /// The router (capability calls).
    pub router: Channel,
    /// The orchestrator (flows, tasks, push configs).
    pub orchestrator: Channel,
    /// With TLS: channels to the router and the orchestrator that present no certificate of
    /// the edge's, for requests of callers with a bearer token — a verified certificate would
    /// win over the token, and the edge would act as itself. `None` without TLS (the token is
    /// then the only credential anyway).
    pub as_caller: Option<(Channel, Channel)>,
}

impl A2aEdge {
    /// An edge calling the registry, router and orchestrator on their channels, advertising
    /// `interfaces` and `security` in its cards.
    pub fn new(
        config: EdgeConfig,
        interfaces: Interfaces,
        security: Security,
        channels: MeshChannels,
    ) -> Self {
        let limit = config.max_message_bytes;
        let router =
            |channel: Channel| RouterServiceClient::new(channel).max_decoding_message_size(limit);
        let orchestrator = |channel: Channel| {
            OrchestratorServiceClient::new(channel).max_decoding_message_size(limit)
        };
        Self {
            inner: Arc::new(Inner {
                interfaces,
                security,
                registry: RegistryServiceClient::new(channels.registry)
                    .max_decoding_message_size(reach_rpc::limits::REGISTRY_LIST_BYTES),
                mesh: MeshClient::new(channels.router.clone(), "a2a.edge"),
                router: router(channels.router),
                orchestrator: orchestrator(channels.orchestrator),
                as_caller: channels
                    .as_caller
                    .map(|(r, o)| (router(r), orchestrator(o))),
                config,
            }),
        }
    }

    /// The router client for a request: one presenting no certificate of the edge's when
    /// the caller sent a bearer token (so the mesh authenticates the caller by it), else the
    /// edge's own.
    fn router(&self, cx: &RequestContext) -> RouterServiceClient<Channel> {
        crate::forward::client_for(
            self.inner.as_caller.as_ref().map(|(router, _)| router),
            &self.inner.router,
            cx.authorization.as_deref(),
        )
    }

    /// The orchestrator client for a request, as [`A2aEdge::router`].
    fn orchestrator(&self, cx: &RequestContext) -> OrchestratorServiceClient<Channel> {
        crate::forward::client_for(
            self.inner
                .as_caller
                .as_ref()
                .map(|(_, orchestrator)| orchestrator),
            &self.inner.orchestrator,
            cx.authorization.as_deref(),
        )
    }

    /// The edge's settings.
    pub fn config(&self) -> &EdgeConfig {
        &self.inner.config
    }

    async fn catalogue(&self, cx: &RequestContext) -> Result<Catalogue, A2aError> {
        let mut registry = self.inner.registry.clone();
        let mut catalogue = Catalogue::default();
        let mut token = String::new();
        for _ in 0..MAX_CATALOGUE_PAGES {
            let page = registry
                .list_capabilities(cx.request(reach::ListCapabilitiesRequest {
                    name_prefix: String::new(),
                    page_size: 100,
                    page_token: token,
                }))
                .await
                .map_err(A2aError::Mesh)?
                .into_inner();
            for descriptor in page.capabilities {
                catalogue
                    .capabilities
                    .insert(descriptor.name.clone(), descriptor);
            }
            token = page.next_page_token;
            if token.is_empty() {
                break;
            }
        }
        let instances = registry
            .list_instances(cx.request(reach::ListInstancesRequest::default()))
            .await
            .map_err(A2aError::Mesh)?
            .into_inner();
        for instance in instances.instances {
            let routable = matches!(
                instance.state(),
                reach::InstanceState::Ready | reach::InstanceState::Busy
            );
            if let (true, Some(spec)) = (routable, instance.spec) {
                catalogue
                    .services
                    .entry(spec.service)
                    .or_default()
                    .extend(spec.capabilities.into_iter().map(|c| c.name));
            }
        }
        let mut orchestrator = self.inner.orchestrator.clone();
        match orchestrator
            .list_flows(cx.request(reach::ListFlowsRequest::default()))
            .await
        {
            Ok(flows) => catalogue.flows = flows.into_inner().flows,
            // A mesh without an orchestrator has no flows, but its capabilities still serve.
            Err(status) if status.code() == Code::Unimplemented => {}
            Err(status) => return Err(A2aError::Mesh(status)),
        }
        Ok(catalogue)
    }

    /// The card of the mesh (`service` `None`) or of one service.
    ///
    /// # Errors
    /// [`A2aError::InvalidParams`] naming an unknown service (no routable instance);
    /// [`A2aError::Mesh`] when the registry or orchestrator cannot be asked.
    pub async fn card(
        &self,
        cx: &RequestContext,
        service: Option<&str>,
    ) -> Result<AgentCard, A2aError> {
        let catalogue = self.catalogue(cx).await?;
        let inner = &self.inner;
        match service.filter(|s| !s.is_empty()) {
            None => Ok(card::mesh_card(
                &catalogue,
                &inner.interfaces,
                inner.security,
            )),
            Some(service) => {
                card::service_card(&catalogue, service, &inner.interfaces, inner.security)
                    .ok_or_else(|| unknown_service(service, &catalogue))
            }
        }
    }

    /// SendMessage: a message to a capability is answered by a `Message` with the reply's
    /// parts; a message to a flow starts a task and answers with the `Task` (once it ends or
    /// needs input, unless `return_immediately`); a message naming a task in INPUT_REQUIRED
    /// resumes it.
    ///
    /// # Errors
    /// [`A2aError::InvalidParams`] for a message without parts or skill, or an input the
    /// human node's schema refuses; [`A2aError::TaskNotFound`];
    /// [`A2aError::UnsupportedOperation`] for a message to a task that is not waiting for
    /// input; [`A2aError::Mesh`] with the router's or agent's status.
    pub async fn send_message(
        &self,
        cx: &RequestContext,
        request: SendMessageRequest,
    ) -> Result<SendMessageResponse, A2aError> {
        let message = validate_message(request.message.as_ref())?;
        let configuration = request.configuration.unwrap_or_default();
        let history = history_length(configuration.history_length)?;
        let task = if !message.task_id.is_empty() {
            self.resume(cx, message).await?
        } else {
            match self.skill(cx, message, request.metadata.as_ref()).await? {
                Skill::Capability(capability) => {
                    let reply = self.call_capability(cx, &capability, message).await?;
                    return Ok(SendMessageResponse {
                        payload: Some(send_message_response::Payload::Message(reply)),
                    });
                }
                Skill::Flow(flow) => self.start_flow(cx, &flow, message).await?,
            }
        };
        if let Some(push) = configuration.task_push_notification_config {
            self.push_for(cx, &task.task_id, push).await?;
        }
        let task = if configuration.return_immediately {
            task
        } else {
            self.wait_settled(cx, task).await?
        };
        Ok(SendMessageResponse {
            payload: Some(send_message_response::Payload::Task(
                self.task_view(&task, history, true),
            )),
        })
    }

    /// SendStreamingMessage: as [`A2aEdge::send_message`], streamed: a capability's reply is
    /// one `message` event; a flow task streams its snapshot, then its status and artifact
    /// updates until it ends or needs input.
    ///
    /// # Errors
    /// As [`A2aEdge::send_message`], before the stream starts.
    pub async fn send_streaming_message(
        &self,
        cx: &RequestContext,
        request: SendMessageRequest,
    ) -> Result<EventStream, A2aError> {
        let message = validate_message(request.message.as_ref())?;
        let push = request
            .configuration
            .and_then(|c| c.task_push_notification_config);
        let task = if !message.task_id.is_empty() {
            self.resume(cx, message).await?
        } else {
            match self.skill(cx, message, request.metadata.as_ref()).await? {
                Skill::Capability(capability) => {
                    let reply = self.call_capability(cx, &capability, message).await?;
                    let event = StreamResponse {
                        payload: Some(stream_response::Payload::Message(reply)),
                    };
                    return Ok(Box::pin(futures::stream::once(async { Ok(event) })));
                }
                Skill::Flow(flow) => self.start_flow(cx, &flow, message).await?,
            }
        };
        if let Some(push) = push {
            self.push_for(cx, &task.task_id, push).await?;
        }
        Ok(self.stream_task(cx, task, cx.last_event_id))
    }

    /// Checks the request's tenant: empty (the mesh), or a service with a routable instance.
    /// Tasks are the mesh's (flows), so a service's agent shares them.
    async fn check_tenant(&self, cx: &RequestContext) -> Result<(), A2aError> {
        if cx.tenant.is_empty() {
            return Ok(());
        }
        let catalogue = self.catalogue(cx).await?;
        if catalogue.services.contains_key(&cx.tenant) {
            Ok(())
        } else {
            Err(unknown_service(&cx.tenant, &catalogue))
        }
    }

    /// GetTask.
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`]; [`A2aError::InvalidParams`] for a negative history length
    /// or an unknown tenant.
    pub async fn get_task(
        &self,
        cx: &RequestContext,
        request: GetTaskRequest,
    ) -> Result<Task, A2aError> {
        self.check_tenant(cx).await?;
        let history = history_length(request.history_length)?;
        let task = self.reach_task(cx, &request.id).await?;
        Ok(self.task_view(&task, history, true))
    }

    /// ListTasks: the orchestrator's tasks, newest first, filtered by state and context.
    ///
    /// # Errors
    /// [`A2aError::InvalidParams`] for a page size outside 1–100 or a bad page token.
    pub async fn list_tasks(
        &self,
        cx: &RequestContext,
        request: ListTasksRequest,
    ) -> Result<ListTasksResponse, A2aError> {
        self.check_tenant(cx).await?;
        let page_size = match request.page_size {
            None | Some(0) => 50,
            Some(n @ 1..=100) => n,
            Some(n) => {
                return Err(A2aError::InvalidParams(format!(
                    "pageSize {n} is out of range: ask for 1 to 100 tasks per page"
                )));
            }
        };
        let history = history_length(request.history_length)?;
        let statuses = mapping::reach_statuses(request.status());
        if request.status() != TaskState::Unspecified && statuses.is_empty() {
            // No Reach task is ever REJECTED or AUTH_REQUIRED.
            return Ok(ListTasksResponse {
                tasks: Vec::new(),
                next_page_token: String::new(),
                page_size,
                total_size: 0,
            });
        }
        // One status is filtered by the orchestrator; two (SUBMITTED, FAILED) here.
        let status = match statuses {
            [one] => *one,
            _ => reach::TaskStatus::Unspecified,
        };
        let mut orchestrator = self.orchestrator(cx);
        let page = orchestrator
            .list_tasks(cx.request(reach::ListTasksRequest {
                status: status.into(),
                flow_id: String::new(),
                page_size: u32::try_from(page_size).unwrap_or(50),
                page_token: request.page_token.clone(),
                labels: if request.context_id.is_empty() {
                    Default::default()
                } else {
                    [(CONTEXT_LABEL.to_string(), request.context_id.clone())].into()
                },
            }))
            .await
            .map_err(|status| match status.code() {
                Code::InvalidArgument => A2aError::InvalidParams(status.message().to_string()),
                _ => A2aError::Mesh(status),
            })?
            .into_inner();
        let after = request
            .status_timestamp_after
            .as_ref()
            .map(|t| (t.seconds, t.nanos));
        let include_artifacts = request.include_artifacts.unwrap_or(false);
        let wanted = request.status();
        let rows: Vec<String> = page
            .tasks
            .iter()
            .filter(|t| statuses.is_empty() || statuses.contains(&t.status()))
            .filter(|t| match (after, &t.updated_at) {
                (Some(after), Some(updated)) => (updated.seconds, updated.nanos) > after,
                _ => true,
            })
            .map(|t| t.task_id.clone())
            .collect();
        // Lists carry no node history, which the A2A state, artifacts and history come
        // from: read each task (a few at a time).
        let full: Vec<Result<reach::Task, A2aError>> = futures::stream::iter(rows)
            .map(|id| {
                let (edge, cx) = (self.clone(), cx.clone());
                async move { edge.reach_task(&cx, &id).await }
            })
            .buffered(LIST_READS_AT_ONCE)
            .collect()
            .await;
        let mut tasks = Vec::new();
        for task in full {
            match task {
                Ok(task) => {
                    if wanted == TaskState::Unspecified || mapping::state_of(&task) == wanted {
                        tasks.push(self.task_view(&task, history, include_artifacts));
                    }
                }
                // Purged between the list and the read.
                Err(A2aError::TaskNotFound(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(ListTasksResponse {
            total_size: i32::try_from(tasks.len()).unwrap_or(i32::MAX),
            tasks,
            next_page_token: page.next_page_token,
            page_size,
        })
    }

    /// CancelTask: cancels a task that has not ended (a human node's `on_cancel` runs).
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`]; [`A2aError::TaskNotCancelable`] for a task that ended.
    pub async fn cancel_task(
        &self,
        cx: &RequestContext,
        request: CancelTaskRequest,
    ) -> Result<Task, A2aError> {
        self.check_tenant(cx).await?;
        let task = self.reach_task(cx, &request.id).await?;
        let state = mapping::state_of(&task);
        if mapping::is_terminal(state) {
            return Err(A2aError::TaskNotCancelable {
                id: request.id,
                state: state.as_str_name(),
            });
        }
        let mut orchestrator = self.orchestrator(cx);
        let cancelled = orchestrator
            .cancel_task(cx.request(reach::CancelTaskRequest {
                task_id: request.id.clone(),
                reason: "cancelled by an A2A client (CancelTask)".into(),
            }))
            .await
            .map_err(|status| match status.code() {
                Code::FailedPrecondition => A2aError::TaskNotCancelable {
                    id: request.id.clone(),
                    state: "ended",
                },
                _ => task_error(&request.id, status),
            })?
            .into_inner()
            .task
            .unwrap_or_default();
        // The cancel runs the node's `on_cancel` path; answer once the task has ended there
        // (at most `max_wait`), as CANCELED.
        let task = self.wait_until(cx, cancelled, mapping::is_terminal).await?;
        Ok(self.task_view(&task, None, true))
    }

    /// SubscribeToTask: the task's snapshot, then its updates until it ends or needs input.
    /// With `last_event_id`, the events after that sequence number (also of a task that has
    /// ended since); without it, a task that has ended is refused.
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`]; [`A2aError::UnsupportedOperation`] for an ended task
    /// without `last_event_id`.
    pub async fn subscribe(
        &self,
        cx: &RequestContext,
        request: SubscribeToTaskRequest,
    ) -> Result<EventStream, A2aError> {
        self.check_tenant(cx).await?;
        let task = self.reach_task(cx, &request.id).await?;
        if cx.last_event_id.is_none() && mapping::is_terminal(mapping::state_of(&task)) {
            return Err(A2aError::UnsupportedOperation(format!(
                "task {} has ended ({}); GetTask returns its result (to replay events after one you received, send Last-Event-ID)",
                task.task_id,
                mapping::state_of(&task).as_str_name()
            )));
        }
        Ok(self.stream_task(cx, task, cx.last_event_id))
    }

    /// CreateTaskPushNotificationConfig: a webhook of the task, kept and delivered by the
    /// orchestrator from its durable event log (a webhook that is down gets each event later,
    /// in order), with `X-A2A-Notification-Token` and `Authorization` as the config says.
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`]; [`A2aError::InvalidParams`] for a bad URL, too many
    /// webhooks or oversized credentials; [`A2aError::PushNotificationNotSupported`] without
    /// an orchestrator.
    pub async fn create_push_config(
        &self,
        cx: &RequestContext,
        config: TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, A2aError> {
        let task_id = config.task_id.clone();
        if task_id.is_empty() {
            return Err(A2aError::InvalidParams(
                "taskId is required: the task whose updates are pushed".into(),
            ));
        }
        self.push_for(cx, &task_id, config).await
    }

    async fn push_for(
        &self,
        cx: &RequestContext,
        task_id: &str,
        config: TaskPushNotificationConfig,
    ) -> Result<TaskPushNotificationConfig, A2aError> {
        let authentication = config.authentication.unwrap_or_default();
        let mut orchestrator = self.orchestrator(cx);
        let webhook = orchestrator
            .create_task_webhook(cx.request(reach::CreateTaskWebhookRequest {
                task_id: task_id.to_string(),
                webhook_id: config.id,
                url: config.url,
                token: config.token,
                auth_scheme: authentication.scheme,
                auth_credentials: authentication.credentials,
                format: PUSH_FORMAT.into(),
            }))
            .await
            .map_err(|status| push_error(task_id, status))?
            .into_inner()
            .webhook
            .unwrap_or_default();
        Ok(push_config(&cx.tenant, webhook))
    }

    /// GetTaskPushNotificationConfig (credentials are never returned).
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`] for an unknown task or config (as the official SDK).
    pub async fn get_push_config(
        &self,
        cx: &RequestContext,
        request: GetTaskPushNotificationConfigRequest,
    ) -> Result<TaskPushNotificationConfig, A2aError> {
        let mut orchestrator = self.orchestrator(cx);
        let webhook = orchestrator
            .get_task_webhook(cx.request(reach::GetTaskWebhookRequest {
                task_id: request.task_id.clone(),
                webhook_id: request.id,
            }))
            .await
            .map_err(|status| push_error(&request.task_id, status))?
            .into_inner()
            .webhook
            .unwrap_or_default();
        Ok(push_config(&cx.tenant, webhook))
    }

    /// ListTaskPushNotificationConfigs, oldest first, paged.
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`]; [`A2aError::InvalidParams`] for a bad page token.
    pub async fn list_push_configs(
        &self,
        cx: &RequestContext,
        request: ListTaskPushNotificationConfigsRequest,
    ) -> Result<ListTaskPushNotificationConfigsResponse, A2aError> {
        let mut orchestrator = self.orchestrator(cx);
        let page = orchestrator
            .list_task_webhooks(cx.request(reach::ListTaskWebhooksRequest {
                task_id: request.task_id.clone(),
                page_size: u32::try_from(request.page_size).unwrap_or(0),
                page_token: request.page_token,
            }))
            .await
            .map_err(|status| push_error(&request.task_id, status))?
            .into_inner();
        Ok(ListTaskPushNotificationConfigsResponse {
            configs: page
                .webhooks
                .into_iter()
                .map(|w| push_config(&cx.tenant, w))
                .collect(),
            next_page_token: page.next_page_token,
        })
    }

    /// DeleteTaskPushNotificationConfig: nothing more is sent to it.
    ///
    /// # Errors
    /// [`A2aError::TaskNotFound`] for an unknown task or config.
    pub async fn delete_push_config(
        &self,
        cx: &RequestContext,
        request: DeleteTaskPushNotificationConfigRequest,
    ) -> Result<(), A2aError> {
        let mut orchestrator = self.orchestrator(cx);
        orchestrator
            .delete_task_webhook(cx.request(reach::DeleteTaskWebhookRequest {
                task_id: request.task_id.clone(),
                webhook_id: request.id,
            }))
            .await
            .map_err(|status| push_error(&request.task_id, status))?;
        Ok(())
    }

    fn task_view(&self, task: &reach::Task, history: Option<usize>, artifacts: bool) -> Task {
        mapping::task_from_reach(task, context_of(task), history, artifacts)
    }

    async fn reach_task(&self, cx: &RequestContext, id: &str) -> Result<reach::Task, A2aError> {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return Err(A2aError::InvalidParams(format!(
                "task id must be 1 to {MAX_ID_BYTES} bytes (got {})",
                id.len()
            )));
        }
        let mut orchestrator = self.orchestrator(cx);
        orchestrator
            .get_task(cx.request(reach::GetTaskRequest {
                task_id: id.to_string(),
            }))
            .await
            .map_err(|status| task_error(id, status))?
            .into_inner()
            .task
            .ok_or_else(|| A2aError::InvalidAgentResponse("GetTask returned no task".into()))
    }

    /// Which skill a new message goes to: `message.metadata.skill`, the request's
    /// `metadata.skill`, the tenant service's only capability, or the configured default.
    async fn skill(
        &self,
        cx: &RequestContext,
        message: &Message,
        metadata: Option<&pbjson_types::Struct>,
    ) -> Result<Skill, A2aError> {
        let named = [message.metadata.as_ref(), metadata]
            .into_iter()
            .flatten()
            .find_map(
                |m| match m.fields.get("skill").and_then(|v| v.kind.as_ref()) {
                    Some(pbjson_types::value::Kind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                },
            );
        if let Some(id) = &named
            && (id.is_empty() || id.len() > MAX_ID_BYTES)
        {
            return Err(A2aError::InvalidParams(format!(
                "metadata.skill must be a skill id of 1 to {MAX_ID_BYTES} bytes from the agent card"
            )));
        }
        if !cx.tenant.is_empty() {
            // A service's agent: its capabilities only.
            let catalogue = self.catalogue(cx).await?;
            let Some(capabilities) = catalogue.services.get(&cx.tenant) else {
                return Err(unknown_service(&cx.tenant, &catalogue));
            };
            return match named {
                Some(id) if capabilities.contains(&id) => Ok(Skill::Capability(id)),
                Some(id) => Err(A2aError::InvalidParams(format!(
                    "service {} has no skill {id:?}; its skills are {}",
                    cx.tenant,
                    capabilities.iter().cloned().collect::<Vec<_>>().join(", ")
                ))),
                None if capabilities.len() == 1 => Ok(Skill::Capability(
                    capabilities.iter().next().cloned().unwrap_or_default(),
                )),
                None => Err(A2aError::InvalidParams(format!(
                    "service {} has several skills ({}): name one in the message's metadata, as \"skill\"",
                    cx.tenant,
                    capabilities.iter().cloned().collect::<Vec<_>>().join(", ")
                ))),
            };
        }
        match named.or_else(|| self.inner.config.default_skill.clone()) {
            Some(id) => Ok(Skill::parse(&id)),
            None => Err(A2aError::InvalidParams(
                "the message names no skill: set metadata.skill on the message (or the request) to a skill id of the agent card, such as complaint.classify or flow:complaint-flow".into(),
            )),
        }
    }

    async fn call_capability(
        &self,
        cx: &RequestContext,
        capability: &str,
        message: &Message,
    ) -> Result<Message, A2aError> {
        let parts = message
            .parts
            .iter()
            .enumerate()
            .map(|(i, p)| mapping::part_to_reach(i, p))
            .collect::<Result<Vec<_>, _>>()?;
        let options = CallOptions {
            timeout: Some(self.inner.config.call_timeout),
            trace_id: cx.trace_id(),
            ..CallOptions::default()
        };
        let payload = reach::Payload {
            r#type: capability.to_string(),
            parts,
        };
        let envelope = self
            .inner
            .mesh
            .message_to_capability(capability, payload, &options);
        let mut request = cx.request(reach::CallRequest {
            message: Some(envelope),
        });
        request.set_timeout(self.inner.config.call_timeout);
        let mut router = self.router(cx);
        let reply = router
            .call(request)
            .await
            .map_err(|status| {
                let no_route = reach_rpc::errors::reason_of(&status).as_deref()
                    == Some(reach_rpc::errors::reason::ROUTE_NOT_FOUND);
                match status.code() {
                    // The skill names no capability the mesh can route: the router's message
                    // lists what it can.
                    Code::InvalidArgument => A2aError::InvalidParams(status.message().to_string()),
                    Code::NotFound if no_route => A2aError::InvalidParams(format!(
                        "skill {capability:?}: {}",
                        status.message()
                    )),
                    _ => A2aError::Mesh(status),
                }
            })?
            .into_inner();
        let reply_message = reply.message.unwrap_or_default();
        let header = reply_message.header.unwrap_or_default();
        let route = reply.route.unwrap_or_default();
        let parts = reply_message
            .payload
            .map(|p| p.parts.iter().map(mapping::part_from_reach).collect())
            .unwrap_or_default();
        let mut reply = mapping::agent_message(
            if header.message_id.is_empty() {
                uuid::Uuid::now_v7().to_string()
            } else {
                header.message_id.clone()
            },
            "",
            &message.context_id,
            parts,
        );
        reply.metadata = mapping::to_struct(serde_json::json!({
            "reach.traceId": route.trace_id,
            "reach.instanceId": route.instance_id,
            "reach.service": route.service,
            "reach.skill": capability,
        }));
        Ok(reply)
    }

    async fn start_flow(
        &self,
        cx: &RequestContext,
        flow: &str,
        message: &Message,
    ) -> Result<reach::Task, A2aError> {
        let input = reach_proto::json::to_proto(&mapping::message_input(message)?);
        mapping::check_depth("the flow's input (the message's first data part)", &input)?;
        if message.context_id.len() > MAX_ID_BYTES {
            return Err(A2aError::InvalidParams(format!(
                "message.contextId is {} bytes, over the limit of {MAX_ID_BYTES}",
                message.context_id.len()
            )));
        }
        let task_id = uuid::Uuid::now_v7().to_string();
        // The task keeps its context as a label: the client's, or a context of its own (its
        // id), so ListTasks filters by context either way.
        let context_id = if message.context_id.is_empty() {
            task_id.clone()
        } else {
            message.context_id.clone()
        };
        let mut orchestrator = self.orchestrator(cx);
        let task = orchestrator
            .start_task(cx.request(reach::StartTaskRequest {
                flow_id: flow.to_string(),
                flow_version: 0,
                input: Some(input),
                task_id,
                labels: [(CONTEXT_LABEL.to_string(), context_id)].into(),
            }))
            .await
            .map_err(|status| match status.code() {
                Code::NotFound | Code::InvalidArgument => {
                    A2aError::InvalidParams(status.message().to_string())
                }
                _ => A2aError::Mesh(status),
            })?
            .into_inner()
            .task
            .ok_or_else(|| A2aError::InvalidAgentResponse("StartTask returned no task".into()))?;
        Ok(task)
    }

    async fn resume(
        &self,
        cx: &RequestContext,
        message: &Message,
    ) -> Result<reach::Task, A2aError> {
        let id = &message.task_id;
        let task = self.reach_task(cx, id).await?;
        if task.status() != reach::TaskStatus::WaitingHuman {
            return Err(A2aError::UnsupportedOperation(format!(
                "task {id} is {} and takes no message: only a task in TASK_STATE_INPUT_REQUIRED (a flow waiting in a human step) is resumed by a message; to start a new task, send the message without taskId",
                mapping::state_of(&task).as_str_name()
            )));
        }
        let input = reach_proto::json::to_proto(&mapping::message_input(message)?);
        mapping::check_depth("the answer (the message's first data part)", &input)?;
        let node = task
            .waiting
            .as_ref()
            .map(|w| w.node_id.clone())
            .unwrap_or_default();
        let mut orchestrator = self.orchestrator(cx);
        let resumed = orchestrator
            .resume_task(cx.request(reach::ResumeTaskRequest {
                task_id: id.clone(),
                node_id: node,
                input: Some(input),
            }))
            .await
            .map_err(|status| match status.code() {
                Code::FailedPrecondition => A2aError::UnsupportedOperation(format!(
                    "task {id} no longer waits for input: {}",
                    status.message()
                )),
                _ => task_error(id, status),
            })?
            .into_inner()
            .task
            .ok_or_else(|| A2aError::InvalidAgentResponse("ResumeTask returned no task".into()))?;
        Ok(resumed)
    }

    /// Waits (at most `max_wait`) until the task ends or needs input, then reads it again.
    async fn wait_settled(
        &self,
        cx: &RequestContext,
        task: reach::Task,
    ) -> Result<reach::Task, A2aError> {
        self.wait_until(cx, task, mapping::ends_stream).await
    }

    /// Waits (at most `max_wait`) until the task's state satisfies `done`, then reads it
    /// again.
    async fn wait_until(
        &self,
        cx: &RequestContext,
        task: reach::Task,
        done: fn(TaskState) -> bool,
    ) -> Result<reach::Task, A2aError> {
        let after = task.last_sequence;
        if done(mapping::state_of(&task)) {
            return self.reach_task(cx, &task.task_id).await;
        }
        let mut orchestrator = self.orchestrator(cx);
        let watch = orchestrator.watch_task(cx.request(reach::WatchTaskRequest {
            task_id: task.task_id.clone(),
            after_sequence: after,
        }));
        let settled = async {
            let mut events = watch
                .await
                .map_err(|status| task_error(&task.task_id, status))?
                .into_inner();
            while let Some(event) = events.next().await {
                let event = event
                    .map_err(|status| task_error(&task.task_id, status))?
                    .event
                    .unwrap_or_default();
                // Only the states that end waiting matter here, and those do not depend on
                // the task's progress (terminal, or waiting for input).
                if done(mapping::task_state(
                    event.status(),
                    mapping::Progress::default(),
                )) {
                    break;
                }
            }
            Ok::<(), A2aError>(())
        };
        // Past the wait the task is returned as it is (WORKING): the client polls GetTask
        // or subscribes.
        if let Ok(result) = tokio::time::timeout(self.inner.config.max_wait, settled).await {
            result?;
        }
        self.reach_task(cx, &task.task_id).await
    }

    /// The task's snapshot, then the events after `after` (default: those the snapshot
    /// reflects), until the task ends or needs input.
    fn stream_task(
        &self,
        cx: &RequestContext,
        task: reach::Task,
        after: Option<u64>,
    ) -> EventStream {
        let edge = self.clone();
        let cx = cx.clone();
        let now = task.last_sequence;
        let after = after.unwrap_or(now);
        let stream = async_stream(move |tx| async move {
            let snapshot = edge.task_view(&task, None, true);
            if tx
                .send(Ok(StreamResponse {
                    payload: Some(stream_response::Payload::Task(snapshot)),
                }))
                .await
                .is_err()
            {
                return;
            }
            // An ended task with nothing to replay: the snapshot is the whole answer. A task
            // already waiting for input keeps the stream open until it changes and next ends
            // or needs input (as the official SDK's subscriptions do).
            if after >= now && mapping::is_terminal(mapping::state_of(&task)) {
                return;
            }
            let mut orchestrator = edge.orchestrator(&cx);
            let mut events = match orchestrator
                .watch_task(cx.request(reach::WatchTaskRequest {
                    task_id: task.task_id.clone(),
                    // From the start: the mapping folds the whole log, so the events after
                    // `after` are the same whichever connection asks.
                    after_sequence: 0,
                }))
                .await
            {
                Ok(events) => events.into_inner(),
                Err(status) => {
                    let _ = tx.send(Err(task_error(&task.task_id, status))).await;
                    return;
                }
            };
            let mut mapper = EventMapper::new(&task.task_id, context_of(&task));
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(response) => response.event.unwrap_or_default(),
                    Err(status) => {
                        let _ = tx.send(Err(task_error(&task.task_id, status))).await;
                        return;
                    }
                };
                let updates = mapper.map(&event);
                if event.sequence <= after {
                    continue;
                }
                for update in updates {
                    if tx.send(Ok(update)).await.is_err() {
                        return;
                    }
                }
                // A replay goes past old waits for input: only the current one (at or after
                // the snapshot) ends the stream, as an end does.
                let state = mapper.state();
                if mapping::is_terminal(state)
                    || (mapping::ends_stream(state) && event.sequence >= now)
                {
                    return;
                }
            }
        });
        Box::pin(stream)
    }
}

/// A stream fed by `produce` through a bounded channel (16 events), which ends when
/// `produce` returns; dropping the stream makes the next send fail, so `produce` stops.
fn async_stream<F, Fut>(produce: F) -> impl Stream<Item = Result<StreamResponse, A2aError>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<StreamResponse, A2aError>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(produce(tx));
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A webhook as an A2A push config; the credentials are never returned, the scheme is.
fn push_config(tenant: &str, webhook: reach::TaskWebhook) -> TaskPushNotificationConfig {
    TaskPushNotificationConfig {
        tenant: tenant.to_string(),
        id: webhook.webhook_id,
        task_id: webhook.task_id,
        url: webhook.url,
        token: webhook.token,
        authentication: (!webhook.auth_scheme.is_empty()).then(|| AuthenticationInfo {
            scheme: webhook.auth_scheme,
            credentials: String::new(),
        }),
    }
}

/// The A2A error of a failed webhook call about task `task_id`.
fn push_error(task_id: &str, status: tonic::Status) -> A2aError {
    match status.code() {
        // An unknown task or config: TaskNotFound, as the official SDK answers both.
        Code::NotFound => A2aError::TaskNotFound(task_id.to_string()),
        Code::InvalidArgument | Code::FailedPrecondition => {
            A2aError::InvalidParams(status.message().to_string())
        }
        Code::Unimplemented => A2aError::PushNotificationNotSupported,
        _ => A2aError::Mesh(status),
    }
}

fn unknown_service(service: &str, catalogue: &Catalogue) -> A2aError {
    let known: Vec<&str> = catalogue.services.keys().map(String::as_str).collect();
    A2aError::InvalidParams(format!(
        "no routable service {:?}; the mesh's services are {}",
        reach_rpc::errors::cut(service, 64),
        if known.is_empty() {
            "none yet".to_string()
        } else {
            known.join(", ")
        }
    ))
}

fn validate_message(message: Option<&Message>) -> Result<&Message, A2aError> {
    let message = message
        .ok_or_else(|| A2aError::InvalidParams("the request has no message: set message".into()))?;
    if message.parts.is_empty() {
        return Err(A2aError::InvalidParams(
            "message.parts is empty: a message carries at least one text or data part".into(),
        ));
    }
    if message.parts.len() > MAX_MESSAGE_PARTS {
        return Err(A2aError::InvalidParams(format!(
            "message has {} parts, over the limit of {MAX_MESSAGE_PARTS}",
            message.parts.len()
        )));
    }
    if message.task_id.len() > MAX_ID_BYTES {
        return Err(A2aError::InvalidParams(format!(
            "message.taskId is {} bytes, over the limit of {MAX_ID_BYTES}",
            message.task_id.len()
        )));
    }
    if message.role() == super::proto::Role::Agent {
        return Err(A2aError::InvalidParams(
            "message.role is ROLE_AGENT: a client's message has ROLE_USER".into(),
        ));
    }
    Ok(message)
}

fn history_length(length: Option<i32>) -> Result<Option<usize>, A2aError> {
    match length {
        None => Ok(None),
        Some(n) => usize::try_from(n).map(Some).map_err(|_| {
            A2aError::InvalidParams(format!(
                "historyLength {n} is negative: ask for 0 or more messages, or leave it unset for all"
            ))
        }),
    }
}
