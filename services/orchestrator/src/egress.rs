//! Which network addresses the orchestrator's outbound HTTP (task webhook deliveries) may
//! connect to: public unicast addresses, plus the networks an operator allows in
//! `orchestrator.webhook_allowed_networks`.
//!
//! A webhook URL is the caller's input. Without this check, anyone allowed to create a
//! webhook could make the orchestrator POST to its own loopback services, the pod network or
//! a cloud metadata endpoint (169.254.169.254): server-side request forgery (the OWASP SSRF
//! prevention cheat sheet; the A2A specification asks servers to validate push-notification
//! URLs for the same reason).
//!
//! The address is checked twice:
//! - when a webhook is created ([`EgressPolicy::check_url`]): an IP-literal host is refused
//!   at once, with the setting that would allow it;
//! - on every connection, after DNS ([`EgressPolicy::resolver`]): refused addresses are
//!   dropped from what a name resolves to, so a name that resolves (or later re-resolves,
//!   as in DNS rebinding) to an internal address is refused too.
//!
//! The delivery client follows no redirects and uses no proxy, so nothing connects to an
//! address that was not checked.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use ipnet::IpNet;

/// The special-purpose ranges that are not globally reachable, from the IANA IPv4 and IPv6
/// Special-Purpose Address Registries (RFC 6890), each with the name a refusal gives it.
/// IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) and the NAT64 well-known prefix
/// (`64:ff9b::/96`, RFC 6052) are judged by the IPv4 address they carry.
const NOT_PUBLIC: &[(&str, &str)] = &[
    ("0.0.0.0/8", "\"this network\" (RFC 791)"),
    ("10.0.0.0/8", "private (RFC 1918)"),
    (
        "100.64.0.0/10",
        "shared address space (RFC 6598, carrier-grade NAT)",
    ),
    ("127.0.0.0/8", "loopback (RFC 1122)"),
    (
        "169.254.0.0/16",
        "link-local (RFC 3927, where cloud metadata services answer)",
    ),
    ("172.16.0.0/12", "private (RFC 1918)"),
    ("192.0.0.0/24", "IETF protocol assignment (RFC 6890)"),
    ("192.0.2.0/24", "documentation (RFC 5737)"),
    ("192.168.0.0/16", "private (RFC 1918)"),
    ("198.18.0.0/15", "benchmarking (RFC 2544)"),
    ("198.51.100.0/24", "documentation (RFC 5737)"),
    ("203.0.113.0/24", "documentation (RFC 5737)"),
    ("224.0.0.0/4", "multicast (RFC 5771)"),
    ("240.0.0.0/4", "reserved or broadcast (RFC 1112, RFC 919)"),
    ("::/128", "unspecified (RFC 4291)"),
    ("::1/128", "loopback (RFC 4291)"),
    (
        "64:ff9b:1::/48",
        "local-use IPv4/IPv6 translation (RFC 8215)",
    ),
    ("100::/64", "discard-only (RFC 6666)"),
    ("2001:db8::/32", "documentation (RFC 3849)"),
    ("fc00::/7", "unique local (RFC 4193)"),
    ("fe80::/10", "link-local (RFC 4291)"),
    ("ff00::/8", "multicast (RFC 4291)"),
];

/// An address a webhook may not reach.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{address} is a {range} address, which webhooks may not reach; to allow it, add its \
     network to orchestrator.webhook_allowed_networks (for example \"{network}\")"
)]
pub struct Refused {
    /// The address refused (IPv4-mapped addresses as their IPv4 address).
    pub address: IpAddr,
    /// The name of the special-purpose range it is in, with its RFC.
    pub range: &'static str,
    /// That range, as a CIDR network an operator could allow.
    pub network: IpNet,
}

/// The addresses webhook deliveries may connect to: every public unicast address, plus the
/// `allowed` networks (`0.0.0.0/0` and `::/0` allow everything).
#[derive(Debug, Clone)]
pub struct EgressPolicy {
    allowed: Vec<IpNet>,
    not_public: Vec<(IpNet, &'static str)>,
}

impl EgressPolicy {
    /// Public addresses and `allowed`.
    pub fn new(allowed: Vec<IpNet>) -> Self {
        let not_public = NOT_PUBLIC
            .iter()
            .map(|(network, name)| {
                let network = network
                    .parse()
                    .expect("the special-purpose ranges are valid CIDR networks");
                (network, *name)
            })
            .collect();
        Self {
            allowed,
            not_public,
        }
    }

    /// `Ok` when a connection to `address` may be made.
    ///
    /// # Errors
    /// [`Refused`] naming the special-purpose range `address` is in, when no allowed network
    /// holds it.
    pub fn check(&self, address: IpAddr) -> Result<(), Refused> {
        let address = judged_as(address);
        if self.allowed.iter().any(|n| n.contains(&address)) {
            return Ok(());
        }
        match self.not_public.iter().find(|(n, _)| n.contains(&address)) {
            Some((network, range)) => Err(Refused {
                address,
                range,
                network: *network,
            }),
            None => Ok(()),
        }
    }

    /// Checks a URL whose host is an IP address (a name is checked when it is resolved, on
    /// each connection: see [`EgressPolicy::resolver`]).
    ///
    /// # Errors
    /// [`Refused`] as [`EgressPolicy::check`].
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), Refused> {
        // The URL parser has already normalised an IPv4 host (`2130706433`, `0x7f.1`) to
        // dotted decimal and put an IPv6 host in brackets.
        let host = url.host_str().unwrap_or_default();
        let literal = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        match literal.parse::<IpAddr>() {
            Ok(address) => self.check(address),
            Err(_) => Ok(()),
        }
    }

    /// A DNS resolver for the delivery client: the system resolver's answers without the
    /// addresses this policy refuses; a name left with none fails to resolve with the
    /// [`Refused`] reason of its first address.
    pub fn resolver(self: &Arc<Self>) -> Arc<CheckedResolver> {
        Arc::new(CheckedResolver {
            policy: self.clone(),
        })
    }
}

/// The address a check judges: an IPv4-mapped IPv6 address or one under the NAT64
/// well-known prefix as the IPv4 address it carries.
fn judged_as(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V6(v6) => {
            let segments = v6.segments();
            if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let [.., a, b, c, d] = v6.octets();
                IpAddr::V4(Ipv4Addr::new(a, b, c, d))
            } else {
                IpAddr::V6(v6)
            }
        }
        v4 => v4,
    }
}

/// The resolver [`EgressPolicy::resolver`] makes.
#[derive(Debug)]
pub struct CheckedResolver {
    policy: Arc<EgressPolicy>,
}

/// A name that resolved only to refused addresses.
#[derive(Debug, thiserror::Error)]
#[error("{name}: {refused}")]
struct NameRefused {
    name: String,
    refused: Refused,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let policy = self.policy.clone();
        Box::pin(async move {
            let name = name.as_str().to_owned();
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let mut first_refusal = None;
            let kept: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|a| match policy.check(a.ip()) {
                    Ok(()) => true,
                    Err(refused) => {
                        first_refusal.get_or_insert(refused);
                        false
                    }
                })
                .collect();
            match (kept.is_empty(), first_refusal) {
                (true, Some(refused)) => Err(Box::new(NameRefused { name, refused }) as _),
                _ => Ok(Box::new(kept.into_iter()) as reqwest::dns::Addrs),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn internal_addresses_are_refused_and_public_ones_pass() {
        let policy = EgressPolicy::new(Vec::new());
        for internal in [
            "127.0.0.1",
            "10.1.2.3",
            "172.31.255.255",
            "192.168.0.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fd00::1",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
        ] {
            assert!(policy.check(ip(internal)).is_err(), "{internal} passed");
        }
        for public in [
            "1.1.1.1",
            "8.8.8.8",
            "172.32.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
        ] {
            assert_eq!(policy.check(ip(public)), Ok(()), "{public} refused");
        }
    }

    #[test]
    fn a_refusal_names_the_range_and_the_setting_that_allows_it() {
        let refused = EgressPolicy::new(Vec::new())
            .check(ip("::ffff:169.254.169.254"))
            .unwrap_err();
        assert_eq!(refused.address, ip("169.254.169.254"));
        assert_eq!(
            refused.to_string(),
            "169.254.169.254 is a link-local (RFC 3927, where cloud metadata services answer) \
             address, which webhooks may not reach; to allow it, add its network to \
             orchestrator.webhook_allowed_networks (for example \"169.254.0.0/16\")"
        );
    }

    #[test]
    fn allowed_networks_pass_and_nothing_else_does() {
        let policy = EgressPolicy::new(vec!["10.1.0.0/16".parse().unwrap()]);
        assert_eq!(policy.check(ip("10.1.200.3")), Ok(()));
        assert!(policy.check(ip("10.2.0.1")).is_err());
        let everything =
            EgressPolicy::new(vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()]);
        assert_eq!(everything.check(ip("127.0.0.1")), Ok(()));
        assert_eq!(everything.check(ip("::1")), Ok(()));
    }

    #[test]
    fn urls_are_judged_by_an_ip_literal_host_only() {
        let policy = EgressPolicy::new(Vec::new());
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        assert!(
            policy
                .check_url(&url("http://127.0.0.1:8080/hook"))
                .is_err()
        );
        assert!(policy.check_url(&url("http://[::1]/hook")).is_err());
        assert!(policy.check_url(&url("http://2130706433/hook")).is_err());
        assert!(policy.check_url(&url("http://0x7f.1/hook")).is_err());
        assert_eq!(
            policy.check_url(&url("https://hooks.example.com/x")),
            Ok(())
        );
    }

    #[tokio::test]
    async fn the_resolver_drops_refused_addresses() {
        use reqwest::dns::Resolve as _;
        let policy = Arc::new(EgressPolicy::new(Vec::new()));
        let error = policy
            .resolver()
            .resolve("localhost".parse().unwrap())
            .await
            .err()
            .expect("localhost resolves only to loopback addresses");
        let error = error.to_string();
        assert!(
            error.starts_with("localhost: 127.0.0.1 is a loopback")
                || error.starts_with("localhost: ::1 is a loopback"),
            "{error}"
        );
        let allowed = Arc::new(EgressPolicy::new(vec!["127.0.0.0/8".parse().unwrap()]));
        let kept: Vec<SocketAddr> = allowed
            .resolver()
            .resolve("localhost".parse().unwrap())
            .await
            .unwrap()
            .collect();
        assert!(!kept.is_empty());
        assert!(kept.iter().all(|a| a.ip() == ip("127.0.0.1")), "{kept:?}");
    }
}
