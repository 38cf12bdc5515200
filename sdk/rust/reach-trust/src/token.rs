//! Bearer tokens: JWTs (RFC 7519) verified against configured public keys, each mapping to an
//! identity; and signing them (`reach token`, tests).
//!
//! A token's `sub` is its identity: a SPIFFE ID of the trust domain, or any other subject,
//! which becomes `spiffe://<trust-domain>/user/<sub>`. A join token also carries
//! `reach_join: {"services": [...], "one_time": bool}` (see [`JoinGrant`]).

use std::path::PathBuf;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::identity::Identity;

/// The longest bearer token accepted, in bytes.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// The most keys a verifier holds.
pub const MAX_KEYS: usize = 64;

/// Where bearer tokens are verified from, as configured in `[trust.jwt]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// PEM public keys (Ed25519, ECDSA P-256 or RSA) any of which may have signed a token.
    pub keys: Vec<PathBuf>,
    /// The `iss` a token must carry, if set.
    #[serde(default)]
    pub issuer: Option<String>,
    /// The `aud` a token must carry (default `reach`).
    #[serde(default = "default_audience")]
    pub audience: String,
    /// Clock skew allowed on `exp` and `nbf` (default 60 s).
    #[serde(default = "default_leeway", with = "humantime_serde")]
    pub leeway: Duration,
}

fn default_audience() -> String {
    "reach".into()
}

fn default_leeway() -> Duration {
    Duration::from_secs(60)
}

impl JwtConfig {
    /// A configuration of `keys` with the default audience and leeway.
    pub fn new(keys: Vec<PathBuf>) -> Self {
        Self {
            keys,
            issuer: None,
            audience: default_audience(),
            leeway: default_leeway(),
        }
    }
}

/// Why a token was refused or could not be made.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// A key file could not be read or is no supported public key.
    #[error("cannot use {path} as a token key: {reason}")]
    Key {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// No keys configured, or too many.
    #[error("trust.jwt.keys must list between 1 and {MAX_KEYS} PEM public keys")]
    KeyCount,
    /// The token is over [`MAX_TOKEN_BYTES`].
    #[error("the bearer token is over {MAX_TOKEN_BYTES} bytes")]
    TooLong,
    /// The token failed verification (signature, expiry, audience, issuer, shape).
    #[error("the bearer token is not valid: {0}")]
    Invalid(String),
    /// Its subject maps to no identity.
    #[error("the bearer token's subject is not an identity: {0}")]
    Subject(String),
    /// Signing failed (a bad signing key).
    #[error("cannot sign the token: {0}")]
    Sign(String),
}

/// A public key and the algorithm it verifies.
struct Key {
    algorithm: Algorithm,
    key: DecodingKey,
}

fn load_key(path: &PathBuf) -> Result<Key, TokenError> {
    let error = |reason: String| TokenError::Key {
        path: path.clone(),
        reason,
    };
    let pem = std::fs::read(path).map_err(|e| error(e.to_string()))?;
    if pem.len() > crate::tls::MAX_PEM_BYTES as usize {
        return Err(error("over 1 MiB; is it the right file?".into()));
    }
    if let Ok(key) = DecodingKey::from_ed_pem(&pem) {
        return Ok(Key {
            algorithm: Algorithm::EdDSA,
            key,
        });
    }
    if let Ok(key) = DecodingKey::from_ec_pem(&pem) {
        return Ok(Key {
            algorithm: Algorithm::ES256,
            key,
        });
    }
    if let Ok(key) = DecodingKey::from_rsa_pem(&pem) {
        return Ok(Key {
            algorithm: Algorithm::RS256,
            key,
        });
    }
    Err(error(
        "not a PEM public key (Ed25519, ECDSA P-256 or RSA: -----BEGIN PUBLIC KEY-----)".into(),
    ))
}

/// The most verified tokens remembered (see [`TokenVerifier::verify`]).
pub const MAX_CACHED_TOKENS: usize = 4096;

/// A token verified before: its identity, claims and expiry (seconds since the epoch).
struct Verified {
    identity: Identity,
    claims: Map<String, Value>,
    expires_at: u64,
}

/// Verifies bearer tokens and maps them to identities.
pub struct TokenVerifier {
    keys: Vec<Key>,
    config: JwtConfig,
    trust_domain: String,
    /// Tokens verified before, so a client that sends the same token with every call pays
    /// the signature check once (at most [`MAX_CACHED_TOKENS`]; all forgotten when full).
    verified: std::sync::Mutex<std::collections::HashMap<String, Verified>>,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("keys", &self.keys.len())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl TokenVerifier {
    /// Loads the keys of `config`.
    ///
    /// # Errors
    /// [`TokenError::Key`] naming a key file that does not load, [`TokenError::KeyCount`].
    pub fn load(config: &JwtConfig, trust_domain: &str) -> Result<Self, TokenError> {
        if config.keys.is_empty() || config.keys.len() > MAX_KEYS {
            return Err(TokenError::KeyCount);
        }
        Ok(Self {
            keys: config.keys.iter().map(load_key).collect::<Result<_, _>>()?,
            config: config.clone(),
            trust_domain: trust_domain.to_string(),
            verified: std::sync::Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// Verifies `token` (signature by one of the keys, `exp`, `nbf`, `aud`, `iss` when
    /// configured) and returns the identity of its `sub` with all its claims. A token verified
    /// before is taken from memory until its `exp` (plus the leeway).
    ///
    /// # Errors
    /// [`TokenError`] saying why the token is refused.
    pub fn verify(&self, token: &str) -> Result<(Identity, Map<String, Value>), TokenError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(TokenError::TooLong);
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        {
            let verified = self
                .verified
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(hit) = verified.get(token)
                && now <= hit.expires_at.saturating_add(self.config.leeway.as_secs())
            {
                return Ok((hit.identity.clone(), hit.claims.clone()));
            }
        }
        let (identity, claims) = self.verify_signature(token)?;
        if let Some(expires_at) = claims.get("exp").and_then(Value::as_u64) {
            let mut verified = self
                .verified
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if verified.len() >= MAX_CACHED_TOKENS {
                verified.clear();
            }
            verified.insert(
                token.to_string(),
                Verified {
                    identity: identity.clone(),
                    claims: claims.clone(),
                    expires_at,
                },
            );
        }
        Ok((identity, claims))
    }

    fn verify_signature(&self, token: &str) -> Result<(Identity, Map<String, Value>), TokenError> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| TokenError::Invalid(e.to_string()))?;
        let mut last = None;
        for key in self.keys.iter().filter(|key| key.algorithm == header.alg) {
            let mut validation = Validation::new(key.algorithm);
            validation.set_audience(&[&self.config.audience]);
            if let Some(issuer) = &self.config.issuer {
                validation.set_issuer(&[issuer]);
            }
            validation.leeway = self.config.leeway.as_secs();
            validation.validate_nbf = true;
            validation.set_required_spec_claims(&["exp", "sub", "aud"]);
            match jsonwebtoken::decode::<Map<String, Value>>(token, &key.key, &validation) {
                Ok(data) => {
                    let identity = self.identity_of(&data.claims)?;
                    return Ok((identity, data.claims));
                }
                Err(error) => last = Some(error),
            }
        }
        Err(TokenError::Invalid(last.map_or_else(
            || format!("no configured key verifies {:?} tokens", header.alg),
            |e| e.to_string(),
        )))
    }

    fn identity_of(&self, claims: &Map<String, Value>) -> Result<Identity, TokenError> {
        let sub = claims
            .get("sub")
            .and_then(Value::as_str)
            .ok_or_else(|| TokenError::Subject("`sub` is missing or not a string".into()))?;
        let identity = if sub.starts_with("spiffe://") {
            Identity::parse(sub).map_err(|e| TokenError::Subject(e.to_string()))?
        } else {
            Identity::new(&self.trust_domain, &format!("/user/{sub}"))
                .map_err(|e| TokenError::Subject(e.to_string()))?
        };
        if identity.trust_domain() != self.trust_domain {
            return Err(TokenError::Subject(format!(
                "{identity} is not in the trust domain {:?}",
                self.trust_domain
            )));
        }
        Ok(identity)
    }
}

/// What a join token lets its bearer register as: the `reach_join` claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinGrant {
    /// The services it may register instances of (globs, such as `classifier` or `ingest-*`).
    pub services: Vec<String>,
    /// Whether it may register once only.
    #[serde(default)]
    pub one_time: bool,
}

impl JoinGrant {
    /// The claim's name.
    pub const CLAIM: &'static str = "reach_join";

    /// The join grant in a token's claims, if it is a join token.
    ///
    /// # Errors
    /// A message when the claim is there but malformed.
    pub fn of(claims: &Map<String, Value>) -> Result<Option<Self>, String> {
        claims
            .get(Self::CLAIM)
            .map(|value| {
                serde_json::from_value(value.clone())
                    .map_err(|e| format!("the token's {} claim is malformed: {e}", Self::CLAIM))
            })
            .transpose()
    }
}

/// Signs `claims` with the PEM private key `key_pem` (Ed25519 → EdDSA, ECDSA P-256 → ES256,
/// RSA → RS256).
///
/// # Errors
/// [`TokenError::Sign`] when the key is none of those.
pub fn sign(key_pem: &[u8], claims: &Value) -> Result<String, TokenError> {
    let (algorithm, key) = if let Ok(key) = EncodingKey::from_ed_pem(key_pem) {
        (Algorithm::EdDSA, key)
    } else if let Ok(key) = EncodingKey::from_ec_pem(key_pem) {
        (Algorithm::ES256, key)
    } else if let Ok(key) = EncodingKey::from_rsa_pem(key_pem) {
        (Algorithm::RS256, key)
    } else {
        return Err(TokenError::Sign(
            "the signing key is not a PEM Ed25519, ECDSA P-256 or RSA private key".into(),
        ));
    };
    jsonwebtoken::encode(&Header::new(algorithm), claims, &key)
        .map_err(|e| TokenError::Sign(e.to_string()))
}

/// The claims of a token for `subject` valid for `ttl` from now: `sub`, `aud`, `iat`,
/// `exp`, `jti` (a UUIDv4), and `iss` when given.
pub fn claims(
    subject: &str,
    audience: &str,
    issuer: Option<&str>,
    ttl: Duration,
) -> Map<String, Value> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let mut claims = Map::new();
    claims.insert("sub".into(), subject.into());
    claims.insert("aud".into(), audience.into());
    claims.insert("iat".into(), now.into());
    claims.insert("exp".into(), (now + ttl.as_secs()).into());
    claims.insert("jti".into(), uuid::Uuid::new_v4().to_string().into());
    if let Some(issuer) = issuer {
        claims.insert("iss".into(), issuer.into());
    }
    claims
}

/// The claims of a join token: subject `spiffe://<trust_domain>/join/<jti>` and the
/// [`JoinGrant`] claim.
pub fn join_claims(
    trust_domain: &str,
    grant: &JoinGrant,
    audience: &str,
    issuer: Option<&str>,
    ttl: Duration,
) -> Map<String, Value> {
    let mut claims = claims("", audience, issuer, ttl);
    let jti = claims["jti"].as_str().unwrap_or_default().to_string();
    claims.insert(
        "sub".into(),
        format!("spiffe://{trust_domain}/join/{jti}").into(),
    );
    claims.insert(
        JoinGrant::CLAIM.into(),
        serde_json::to_value(grant).unwrap_or_default(),
    );
    claims
}
