//! [`RouteKey`]: what a message addresses — a service, a capability, a topic or (typed
//! pass-through) a gRPC service — and so which route of the table it takes.

/// What a message addresses.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RouteKey {
    /// Any instance of this service.
    Service(String),
    /// Any instance that serves this capability.
    Capability(String),
    /// Every instance subscribed to this topic (publish).
    Topic(String),
    /// Any instance that serves this gRPC service (typed pass-through), e.g.
    /// `examples.complaints.v1.TriageService`.
    GrpcService(String),
}

impl RouteKey {
    /// The service, capability or topic name.
    pub fn name(&self) -> &str {
        match self {
            RouteKey::Service(n)
            | RouteKey::Capability(n)
            | RouteKey::Topic(n)
            | RouteKey::GrpcService(n) => n,
        }
    }
}

impl RouteKey {
    /// The route's name, for metric labels: the capability, service, topic or gRPC service.
    pub fn label(&self) -> &str {
        self.name()
    }
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouteKey::Service(name) => write!(f, "service {name:?}"),
            RouteKey::Capability(name) => write!(f, "capability {name:?}"),
            RouteKey::Topic(name) => write!(f, "topic {name:?}"),
            RouteKey::GrpcService(name) => write!(f, "gRPC service {name:?}"),
        }
    }
}
