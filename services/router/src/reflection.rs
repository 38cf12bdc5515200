//! Reflection of the agents' own gRPC services (typed pass-through) on the router's port: the
//! [`AgentDescriptors`] source that [`reach_rpc::reflection`] asks after the mesh's own
//! descriptors, so `grpcurl list`, `describe` and calls without the proto work through the
//! mesh.
//!
//! `ListServices` names every gRPC service a routable instance registered, read from the
//! routing table when asked (a service leaves the list with its last instance). Descriptors
//! are fetched lazily, the first time a lookup needs them: from the service's instances in
//! instance-id order, the first that answers winning, by asking the instance's own reflection
//! service (`grpc.reflection.v1`, served by every SDK agent) for the file defining the service
//! (`FileContainingSymbol`) and then, by name, every file it imports that the instance serves.
//! They are kept while that instance serves the service and fetched again from another when
//! it goes.
//!
//! Bounded against a slow or hostile agent: a fetch takes at most [`FETCH_TIMEOUT`] and
//! [`MAX_FILES_PER_SERVICE`] files; at most [`MAX_SERVICES`] services and [`MAX_BYTES`]
//! bytes of descriptors are kept, in all; a fetch that fails (or would go over) is logged and
//! not tried again for that service for [`RETRY_AFTER`]. Concurrent lookups share one fetch.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use reach_rpc::reflection::{DescriptorIndex, ReflectionSource};
use tokio::time::Instant;
use tonic_reflection::pb::v1;
use v1::server_reflection_request::MessageRequest;
use v1::server_reflection_response::MessageResponse;

use crate::key::RouteKey;
use crate::table::RoutingTable;

/// The longest one service's descriptors take to fetch from one instance, all files included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// The most files kept for one service (its own file and its imports).
pub const MAX_FILES_PER_SERVICE: usize = 64;
/// The most services whose descriptors are kept at once.
pub const MAX_SERVICES: usize = 256;
/// The most bytes of encoded descriptors kept, all services together.
pub const MAX_BYTES: usize = 16 * 1024 * 1024;
/// How long after a failed fetch a service's descriptors are not asked for again.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

type Fetch = Shared<BoxFuture<'static, Option<Arc<Fetched>>>>;

/// One service's descriptors and the instance they came from.
#[derive(Debug)]
struct Fetched {
    instance_id: Arc<str>,
    index: DescriptorIndex,
}

enum Entry {
    Fetching(Fetch),
    Ready(Arc<Fetched>),
    Failed(Instant),
}

/// The agents' typed services' descriptors, for the router port's reflection. Clones share
/// them.
#[derive(Clone)]
pub struct AgentDescriptors {
    table: Arc<RoutingTable>,
    entries: Arc<Mutex<HashMap<String, Entry>>>,
}

impl AgentDescriptors {
    /// Descriptors of the gRPC services routable in `table`.
    pub fn new(table: Arc<RoutingTable>) -> Self {
        Self {
            table,
            entries: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The instance ids serving `service` now, in instance-id order.
    fn members(&self, service: &str) -> Vec<Arc<str>> {
        self.table
            .route(&RouteKey::GrpcService(service.to_string()))
            .map(|route| {
                route
                    .members
                    .iter()
                    .map(|m| Arc::from(m.info().instance_id.as_str()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The descriptors of every routable service already fetched (from an instance still
    /// serving it), forgetting those that are not.
    fn ready(&self) -> Vec<Arc<Fetched>> {
        let services: HashSet<String> = self.table.grpc_services().into_iter().collect();
        let mut entries = self.entries();
        entries.retain(|service, _| services.contains(service));
        let mut ready: Vec<(String, Arc<Fetched>)> = entries
            .iter()
            .filter_map(|(service, entry)| match entry {
                Entry::Ready(fetched) => Some((service.clone(), fetched.clone())),
                _ => None,
            })
            .collect();
        drop(entries);
        ready.retain(|(service, fetched)| self.members(service).contains(&fetched.instance_id));
        // Sorted, so when two services' files share a name the same one always wins.
        ready.sort_by(|a, b| a.0.cmp(&b.0));
        ready.into_iter().map(|(_, fetched)| fetched).collect()
    }

    /// `service`'s descriptors: kept ones, or fetched now (see the module docs).
    async fn descriptors(&self, service: &str) -> Option<Arc<Fetched>> {
        let members = self.members(service);
        let fetch = {
            let mut entries = self.entries();
            match entries.get(service) {
                Some(Entry::Ready(fetched)) if members.contains(&fetched.instance_id) => {
                    return Some(fetched.clone());
                }
                Some(Entry::Failed(at)) if at.elapsed() < RETRY_AFTER => return None,
                Some(Entry::Fetching(fetch)) => fetch.clone(),
                _ => {
                    if members.is_empty() {
                        return None;
                    }
                    let kept = entries
                        .iter()
                        .filter(|(name, e)| {
                            name.as_str() != service && !matches!(e, Entry::Failed(_))
                        })
                        .count();
                    let used: usize = entries
                        .values()
                        .filter_map(|e| match e {
                            Entry::Ready(f) => Some(f.index.bytes()),
                            _ => None,
                        })
                        .sum();
                    if kept >= MAX_SERVICES || used >= MAX_BYTES {
                        tracing::warn!(
                            service,
                            kept,
                            used_bytes = used,
                            "not fetching the descriptors of a typed service for reflection: \
                             the router keeps those of {MAX_SERVICES} services and {MAX_BYTES} \
                             bytes at most"
                        );
                        entries.insert(service.to_string(), Entry::Failed(Instant::now()));
                        return None;
                    }
                    let fetch = self
                        .clone()
                        .fetch(service.to_string(), members, MAX_BYTES - used)
                        .boxed()
                        .shared();
                    entries.insert(service.to_string(), Entry::Fetching(fetch.clone()));
                    fetch
                }
            }
        };
        fetch.await
    }

    /// Fetches `service`'s descriptors from the first of `members` that answers, within
    /// `budget` bytes, and records the outcome.
    async fn fetch(
        self,
        service: String,
        members: Vec<Arc<str>>,
        budget: usize,
    ) -> Option<Arc<Fetched>> {
        let mut errors = Vec::new();
        let mut fetched = None;
        for instance_id in members {
            let Some(endpoint) = self.table.endpoint(&instance_id) else {
                continue;
            };
            let attempt = tokio::time::timeout(
                FETCH_TIMEOUT,
                fetch_from(endpoint.channel(), &service, budget),
            )
            .await
            .unwrap_or_else(|_| Err(format!("no answer within {FETCH_TIMEOUT:?}")));
            match attempt {
                Ok(index) => {
                    fetched = Some(Arc::new(Fetched { instance_id, index }));
                    break;
                }
                Err(error) => errors.push(format!("{instance_id}: {error}")),
            }
        }
        let mut entries = self.entries();
        match &fetched {
            Some(f) => {
                tracing::debug!(
                    service,
                    instance = %f.instance_id,
                    files = f.index.len(),
                    bytes = f.index.bytes(),
                    "fetched a typed service's descriptors for reflection"
                );
                entries.insert(service, Entry::Ready(f.clone()));
            }
            None => {
                tracing::warn!(
                    service,
                    errors = ?errors,
                    "cannot fetch a typed service's descriptors from its instances' reflection; \
                     the router's reflection will not describe it (retried in {RETRY_AFTER:?})"
                );
                entries.insert(service, Entry::Failed(Instant::now()));
            }
        }
        fetched
    }

    async fn find_symbol(&self, symbol: &str) -> Option<Bytes> {
        let search = |ready: &[Arc<Fetched>]| {
            ready
                .iter()
                .find_map(|f| f.index.file_containing_symbol(symbol).cloned())
        };
        if let Some(found) = search(&self.ready()) {
            return Some(found);
        }
        // The service named by the symbol (or whose method it is) first; otherwise every
        // service not fetched yet, since the symbol may be one of their types.
        let services = self.table.grpc_services();
        let named: Vec<&String> = services
            .iter()
            .filter(|s| symbol == **s || symbol.starts_with(&format!("{s}.")))
            .collect();
        let wanted: Vec<&String> = if named.is_empty() {
            services.iter().collect()
        } else {
            named
        };
        let fetches = wanted.into_iter().map(|service| self.descriptors(service));
        let fetched: Vec<Arc<Fetched>> = futures::future::join_all(fetches)
            .await
            .into_iter()
            .flatten()
            .collect();
        search(&fetched)
    }
}

impl ReflectionSource for AgentDescriptors {
    fn services(&self) -> Vec<String> {
        self.table.grpc_services()
    }

    fn file_containing_symbol<'a>(&'a self, symbol: &'a str) -> BoxFuture<'a, Option<Bytes>> {
        self.find_symbol(symbol).boxed()
    }

    fn file_by_filename<'a>(&'a self, filename: &'a str) -> BoxFuture<'a, Option<Bytes>> {
        let found = self
            .ready()
            .iter()
            .find_map(|f| f.index.file(filename).cloned());
        futures::future::ready(found).boxed()
    }
}

/// Asks one instance's reflection for `service`'s file and the files it imports.
async fn fetch_from(
    channel: tonic::transport::Channel,
    service: &str,
    budget: usize,
) -> Result<DescriptorIndex, String> {
    let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel)
        .max_decoding_message_size(budget);
    let (requests, outbound) = tokio::sync::mpsc::channel(1);
    let ask = |request: MessageRequest| v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    };
    requests
        .send(ask(MessageRequest::FileContainingSymbol(
            service.to_string(),
        )))
        .await
        .map_err(|_| "the reflection stream closed".to_string())?;
    let mut responses = client
        .server_reflection_info(tokio_stream::wrappers::ReceiverStream::new(outbound))
        .await
        .map_err(|status| status.to_string())?
        .into_inner();
    let mut index = DescriptorIndex::default();
    let mut asked = HashSet::new();
    let mut to_ask = VecDeque::new();
    let mut first = true;
    loop {
        let response = responses
            .message()
            .await
            .map_err(|status| status.to_string())?
            .ok_or("the reflection stream ended early")?;
        match response.message_response {
            Some(MessageResponse::FileDescriptorResponse(files)) => {
                for raw in files.file_descriptor_proto {
                    if index.bytes() + raw.len() > budget {
                        return Err(format!("its descriptors exceed {budget} bytes"));
                    }
                    if index.len() >= MAX_FILES_PER_SERVICE {
                        return Err(format!("it has over {MAX_FILES_PER_SERVICE} files"));
                    }
                    let file = index
                        .add_file(Bytes::from(raw))
                        .map_err(|e| format!("an undecodable file descriptor: {e}"))?;
                    for dependency in file.dependency {
                        if index.file(&dependency).is_none() && asked.insert(dependency.clone()) {
                            to_ask.push_back(dependency);
                        }
                    }
                }
            }
            Some(MessageResponse::ErrorResponse(error)) if first => {
                return Err(format!(
                    "its reflection does not know {service}: {}",
                    error.error_message
                ));
            }
            // An import the instance does not serve (the mesh's own descriptors may have it).
            Some(MessageResponse::ErrorResponse(_)) => {}
            _ => return Err("an unexpected reflection response".to_string()),
        }
        first = false;
        let Some(next) = to_ask.pop_front() else {
            break;
        };
        requests
            .send(ask(MessageRequest::FileByFilename(next)))
            .await
            .map_err(|_| "the reflection stream closed".to_string())?;
    }
    if index.file_containing_symbol(service).is_none() {
        return Err(format!(
            "its reflection answered with no file defining {service}"
        ));
    }
    Ok(index)
}
