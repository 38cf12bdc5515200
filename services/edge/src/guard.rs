//! What the edge's HTTP port takes from browsers and rebinding names: [`HttpGuard`], in front
//! of the A2A JSON-RPC binding and the MCP endpoint alike.
//!
//! A web page can make a browser POST to `127.0.0.1:7072` (a "simple" cross-origin request,
//! `text/plain`, needs no preflight), or rebind a name it controls to that address (DNS
//! rebinding), and so call the mesh's capabilities as the person browsing. MCP's transport
//! spec asks servers to validate `Origin` and bind to loopback; the same holds for the A2A
//! JSON-RPC binding on the same port. So every request must name one of the edge's hosts
//! (`Host`), a request that changes something (not GET or HEAD) from a browser (`Origin`)
//! must come from an allowed origin, and a POST must be `application/json`.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode};
use reach_rpc::hosts::{AllowedHosts, LOOPBACK_HOSTS, request_host};

/// The Host and Origin checks of the edge's HTTP port, from `edge.allowed_hosts`,
/// `edge.allowed_origins` and `edge.public_url`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct HttpGuard {
    /// The `Host`s the port answers.
    hosts: AllowedHosts,
    /// Lower-case `scheme://host[:port]` entries, `:*` for any port.
    origins: Arc<[String]>,
}

impl HttpGuard {
    /// A guard allowing the `Host`s `allowed_hosts` (`host` or `host:port`), or when there
    /// are none [`LOOPBACK_HOSTS`] and the host of `public_url`, and the browser `Origin`s
    /// `allowed_origins` (`scheme://host[:port]`, `:*` for any port). The edge's settings
    /// (`edge.allowed_hosts`, `edge.allowed_origins`, `edge.public_url`) give them:
    /// [`crate::a2a::EdgeConfig::http_guard`].
    pub fn new(allowed_hosts: &[String], allowed_origins: &[String], public_url: &str) -> Self {
        let mut hosts: Vec<&str> = allowed_hosts.iter().map(String::as_str).collect();
        let public = public_url.parse::<http::Uri>().ok();
        if hosts.iter().all(|h| h.trim().is_empty()) {
            hosts = LOOPBACK_HOSTS.to_vec();
            if let Some(authority) = public.as_ref().and_then(http::Uri::authority) {
                hosts.push(bare_host(authority.host()));
            }
        }
        Self {
            hosts: AllowedHosts::new(hosts),
            origins: allowed_origins
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .collect::<Vec<_>>()
                .into(),
        }
    }

    /// Checks one request.
    ///
    /// # Errors
    /// The [`Refusal`] to answer instead: 403 naming a `Host` that is none of the edge's or an
    /// `Origin` not allowed, 415 for a POST that is not `application/json`.
    pub fn check(
        &self,
        method: &Method,
        uri: &http::Uri,
        headers: &HeaderMap,
    ) -> Result<(), Refusal> {
        let host = request_host(uri, headers);
        if !self.hosts.allows(host) {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                format!(
                    "this edge does not answer requests for host {:?}; address it by one of its names, or add the name to edge.allowed_hosts",
                    clip(host)
                ),
            ));
        }
        if method != Method::GET
            && method != Method::HEAD
            && let Some(origin) = headers.get(http::header::ORIGIN)
        {
            let origin = origin.to_str().unwrap_or_default();
            if !self.allows_origin(origin) {
                return Err(refuse(
                    StatusCode::FORBIDDEN,
                    format!(
                        "cross-origin requests are refused (Origin {:?}); list the web apps trusted to call the mesh in edge.allowed_origins",
                        clip(origin)
                    ),
                ));
            }
        }
        if method == Method::POST {
            let json = headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
            if !json {
                return Err(refuse(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "send the request as Content-Type: application/json".to_string(),
                ));
            }
        }
        Ok(())
    }

    /// Whether `origin` (`scheme://host[:port]`) is allowed.
    fn allows_origin(&self, origin: &str) -> bool {
        let origin = origin.trim().trim_end_matches('/').to_ascii_lowercase();
        self.origins
            .iter()
            .any(|allowed| match allowed.strip_suffix(":*") {
                Some(any_port) => {
                    origin == any_port
                        || origin
                            .strip_prefix(any_port)
                            .and_then(|rest| rest.strip_prefix(':'))
                            .is_some_and(|port| {
                                !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
                            })
                }
                None => *allowed == origin,
            })
    }

    /// An axum middleware applying [`HttpGuard::check`] to every request of a router.
    pub fn layer<S: Clone + Send + Sync + 'static>(
        &self,
        router: axum::Router<S>,
    ) -> axum::Router<S> {
        let guard = self.clone();
        reach_rpc::hosts::guarded(router, move |method, uri, headers| {
            guard.check(method, uri, headers)
        })
    }
}

/// `host` without the brackets of an IPv6 literal.
fn bare_host(host: &str) -> &str {
    host.trim_start_matches('[').trim_end_matches(']')
}

fn clip(value: &str) -> String {
    value.chars().take(128).collect()
}

/// Why [`HttpGuard::check`] refused a request: the status and what to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// 403 or 415.
    pub status: StatusCode,
    /// What was wrong and which setting to change, lowercase.
    pub message: String,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.status, format!("{}\n", self.message)).into_response()
    }
}

fn refuse(status: StatusCode, message: String) -> Refusal {
    Refusal { status, message }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(hosts: &[&str], origins: &[&str], public_url: &str) -> HttpGuard {
        let strings = |items: &[&str]| items.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
        HttpGuard::new(&strings(hosts), &strings(origins), public_url)
    }

    fn post(host: &str, origin: Option<&str>, content_type: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, host.parse().unwrap());
        headers.insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        if let Some(origin) = origin {
            headers.insert(http::header::ORIGIN, origin.parse().unwrap());
        }
        headers
    }

    fn status(guard: &HttpGuard, method: Method, headers: &HeaderMap) -> u16 {
        let uri = http::Uri::from_static("/mcp");
        guard
            .check(&method, &uri, headers)
            .map_or_else(|r| r.status.as_u16(), |()| 200)
    }

    #[test]
    fn only_the_edges_own_hosts_are_answered() {
        let default = guard(&[], &[], "https://mesh.example.com:8443");
        for ok in [
            "127.0.0.1:7072",
            "localhost",
            "LOCALHOST:1",
            "[::1]:7072",
            "mesh.example.com:443",
        ] {
            assert_eq!(
                status(&default, Method::POST, &post(ok, None, "application/json")),
                200,
                "{ok}"
            );
        }
        for bad in [
            "evil.example.com",
            "evil.com@localhost",
            "localhost.evil.com",
            "127.0.0.2:7072",
            "",
        ] {
            assert_eq!(
                status(&default, Method::GET, &post(bad, None, "application/json")),
                403,
                "{bad:?}"
            );
        }
        let pinned = guard(&["mcp.example.com:443"], &[], "");
        assert_eq!(
            status(
                &pinned,
                Method::GET,
                &post("mcp.example.com:443", None, "application/json")
            ),
            200
        );
        assert_eq!(
            status(
                &pinned,
                Method::GET,
                &post("mcp.example.com:80", None, "application/json")
            ),
            403
        );
        assert_eq!(
            status(
                &pinned,
                Method::GET,
                &post("127.0.0.1", None, "application/json")
            ),
            403
        );
    }

    #[test]
    fn browsers_post_only_from_allowed_origins_and_only_json() {
        let guard = guard(&[], &["https://app.example.com", "http://localhost:*"], "");
        let at = |origin, content_type| {
            status(
                &guard,
                Method::POST,
                &post("127.0.0.1", origin, content_type),
            )
        };
        assert_eq!(at(None, "application/json; charset=utf-8"), 200);
        assert_eq!(at(Some("https://app.example.com"), "application/json"), 200);
        assert_eq!(at(Some("http://localhost:5173"), "application/json"), 200);
        assert_eq!(
            at(Some("https://evil.example.com"), "application/json"),
            403
        );
        assert_eq!(at(Some("null"), "application/json"), 403);
        assert_eq!(at(Some("http://localhost:x"), "application/json"), 403);
        assert_eq!(at(None, "text/plain"), 415);
        // A card is read from anywhere.
        let get = status(
            &guard,
            Method::GET,
            &post("127.0.0.1", Some("https://evil.example.com"), "text/plain"),
        );
        assert_eq!(get, 200);
    }
}
