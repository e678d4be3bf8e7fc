//! The source address of the relay's own connections to endpoints.
//!
//! Normally the kernel picks it from the route to the endpoint, as it would for a
//! masqueraded flow. On a node whose only address has link scope (a link-local `/30` set up
//! with `scope link`) and whose pods hang off address-less veths, the kernel finds no
//! address it may use for the pod's route and sends from 0.0.0.0, so the endpoint never
//! answers. Then the relay uses the address the client reached it on (the node address the
//! capture DNATs to), which the endpoint routes back to the node.
//!
//! Asking the kernel costs a throwaway UDP socket, so each endpoint's answer is kept for
//! [`DEFAULT_SOURCE_CHECK_TTL`].

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How long the kernel's answer for one endpoint is trusted: routes and addresses change
/// rarely, and a stale "needs a source" only means the relay binds the address the client
/// reached it on, which also works.
pub const DEFAULT_SOURCE_CHECK_TTL: Duration = Duration::from_secs(10);

/// A port for the route probe: connecting a UDP socket sends nothing.
const PROBE_PORT: u16 = 9;

/// Per endpoint address: whether the kernel has no source for it, and when that was asked.
#[derive(Debug, Default)]
pub(crate) struct SourceCache {
    checked: Mutex<HashMap<IpAddr, (bool, Instant)>>,
}

impl SourceCache {
    /// The address to bind a connection to `endpoint` to: `None` (let the kernel pick) unless
    /// the kernel has no source for it and `local` (where the client reached the relay) is a
    /// usable one.
    pub(crate) fn source_for(&self, endpoint: IpAddr, local: IpAddr) -> Option<IpAddr> {
        if local.is_unspecified() || local.is_loopback() || local.is_ipv4() != endpoint.is_ipv4() {
            return None;
        }
        let now = Instant::now();
        let mut checked = self.checked.lock().unwrap_or_else(PoisonError::into_inner);
        let needs = match checked.get(&endpoint) {
            Some(&(needs, at)) if now.saturating_duration_since(at) < DEFAULT_SOURCE_CHECK_TTL => {
                needs
            }
            _ => {
                let needs = kernel_has_no_source(endpoint);
                checked.insert(endpoint, (needs, now));
                needs
            }
        };
        needs.then_some(local)
    }

    /// Forgets endpoints not in `endpoints`.
    pub(crate) fn retain(&self, endpoints: &[SocketAddr]) {
        self.checked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|ip, _| endpoints.iter().any(|e| e.ip() == *ip));
    }
}

/// Whether the route to `endpoint` gives no source address (a connected UDP socket's local
/// address stays unspecified). A failed probe says "no": the connection attempt itself
/// will report the problem.
fn kernel_has_no_source(endpoint: IpAddr) -> bool {
    let any = match endpoint {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let Ok(probe) = UdpSocket::bind(SocketAddr::new(any, 0)) else {
        return false;
    };
    if probe
        .connect(SocketAddr::new(endpoint, PROBE_PORT))
        .is_err()
    {
        return false;
    }
    probe.local_addr().is_ok_and(|a| a.ip().is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_wildcard_frontends_never_pick_a_source() {
        let cache = SourceCache::default();
        let endpoint = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(
            cache.source_for(endpoint, IpAddr::from([127, 0, 0, 1])),
            None
        );
        assert_eq!(cache.source_for(endpoint, IpAddr::from([0, 0, 0, 0])), None);
        // The kernel has a source for loopback: nothing is bound.
        assert!(!kernel_has_no_source(endpoint));
    }
}
