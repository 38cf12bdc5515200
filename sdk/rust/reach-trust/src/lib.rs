//! Reach's trust layer: who a caller is and what it may do.
//!
//! # Layout
//! - [`identity`]: SPIFFE IDs and the [`Caller`] of a request.
//! - [`tls`]: TLS server and client configurations from files, reloaded when they change,
//!   verifying peers the SPIFFE way.
//! - [`connector`]: dials outbound channels with them.
//! - [`token`]: bearer tokens (JWT) verified against configured keys; join tokens.
//! - [`policy`]: the policy file (serve, call, tasks, operators, registry readers, open admin
//!   paths).
//! - [`trust`]: [`Trust`], a process's settings and the decisions made with them (private;
//!   re-exported at the root).
//! - [`audit`]: records those decisions.
//! - [`reload`]: re-reads changed files on an interval (private; see
//!   [`tls::TlsSource::watch`]).
//! - [`issue`] (feature `issue`): a development CA issuing certificates (rcgen).
//!
//! [`trust`]: Trust
//! [`reload`]: tls::TlsSource::watch
//! [`issue`]: #layout
//!
//! See `docs/security.md` for the threat model and setup.

pub mod audit;
pub mod connector;
pub mod identity;
#[cfg(feature = "issue")]
pub mod issue;
pub mod policy;
mod reload;
pub mod tls;
pub mod token;
mod trust;

pub use identity::{Caller, DEFAULT_TRUST_DOMAIN, Identity, PeerIdentity, Via};
pub use policy::{CallGrant, CallTarget, Served, ServedName, TaskAction};
/// The rustls crate Reach builds on, for certificates and configurations in callers.
pub use rustls;
pub use trust::{
    AuthError, Denied, ERROR_DOMAIN, NOT_AUTHORIZED, Trust, TrustConfig, TrustError,
    UNAUTHENTICATED,
};
