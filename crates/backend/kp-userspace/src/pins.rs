//! Every service port's ClientIP affinity table, by service port: the relay's frontends
//! share them, the metrics count their live pins, and `/debug/explain` looks a client up.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::time::Instant;

use crate::balancer::{Affinity, SharedAffinity, lock};

/// The metric counting live pins per service port and endpoint (prometheus-client adds no
/// suffix to gauges).
pub const PINNED_CLIENTS_METRIC: &str = "kube_proxy_rs_userspace_affinity_clients";

/// The tables by service port. A table lives while a frontend of its service port does
/// (each holds it), so a service port that goes away takes its pins with it.
#[derive(Clone, Debug, Default)]
pub struct AffinityTables {
    tables: Arc<Mutex<HashMap<String, Weak<Mutex<Affinity>>>>>,
}

/// What a service port's table says about one client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinLookup {
    /// No frontend of that service port is open, or its affinity is off.
    NoAffinity,
    /// Affinity is on; the client has no live pin (its next connection is balanced).
    Unpinned {
        /// The affinity timeout.
        timeout: Duration,
    },
    /// The client's next connection goes to `endpoint` (if the frontend it reaches has it).
    Pinned {
        /// The endpoint.
        endpoint: SocketAddr,
        /// How long ago the client last reached it.
        idle: Duration,
        /// The affinity timeout.
        timeout: Duration,
    },
}

/// Labels of [`PINNED_CLIENTS_METRIC`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PinLabels {
    /// `namespace/name:port/protocol`.
    service_port: String,
    /// `ip:port`.
    endpoint: String,
}

impl AffinityTables {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Weak<Mutex<Affinity>>>> {
        self.tables.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `service_port`'s live table, or a new one (affinity off).
    pub(crate) fn table(&self, service_port: &str) -> SharedAffinity {
        let mut tables = self.lock();
        if let Some(table) = tables.get(service_port).and_then(Weak::upgrade) {
            return table;
        }
        tables.retain(|_, t| t.strong_count() > 0);
        let table = SharedAffinity::default();
        tables.insert(service_port.to_owned(), Arc::downgrade(&table));
        table
    }

    /// What `service_port`'s table says about `client` now.
    pub fn lookup(&self, service_port: &str, client: IpAddr) -> PinLookup {
        let Some(table) = self.lock().get(service_port).and_then(Weak::upgrade) else {
            return PinLookup::NoAffinity;
        };
        let now = Instant::now();
        let affinity = lock(&table);
        let Some(timeout) = affinity.timeout() else {
            return PinLookup::NoAffinity;
        };
        match affinity.live_pin(client, now) {
            Some(pin) => PinLookup::Pinned {
                endpoint: pin.endpoint,
                idle: now.saturating_duration_since(pin.last_used),
                timeout,
            },
            None => PinLookup::Unpinned { timeout },
        }
    }

    /// Live pins per service port and endpoint, now.
    fn counts(&self) -> BTreeMap<(String, SocketAddr), i64> {
        let tables: Vec<(String, SharedAffinity)> = self
            .lock()
            .iter()
            .filter_map(|(name, t)| Some((name.clone(), t.upgrade()?)))
            .collect();
        let now = Instant::now();
        let mut counts = BTreeMap::new();
        for (name, table) in tables {
            for (_, pin) in lock(&table).live_pins(now) {
                *counts.entry((name.clone(), pin.endpoint)).or_insert(0) += 1;
            }
        }
        counts
    }
}

/// Encodes [`PINNED_CLIENTS_METRIC`] at each scrape from the live pins (so expired pins that
/// are not swept yet never count).
#[derive(Debug)]
pub(crate) struct PinCollector(pub(crate) AffinityTables);

impl Collector for PinCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let counts = self.0.counts();
        let mut family = encoder.encode_descriptor(
            PINNED_CLIENTS_METRIC,
            "Clients pinned by sessionAffinity ClientIP to each endpoint of a service port (live pins, shared by all of the service port's addresses)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for ((service_port, endpoint), count) in counts {
            let labels = PinLabels {
                service_port,
                endpoint: endpoint.to_string(),
            };
            ConstGauge::new(count).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
