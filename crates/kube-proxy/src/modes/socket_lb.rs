//! `--socket-lb` (`socketLB.enabled`): the socket load balancer beside nftables mode
//! (docs/socket-lb.md). Its cgroup BPF programs send the node's own sockets' connections
//! to Service addresses straight to an endpoint; its maps are fed after every nftables sync
//! from the same state and the same plan, and a partial sync touches only the changed
//! Services' entries. nftables mode's rules stay fully programmed, so a node where the
//! programs cannot run (said once, with why) loses nothing but the shortcut.
//!
//! The links and maps are pinned in bpffs ([`kp_socklb::pin`]): a restarted or killed proxy
//! leaves translation running, and the next one adopts the maps and replaces the links.
//! The canary check ([`SocketLb::verify`]) reports pins someone else removed, and pinned
//! links someone detached from the cgroup, as foreign changes; the thorough check also
//! reads the Service and slot maps back and reports entries someone else rewrote. The full
//! sync that follows restores them. The destroy pass and the maps' read-back run on a thread
//! of their own ([`worker`]), so no sync waits for them. A start without `--socket-lb` (or
//! one that cannot attach) and `--cleanup` remove the pins ([`remove_pins`]).

mod worker;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kp_config::SocketLbConfiguration;
use kp_core::backend::{SyncKind, SyncRequest};
use kp_core::foreign::{Check, ForeignChange};
use kp_core::model::Protocol;
use kp_core::report::ErrorChain as _;
use kp_core::tracker::ProxyState;
use kp_rules::explain::{MatchKind, ServiceMatch, SocketLbPath};
use kp_socklb::{
    AttachError, CgroupError, CgroupTarget, KernelMaps, LoadError, MissingPin, ServiceKey,
    ServiceLb, SocketPrograms, pin,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
    /// No thread for the destroy pass and the maps' read-back.
    #[error("cannot start the socket load balancer's thread")]
    Thread(#[source] std::io::Error),
}

/// The socket load balancer's metrics (docs/metrics.md), registered with `--socket-lb`
/// whether or not the programs could be attached.
#[derive(Clone, Debug, Default)]
pub struct SocketLbMetrics {
    /// `kube_proxy_rs_socket_lb_attached`: 1 while the programs are attached.
    pub attached: Gauge,
    /// `kube_proxy_rs_socket_lb_map_writes_total`: map element writes.
    pub writes: Counter,
    /// `kube_proxy_rs_socket_lb_map_write_failures_total`: Service ports whose write failed.
    pub failures: Counter,
    /// `kube_proxy_rs_socket_lb_sockets_destroyable`: 1 where sockets of removed endpoints
    /// are destroyed, 0 where UDP Services are left to nftables mode instead.
    pub destroyable: Gauge,
}

impl SocketLbMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "kube_proxy_rs_socket_lb_attached",
            "1 while the socket load balancer's programs are attached, else 0",
            m.attached.clone(),
        );
        registry.register(
            "kube_proxy_rs_socket_lb_map_writes",
            "Socket load balancer map element writes",
            m.writes.clone(),
        );
        registry.register(
            "kube_proxy_rs_socket_lb_map_write_failures",
            "Service ports whose socket load balancer map write failed",
            m.failures.clone(),
        );
        registry.register(
            "kube_proxy_rs_socket_lb_sockets_destroyable",
            "1 where the socket load balancer destroys sockets of removed endpoints, 0 where \
             UDP Services stay with nftables mode instead",
            m.destroyable.clone(),
        );
        m
    }
}

/// The programs, attached, and their maps.
#[derive(Debug)]
pub struct SocketLb {
    /// Held for the proxy's lifetime: pinned, the programs stay attached after it (a restart
    /// adopts them); unpinned (no bpffs), dropping it detaches them.
    /// Its socket iterators destroy the sockets of endpoints a sync removed, on the
    /// worker's thread, which holds the lock meanwhile.
    programs: Arc<Mutex<SocketPrograms>>,
    lb: ServiceLb<KernelMaps>,
    metrics: SocketLbMetrics,
    /// Dropped before the pins (its thread holds the programs).
    worker: worker::Worker,
    /// The pins and their lock, held while this process runs (none where nothing is
    /// pinned).
    _pins: Option<Pins>,
    /// A read-back of the maps is under way on the worker's thread.
    reading: bool,
}

/// The pins' directory, locked for this process ([`claim_pins`]).
#[derive(Debug)]
pub struct Pins {
    dir: PathBuf,
    _lock: pin::PinLock,
}

/// The pins' directory on a bpffs, locked ([`pin::lock`]) before anything else is touched:
/// two proxies on one set of pins would fight over the links and the maps, so a second one
/// fails start-up naming the first. `None` where nothing can be pinned (said why).
pub fn claim_pins() -> Result<Option<Pins>, pin::PinError> {
    let Some(dir) = usable_pin_dir() else {
        return Ok(None);
    };
    let lock = pin::lock(&dir)?;
    Ok(Some(Pins { dir, _lock: lock }))
}

impl SocketLb {
    /// Loads and attaches the programs as `config` says, pinned in `pins` when given; `None`
    /// where this node cannot run them, said once at warning level with the reason
    /// (nftables mode then runs alone, and pinned programs of an earlier run are removed,
    /// since nothing would update their maps).
    pub fn start(
        config: &SocketLbConfiguration,
        metrics: SocketLbMetrics,
        pins: Option<Pins>,
    ) -> Option<Self> {
        // An error has dropped `pins` (and its lock) inside `try_start`: removing them below
        // takes the lock again (another open file: it would conflict).
        match Self::try_start(config, metrics, pins) {
            Ok(lb) => Some(lb),
            Err(error) => {
                tracing::warn!(
                    error = %error.chain(),
                    "Socket load balancer unavailable; nftables mode runs alone"
                );
                remove_pins_logged("the socket load balancer could not start");
                None
            }
        }
    }

    fn try_start(
        config: &SocketLbConfiguration,
        metrics: SocketLbMetrics,
        pins: Option<Pins>,
    ) -> Result<Self, StartError> {
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
        let (mut programs, maps) = match &pins {
            Some(pins) => SocketPrograms::load_pinned(&pins.dir)?,
            None => SocketPrograms::load()?,
        };
        let (held, top_slot_id) = maps.read_back();
        let adopted = held.len();
        let mut lb = ServiceLb::new(maps);
        lb.balancer_mut().adopt(held, top_slot_id);
        programs.attach(target.path())?;
        metrics.attached.set(1);
        tracing::info!(
            cgroup = %target.path().display(),
            adopted,
            "Socket load balancer attached: the node's own sockets reach Service addresses \
             without per-packet NAT"
        );
        let cannot_destroy = programs.destroy_unavailable();
        metrics.destroyable.set(i64::from(cannot_destroy.is_none()));
        if let Some(why) = cannot_destroy {
            tracing::warn!(
                error = %why.chain(),
                "Socket load balancer cannot destroy sockets of removed endpoints: UDP Services \
                 stay with nftables mode (DNAT and conntrack flush), TCP keeps its connections"
            );
            lb.leave_udp_to_nftables();
        }
        let reader = programs.map_reader()?;
        let programs = Arc::new(Mutex::new(programs));
        let worker = worker::Worker::start(worker::KernelWork {
            programs: programs.clone(),
            reader,
            metrics: metrics.clone(),
        })
        .map_err(StartError::Thread)?;
        Ok(Self {
            programs,
            lb,
            metrics,
            worker,
            _pins: pins,
            reading: false,
        })
    }

    /// Brings the maps to `request`'s state: every Service on a full sync, the changed ones
    /// on a partial one. A port that cannot be written is logged and left to nftables mode's
    /// rules; the next sync rewrites everything. A full sync also restores missing pins.
    pub fn sync(&mut self, request: &SyncRequest<'_>) {
        let full = request.kind == SyncKind::Full;
        if full {
            self.repair();
        }
        let report = self.lb.sync(request.state, full, request.changed);
        self.metrics.writes.inc_by(report.writes as u64);
        self.metrics.failures.inc_by(report.failed.len() as u64);
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

    /// Hands the worker the endpoints this sync removed: it destroys the translated sockets
    /// still connected to them (as nftables mode flushes their UDP conntrack entries). The
    /// map writes that removed them are done, so no connect from now on picks them.
    fn destroy_removed(&mut self) {
        let removed = self.lb.balancer_mut().take_removed();
        if !removed.is_empty() {
            self.worker.send(worker::Job::Destroy(removed));
        }
    }

    /// The pins someone else removed (each a foreign change: the proxier logs and counts
    /// it, then runs the full sync that restores it); also the Service and slot maps'
    /// entries someone else rewrote, removed or added, from the last read-back the worker
    /// finished (a thorough check starts the next): the full sync after it rewrites them.
    pub fn verify(&mut self, check: Check) -> Vec<ForeignChange> {
        // While a destroy pass holds them, the next check looks (a canary period later).
        let missing = worker::try_lock(&self.programs)
            .map(|programs| programs.verify())
            .unwrap_or_default();
        let mut changes: Vec<ForeignChange> = missing.into_iter().map(pin_change).collect();
        changes.extend(self.verify_entries(check));
        changes
    }

    /// The thorough check's comparison of the maps with what was written: a read-back the
    /// worker finished is compared (on any check), and a thorough check starts the next.
    /// Ports someone else changed are marked for the next full sync to rewrite (one we never
    /// wrote is deleted now).
    fn verify_entries(&mut self, check: Check) -> Option<ForeignChange> {
        let change = self.worker.read_back().and_then(|(epoch, held)| {
            self.reading = false;
            let Some(held) = held else {
                tracing::warn!(
                    "Cannot read the socket load balancer's maps back; the next thorough \
                     check tries again"
                );
                return None;
            };
            let differ = self.lb.balancer().table().differences_since(&held, epoch)?;
            self.foreign_entries(&differ)
        });
        if check == Check::Thorough && !self.reading {
            let epoch = self.lb.balancer_mut().watch();
            self.worker.send(worker::Job::ReadBack(epoch));
            self.reading = true;
        }
        change
    }

    /// Ports whose entries differ from what was written: restored, and reported.
    fn foreign_entries(&mut self, differ: &[ServiceKey]) -> Option<ForeignChange> {
        let first = *differ.first()?;
        for (key, error) in self.lb.balancer_mut().restore(differ) {
            tracing::warn!(
                service = %describe(key),
                error = %error.chain(),
                "Cannot delete a socket load balancer map entry someone else added"
            );
        }
        Some(ForeignChange::changed(
            "bpf-map",
            format!(
                "socket load balancer map entries of {} Service ports differ from what was \
                 written (first: {})",
                differ.len(),
                describe(first)
            ),
        ))
    }

    /// Re-attaches detached programs and pins unpinned maps; a failure is logged and the
    /// programs that still run go on (nftables mode's rules serve the rest). While a destroy
    /// pass holds the programs, the worker does it after the pass.
    fn repair(&mut self) {
        match worker::try_lock(&self.programs) {
            Some(mut programs) => repair_programs(&mut programs, &self.metrics),
            None => self.worker.send(worker::Job::Repair),
        }
    }
}

/// [`SocketLb::repair`] with the programs in hand (on the sync thread or the worker's).
fn repair_programs(programs: &mut SocketPrograms, metrics: &SocketLbMetrics) {
    let missing = programs.verify();
    if missing.is_empty() {
        return;
    }
    match programs.repair(&missing) {
        Ok(()) => {
            metrics.attached.set(1);
            tracing::info!(
                restored = missing.len(),
                "Socket load balancer pins restored"
            );
        }
        Err(error) => {
            let links = missing
                .iter()
                .any(|m| matches!(m, MissingPin::Link(_) | MissingPin::Detached(_)));
            if links {
                metrics.attached.set(0);
            }
            tracing::warn!(
                error = %error.chain(),
                "Cannot restore the socket load balancer's pins"
            );
        }
    }
}

/// The foreign change a missing pin is.
fn pin_change(missing: MissingPin) -> ForeignChange {
    match missing {
        MissingPin::Link(name) => ForeignChange::removed(
            "bpf-link",
            format!("socket load balancer program {name} detached (its link pin is gone)"),
        ),
        MissingPin::Detached(name) => ForeignChange::changed(
            "bpf-link",
            format!(
                "socket load balancer program {name} detached from its cgroup (its link pin \
                 stays)"
            ),
        ),
        MissingPin::Map(name) => ForeignChange::removed(
            "bpf-map",
            format!("socket load balancer map {name} unpinned"),
        ),
    }
}

/// The pins' directory on a bpffs (mounted there if needed, which is logged); `None`, said
/// why, where it cannot be had: the programs then detach with this process.
fn usable_pin_dir() -> Option<PathBuf> {
    let dir = pin_dir();
    match pin::prepare(&dir) {
        Ok(mounted) => {
            if mounted {
                tracing::warn!(
                    dir = %dir.display(),
                    "Mounted a bpffs for the socket load balancer's pins: they last as long as \
                     this mount (mount the host's /sys/fs/bpf for them to outlive the container)"
                );
            }
            Some(dir)
        }
        Err(error) => {
            tracing::warn!(
                error = %error.chain(),
                "Socket load balancer not pinned: its programs detach when this process exits"
            );
            None
        }
    }
}

/// `$KUBE_PROXY_RS_STATE_DIR/bpf/...` when the variable is set, else under /sys/fs/bpf.
fn pin_dir() -> PathBuf {
    let state = std::env::var_os(kp_dataplane::sysctls::STATE_DIR_ENV)
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from);
    pin::pin_dir(state.as_deref())
}

/// Removes the socket load balancer's pinned links and maps (`--cleanup`; a start without
/// `--socket-lb`): its programs detach. Returns how many pins there were; refused
/// ([`pin::PinError::Held`]) while another proxy uses them.
pub fn remove_pins() -> Result<usize, pin::PinError> {
    let dir = pin_dir();
    if !dir.exists() {
        return Ok(0);
    }
    let _lock = pin::lock(&dir)?;
    pin::remove(&dir)
}

/// [`remove_pins`], logged: at info level when there were some (`because` says why), at
/// warning level when they cannot be removed (another proxy's are left alone).
pub fn remove_pins_logged(because: &str) {
    match remove_pins() {
        Ok(0) => {}
        Ok(pins) => tracing::info!(
            pins,
            dir = %pin_dir().display(),
            "Removed the socket load balancer's pinned programs and maps: {because}"
        ),
        Err(error) => tracing::warn!(
            error = %error.chain(),
            "Cannot remove the socket load balancer's pinned programs and maps"
        ),
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
    let pinned = endpoints.as_ref().is_some_and(|t| t.affinity_ms != 0);
    let endpoints = endpoints.map(|t| t.endpoints);
    let reason = match &endpoints {
        Some(list) if list.is_empty() => format!(
            "no endpoints: connect() and sendto() from sockets in {cgroup} fail with ECONNREFUSED"
        ),
        Some(_) => format!(
            "connect() (and unconnected UDP's sendto()) from sockets in {cgroup} goes straight \
             to one of these endpoints, with no NAT{}; other sources meet nftables mode's rules",
            if pinned {
                " (ClientIP affinity: each network namespace, i.e. pod, keeps its endpoint)"
            } else {
                ""
            }
        ),
        None => untranslated(m).to_owned(),
    };
    SocketLbPath {
        translated: endpoints.is_some(),
        endpoints: endpoints.unwrap_or_default(),
        reason,
    }
}

/// Why the programs leave `m` to nftables mode's rules (as `kp_socklb::desired` decides).
fn untranslated(m: &ServiceMatch) -> &'static str {
    if m.how == MatchKind::NodePort {
        "NodePorts stay with nftables mode's rules"
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
