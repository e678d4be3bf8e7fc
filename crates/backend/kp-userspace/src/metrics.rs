//! The relay's metrics, in kp-core's style: families registered once, clones share series.
//! prometheus-client appends `_total` to counters itself.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::pins::{AffinityTables, PinCollector};

/// Labels of the per-service counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabel {
    /// The service (`namespace/name` in userspace mode), whose cap bit.
    pub service: String,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
}

/// Labels of `kube_proxy_rs_userspace_unserved_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `no_endpoints` or `all_endpoints_failed`.
    pub reason: &'static str,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
}

/// The relay's metrics. `Default` gives unregistered ones (tests).
#[derive(Clone, Debug, Default)]
pub struct RelayMetrics {
    /// `kube_proxy_rs_userspace_open_connections`: TCP connections being relayed.
    pub open_connections: Gauge,
    /// `kube_proxy_rs_userspace_udp_sessions`: live UDP sessions.
    pub udp_sessions: Gauge,
    /// `kube_proxy_rs_userspace_limit_rejections_total{service,protocol}`: connections
    /// reset or datagrams dropped because the service's cap was reached (one budget per
    /// service over all its ports, families and scopes). Series appear only for services
    /// whose cap bit.
    pub limit_rejections: Family<ServiceLabel, Counter>,
    /// `kube_proxy_rs_userspace_connect_failures_total`: backend connect attempts refused or
    /// timed out (each followed by a try on the next endpoint, if any).
    pub connect_failures: Counter,
    /// `kube_proxy_rs_userspace_unserved_total{reason,protocol}`: clients given up on.
    pub unserved: Family<ReasonLabel, Counter>,
    /// The service ports' ClientIP affinity tables, encoded at each scrape as
    /// `kube_proxy_rs_userspace_affinity_clients{service_port,endpoint}` (live pins).
    pub affinity: AffinityTables,
}

impl RelayMetrics {
    /// Create the metrics and register them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "kube_proxy_rs_userspace_open_connections",
            "TCP connections the userspace relay is copying",
            m.open_connections.clone(),
        );
        registry.register(
            "kube_proxy_rs_userspace_udp_sessions",
            "Live UDP sessions of the userspace relay",
            m.udp_sessions.clone(),
        );
        registry.register(
            "kube_proxy_rs_userspace_limit_rejections",
            "Connections reset or datagrams dropped because a service's cap was reached",
            m.limit_rejections.clone(),
        );
        registry.register(
            "kube_proxy_rs_userspace_connect_failures",
            "Backend connect attempts that were refused or timed out",
            m.connect_failures.clone(),
        );
        registry.register(
            "kube_proxy_rs_userspace_unserved",
            "Clients the relay gave up on, by reason",
            m.unserved.clone(),
        );
        registry.register_collector(Box::new(PinCollector(m.affinity.clone())));
        m
    }

    pub(crate) fn limit_hit(&self, service: &str, protocol: &'static str) {
        self.limit_rejections
            .get_or_create(&ServiceLabel {
                service: service.to_owned(),
                protocol,
            })
            .inc();
    }

    pub(crate) fn unserved(&self, reason: &'static str, protocol: &'static str) {
        self.unserved
            .get_or_create(&ReasonLabel { reason, protocol })
            .inc();
    }
}
