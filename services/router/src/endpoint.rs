//! One instance as a `tower::Service`: forwards a unary call or opens a stream to its
//! `reach.v1.AgentService`, counting the work on the instance's [`LoadTracker`].

use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use reach_proto::v1::agent_service_client::AgentServiceClient;
use reach_proto::v1::{HandleRequest, HandleResponse, HandleStreamResponse};
use reach_telemetry::grpc::GrpcClientTrace;
use tonic::transport::Channel;
use tonic::{Response, Status, Streaming};
use tower::Service;
use tower::load::Load;

use crate::load::{InFlight, LoadTracker};

/// The inbound half of a forwarded stream, as the agent client consumes it.
pub type InboundStream = crate::pump::InboundPump;

/// What the router asks an instance to do. Built once per call and moved into the balancer,
/// so the variants' size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Forward {
    /// Deliver one message and wait for the reply.
    Unary(tonic::Request<HandleRequest>),
    /// Open a stream fed by the given inbound messages.
    Stream(tonic::Request<InboundStream>),
}

/// What came back, tagged with the instance that answered.
pub struct Forwarded {
    /// The instance that took the request.
    pub instance: Arc<InstanceInfo>,
    /// The instance's answer.
    pub outcome: Outcome,
}

/// The answer of an instance.
pub enum Outcome {
    /// The unary reply or error status.
    Unary(Result<Response<HandleResponse>, Status>),
    /// The opened stream (or the error that prevented it), and the in-flight guard that
    /// keeps the stream counted as load until it ends.
    Stream(
        Result<Response<Streaming<HandleStreamResponse>>, Status>,
        InFlight,
    ),
}

/// What the router knows about an instance besides its connection.
#[derive(Debug)]
pub struct InstanceInfo {
    /// The instance id.
    pub instance_id: String,
    /// The service the instance belongs to.
    pub service: String,
    /// The endpoint URL.
    pub endpoint: String,
}

/// A connection to one instance plus its shared load signal. Cheap to clone: clones share
/// the connection and the load tracker.
#[derive(Clone)]
pub struct InstanceEndpoint {
    client: AgentServiceClient<GrpcClientTrace<Channel>>,
    info: Arc<InstanceInfo>,
    load: Arc<LoadTracker>,
}

impl InstanceEndpoint {
    /// An endpoint over a (lazily connecting) channel.
    pub fn new(
        channel: Channel,
        info: InstanceInfo,
        load: Arc<LoadTracker>,
        max_message_bytes: usize,
    ) -> Self {
        let client = AgentServiceClient::new(reach_telemetry::traced_channel(channel))
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes);
        Self {
            client,
            info: Arc::new(info),
            load,
        }
    }

    /// The instance's identity.
    pub fn info(&self) -> &Arc<InstanceInfo> {
        &self.info
    }

    /// The instance's load tracker.
    pub fn load_tracker(&self) -> &Arc<LoadTracker> {
        &self.load
    }
}

impl Service<Forward> for InstanceEndpoint {
    type Response = Forwarded;
    type Error = tower::BoxError;
    type Future = BoxFuture<'static, Result<Forwarded, tower::BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The channel buffers and connects on demand; its readiness is awaited per call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Forward) -> Self::Future {
        let mut client = self.client.clone();
        let info = self.info.clone();
        let in_flight = self.load.start();
        Box::pin(async move {
            let outcome = match request {
                Forward::Unary(request) => {
                    let result = client.handle(request).await;
                    drop(in_flight);
                    Outcome::Unary(result)
                }
                Forward::Stream(request) => {
                    Outcome::Stream(client.handle_stream(request).await, in_flight)
                }
            };
            Ok(Forwarded {
                instance: info,
                outcome,
            })
        })
    }
}

impl Load for InstanceEndpoint {
    type Metric = f64;

    fn load(&self) -> f64 {
        self.load.cost()
    }
}
