//! Registry errors and their gRPC statuses.

use reach_rpc::errors::{reason, status_with_reason};
use tonic::{Code, Status};

/// Why a [`Registry`](crate::Registry) could not be made.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A setting is out of range.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The configured protocol registry could not be read or parsed (the error names the
    /// file).
    #[error(transparent)]
    ProtocolRegistry(#[from] reach_protocol::LoadError),
    /// The etcd backend could not start: etcd is unreachable or refused us (the message
    /// names the endpoints and the fix).
    #[error("{0}")]
    Etcd(String),
    /// `backend = "etcd"` in a `reach` built without the `etcd` feature.
    #[error(
        "registry.backend = \"etcd\" needs a reach built with etcd support: `cargo build --release -p reach --features etcd` (needs protoc), or the container image"
    )]
    EtcdNotBuilt,
}

/// Why a registry operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The registration is malformed; the message names the field and the fix.
    /// INVALID_ARGUMENT, no ErrorInfo reason.
    #[error("invalid registration: {0}")]
    InvalidRegistration(String),
    /// A capability's description or schema is out of bounds or not a JSON Schema:
    /// INVALID_ARGUMENT with a BadRequest naming `instance.capabilities[index].field`.
    #[error("invalid registration: instance.capabilities[{index}] ({name:?}) {field} {detail}")]
    InvalidCapability {
        /// The capability's index in `instance.capabilities`.
        index: usize,
        /// The capability's name.
        name: String,
        /// The field at fault: `description`, `input_schema` or `output_schema`.
        field: &'static str,
        /// What is wrong and how to fix it.
        detail: String,
    },
    /// Strict mode: a capability is not declared in the protocol registry.
    #[error("registration refused: {0}")]
    CapabilityNotDeclared(String),
    /// The instance or its lease is unknown (never registered, expired or deregistered).
    #[error(
        "no live lease {lease_id:?} for instance {instance_id:?}: it expired or was never granted; register again"
    )]
    LeaseNotFound {
        /// The instance id the caller sent.
        instance_id: String,
        /// The lease id the caller sent.
        lease_id: String,
    },
    /// The registration waited its whole deadline for the descriptor checker (one
    /// registration's schemas are compiled at a time): UNAVAILABLE, retry later.
    #[error(
        "the registry is busy checking other registrations' schemas and could not check this one within {}; retry with backoff",
        crate::config::readable(*.0)
    )]
    CheckerBusy(std::time::Duration),
    /// The store behind the registry (etcd) did not answer or refused the write; nothing was
    /// changed: UNAVAILABLE, retry with backoff (another registry replica may answer).
    #[error("the registry's store did not take the change: {0}; retry with backoff")]
    StoreUnavailable(String),
    /// A registry bug (a check panicked): INTERNAL.
    #[error("internal registry error: {0}")]
    Internal(String),
    /// Another identity holds the instance id while its lease lives: PERMISSION_DENIED with
    /// ErrorInfo reason `NOT_AUTHORIZED` (metadata `identity`, `action`, `target`).
    #[error(
        "{identity} may not register as instance {instance_id:?}: it is registered by {owner} while its lease lives; choose another instance id, or deregister it as {owner}"
    )]
    NotOwner {
        /// The identity that asked.
        identity: String,
        /// The instance id.
        instance_id: String,
        /// The identity holding it.
        owner: String,
    },
    /// The trust layer refused the caller: PERMISSION_DENIED, `NOT_AUTHORIZED`.
    #[error(transparent)]
    Denied(#[from] reach_trust::Denied),
    /// An operator drained the instance (`DELETE /agents/{service}`); it must not register again.
    #[error("instance {0:?} was drained by an operator and removed; it must not register again")]
    Drained(String),
}

impl RegistryError {
    /// The refusal as the trust layer records it, for [`RegistryError::NotOwner`] and
    /// [`RegistryError::Denied`].
    pub fn denied(&self) -> Option<reach_trust::Denied> {
        match self {
            RegistryError::NotOwner {
                identity,
                instance_id,
                owner,
            } => Some(reach_trust::Denied {
                identity: identity.clone(),
                action: "register as".into(),
                target: format!("instance {instance_id:?}"),
                reason: format!(
                    "it is registered by {owner} while its lease lives; choose another instance id, or deregister it as {owner}"
                ),
            }),
            RegistryError::Denied(denied) => Some(denied.clone()),
            _ => None,
        }
    }
}

impl From<RegistryError> for Status {
    fn from(err: RegistryError) -> Self {
        match &err {
            RegistryError::NotOwner { .. } => err
                .denied()
                .map(|d| d.to_status())
                .unwrap_or_else(|| Status::permission_denied(err.to_string())),
            RegistryError::Denied(denied) => denied.to_status(),
            RegistryError::InvalidRegistration(_) => Status::invalid_argument(err.to_string()),
            RegistryError::CheckerBusy(_) | RegistryError::StoreUnavailable(_) => {
                Status::unavailable(err.to_string())
            }
            RegistryError::Internal(_) => Status::internal(err.to_string()),
            RegistryError::InvalidCapability {
                index,
                field,
                detail,
                ..
            } => {
                // A BadRequest names the field, as grpcurl and programs read it.
                let mut details = tonic_types::ErrorDetails::new();
                details.add_bad_request_violation(
                    format!("instance.capabilities[{index}].{field}"),
                    detail.clone(),
                );
                <Status as tonic_types::StatusExt>::with_error_details(
                    Code::InvalidArgument,
                    err.to_string(),
                    details,
                )
            }
            RegistryError::CapabilityNotDeclared(_) => status_with_reason(
                Code::FailedPrecondition,
                err.to_string(),
                reason::CAPABILITY_NOT_DECLARED,
                [],
            ),
            RegistryError::Drained(instance_id) => status_with_reason(
                Code::FailedPrecondition,
                err.to_string(),
                reason::INSTANCE_DRAINED,
                [("instance_id".to_string(), instance_id.clone())],
            ),
            RegistryError::LeaseNotFound {
                instance_id,
                lease_id,
            } => status_with_reason(
                Code::NotFound,
                err.to_string(),
                reason::LEASE_NOT_FOUND,
                [
                    ("instance_id".to_string(), instance_id.clone()),
                    ("lease_id".to_string(), lease_id.clone()),
                ],
            ),
        }
    }
}
