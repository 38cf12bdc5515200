//! Admission: a check every request to a [`crate::GrpcServer`] passes before any of its
//! services (health and reflection included) sees it — for a server that serves only certain
//! peers, such as an agent, which answers only the mesh's routers (see
//! [`crate::GrpcServer::with_admission`]).
//!
//! The check runs after the TLS handshake and authentication, so it can read the request's
//! [`reach_trust::PeerIdentity`] and [`reach_trust::Caller`] extensions and its path. A
//! refused request is answered with the check's status at once (its body is not read).

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::Either;

/// The check: `Ok(())` lets a request through, `Err(status)` answers it with `status`.
type Check = dyn Fn(&http::Request<axum::body::Body>) -> Result<(), tonic::Status> + Send + Sync;

/// A check every request passes before it is routed to a service: a tower layer (see the
/// [module](self)). Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    check: Arc<Check>,
}

impl Admission {
    /// Admits the requests for which `check` returns `Ok(())`; the others are answered with the
    /// status it returns.
    pub fn new(
        check: impl Fn(&http::Request<axum::body::Body>) -> Result<(), tonic::Status>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self {
            check: Arc::new(check),
        }
    }

    /// What the check says of `request`.
    ///
    /// # Errors
    /// The status `request` is refused with.
    pub fn check(&self, request: &http::Request<axum::body::Body>) -> Result<(), tonic::Status> {
        (self.check)(request)
    }
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission").finish_non_exhaustive()
    }
}

impl<S> tower::Layer<S> for Admission {
    type Service = Admitted<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admitted {
            inner,
            admission: self.clone(),
        }
    }
}

/// A service behind an [`Admission`]: requests the check refuses never reach it.
#[derive(Clone, Debug)]
pub struct Admitted<S> {
    inner: S,
    admission: Admission,
}

impl<S> tower::Service<http::Request<axum::body::Body>> for Admitted<S>
where
    S: tower::Service<
            http::Request<axum::body::Body>,
            Response = axum::response::Response,
            Error = Infallible,
        >,
{
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future =
        Either<std::future::Ready<Result<axum::response::Response, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<axum::body::Body>) -> Self::Future {
        match self.admission.check(&request) {
            Ok(()) => Either::Right(self.inner.call(request)),
            Err(status) => Either::Left(std::future::ready(Ok(
                status.into_http::<axum::body::Body>()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tower::{Layer, ServiceExt};

    use super::*;

    fn request(path: &str) -> http::Request<axum::body::Body> {
        http::Request::builder()
            .uri(path)
            .header("content-type", "application/grpc")
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn a_refused_request_is_answered_with_the_refusal_and_never_reaches_the_service() {
        let reached = Arc::new(AtomicUsize::new(0));
        let counted = reached.clone();
        let inner = tower::service_fn(move |_request: http::Request<axum::body::Body>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(axum::response::Response::new(axum::body::Body::empty())) }
        });
        let admitted = Admission::new(|request| match request.uri().path() {
            "/open.v1.Open/Call" => Ok(()),
            path => Err(tonic::Status::permission_denied(format!("not {path}"))),
        })
        .layer(inner);

        let refused = admitted
            .clone()
            .oneshot(request("/closed.v1.Closed/Call"))
            .await
            .unwrap();
        let status = tonic::Status::from_header_map(refused.headers()).expect("a gRPC status");
        assert_eq!(status.code(), tonic::Code::PermissionDenied);
        assert_eq!(status.message(), "not /closed.v1.Closed/Call");
        assert_eq!(reached.load(Ordering::SeqCst), 0);

        let answered = admitted
            .oneshot(request("/open.v1.Open/Call"))
            .await
            .unwrap();
        assert!(tonic::Status::from_header_map(answered.headers()).is_none());
        assert_eq!(reached.load(Ordering::SeqCst), 1);
    }
}
