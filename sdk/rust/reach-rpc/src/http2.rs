//! HTTP/2 settings shared by every Reach server and data-path channel.

use tonic::transport::{Endpoint, Error};

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
