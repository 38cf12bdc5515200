//! What the console takes from browsers: [`Guard`], in front of every route.
//!
//! A page on another site can make a browser post a form to `127.0.0.1:7071` (a cross-site
//! request forgery: resume or cancel a task as the person browsing), or rebind a name it
//! controls to that address (DNS rebinding) and read the pages. So every request must name
//! one of the console's hosts (`Host`), and a request that changes something (not GET or
//! HEAD) coming from a browser must come from the console's own origin (`Origin` equal to
//! the `Host` it names; `Sec-Fetch-Site: same-origin` when a browser sends no `Origin`).
//! The console's cookies are `SameSite=Strict` as well.

use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode};
use reach_rpc::hosts::{AllowedHosts, LOOPBACK_HOSTS, request_host};

/// The Host and Origin checks. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The `Host`s the console answers.
    hosts: AllowedHosts,
}

impl Guard {
    /// A guard allowing [`LOOPBACK_HOSTS`] and `allowed_hosts` (`host` or `host:port`).
    pub fn new(allowed_hosts: &[String]) -> Self {
        Self {
            hosts: AllowedHosts::new(
                LOOPBACK_HOSTS
                    .into_iter()
                    .chain(allowed_hosts.iter().map(String::as_str)),
            ),
        }
    }

    /// Checks one request.
    ///
    /// # Errors
    /// The [`Refusal`] to answer instead (403): a `Host` that is none of the console's, or
    /// a change from another origin.
    pub fn check(
        &self,
        method: &Method,
        uri: &http::Uri,
        headers: &HeaderMap,
    ) -> Result<(), Refusal> {
        // HTTP/2 (the admin port over TLS) names the host in the URI's authority.
        let host = request_host(uri, headers).trim().to_ascii_lowercase();
        if !self.hosts.allows(&host) {
            return Err(Refusal(format!(
                "this console does not answer requests for host {:?}; open it by one of its names (localhost, 127.0.0.1) or add the name to the console's allowed hosts",
                clip(&host)
            )));
        }
        if method == Method::GET || method == Method::HEAD {
            return Ok(());
        }
        match headers.get(http::header::ORIGIN) {
            Some(origin) => {
                let origin = origin
                    .to_str()
                    .unwrap_or_default()
                    .trim()
                    .trim_end_matches('/')
                    .to_ascii_lowercase();
                let same = origin.split_once("://").is_some_and(|(scheme, rest)| {
                    (scheme == "http" || scheme == "https") && rest == host
                });
                if !same {
                    return Err(Refusal(format!(
                        "a form of another site (Origin {:?}) cannot change anything here",
                        clip(&origin)
                    )));
                }
            }
            None => {
                // A browser that sends no Origin still says where the request comes from.
                let site = headers
                    .get("sec-fetch-site")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("none");
                if site != "same-origin" && site != "none" {
                    return Err(Refusal(format!(
                        "a request from another site (Sec-Fetch-Site {:?}) cannot change anything here",
                        clip(site)
                    )));
                }
            }
        }
        Ok(())
    }

    /// `router` with [`Guard::check`] in front of every request (a refusal is answered
    /// instead): for other routes a browser must not reach from another site, such as the
    /// admin port's operator routes when no trust authenticates their callers.
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

/// The Content-Security-Policy of every console response: scripts, styles, forms and
/// requests from the console itself only (inline `style` attributes allowed: the timeline's
/// bars), and no framing by another page (clickjacking a Submit button).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Adds the console's security headers to a response: [`CONTENT_SECURITY_POLICY`],
/// `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff`, `Referrer-Policy:
/// same-origin` (task ids stay on the site), `Cache-Control: no-store` for pages (they
/// hold task data).
pub fn harden(headers: &mut HeaderMap) {
    use http::header::{self, HeaderValue};
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    if !headers.contains_key(header::CACHE_CONTROL) {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
}

fn clip(value: &str) -> String {
    value.chars().take(128).collect()
}

/// Why [`Guard::check`] refused a request: what to change. Answers 403 as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal(pub String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (StatusCode::FORBIDDEN, self.0).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn hosts_are_loopback_or_configured() {
        let guard = Guard::new(&["console.example:8443".to_string()]);
        for ok in [
            "127.0.0.1:7071",
            "localhost",
            "[::1]:7071",
            "console.example:8443",
        ] {
            assert!(
                guard
                    .check(
                        &Method::GET,
                        &http::Uri::from_static("/"),
                        &headers(&[("host", ok)])
                    )
                    .is_ok(),
                "{ok}"
            );
        }
        for bad in ["evil.example", "console.example:80", "a@127.0.0.1", ""] {
            assert!(
                guard
                    .check(
                        &Method::GET,
                        &http::Uri::from_static("/"),
                        &headers(&[("host", bad)])
                    )
                    .is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn posts_come_from_the_consoles_own_origin() {
        let guard = Guard::new(&[]);
        let host = ("host", "127.0.0.1:7071");
        let post = |extra: &[(&'static str, &str)]| {
            let mut pairs = vec![host];
            pairs.extend_from_slice(extra);
            guard.check(
                &Method::POST,
                &http::Uri::from_static("/"),
                &headers(&pairs),
            )
        };
        assert!(post(&[("origin", "http://127.0.0.1:7071")]).is_ok());
        assert!(post(&[("origin", "http://evil.example")]).is_err());
        assert!(post(&[("origin", "http://127.0.0.1:9999")]).is_err());
        assert!(post(&[("origin", "null")]).is_err());
        assert!(post(&[("sec-fetch-site", "cross-site")]).is_err());
        assert!(post(&[("sec-fetch-site", "same-origin")]).is_ok());
        // curl and other non-browser clients send neither.
        assert!(post(&[]).is_ok());
    }

    #[test]
    fn http2_names_the_host_in_the_authority() {
        let guard = Guard::new(&[]);
        let uri = http::Uri::from_static("https://127.0.0.1:7071/console/inbox");
        assert!(guard.check(&Method::GET, &uri, &HeaderMap::new()).is_ok());
        let uri = http::Uri::from_static("https://evil.example/console/inbox");
        assert!(guard.check(&Method::GET, &uri, &HeaderMap::new()).is_err());
    }
}
