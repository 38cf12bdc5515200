//! The `grpc-timeout` request header, as defined by the gRPC over HTTP/2 protocol
//! (`PROTOCOL-HTTP2.md`: `TimeoutValue TimeoutUnit`, at most 8 ASCII digits, unit one of
//! `H M S m u n`).

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// The metadata key of the gRPC timeout header.
pub const GRPC_TIMEOUT: &str = "grpc-timeout";

/// Reads the caller's timeout from `grpc-timeout`.
///
/// Returns `Ok(None)` when the header is absent.
///
/// # Errors
/// Returns a message naming the bad value when the header is present but malformed.
pub fn grpc_timeout(metadata: &MetadataMap) -> Result<Option<Duration>, String> {
    let Some(value) = metadata.get(GRPC_TIMEOUT) else {
        return Ok(None);
    };
    let text = value
        .to_str()
        .map_err(|_| "grpc-timeout is not ASCII".to_string())?;
    parse_grpc_timeout(text)
        .map(Some)
        .ok_or_else(|| format!("grpc-timeout {text:?} is malformed: expected up to 8 digits and a unit (H, M, S, m, u, n)"))
}

/// Parses a `grpc-timeout` value such as `250m` (250 ms); `None` when malformed.
pub fn parse_grpc_timeout(text: &str) -> Option<Duration> {
    if text.len() < 2 || text.len() > 9 {
        return None;
    }
    let (digits, unit) = text.split_at(text.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.checked_mul(3600)?),
        "M" => Duration::from_secs(value.checked_mul(60)?),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// Formats a duration as a `grpc-timeout` value, rounding up so that the receiver never
/// sees a shorter deadline than the sender holds, and staying within 8 digits.
pub fn format_grpc_timeout(timeout: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let nanos = timeout.as_nanos();
    for (unit, per) in [
        ("n", 1u128),
        ("u", 1_000),
        ("m", 1_000_000),
        ("S", 1_000_000_000),
    ] {
        let value = nanos.div_ceil(per);
        if value <= MAX {
            return format!("{value}{unit}");
        }
    }
    let minutes = nanos.div_ceil(60_000_000_000);
    if minutes <= MAX {
        format!("{minutes}M")
    } else {
        format!("{}H", minutes.div_ceil(60).min(MAX))
    }
}

/// Whether `status` is tonic's client-side deadline expiry (tonic channels enforce
/// `grpc-timeout` locally and report it as `CANCELLED: Timeout expired`).
pub fn is_local_timeout(status: &tonic::Status) -> bool {
    if status.code() != tonic::Code::Cancelled {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Turns tonic's client-side deadline expiry into `DEADLINE_EXCEEDED`, the code the gRPC
/// spec gives an expired deadline; other statuses pass through.
pub fn normalize_client_status(status: tonic::Status) -> tonic::Status {
    if is_local_timeout(&status) {
        tonic::Status::deadline_exceeded("the deadline passed before the reply arrived")
    } else {
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in ["", "m", "12", "123456789m", "1.5S", "-1S", "10x"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad}");
        }
    }

    #[test]
    fn formats_round_trip_without_shortening() {
        for d in [
            Duration::from_millis(250),
            Duration::from_secs(30),
            Duration::from_secs(86_400 * 400),
        ] {
            let parsed = parse_grpc_timeout(&format_grpc_timeout(d)).unwrap();
            assert!(parsed >= d, "{d:?} -> {parsed:?}");
        }
    }
}
