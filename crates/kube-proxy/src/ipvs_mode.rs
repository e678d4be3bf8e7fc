//! `--proxy-mode ipvs`: checks that the kernel can run it (IPVS over netlink, the configured
//! scheduler, the `ipset` tool) and builds [`IpvsBackend`]. When it cannot, the caller logs
//! upstream's "Can't use the IPVS proxier" and falls back to iptables mode.

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context as _;
use kp_config::KubeProxyConfiguration;
use kp_core::model::IpFamily;
use kp_dataplane::exec::{ExecRunner, Tools};
use kp_dataplane::iptables::detect_families;
use kp_dataplane::ipvs::{ExecIpset, IpvsBackend, IpvsBackendConfig, RtLinks};
use kp_dataplane::sysctls::{self, FsSysctl};
use kp_ipvs::{Ipvs, NetlinkIpvs, Protocol, Scheduler, ServiceKey, Timeouts, VirtualServer};
use kp_rules::iptables::NodePortAddresses;
use kp_rules::ipvs::{DUMMY_DEVICE, IpvsConfig};

use crate::modes;

/// The real backend.
pub type RealIpvsBackend = IpvsBackend<NetlinkIpvs>;

/// Why ipvs mode cannot run on this node.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(String);

/// Upstream's scheduler probe: a throwaway virtual server in TEST-NET-2, deleted at once.
const PROBE: &str = "198.51.100.0";
const PROBE_PORT: u16 = 20000;

/// Opens IPVS and proves the scheduler works, as upstream does before choosing the mode.
fn probe(scheduler: Scheduler) -> Result<NetlinkIpvs, Unavailable> {
    let mut ipvs = match NetlinkIpvs::open() {
        Ok(ipvs) => ipvs,
        Err(first) => {
            // The module may just not be loaded yet; modprobe is best effort.
            let _ = std::process::Command::new("modprobe")
                .args(["-q", "ip_vs"])
                .status();
            NetlinkIpvs::open().map_err(|_| Unavailable(first.to_string()))?
        }
    };
    let key = ServiceKey {
        address: PROBE
            .parse()
            .map_err(|_| Unavailable("probe address".into()))?,
        protocol: Protocol::Tcp,
        port: PROBE_PORT,
    };
    let vs = VirtualServer::new(key, scheduler, None);
    let _ = ipvs.delete_service(&key);
    ipvs.add_service(&vs).map_err(|e| {
        Unavailable(format!(
            "the IPVS scheduler {scheduler} does not work here: {e}"
        ))
    })?;
    ipvs.delete_service(&key)
        .map_err(|e| Unavailable(format!("cannot remove the IPVS probe: {e}")))?;
    match std::process::Command::new("ipset")
        .arg("--version")
        .output()
    {
        Ok(out) if out.status.success() => Ok(ipvs),
        _ => Err(Unavailable(
            "the ipset tool is missing (Debian: apt-get install ipset)".into(),
        )),
    }
}

fn seconds(d: Duration) -> u32 {
    u32::try_from(d.as_secs()).unwrap_or(u32::MAX)
}

/// Whether ipvs mode can run here, as [`build`] checks it. Loading `ip_vs` (which the probe
/// tries) needs privileges only `--init-only`'s container has, so it probes too.
pub fn available(config: &KubeProxyConfiguration) -> anyhow::Result<Result<(), Unavailable>> {
    let scheduler: Scheduler = config
        .ipvs
        .scheduler
        .parse()
        .context("invalid ipvs.scheduler")?;
    Ok(probe(scheduler).map(drop))
}

/// Builds ipvs mode, or says why it cannot run here (`Ok(Err(..))`, for the fallback).
/// Configuration errors are `Err`. `node` is resolved once at start-up.
pub fn build(
    config: &KubeProxyConfiguration,
    node: &modes::NodeAddressing,
    cleanup_only: bool,
) -> anyhow::Result<Result<RealIpvsBackend, Unavailable>> {
    let scheduler: Scheduler = config
        .ipvs
        .scheduler
        .parse()
        .context("invalid ipvs.scheduler")?;
    let ipvs = match probe(scheduler) {
        Ok(ipvs) => ipvs,
        Err(why) => return Ok(Err(why)),
    };
    let host = FsSysctl::host();
    if !cleanup_only {
        modes::conntrack_sysctls(config, &host);
    }
    let render = modes::render_config(config, None, node)?;
    let every = node_addresses();
    let node_ips = node_port_ips(&node.node_ports, || every.clone());
    let (masquerade_bit, masquerade_all) = config.masquerade();
    let backend_config = IpvsBackendConfig {
        families: detect_families(),
        plan: IpvsConfig {
            scheduler,
            node_ips,
            detected_node_ips: node.node_ips.clone(),
            local_detector: render.local_detector.clone(),
            masquerade_all,
            masquerade_bit: u8::try_from(masquerade_bit).context("masqueradeBit out of range")?,
            drop_invalid: !sysctls::tcp_be_liberal(&host),
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
    let backend = IpvsBackend::with_parts(
        backend_config,
        ipvs,
        RtLinks::new(),
        ExecRunner::new(Tools::host()),
        ExecIpset,
        Box::new(host),
    );
    tracing::info!(%scheduler, "Using ipvs Proxier");
    Ok(Ok(backend))
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

/// The node's addresses for NodePorts when nodePortAddresses is unset: every address except
/// loopback, IPv6 link-local, and kube-ipvs0's own (as upstream).
fn node_addresses() -> Vec<IpAddr> {
    match std::process::Command::new("ip")
        .args(["-o", "addr", "show"])
        .output()
    {
        Ok(out) if out.status.success() => {
            parse_node_addresses(&String::from_utf8_lossy(&out.stdout))
        }
        _ => {
            tracing::warn!("cannot list the node's addresses; NodePorts answer nowhere");
            Vec::new()
        }
    }
}

/// `2: eth0    inet 192.168.1.2/24 ...` lines minus loopback, link-local and kube-ipvs0.
fn parse_node_addresses(text: &str) -> Vec<IpAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let device = words.nth(1)?;
            if device == DUMMY_DEVICE {
                return None;
            }
            words.find(|w| *w == "inet" || *w == "inet6")?;
            let ip: IpAddr = words.next()?.split('/').next()?.parse().ok()?;
            let link_local = matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
            (!ip.is_loopback() && !link_local).then_some(ip)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_leave_out_loopback_link_local_and_kube_ipvs0() {
        let text = "1: lo    inet 127.0.0.1/8 scope host lo\n\
                    2: eth0    inet 192.168.49.2/24 brd 192.168.49.255 scope global eth0\n\
                    2: eth0    inet6 fe80::1/64 scope link\n\
                    2: eth0    inet6 2001:db8::2/64 scope global\n\
                    5: kube-ipvs0    inet 10.96.0.1/32 scope global kube-ipvs0\n";
        let ips: Vec<String> = parse_node_addresses(text)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(ips, ["192.168.49.2", "2001:db8::2"]);
    }
}
