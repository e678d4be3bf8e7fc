//! [`LocalhostNodePorts`]: TCP NodePorts on `127.0.0.1` and `::1` in nftables mode
//! (`KubeProxyNFTablesLocalhostNodePorts`, KEP-6032).
//!
//! The kernel cannot DNAT a connection to a loopback address towards a pod without
//! `route_localnet` (IPv4 only, and a security hole), so nftables mode never matches loopback
//! in its NodePort rules. Instead the relay listens on the loopback address itself, one
//! socket per TCP NodePort and family, and copies each connection to one of the service's
//! endpoints for external traffic (`externalTrafficPolicy: Local`: node-local ones only). A
//! listener exists only while the service port has such an endpoint; without one the port
//! refuses connections. UDP and SCTP NodePorts get no listener (upstream's neither).
//!
//! As the other frontends of the relay: round robin, ClientIP affinity (every client here
//! is the loopback address, so a pin holds for all of them, as upstream), retries on the next
//! endpoint, the per-service connection cap; removing a listener leaves established
//! connections to finish.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use kp_core::model::{IpFamily, ServicePortName};
use kp_core::report::ErrorChain as _;
use kp_core::tracker::ProxyState;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::{debug, error};

use crate::relay::{Owner, Relay};
use crate::shared::service_port_label;
use crate::{RelayConfig, RelayMetrics};
use kp_rules::plan::localhost_listener_endpoints;

/// One listener: a service port's NodePort on one loopback address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Listener {
    /// The service port.
    pub port: ServicePortName,
    /// The loopback address and NodePort it listens on.
    pub addr: SocketAddr,
}

impl fmt::Display for Listener {
    /// `ns/name:port/tcp/127.0.0.1:30080`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", service_port_label(&self.port), self.addr)
    }
}

/// The `ip_family` label (`IPv4`, `IPv6`), as upstream's.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FamilyLabel {
    /// `IPv4` or `IPv6`.
    pub ip_family: &'static str,
}

/// KEP-6032's listener metrics, under upstream's names.
#[derive(Clone, Debug, Default)]
pub struct LocalhostMetrics {
    /// `kubeproxy_nftables_localhost_nodeport_listeners{ip_family}`: listeners open.
    pub listeners: Family<FamilyLabel, Gauge>,
    /// `kubeproxy_nftables_localhost_nodeport_listener_creation_failures_total{ip_family}`:
    /// listeners that could not be opened (the port taken by another program), counted at
    /// each sync that tries again, as upstream.
    pub creation_failures: Family<FamilyLabel, Counter>,
}

impl LocalhostMetrics {
    /// Create the metrics and register them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "kubeproxy_nftables_localhost_nodeport_listeners",
            "Number of localhost NodePort userspace proxy listeners",
            m.listeners.clone(),
        );
        registry.register(
            "kubeproxy_nftables_localhost_nodeport_listener_creation_failures",
            "Number of localhost NodePort userspace proxy listener creation failures",
            m.creation_failures.clone(),
        );
        m
    }

    fn label(family: IpFamily) -> FamilyLabel {
        FamilyLabel {
            ip_family: family.api_name(),
        }
    }
}

/// What one listener should relay to.
#[derive(Debug)]
struct Wanted {
    endpoints: Vec<SocketAddr>,
    affinity: Option<Duration>,
}

/// The localhost NodePort listeners of the loopback addresses given. Must be used inside a
/// tokio runtime (the relay spawns its tasks there).
#[derive(Debug)]
pub struct LocalhostNodePorts {
    relay: Relay<Listener>,
    addresses: Vec<IpAddr>,
    metrics: LocalhostMetrics,
}

impl LocalhostNodePorts {
    /// Listeners on `addresses` (`127.0.0.1`, `::1`: the families whose
    /// `nodePortAddresses` name loopback explicitly).
    pub fn new(
        config: RelayConfig,
        relay_metrics: RelayMetrics,
        metrics: LocalhostMetrics,
        addresses: Vec<IpAddr>,
    ) -> Self {
        // A series per family from the start, so a family without listeners shows 0.
        for ip in &addresses {
            let label = LocalhostMetrics::label(IpFamily::of(ip));
            metrics.listeners.get_or_create(&label).set(0);
        }
        Self {
            relay: Relay::new(config, relay_metrics),
            addresses,
            metrics,
        }
    }

    /// The relay (tests, diagnostics).
    pub fn relay(&self) -> &Relay<Listener> {
        &self.relay
    }

    /// Makes the listeners match `state`: opens those of new TCP NodePorts with endpoints,
    /// updates the endpoints of the others, closes those gone. A listener that cannot be
    /// opened is logged and counted and tried again next sync; the rest go on. Returns the
    /// number open.
    pub fn sync(&mut self, state: &ProxyState) -> usize {
        let wanted = self.wanted(state);
        let stale: Vec<Listener> = self
            .relay
            .keys()
            .filter(|l| !wanted.contains_key(*l))
            .cloned()
            .collect();
        for listener in &stale {
            self.relay.remove(listener);
            debug!(%listener, "closed localhost NodePort listener");
        }
        for (listener, want) in wanted {
            if self.relay.local_addr(&listener).is_none() && !self.open(&listener) {
                continue;
            }
            self.relay.update(&listener, want.endpoints, want.affinity);
        }
        self.relay.forget_stale_pins();
        self.count()
    }

    /// Every listener `state` wants, with its endpoints
    /// ([`localhost_listener_endpoints`] decides).
    fn wanted(&self, state: &ProxyState) -> BTreeMap<Listener, Wanted> {
        let mut wanted = BTreeMap::new();
        for svc in state.services.values() {
            let Some(node_port) = svc.node_port else {
                continue;
            };
            let affinity = svc.session_affinity.map(|a| a.timeout);
            for &ip in &self.addresses {
                let endpoints = localhost_listener_endpoints(svc, state, IpFamily::of(&ip));
                if endpoints.is_empty() {
                    continue;
                }
                let listener = Listener {
                    port: svc.name.clone(),
                    addr: SocketAddr::new(ip, node_port),
                };
                wanted.insert(
                    listener,
                    Wanted {
                        endpoints,
                        affinity,
                    },
                );
            }
        }
        wanted
    }

    /// Opens `listener`; false (logged, counted) when its socket cannot be bound.
    fn open(&mut self, listener: &Listener) -> bool {
        let service = listener.port.service.to_string();
        let service_port = service_port_label(&listener.port);
        let owner = Owner {
            service: &service,
            service_port: &service_port,
        };
        let opened = crate::bind::tcp_listener(listener.addr)
            .and_then(|socket| self.relay.add_tcp(listener.clone(), owner, socket));
        match opened {
            Ok(_) => {
                debug!(%listener, "opened localhost NodePort listener");
                true
            }
            Err(source) => {
                let family = IpFamily::of(&listener.addr.ip());
                self.metrics
                    .creation_failures
                    .get_or_create(&LocalhostMetrics::label(family))
                    .inc();
                error!(%listener, error = %source.chain(), "Failed to create localhost nodeport proxy");
                false
            }
        }
    }

    /// Sets the listener gauge of each family and returns the total.
    fn count(&self) -> usize {
        let mut total = 0;
        for ip in &self.addresses {
            let family = IpFamily::of(ip);
            let open = self
                .relay
                .keys()
                .filter(|l| IpFamily::of(&l.addr.ip()) == family)
                .count();
            total += open;
            self.metrics
                .listeners
                .get_or_create(&LocalhostMetrics::label(family))
                .set(i64::try_from(open).unwrap_or(i64::MAX));
        }
        total
    }
}
