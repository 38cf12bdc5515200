//! The page shell: the document head, the navigation bar, the `#live` part that live updates
//! replace, and the stylesheet and script served from the binary
//! (`/console/assets/console.css`, `/console/assets/console.js`).

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};

use crate::BASE;

/// The stylesheet, compiled into the binary.
pub const STYLESHEET: &str = include_str!("../assets/console.css");
/// The script (live updates, filters that submit on change), compiled into the binary.
pub const SCRIPT: &str = include_str!("../assets/console.js");

/// Which navigation entry a page belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    /// The inbox and review pages.
    Inbox,
    /// Task pages.
    Tasks,
    /// Flow pages.
    Flows,
    /// The mesh page.
    Mesh,
    /// None (an error page).
    None,
}

const ENTRIES: [(Nav, &str, &str); 4] = [
    (Nav::Inbox, "inbox", "Inbox"),
    (Nav::Tasks, "tasks", "Tasks"),
    (Nav::Flows, "flows", "Flows"),
    (Nav::Mesh, "mesh", "Mesh"),
];

/// A whole page titled `title` with `body` in `<main>` (not live).
pub fn page(title: &str, nav: Nav, body: Markup) -> Html<String> {
    shell(title, nav, 0, body)
}

/// A whole page whose `body` (wrapped in `#live`) the script refreshes every `refresh_ms`
/// milliseconds (0: never).
pub fn live_page(title: &str, nav: Nav, refresh_ms: u64, body: Markup) -> Html<String> {
    shell(title, nav, refresh_ms, html! { div #live { (body) } })
}

fn shell(title: &str, nav: Nav, refresh_ms: u64, body: Markup) -> Html<String> {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · Reach console" }
                link rel="stylesheet" href={ (BASE) "/assets/console.css" };
            }
            body {
                header.top {
                    a.brand href={ (BASE) "/inbox" } { "Reach console" }
                    nav {
                        @for (entry, path, label) in ENTRIES {
                            a href={ (BASE) "/" (path) } class=[(entry == nav).then_some("active")] { (label) }
                        }
                    }
                    @if refresh_ms > 0 {
                        span.live #live-stamp { "live" }
                    }
                    @if crate::session::current().is_some() {
                        form.logout method="post" action={ (BASE) "/logout" } {
                            button.small.secondary type="submit" #logout { "Log out" }
                        }
                    }
                }
                main data-live=[(refresh_ms > 0).then_some(refresh_ms)] {
                    (body)
                }
                script src={ (BASE) "/assets/console.js" } defer {}
            }
        }
    };
    Html(markup.into_string())
}

/// `GET /console/assets/console.css`.
pub async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// `GET /console/assets/console.js`.
pub async fn script() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        SCRIPT,
    )
        .into_response()
}
