//! `--socket-lb` (`socketLB.enabled`): the socket load balancer beside nftables mode
//! (docs/socket-lb.md). Its cgroup BPF programs send the node's own sockets' connections
//! to Service addresses straight to an endpoint; its maps are fed after every nftables sync
//! from the same state and the same plan, and a partial sync touches only the changed
//! Services' entries. nftables mode's rules stay fully programmed, so a node where the
//! programs cannot run (said once, with why) loses nothing but the shortcut.

use std::net::SocketAddr;
use std::path::Path;

use kp_config::SocketLbConfiguration;
use kp_core::backend::{SyncKind, SyncRequest};
use kp_core::model::Protocol;
use kp_core::report::ErrorChain as _;
use kp_core::tracker::ProxyState;
use kp_rules::explain::{MatchKind, ServiceMatch, SocketLbPath};
use kp_socklb::{
    AttachError, CgroupError, CgroupTarget, DestroyError, KernelMaps, LoadError, ServiceKey,
    ServiceLb, SocketPrograms,
};

/// Where a node with only cgroup v1 gets a private cgroup2 mount, in the state directory.
const PRIVATE_MOUNT: &str = "cgroup2";

/// Why the programs could not be started.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No cgroup v2 directory to attach to.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The kernel would not load them (or this process may not).
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The kernel would not attach them.
    #[error(transparent)]
    Attach(#[from] AttachError),
}

/// The programs, attached, and their maps.
#[derive(Debug)]
pub struct SocketLb {
    /// Held for the proxy's lifetime: dropping it (or the process ending) detaches them.
    /// Its socket iterators destroy the sockets of endpoints a sync removed.
    programs: SocketPrograms,
    lb: ServiceLb<KernelMaps>,
}

impl SocketLb {
    /// Loads and attaches the programs as `config` says; `None` where this node cannot run
    /// them, said once at warning level with the reason (nftables mode then runs alone).
    pub fn start(config: &SocketLbConfiguration) -> Option<Self> {
        match Self::try_start(config) {
            Ok(lb) => Some(lb),
            Err(error) => {
                tracing::warn!(
                    error = %error.chain(),
                    "Socket load balancer unavailable; nftables mode runs alone"
                );
                None
            }
        }
    }

    fn try_start(config: &SocketLbConfiguration) -> Result<Self, StartError> {
        let chosen = (!config.cgroup.is_empty()).then(|| Path::new(&config.cgroup));
        let private = kp_dataplane::sysctls::state_dir().join(PRIVATE_MOUNT);
        let target = kp_socklb::cgroup::resolve(chosen, &private)?;
        if let CgroupTarget::PrivateMount(path) = &target {
            tracing::warn!(
                cgroup = %path.display(),
                "This node has only cgroup v1 mounted: mounted a private cgroup2 for the socket \
                 load balancer (every process is in its root)"
            );
        }
        let (mut programs, maps) = SocketPrograms::load()?;
        programs.attach(target.path())?;
        tracing::info!(
            cgroup = %target.path().display(),
            "Socket load balancer attached: the node's own sockets reach Service addresses \
             without per-packet NAT"
        );
        let mut lb = ServiceLb::new(maps);
        if let Some(why) = programs.destroy_unavailable() {
            tracing::warn!(
                error = %why.chain(),
                "Socket load balancer cannot destroy sockets of removed endpoints: UDP Services \
                 stay with nftables mode (DNAT and conntrack flush), TCP keeps its connections"
            );
            lb.leave_udp_to_nftables();
        }
        Ok(Self { programs, lb })
    }

    /// Brings the maps to `request`'s state: every Service on a full sync, the changed ones
    /// on a partial one. A port that cannot be written is logged and left to nftables mode's
    /// rules; the next sync rewrites everything.
    pub fn sync(&mut self, request: &SyncRequest<'_>) {
        let full = request.kind == SyncKind::Full;
        let report = self.lb.sync(request.state, full, request.changed);
        for (key, error) in &report.failed {
            tracing::warn!(
                service = %describe(*key),
                error = %error.chain(),
                "Cannot write the socket load balancer's map entry; nftables mode's rules serve \
                 it until the next sync"
            );
        }
        tracing::debug!(
            full,
            writes = report.writes,
            failed = report.failed.len(),
            "Socket load balancer maps synced"
        );
        self.destroy_removed();
    }

    /// Destroys the translated sockets still connected to endpoints this sync removed (as
    /// nftables mode flushes their UDP conntrack entries).
    fn destroy_removed(&mut self) {
        let removed = self.lb.balancer_mut().take_removed();
        if removed.is_empty() {
            return;
        }
        match self.programs.destroy_sockets(&removed) {
            // Info when sockets went (the event an operator may look for), debug otherwise.
            Ok(report) if report.destroyed > 0 => tracing::info!(
                pairs = removed.len(),
                namespaces = report.namespaces,
                skipped = report.skipped,
                destroyed = report.destroyed,
                "Socket load balancer destroyed sockets of removed endpoints"
            ),
            Ok(report) => tracing::debug!(
                pairs = removed.len(),
                namespaces = report.namespaces,
                skipped = report.skipped,
                "Socket load balancer found no socket of the removed endpoints"
            ),
            // Said once at start; UDP is left to nftables mode there.
            Err(DestroyError::Unavailable) => {}
            Err(error) => tracing::warn!(
                error = %error.chain(),
                "Cannot destroy sockets connected to removed endpoints; they keep their \
                 endpoint until they close"
            ),
        }
    }
}

fn describe(key: ServiceKey) -> String {
    format!("{}/{}", key.addr, key.protocol.as_str())
}

/// What `explain` says of the socket load balancer for `m` (a match of the running state):
/// the endpoints `desired` gives its address, or why nftables mode's rules serve it.
pub(crate) fn explain_path(
    state: &ProxyState,
    m: &ServiceMatch,
    config: &SocketLbConfiguration,
) -> SocketLbPath {
    let cgroup = if config.cgroup.is_empty() {
        "the cgroup v2 root (every process of the node)".to_owned()
    } else {
        config.cgroup.clone()
    };
    let key = ServiceKey::new(SocketAddr::new(m.ip, m.port), m.name.protocol);
    let endpoints = (m.how != MatchKind::NodePort)
        .then(|| kp_socklb::desired_service(state, &m.name.service).remove(&key))
        .flatten();
    let reason = match &endpoints {
        Some(list) if list.is_empty() => format!(
            "no endpoints: connect() and sendto() from sockets in {cgroup} fail with ECONNREFUSED"
        ),
        Some(_) => format!(
            "connect() (and unconnected UDP's sendto()) from sockets in {cgroup} goes straight \
             to one of these endpoints, with no NAT; other sources meet nftables mode's rules"
        ),
        None => untranslated(state, m).to_owned(),
    };
    SocketLbPath {
        translated: endpoints.is_some(),
        endpoints: endpoints.unwrap_or_default(),
        reason,
    }
}

/// Why the programs leave `m` to nftables mode's rules (as `kp_socklb::desired` decides).
fn untranslated(state: &ProxyState, m: &ServiceMatch) -> &'static str {
    let port = state.services.get(&m.name);
    if m.how == MatchKind::NodePort {
        "NodePorts stay with nftables mode's rules"
    } else if port.is_some_and(|p| p.session_affinity.is_some()) {
        "ClientIP affinity stays with nftables mode's rules"
    } else if m.name.protocol == Protocol::Sctp {
        "SCTP stays with nftables mode's rules"
    } else if m.how == MatchKind::LoadBalancerIp && !m.load_balancer_source_ranges.is_empty() {
        "loadBalancerSourceRanges: nftables mode's firewall decides by source"
    } else if m.how == MatchKind::ClusterIp {
        "internalTrafficPolicy Local without a local endpoint: nftables mode's rules drop it"
    } else {
        "the plan gives the node's own sockets no endpoint list here: nftables mode's rules decide"
    }
}
