//! Conversions between `std::time` and `google.protobuf.{Timestamp, Duration}`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Now, as a protobuf timestamp.
pub fn now() -> prost_types::Timestamp {
    timestamp(SystemTime::now())
}

/// A system time as a protobuf timestamp (times before 1970 clamp to the epoch).
pub fn timestamp(time: SystemTime) -> prost_types::Timestamp {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(since.subsec_nanos()).unwrap_or(0),
    }
}

/// Unix milliseconds (negative before 1970) as a protobuf timestamp, nanos always in
/// `0..1e9` as the type requires.
pub fn from_unix_ms(ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0),
    }
}

/// A protobuf timestamp as a system time; `None` when negative or out of range.
pub fn system_time(ts: &prost_types::Timestamp) -> Option<SystemTime> {
    let seconds = u64::try_from(ts.seconds).ok()?;
    let nanos = u32::try_from(ts.nanos).ok()?;
    UNIX_EPOCH.checked_add(Duration::new(seconds, nanos))
}

/// A std duration as a protobuf duration.
pub fn proto_duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// A protobuf duration as a std duration; `None` when negative.
pub fn std_duration(d: &prost_types::Duration) -> Option<Duration> {
    let seconds = u64::try_from(d.seconds).ok()?;
    let nanos = u32::try_from(d.nanos).ok()?;
    Some(Duration::new(seconds, nanos))
}
