//! nftables mode's answer for a loopback destination on a NodePort (KEP-6032): the table never
//! DNATs loopback, so such a packet is served by the userspace listener, rejected by the table,
//! refused by the kernel or not touched at all, as [`RenderConfig::nftables_localhost_rejects`]
//! and the state say. The listener's endpoints are the listeners' own answer
//! ([`localhost_listener_endpoints`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use kp_core::model::IpFamily;
use kp_core::tracker::ProxyState;
use serde::Serialize;

use super::Destination;
use crate::config::RenderConfig;
use crate::nftables::localhost_reject_counter;
use crate::plan::localhost_listener_endpoints;

/// What happens to a packet to a loopback NodePort.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum LocalhostVerdict {
    /// The userspace listener on the address accepts it and relays to one of `endpoints`.
    Listener {
        /// What the listener relays to.
        endpoints: Vec<SocketAddr>,
    },
    /// The port has no listener on this address (no endpoint for external traffic, or an
    /// address other than `127.0.0.1` / `::1`): the kernel refuses it unless another program
    /// listens there.
    NoListener,
    /// The table rejects it (port unreachable) and counts it in `counter`.
    Rejected {
        /// The named counter.
        counter: &'static str,
    },
    /// Neither a listener nor a reject rule (the gate off): the table does not match
    /// loopback; whatever listens there gets it.
    Untouched,
}

/// One service port whose NodePort a loopback destination names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LocalhostNodePort {
    /// `namespace/name:port`.
    pub service_port: String,
    /// The NodePort.
    pub node_port: u16,
    /// The verdict.
    #[serde(flatten)]
    pub verdict: LocalhostVerdict,
}

impl LocalhostNodePort {
    /// One line saying what happens.
    pub fn describe(&self) -> String {
        let port = format!("{} (NodePort {})", self.service_port, self.node_port);
        match &self.verdict {
            LocalhostVerdict::Listener { endpoints } => format!(
                "{port}: served by the localhost NodePort listener, relayed to one of {} endpoint(s)",
                endpoints.len()
            ),
            LocalhostVerdict::NoListener => format!(
                "{port}: no localhost listener on this address; refused unless another program listens"
            ),
            LocalhostVerdict::Rejected { counter } => {
                format!("{port}: rejected by the nftables table (counted in {counter})")
            }
            LocalhostVerdict::Untouched => format!(
                "{port}: not handled by nftables mode (no listener, no reject rule); reaches whatever listens on the host"
            ),
        }
    }
}

/// nftables mode's answer for `dest` when it is a loopback address: one entry per service
/// port of the protocol whose NodePort is `dest`'s port (every such port when no port is
/// given). Empty for other destinations.
pub fn explain_localhost(
    state: &ProxyState,
    config: &RenderConfig,
    dest: &Destination,
) -> Vec<LocalhostNodePort> {
    if !dest.ip.is_loopback() {
        return Vec::new();
    }
    let family = IpFamily::of(&dest.ip);
    let rejects = &config.nftables_localhost_rejects;
    let listener_addr = match family {
        IpFamily::V4 => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpFamily::V6 => IpAddr::V6(Ipv6Addr::LOCALHOST),
    };
    let mut out = Vec::new();
    for svc in state.services.values() {
        let Some(node_port) = svc.node_port else {
            continue;
        };
        let of_family = svc.cluster_ips.iter().any(|c| IpFamily::of(c) == family);
        if svc.name.protocol != dest.protocol
            || dest.port.is_some_and(|p| p != node_port)
            || !of_family
        {
            continue;
        }
        let listens = rejects.enabled
            && rejects.served.contains(&family)
            && svc.name.protocol == kp_core::model::Protocol::Tcp;
        let verdict = if rejects.protocols(family).contains(&svc.name.protocol) {
            LocalhostVerdict::Rejected {
                counter: localhost_reject_counter(svc.name.protocol),
            }
        } else if listens {
            let endpoints = localhost_listener_endpoints(svc, state, family);
            if endpoints.is_empty() || dest.ip != listener_addr {
                LocalhostVerdict::NoListener
            } else {
                LocalhostVerdict::Listener { endpoints }
            }
        } else {
            LocalhostVerdict::Untouched
        };
        out.push(LocalhostNodePort {
            service_port: svc.name.to_string(),
            node_port,
            verdict,
        });
    }
    out.sort_by(|a, b| a.service_port.cmp(&b.service_port));
    out
}
