//! Server reflection (`grpc.reflection.v1` and `grpc.reflection.v1alpha`, which grpcurl 1.8
//! speaks) over the descriptor sets a server knows at start ([`DescriptorIndex`]) and,
//! optionally, a [`ReflectionSource`] asked at request time for what the index does not hold
//! (the router serves its agents' typed services this way).
//!
//! Files are kept and served as the bytes they were registered with (custom options
//! survive). A lookup the server cannot answer gets an in-band `ErrorResponse` (NOT_FOUND),
//! as grpc-go answers, and the stream goes on.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use prost::Message;
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_reflection::pb::{v1, v1alpha};
use v1::server_reflection_request::MessageRequest;
use v1::server_reflection_response::MessageResponse;

/// An encoded `FileDescriptorSet` whose files stay encoded.
#[derive(Clone, PartialEq, prost::Message)]
struct RawFileDescriptorSet {
    #[prost(bytes = "bytes", repeated, tag = "1")]
    file: Vec<Bytes>,
}

/// Encoded `FileDescriptorProto`s by file name and by the symbols they define (messages,
/// nested messages, enums, services and methods, by full name). The first file registered
/// under a name wins; later ones are ignored.
#[derive(Debug, Default)]
pub struct DescriptorIndex {
    files: HashMap<String, Bytes>,
    /// Symbol → the name of the file that defines it.
    symbols: HashMap<String, String>,
    services: Vec<String>,
    bytes: usize,
}

impl DescriptorIndex {
    /// Adds every file of an encoded `FileDescriptorSet`.
    ///
    /// # Errors
    /// When the set or one of its files cannot be decoded.
    pub fn add_encoded_set(&mut self, set: &[u8]) -> Result<(), prost::DecodeError> {
        for file in RawFileDescriptorSet::decode(set)?.file {
            self.add_file(file)?;
        }
        Ok(())
    }

    /// Adds one encoded `FileDescriptorProto` and returns it decoded; a file whose name is
    /// already known is decoded but not added.
    ///
    /// # Errors
    /// When `raw` is not a `FileDescriptorProto`.
    pub fn add_file(
        &mut self,
        raw: Bytes,
    ) -> Result<prost_types::FileDescriptorProto, prost::DecodeError> {
        let file = prost_types::FileDescriptorProto::decode(raw.clone())?;
        let name = file.name().to_string();
        if self.files.contains_key(&name) {
            return Ok(file);
        }
        let package = file.package();
        let mut symbols = Vec::new();
        for message in &file.message_type {
            message_symbols(package, message, &mut symbols);
        }
        for e in &file.enum_type {
            symbols.push(join(package, e.name()));
        }
        for service in &file.service {
            let service_name = join(package, service.name());
            for method in &service.method {
                symbols.push(join(&service_name, method.name()));
            }
            self.services.push(service_name.clone());
            symbols.push(service_name);
        }
        for symbol in symbols {
            self.symbols.entry(symbol).or_insert_with(|| name.clone());
        }
        self.bytes += raw.len();
        self.files.insert(name, raw);
        Ok(file)
    }

    /// The encoded file named `name`.
    pub fn file(&self, name: &str) -> Option<&Bytes> {
        self.files.get(name)
    }

    /// The encoded file that defines `symbol` (a full name, without a leading dot).
    pub fn file_containing_symbol(&self, symbol: &str) -> Option<&Bytes> {
        self.symbols
            .get(symbol)
            .and_then(|name| self.files.get(name))
    }

    /// The services the files define, by full name, in the order they were added.
    pub fn services(&self) -> &[String] {
        &self.services
    }

    /// The encoded size of every file held, in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many files it holds.
    pub fn len(&self) -> usize {
        self.files.len()
    }

    /// Whether it holds no file.
    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

fn message_symbols(prefix: &str, message: &prost_types::DescriptorProto, out: &mut Vec<String>) {
    let name = join(prefix, message.name());
    for nested in &message.nested_type {
        message_symbols(&name, nested, out);
    }
    for e in &message.enum_type {
        out.push(join(&name, e.name()));
    }
    out.push(name);
}

/// Descriptors a reflection service finds at request time, after its own index: services to
/// list and files to serve. Implementations bound their own time and memory (the router's:
/// `reach_router::reflection`).
pub trait ReflectionSource: Send + Sync + 'static {
    /// Services to list after the server's own, by full name.
    fn services(&self) -> Vec<String>;

    /// The encoded `FileDescriptorProto` that defines `symbol`, if the source knows one.
    fn file_containing_symbol<'a>(&'a self, symbol: &'a str) -> BoxFuture<'a, Option<Bytes>>;

    /// The encoded `FileDescriptorProto` named `filename`, if the source knows one.
    fn file_by_filename<'a>(&'a self, filename: &'a str) -> BoxFuture<'a, Option<Bytes>>;
}

/// The reflection service, for both protocol versions ([`Reflection::v1`],
/// [`Reflection::v1alpha`]).
#[derive(Clone)]
pub struct Reflection {
    index: Arc<DescriptorIndex>,
    /// The services `ListServices` names before the source's.
    listed: Arc<[String]>,
    source: Option<Arc<dyn ReflectionSource>>,
}

impl Reflection {
    /// Answers from `index`, then from `source`; lists `listed` and then the source's
    /// services.
    pub fn new(
        index: DescriptorIndex,
        listed: Vec<String>,
        source: Option<Arc<dyn ReflectionSource>>,
    ) -> Self {
        Self {
            index: Arc::new(index),
            listed: listed.into(),
            source,
        }
    }

    /// The `grpc.reflection.v1.ServerReflection` service.
    pub fn v1(self) -> v1::server_reflection_server::ServerReflectionServer<Self> {
        v1::server_reflection_server::ServerReflectionServer::new(self)
    }

    /// The `grpc.reflection.v1alpha.ServerReflection` service (same messages, same field
    /// numbers).
    pub fn v1alpha(self) -> v1alpha::server_reflection_server::ServerReflectionServer<V1Alpha> {
        v1alpha::server_reflection_server::ServerReflectionServer::new(V1Alpha(self))
    }

    async fn file_by_filename(&self, name: &str) -> Option<Bytes> {
        if let Some(file) = self.index.file(name) {
            return Some(file.clone());
        }
        self.source.as_ref()?.file_by_filename(name).await
    }

    async fn file_containing_symbol(&self, symbol: &str) -> Option<Bytes> {
        if let Some(file) = self.index.file_containing_symbol(symbol) {
            return Some(file.clone());
        }
        self.source.as_ref()?.file_containing_symbol(symbol).await
    }

    fn services(&self) -> Vec<String> {
        let mut names = self.listed.to_vec();
        if let Some(source) = &self.source {
            for name in source.services() {
                if !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        names
    }

    /// The answer to one request.
    async fn answer(&self, request: v1::ServerReflectionRequest) -> v1::ServerReflectionResponse {
        let not_found = |what: String| {
            MessageResponse::ErrorResponse(v1::ErrorResponse {
                error_code: Code::NotFound as i32,
                error_message: what,
            })
        };
        let file = |file: Bytes| {
            MessageResponse::FileDescriptorResponse(v1::FileDescriptorResponse {
                file_descriptor_proto: vec![file.to_vec()],
            })
        };
        let message = match &request.message_request {
            Some(MessageRequest::FileByFilename(name)) => match self.file_by_filename(name).await {
                Some(found) => file(found),
                None => not_found(format!("file {name:?} not found")),
            },
            Some(MessageRequest::FileContainingSymbol(symbol)) => {
                match self.file_containing_symbol(symbol).await {
                    Some(found) => file(found),
                    None => not_found(format!("symbol {symbol:?} not found")),
                }
            }
            Some(MessageRequest::FileContainingExtension(_)) => {
                not_found("extensions are not supported".to_string())
            }
            // grpcurl asks this of every message type and expects an answer.
            Some(MessageRequest::AllExtensionNumbersOfType(name)) => {
                MessageResponse::AllExtensionNumbersResponse(v1::ExtensionNumberResponse {
                    base_type_name: name.clone(),
                    extension_number: Vec::new(),
                })
            }
            Some(MessageRequest::ListServices(_)) => {
                MessageResponse::ListServicesResponse(v1::ListServiceResponse {
                    service: self
                        .services()
                        .into_iter()
                        .map(|name| v1::ServiceResponse { name })
                        .collect(),
                })
            }
            None => MessageResponse::ErrorResponse(v1::ErrorResponse {
                error_code: Code::InvalidArgument as i32,
                error_message: "the request names no message_request".to_string(),
            }),
        };
        v1::ServerReflectionResponse {
            valid_host: request.host.clone(),
            original_request: Some(request),
            message_response: Some(message),
        }
    }

    /// Answers `requests` one at a time, in order, until the caller half-closes or fails.
    fn answer_all<Req, Resp>(
        &self,
        requests: Streaming<Req>,
    ) -> BoxStream<'static, Result<Resp, Status>>
    where
        Req: Message + Default + 'static,
        Resp: Message + Default + 'static,
    {
        let this = self.clone();
        Box::pin(futures::stream::unfold(
            (this, requests),
            |(this, mut requests)| async move {
                let request = requests.message().await.ok()??;
                // v1 and v1alpha messages are the same on the wire.
                let request =
                    v1::ServerReflectionRequest::decode(request.encode_to_vec().as_slice());
                let response = match request {
                    Ok(request) => {
                        Resp::decode(this.answer(request).await.encode_to_vec().as_slice())
                            .map_err(|e| Status::internal(e.to_string()))
                    }
                    Err(error) => Err(Status::invalid_argument(error.to_string())),
                };
                Some((response, (this, requests)))
            },
        ))
    }
}

#[tonic::async_trait]
impl v1::server_reflection_server::ServerReflection for Reflection {
    type ServerReflectionInfoStream =
        BoxStream<'static, Result<v1::ServerReflectionResponse, Status>>;

    async fn server_reflection_info(
        &self,
        request: Request<Streaming<v1::ServerReflectionRequest>>,
    ) -> Result<Response<Self::ServerReflectionInfoStream>, Status> {
        Ok(Response::new(self.answer_all(request.into_inner())))
    }
}

/// [`Reflection`] speaking `grpc.reflection.v1alpha`.
#[derive(Clone)]
pub struct V1Alpha(Reflection);

#[tonic::async_trait]
impl v1alpha::server_reflection_server::ServerReflection for V1Alpha {
    type ServerReflectionInfoStream =
        BoxStream<'static, Result<v1alpha::ServerReflectionResponse, Status>>;

    async fn server_reflection_info(
        &self,
        request: Request<Streaming<v1alpha::ServerReflectionRequest>>,
    ) -> Result<Response<Self::ServerReflectionInfoStream>, Status> {
        Ok(Response::new(self.0.answer_all(request.into_inner())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_finds_files_by_name_and_by_symbol() {
        let mut index = DescriptorIndex::default();
        index
            .add_encoded_set(reach_proto::FILE_DESCRIPTOR_SET)
            .unwrap();
        assert!(
            index
                .services()
                .iter()
                .any(|s| s == "reach.v1.RouterService")
        );
        let by_symbol = index
            .file_containing_symbol("reach.v1.RouterService.Call")
            .unwrap();
        let file = prost_types::FileDescriptorProto::decode(by_symbol.clone()).unwrap();
        assert_eq!(index.file(file.name()), Some(by_symbol));
        assert!(
            index
                .file_containing_symbol("reach.v1.ReachMessage")
                .is_some()
        );
        assert!(index.file_containing_symbol("reach.v1.Nothing").is_none());
    }
}
