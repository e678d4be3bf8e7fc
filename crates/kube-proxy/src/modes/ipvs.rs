//! `--proxy-mode ipvs`: [`IpvsBackend`] where the host probe found IPVS working (the
//! kernel's IPVS over netlink, the configured scheduler, the `ipset` tool; see
//! [`super::host`]). Where it did not, [`Host::mode_to_run`] logs upstream's "Can't use the
//! IPVS proxier" and iptables mode runs instead.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context as _;
use kp_config::KubeProxyConfiguration;
use kp_core::model::IpFamily;
use kp_dataplane::exec::ExecRunner;
use kp_dataplane::ipvs::{ExecIpset, IpvsBackend, IpvsBackendConfig, RtLinks};
use kp_dataplane::sysctls::{self, FsSysctl};
use kp_ipvs::{NetlinkIpvs, Scheduler, Timeouts};
use kp_rules::iptables::{NodePortAddresses, RenderConfig};
use kp_rules::ipvs::IpvsConfig;

use super::host::Host;
use super::nftables::RemovesNftablesLeftovers;
use super::{Input, Mode, NodeAddressing};

/// The real backend.
pub type RealIpvsBackend = IpvsBackend<NetlinkIpvs>;

/// ipvs mode.
#[derive(Debug)]
pub struct Ipvs;

impl Mode for Ipvs {
    type Backend = RemovesNftablesLeftovers<RealIpvsBackend>;

    /// Its iptables rules, where the node's iptables writes to nf_tables.
    fn watch(host: &Host) -> Option<kp_dataplane::watch::Owned> {
        super::iptables_on_nf_tables(host).then_some(kp_dataplane::watch::Owned::IptablesChains)
    }

    /// IPVS, `kube-ipvs0` and the ipsets send no notifications.
    const CANARIES_WHILE_WATCHED: bool = true;

    /// Applies upstream's conntrack sysctls, then builds the backend (which makes IPVS's own
    /// sysctls at its first sync). Only where the host probe found IPVS working.
    fn build(input: Input<'_>) -> anyhow::Result<Self::Backend> {
        anyhow::ensure!(
            input.host.has_ipvs(),
            "ipvs mode without IPVS (a bug: the mode falls back to iptables before it is built)"
        );
        let scheduler = scheduler(input.config)?;
        let (sysctl, render) = super::start_kernel_mode(&input)?;
        let backend = backend(input.config, input.node, input.host, sysctl, &render)?
            .with_iptables_watched(Self::watch(input.host).is_some());
        tracing::info!(%scheduler, "Using ipvs Proxier");
        RemovesNftablesLeftovers::new(backend, input.host)
    }
}

/// `ipvs.scheduler`.
fn scheduler(config: &KubeProxyConfiguration) -> anyhow::Result<Scheduler> {
    config
        .ipvs
        .scheduler
        .parse()
        .context("invalid ipvs.scheduler")
}

fn seconds(d: Duration) -> u32 {
    u32::try_from(d.as_secs()).unwrap_or(u32::MAX)
}

/// The ipvs backend for `config` on `host`, without touching the kernel. `node` is resolved
/// once at start-up (empty for `--cleanup`, whose removal needs no addresses); `render` is
/// the renderer configuration from it.
fn backend(
    config: &KubeProxyConfiguration,
    node: &NodeAddressing,
    host: &Host,
    sysctl: FsSysctl,
    render: &RenderConfig,
) -> anyhow::Result<RealIpvsBackend> {
    let scheduler = scheduler(config)?;
    let ipvs = NetlinkIpvs::open().context("opening IPVS")?;
    let every = host.node_addresses();
    let node_ips = node_port_ips(&node.node_ports, || every.clone());
    let (masquerade_bit, masquerade_all) = config.masquerade();
    let backend_config = IpvsBackendConfig {
        families: host.families.clone(),
        plan: IpvsConfig {
            scheduler,
            node_ips,
            detected_node_ips: node.node_ips.clone(),
            local_detector: render.local_detector.clone(),
            masquerade_all,
            masquerade_bit: u8::try_from(masquerade_bit).context("masqueradeBit out of range")?,
            drop_invalid: !sysctls::tcp_be_liberal(&sysctl),
            random_fully: true,
        },
        timeouts: Timeouts {
            tcp: seconds(config.ipvs.tcp_timeout),
            tcp_fin: seconds(config.ipvs.tcp_fin_timeout),
            udp: seconds(config.ipvs.udp_timeout),
        },
        strict_arp: config.ipvs.strict_arp,
        exclude_cidrs: config.ipvs_exclude_cidrs(),
        node_addresses: every,
    };
    Ok(IpvsBackend::with_parts(
        backend_config,
        ipvs,
        RtLinks::new(),
        ExecRunner::new(host.iptables.clone()),
        ExecIpset,
        Box::new(sysctl),
    ))
}

/// An ipvs backend only for removing ipvs mode's state (`--cleanup`): `None` where the host
/// has no IPVS, so there is none.
pub(crate) fn leftovers(
    config: &KubeProxyConfiguration,
    host: &Host,
) -> anyhow::Result<Option<RealIpvsBackend>> {
    match &host.ipvs {
        Some(Ok(())) => {
            let node = NodeAddressing::default();
            let render = super::render_config(config, None, &node)?;
            backend(config, &node, host, FsSysctl::host(), &render).map(Some)
        }
        Some(Err(why)) => {
            tracing::info!(reason = %why, "no IPVS here: nothing of ipvs mode to clean up");
            Ok(None)
        }
        None => Ok(None),
    }
}

/// Where IPVS NodePort virtual servers go: per family, the addresses nodePortAddresses
/// allows, or every node address (`all`, read only when a family is unrestricted) as
/// upstream, which creates one virtual server per node address.
pub(crate) fn node_port_ips(
    node_ports: &NodePortAddresses,
    all: impl FnOnce() -> Vec<IpAddr>,
) -> Vec<IpAddr> {
    let mut all = Some(all);
    let mut every = Vec::new();
    let mut ips = Vec::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        match node_ports.for_family(family) {
            NodePortAddresses::Ips(mine) => ips.extend(mine),
            NodePortAddresses::All => {
                if let Some(read) = all.take() {
                    every = read();
                }
                ips.extend(every.iter().filter(|ip| IpFamily::of(ip) == family));
            }
        }
    }
    ips
}
