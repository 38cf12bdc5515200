//! Agent cards generated live from the registry and the orchestrator: the mesh as one agent
//! whose skills are its routable capabilities and its flows, and one agent per service.

use std::collections::{BTreeMap, BTreeSet};

use reach_proto::v1 as reach;

use super::proto::{
    AgentCapabilities, AgentCard, AgentInterface, AgentProvider, AgentSkill,
    HttpAuthSecurityScheme, SecurityRequirement, SecurityScheme, StringList, security_scheme,
};

/// The A2A protocol version the edge serves.
pub const PROTOCOL_VERSION: &str = "1.0";

/// The prefix of a flow's skill id (`flow:complaint-flow`); capability names never contain
/// `:`.
pub const FLOW_SKILL_PREFIX: &str = "flow:";

/// Where the edge is reached, as its cards advertise it.
#[derive(Debug, Clone)]
pub struct Interfaces {
    /// The JSON-RPC base URL (`http://127.0.0.1:7072`), without a trailing slash.
    pub json_rpc: String,
    /// The gRPC target (`127.0.0.1:7070`), as gRPC clients take it.
    pub grpc: String,
}

/// How callers authenticate, for `security_schemes`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Security {
    /// The edge verifies bearer JWTs (the one credential it acts with: see
    /// [`super::RequestContext::check_caller`]).
    pub bearer: bool,
    /// The edge serves TLS (its URLs are `https`).
    pub tls: bool,
}

/// A skill the edge can send a message to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skill {
    /// A capability, called through the router.
    Capability(String),
    /// A flow, started as a task of the orchestrator.
    Flow(String),
}

impl Skill {
    /// The skill for an A2A skill id: `flow:<id>` is a flow, anything else a capability.
    pub fn parse(id: &str) -> Skill {
        match id.strip_prefix(FLOW_SKILL_PREFIX) {
            Some(flow) => Skill::Flow(flow.to_string()),
            None => Skill::Capability(id.to_string()),
        }
    }
}

/// What the mesh offers, read from registry and orchestrator for one card.
#[derive(Debug, Default)]
pub struct Catalogue {
    /// Capability descriptors by name.
    pub capabilities: BTreeMap<String, reach::CapabilityDescriptor>,
    /// Flows (latest versions).
    pub flows: Vec<reach::FlowSummary>,
    /// Routable service names to the capability names they serve.
    pub services: BTreeMap<String, BTreeSet<String>>,
}

fn capability_skill(name: &str, descriptor: Option<&reach::CapabilityDescriptor>) -> AgentSkill {
    let description = descriptor
        .map(|d| d.description.clone())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| format!("the mesh capability {name}"));
    let takes_json = descriptor.is_some_and(|d| !d.input_schema.is_empty());
    let gives_json = descriptor.is_some_and(|d| !d.output_schema.is_empty());
    let family = name.split('.').next().unwrap_or(name).to_string();
    AgentSkill {
        id: name.to_string(),
        name: name.to_string(),
        description,
        tags: vec![family, "capability".into()],
        input_modes: if takes_json {
            vec!["application/json".into()]
        } else {
            Vec::new()
        },
        output_modes: if gives_json {
            vec!["application/json".into()]
        } else {
            Vec::new()
        },
        ..AgentSkill::default()
    }
}

fn flow_skill(flow: &reach::FlowSummary) -> AgentSkill {
    let what = if flow.description.is_empty() {
        format!("Runs the flow {}", flow.flow_id)
    } else {
        flow.description.trim_end_matches('.').to_string()
    };
    AgentSkill {
        id: format!("{FLOW_SKILL_PREFIX}{}", flow.flow_id),
        name: flow.flow_id.clone(),
        description: format!(
            "{what}. A task of flow {} (version {}, {} nodes): its input is the message's first data part; a human step makes the task INPUT_REQUIRED until a message with the task id answers it.",
            flow.flow_id, flow.version, flow.node_count
        ),
        tags: vec!["flow".into()],
        input_modes: vec!["application/json".into(), "text/plain".into()],
        output_modes: vec!["application/json".into()],
        ..AgentSkill::default()
    }
}

fn security(security: Security) -> (BTreeMap<String, SecurityScheme>, Vec<SecurityRequirement>) {
    let mut schemes = BTreeMap::new();
    let mut requirements = Vec::new();
    if security.bearer {
        schemes.insert(
            "bearer".to_string(),
            SecurityScheme {
                scheme: Some(security_scheme::Scheme::HttpAuthSecurityScheme(
                    HttpAuthSecurityScheme {
                        description: "a JWT the mesh's trust settings verify ([trust.jwt])".into(),
                        scheme: "Bearer".into(),
                        bearer_format: "JWT".into(),
                    },
                )),
            },
        );
    }
    // Each scheme alone suffices: one requirement per scheme (OR).
    for name in schemes.keys() {
        requirements.push(SecurityRequirement {
            schemes: [(name.clone(), StringList::default())].into(),
        });
    }
    (schemes.into_iter().collect(), requirements)
}

fn card(
    name: String,
    description: String,
    interfaces: &Interfaces,
    path: &str,
    tenant: &str,
    auth: Security,
    skills: Vec<AgentSkill>,
) -> AgentCard {
    let scheme = if auth.tls { "https" } else { "http" };
    let json_rpc = interfaces
        .json_rpc
        .replacen("http://", &format!("{scheme}://"), 1);
    let (security_schemes, security_requirements) = security(auth);
    AgentCard {
        name,
        description,
        // Without an HTTP listener the edge speaks gRPC only.
        supported_interfaces: (!json_rpc.is_empty())
            .then(|| AgentInterface {
                url: format!("{json_rpc}{path}/"),
                protocol_binding: "JSONRPC".into(),
                tenant: String::new(),
                protocol_version: PROTOCOL_VERSION.into(),
            })
            .into_iter()
            .chain([AgentInterface {
                url: interfaces.grpc.clone(),
                protocol_binding: "GRPC".into(),
                tenant: tenant.to_string(),
                protocol_version: PROTOCOL_VERSION.into(),
            }])
            .collect(),
        provider: Some(AgentProvider {
            url: "https://example.invalid/reach".into(),
            organization: "Reach".into(),
        }),
        version: env!("CARGO_PKG_VERSION").into(),
        documentation_url: None,
        capabilities: Some(AgentCapabilities {
            streaming: Some(true),
            push_notifications: Some(true),
            extensions: Vec::new(),
            extended_agent_card: Some(true),
        }),
        security_schemes: security_schemes.into_iter().collect(),
        security_requirements,
        default_input_modes: vec!["application/json".into(), "text/plain".into()],
        default_output_modes: vec!["application/json".into(), "text/plain".into()],
        skills,
        signatures: Vec::new(),
        icon_url: None,
    }
}

/// The mesh's card: every routable capability and every flow as a skill, sorted by id.
pub fn mesh_card(catalogue: &Catalogue, interfaces: &Interfaces, auth: Security) -> AgentCard {
    let mut skills: Vec<AgentSkill> = catalogue
        .capabilities
        .values()
        .filter(|d| d.routable_instances > 0)
        .map(|d| capability_skill(&d.name, Some(d)))
        .chain(catalogue.flows.iter().map(flow_skill))
        .collect();
    skills.sort_by(|a, b| a.id.cmp(&b.id));
    card(
        "Reach mesh".into(),
        "Every capability the mesh can route now, and every flow as a task, as one agent. Name the skill in the message's metadata (\"skill\": \"complaint.classify\" or \"flow:complaint-flow\").".into(),
        interfaces,
        "",
        "",
        auth,
        skills,
    )
}

/// One service's card (the capabilities its routable instances serve); `None` when no
/// routable instance of `service` is registered.
pub fn service_card(
    catalogue: &Catalogue,
    service: &str,
    interfaces: &Interfaces,
    auth: Security,
) -> Option<AgentCard> {
    let capabilities = catalogue.services.get(service)?;
    let skills = capabilities
        .iter()
        .map(|name| capability_skill(name, catalogue.capabilities.get(name)))
        .collect();
    Some(card(
        service.to_string(),
        format!(
            "The mesh service {service}: its capabilities, called through the router (balanced across its instances)."
        ),
        interfaces,
        &format!("/agents/{service}"),
        service,
        auth,
        skills,
    ))
}
