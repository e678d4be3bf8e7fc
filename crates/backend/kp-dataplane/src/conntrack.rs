//! Stale UDP/SCTP conntrack entries: which to delete after a sync ([`stale_flows`]) and how
//! ([`Conntrack`]).
//!
//! TCP recovers by itself (a reset ends the connection), but a UDP "connection" lives in
//! conntrack as long as packets keep arriving. Two cases black-hole clients:
//!
//! - An endpoint goes away: entries DNATed to it keep sending the client's packets to a dead
//!   pod. Delete the entries to the service whose reply source is that endpoint.
//! - A service port goes from no endpoints to some (upstream #48370): while it had none, the
//!   client's packets were rejected or sent on un-NATed, and the resulting entry keeps
//!   bypassing the new DNAT rules. Delete the entries to the service's IPs and NodePort.
//!
//! The default, [`NetlinkConntrack`], talks ctnetlink directly: one table dump per address
//! family and sync, matched against every filter, then one delete per stale entry (as
//! upstream since kubernetes#126847). [`ExecConntrack`] runs `conntrack -D` once per filter
//! instead (needs conntrack-tools); the backends' `with_parts` can take it, no flag selects it.
//! Both only see the changes they are told about: entries left stale from before a restart
//! are not found (a dump-based reconciler could, later).

use kp_core::report::ErrorChain as _;
use std::collections::BTreeSet;
#[cfg(any(test, feature = "test-util"))]
use std::collections::VecDeque;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::topology::categorize;
use kp_core::tracker::ProxyState;
use tracing::{debug, warn};

use crate::exec::{ExecError, run_program};

mod netlink;

pub use netlink::{
    FlowEntry, FlowTuple, NetlinkConntrack, Reply, delete_request, dump_request, parse_replies,
    protocol_number,
};

/// The [`Conntrack`] the backends use unless told otherwise.
pub type DefaultConntrack = NetlinkConntrack;

/// The conntrack-tools binary, looked up on the `PATH`.
pub const DEFAULT_CONNTRACK_BINARY: &str = "conntrack";

/// Which conntrack entries to delete. Unset fields match anything.
///
/// In conntrack's terms the original tuple is client -> service IP:port; after DNAT the
/// reply tuple is endpoint -> client, so the endpoint is the reply source.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FlowFilter {
    /// Address family of the entries.
    pub family: IpFamily,
    /// UDP or SCTP (TCP is never cleaned).
    pub protocol: Protocol,
    /// Original destination address (a service IP).
    pub orig_dst: Option<IpAddr>,
    /// Original destination port (the service port or NodePort).
    pub orig_dst_port: Option<u16>,
    /// Reply source address (the endpoint the entry was DNATed to).
    pub reply_src: Option<IpAddr>,
    /// Reply source port (the endpoint's port).
    pub reply_src_port: Option<u16>,
}

impl FlowFilter {
    /// The `conntrack -D` arguments selecting these entries.
    pub fn delete_args(&self) -> Vec<String> {
        let family = match self.family {
            IpFamily::V4 => "ipv4",
            IpFamily::V6 => "ipv6",
        };
        let mut args: Vec<String> = ["-D", "-f", family, "-p", self.protocol.as_str()]
            .map(str::to_owned)
            .into();
        let mut push = |flag: &str, value: Option<String>| {
            if let Some(value) = value {
                args.push(flag.to_owned());
                args.push(value);
            }
        };
        push("--orig-dst", self.orig_dst.map(|ip| ip.to_string()));
        push("--orig-port-dst", self.orig_dst_port.map(|p| p.to_string()));
        push("--reply-src", self.reply_src.map(|ip| ip.to_string()));
        push(
            "--reply-port-src",
            self.reply_src_port.map(|p| p.to_string()),
        );
        args
    }
}

impl fmt::Display for FlowFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "conntrack {}", self.delete_args().join(" "))
    }
}

/// Why deleting conntrack entries failed.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// Running the `conntrack` tool failed (missing binary, bad arguments, no permission).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// The tool succeeded but its summary line could not be read.
    #[error("unexpected conntrack output: {0:?}")]
    Output(String),
    /// Opening or using the ctnetlink socket failed (no `CAP_NET_ADMIN`, no conntrack
    /// support in the kernel).
    #[error("ctnetlink socket")]
    Socket(#[source] std::io::Error),
    /// The kernel refused a ctnetlink request.
    #[error("ctnetlink {request} failed")]
    Kernel {
        /// Which request: `dump` or `delete`.
        request: &'static str,
        /// The errno the kernel answered with.
        #[source]
        error: std::io::Error,
    },
    /// A ctnetlink reply could not be framed.
    #[error("unreadable ctnetlink reply: {0}")]
    Decode(String),
    /// An injected failure of `FakeConntrack` (`test-util`).
    #[error("injected conntrack failure")]
    Injected,
}

/// Deletes conntrack entries.
pub trait Conntrack: Send + Sync {
    /// Delete every entry matching `filter`; returns how many were deleted.
    fn delete(
        &self,
        filter: &FlowFilter,
    ) -> impl Future<Output = Result<usize, ConntrackError>> + Send;

    /// Delete every entry matching any of `filters`; returns how many were deleted.
    ///
    /// The default calls [`Conntrack::delete`] per filter, logging and skipping failures (as
    /// upstream: the entries time out eventually). Implementations that can match many
    /// filters in one pass over the table override it.
    fn delete_matching(
        &self,
        filters: &[FlowFilter],
    ) -> impl Future<Output = Result<usize, ConntrackError>> + Send {
        async move {
            let mut deleted = 0;
            for filter in filters {
                match self.delete(filter).await {
                    Ok(n) => deleted += n,
                    Err(err) => {
                        warn!(filter = %filter, error = %err.chain(), "deleting conntrack entries failed")
                    }
                }
            }
            Ok(deleted)
        }
    }
}

/// Runs `conntrack -D ...` (conntrack-tools) once per filter.
///
/// conntrack exits with 1 when nothing matched ("0 flow entries have been deleted"); that is
/// success here.
#[derive(Clone, Debug)]
pub struct ExecConntrack {
    binary: PathBuf,
}

impl ExecConntrack {
    /// Run `binary` (for example [`DEFAULT_CONNTRACK_BINARY`]).
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
        }
    }
}

impl Default for ExecConntrack {
    fn default() -> Self {
        Self::new(DEFAULT_CONNTRACK_BINARY)
    }
}

impl Conntrack for ExecConntrack {
    async fn delete(&self, filter: &FlowFilter) -> Result<usize, ConntrackError> {
        match run_program(&self.binary, &filter.delete_args(), None).await {
            // The summary goes to stderr, which is only kept on failure; a success deleted at
            // least one entry, and the entries themselves are printed on stdout one per line.
            Ok(stdout) => Ok(stdout.lines().filter(|l| !l.trim().is_empty()).count()),
            Err(ExecError::Failed {
                code: Some(1),
                stderr,
                ..
            }) if stderr.contains(" 0 flow entries") => Ok(0),
            Err(err) => Err(err.into()),
        }
    }
}

#[cfg(any(test, feature = "test-util"))]
/// A [`Conntrack`] that records filters. Clones share the record.
#[derive(Clone, Debug, Default)]
pub struct FakeConntrack {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeState {
    deleted: Vec<FlowFilter>,
    failures: VecDeque<()>,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeConntrack {
    /// A fake whose deletions succeed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every filter passed to [`Conntrack::delete`], in order.
    pub fn deleted(&self) -> Vec<FlowFilter> {
        self.lock().deleted.clone()
    }

    /// Make the next `n` deletions fail.
    pub fn fail_next(&self, n: usize) {
        self.lock().failures.extend(std::iter::repeat_n((), n));
    }

    /// Forget the recorded filters.
    pub fn clear(&self) {
        self.lock().deleted.clear();
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Conntrack for FakeConntrack {
    async fn delete(&self, filter: &FlowFilter) -> Result<usize, ConntrackError> {
        let mut state = self.lock();
        state.deleted.push(filter.clone());
        if state.failures.pop_front().is_some() {
            return Err(ConntrackError::Injected);
        }
        Ok(0)
    }
}

/// The entries that may be stale after moving from `previous` to `current`, for the service
/// ports of `services` (all when `None`) and the given families. Sorted and de-duplicated.
///
/// "Endpoints" here are those the rules actually send traffic to on this node (topology,
/// traffic policy and terminating fallback applied, per family), so an endpoint that stops
/// being used, for example because it is no longer ready, counts as removed. The service's
/// IPs and ports for a removed endpoint come from `previous`, where the entries were made.
pub fn stale_flows(
    previous: &ProxyState,
    current: &ProxyState,
    services: Option<&BTreeSet<ServiceName>>,
    families: &[IpFamily],
) -> Vec<FlowFilter> {
    let in_scope = |name: &&ServicePortName| {
        name.protocol != Protocol::Tcp && services.is_none_or(|s| s.contains(&name.service))
    };
    let names: BTreeSet<&ServicePortName> = previous
        .services
        .keys()
        .chain(current.services.keys())
        .filter(in_scope)
        .collect();
    let mut out = BTreeSet::new();
    for name in names {
        for &family in families {
            let old = used_endpoints(previous, name, family);
            let new = used_endpoints(current, name, family);
            let flow = |orig_dst, orig_dst_port, reply: Option<(IpAddr, u16)>| FlowFilter {
                family,
                protocol: name.protocol,
                orig_dst,
                orig_dst_port: Some(orig_dst_port),
                reply_src: reply.map(|(ip, _)| ip),
                reply_src_port: reply.map(|(_, port)| port),
            };
            if let Some((svc, old_eps)) = &old {
                let empty = BTreeSet::new();
                let new_eps = new.as_ref().map_or(&empty, |(_, eps)| eps);
                for &endpoint in old_eps.difference(new_eps) {
                    for ip in service_ips(svc) {
                        out.insert(flow(Some(ip), svc.port, Some(endpoint)));
                    }
                    if let Some(node_port) = node_port(svc) {
                        out.insert(flow(None, node_port, Some(endpoint)));
                    }
                }
            }
            let was_active = old.as_ref().is_some_and(|(_, eps)| !eps.is_empty());
            if let Some((svc, new_eps)) = &new
                && !new_eps.is_empty()
                && !was_active
            {
                for ip in service_ips(svc) {
                    out.insert(flow(Some(ip), svc.port, None));
                }
                if let Some(node_port) = node_port(svc) {
                    out.insert(flow(None, node_port, None));
                }
            }
        }
    }
    out.into_iter().collect()
}

/// Delete, through `conntrack`, the entries that moving from `previous` (the last
/// programmed state; `None` before the first successful sync) to `current` made stale, as
/// [`stale_flows`] decides for `services` (all when `None`: a full sync) and `families`.
/// Failures are logged and skipped, as upstream does (the entries time out eventually).
/// Returns how many entries were deleted.
pub async fn delete_stale<C: Conntrack>(
    conntrack: &C,
    previous: Option<&ProxyState>,
    current: &ProxyState,
    services: Option<&BTreeSet<ServiceName>>,
    families: &[IpFamily],
) -> usize {
    // Without a previous state (first sync after start) nothing is known to be stale, and
    // treating every service as newly active would cut live UDP flows (upstream #122740).
    let Some(previous) = previous else {
        return 0;
    };
    let flows = stale_flows(previous, current, services, families);
    delete_flows(conntrack, &flows).await
}

/// Deletes the entries matching `filters` through `conntrack` in one pass (a mode's own
/// notion of stale, such as the userspace relay's moved ports, as well as
/// [`delete_stale`]'s). Failures are logged and skipped, as upstream does (the entries time
/// out eventually). Returns how many were deleted.
pub async fn delete_flows<C: Conntrack>(conntrack: &C, filters: &[FlowFilter]) -> usize {
    if filters.is_empty() {
        return 0;
    }
    let deleted = match conntrack.delete_matching(filters).await {
        Ok(n) => n,
        // As upstream: log and go on; the entries time out eventually.
        Err(err) => {
            warn!(filters = filters.len(), error = %err.chain(), "deleting stale conntrack entries failed");
            0
        }
    };
    debug!(
        filters = filters.len(),
        deleted, "deleted stale conntrack entries"
    );
    deleted
}

/// Only what [`stale_flows`] needs from a state: its UDP and SCTP service ports and their
/// endpoints (so keeping the last programmed state costs nothing for TCP).
pub fn conntrack_relevant(state: &ProxyState) -> ProxyState {
    let relevant = |name: &ServicePortName| name.protocol != Protocol::Tcp;
    ProxyState {
        services: state
            .services
            .iter()
            .filter(|(name, _)| relevant(name))
            .map(|(name, svc)| (name.clone(), svc.clone()))
            .collect(),
        endpoints: state
            .endpoints
            .iter()
            .filter(|(name, _)| relevant(name))
            .map(|(name, eps)| (name.clone(), eps.clone()))
            .collect(),
        node: state.node.clone(),
        service_cidrs: Vec::new(),
    }
}

/// Brings `programmed` (a [`conntrack_relevant`] state) up to `state` after a sync: only the
/// `changed` services are copied again when given (a partial sync), so that keeping it costs
/// nothing per unchanged service; everything otherwise.
pub fn refresh_conntrack_relevant(
    programmed: &mut Option<ProxyState>,
    state: &ProxyState,
    changed: Option<&BTreeSet<ServiceName>>,
) {
    let (Some(previous), Some(changed)) = (programmed.as_mut(), changed) else {
        *programmed = Some(conntrack_relevant(state));
        return;
    };
    let relevant = |name: &ServicePortName| name.protocol != Protocol::Tcp;
    for service in changed {
        let old: Vec<ServicePortName> = previous
            .service_ports(service)
            .map(|(name, _)| name)
            .chain(previous.service_endpoints(service).map(|(name, _)| name))
            .cloned()
            .collect();
        for name in &old {
            previous.services.remove(name);
            previous.endpoints.remove(name);
        }
        for (name, svc) in state.service_ports(service).filter(|(n, _)| relevant(n)) {
            previous.services.insert(name.clone(), svc.clone());
            if let Some(eps) = state.endpoints.get(name) {
                previous.endpoints.insert(name.clone(), eps.clone());
            }
        }
    }
    previous.node = state.node.clone();
}

/// The service port as `family` programs it, and the `ip:port`s its rules DNAT to.
fn used_endpoints(
    state: &ProxyState,
    name: &ServicePortName,
    family: IpFamily,
) -> Option<(ServicePort, BTreeSet<(IpAddr, u16)>)> {
    let svc = state.services.get(name)?.for_family(family)?;
    let endpoints: Vec<Endpoint> = state
        .endpoints
        .get(name)
        .into_iter()
        .flatten()
        .filter(|ep| IpFamily::of(&ep.ip) == family)
        .cloned()
        .collect();
    let used = categorize(&svc, &endpoints, &state.node)
        .all_reachable
        .iter()
        .map(|ep| (ep.ip, ep.port))
        .collect();
    Some((svc, used))
}

/// The ClusterIP, externalIPs and LB IPs of a (single-family) service port.
fn service_ips(svc: &ServicePort) -> impl Iterator<Item = IpAddr> + '_ {
    svc.cluster_ips
        .iter()
        .chain(&svc.external_ips)
        .chain(&svc.load_balancer_ips)
        .copied()
}

/// The NodePort, treating 0 as none (as the renderer does).
fn node_port(svc: &ServicePort) -> Option<u16> {
    svc.node_port.filter(|port| *port != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delete_args_use_conntrack_tools_spelling() {
        let filter = FlowFilter {
            family: IpFamily::V6,
            protocol: Protocol::Udp,
            orig_dst: Some("fd00::10".parse().expect("literal")),
            orig_dst_port: Some(53),
            reply_src: Some("fd00:10::5".parse().expect("literal")),
            reply_src_port: Some(5353),
        };
        assert_eq!(
            filter.delete_args().join(" "),
            "-D -f ipv6 -p udp --orig-dst fd00::10 --orig-port-dst 53 \
             --reply-src fd00:10::5 --reply-port-src 5353"
        );
        let node_port = FlowFilter {
            family: IpFamily::V4,
            protocol: Protocol::Sctp,
            orig_dst: None,
            orig_dst_port: Some(30053),
            reply_src: None,
            reply_src_port: None,
        };
        assert_eq!(
            node_port.delete_args().join(" "),
            "-D -f ipv4 -p sctp --orig-port-dst 30053"
        );
    }

    #[tokio::test]
    async fn a_missing_conntrack_binary_is_an_error() {
        let ct = ExecConntrack::new("/nonexistent/kp-dataplane-test/conntrack");
        let filter = FlowFilter {
            family: IpFamily::V4,
            protocol: Protocol::Udp,
            orig_dst: None,
            orig_dst_port: Some(53),
            reply_src: None,
            reply_src_port: None,
        };
        let err = ct.delete(&filter).await.expect_err("cannot run");
        assert!(matches!(err, ConntrackError::Exec(ExecError::Spawn { .. })));
    }
}
