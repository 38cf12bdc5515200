//! The console's routes without services behind them: redirects, assets, the guard, and
//! pages that say which service is missing.

use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt as _;
use reach_console::{Console, ConsoleChannels, ConsoleConfig};
use tower::ServiceExt as _;

fn console() -> axum::Router {
    Console::new(ConsoleChannels::default(), ConsoleConfig::default()).routes()
}

async fn send(request: Request<Body>) -> (StatusCode, http::HeaderMap, String) {
    let response = console().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

fn get(path: &str, host: &str) -> Request<Body> {
    Request::get(path)
        .header("host", host)
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn the_root_redirects_to_the_inbox() {
    let (status, headers, _) = send(get("/console", "127.0.0.1:7071")).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers["location"], "/console/inbox");
}

#[tokio::test]
async fn every_response_forbids_framing_and_foreign_scripts() {
    for path in ["/console/inbox", "/console/assets/console.js"] {
        let (_, headers, _) = send(get(path, "127.0.0.1:7071")).await;
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
        assert!(csp.contains("script-src 'self'"), "{csp}");
        assert_eq!(headers["x-frame-options"], "DENY");
        assert_eq!(headers["x-content-type-options"], "nosniff");
    }
    let (_, headers, _) = send(get("/console/inbox", "evil.example")).await;
    assert_eq!(headers["x-frame-options"], "DENY");
}

#[tokio::test]
async fn assets_come_from_the_binary() {
    let (status, headers, body) = send(get("/console/assets/console.css", "localhost")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/css")
    );
    assert!(body.contains(":root"));
    let (status, _, body) = send(get("/console/assets/console.js", "localhost")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("data-live"));
}

#[tokio::test]
async fn a_page_without_its_service_says_which_is_missing() {
    let (status, _, body) = send(get("/console/inbox", "127.0.0.1:7071")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("no orchestrator"), "{body}");
    assert!(body.contains("<nav>"), "{body}");
    let (status, _, body) = send(get("/console/mesh", "127.0.0.1:7071")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("no registry"), "{body}");
}

#[tokio::test]
async fn other_hosts_and_cross_site_posts_are_refused() {
    let (status, _, body) = send(get("/console/inbox", "evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("evil.example"), "{body}");
    let post = Request::post("/console/inbox/t1")
        .header("host", "127.0.0.1:7071")
        .header("origin", "http://evil.example")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from("f.category=servicing"))
        .unwrap();
    let (status, _, body) = send(post).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("another site"), "{body}");
}

#[tokio::test]
async fn oversized_forms_are_refused() {
    let post = Request::post("/console/inbox/t1")
        .header("host", "127.0.0.1:7071")
        .header("origin", "http://127.0.0.1:7071")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(Body::from(format!(
            "f.note={}",
            "x".repeat(reach_console::MAX_FORM_BYTES + 1)
        )))
        .unwrap();
    let (status, _, _) = send(post).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn with_logins_a_page_needs_a_token_which_the_calls_carry() {
    let routes = Console::new(
        ConsoleChannels::default(),
        ConsoleConfig {
            login: true,
            ..ConsoleConfig::default()
        },
    )
    .routes();
    let send = |request: Request<Body>| {
        let routes = routes.clone();
        async move {
            let response = routes.oneshot(request).await.unwrap();
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, headers, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let (status, headers, _) = send(get("/console/tasks/t1", "127.0.0.1")).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers["location"], "/console/login?next=/console/tasks/t1");
    let (status, _, body) = send(get("/console/login?next=/console/tasks/t1", "127.0.0.1")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("name=\"token\""), "{body}");
    let login = |token: &str| {
        Request::post("/console/login")
            .header("host", "127.0.0.1")
            .header("origin", "http://127.0.0.1")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(format!(
                "next=%2Fconsole%2Ftasks%2Ft1&token={token}"
            )))
            .unwrap()
    };
    let (status, _, body) = send(login("two+words")).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(body.contains("login-error"), "{body}");
    let (status, headers, _) = send(login("eyJ.token")).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(headers["location"], "/console/tasks/t1");
    let cookie = headers["set-cookie"].to_str().unwrap();
    assert!(cookie.starts_with("reach_token=eyJ.token;"), "{cookie}");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    let with_cookie = Request::get("/console/inbox")
        .header("host", "127.0.0.1")
        .header("cookie", "reach_token=eyJ.token")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = send(with_cookie).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("Log out"), "{body}");
}
