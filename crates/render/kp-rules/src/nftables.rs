//! nftables mode: the pure renderer of upstream kube-proxy's nftables layout.
//!
//! [`render`] turns the proxy state into one [`Transaction`] of typed [`cmd`] commands (its
//! `Display` is the `nft -f -` script): a single atomic transaction on table `ip kube-proxy` (or `ip6 kube-proxy`) with upstream's object names, so that a node
//! can move between upstream kube-proxy and this one. Dispatch is O(1): verdict maps keyed by
//! `address . protocol . port` (and `protocol . port` for NodePorts) jump to per-service
//! chains, which pick an endpoint with `numgen random`.
//!
//! Syncs are incremental, as upstream's are. The renderer is pure, so what is installed is
//! described by an [`NftState`] that the caller keeps: each [`NftOutput`] carries the update
//! that turns it into the state the kernel holds once the script has been applied, to be
//! passed back (in [`NftScope`]) on the next call. A partial sync's update, like its script,
//! only covers the services it rewrites, so its cost does not grow with the number of
//! services installed. A failed `nft -f` changes nothing (the transaction is atomic), so
//! after a failure the caller passes the previous state again.
//!
//! - A [`SyncKind::Full`] sync (re)creates the table's fixed part (base chains, helper
//!   chains, sets and maps), flushes the sets and maps and refills them, and rewrites every
//!   service chain. Like upstream it never flushes the whole table, so affinity sets keep
//!   their clients and nothing else in the table is disturbed.
//! - A [`SyncKind::Partial`] sync rewrites only the chains of the services in
//!   [`NftScope::changed`] (plus any service port that appeared or vanished unreported, so
//!   no element points at a missing chain), and updates map elements by difference; other
//!   services are not even planned. An idle partial sync is an empty script. A partial
//!   sync is promoted to a full one when the fixed part would differ from what `existing`
//!   records (first sync, new node addresses or service CIDRs, another configuration).
//! - Chains that are no longer used are flushed in the sync that finds them stale, and deleted
//!   by a later sync with [`NftScope::delete_stale`] set: kernels before 6.2 keep a chain
//!   referenced for a moment after the map element pointing to it is removed, so upstream
//!   waits at least a second. Stale affinity sets are deleted at once, as upstream does.
//!
//! ```
//! use std::collections::BTreeSet;
//!
//! use kp_core::backend::SyncKind;
//! use kp_core::model::IpFamily;
//! use kp_core::tracker::ProxyState;
//! use kp_rules::nftables::{NftScope, NftState, RenderConfig, render};
//!
//! let state = ProxyState::default();
//! let installed = NftState::default();
//! let out = render(&state, IpFamily::V4, &RenderConfig::default(), &NftScope {
//!     kind: SyncKind::Partial,
//!     changed: &BTreeSet::new(),
//!     existing: &installed,
//!     delete_stale: false,
//!     service_cidrs: &[],
//! })?;
//! assert_eq!(out.kind, SyncKind::Full, "nothing installed yet");
//! // The backend applies `out.transaction` (if not empty; `out.script()` is its text for
//! // `nft -f -`); once that succeeded,
//! // `out.update` turns `installed` into the state of the kernel: the next `existing`.
//! let mut installed = installed;
//! out.update.apply(&mut installed);
//! assert!(installed.is_initialized());
//! # Ok::<(), kp_rules::nftables::RenderError>(())
//! ```
//!
//! Text from API objects (namespaces, names, port names) only appears in identifiers, where
//! characters outside `[A-Za-z0-9_./-]` are replaced (see [`names`]), and inside
//! `comment "..."` strings, percent-encoded by [`comment`](crate::iptables::comment::sanitize)
//! and cut to nft's 128-byte limit. A hostile name can therefore not end a string, a
//! statement or a line.
//!
//! Deliberate differences from upstream: no rule drops conntrack-INVALID packets (upstream
//! removed it from nftables mode, kubernetes#122663, relying on `nf_conntrack_tcp_be_liberal`
//! instead), so [`RenderConfig::drop_invalid`], `localhost_node_ports` and
//! `large_cluster_threshold` have no effect here; `random_fully: false` writes a plain
//! `masquerade`; services with at most 32 endpoints pick one with a cascade of `numgen random
//! mod k 0 goto` rules (uniform, like iptables mode's `statistic` rules) instead of one
//! `numgen random mod n vmap { ... }` rule, because the kernel makes every anonymous map in a
//! transaction cost a walk over the whole transaction: with one per service the first sync
//! of 10k services did not finish in minutes (see bench/notes/2026-11-23-why-big-syncs-were-slow.md). The table's chains,
//! maps, sets and their names are upstream's.

pub mod cmd;
pub mod layout;
pub mod names;
mod render;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use kp_core::backend::SyncKind;
use kp_core::model::{IpFamily, ServiceName, ServicePortName};
use kp_core::tracker::ProxyState;

pub use crate::config::{
    LocalDetector, LocalhostNodePortRejects, NodePortAddresses, RenderConfig, RenderError,
};
pub use cmd::{Command, ElementKey, ElementValue, Name, NoSteps, StepSink, Transaction};
pub use render::{StepRenderError, render, render_in_steps};

/// The table kube-proxy owns in each family (`ip kube-proxy`, `ip6 kube-proxy`).
pub const TABLE: &str = "kube-proxy";

/// The named counter of `proto`'s rejected localhost NodePort packets
/// ([`LocalhostNodePortRejects`]), upstream's name (`localhost-nodeport-rejected-udp`), in
/// both layouts' tables: what `kubeproxy_nftables_localhost_nodeport_rejected_packets_total`
/// reads.
pub fn localhost_reject_counter(proto: kp_core::model::Protocol) -> &'static str {
    match proto {
        kp_core::model::Protocol::Tcp => "localhost-nodeport-rejected-tcp",
        kp_core::model::Protocol::Udp => "localhost-nodeport-rejected-udp",
        kp_core::model::Protocol::Sctp => "localhost-nodeport-rejected-sctp",
    }
}

/// nft limits comments (rules, elements, sets) to 128 bytes.
pub const MAX_COMMENT_BYTES: usize = 128;

/// A base chain: hooked into netfilter directly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseChain {
    /// Chain name.
    pub name: &'static str,
    /// `filter` or `nat`.
    pub kind: &'static str,
    /// Netfilter hook.
    pub hook: &'static str,
    /// Numeric priority (dstnat is -100, filter 0, srcnat 100).
    pub priority: i32,
}

/// Upstream's base chains (newest layout). The filter chains that look at service IPs run
/// before DNAT (`dstnat - 10`), the reject/drop checks at filter priority, where `reject` is
/// allowed on every kernel.
pub const BASE_CHAINS: [BaseChain; 8] = [
    BaseChain {
        name: "filter-prerouting-pre-dnat",
        kind: "filter",
        hook: "prerouting",
        priority: -110,
    },
    BaseChain {
        name: "filter-output-pre-dnat",
        kind: "filter",
        hook: "output",
        priority: -110,
    },
    BaseChain {
        name: "filter-forward",
        kind: "filter",
        hook: "forward",
        priority: 0,
    },
    BaseChain {
        name: "filter-input",
        kind: "filter",
        hook: "input",
        priority: 0,
    },
    BaseChain {
        name: "filter-output",
        kind: "filter",
        hook: "output",
        priority: 0,
    },
    BaseChain {
        name: "nat-prerouting",
        kind: "nat",
        hook: "prerouting",
        priority: -100,
    },
    BaseChain {
        name: "nat-output",
        kind: "nat",
        hook: "output",
        priority: -100,
    },
    BaseChain {
        name: "nat-postrouting",
        kind: "nat",
        hook: "postrouting",
        priority: 100,
    },
];

/// Base chains of older upstream releases (v1.29-v1.32); removed on the first sync so a node
/// upgraded from those does not run both layouts.
pub const LEGACY_BASE_CHAINS: [&str; 2] = ["filter-prerouting", "filter-output-post-dnat"];

/// Regular chain of older upstream releases, only reachable from [`LEGACY_BASE_CHAINS`].
pub const LEGACY_CHAINS: [&str; 1] = ["endpoints-check"];

/// Dispatch for ClusterIPs, externalIPs and LB IPs: `addr . proto . port : verdict`.
pub const SERVICE_IPS: &str = "service-ips";
/// Dispatch for NodePorts: `proto . port : verdict`.
pub const SERVICE_NODEPORTS: &str = "service-nodeports";
/// Every active ClusterIP, for rejecting unknown ports.
pub const CLUSTER_IPS: &str = "cluster-ips";
/// Node addresses accepting NodePorts (restricted `nodePortAddresses` only).
pub const NODEPORT_IPS: &str = "nodeport-ips";
/// LB destinations subject to loadBalancerSourceRanges.
pub const FIREWALL_IPS: &str = "firewall-ips";
/// Destinations without (usable) endpoints: `drop` or `goto reject-chain`.
pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
/// NodePorts without (usable) endpoints.
pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
/// The NodePorts whose localhost traffic is rejected and counted (KEP-6032, the
/// [`LocalhostNodePortRejects`] protocols): `proto . port`, the verdict-free layout's name.
pub const NODEPORT_LOCALHOST_REJECT: &str = "nodeport-localhost-reject";
/// Helper chain holding the `reject` the no-endpoint maps jump to.
pub const REJECT_CHAIN: &str = "reject-chain";
/// Chain setting the masquerade mark.
pub const MARK_FOR_MASQUERADE: &str = "mark-for-masquerade";

/// One of the sets or maps whose elements a sync maintains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ElementSet {
    /// [`CLUSTER_IPS`].
    ClusterIps,
    /// [`SERVICE_IPS`].
    ServiceIps,
    /// [`SERVICE_NODEPORTS`].
    ServiceNodePorts,
    /// [`FIREWALL_IPS`].
    FirewallIps,
    /// [`NO_ENDPOINT_SERVICES`].
    NoEndpointServices,
    /// [`NO_ENDPOINT_NODEPORTS`].
    NoEndpointNodePorts,
    /// [`NODEPORT_LOCALHOST_REJECT`].
    NodePortLocalhostReject,
}

impl ElementSet {
    /// Every element set, in the order a full sync flushes them.
    pub const ALL: [ElementSet; 7] = [
        ElementSet::ClusterIps,
        ElementSet::ServiceIps,
        ElementSet::ServiceNodePorts,
        ElementSet::FirewallIps,
        ElementSet::NoEndpointServices,
        ElementSet::NoEndpointNodePorts,
        ElementSet::NodePortLocalhostReject,
    ];

    /// The nft object name.
    pub fn name(self) -> &'static str {
        match self {
            ElementSet::ClusterIps => CLUSTER_IPS,
            ElementSet::ServiceIps => SERVICE_IPS,
            ElementSet::ServiceNodePorts => SERVICE_NODEPORTS,
            ElementSet::FirewallIps => FIREWALL_IPS,
            ElementSet::NoEndpointServices => NO_ENDPOINT_SERVICES,
            ElementSet::NoEndpointNodePorts => NO_ENDPOINT_NODEPORTS,
            ElementSet::NodePortLocalhostReject => NODEPORT_LOCALHOST_REJECT,
        }
    }

    /// `set` or `map`, as the `flush` statement needs it.
    pub fn object(self) -> &'static str {
        match self {
            ElementSet::ClusterIps | ElementSet::NodePortLocalhostReject => "set",
            _ => "map",
        }
    }
}

/// The per-service objects one service port owns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnedObjects {
    /// Its chains (`service-`, `local-`, `external-`, `firewall-`, `endpoint-`), sharing
    /// the names the render allocated for its commands (136k chains at 10k×10 services).
    pub chains: BTreeSet<Name>,
    /// Its affinity sets, with their timeout in seconds.
    pub affinity_sets: BTreeMap<String, u64>,
}

/// What one of our renders left in the kernel, as far as the next render needs to know.
///
/// Start from [`NftState::default`] (nothing known: the next sync is full), or from
/// [`NftState::adopt`] with the per-service objects `nft list table` shows after a restart,
/// so that leftovers of a previous process get cleaned up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NftState {
    /// The fixed part as last written; `None` until a full sync succeeded.
    setup: Option<String>,
    /// Per service port: the chains and sets it owns.
    owned: BTreeMap<ServicePortName, OwnedObjects>,
    /// Per-service chains found in the kernel that no known service owns.
    foreign_chains: BTreeSet<String>,
    /// Affinity sets found in the kernel that no known service owns, with their timeout in
    /// seconds (`None`: none or unknown).
    foreign_sets: BTreeMap<String, Option<u64>>,
    /// Flushed chains waiting for [`NftScope::delete_stale`].
    pending_deletions: BTreeSet<String>,
    /// The elements of every maintained set and map, each with the service port whose value
    /// it holds and how many claim its key.
    elements: BTreeMap<ElementSet, BTreeMap<ElementKey, Installed>>,
    /// Per service port: the elements it asks for. Kept so that a partial sync can release a
    /// rewritten service's elements without planning every other service again.
    claims: BTreeMap<ServicePortName, Vec<Claim>>,
    /// Whether every per-service chain in the table is known (listed by [`NftState::adopt`]
    /// or written by us): then a new chain is created empty and needs no `flush`, which
    /// saves one statement per chain (~10% of a 10k-service first sync). Unknown (the
    /// default): every written chain is flushed, as upstream does.
    chains_known: bool,
}

impl NftState {
    /// A state for a table whose content is unknown apart from these object names (as `nft
    /// list table` prints them), each set with its timeout in seconds (`None` when it has
    /// none or it is unknown). Per-service chains and affinity sets among them (names
    /// containing `/`) are adopted: the next (full) sync rewrites the chains still in use and
    /// flushes, then deletes, the others; it keeps (with their elements, the pinned clients)
    /// the affinity sets still wanted with the same timeout, and deletes the others (an
    /// unknown timeout counts as different). Other names are ignored.
    pub fn adopt(
        chains: impl IntoIterator<Item = String>,
        sets: impl IntoIterator<Item = (String, Option<u64>)>,
    ) -> Self {
        Self {
            foreign_chains: chains
                .into_iter()
                .filter(|c| names::is_service_object(c))
                .collect(),
            foreign_sets: sets
                .into_iter()
                .filter(|(s, _)| {
                    names::is_service_object(s) && s.starts_with(names::AFFINITY_PREFIX)
                })
                .collect(),
            chains_known: true,
            ..Self::default()
        }
    }

    /// Whether a full sync has set up the table (so a partial sync is possible).
    pub fn is_initialized(&self) -> bool {
        self.setup.is_some()
    }

    /// Flushed chains that a later sync with [`NftScope::delete_stale`] deletes.
    pub fn pending_deletions(&self) -> &BTreeSet<String> {
        &self.pending_deletions
    }

    /// Whether `chain`, one of `owner`'s chains (names are unique per service port), may be
    /// in the table already (always, while the table's chains are not known).
    pub fn may_hold_chain(&self, owner: &ServicePortName, chain: &str) -> bool {
        !self.chains_known
            || self.foreign_chains.contains(chain)
            || self.pending_deletions.contains(chain)
            || self
                .owned
                .get(owner)
                .is_some_and(|o| o.chains.contains(chain))
    }

    /// Every per-service chain in the table: those in use and those pending deletion.
    pub fn chains(&self) -> BTreeSet<&str> {
        self.owned
            .values()
            .flat_map(|o| o.chains.iter().map(Name::as_str))
            .chain(self.foreign_chains.iter().map(String::as_str))
            .chain(self.pending_deletions.iter().map(String::as_str))
            .collect()
    }

    /// Every affinity set in the table.
    pub fn affinity_sets(&self) -> BTreeSet<&str> {
        self.owned
            .values()
            .flat_map(|o| o.affinity_sets.keys())
            .chain(self.foreign_sets.keys())
            .map(String::as_str)
            .collect()
    }

    /// The objects one service port owns.
    pub fn owned(&self, name: &ServicePortName) -> Option<&OwnedObjects> {
        self.owned.get(name)
    }

    /// The elements of one set or map with their nft key text, in key order.
    pub fn elements(&self, set: ElementSet) -> impl Iterator<Item = (&str, &ElementValue)> {
        self.elements
            .get(&set)
            .into_iter()
            .flatten()
            .map(|(key, installed)| (key.as_str(), &installed.value))
    }

    /// Forget which chains hold rules, so the next sync empties every chain it writes (as
    /// upstream always does): for when part of a sync may have been applied, see
    /// [`Transaction::steps`].
    pub fn forget_chain_contents(&mut self) {
        self.chains_known = false;
    }

    /// One element of one set or map, by its nft key text.
    pub fn element(&self, set: ElementSet, key: &str) -> Option<&ElementValue> {
        self.elements.get(&set)?.get(key).map(|i| &i.value)
    }
}

/// One element a service port asks for: several may ask for the same key (every port of a
/// service for its ClusterIP, or two services sharing an external IP and port by mistake);
/// the first in service order holds it, as on a full sync.
pub(crate) type Claim = (ElementSet, ElementKey, ElementValue);

/// What a rewritten service port leaves in the state: its objects and its claims.
pub(crate) type PortObjects = (OwnedObjects, Vec<Claim>);

/// An element as installed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Installed {
    /// What the kernel holds: the owner's value.
    pub(crate) value: ElementValue,
    /// The first service port (in service order) claiming the key.
    pub(crate) owner: ServicePortName,
    /// How many service ports claim the key (at least 1).
    pub(crate) claims: u32,
}

/// How the state changes once a sync's script has been applied. A partial sync carries only
/// what its services changed, so keeping the state costs nothing per unchanged service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateUpdate(pub(crate) Update);

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Update {
    /// A full sync: the whole new state.
    Replace(Box<NftState>),
    /// A partial sync: the rewritten service ports and touched elements.
    Patch(Patch),
}

/// The part of the state a partial sync changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Patch {
    /// Rewritten service ports: their objects and claims, or `None` once gone.
    pub(crate) ports: Vec<(ServicePortName, Option<PortObjects>)>,
    /// Touched elements: the new installed element, or `None` once deleted.
    pub(crate) elements: Vec<(ElementSet, ElementKey, Option<Installed>)>,
    /// The chains pending deletion afterwards.
    pub(crate) pending_deletions: BTreeSet<String>,
}

impl StateUpdate {
    /// Turns `state` (the one the sync was rendered against) into the state the kernel holds
    /// once the sync's script has been applied.
    pub fn apply(self, state: &mut NftState) {
        match self.0 {
            Update::Replace(new) => *state = *new,
            Update::Patch(patch) => {
                for (name, objects) in patch.ports {
                    match objects {
                        Some((owned, claims)) => {
                            state.owned.insert(name.clone(), owned);
                            state.claims.insert(name, claims);
                        }
                        None => {
                            state.owned.remove(&name);
                            state.claims.remove(&name);
                        }
                    }
                }
                for (set, key, installed) in patch.elements {
                    let elements = state.elements.entry(set).or_default();
                    match installed {
                        Some(installed) => {
                            elements.insert(key, installed);
                        }
                        None => {
                            elements.remove(&key);
                        }
                    }
                }
                state.pending_deletions = patch.pending_deletions;
                state.chains_known = true;
            }
        }
    }
}

/// What one sync covers.
#[derive(Clone, Copy, Debug)]
pub struct NftScope<'a> {
    /// Full: rewrite everything. Partial: only what changed (promoted to full when needed).
    pub kind: SyncKind,
    /// Services whose Service or EndpointSlices changed since the last successful sync.
    pub changed: &'a BTreeSet<ServiceName>,
    /// What is installed now: the previous `existing` with [`NftOutput::update`] applied after a successful apply (or
    /// the one before it after a failed apply).
    pub existing: &'a NftState,
    /// Delete the chains in [`NftState::pending_deletions`] (those not needed again). Upstream
    /// does so once they were flushed at least a second ago.
    pub delete_stale: bool,
    /// The service CIDRs (from ServiceCIDR objects or `--service-cluster-ip-range`); those of
    /// this family get the "drop traffic to unallocated ClusterIPs" rule. May be empty.
    pub service_cidrs: &'a [IpNet],
}

/// The rendered transaction and its bookkeeping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NftOutput {
    /// The commands of the transaction (its `Display` is the input for `nft -f -`). Empty
    /// when there is nothing to do.
    pub transaction: Transaction,
    /// Steps of a full sync that [`render_in_steps`] already had applied; `transaction` holds
    /// the rest. Always 0 from [`render`].
    pub steps_applied: usize,
    /// The kind of sync actually rendered (a partial one may have been promoted).
    pub kind: SyncKind,
    /// Statements of the sync (upstream's "operations" per transaction), those of steps
    /// already applied included.
    pub operations: usize,
    /// Service ports whose chains `transaction` rewrites.
    pub services_written: usize,
    /// Chains found stale and flushed by `transaction` (now pending deletion).
    pub flushed_stale: BTreeSet<String>,
    /// Chains `transaction` deletes (pending ones, with [`NftScope::delete_stale`]).
    pub deleted_chains: BTreeSet<String>,
    /// Affinity sets `transaction` deletes (stale, or re-created with a new timeout).
    pub deleted_sets: BTreeSet<String>,
    /// How [`NftScope::existing`] becomes the installed state once `transaction` is applied (the
    /// next sync's `existing`): see [`StateUpdate::apply`] and [`NftOutput::state_after`].
    pub update: StateUpdate,
}

/// A full sync of `state` onto an empty table, with the state it leaves: the whole layout at
/// once, as `explain` and tests look at it.
pub fn render_full(
    state: &ProxyState,
    family: IpFamily,
    config: &RenderConfig,
) -> Result<(NftOutput, NftState), RenderError> {
    let existing = NftState::default();
    let out = render(
        state,
        family,
        config,
        &NftScope {
            kind: SyncKind::Full,
            changed: &BTreeSet::new(),
            existing: &existing,
            delete_stale: false,
            service_cidrs: &state.service_cidrs,
        },
    )?;
    let installed = out.state_after(&existing);
    Ok((out, installed))
}

impl NftOutput {
    /// The transaction as an `nft -f -` script.
    pub fn script(&self) -> String {
        self.transaction.to_string()
    }

    /// The installed state once `transaction` is applied to a kernel holding `existing` (the state
    /// this output was rendered against). Clones `existing`; a caller that keeps the state
    /// applies [`NftOutput::update`] in place instead.
    pub fn state_after(&self, existing: &NftState) -> NftState {
        let mut state = existing.clone();
        self.update.clone().apply(&mut state);
        state
    }
}
