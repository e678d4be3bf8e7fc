//! IPVS objects as kube-proxy thinks of them: virtual servers keyed by (address, protocol,
//! port), real servers in masquerade mode, schedulers and the global timeouts.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// Transport protocols kube-proxy programs (IPPROTO_* numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    /// TCP (6).
    Tcp,
    /// UDP (17).
    Udp,
    /// SCTP (132).
    Sctp,
}

impl Protocol {
    /// The IP protocol number.
    pub fn number(self) -> u16 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
        }
    }

    /// The protocol with IP protocol number `n`, if kube-proxy knows it.
    pub fn from_number(n: u16) -> Option<Self> {
        match n {
            6 => Some(Self::Tcp),
            17 => Some(Self::Udp),
            132 => Some(Self::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        })
    }
}

/// What identifies a virtual server.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    /// The virtual address (ClusterIP, node IP, external or load-balancer IP).
    pub address: IpAddr,
    /// The transport protocol.
    pub protocol: Protocol,
    /// The virtual port.
    pub port: u16,
}

impl fmt::Display for ServiceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.address {
            IpAddr::V4(a) => write!(f, "{a}:{}/{}", self.port, self.protocol),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{}", self.port, self.protocol),
        }
    }
}

/// The IPVS schedulers kube-proxy accepts (`ipvs.scheduler`; empty means [`Scheduler::Rr`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scheduler {
    /// Round robin.
    #[default]
    Rr,
    /// Weighted round robin.
    Wrr,
    /// Least connections.
    Lc,
    /// Weighted least connections.
    Wlc,
    /// Locality-based least connections.
    Lblc,
    /// Locality-based least connections with replication.
    Lblcr,
    /// Source hashing.
    Sh,
    /// Destination hashing.
    Dh,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
    /// Maglev hashing.
    Mh,
}

impl Scheduler {
    /// Every scheduler, in upstream's documentation order.
    pub const ALL: [Self; 11] = [
        Self::Rr,
        Self::Wrr,
        Self::Lc,
        Self::Wlc,
        Self::Lblc,
        Self::Lblcr,
        Self::Sh,
        Self::Dh,
        Self::Sed,
        Self::Nq,
        Self::Mh,
    ];

    /// The kernel's name for it (module `ip_vs_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Rr => "rr",
            Self::Wrr => "wrr",
            Self::Lc => "lc",
            Self::Wlc => "wlc",
            Self::Lblc => "lblc",
            Self::Lblcr => "lblcr",
            Self::Sh => "sh",
            Self::Dh => "dh",
            Self::Sed => "sed",
            Self::Nq => "nq",
            Self::Mh => "mh",
        }
    }

    /// Scheduler flags upstream sets: Maglev hashes the source port too (`mh-port`), so
    /// flows from one client spread; `mh-fallback` is not set (as upstream).
    pub fn flags(self) -> u32 {
        match self {
            Self::Mh => FLAG_SCHED_MH_PORT,
            _ => 0,
        }
    }
}

impl fmt::Display for Scheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown scheduler name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown IPVS scheduler {0:?} (known: rr, wrr, lc, wlc, lblc, lblcr, sh, dh, sed, nq, mh)")]
pub struct UnknownScheduler(pub String);

impl FromStr for Scheduler {
    type Err = UnknownScheduler;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(Self::Rr);
        }
        Self::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| UnknownScheduler(s.to_owned()))
    }
}

/// `IP_VS_SVC_F_PERSISTENT`: connections from one client go to one real server until the
/// timeout (sessionAffinity ClientIP).
pub const FLAG_PERSISTENT: u32 = 0x0001;
/// `IP_VS_SVC_F_HASHED`: set by the kernel on every listed service; never compared.
pub const FLAG_HASHED: u32 = 0x0002;
/// `IP_VS_SVC_F_SCHED2`, which the mh scheduler reads as "hash the source port too".
pub const FLAG_SCHED_MH_PORT: u32 = 0x0010;

/// A virtual server as kube-proxy programs it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VirtualServer {
    /// Address, protocol and port.
    pub key: ServiceKey,
    /// The scheduler's kernel name (kept as a string: a listed service may use any).
    pub scheduler: String,
    /// `IP_VS_SVC_F_*` flags, without [`FLAG_HASHED`].
    pub flags: u32,
    /// Persistence timeout in seconds (meaningful with [`FLAG_PERSISTENT`]).
    pub timeout: u32,
}

impl VirtualServer {
    /// A virtual server for `key` with `scheduler`; `affinity_timeout` is the
    /// sessionAffinity ClientIP timeout in seconds, if the service has one.
    pub fn new(key: ServiceKey, scheduler: Scheduler, affinity_timeout: Option<u32>) -> Self {
        let mut flags = scheduler.flags();
        if affinity_timeout.is_some() {
            flags |= FLAG_PERSISTENT;
        }
        Self {
            key,
            scheduler: scheduler.name().to_owned(),
            flags,
            timeout: affinity_timeout.unwrap_or(0),
        }
    }
}

/// How IPVS forwards to a real server. kube-proxy uses only masquerading (NAT).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Forward {
    /// `IP_VS_CONN_F_MASQ` (0).
    #[default]
    Masquerade,
    /// `IP_VS_CONN_F_LOCALNODE` (1).
    Local,
    /// `IP_VS_CONN_F_TUNNEL` (2).
    Tunnel,
    /// `IP_VS_CONN_F_DROUTE` (3).
    DirectRoute,
}

impl Forward {
    /// The `IPVS_DEST_ATTR_FWD_METHOD` value.
    pub fn value(self) -> u32 {
        match self {
            Self::Masquerade => 0,
            Self::Local => 1,
            Self::Tunnel => 2,
            Self::DirectRoute => 3,
        }
    }

    /// From the attribute value (masked with `IP_VS_CONN_F_FWD_MASK`).
    pub fn from_value(v: u32) -> Option<Self> {
        match v & 0x7 {
            0 => Some(Self::Masquerade),
            1 => Some(Self::Local),
            2 => Some(Self::Tunnel),
            3 => Some(Self::DirectRoute),
            _ => None,
        }
    }
}

/// A real server (endpoint) of a virtual server.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RealServer {
    /// The endpoint's address.
    pub address: IpAddr,
    /// The endpoint's port.
    pub port: u16,
    /// Scheduling weight: 1 for serving endpoints, 0 for terminating ones (they keep their
    /// connections but get no new ones).
    pub weight: u32,
    /// Forwarding method.
    pub forward: Forward,
}

impl RealServer {
    /// A masquerading real server.
    pub fn new(address: IpAddr, port: u16, weight: u32) -> Self {
        Self {
            address,
            port,
            weight,
            forward: Forward::Masquerade,
        }
    }
}

/// A real server as listed by the kernel, with its connection counters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedRealServer {
    /// The programmed part.
    pub server: RealServer,
    /// Established connections.
    pub active_connections: u32,
    /// Other connections (closing, UDP).
    pub inactive_connections: u32,
}

/// IPVS connection timeouts in seconds (`ipvsadm --set tcp tcpfin udp`); 0 leaves one alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    /// Idle TCP sessions.
    pub tcp: u32,
    /// TCP after a FIN.
    pub tcp_fin: u32,
    /// UDP.
    pub udp: u32,
}
