//! rmcp's [`StreamableHttpClient`] over the workspace's reqwest 0.12 (rustls on ring), so
//! attaching a Streamable HTTP MCP server pulls in no second reqwest (rmcp's own client is
//! on reqwest 0.13).
//!
//! Bounds: a JSON response body is read up to the transport's `max_json_response_size`,
//! an error body quotes at most 4 KiB, and one SSE event may hold up to the transport's
//! `max_sse_event_size` bytes (the stream ends with an error past it).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use ::http::{HeaderName, HeaderValue};
use futures::StreamExt;
use futures::stream::BoxStream;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::common::http_header::{
    EVENT_STREAM_MIME_TYPE, HEADER_LAST_EVENT_ID, HEADER_SESSION_ID, JSON_MIME_TYPE,
};
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use sse_stream::{Sse, SseStream};

/// The most bytes of an HTTP error body quoted in an error.
const MAX_ERROR_BODY: usize = 4096;

/// A reqwest 0.12 client speaking rmcp's Streamable HTTP client side.
#[derive(Clone, Debug, Default)]
pub struct HttpClient(pub reqwest::Client);

/// The transport for `url`, sending `headers` with every request (an `Authorization`
/// header is passed as rmcp's auth header).
///
/// # Errors
/// A message naming a header whose name or value is not valid HTTP.
pub(super) fn transport(
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Result<StreamableHttpClientTransport<HttpClient>, String> {
    let mut custom = HashMap::new();
    let mut auth = None;
    for (name, value) in headers {
        if name.eq_ignore_ascii_case("authorization") {
            let token = value
                .strip_prefix("Bearer ")
                .or_else(|| value.strip_prefix("bearer "))
                .unwrap_or(value);
            auth = Some(token.to_string());
            continue;
        }
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("header {name:?} is not an HTTP header name"))?;
        let value = HeaderValue::from_str(value)
            .map_err(|_| format!("header {name:?} has a value that is not valid in HTTP"))?;
        custom.insert(header, value);
    }
    let mut config = StreamableHttpClientTransportConfig::with_uri(url.to_string());
    config.auth_header = auth;
    config.custom_headers = custom;
    Ok(StreamableHttpClientTransport::with_client(
        HttpClient(reqwest::Client::new()),
        config,
    ))
}

fn client_error(e: reqwest::Error) -> StreamableHttpError<reqwest::Error> {
    StreamableHttpError::Client(e)
}

fn is_media(value: Option<&HeaderValue>, media: &str) -> bool {
    value
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case(media))
}

/// The SSE events of `response`; an event over `max_event` bytes (counted from the last
/// blank line) ends the stream with an error rather than being buffered.
fn sse(response: reqwest::Response, max_event: usize) -> BoxStream<'static, Result<Sse, SseError>> {
    let mut event_bytes = 0usize;
    let mut previous = 0u8;
    let bounded = response.bytes_stream().map(move |chunk| {
        let chunk = chunk.map_err(std::io::Error::other)?;
        for &byte in chunk.iter() {
            match byte {
                b'\r' => continue,
                b'\n' if previous == b'\n' => event_bytes = 0,
                _ => event_bytes += 1,
            }
            previous = byte;
        }
        if event_bytes > max_event {
            return Err(std::io::Error::other(format!(
                "an SSE event from the mcp server is over {max_event} bytes"
            )));
        }
        Ok(chunk)
    });
    SseStream::from_bytes_stream(bounded).boxed()
}

/// Reads at most `limit` bytes of `response`'s body.
async fn bounded_body(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, StreamableHttpError<reqwest::Error>> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(client_error)? {
        if body.len() + chunk.len() > limit {
            return Err(StreamableHttpError::ResponseBodyTooLarge { max_size: limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn request(
    mut builder: reqwest::RequestBuilder,
    session_id: Option<Arc<str>>,
    auth: Option<String>,
    custom_headers: HashMap<HeaderName, HeaderValue>,
) -> reqwest::RequestBuilder {
    if let Some(session_id) = session_id {
        builder = builder.header(HEADER_SESSION_ID, session_id.as_ref());
    }
    if let Some(token) = auth {
        builder = builder.bearer_auth(token);
    }
    for (name, value) in custom_headers {
        builder = builder.header(name, value);
    }
    builder
}

impl StreamableHttpClient for HttpClient {
    type Error = reqwest::Error;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
        .await
    }

    async fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>> {
        let session_was_attached = session_id.is_some();
        let builder = self
            .0
            .post(uri.as_ref())
            .header(
                ::http::header::ACCEPT,
                format!("{EVENT_STREAM_MIME_TYPE}, {JSON_MIME_TYPE}"),
            )
            .json(&message);
        let response = request(builder, session_id, auth_header, custom_headers)
            .send()
            .await
            .map_err(client_error)?;
        let status = response.status();
        if matches!(
            status,
            reqwest::StatusCode::ACCEPTED | reqwest::StatusCode::NO_CONTENT
        ) {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        if status == reqwest::StatusCode::NOT_FOUND && session_was_attached {
            return Err(StreamableHttpError::SessionExpired);
        }
        let session = response
            .headers()
            .get(HEADER_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let content_type = response
            .headers()
            .get(::http::header::CONTENT_TYPE)
            .cloned();
        let awaits_no_response = matches!(
            message,
            ClientJsonRpcMessage::Notification(_)
                | ClientJsonRpcMessage::Response(_)
                | ClientJsonRpcMessage::Error(_)
        );
        if !status.is_success() {
            let json = is_media(content_type.as_ref(), JSON_MIME_TYPE);
            let body = bounded_body(response, limits.max_json_response_size.min(1 << 20))
                .await
                .unwrap_or_default();
            if json
                && let Ok(error @ ServerJsonRpcMessage::Error(_)) =
                    serde_json::from_slice::<ServerJsonRpcMessage>(&body)
            {
                return Ok(StreamableHttpPostResponse::Json(error, session));
            }
            let text: String = String::from_utf8_lossy(&body)
                .chars()
                .take(MAX_ERROR_BODY)
                .collect();
            return Err(StreamableHttpError::UnexpectedServerResponse(Cow::Owned(
                format!("HTTP {status}: {text}"),
            )));
        }
        if is_media(content_type.as_ref(), EVENT_STREAM_MIME_TYPE) {
            return Ok(StreamableHttpPostResponse::Sse(
                sse(response, limits.max_sse_event_size),
                session,
            ));
        }
        if is_media(content_type.as_ref(), JSON_MIME_TYPE) {
            let body = bounded_body(response, limits.max_json_response_size).await?;
            return match serde_json::from_slice::<ServerJsonRpcMessage>(&body) {
                Ok(parsed) => Ok(StreamableHttpPostResponse::Json(parsed, session)),
                Err(_) if awaits_no_response => Ok(StreamableHttpPostResponse::Accepted),
                Err(e) => Err(StreamableHttpError::Deserialize(e)),
            };
        }
        if awaits_no_response {
            return Ok(StreamableHttpPostResponse::Accepted);
        }
        Err(StreamableHttpError::UnexpectedContentType(
            content_type.map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        ))
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<(), StreamableHttpError<Self::Error>> {
        let builder = self.0.delete(uri.as_ref());
        let response = request(builder, Some(session_id), auth_header, custom_headers)
            .send()
            .await
            .map_err(client_error)?;
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Ok(());
        }
        response.error_for_status().map_err(client_error)?;
        Ok(())
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        self.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default().max_sse_event_size,
        )
        .await
    }

    async fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>> {
        let mut builder = self
            .0
            .get(uri.as_ref())
            .header(::http::header::ACCEPT, EVENT_STREAM_MIME_TYPE);
        if let Some(last_event_id) = last_event_id {
            builder = builder.header(HEADER_LAST_EVENT_ID, last_event_id);
        }
        let response = request(builder, session_id, auth_header, custom_headers)
            .send()
            .await
            .map_err(client_error)?;
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        let response = response.error_for_status().map_err(client_error)?;
        if !is_media(
            response.headers().get(::http::header::CONTENT_TYPE),
            EVENT_STREAM_MIME_TYPE,
        ) {
            return Err(StreamableHttpError::UnexpectedContentType(
                response
                    .headers()
                    .get(::http::header::CONTENT_TYPE)
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            ));
        }
        Ok(sse(response, max_sse_event_size))
    }
}
