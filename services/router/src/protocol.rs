//! The router's use of the protocol registry ([`reach_protocol`]): which instances a versioned
//! call may go to, the version adapter bridging caller and instance, and input validation.
//!
//! Resolution of `capability` + `header.capability_version` (a semver requirement):
//! 1. instances whose registered version satisfies the requirement (an empty requirement
//!    accepts every instance; an empty registered version is `0.0.0`);
//! 2. otherwise, an adapter declared for the capability whose `from` satisfies the requirement
//!    and whose `to` some instance serves (`^to`): the request is rewritten before delivery and
//!    the reply after;
//! 3. otherwise FAILED_PRECONDITION with ErrorInfo `VERSION_NOT_SUPPORTED`.

use std::collections::HashSet;

use reach_proto::v1::{Part, ReachMessage, part};
use reach_protocol::{Adapter, ProtocolError};

use crate::error::{AdapterDirection, RouteError};
use crate::table::Route;

pub use reach_protocol::ProtocolRegistry;

/// Where a versioned call may go and how its payload is bridged.
#[derive(Debug, Default)]
pub struct VersionPlan {
    /// The instance ids that may take the call; `None`: any instance of the route.
    pub allowed: Option<HashSet<String>>,
    /// The adapter to apply, when no instance speaks the caller's version.
    pub adapter: Option<Adapter>,
}

impl VersionPlan {
    /// Any instance, no adapter.
    pub fn any() -> Self {
        Self::default()
    }

    /// Resolves the plan for a call to `capability` with the semver `requirement`, among the
    /// members of the capability's `route` (`None`: nothing serves it, and the plan is
    /// [`VersionPlan::any`] so that the route lookup reports ROUTE_NOT_FOUND).
    ///
    /// # Errors
    /// [`RouteError::InvalidVersionRequirement`] for a malformed requirement;
    /// [`RouteError::VersionNotSupported`] when neither an instance nor an adapter fits.
    pub fn resolve(
        route: Option<&Route>,
        protocols: Option<&ProtocolRegistry>,
        capability: &str,
        requirement: &str,
    ) -> Result<Self, RouteError> {
        if requirement.is_empty() || requirement == "*" {
            return Ok(Self::any());
        }
        let req = semver::VersionReq::parse(requirement)
            .map_err(|_| RouteError::InvalidVersionRequirement(requirement.to_string()))?;
        let versions: Vec<(&str, &semver::Version)> = route
            .map(|route| {
                route
                    .member_versions()
                    .map(|(member, version)| (member.info().instance_id.as_str(), version))
                    .collect()
            })
            .unwrap_or_default();
        if versions.is_empty() {
            return Ok(Self::any());
        }
        let compatible: HashSet<String> = versions
            .iter()
            .filter(|(_, v)| req.matches(v))
            .map(|(id, _)| id.to_string())
            .collect();
        if !compatible.is_empty() {
            return Ok(Self {
                allowed: Some(compatible),
                adapter: None,
            });
        }
        if let Some(protocols) = protocols {
            for adapter in protocols.adapters_for(capability, &req) {
                let served: HashSet<String> = versions
                    .iter()
                    .filter(|(_, v)| adapter.serves(v))
                    .map(|(id, _)| id.to_string())
                    .collect();
                if !served.is_empty() {
                    return Ok(Self {
                        allowed: Some(served),
                        adapter: Some(adapter.clone()),
                    });
                }
            }
        }
        let mut available: Vec<String> = versions.iter().map(|(_, v)| v.to_string()).collect();
        available.sort();
        available.dedup();
        Err(RouteError::VersionNotSupported {
            capability: capability.to_string(),
            requirement: requirement.to_string(),
            available: available.join(", "),
        })
    }
}

/// Rewrites the first data part of `message` with `transform` (no data part: unchanged).
fn rewrite(
    adapter: &Adapter,
    direction: AdapterDirection,
    transform: Option<&reach_protocol::Transform>,
    message: &mut ReachMessage,
) -> Result<(), RouteError> {
    let Some(transform) = transform else {
        return Ok(());
    };
    let Some(part) = message.payload.as_mut().and_then(|p| {
        p.parts
            .iter_mut()
            .find(|p| matches!(p.content, Some(part::Content::Data(_))))
    }) else {
        return Ok(());
    };
    let input = part.as_json().unwrap_or_default();
    let output = transform
        .apply(&input)
        .map_err(|e| RouteError::AdapterFailed {
            adapter: adapter.name(),
            direction,
            detail: e.to_string(),
        })?;
    let media_type = std::mem::take(&mut part.media_type);
    *part = Part {
        media_type,
        ..Part::data(&output)
    };
    Ok(())
}

/// Extension: applying an adapter to messages.
pub trait AdapterExt {
    /// Rewrites a request from the caller's version to the instance's.
    ///
    /// # Errors
    /// [`RouteError::AdapterFailed`] ([`AdapterDirection::Request`]) when the transform fails.
    fn adapt_request(&self, message: &mut ReachMessage) -> Result<(), RouteError>;
    /// Rewrites a reply from the instance's version back to the caller's.
    ///
    /// # Errors
    /// [`RouteError::AdapterFailed`] ([`AdapterDirection::Reply`]) when the transform fails.
    fn adapt_response(&self, message: &mut ReachMessage) -> Result<(), RouteError>;
}

impl AdapterExt for Adapter {
    fn adapt_request(&self, message: &mut ReachMessage) -> Result<(), RouteError> {
        rewrite(
            self,
            AdapterDirection::Request,
            self.request.as_ref(),
            message,
        )?;
        if let Some(header) = message.header.as_mut() {
            header.capability_version = format!("^{}", self.to);
        }
        Ok(())
    }

    fn adapt_response(&self, message: &mut ReachMessage) -> Result<(), RouteError> {
        rewrite(
            self,
            AdapterDirection::Reply,
            self.response.as_ref(),
            message,
        )
    }
}

/// Validates the first data part of `message` against the input schema of `capability`.
///
/// # Errors
/// [`RouteError::InvalidPayload`] with the JSON pointer of the bad property and the schema
/// keyword that failed (`format` included: formats are asserted).
pub fn validate_input(
    protocols: &ProtocolRegistry,
    capability: &str,
    message: &ReachMessage,
) -> Result<(), RouteError> {
    if !protocols.has_input_schema(capability) {
        return Ok(());
    }
    let Some(value) = message.payload.as_ref().and_then(|p| p.first_json()) else {
        return Err(RouteError::InvalidPayload {
            capability: capability.to_string(),
            pointer: String::new(),
            keyword: String::new(),
            schema_path: String::new(),
            detail: "the payload has no data part; the capability's input schema needs one".into(),
        });
    };
    protocols
        .validate_input(capability, &value)
        .map_err(|e| match e {
            ProtocolError::SchemaViolation {
                pointer,
                keyword,
                schema_path,
                detail,
            } => RouteError::InvalidPayload {
                capability: capability.to_string(),
                pointer,
                keyword,
                schema_path,
                detail,
            },
            ProtocolError::Transform(detail) => RouteError::InvalidPayload {
                capability: capability.to_string(),
                pointer: String::new(),
                keyword: String::new(),
                schema_path: String::new(),
                detail,
            },
        })
}
