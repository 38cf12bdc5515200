//! HTTP/2 settings shared by every Reach server and data-path channel.

use std::sync::Arc;

use reach_trust::Identity;
use reach_trust::tls::TlsSource;
use tonic::transport::{Channel, Endpoint, Error};

/// The HTTP/2 `SETTINGS_MAX_FRAME_SIZE` every Reach server and data-path channel advertises,
/// in bytes: the largest DATA frame the peer may send it.
///
/// The protocol's default, 16 KiB (RFC 9113 §6.5.2), cuts a 64 KiB message into five frames,
/// each its own write and read. With 256 KiB a message up to that size travels as one frame;
/// a larger message still yields the connection to other streams between its frames. Measured
/// with `reach bench router` at 64 KiB and concurrency 64: +60 % throughput direct to an agent
/// and +25 % through the router (`docs/benchmarks.md`). A peer that does not raise its own
/// setting (any gRPC library's default) is still sent frames of at most 16 KiB.
pub const MAX_FRAME_BYTES: u32 = 256 * 1024;

/// How often a server pings each HTTP/2 connection (RFC 9113 §6.7), to find peers that went
/// away without closing it (a crashed host, a dropped NAT mapping).
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a server waits for a ping's acknowledgement before it closes the connection.
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// Streams a client may reset before the server has accepted them, per connection, before the
/// server ends the connection with `GOAWAY ENHANCE_YOUR_CALM` ("too_many_resets").
///
/// This is h2's defence against the rapid-reset attack (CVE-2023-44487). What h2 counts is
/// narrow: a `RST_STREAM` from the client on a stream that is still in the server's accept
/// queue (its HEADERS were read but the server has not taken it yet); the count goes down as
/// soon as the server takes such a stream. h2's default, 20, is tripped by ordinary clients:
/// when callers give up at their deadlines under load, a single read of the connection holds
/// the HEADERS and the RST_STREAM of many streams at once, and the whole connection (every
/// other call on it) was failed with no retry hint. Each counted stream holds only its
/// request headers (bounded by the header list limit) until it is taken, so this bounds a
/// flood to that many queued streams per connection while a client with up to this many
/// calls giving up together on one connection (five times the 200 concurrent streams hyper
/// lets a connection have open) never trips it.
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 1024;

/// Streams a server may reset on one connection because the client broke the protocol on
/// them (flow-control errors, malformed frames) before it ends the connection with `GOAWAY
/// ENHANCE_YOUR_CALM`. Ordinary cancellations (resets either side asks for) are not counted;
/// this is hyper's default, stated here so that the two reset limits sit side by side.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// A channel endpoint for `url` (`http://HOST:PORT`) with the settings Reach's data path uses:
/// `TCP_NODELAY` (small gRPC frames must not wait for Nagle's algorithm) and
/// [`MAX_FRAME_BYTES`], so replies come back in large frames.
///
/// # Errors
/// When `url` is not a valid URI.
pub fn endpoint(url: impl Into<String>) -> Result<Endpoint, Error> {
    Ok(Endpoint::from_shared(url.into())?
        .tcp_nodelay(true)
        .max_frame_size(MAX_FRAME_BYTES))
}

/// A channel on `endpoint` that connects when first used: plaintext without `tls`; with it,
/// TLS presenting `tls`'s certificate and verifying the server the SPIFFE way (chained to the
/// CA, an identity of the trust domain) and, when `expected` is given, that the server is that
/// identity (a connection to another is refused, so calls fail `UNAVAILABLE`).
pub fn channel_lazy(
    endpoint: &Endpoint,
    tls: Option<&Arc<TlsSource>>,
    expected: Option<Identity>,
) -> Channel {
    match tls {
        None => endpoint.connect_lazy(),
        Some(tls) => {
            let connector = reach_trust::connector::TlsConnector::new(tls.clone());
            let connector = match expected {
                Some(expected) => connector.expecting(expected),
                None => connector,
            };
            endpoint.connect_with_connector_lazy(connector)
        }
    }
}

/// [`channel_lazy`], connected now.
///
/// # Errors
/// When the connection (or, with `tls`, the handshake or the identity check) fails.
pub async fn channel(
    endpoint: &Endpoint,
    tls: Option<&Arc<TlsSource>>,
    expected: Option<Identity>,
) -> Result<Channel, Error> {
    match tls {
        None => endpoint.connect().await,
        Some(tls) => {
            let connector = reach_trust::connector::TlsConnector::new(tls.clone());
            let connector = match expected {
                Some(expected) => connector.expecting(expected),
                None => connector,
            };
            endpoint.connect_with_connector(connector).await
        }
    }
}
