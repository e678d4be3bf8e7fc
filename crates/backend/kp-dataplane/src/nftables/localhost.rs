//! `kubeproxy_nftables_localhost_nodeport_rejected_packets_total{ip_family,protocol}`
//! (upstream 1.37, KEP-6032): the packets the table's localhost NodePort rejects counted,
//! in the kernel, in upstream's named counters
//! ([`localhost_reject_counter`]). Read at
//! each scrape with one netlink dump per family, so the value is the kernel's; a counter the
//! table does not hold (a protocol not rejected in that family) has no series.

use kp_core::model::IpFamily;
use kp_nftnl::counters::read_counters;
use kp_nftnl::{NftSocket, lower};
use kp_rules::nftables::layout::element::PROTOCOLS;
use kp_rules::nftables::localhost_reject_counter;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::registry::Registry;

/// The metric's name (the text exposition adds `_total`).
pub const REJECTED_PACKETS_METRIC: &str = "kubeproxy_nftables_localhost_nodeport_rejected_packets";

/// Upstream's help text.
const HELP: &str = "Number of packets rejected on localhost NodePorts. UDP and SCTP are always rejected; TCP is rejected when the localhost NodePort proxy is not running";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Labels {
    ip_family: &'static str,
    protocol: &'static str,
}

/// Reads the rejected-packet counters of `families`' tables at each scrape.
#[derive(Debug)]
pub struct LocalhostRejectedPackets {
    families: Vec<IpFamily>,
}

impl LocalhostRejectedPackets {
    /// Register the metric for `families`' tables in `registry`.
    pub fn register(registry: &mut Registry, families: Vec<IpFamily>) {
        registry.register_collector(Box::new(Self { families }));
    }

    /// `(family, protocol, packets)` of every rejected-packet counter the tables hold; a
    /// table that cannot be read is left out (logged).
    fn read(&self) -> Vec<(IpFamily, &'static str, u64)> {
        let mut socket = match NftSocket::open() {
            Ok(socket) => socket,
            Err(err) => {
                tracing::debug!(error = %err, "cannot read the localhost NodePort counters");
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for &family in &self.families {
            let counters = match read_counters(&mut socket, lower::family(family)) {
                Ok(counters) => counters,
                Err(err) => {
                    tracing::debug!(?family, error = %err, "cannot read the localhost NodePort counters");
                    continue;
                }
            };
            for proto in PROTOCOLS {
                let name = localhost_reject_counter(proto);
                if let Some(counter) = counters.iter().find(|c| c.name == name) {
                    out.push((family, proto.api_name(), counter.packets));
                }
            }
        }
        out
    }
}

impl Collector for LocalhostRejectedPackets {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let values = self.read();
        let mut family =
            encoder.encode_descriptor(REJECTED_PACKETS_METRIC, HELP, None, MetricType::Counter)?;
        for (ip_family, protocol, packets) in values {
            let labels = Labels {
                ip_family: ip_family.api_name(),
                protocol,
            };
            ConstCounter::new(packets).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
