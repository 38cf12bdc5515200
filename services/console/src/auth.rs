//! Who is browsing, once the mesh's trust is on: a login with a bearer token (one the mesh
//! verifies, such as `reach token operator`), kept in an `HttpOnly`, `SameSite=Strict`
//! cookie and forwarded as `authorization: Bearer …` on every call the console makes for the
//! request, so the orchestrator's and registry's own policy judges the person, never the
//! console. [`layer`] sends a request without a token to the login page; the token of the
//! request being served is the session's ([`crate::session::current`]), which
//! [`crate::request`] reads.

use std::sync::Arc;

use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;
use reach_proto::v1::{ListFlowsRequest, ListInstancesRequest};
use serde::Deserialize;

use crate::layout::{Nav, page};
use crate::session::{self, TOKEN_COOKIE, cookie_token, valid_token};
use crate::{BASE, Console};

/// The middleware: with logins required, a request without a token cookie (other than the
/// login page and the assets) is sent to `/console/login`; the token of one with it is
/// [`current`] while it is served.
pub async fn layer(State(console): State<Console>, request: Request, next: Next) -> Response {
    let token = cookie_token(request.headers());
    // Within the console's routes the path has lost its [`BASE`] prefix.
    let path = request.uri().path();
    let open = path == "/login" || path.starts_with("/assets/");
    if console.config().login && token.is_none() && !open {
        let next_path = format!(
            "{BASE}{}",
            request
                .uri()
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or_default()
        );
        let target = format!("{BASE}/login?next={}", escape_query(&next_path));
        return Redirect::to(&target).into_response();
    }
    session::serve_as(token, next.run(request)).await
}

/// `text` percent-encoded for a query value (everything but unreserved characters).
fn escape_query(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Where to go after logging in: a console path, else the inbox (never another site).
fn next_path(next: &str) -> String {
    let console_path = next.starts_with(&format!("{BASE}/")) && !next.contains("//");
    if console_path && !next.starts_with(&format!("{BASE}/login")) {
        next.to_string()
    } else {
        format!("{BASE}/inbox")
    }
}

/// The login page's query.
#[derive(Debug, Default, Deserialize)]
pub struct LoginQuery {
    /// The console path to return to.
    #[serde(default)]
    pub next: String,
}

fn login_page(next: &str, error: Option<&str>, status: StatusCode) -> Response {
    let body = html! {
        h1 { "Log in" }
        p { "The mesh's trust is on: the console acts as you, with a bearer token the mesh verifies "
            "(for example one from " code { "reach token operator" } "). It is kept in a cookie of this site only." }
        @if let Some(error) = error { div.notice.error role="alert" #login-error { (error) } }
        form.card method="post" action={ (BASE) "/login" } #login-form {
            input type="hidden" name="next" value=(next);
            div.field {
                label for="token" { "Bearer token" span.required { " *" } }
                textarea #token name="token" rows="4" autocomplete="off" spellcheck="false" {}
            }
            button type="submit" #login { "Log in" }
        }
    };
    (status, page("Log in", Nav::None, body)).into_response()
}

/// `GET /console/login`.
pub async fn login_form(Query(query): Query<LoginQuery>) -> Response {
    login_page(&next_path(&query.next), None, StatusCode::OK)
}

/// `POST /console/login`: checks the token with one call of the mesh (it must be accepted),
/// sets the cookie, then 303 to `next`.
pub async fn login(
    State(console): State<Console>,
    uri: http::Uri,
    headers: HeaderMap,
    extensions: http::Extensions,
    axum::extract::Form(posted): axum::extract::Form<Vec<(String, String)>>,
) -> Response {
    let value = |name: &str| {
        posted
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let next = next_path(&value("next"));
    let token = value("token");
    let token = token.strip_prefix("Bearer ").unwrap_or(&token).trim();
    if !valid_token(token) {
        return login_page(
            &next,
            Some("paste a token: visible ASCII characters, at most 8 KiB"),
            StatusCode::UNPROCESSABLE_ENTITY,
        );
    }
    let shared: Arc<str> = Arc::from(token);
    let checked = session::serve_as(Some(shared), async {
        if let Ok(mut orchestrator) = console.orchestrator() {
            orchestrator
                .list_flows(crate::request(ListFlowsRequest::default()))
                .await
                .map(|_| ())
        } else if let Ok(mut registry) = console.registry() {
            registry
                .list_instances(crate::request(ListInstancesRequest::default()))
                .await
                .map(|_| ())
        } else {
            Ok(())
        }
    })
    .await;
    if let Err(status) = checked
        && matches!(
            status.code(),
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
        )
    {
        return login_page(
            &next,
            Some(&format!(
                "the mesh refuses this token: {}",
                status.message()
            )),
            StatusCode::UNAUTHORIZED,
        );
    }
    let mut response = Redirect::to(&next).into_response();
    set_token_cookie(
        &mut response,
        token,
        served_securely(&uri, &headers, &extensions),
    );
    response
}

/// Whether the request came over HTTPS: on a TLS connection of a Reach server (whatever the
/// HTTP version: HTTP/1.1 requests name no scheme), with an `https` URI (HTTP/2), or through a
/// proxy that terminated TLS (`X-Forwarded-Proto: https`).
pub fn served_securely(
    uri: &http::Uri,
    headers: &HeaderMap,
    extensions: &http::Extensions,
) -> bool {
    reach_rpc::server::Transport::of(extensions) == reach_rpc::server::Transport::Tls
        || uri.scheme_str() == Some("https")
        || headers
            .get("x-forwarded-proto")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("https"))
}

/// The `Set-Cookie` value of the login cookie holding `token` (empty and expired to log
/// out): this site's console paths only, `SameSite=Strict`, `HttpOnly`, and `Secure` when
/// `secure` (served over HTTPS), so a browser never sends it over plain HTTP.
pub fn token_cookie(token: &str, secure: bool) -> String {
    let cookie = cookie::Cookie::build((TOKEN_COOKIE, token))
        .path(BASE)
        .same_site(cookie::SameSite::Strict)
        .http_only(true)
        .secure(secure);
    let cookie = if token.is_empty() {
        cookie.max_age(cookie::time::Duration::ZERO)
    } else {
        cookie
    };
    cookie.build().to_string()
}

fn set_token_cookie(response: &mut Response, token: &str, secure: bool) {
    if let Ok(value) = HeaderValue::from_str(&token_cookie(token, secure)) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
}

/// `POST /console/logout`: forgets the token, then 303 to the login page.
pub async fn logout(uri: http::Uri, headers: HeaderMap, extensions: http::Extensions) -> Response {
    let mut response = Redirect::to(&format!("{BASE}/login")).into_response();
    set_token_cookie(
        &mut response,
        "",
        served_securely(&uri, &headers, &extensions),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_paths_are_checked() {
        assert_eq!(next_path("/console/tasks/t1"), "/console/tasks/t1");
        assert_eq!(next_path("https://evil.example/"), "/console/inbox");
        assert_eq!(next_path("/console//evil.example"), "/console/inbox");
        assert_eq!(next_path("/console/login"), "/console/inbox");
        assert_eq!(
            escape_query("/console/inbox?flow=a b"),
            "/console/inbox%3Fflow%3Da%20b"
        );
    }
}
