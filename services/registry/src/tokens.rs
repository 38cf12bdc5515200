//! One-time join tokens: the `jti` of each one used to register, remembered until the token
//! expires so that it cannot register a second time.

use std::collections::HashMap;
use std::sync::Mutex;

/// The most used one-time tokens remembered at once. Past it (after forgetting expired ones)
/// registrations with one-time tokens are refused until some expire: a bound on memory that
/// never lets a token be used twice.
pub const MAX_USED_TOKENS: usize = 100_000;

/// The `jti`s of one-time tokens already used, with their expiry (unix seconds).
#[derive(Debug, Default)]
pub struct UsedTokens {
    used: Mutex<HashMap<String, u64>>,
}

/// Why a one-time token cannot be used now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// It was used before.
    Used,
    /// [`MAX_USED_TOKENS`] unexpired tokens are remembered already.
    Full,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

impl UsedTokens {
    /// Records `jti` (expiring at `exp`, unix seconds) as used.
    ///
    /// # Errors
    /// [`Refused::Used`] when it was used before and has not expired,
    /// [`Refused::Full`] when too many are remembered.
    pub fn claim(&self, jti: &str, exp: u64) -> Result<(), Refused> {
        let mut used = self
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = now_secs();
        if used.get(jti).is_some_and(|&until| until >= now) {
            return Err(Refused::Used);
        }
        if used.len() >= MAX_USED_TOKENS {
            used.retain(|_, until| *until >= now);
            if used.len() >= MAX_USED_TOKENS {
                return Err(Refused::Full);
            }
        }
        used.insert(jti.to_string(), exp);
        Ok(())
    }

    /// Forgets `jti` (its registration failed for another reason, so it was not used).
    pub fn release(&self, jti: &str) {
        self.used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(jti);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_used_once_until_released() {
        let used = UsedTokens::default();
        let exp = now_secs() + 60;
        used.claim("a", exp).unwrap();
        assert_eq!(used.claim("a", exp), Err(Refused::Used));
        used.release("a");
        used.claim("a", exp).unwrap();
        // An expired entry does not block (the token itself no longer verifies).
        used.claim("old", 1).unwrap();
        used.claim("old", 1).unwrap();
    }
}
