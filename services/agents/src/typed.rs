//! The triage agent's own typed gRPC API, `examples.complaints.v1.TriageService`, served next
//! to `reach.v1.AgentService` and registered so the router forwards its method paths (typed
//! pass-through): a client generated from `examples/proto/examples/complaints/v1/triage.proto`
//! in any language calls it through the mesh with no envelope.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use reach_proto::v1::{Payload, ReachMessage};
use reach_sdk::{AgentConfig, AgentRuntime, HandlerContext};
use tonic::{Request, Response, Status, Streaming};

/// Generated code of `examples.complaints.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("examples.complaints.v1");
}

/// The encoded descriptor set of `triage.proto`, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/triage_descriptor.bin"));

use pb::triage_service_server::{TriageService, TriageServiceServer};
use pb::{TriageRequest, TriageResponse};

/// The TriageService implementation over the keyword classifier.
#[derive(Clone)]
pub struct Triage {
    instance_id: Arc<str>,
}

impl Triage {
    fn answer(&self, request: TriageRequest) -> TriageResponse {
        let classification = crate::classifier::classify(&request.narrative);
        TriageResponse {
            complaint_id: request.complaint_id,
            category: classification.category.name().to_string(),
            confidence: classification.confidence,
            instance_id: self.instance_id.to_string(),
        }
    }
}

#[tonic::async_trait]
impl TriageService for Triage {
    async fn triage(
        &self,
        request: Request<TriageRequest>,
    ) -> Result<Response<TriageResponse>, Status> {
        Ok(Response::new(self.answer(request.into_inner())))
    }

    type TriageStreamStream = Pin<Box<dyn Stream<Item = Result<TriageResponse, Status>> + Send>>;

    async fn triage_stream(
        &self,
        request: Request<Streaming<TriageRequest>>,
    ) -> Result<Response<Self::TriageStreamStream>, Status> {
        let this = self.clone();
        let replies = request
            .into_inner()
            .map(move |item| item.map(|r| this.answer(r)));
        Ok(Response::new(Box::pin(replies)))
    }
}

/// A runtime for the typed triage agent: `examples.complaints.v1.TriageService`, plus the
/// `complaint.classify` capability on the envelope API. `config.instance_id` must be set.
pub fn triage_agent(config: AgentConfig) -> AgentRuntime {
    let service = Triage {
        instance_id: Arc::from(config.instance_id.as_str()),
    };
    AgentRuntime::new(config)
        .grpc_service(TriageServiceServer::new(service), Some(FILE_DESCRIPTOR_SET))
        .handle(
            "complaint.classify",
            "1.0.0",
            |_ctx: HandlerContext, message: ReachMessage| async move {
                let narrative = message
                    .payload
                    .as_ref()
                    .and_then(|p| p.first_json())
                    .and_then(|v| {
                        v.get("narrative")
                            .and_then(|n| n.as_str())
                            .map(str::to_string)
                    })
                    .unwrap_or_default();
                let classification = crate::classifier::classify(&narrative);
                Ok(Payload::json(
                    crate::COMPLAINT_CLASSIFICATION,
                    &serde_json::json!({
                        "category": classification.category.name(),
                        "confidence": classification.confidence,
                    }),
                ))
            },
        )
}
