//! The names the contracts use for capabilities, topics and services.

/// The longest dotted name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

/// Whether `s` is a dotted name — segments of ASCII letters, digits, `_` and `-`, at most
/// [`MAX_NAME_BYTES`] — as capability names and topics are (the registry refuses others).
pub fn is_dotted_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME_BYTES
        && s.split('.').all(|segment| {
            !segment.is_empty()
                && segment
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dotted_names_are_segments_of_the_allowed_bytes() {
        for good in [
            "a",
            "complaint.classify",
            "mcp.words.count_words",
            "a-b.c_d",
        ] {
            assert!(is_dotted_name(good), "{good}");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a..b",
            "a b",
            "a/b",
            "é",
            &"x".repeat(257),
        ] {
            assert!(!is_dotted_name(bad), "{bad:?}");
        }
    }
}
