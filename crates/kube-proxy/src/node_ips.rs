//! This node's IPs, as upstream's node manager (`pkg/proxy`, `NodeManager`) handles them:
//! read once at start-up, before any backend is built, and never changed while running.
//!
//! - Start-up: from the API server, poll for the Node every second until it lists an
//!   `InternalIP`/`ExternalIP`, for up to 30 s once the server answers (`kp_sources::node`;
//!   upstream's node manager waits for its cache to sync first); from `--manifests`, the Node of
//!   that name in the files' first reading (nobody registers a Node into local files later, so
//!   there is nothing to wait for). Without one, upstream's fallback applies: a specific
//!   `bindAddress`, else loopback, with upstream's log lines.
//! - [`NodeIps::detect`] picks one IP per family (InternalIP before ExternalIP; `bindAddress`
//!   overrides its family).
//! - While running ([`NodeIpsWatch`]): upstream's newest releases exit (status 1) when the
//!   Node's IPs differ from the ones read at start-up, or when the Node is deleted, so the
//!   restarted proxy (the DaemonSet's restart policy) programs the new ones (kubernetes PR
//!   #138183, after the node manager of #133059). We do the same.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node;
use kp_config::KubeProxyConfiguration;
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::model::{IpFamily, NodeIps, host_ips, node_info};
use kp_rules::iptables::NodePortAddresses;
use kp_sources::node::{DEFAULT_NODE_IPS_TIMEOUT, DEFAULT_NODE_POLL_INTERVAL, wait_for_api_node};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::app::StartedSource;

/// The node IPs found at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Detected {
    /// The Node's own IPs (upstream's "raw" node IPs: one per family, empty without a Node
    /// or without addresses): what later Node events are compared with.
    pub raw: Vec<IpAddr>,
    /// One IP per family, after `bindAddress` and the loopback fallback.
    pub ips: NodeIps,
    /// This node's Node exists (found at start-up, with or without IPs): the first sync
    /// waits for its labels from the watch.
    pub node_found: bool,
}

impl Detected {
    /// From the Node's IPs found at start-up ([`host_ips`]; empty without a Node) and
    /// `bindAddress`, logging as upstream.
    pub fn new(raw: Vec<IpAddr>, bind_address: Option<IpAddr>) -> Self {
        if !raw.is_empty() {
            let list: Vec<String> = raw.iter().map(IpAddr::to_string).collect();
            tracing::info!(NodeIPs = %list.join(","), "Successfully retrieved NodeIPs");
        }
        let ips = NodeIps::detect(&raw, bind_address);
        if ips.primary_unknown() {
            tracing::info!(
                "Can't determine this node's IP, assuming loopback; if this is incorrect, please set the --bind-address flag"
            );
        }
        let node_found = !raw.is_empty();
        Self {
            raw,
            ips,
            node_found,
        }
    }
}

/// Where the proxy reads its objects from.
pub struct SourceSpec<'a> {
    /// `--manifests`.
    pub manifests: Option<&'a PathBuf>,
    /// `--master`.
    pub master: Option<&'a str>,
}

/// Reads this node's Node at start-up, from the source the proxy will use, and detects its
/// IPs. With `--manifests` the proxy's own manifests source is started here (its metrics in
/// `registry`) and returned: the Node comes from its first reading, whose events then go on
/// to the proxier, so the files are read and decoded once. Never fails for a missing Node
/// (upstream's fallback); fails only when the API client cannot be built at all, or the
/// manifests source cannot start.
pub async fn detect(
    source: &SourceSpec<'_>,
    config: &KubeProxyConfiguration,
    node_name: &str,
    registry: &mut Registry,
) -> anyhow::Result<(Detected, Option<StartedSource>)> {
    let shutdown = CancellationToken::new();
    let (node, started) = match source.manifests {
        Some(path) => {
            let (node, started) = manifests_node(path, node_name, registry).await?;
            (node, Some(started))
        }
        None => {
            let client = crate::app::api_client(source.master, config).await?;
            let wait = wait_for_api_node(
                client,
                node_name,
                DEFAULT_NODE_POLL_INTERVAL,
                DEFAULT_NODE_IPS_TIMEOUT,
                &shutdown,
            )
            .await;
            (wait.node().cloned(), None)
        }
    };
    let raw = node
        .as_ref()
        .map(|node| host_ips(&node_info(node).addresses))
        .unwrap_or_default();
    let mut detected = Detected::new(raw, config.bind_address());
    detected.node_found = node.is_some();
    Ok((detected, started))
}

/// How long the first reading of a manifests path that exists may take before the search for
/// this node's Node ends: reading existing files always ends, but a large directory takes its
/// time (a 10k-service one took minutes in the test VM under emulation), and giving up
/// after upstream's 30 s would start the proxy with no node IPs, then make it exit ("NodeIPs
/// changed") as soon as the same reading delivers the Node. Still bounded, for a path that
/// never finishes (a FIFO).
const DEFAULT_MANIFESTS_FIRST_READING_WAIT: Duration = Duration::from_secs(600);

/// Starts the manifests source and waits for the Node named `node_name` in its first
/// reading. A path that does not exist (the source waits for it) ends the search after
/// upstream's wait, a path that exists when its first reading ends (bounded by
/// [`DEFAULT_MANIFESTS_FIRST_READING_WAIT`]); without the Node, with upstream's log line. The
/// source keeps running either way: a Node it reports later is a change of the node IPs.
/// Fails only when the source cannot start (an invalid removal guard).
async fn manifests_node(
    path: &std::path::Path,
    node_name: &str,
    registry: &mut Registry,
) -> anyhow::Result<(Option<Node>, StartedSource)> {
    let (first_node, reading) = oneshot::channel();
    let wait = if path.exists() {
        DEFAULT_MANIFESTS_FIRST_READING_WAIT
    } else {
        DEFAULT_NODE_IPS_TIMEOUT
    };
    let started = crate::app::start_manifests(path, node_name, registry, Some(first_node))?;
    // A source that stopped before its first reading drops the sender: no Node.
    let found = tokio::time::timeout(wait, reading)
        .await
        .ok()
        .and_then(Result::ok)
        .flatten();
    if found.is_none() {
        tracing::error!(node = node_name, "Timed out waiting for node to exist");
    }
    Ok((found, started))
}

/// Why the proxy must restart.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Restart {
    /// The Node's IPs are not the ones the proxy started with.
    #[error(
        "NodeIPs changed for the node {node}: {old:?} -> {new:?}; exiting so the restarted proxy uses the new ones"
    )]
    IpsChanged {
        /// The node name.
        node: String,
        /// The IPs at start-up.
        old: Vec<IpAddr>,
        /// The Node's IPs now.
        new: Vec<IpAddr>,
    },
    /// The Node was deleted.
    #[error("Node {node} is being deleted; exiting")]
    Deleted {
        /// The node name.
        node: String,
    },
}

/// Watches the source's Node events for the changes upstream restarts on.
#[derive(Clone, Debug)]
pub struct NodeIpsWatch {
    node_name: String,
    raw: Vec<IpAddr>,
}

impl NodeIpsWatch {
    /// For `node_name`, whose IPs at start-up were `raw` ([`Detected::raw`]).
    pub fn new(node_name: impl Into<String>, raw: Vec<IpAddr>) -> Self {
        Self {
            node_name: node_name.into(),
            raw,
        }
    }

    /// Whether `event` (or an event of a batch) means the proxy must restart.
    pub fn check(&self, event: &SourceEvent) -> Option<Restart> {
        match event {
            SourceEvent::Batch(events) => events.iter().find_map(|e| self.check(e)),
            SourceEvent::Node(ObjectEvent::Applied(node)) if self.mine(node) => {
                let new = host_ips(&node_info(node).addresses);
                (new != self.raw).then(|| Restart::IpsChanged {
                    node: self.node_name.clone(),
                    old: self.raw.clone(),
                    new,
                })
            }
            SourceEvent::Node(ObjectEvent::Deleted(node)) if self.mine(node) => {
                Some(Restart::Deleted {
                    node: self.node_name.clone(),
                })
            }
            _ => None,
        }
    }

    fn mine(&self, node: &Node) -> bool {
        node.metadata.name.as_deref() == Some(self.node_name.as_str())
    }
}

/// Forwards `events` to `out` until shutdown, the end of either channel, or an event after
/// which upstream restarts: then logs upstream's line, cancels `shutdown` and returns why.
pub async fn forward_watching(
    watch: NodeIpsWatch,
    mut events: mpsc::Receiver<SourceEvent>,
    out: mpsc::Sender<SourceEvent>,
    shutdown: CancellationToken,
) -> Option<Restart> {
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return None,
            event = events.recv() => event?,
        };
        if let Some(restart) = watch.check(&event) {
            match &restart {
                Restart::IpsChanged { node, old, new } => tracing::info!(
                    node = %node,
                    newNodeIPs = ?new,
                    oldNodeIPs = ?old,
                    "NodeIPs changed for the node"
                ),
                Restart::Deleted { node } => {
                    tracing::info!(node = %node, "Node is being deleted")
                }
            }
            shutdown.cancel();
            return Some(restart);
        }
        if out.send(event).await.is_err() {
            return None;
        }
    }
}

/// nodePortAddresses as CIDRs, the union of its entries: `primary` is each known node IP (as
/// upstream: a /32 or /128 CIDR of it), `localhost` and `all` their CIDRs; `None` when unset
/// (every address).
fn node_port_cidrs(config: &KubeProxyConfiguration, node: &NodeIps) -> Option<Vec<IpNet>> {
    let setting = config.node_port_addresses();
    let mut cidrs = setting.cidrs()?;
    if setting.has_primary() {
        cidrs.extend(node.known().into_iter().map(IpNet::from));
    }
    Some(cidrs)
}

/// nodePortAddresses resolved for this node: its `local` addresses (the proxy reads them with
/// rtnetlink, `modes::host`) inside [`node_port_cidrs`]. Per family, as upstream: a family the list
/// has no CIDR for (or a `0.0.0.0/0`, `::/0` one) is unrestricted, which
/// [`NodePortAddresses`] marks with that family's unspecified address.
pub fn node_port_addresses(
    config: &KubeProxyConfiguration,
    node: &NodeIps,
    local: &[IpAddr],
) -> NodePortAddresses {
    match node_port_cidrs(config, node) {
        None => NodePortAddresses::All,
        Some(cidrs) => resolve(&cidrs, local),
    }
}

/// Upstream's start-up warnings about nodePortAddresses leaving a family unrestricted
/// (logged as "Kube-proxy configuration may be incomplete or incorrect").
pub fn config_warnings(config: &KubeProxyConfiguration, node: &NodeIps) -> Vec<String> {
    let Some(cidrs) = node_port_cidrs(config, node) else {
        return vec![
            "nodePortAddresses is unset; NodePort connections will be accepted on all local \
             IPs. Consider using `--nodeport-addresses primary`"
                .to_owned(),
        ];
    };
    let primary = node.primary;
    let other = match primary {
        IpFamily::V4 => IpFamily::V6,
        IpFamily::V6 => IpFamily::V4,
    };
    let of = |family: IpFamily| {
        cidrs
            .iter()
            .filter(|c| IpFamily::of_net(c) == family)
            .count()
    };
    let dual = |nets: &[IpNet]| {
        let mut families = nets.iter().map(IpFamily::of_net);
        families
            .next()
            .is_some_and(|first| families.any(|f| f != first))
    };
    let any_dual_stack = [
        config.cluster_cidrs(),
        cidrs.clone(),
        config.ipvs_exclude_cidrs(),
    ]
    .iter()
    .any(|nets| dual(nets));
    if any_dual_stack && of(primary) == cidrs.len() {
        vec![format!(
            "cluster appears to be dual-stack but nodePortAddresses contains only {} addresses; \
             NodePort connections will be accepted on all local {} IPs",
            primary.api_name(),
            other.api_name()
        )]
    } else if of(primary) == 0 {
        vec![format!(
            "cluster appears to be {}-primary but nodePortAddresses contains only {} addresses; \
             NodePort connections will be accepted on all local {} IPs",
            primary.api_name(),
            other.api_name(),
            primary.api_name()
        )]
    } else {
        Vec::new()
    }
}

/// [`node_port_addresses`]'s pure part: `cidrs` against the node's `local` addresses.
pub fn resolve(cidrs: &[IpNet], local: &[IpAddr]) -> NodePortAddresses {
    let mut ips = Vec::new();
    let mut unrestricted = 0;
    for family in [IpFamily::V4, IpFamily::V6] {
        let mine: Vec<&IpNet> = cidrs
            .iter()
            .filter(|c| IpFamily::of_net(c) == family)
            .collect();
        if mine.is_empty() || mine.iter().any(|c| c.prefix_len() == 0) {
            unrestricted += 1;
            ips.push(match family {
                IpFamily::V4 => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                IpFamily::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            });
            continue;
        }
        for ip in local.iter().filter(|ip| IpFamily::of(ip) == family) {
            if mine.iter().any(|c| c.contains(ip)) && !ips.contains(ip) {
                ips.push(*ip);
            }
        }
    }
    if unrestricted == 2 {
        NodePortAddresses::All
    } else {
        NodePortAddresses::Ips(ips)
    }
}

/// Where health-check node ports listen: every address NodePorts answer on, the unspecified
/// address of an unrestricted family; empty means everywhere (see `kp_server`).
pub fn health_check_addresses(node_ports: &NodePortAddresses) -> Vec<IpAddr> {
    match node_ports {
        NodePortAddresses::All => Vec::new(),
        NodePortAddresses::Ips(ips) => ips.clone(),
    }
}

/// What this node's IPs decide, resolved once at start-up ([`crate::node_ips`]): where
/// NodePorts (and health-check node ports) answer, and the node IP of each family the rules
/// use (`loadBalancerSourceRanges`' allowance for the node).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeAddressing {
    /// nodePortAddresses resolved ([`node_port_addresses`]).
    pub node_ports: NodePortAddresses,
    /// One node IP per family ([`kp_core::model::NodeIps::all`]).
    pub node_ips: Vec<IpAddr>,
}

impl NodeAddressing {
    /// From the node IPs detected at start-up and the node's `local` addresses.
    pub fn new(config: &KubeProxyConfiguration, detected: &Detected, local: &[IpAddr]) -> Self {
        Self {
            node_ports: node_port_addresses(config, &detected.ips, local),
            node_ips: detected.ips.all().to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("literal")
    }

    fn node(name: &str, addresses: &[(&str, &str)]) -> Node {
        let addresses: Vec<serde_json::Value> = addresses
            .iter()
            .map(|(kind, address)| serde_json::json!({ "type": kind, "address": address }))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": { "name": name },
            "status": { "addresses": addresses },
        }))
        .expect("a valid Node")
    }

    #[test]
    fn detects_internal_before_external_one_per_family() {
        let n = node(
            "n1",
            &[
                ("ExternalIP", "203.0.113.9"),
                ("Hostname", "n1"),
                ("InternalIP", "192.168.1.10"),
                ("InternalIP", "192.168.1.11"),
                ("ExternalIP", "2001:db8::9"),
            ],
        );
        let detected = Detected::new(host_ips(&node_info(&n).addresses), None);
        assert_eq!(detected.raw, [ip("192.168.1.10"), ip("2001:db8::9")]);
        assert_eq!(
            detected.ips.known(),
            [ip("192.168.1.10"), ip("2001:db8::9")]
        );
        let fallback = Detected::new(Vec::new(), Some(ip("0.0.0.0")));
        assert!(fallback.raw.is_empty());
        assert!(fallback.ips.known().is_empty());
    }

    #[test]
    fn restarts_when_the_ips_change_or_the_node_goes() {
        let watch = NodeIpsWatch::new("n1", vec![ip("192.168.1.10")]);
        let same = node("n1", &[("InternalIP", "192.168.1.10"), ("Hostname", "x")]);
        assert_eq!(
            watch.check(&SourceEvent::Node(ObjectEvent::Applied(same))),
            None
        );
        // Another node's events and extra non-node-IP addresses do not matter.
        let other = node("n2", &[("InternalIP", "10.0.0.1")]);
        assert_eq!(
            watch.check(&SourceEvent::Node(ObjectEvent::Applied(other.clone()))),
            None
        );
        assert_eq!(
            watch.check(&SourceEvent::Node(ObjectEvent::Deleted(other))),
            None
        );
        let second = node(
            "n1",
            &[
                ("InternalIP", "192.168.1.10"),
                ("InternalIP", "192.168.1.12"),
            ],
        );
        assert_eq!(
            watch.check(&SourceEvent::Node(ObjectEvent::Applied(second))),
            None
        );
        let moved = node("n1", &[("InternalIP", "192.168.1.20")]);
        assert_eq!(
            watch.check(&SourceEvent::Batch(vec![SourceEvent::Node(
                ObjectEvent::Applied(moved)
            )])),
            Some(Restart::IpsChanged {
                node: "n1".into(),
                old: vec![ip("192.168.1.10")],
                new: vec![ip("192.168.1.20")],
            })
        );
        let added_v6 = node(
            "n1",
            &[("InternalIP", "192.168.1.10"), ("InternalIP", "fd00::10")],
        );
        assert!(
            watch
                .check(&SourceEvent::Node(ObjectEvent::Applied(added_v6)))
                .is_some()
        );
        let gone = node("n1", &[]);
        assert_eq!(
            watch.check(&SourceEvent::Node(ObjectEvent::Deleted(gone))),
            Some(Restart::Deleted { node: "n1".into() })
        );
        // Started without a Node: its first appearance with IPs is a change, as upstream.
        let late = NodeIpsWatch::new("n1", Vec::new());
        let appeared = node("n1", &[("InternalIP", "192.168.1.10")]);
        assert!(
            late.check(&SourceEvent::Node(ObjectEvent::Applied(appeared)))
                .is_some()
        );
    }

    #[test]
    fn warns_as_upstream_when_a_family_is_left_unrestricted() {
        let config = |yaml: &str| {
            KubeProxyConfiguration::from_yaml(&format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{yaml}"
            ))
            .expect("valid config")
        };
        let dual = NodeIps::detect(&[ip("192.168.1.10"), ip("fd00::10")], None);
        let single = NodeIps::detect(&[ip("192.168.1.10")], None);
        let unset = config_warnings(&config("mode: iptables\n"), &dual);
        assert!(
            unset[0].starts_with("nodePortAddresses is unset"),
            "{unset:?}"
        );
        // nftables' default `primary` on a dual-stack node restricts both families.
        assert!(config_warnings(&config("mode: nftables\n"), &dual).is_empty());
        // On a single-stack node with a dual-stack cluster CIDR, IPv6 stays open.
        let open_v6 = config_warnings(
            &config("mode: nftables\nclusterCIDR: 10.244.0.0/16,fd00:10:244::/48\n"),
            &single,
        );
        assert!(
            open_v6[0].contains("dual-stack") && open_v6[0].contains("all local IPv6"),
            "{open_v6:?}"
        );
        let v6_only = config_warnings(&config("nodePortAddresses: [\"fd00::/64\"]\n"), &dual);
        assert!(
            v6_only[0].contains("IPv4-primary") && v6_only[0].contains("all local IPv4"),
            "{v6_only:?}"
        );
    }

    #[test]
    fn keywords_resolve_to_the_union_of_their_addresses() {
        let config = |list: &str| {
            KubeProxyConfiguration::from_yaml(&format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
                 mode: nftables\nnodePortAddresses: [{list}]\n"
            ))
            .expect("valid config")
        };
        let node = NodeIps::detect(&[ip("192.168.1.10"), ip("fd00::10")], None);
        let local = [
            ip("127.0.0.1"),
            ip("192.168.1.10"),
            ip("10.0.0.5"),
            ip("::1"),
            ip("fd00::10"),
        ];
        let resolved = |list: &str| node_port_addresses(&config(list), &node, &local);
        assert_eq!(
            resolved("primary, localhost"),
            NodePortAddresses::Ips(vec![
                ip("127.0.0.1"),
                ip("192.168.1.10"),
                ip("::1"),
                ip("fd00::10")
            ])
        );
        assert_eq!(
            resolved("10.0.0.0/8, primary"),
            NodePortAddresses::Ips(vec![ip("192.168.1.10"), ip("10.0.0.5"), ip("fd00::10")])
        );
        assert_eq!(resolved("all"), NodePortAddresses::All);
        assert_eq!(
            resolved("all, localhost").for_family(IpFamily::V4),
            NodePortAddresses::All
        );
    }

    #[test]
    fn resolves_node_port_addresses_per_family() {
        let local = [
            ip("127.0.0.1"),
            ip("192.168.1.10"),
            ip("10.96.0.1"),
            ip("169.254.20.10"),
            ip("192.168.2.10"),
            ip("::1"),
            ip("fd00::10"),
            ip("fd00::11"),
            ip("fe80::1"),
        ];
        let net = |s: &str| s.parse::<IpNet>().expect("literal");
        // primary on a dual-stack node: one address per family.
        assert_eq!(
            resolve(&[net("192.168.1.10/32"), net("fd00::10/128")], &local),
            NodePortAddresses::Ips(vec![ip("192.168.1.10"), ip("fd00::10")])
        );
        // primary on an IPv4-only node: IPv6 unrestricted, as upstream.
        assert_eq!(
            resolve(&[net("192.168.1.10/32")], &local),
            NodePortAddresses::Ips(vec![ip("192.168.1.10"), ip("::")])
        );
        // A CIDR list: every local address inside it, none outside.
        assert_eq!(
            resolve(&[net("192.168.0.0/16"), net("fd00::/64")], &local),
            NodePortAddresses::Ips(vec![
                ip("192.168.1.10"),
                ip("192.168.2.10"),
                ip("fd00::10"),
                ip("fd00::11")
            ])
        );
        // Matching nothing: that family answers nowhere.
        assert_eq!(
            resolve(&[net("172.16.0.0/12"), net("fd00::/64")], &local),
            NodePortAddresses::Ips(vec![ip("fd00::10"), ip("fd00::11")])
        );
        // 0.0.0.0/0 and ::/0 mean everything; no CIDR at all (primary without node IPs) too.
        assert_eq!(
            resolve(&[net("0.0.0.0/0"), net("::/0")], &local),
            NodePortAddresses::All
        );
        assert_eq!(resolve(&[], &local), NodePortAddresses::All);
        let some = resolve(&[net("0.0.0.0/0"), net("fd00::10/128")], &local);
        assert_eq!(some.for_family(IpFamily::V4), NodePortAddresses::All);
        assert_eq!(
            some.for_family(IpFamily::V6),
            NodePortAddresses::Ips(vec![ip("fd00::10")])
        );
    }
}
