//! Upstream's ipsets for ipvs mode, as data, and the `ipset restore` input that moves the
//! kernel's sets to the desired ones by adding and deleting only the entries that differ.
//!
//! Entries are built from typed addresses, protocols and ports only, never from API strings,
//! so nothing an object says can reach the restore input except through those types.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use kp_core::model::IpFamily;

/// ipset refuses longer set names (`IPSET_MAXNAMELEN` is 32 with the NUL).
pub const MAX_SET_NAME: usize = 31;

/// What one kube-proxy set holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKind {
    /// `KUBE-LOOP-BACK`: local endpoint, port and the same endpoint as source (hairpin).
    LoopBack,
    /// `KUBE-CLUSTER-IP`: every ClusterIP and port.
    ClusterIp,
    /// `KUBE-EXTERNAL-IP`: every externalIP and port.
    ExternalIp,
    /// `KUBE-EXTERNAL-IP-LOCAL`: externalIPs of externalTrafficPolicy Local services.
    ExternalIpLocal,
    /// `KUBE-LOAD-BALANCER`: every load-balancer IP and port.
    LoadBalancer,
    /// `KUBE-LOAD-BALANCER-LOCAL`: load-balancer IPs of eTP Local services.
    LoadBalancerLocal,
    /// `KUBE-LOAD-BALANCER-FW`: load-balancer IPs restricted by source ranges.
    LoadBalancerFw,
    /// `KUBE-LOAD-BALANCER-SOURCE-CIDR`: allowed (LB IP, port, source range).
    LoadBalancerSourceCidr,
    /// `KUBE-LOAD-BALANCER-SOURCE-IP`: allowed (LB IP, port, source IP).
    LoadBalancerSourceIp,
    /// `KUBE-NODE-PORT-TCP`: TCP NodePorts.
    NodePortTcp,
    /// `KUBE-NODE-PORT-LOCAL-TCP`: TCP NodePorts of eTP Local services.
    NodePortLocalTcp,
    /// `KUBE-NODE-PORT-UDP`: UDP NodePorts.
    NodePortUdp,
    /// `KUBE-NODE-PORT-LOCAL-UDP`: UDP NodePorts of eTP Local services.
    NodePortLocalUdp,
    /// `KUBE-NODE-PORT-SCTP-HASH`: SCTP NodePorts, keyed by node IP.
    NodePortSctp,
    /// `KUBE-NODE-PORT-LOCAL-SCTP-HASH`: SCTP NodePorts of eTP Local services.
    NodePortLocalSctp,
    /// `KUBE-HEALTH-CHECK-NODE-PORT`: health-check node ports to accept.
    HealthCheckNodePort,
    /// `KUBE-IPVS-IPS`: every address on kube-ipvs0.
    IpvsIps,
}

impl SetKind {
    /// Every set, in upstream's order.
    pub const ALL: [Self; 17] = [
        Self::LoopBack,
        Self::ClusterIp,
        Self::ExternalIp,
        Self::ExternalIpLocal,
        Self::LoadBalancer,
        Self::LoadBalancerLocal,
        Self::LoadBalancerFw,
        Self::LoadBalancerSourceCidr,
        Self::LoadBalancerSourceIp,
        Self::NodePortTcp,
        Self::NodePortLocalTcp,
        Self::NodePortUdp,
        Self::NodePortLocalUdp,
        Self::NodePortSctp,
        Self::NodePortLocalSctp,
        Self::HealthCheckNodePort,
        Self::IpvsIps,
    ];

    /// The IPv4 name (IPv6 sets insert `6-` after `KUBE-`).
    fn base_name(self) -> &'static str {
        match self {
            Self::LoopBack => "LOOP-BACK",
            Self::ClusterIp => "CLUSTER-IP",
            Self::ExternalIp => "EXTERNAL-IP",
            Self::ExternalIpLocal => "EXTERNAL-IP-LOCAL",
            Self::LoadBalancer => "LOAD-BALANCER",
            Self::LoadBalancerLocal => "LOAD-BALANCER-LOCAL",
            Self::LoadBalancerFw => "LOAD-BALANCER-FW",
            Self::LoadBalancerSourceCidr => "LOAD-BALANCER-SOURCE-CIDR",
            Self::LoadBalancerSourceIp => "LOAD-BALANCER-SOURCE-IP",
            Self::NodePortTcp => "NODE-PORT-TCP",
            Self::NodePortLocalTcp => "NODE-PORT-LOCAL-TCP",
            Self::NodePortUdp => "NODE-PORT-UDP",
            Self::NodePortLocalUdp => "NODE-PORT-LOCAL-UDP",
            Self::NodePortSctp => "NODE-PORT-SCTP-HASH",
            Self::NodePortLocalSctp => "NODE-PORT-LOCAL-SCTP-HASH",
            Self::HealthCheckNodePort => "HEALTH-CHECK-NODE-PORT",
            Self::IpvsIps => "IPVS-IPS",
        }
    }

    /// The set's name for `family`: `KUBE-CLUSTER-IP`, `KUBE-6-CLUSTER-IP`, cut to ipset's
    /// limit of [`MAX_SET_NAME`] characters (two IPv6 names are longer and lose their last
    /// letter: `KUBE-6-LOAD-BALANCER-SOURCE-CID`, `KUBE-6-NODE-PORT-LOCAL-SCTP-HAS`).
    pub fn name(self, family: IpFamily) -> String {
        let mut name = match family {
            IpFamily::V4 => format!("KUBE-{}", self.base_name()),
            IpFamily::V6 => format!("KUBE-6-{}", self.base_name()),
        };
        name.truncate(MAX_SET_NAME);
        name
    }

    /// The ipset type.
    pub fn set_type(self) -> &'static str {
        match self {
            Self::LoopBack | Self::LoadBalancerSourceIp => "hash:ip,port,ip",
            Self::LoadBalancerSourceCidr => "hash:ip,port,net",
            Self::NodePortTcp
            | Self::NodePortLocalTcp
            | Self::NodePortUdp
            | Self::NodePortLocalUdp
            | Self::HealthCheckNodePort => "bitmap:port",
            Self::IpvsIps => "hash:ip",
            _ => "hash:ip,port",
        }
    }

    /// The `create` options after the type.
    fn create_options(self, family: IpFamily) -> String {
        if self.set_type() == "bitmap:port" {
            return "range 0-65535".to_owned();
        }
        let family = match family {
            IpFamily::V4 => "inet",
            IpFamily::V6 => "inet6",
        };
        format!("family {family} hashsize 1024 maxelem 65536")
    }
}

/// Set contents: kind to entries in ipset's own syntax (`10.96.0.1,tcp:80`).
pub type SetEntries = BTreeMap<SetKind, BTreeSet<String>>;

/// Every set of `family`, all empty.
pub fn empty_sets() -> SetEntries {
    SetKind::ALL.iter().map(|k| (*k, BTreeSet::new())).collect()
}

/// The `ipset restore` input that turns `current` (parsed from `ipset save`; sets absent there
/// are created) into `desired`: `create -exist` for every set, then only the `del`s and
/// `add`s that differ. Empty when nothing changes and every set exists.
pub fn restore_input(family: IpFamily, desired: &SetEntries, current: &SavedSets) -> String {
    let mut out = String::new();
    let none = BTreeSet::new();
    for kind in SetKind::ALL {
        let name = kind.name(family);
        let want = desired.get(&kind).unwrap_or(&none);
        let have = current.get(&name);
        if have.is_none() {
            let _ = writeln!(
                out,
                "create {name} {} {} -exist",
                kind.set_type(),
                kind.create_options(family)
            );
        }
        let have = have.unwrap_or(&none);
        for gone in have.difference(want) {
            let _ = writeln!(out, "del {name} {gone} -exist");
        }
        for new in want.difference(have) {
            let _ = writeln!(out, "add {name} {new} -exist");
        }
    }
    out
}

/// The `ipset restore` input that deletes `gone` from and adds `new` to `family`'s sets, which
/// exist already: a partial sync's change, written without reading the sets back.
pub fn change_input(family: IpFamily, gone: &SetEntries, new: &SetEntries) -> String {
    let mut out = String::new();
    for kind in SetKind::ALL {
        let name = kind.name(family);
        for entry in gone.get(&kind).into_iter().flatten() {
            let _ = writeln!(out, "del {name} {entry} -exist");
        }
        for entry in new.get(&kind).into_iter().flatten() {
            let _ = writeln!(out, "add {name} {entry} -exist");
        }
    }
    out
}

/// Sets as read back with `ipset save`: name to entries.
pub type SavedSets = BTreeMap<String, BTreeSet<String>>;

/// Parses `ipset save` output, keeping kube-proxy's sets (`KUBE-` names) only.
pub fn parse_save(text: &str) -> SavedSets {
    let mut sets = SavedSets::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("create"), Some(name), _) if name.starts_with("KUBE-") => {
                sets.entry(name.to_owned()).or_default();
            }
            (Some("add"), Some(name), Some(entry)) if name.starts_with("KUBE-") => {
                sets.entry(name.to_owned())
                    .or_default()
                    .insert(entry.to_owned());
            }
            _ => {}
        }
    }
    sets
}

/// `ipset restore` input destroying every kube-proxy set of both families that `saved` lists
/// (`--cleanup`; the iptables rules that use them must be gone first).
pub fn destroy_input(saved: &SavedSets) -> String {
    let mut out = String::new();
    for kind in SetKind::ALL {
        for family in [IpFamily::V4, IpFamily::V6] {
            let name = kind.name(family);
            if saved.contains_key(&name) {
                let _ = writeln!(out, "flush {name}\ndestroy {name}");
            }
        }
    }
    out
}
