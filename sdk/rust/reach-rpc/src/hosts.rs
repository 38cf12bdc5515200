//! Which `Host`s an HTTP port answers: the defence against DNS rebinding, where a page on
//! another site rebinds a name it controls to `127.0.0.1` and reads what the port serves. A
//! port answers only requests naming one of its hosts ([`AllowedHosts`]); browsers always
//! send the name they resolved.

use std::sync::Arc;

/// The host names every loopback port answers to.
pub const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// The `Host`s a port answers: lower-case `host` (any port) or `host:port` entries. Cheap
/// to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts(Arc<[String]>);

impl AllowedHosts {
    /// The hosts `entries` names (`host` or `host:port`, `[v6]:port`; trimmed, any case);
    /// blank entries are left out.
    pub fn new<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        Self(
            entries
                .into_iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .collect(),
        )
    }

    /// Whether `authority` (a `Host` value, `host[:port]`) names one of the hosts: the same
    /// host, and the same port when the entry names one. `user@host` and anything with a
    /// path or space is no `Host` a client sends, and is refused rather than read two ways.
    pub fn allows(&self, authority: &str) -> bool {
        let authority = authority.trim().to_ascii_lowercase();
        if authority.is_empty() || authority.contains(['@', '/', '\\', ' ']) {
            return false;
        }
        let (host, port) = split_port(&authority);
        self.0.iter().any(|allowed| {
            let (allowed_host, allowed_port) = split_port(allowed);
            allowed_host == host && allowed_port.is_none_or(|p| Some(p) == port)
        })
    }
}

/// `router` with `check` in front of every request: a request it refuses is answered with
/// its response instead of reaching a route (the Host and Origin guards of the HTTP ports).
pub fn guarded<S, R>(
    router: axum::Router<S>,
    check: impl Fn(&http::Method, &http::Uri, &http::HeaderMap) -> Result<(), R>
    + Clone
    + Send
    + Sync
    + 'static,
) -> axum::Router<S>
where
    S: Clone + Send + Sync + 'static,
    R: axum::response::IntoResponse + Send + 'static,
{
    router.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let refused = check(request.method(), request.uri(), request.headers()).err();
            async move {
                match refused {
                    Some(refusal) => refusal.into_response(),
                    None => next.run(request).await,
                }
            }
        },
    ))
}

/// The host a request names: its `Host` header, else (HTTP/2) its URI's authority; empty
/// when it names none.
pub fn request_host<'a>(uri: &'a http::Uri, headers: &'a http::HeaderMap) -> &'a str {
    headers
        .get(http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| uri.authority().map(http::uri::Authority::as_str))
        .unwrap_or_default()
}

/// `host[:port]` (or `[v6]:port`) as the bare host and the port, if any.
pub fn split_port(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((host, tail)) => (host, tail.strip_prefix(':')),
            None => (rest, None),
        };
    }
    match authority.rsplit_once(':') {
        // A bare IPv6 address has several colons and no port.
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            (host, Some(port))
        }
        _ => (authority, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_match_by_name_and_by_port_when_one_is_named() {
        let hosts = AllowedHosts::new(["localhost", "::1", "Mesh.Example:8443"]);
        for ok in [
            "localhost",
            "localhost:7071",
            "[::1]:7071",
            "mesh.example:8443",
        ] {
            assert!(hosts.allows(ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example",
            "mesh.example:80",
            "mesh.example",
            "a@localhost",
            "localhost/x",
        ] {
            assert!(!hosts.allows(bad), "{bad}");
        }
    }

    #[test]
    fn http2_names_the_host_in_the_authority() {
        let uri = http::Uri::from_static("https://127.0.0.1:7071/console");
        assert_eq!(
            request_host(&uri, &http::HeaderMap::new()),
            "127.0.0.1:7071"
        );
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::HOST, "localhost".parse().unwrap());
        assert_eq!(request_host(&uri, &headers), "localhost");
    }
}
