//! What both edges pass on to the mesh for their caller: its `authorization` (so the policy
//! judges the caller, not the edge) and its W3C `traceparent` (so the call continues the
//! caller's trace), and which channel a call goes on.

/// `message` as a request carrying the caller's `authorization` and `traceparent` as
/// metadata (values that are no valid metadata are left out).
pub(crate) fn request<T>(
    message: T,
    authorization: Option<&str>,
    traceparent: Option<&str>,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    if let Some(value) = authorization.and_then(|v| v.parse().ok()) {
        metadata.insert("authorization", value);
    }
    if let Some(value) = traceparent.and_then(|v| v.parse().ok()) {
        metadata.insert("traceparent", value);
    }
    request
}

/// The trace id of `traceparent`, when it is a valid one (W3C Trace Context).
pub(crate) fn trace_id(traceparent: Option<&str>) -> Option<String> {
    reach_rpc::trace::TraceId::from_traceparent(traceparent?).map(|id| id.to_string())
}

/// The client a caller's call goes on: `as_caller` (a channel presenting no certificate of
/// the edge's, so the mesh authenticates the caller by its token) when the caller sent an
/// `authorization` and there is one, else the edge's own `client`.
pub(crate) fn client_for<C: Clone>(
    as_caller: Option<&C>,
    client: &C,
    authorization: Option<&str>,
) -> C {
    match (as_caller, authorization) {
        (Some(as_caller), Some(_)) => as_caller.clone(),
        _ => client.clone(),
    }
}
