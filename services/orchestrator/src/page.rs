//! Page tokens of the paged lists (ListTasks, ListDeadLetters, ListTaskWebhooks).
//!
//! A token is opaque to clients: base64url (no padding) of a version byte, the list it
//! belongs to, a fingerprint of the query and the caller that asked, and the cursor of the
//! last item the caller was *shown* (`created_ms`, id). Lists are filtered to what the caller
//! may view before the page is cut, so a token never names an item the caller did not see,
//! and a caller who may view nothing gets no token. A token of another list, another query,
//! another caller or one that does not decode is refused (`INVALID_ARGUMENT`,
//! `INVALID_PAGE_TOKEN`) instead of answering an empty page. Tokens are not secrets and not
//! signed: what one names, its holder was shown, and a made-up cursor only starts the same
//! filtered list elsewhere.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::error::Error;

/// The token format's version.
const VERSION: u8 = 1;
/// The longest token accepted, in bytes (a cursor id is at most a few hundred bytes).
const MAX_TOKEN_BYTES: usize = 1024;

/// Which list a token continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum List {
    /// ListTasks.
    Tasks = 1,
    /// ListDeadLetters.
    DeadLetters = 2,
    /// ListTaskWebhooks.
    Webhooks = 3,
}

/// Where a page starts: after the item created at `created_ms` with id `id` (in the list's
/// order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The creation time of the last item shown, in ms since the epoch.
    pub created_ms: i64,
    /// Its id.
    pub id: String,
}

/// A fingerprint of a query: the list's parameters and the caller, in order. Tokens carry
/// it so that one is accepted only for the query (and caller) it was issued to.
#[derive(Debug, Clone, Copy)]
pub struct Query(u64);

impl Query {
    /// The fingerprint of `parts` (each separated, so `["ab", "c"]` differs from
    /// `["a", "bc"]`).
    pub fn of<'a>(list: List, parts: impl IntoIterator<Item = &'a str>) -> Self {
        // FNV-1a, 64 bits: stable across processes and replicas (unlike std's hasher).
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for b in bytes {
                hash ^= u64::from(*b);
                hash = hash.wrapping_mul(0x0100_0000_01b3);
            }
        };
        eat(&[list as u8]);
        for part in parts {
            eat(&(part.len() as u64).to_be_bytes());
            eat(part.as_bytes());
        }
        Self(hash)
    }
}

/// The token continuing `list` after `cursor`, for `query`.
pub fn encode(list: List, query: Query, cursor: &Cursor) -> String {
    let mut bytes = Vec::with_capacity(18 + cursor.id.len());
    bytes.push(VERSION);
    bytes.push(list as u8);
    bytes.extend_from_slice(&query.0.to_be_bytes());
    bytes.extend_from_slice(&cursor.created_ms.to_be_bytes());
    bytes.extend_from_slice(cursor.id.as_bytes());
    URL_SAFE_NO_PAD.encode(bytes)
}

/// The cursor of `token` (`None` for an empty token: the first page).
///
/// # Errors
/// [`Error::InvalidPageToken`] when the token does not decode, is of another version or
/// list, or was issued for another query or caller.
pub fn decode(token: &str, list: List, query: Query) -> Result<Option<Cursor>, Error> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || Error::InvalidPageToken {
        token: crate::expr::cut(token, 80),
    };
    if token.len() > MAX_TOKEN_BYTES {
        return Err(bad());
    }
    let bytes = URL_SAFE_NO_PAD.decode(token).map_err(|_| bad())?;
    if bytes.len() < 18 || bytes[0] != VERSION || bytes[1] != list as u8 {
        return Err(bad());
    }
    let fingerprint = u64::from_be_bytes(bytes[2..10].try_into().map_err(|_| bad())?);
    if fingerprint != query.0 {
        return Err(bad());
    }
    let created_ms = i64::from_be_bytes(bytes[10..18].try_into().map_err(|_| bad())?);
    let id = String::from_utf8(bytes[18..].to_vec()).map_err(|_| bad())?;
    if id.is_empty() {
        return Err(bad());
    }
    Ok(Some(Cursor { created_ms, id }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor() -> Cursor {
        Cursor {
            created_ms: 1_764_000_000_123,
            id: "task-7".into(),
        }
    }

    #[test]
    fn a_token_round_trips_for_its_own_query_only() {
        let query = Query::of(List::Tasks, ["FAILED", "flow-a", "alice"]);
        let token = encode(List::Tasks, query, &cursor());
        assert!(!token.contains("task-7"), "the id is not readable as is");
        assert_eq!(decode(&token, List::Tasks, query).unwrap(), Some(cursor()));
        assert_eq!(decode("", List::Tasks, query).unwrap(), None);
        let other_caller = Query::of(List::Tasks, ["FAILED", "flow-a", "bob"]);
        let other_split = Query::of(List::Tasks, ["FAILED", "flow-ab", "lice"]);
        for (list, query) in [
            (List::Tasks, other_caller),
            (List::Tasks, other_split),
            (List::DeadLetters, query),
        ] {
            let e = decode(&token, list, query).unwrap_err();
            assert!(matches!(e, Error::InvalidPageToken { .. }), "{e}");
        }
    }

    #[test]
    fn raw_and_malformed_tokens_are_refused() {
        let query = Query::of(List::Tasks, ["alice"]);
        for token in [
            "1764000000123:task-7",
            "not base64 !",
            "AQE",
            &"A".repeat(2000),
            &URL_SAFE_NO_PAD.encode([9u8; 20]),
        ] {
            assert!(decode(token, List::Tasks, query).is_err(), "{token}");
        }
    }
}
