//! W3C Trace Context trace ids (<https://www.w3.org/TR/trace-context/>): 16 bytes written as
//! 32 lowercase hex characters, never all zero. The same id OpenTelemetry uses.

use std::fmt;

/// The metadata key of the W3C `traceparent` header.
pub const TRACEPARENT: &str = "traceparent";

/// A validated W3C trace id.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// Why a trace id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceIdError {
    /// Not 32 characters long.
    #[error("trace id {0:?} must be 32 lowercase hex characters, got {1}")]
    Length(String, usize),
    /// A character other than `0-9a-f`.
    #[error("trace id {0:?} must be lowercase hex (0-9, a-f)")]
    NotLowercaseHex(String),
    /// All zeros, which W3C Trace Context reserves as invalid.
    #[error("trace id {0:?} is all zeros, which W3C Trace Context forbids")]
    AllZero(String),
}

impl TraceId {
    /// A fresh random trace id (128 random bits, never all zero).
    pub fn random() -> Self {
        loop {
            let bytes: [u8; 16] = rand::random();
            if bytes != [0; 16] {
                return Self(bytes);
            }
        }
    }

    /// Parses and validates a trace id.
    ///
    /// # Errors
    /// [`TraceIdError`] says which rule the text broke.
    pub fn parse(text: &str) -> Result<Self, TraceIdError> {
        if text.len() != 32 {
            return Err(TraceIdError::Length(text.to_string(), text.len()));
        }
        let mut bytes = [0u8; 16];
        for (i, pair) in text.as_bytes().chunks(2).enumerate() {
            let hi = hex_value(pair[0])
                .ok_or_else(|| TraceIdError::NotLowercaseHex(text.to_string()))?;
            let lo = hex_value(pair[1])
                .ok_or_else(|| TraceIdError::NotLowercaseHex(text.to_string()))?;
            bytes[i] = hi << 4 | lo;
        }
        if bytes == [0; 16] {
            return Err(TraceIdError::AllZero(text.to_string()));
        }
        Ok(Self(bytes))
    }

    /// Reads the trace id out of a `traceparent` header value
    /// (`version-traceid-parentid-flags`, W3C Trace Context §3.2); `None` when the header is
    /// malformed: a field of the wrong length or not lowercase hex, version `ff`, an all-zero
    /// trace id or parent id, or (for version `00`) trailing fields.
    pub fn from_traceparent(value: &str) -> Option<Self> {
        let is_hex = |field: &str, len: usize| {
            field.len() == len && field.bytes().all(|c| hex_value(c).is_some())
        };
        let mut fields = value.trim().split('-');
        let version = fields.next()?;
        let trace_id = fields.next()?;
        let parent_id = fields.next()?;
        let flags = fields.next()?;
        if !is_hex(version, 2)
            || version == "ff"
            || (version == "00" && fields.next().is_some())
            || !is_hex(parent_id, 16)
            || parent_id.bytes().all(|c| c == b'0')
            || !is_hex(flags, 2)
        {
            return None;
        }
        Self::parse(trace_id).ok()
    }

    /// The 16 raw bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TraceId({self})")
    }
}

/// A fresh message id: a UUIDv7 (time-ordered), hyphenated lowercase.
pub fn new_message_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_validates() {
        let id = TraceId::random();
        assert_eq!(TraceId::parse(&id.to_string()), Ok(id));
        assert!(matches!(
            TraceId::parse("abc"),
            Err(TraceIdError::Length(..))
        ));
        assert!(matches!(
            TraceId::parse("4BF92F3577B34DA6A3CE929D0E0E4736"),
            Err(TraceIdError::NotLowercaseHex(_))
        ));
        assert!(matches!(
            TraceId::parse(&"0".repeat(32)),
            Err(TraceIdError::AllZero(_))
        ));
    }

    #[test]
    fn reads_traceparent() {
        let id =
            TraceId::from_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
                .unwrap();
        assert_eq!(id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(TraceId::from_traceparent("00-xyz-00f067aa0ba902b7-01").is_none());
        for malformed in [
            // parent id not hex, all zero, too short
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902-01",
            // flags not hex; version ff; version 00 with a trailing field
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert!(
                TraceId::from_traceparent(malformed).is_none(),
                "{malformed}"
            );
        }
    }
}
