//! The A2A gRPC binding: `lf.a2a.v1.A2AService` served by [`A2aGrpc`] on the mesh port.
//! Request metadata: `a2a-version` (refused unless 1.x), `authorization` and `traceparent`
//! (passed into the mesh), `last-event-id` (resume a stream after that event sequence).

use futures::StreamExt;
use tonic::{Request, Response, Status};

use super::edge::{A2aEdge, EventStream, RequestContext};
use super::proto::a2a_service_server::{A2aService, A2aServiceServer};
use super::proto::{
    AgentCard, CancelTaskRequest, DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest, GetTaskPushNotificationConfigRequest, GetTaskRequest,
    ListTaskPushNotificationConfigsRequest, ListTaskPushNotificationConfigsResponse,
    ListTasksRequest, ListTasksResponse, SendMessageRequest, SendMessageResponse, StreamResponse,
    SubscribeToTaskRequest, Task, TaskPushNotificationConfig,
};

/// The gRPC service of an [`A2aEdge`].
#[derive(Clone)]
pub struct A2aGrpc {
    edge: A2aEdge,
}

impl A2aGrpc {
    /// The service of `edge`.
    pub fn new(edge: A2aEdge) -> Self {
        Self { edge }
    }

    /// As a tonic server, with the edge's message limits.
    pub fn into_server(self) -> A2aServiceServer<Self> {
        let limit = self.edge.config().max_message_bytes;
        A2aServiceServer::new(self)
            .max_decoding_message_size(limit)
            .max_encoding_message_size(limit)
    }
}

fn context<T>(request: &Request<T>, tenant: &str) -> Result<RequestContext, Status> {
    let cx = RequestContext::from_headers(request.metadata().as_ref(), tenant)?;
    RequestContext::check_caller(&reach_trust::Caller::of(request.extensions()))?;
    Ok(cx)
}

fn events(stream: EventStream) -> EventsStream {
    Box::pin(stream.map(|item| item.map_err(Status::from)))
}

/// The server-streaming responses of SendStreamingMessage and SubscribeToTask.
pub type EventsStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<StreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl A2aService for A2aGrpc {
    async fn send_message(
        &self,
        request: Request<SendMessageRequest>,
    ) -> Result<Response<SendMessageResponse>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge.send_message(&cx, request.into_inner()).await?,
        ))
    }

    type SendStreamingMessageStream = EventsStream;

    async fn send_streaming_message(
        &self,
        request: Request<SendMessageRequest>,
    ) -> Result<Response<EventsStream>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        let stream = self
            .edge
            .send_streaming_message(&cx, request.into_inner())
            .await?;
        Ok(Response::new(events(stream)))
    }

    async fn get_task(&self, request: Request<GetTaskRequest>) -> Result<Response<Task>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge.get_task(&cx, request.into_inner()).await?,
        ))
    }

    async fn list_tasks(
        &self,
        request: Request<ListTasksRequest>,
    ) -> Result<Response<ListTasksResponse>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge.list_tasks(&cx, request.into_inner()).await?,
        ))
    }

    async fn cancel_task(
        &self,
        request: Request<CancelTaskRequest>,
    ) -> Result<Response<Task>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge.cancel_task(&cx, request.into_inner()).await?,
        ))
    }

    type SubscribeToTaskStream = EventsStream;

    async fn subscribe_to_task(
        &self,
        request: Request<SubscribeToTaskRequest>,
    ) -> Result<Response<EventsStream>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        let stream = self.edge.subscribe(&cx, request.into_inner()).await?;
        Ok(Response::new(events(stream)))
    }

    async fn create_task_push_notification_config(
        &self,
        request: Request<TaskPushNotificationConfig>,
    ) -> Result<Response<TaskPushNotificationConfig>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge
                .create_push_config(&cx, request.into_inner())
                .await?,
        ))
    }

    async fn get_task_push_notification_config(
        &self,
        request: Request<GetTaskPushNotificationConfigRequest>,
    ) -> Result<Response<TaskPushNotificationConfig>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge.get_push_config(&cx, request.into_inner()).await?,
        ))
    }

    async fn list_task_push_notification_configs(
        &self,
        request: Request<ListTaskPushNotificationConfigsRequest>,
    ) -> Result<Response<ListTaskPushNotificationConfigsResponse>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        Ok(Response::new(
            self.edge
                .list_push_configs(&cx, request.into_inner())
                .await?,
        ))
    }

    async fn get_extended_agent_card(
        &self,
        request: Request<GetExtendedAgentCardRequest>,
    ) -> Result<Response<AgentCard>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        let service = cx.tenant.clone();
        Ok(Response::new(
            self.edge.card(&cx, Some(service.as_str())).await?,
        ))
    }

    async fn delete_task_push_notification_config(
        &self,
        request: Request<DeleteTaskPushNotificationConfigRequest>,
    ) -> Result<Response<pbjson_types::Empty>, Status> {
        let cx = context(&request, &request.get_ref().tenant)?;
        self.edge
            .delete_push_config(&cx, request.into_inner())
            .await?;
        Ok(Response::new(pbjson_types::Empty {}))
    }
}
