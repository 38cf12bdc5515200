//! The bearer token of the request being served (a task-local set by [`crate::auth::layer`]
//! from the login cookie), read by every call the console makes for it and by the pages that
//! show a logout button.

use std::future::Future;
use std::sync::Arc;

use axum::http::{HeaderMap, header};

/// The cookie holding the bearer token.
pub const TOKEN_COOKIE: &str = "reach_token";
/// The longest token accepted, in bytes.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

tokio::task_local! {
    static TOKEN: Option<Arc<str>>;
}

/// The bearer token of the request being served; `None` without a login (or outside one).
pub fn current() -> Option<Arc<str>> {
    TOKEN.try_with(Clone::clone).ok().flatten()
}

/// Whether `token` can be a bearer token: 1 to [`MAX_TOKEN_BYTES`] visible ASCII characters.
pub fn valid_token(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= MAX_TOKEN_BYTES
        && token.bytes().all(|b| b.is_ascii_graphic())
}

/// The value of cookie `name` in the request's `Cookie` headers, if any (parsed with the
/// `cookie` crate, RFC 6265 §5.4: `name=value` pairs separated by `;`).
pub(crate) fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(cookie::Cookie::split_parse)
        .filter_map(Result::ok)
        .find(|c| c.name() == name)
        .map(|c| c.value().to_string())
}

/// The token in the request's cookie, when it is a [`valid_token`].
pub(crate) fn cookie_token(headers: &HeaderMap) -> Option<Arc<str>> {
    cookie(headers, TOKEN_COOKIE)
        .filter(|v| valid_token(v))
        .map(Arc::from)
}

/// Runs `serve` with `token` as the [`current`] one.
pub(crate) async fn serve_as<F: Future>(token: Option<Arc<str>>, serve: F) -> F::Output {
    TOKEN.scope(token, serve).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_visible_ascii_of_bounded_size() {
        assert!(valid_token("eyJ.abc-_"));
        assert!(!valid_token("a b"));
        assert!(!valid_token(""));
        assert!(!valid_token(&"x".repeat(MAX_TOKEN_BYTES + 1)));
    }
}
