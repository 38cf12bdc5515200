//! The orchestrator's error type and its mapping to gRPC statuses.

use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

use crate::flow::FlowErrors;
use crate::store::StoreError;

/// Why an orchestrator operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A task, flow or node does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed; `violations` are `(field path, description)`.
    #[error("{message}")]
    InvalidArgument {
        /// What is wrong, for a person.
        message: String,
        /// Field-level violations, for a program.
        violations: Vec<(String, String)>,
    },
    /// A flow failed validation.
    #[error("{0}")]
    InvalidFlow(#[from] FlowErrors),
    /// The operation does not apply to the task's current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The id is taken.
    #[error("{0}")]
    AlreadyExists(String),
    /// Try again later.
    #[error("{0}")]
    Unavailable(String),
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Serving failed.
    #[error(transparent)]
    Serve(#[from] reach_rpc::server::ServeError),
}

impl From<Error> for tonic::Status {
    fn from(err: Error) -> Self {
        let message = err.to_string();
        match err {
            Error::NotFound(_) => tonic::Status::new(Code::NotFound, message),
            Error::InvalidArgument { violations, .. } => {
                let mut details = ErrorDetails::new();
                for (field, description) in violations {
                    details.add_bad_request_violation(field, description);
                }
                tonic::Status::with_error_details(Code::InvalidArgument, message, details)
            }
            Error::InvalidFlow(errors) => {
                let mut details = ErrorDetails::new();
                for e in &errors.errors {
                    details.add_bad_request_violation(
                        format!("{}:{}:{}", e.source, e.line, e.column),
                        format!("{}; {}", e.message, e.hint),
                    );
                }
                tonic::Status::with_error_details(Code::InvalidArgument, message, details)
            }
            Error::FailedPrecondition(_) => tonic::Status::new(Code::FailedPrecondition, message),
            Error::AlreadyExists(_) => tonic::Status::new(Code::AlreadyExists, message),
            Error::Unavailable(_) => tonic::Status::new(Code::Unavailable, message),
            Error::Config(_) => tonic::Status::new(Code::Internal, message),
            Error::Store(_) => tonic::Status::new(Code::Unavailable, message),
            Error::Serve(_) => tonic::Status::new(Code::Internal, message),
        }
    }
}
