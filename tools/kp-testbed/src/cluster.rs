//! The test cluster: building the namespaces, running commands and probing flows in them.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::addresses::{
    EXTERNAL_IN_V4, EXTERNAL_IN_V6, EXTERNAL_OUT_V4, EXTERNAL_OUT_V6, LINK_LOCAL_DEVICE,
    LINK_LOCAL_NODE_V4, LINK_LOCAL_PEER_V4, LINK_LOCAL_SERVICE_V4, LOAD_BALANCER_CIDR_V4,
    LOAD_BALANCER_CIDR_V6, LOCAL_POD_CIDR_V4, LOCAL_POD_CIDR_V6, NIC2_DEVICE, NODE_LO_VIP_V4,
    NODE_LO_VIP_V6, NODE_NIC2_V4, NODE_NIC2_V6, NODE_SECONDARY_V4, NODE_SECONDARY_V6, NODE_V4,
    NODE_V6, NODE2_V4, NODE2_V6, REMOTE_POD_CIDR_V4, REMOTE_POD_CIDR_V6, ROUTER_NIC2_V4,
    ROUTER_NIC2_V6, ROUTER_V4, ROUTER_V6, pod_v4, pod_v6,
};
use crate::command::{
    COMMAND_DEADLINE, check_prerequisites, describe, in_namespace, ip_batch, run, run_checked,
};
use crate::echo::{EchoServer, EchoSpec, echo_binary};
use crate::error::{Result, TestbedError};
use crate::netns::{NamespaceSet, exec_in, next_base, sweep_stale};
use crate::outcome::{BurstReport, Outcome, PeerReport, Protocol, Tally};
use crate::session::{Session, parse_outcome};

/// The namespace name prefix used unless [`ClusterBuilder::prefix`] says otherwise.
pub const DEFAULT_PREFIX: &str = "kpt-";

/// The port every pod's echo server answers on (TCP and UDP) unless configured otherwise.
pub const DEFAULT_ECHO_PORT: u16 = 8080;

/// The name of the in-cluster client pod every cluster has on this node.
pub const CLIENT_POD: &str = "client";

/// How long a probe waits for an answer before calling the flow `TimedOut`. Flows between
/// namespaces answer in well under a millisecond; a second leaves room for a loaded machine
/// while keeping "dropped" checks short.
const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Extra time the harness grants a probe process beyond its own timeouts, for
/// `ip netns exec` and process start-up on a loaded machine.
const PROBE_SLACK: Duration = Duration::from_secs(10);

/// Pod host numbers start at 2 (1 is the gateway) and must stay below the broadcast address.
const FIRST_POD_HOST: u8 = 2;
/// The most pods one node's /24 holds here.
const MAX_PODS_PER_NODE: usize = 250;
/// Pod names go into namespace names; short keeps `ip` output readable.
const MAX_POD_NAME_LEN: usize = 24;

/// What a namespace stands for in the topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// This node: the proxy under test runs here.
    Node,
    /// The other node, hosting remote pods.
    RemoteNode,
    /// `ext`: the LAN bridge and router to the external clients.
    Router,
    /// A client outside the cluster, behind the router.
    ExternalClient,
    /// A pod, on this node or on the remote node.
    Pod {
        /// Whether the pod lives on the remote node.
        remote: bool,
    },
}

/// One namespace of the cluster and its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    name: String,
    ns: String,
    ipv4: Ipv4Addr,
    ipv6: Option<Ipv6Addr>,
    role: Role,
}

impl Host {
    /// The short name (`node`, `node2`, `ext`, `external-in`, `external-out`, or the pod name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The network namespace name, for `ip netns exec` or a proxy started inside it.
    pub fn ns(&self) -> &str {
        &self.ns
    }

    /// The primary (IPv4) address.
    pub fn ip(&self) -> IpAddr {
        IpAddr::V4(self.ipv4)
    }

    /// The IPv4 address.
    pub fn ipv4(&self) -> Ipv4Addr {
        self.ipv4
    }

    /// The IPv6 address, when the cluster is dual-stack.
    pub fn ipv6(&self) -> Option<Ipv6Addr> {
        self.ipv6
    }

    /// What this namespace is.
    pub fn role(&self) -> Role {
        self.role
    }
}

/// Configures a [`Cluster`]; see [`Cluster::builder`].
#[derive(Debug, Clone)]
pub struct ClusterBuilder {
    prefix: String,
    pods: Vec<(String, bool)>,
    echo_tcp: Vec<u16>,
    echo_udp: Vec<u16>,
    echo_sctp: Vec<u16>,
    dual_stack: bool,
    probe_timeout: Duration,
    echo_binary: Option<PathBuf>,
    echo_args: Vec<String>,
    real_node_shape: bool,
    link_local: Option<LinkLocalScope>,
}

/// The scope of the node's address in the link-local node shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLocalScope {
    /// `scope global` (what `ip addr add` sets unless told otherwise): the kernel may use the
    /// address as the source towards any route.
    Global,
    /// `scope link`, as link-local configurators (systemd-networkd's IPv4LL, avahi-autoipd)
    /// set it: the kernel uses it as a source only on its own link, so the node has no
    /// source address for its pods' routes.
    Link,
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        Self {
            prefix: DEFAULT_PREFIX.to_owned(),
            pods: Vec::new(),
            echo_tcp: vec![DEFAULT_ECHO_PORT],
            echo_udp: vec![DEFAULT_ECHO_PORT],
            echo_sctp: Vec::new(),
            dual_stack: true,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
            echo_binary: None,
            echo_args: Vec::new(),
            link_local: None,
            real_node_shape: false,
        }
    }
}

impl ClusterBuilder {
    /// The namespace name prefix (default [`DEFAULT_PREFIX`]); names are
    /// `<prefix><pid>-<n>-<role>`.
    #[must_use]
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Adds a pod on this node, running an echo server that reports `name`.
    #[must_use]
    pub fn pod(mut self, name: impl Into<String>) -> Self {
        self.pods.push((name.into(), false));
        self
    }

    /// Adds a pod on the remote node (`node2`).
    #[must_use]
    pub fn remote_pod(mut self, name: impl Into<String>) -> Self {
        self.pods.push((name.into(), true));
        self
    }

    /// The TCP ports every pod's echo server answers on (default [`DEFAULT_ECHO_PORT`]).
    #[must_use]
    pub fn echo_tcp_ports(mut self, ports: &[u16]) -> Self {
        self.echo_tcp = ports.to_vec();
        self
    }

    /// The UDP ports every pod's echo server answers on (default [`DEFAULT_ECHO_PORT`]).
    #[must_use]
    pub fn echo_udp_ports(mut self, ports: &[u16]) -> Self {
        self.echo_udp = ports.to_vec();
        self
    }

    /// The SCTP ports every pod's echo server answers on (default none: a kernel without
    /// SCTP sockets, like most CI hosts', could not start the servers otherwise).
    #[must_use]
    pub fn echo_sctp_ports(mut self, ports: &[u16]) -> Self {
        self.echo_sctp = ports.to_vec();
        self
    }

    /// Whether to configure IPv6 as well (default on).
    #[must_use]
    pub fn dual_stack(mut self, on: bool) -> Self {
        self.dual_stack = on;
        self
    }

    /// How long a probe waits before calling a flow `TimedOut` (default 1 s).
    #[must_use]
    pub fn probe_timeout(mut self, timeout: Duration) -> Self {
        self.probe_timeout = timeout;
        self
    }

    /// Where `kp-echo` is; default [`echo_binary`]. This crate's own tests pass
    /// `env!("CARGO_BIN_EXE_kp-echo")`.
    #[must_use]
    pub fn echo_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.echo_binary = Some(path.into());
        self
    }

    /// Runs the echo tool as `program ARGS... serve|probe|session ...` instead of `kp-echo`:
    /// for a binary that embeds [`crate::tool`] behind a subcommand (e.g. `kube-proxy`
    /// re-running itself, so no second binary needs to be built).
    #[must_use]
    pub fn echo_command(mut self, program: impl Into<PathBuf>, args: &[&str]) -> Self {
        self.echo_binary = Some(program.into());
        self.echo_args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    /// The link-local node shape: this node's only address is
    /// [`LINK_LOCAL_NODE_V4`]`/30` (the router holds the other end) with `scope`, it has no
    /// default route (only routes to the remote pods, the external clients and the load
    /// balancer range's clients, via the router), and its pods hang off veths without an
    /// address on the node's side, on `/32` routes, using the node's address as their
    /// gateway (the node answers ARP for it on every interface). IPv4 only (implies
    /// `dual_stack(false)`). The remote node, the router and the external clients are as
    /// usual; the router routes this node's pod subnet and the load balancer range to it.
    #[must_use]
    pub fn link_local_node(mut self, scope: LinkLocalScope) -> Self {
        self.link_local = Some(scope);
        self.dual_stack = false;
        // One shape at a time: this one replaces the LAN address the real shape builds on.
        self.real_node_shape = false;
        self
    }

    /// Shapes this node like real nodes (default off): besides `eth0` on the LAN, a second
    /// NIC `eth1` on a network of its own ([`crate::addresses::NIC2_CIDR_V4`]) that carries
    /// the default route, secondary addresses on `eth0`, a virtual IP on `lo`, and
    /// NodeLocal DNSCache's link-local service address on a dummy-like device. The node IP
    /// (`InternalIP`) stays [`NODE_V4`] / [`NODE_V6`], the source of the node's LAN traffic.
    /// The router reaches every one of them but the link-local address.
    #[must_use]
    pub fn real_node_shape(mut self, on: bool) -> Self {
        self.real_node_shape = on;
        self
    }

    /// Creates the namespaces, links, addresses, routes and echo servers.
    ///
    /// Fails with [`TestbedError::NotRoot`] or [`TestbedError::ToolMissing`] when the
    /// machine cannot host it, and removes whatever it created when any step fails. It
    /// first removes leftovers of crashed runs under the same prefix ([`sweep_stale`]).
    pub fn build(self) -> Result<Cluster> {
        check_prerequisites()?;
        let echo_binary = match self.echo_binary {
            Some(path) if path.is_file() => path,
            Some(path) => {
                return Err(TestbedError::EchoBinaryMissing {
                    searched: vec![path],
                });
            }
            None => echo_binary()?,
        };
        validate_prefix(&self.prefix)?;
        let swept = sweep_stale(&self.prefix)?;
        if !swept.is_empty() {
            tracing::info!(?swept, "removed namespaces of crashed earlier runs");
        }
        let base = next_base(&self.prefix);
        let v6 = |addr: Ipv6Addr| self.dual_stack.then_some(addr);
        let fixed = |name: &str, role, ipv4, ipv6| Host {
            name: name.to_owned(),
            ns: format!("{base}{name}"),
            ipv4,
            ipv6: v6(ipv6),
            role,
        };
        let mut local_hosts = FIRST_POD_HOST..;
        let mut remote_hosts = FIRST_POD_HOST..;
        let mut next_pod = |name: &str, remote: bool| -> Result<Host> {
            validate_pod_name(name)?;
            let (index, host) = if remote {
                (2, remote_hosts.next())
            } else {
                (1, local_hosts.next())
            };
            let host = host
                .filter(|h| usize::from(*h) < usize::from(FIRST_POD_HOST) + MAX_PODS_PER_NODE)
                .ok_or(TestbedError::TooManyPods {
                    max: MAX_PODS_PER_NODE,
                })?;
            Ok(Host {
                name: name.to_owned(),
                ns: format!("{base}p-{name}"),
                ipv4: pod_v4(index, host),
                ipv6: v6(pod_v6(index, host)),
                role: Role::Pod { remote },
            })
        };
        let client = next_pod(CLIENT_POD, false)?;
        let mut pods: Vec<Host> = Vec::new();
        for (name, remote) in &self.pods {
            if pods.iter().any(|p| &p.name == name) || name == CLIENT_POD {
                return Err(TestbedError::InvalidName {
                    name: name.clone(),
                    reason: "pod names must be unique (and `client` is taken)",
                });
            }
            pods.push(next_pod(name, *remote)?);
        }
        let mut cluster = Cluster {
            echoes: Mutex::new(BTreeMap::new()),
            namespaces: NamespaceSet::default(),
            prefix: base.clone(),
            echo_binary,
            echo_args: self.echo_args,
            probe_timeout: self.probe_timeout,
            dual_stack: self.dual_stack,
            real_node_shape: self.real_node_shape,
            router: fixed("ext", Role::Router, ROUTER_V4, ROUTER_V6),
            node: fixed(
                "node",
                Role::Node,
                if self.link_local.is_some() {
                    LINK_LOCAL_NODE_V4
                } else {
                    NODE_V4
                },
                NODE_V6,
            ),
            node2: fixed("node2", Role::RemoteNode, NODE2_V4, NODE2_V6),
            external_in: fixed(
                "external-in",
                Role::ExternalClient,
                EXTERNAL_IN_V4,
                EXTERNAL_IN_V6,
            ),
            external_out: fixed(
                "external-out",
                Role::ExternalClient,
                EXTERNAL_OUT_V4,
                EXTERNAL_OUT_V6,
            ),
            client,
            probe_cgroup: Mutex::new(None),
            pods,
            link_local: self.link_local,
        };
        // From here on, dropping `cluster` (on any error) removes what exists so far.
        cluster.set_up(&self.echo_tcp, &self.echo_udp, &self.echo_sctp)?;
        Ok(cluster)
    }
}

/// The only outcome of a one-flow probe.
fn first_outcome(tally: &Tally) -> Result<Outcome> {
    tally
        .outcomes()
        .first()
        .cloned()
        .ok_or_else(|| TestbedError::ProbeOutput {
            output: String::new(),
            detail: "no outcome".to_owned(),
        })
}

/// Prefixes end up in namespace names and are parsed back by [`sweep_stale`].
pub(crate) fn validate_prefix(prefix: &str) -> Result<()> {
    let fine = !prefix.is_empty()
        && prefix.ends_with('-')
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if fine {
        Ok(())
    } else {
        Err(TestbedError::InvalidName {
            name: prefix.to_owned(),
            reason: "a prefix is lowercase letters, digits and '-', ending in '-'",
        })
    }
}

/// Pod names end up in namespace names and command lines.
fn validate_pod_name(name: &str) -> Result<()> {
    let fine = !name.is_empty()
        && name.len() <= MAX_POD_NAME_LEN
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if fine {
        Ok(())
    } else {
        Err(TestbedError::InvalidName {
            name: name.to_owned(),
            reason: "a pod name is 1-24 lowercase letters, digits and '-'",
        })
    }
}

/// A small cluster of network namespaces; see the crate documentation for the topology.
///
/// Dropping it kills the echo servers and every process left in its namespaces, then
/// deletes the namespaces (which removes their veths).
#[derive(Debug)]
pub struct Cluster {
    // Field order is drop order: echo servers go before their namespaces.
    echoes: Mutex<BTreeMap<String, EchoServer>>,
    namespaces: NamespaceSet,
    prefix: String,
    echo_binary: PathBuf,
    echo_args: Vec<String>,
    probe_timeout: Duration,
    dual_stack: bool,
    real_node_shape: bool,
    router: Host,
    node: Host,
    node2: Host,
    external_in: Host,
    external_out: Host,
    client: Host,
    pods: Vec<Host>,
    link_local: Option<LinkLocalScope>,
    /// The cgroup v2 directory probes start in ([`Cluster::set_probe_cgroup`]).
    probe_cgroup: Mutex<Option<PathBuf>>,
}

/// `ip` commands to run inside one namespace, in order.
type Step = (String, String);

impl Cluster {
    /// Starts configuring a cluster.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    fn all_hosts(&self) -> impl Iterator<Item = &Host> {
        [
            &self.router,
            &self.node,
            &self.node2,
            &self.external_in,
            &self.external_out,
            &self.client,
        ]
        .into_iter()
        .chain(&self.pods)
    }

    fn set_up(&mut self, echo_tcp: &[u16], echo_udp: &[u16], echo_sctp: &[u16]) -> Result<()> {
        let hosts: Vec<Host> = self.all_hosts().cloned().collect();
        for host in &hosts {
            self.namespaces.create(&host.ns)?;
        }
        for host in &hosts {
            self.sysctls(host)?;
        }
        for phase in [self.link_steps(), self.address_steps(), self.route_steps()] {
            run_steps(&phase)?;
        }
        for pod in &self.pods {
            let mut spec = EchoSpec::new(pod.name.clone());
            for port in echo_tcp {
                spec = spec.tcp(*port);
            }
            for port in echo_udp {
                spec = spec.udp(*port);
            }
            for port in echo_sctp {
                spec = spec.sctp(*port);
            }
            self.start_echo(pod, spec)?;
        }
        Ok(())
    }

    /// Per-namespace kernel settings. New namespaces inherit some IPv4 settings from the
    /// host, so everything a flow depends on is set explicitly.
    fn sysctls(&self, host: &Host) -> Result<()> {
        let forwards = matches!(host.role, Role::Node | Role::RemoteNode | Role::Router);
        let mut settings = vec![
            // ICMP errors (port unreachable) must not be rate limited, or repeated
            // `Refused` probes turn into `TimedOut`.
            "net.ipv4.icmp_ratelimit=0",
            // Strict reverse-path filtering inherited from the host would drop asymmetric
            // flows the proxy under test is responsible for.
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ];
        if forwards {
            settings.push("net.ipv4.ip_forward=1");
        }
        if self.dual_stack {
            settings.extend([
                "net.ipv6.icmp.ratelimit=0",
                // Duplicate address detection would leave addresses unusable for a second.
                "net.ipv6.conf.all.accept_dad=0",
                "net.ipv6.conf.default.accept_dad=0",
            ]);
            if forwards {
                settings.push("net.ipv6.conf.all.forwarding=1");
            }
        }
        let mut command = in_namespace(&host.ns, "sysctl");
        command.arg("-q").arg("-w").args(settings);
        run_checked(&mut command, None, COMMAND_DEADLINE).map(drop)
    }

    /// The node a pod hangs off.
    fn node_of(&self, pod: &Host) -> &Host {
        if pod.role == (Role::Pod { remote: true }) {
            &self.node2
        } else {
            &self.node
        }
    }

    /// The pods (client included) with the name of their veth end in their node.
    fn pod_links(&self) -> impl Iterator<Item = (&Host, String)> {
        std::iter::once(&self.client)
            .chain(&self.pods)
            .enumerate()
            .map(|(index, pod)| (pod, format!("kpv{index}")))
    }

    /// Phase 1: veth pairs, each created inside one namespace with its peer placed directly
    /// into the other, so the host namespace never sees them.
    fn link_steps(&self) -> Vec<Step> {
        let ext = &self.router.ns;
        let mut steps = vec![(
            ext.clone(),
            "link add lan type bridge mcast_snooping 0".to_owned(),
        )];
        for (host, peer) in [
            (&self.node, "lan-node"),
            (&self.node2, "lan-node2"),
            (&self.external_in, "xin"),
            (&self.external_out, "xout"),
        ] {
            steps.push((
                host.ns.clone(),
                format!("link add eth0 type veth peer name {peer} netns {ext}"),
            ));
        }
        for (pod, peer) in self.pod_links() {
            steps.push((
                pod.ns.clone(),
                format!(
                    "link add eth0 type veth peer name {peer} netns {}",
                    self.node_of(pod).ns
                ),
            ));
        }
        if self.real_node_shape {
            let node = &self.node.ns;
            steps.push((
                node.clone(),
                format!("link add {NIC2_DEVICE} type veth peer name lan2-node netns {ext}"),
            ));
            // Dummy-like: a veth whose peer stays in the node, so nothing is behind it.
            steps.push((
                node.clone(),
                format!("link add {LINK_LOCAL_DEVICE} type veth peer name {LINK_LOCAL_DEVICE}-p"),
            ));
        }
        steps
    }

    /// Phase 2: addresses and links up.
    fn address_steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut add = |host: &Host, line: String| steps.push((host.ns.clone(), line));
        let v6 = self.dual_stack;
        let router = &self.router;
        add(router, format!("addr add {ROUTER_V4}/24 dev lan"));
        if self.link_local.is_some() {
            add(router, format!("addr add {LINK_LOCAL_PEER_V4}/30 dev lan"));
        }
        if v6 {
            add(router, format!("addr add {ROUTER_V6}/64 dev lan nodad"));
        }
        for port in ["lan-node", "lan-node2"] {
            add(router, format!("link set {port} master lan"));
            add(router, format!("link set {port} up"));
        }
        for (link, v4, v6_addr) in [
            ("xin", "203.0.113.1/25", "2001:db8:1::1/64"),
            ("xout", "203.0.113.129/25", "2001:db8:2::1/64"),
        ] {
            add(router, format!("addr add {v4} dev {link}"));
            if v6 {
                add(router, format!("addr add {v6_addr} dev {link} nodad"));
            }
            add(router, format!("link set {link} up"));
        }
        add(router, "link set lan up".to_owned());
        for (host, v4_len, v6_len) in [
            (&self.node, 24, 64),
            (&self.node2, 24, 64),
            (&self.external_in, 25, 64),
            (&self.external_out, 25, 64),
        ] {
            if host.role == Role::Node
                && let Some(scope) = self.link_local
            {
                let scope = match scope {
                    LinkLocalScope::Global => "global",
                    LinkLocalScope::Link => "link",
                };
                add(
                    host,
                    format!("addr add {}/30 dev eth0 scope {scope}", host.ipv4),
                );
                add(host, "link set eth0 up".to_owned());
                continue;
            }
            add(host, format!("addr add {}/{v4_len} dev eth0", host.ipv4));
            if let Some(addr) = host.ipv6 {
                add(host, format!("addr add {addr}/{v6_len} dev eth0 nodad"));
            }
            add(host, "link set eth0 up".to_owned());
        }
        let links: Vec<(Host, String)> = self
            .pod_links()
            .map(|(pod, link)| (pod.clone(), link))
            .collect();
        for (pod, link) in &links {
            let node = self.node_of(pod);
            let (gw4, gw6) = self.gateways(pod);
            if !self.address_less_veth(pod) {
                add(node, format!("addr add {gw4}/32 dev {link}"));
            }
            if v6 {
                add(node, format!("addr add {gw6}/128 dev {link} nodad"));
            }
            add(node, format!("link set {link} up"));
            add(pod, format!("addr add {}/32 dev eth0", pod.ipv4));
            if let Some(addr) = pod.ipv6 {
                add(pod, format!("addr add {addr}/128 dev eth0 nodad"));
            }
            add(pod, "link set eth0 up".to_owned());
        }
        for host in self.all_hosts() {
            add(host, "link set lo up".to_owned());
        }
        if self.real_node_shape {
            let node = &self.node;
            add(
                router,
                format!("addr add {ROUTER_NIC2_V4}/24 dev lan2-node"),
            );
            add(
                node,
                format!("addr add {NODE_NIC2_V4}/24 dev {NIC2_DEVICE}"),
            );
            // Added after the primary address: the kernel marks them secondary.
            add(node, format!("addr add {NODE_SECONDARY_V4}/24 dev eth0"));
            add(node, format!("addr add {NODE_LO_VIP_V4}/32 dev lo"));
            add(
                node,
                format!("addr add {LINK_LOCAL_SERVICE_V4}/32 dev {LINK_LOCAL_DEVICE}"),
            );
            if v6 {
                add(
                    router,
                    format!("addr add {ROUTER_NIC2_V6}/64 dev lan2-node nodad"),
                );
                add(
                    node,
                    format!("addr add {NODE_NIC2_V6}/64 dev {NIC2_DEVICE} nodad"),
                );
                add(
                    node,
                    format!("addr add {NODE_SECONDARY_V6}/64 dev eth0 nodad"),
                );
                add(node, format!("addr add {NODE_LO_VIP_V6}/128 dev lo"));
            }
            add(router, "link set lan2-node up".to_owned());
            for link in [
                NIC2_DEVICE,
                LINK_LOCAL_DEVICE,
                &format!("{LINK_LOCAL_DEVICE}-p"),
            ] {
                add(node, format!("link set {link} up"));
            }
        }
        steps
    }

    /// Phase 3: routes (after every link is up, so gateways are reachable).
    fn route_steps(&self) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut add = |host: &Host, line: String| steps.push((host.ns.clone(), line));
        let v6 = self.dual_stack;
        if self.link_local.is_some() {
            // No default route: the remote pods and the external clients via the router,
            // which routes this node's pod subnet and the load balancer range back here.
            for cidr in [REMOTE_POD_CIDR_V4, "203.0.113.0/24"] {
                add(
                    &self.node,
                    format!("route add {cidr} via {LINK_LOCAL_PEER_V4}"),
                );
            }
            add(&self.node2, format!("route add default via {ROUTER_V4}"));
            for (cidr, via) in [
                (LOCAL_POD_CIDR_V4, LINK_LOCAL_NODE_V4),
                (REMOTE_POD_CIDR_V4, NODE2_V4),
            ] {
                add(&self.router, format!("route add {cidr} via {via}"));
            }
        }
        let nodes = [
            (
                &self.node,
                REMOTE_POD_CIDR_V4,
                REMOTE_POD_CIDR_V6,
                NODE2_V4,
                NODE2_V6,
            ),
            (
                &self.node2,
                LOCAL_POD_CIDR_V4,
                LOCAL_POD_CIDR_V6,
                NODE_V4,
                NODE_V6,
            ),
        ];
        let skip = usize::from(self.link_local.is_some()) * nodes.len();
        for (node, other_cidr4, other_cidr6, other_node4, other_node6) in
            nodes.into_iter().skip(skip)
        {
            // A real-shaped node's default route leaves through its second NIC.
            let (gw4, gw6) = if self.real_node_shape && node.role == Role::Node {
                (ROUTER_NIC2_V4, ROUTER_NIC2_V6)
            } else {
                (ROUTER_V4, ROUTER_V6)
            };
            add(node, format!("route add default via {gw4}"));
            add(node, format!("route add {other_cidr4} via {other_node4}"));
            if v6 {
                add(node, format!("route add default via {gw6}"));
                add(node, format!("route add {other_cidr6} via {other_node6}"));
            }
        }
        for (client, gw4, gw6) in [
            (&self.external_in, "203.0.113.1", "2001:db8:1::1"),
            (&self.external_out, "203.0.113.129", "2001:db8:2::1"),
        ] {
            add(client, format!("route add default via {gw4}"));
            if v6 {
                add(client, format!("route add default via {gw6}"));
            }
        }
        add(
            &self.router,
            format!("route add {LOAD_BALANCER_CIDR_V4} via {}", self.node.ipv4),
        );
        if self.real_node_shape {
            add(
                &self.router,
                format!("route add {NODE_LO_VIP_V4}/32 via {NODE_V4}"),
            );
            if v6 {
                add(
                    &self.router,
                    format!("route add {NODE_LO_VIP_V6}/128 via {NODE_V6}"),
                );
            }
        }
        if v6 {
            add(
                &self.router,
                format!("route add {LOAD_BALANCER_CIDR_V6} via {NODE_V6}"),
            );
        }
        let links: Vec<(Host, String)> = self
            .pod_links()
            .map(|(pod, link)| (pod.clone(), link))
            .collect();
        for (pod, link) in &links {
            let node = self.node_of(pod);
            let (gw4, gw6) = self.gateways(pod);
            add(node, format!("route add {}/32 dev {link}", pod.ipv4));
            add(pod, format!("route add {gw4}/32 dev eth0 scope link"));
            add(pod, format!("route add default via {gw4} dev eth0"));
            if let Some(addr) = pod.ipv6 {
                add(node, format!("route add {addr}/128 dev {link}"));
                add(pod, format!("route add {gw6}/128 dev eth0"));
                add(pod, format!("route add default via {gw6} dev eth0"));
            }
        }
        steps
    }

    /// The namespace prefix of this cluster (`<prefix><pid>-<n>-`): every namespace it
    /// created starts with it.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The names of every namespace of this cluster.
    pub fn namespaces(&self) -> Vec<&str> {
        self.all_hosts().map(Host::ns).collect()
    }

    /// This node (the proxy under test runs in its namespace).
    pub fn node(&self) -> &Host {
        &self.node
    }

    /// This node's namespace.
    pub fn node_ns(&self) -> &str {
        &self.node.ns
    }

    /// This node's IP.
    pub fn node_ip(&self) -> IpAddr {
        self.node.ip()
    }

    /// The remote node.
    pub fn node2(&self) -> &Host {
        &self.node2
    }

    /// `ext`: the LAN bridge and router (also usable as a client on the node LAN).
    pub fn router(&self) -> &Host {
        &self.router
    }

    /// The external client inside [`crate::addresses::EXTERNAL_IN_RANGE_V4`].
    pub fn external_in(&self) -> &Host {
        &self.external_in
    }

    /// The external client outside that range.
    pub fn external_out(&self) -> &Host {
        &self.external_out
    }

    /// The in-cluster client pod on this node (no echo server).
    pub fn client(&self) -> &Host {
        &self.client
    }

    /// A pod by name (the client pod is [`CLIENT_POD`]).
    pub fn pod(&self, name: &str) -> Result<&Host> {
        std::iter::once(&self.client)
            .chain(&self.pods)
            .find(|p| p.name == name)
            .ok_or_else(|| TestbedError::UnknownPod {
                name: name.to_owned(),
            })
    }

    /// The pods the builder asked for (without the client), in that order.
    pub fn pods(&self) -> &[Host] {
        &self.pods
    }

    /// Whether the cluster has IPv6 addresses too.
    pub fn dual_stack(&self) -> bool {
        self.dual_stack
    }

    /// Whether this node is shaped like real nodes ([`ClusterBuilder::real_node_shape`]).
    pub fn real_node_shape(&self) -> bool {
        self.real_node_shape
    }

    /// The probe timeout in force.
    pub fn probe_timeout(&self) -> Duration {
        self.probe_timeout
    }

    /// The `kp-echo` binary in use (also handy to start more helpers).
    pub fn echo_binary_path(&self) -> &Path {
        &self.echo_binary
    }

    /// The echo tool inside `ns`, ready for its subcommand.
    fn echo_tool(&self, ns: &str) -> std::process::Command {
        let cgroup = self
            .probe_cgroup
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut command = match cgroup {
            // The shell joins the cgroup before `ip netns exec` (which remounts /sys, hiding
            // the cgroup mount); the prober inherits it, so its sockets are created inside.
            Some(cgroup) => {
                let mut command = std::process::Command::new("sh");
                command
                    .args(["-c", r#"echo $$ > "$0/cgroup.procs" && exec "$@""#])
                    .arg(cgroup)
                    .args(["ip", "netns", "exec", ns])
                    .arg(&self.echo_binary);
                command
            }
            None => in_namespace(ns, &self.echo_binary),
        };
        command.args(&self.echo_args);
        command
    }

    /// Makes probes ([`Cluster::probe`], [`Cluster::tcp`], [`Cluster::peer`], sessions, ...)
    /// start inside the cgroup v2 directory `cgroup` (`None`: where this process is), as
    /// pods' processes do: programs attached to it (the socket load balancer's) then see
    /// their sockets. Echo servers are not moved.
    pub fn set_probe_cgroup(&self, cgroup: Option<PathBuf>) {
        *self
            .probe_cgroup
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = cgroup;
    }

    /// One flow from `from` to `dst`, with the Service-side address its socket reports
    /// ([`PeerReport`]): TCP's `getpeername()`, or for UDP the source of the answer to a
    /// datagram sent with `sendto()` on an unconnected socket.
    pub fn peer(&self, from: &Host, protocol: Protocol, dst: SocketAddr) -> Result<PeerReport> {
        self.own_namespace(&from.ns)?;
        let mut command = self.flow_tool(&from.ns, "peer", protocol, dst);
        let deadline = self
            .probe_timeout
            .saturating_mul(2)
            .saturating_add(PROBE_SLACK);
        let stdout = finish(&mut command, deadline)?;
        serde_json::from_str(stdout.trim()).map_err(|e| TestbedError::ProbeOutput {
            output: stdout.clone(),
            detail: e.to_string(),
        })
    }

    /// `kp-echo SUBCOMMAND --proto PROTOCOL --to DST --timeout-ms ...` inside `ns`.
    fn flow_tool(
        &self,
        ns: &str,
        subcommand: &str,
        protocol: Protocol,
        dst: SocketAddr,
    ) -> std::process::Command {
        let mut command = self.echo_tool(ns);
        command.args([
            subcommand.to_owned(),
            "--proto".to_owned(),
            protocol.to_string(),
            "--to".to_owned(),
            dst.to_string(),
            "--timeout-ms".to_owned(),
            self.probe_timeout.as_millis().to_string(),
        ]);
        command
    }

    fn own_namespace(&self, ns: &str) -> Result<()> {
        if self.namespaces.contains(ns) {
            Ok(())
        } else {
            Err(TestbedError::UnknownNamespace { ns: ns.to_owned() })
        }
    }

    /// Runs `args` inside namespace `ns` of this cluster (e.g.
    /// `cluster.exec(cluster.node_ns(), &["iptables-save"])`) and returns its standard
    /// output; a non-zero exit is [`TestbedError::CommandFailed`].
    pub fn exec(&self, ns: &str, args: &[&str]) -> Result<String> {
        self.exec_with_input(ns, args, None)
    }

    /// Like [`Cluster::exec`], feeding `input` on standard input (e.g. `iptables-restore`).
    pub fn exec_with_input(&self, ns: &str, args: &[&str], input: Option<&str>) -> Result<String> {
        self.own_namespace(ns)?;
        exec_in(ns, args, input)
    }

    fn echoes(&self) -> MutexGuard<'_, BTreeMap<String, EchoServer>> {
        // A panic elsewhere never leaves the map half-updated.
        self.echoes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts an echo server inside `on` (a pod, or e.g. the node for a host-network
    /// backend) and waits until it listens. Its name must not be in use.
    pub fn start_echo(&self, on: &Host, spec: EchoSpec) -> Result<()> {
        self.own_namespace(&on.ns)?;
        validate_pod_name(spec.name())?;
        let mut spec = spec;
        if spec.udp_bind_addrs().is_empty() {
            spec = spec.udp_bind(on.ip());
            if let Some(v6) = on.ipv6 {
                spec = spec.udp_bind(IpAddr::V6(v6));
            }
        }
        let mut echoes = self.echoes();
        if echoes.contains_key(spec.name()) {
            return Err(TestbedError::InvalidName {
                name: spec.name().to_owned(),
                reason: "an echo server of that name is already running",
            });
        }
        let name = spec.name().to_owned();
        let server = EchoServer::start(&self.echo_binary, &self.echo_args, &on.ns, spec)?;
        echoes.insert(name, server);
        Ok(())
    }

    /// Stops (kills) the echo server `name`; its ports then refuse connections.
    pub fn stop_echo(&self, name: &str) -> Result<()> {
        self.echoes()
            .remove(name)
            .map(drop)
            .ok_or_else(|| TestbedError::UnknownEcho {
                name: name.to_owned(),
            })
    }

    /// Restarts the echo server `name` in the same namespace with the same ports.
    pub fn restart_echo(&self, name: &str) -> Result<()> {
        let mut echoes = self.echoes();
        let old = echoes
            .remove(name)
            .ok_or_else(|| TestbedError::UnknownEcho {
                name: name.to_owned(),
            })?;
        let (ns, spec) = (old.ns().to_owned(), old.spec().clone());
        drop(old);
        let server = EchoServer::start(&self.echo_binary, &self.echo_args, &ns, spec)?;
        echoes.insert(name.to_owned(), server);
        Ok(())
    }

    /// Runs `count` flows of `protocol` from `from` to `dst`, one after another, each from a
    /// fresh socket (so a new source port and a new conntrack entry).
    pub fn probe(
        &self,
        from: &Host,
        protocol: Protocol,
        dst: SocketAddr,
        count: usize,
    ) -> Result<Tally> {
        self.probe_with(from, protocol, dst, count, &[])
    }

    /// One UDP datagram from `from`'s source port `sport` to `dst`, and its answer. Unlike
    /// [`Cluster::udp`] (a new source port each time), repeated calls keep the flow's
    /// 5-tuple, so they show what a stale conntrack (or IPVS) entry does to a client.
    pub fn udp_from_port(&self, from: &Host, dst: SocketAddr, sport: u16) -> Result<Outcome> {
        let tally = self.probe_with(
            from,
            Protocol::Udp,
            dst,
            1,
            &["--source-port".to_owned(), sport.to_string()],
        )?;
        first_outcome(&tally)
    }

    fn probe_with(
        &self,
        from: &Host,
        protocol: Protocol,
        dst: SocketAddr,
        count: usize,
        extra: &[String],
    ) -> Result<Tally> {
        self.own_namespace(&from.ns)?;
        // Namespaces share the kernel, so this process's answer holds for `from` too.
        if protocol == Protocol::Sctp && !crate::tool::sctp_supported() {
            return Err(TestbedError::SctpUnsupported);
        }
        if count == 0 {
            return Ok(Tally::new(Vec::new()));
        }
        let mut command = self.flow_tool(&from.ns, "probe", protocol, dst);
        command.args(["--count".to_owned(), count.to_string()]);
        command.args(extra);
        // Each flow may wait for a connect and then for a reply.
        let per_flow = self.probe_timeout.saturating_mul(2);
        let flows = u32::try_from(count).unwrap_or(u32::MAX);
        let deadline = per_flow.saturating_mul(flows).saturating_add(PROBE_SLACK);
        let stdout = finish(&mut command, deadline)?;
        let outcomes = stdout
            .lines()
            .map(parse_outcome)
            .collect::<Result<Vec<_>>>()?;
        if outcomes.len() != count {
            return Err(TestbedError::ProbeOutput {
                output: stdout,
                detail: format!("expected {count} outcomes, got {}", outcomes.len()),
            });
        }
        Ok(Tally::new(outcomes))
    }

    fn probe_one(&self, from: &Host, protocol: Protocol, dst: SocketAddr) -> Result<Outcome> {
        first_outcome(&self.probe(from, protocol, dst, 1)?)
    }

    /// One TCP connection from `from` to `dst:port`: `Answered` once the echo server's
    /// greeting arrives.
    pub fn tcp(&self, from: &Host, dst: IpAddr, port: u16) -> Result<Outcome> {
        self.probe_one(from, Protocol::Tcp, SocketAddr::new(dst, port))
    }

    /// One UDP datagram from `from` to `dst:port`, and its answer.
    pub fn udp(&self, from: &Host, dst: IpAddr, port: u16) -> Result<Outcome> {
        self.probe_one(from, Protocol::Udp, SocketAddr::new(dst, port))
    }

    /// One SCTP association (one-to-one style socket) from `from` to `dst:port`: `Answered`
    /// once the echo server's greeting arrives. [`TestbedError::SctpUnsupported`] on a
    /// kernel without SCTP sockets.
    pub fn sctp(&self, from: &Host, dst: IpAddr, port: u16) -> Result<Outcome> {
        self.probe_one(from, Protocol::Sctp, SocketAddr::new(dst, port))
    }

    /// `n` SCTP associations, each from a new source port.
    pub fn sctp_repeat(&self, from: &Host, dst: IpAddr, port: u16, n: usize) -> Result<Tally> {
        self.probe(from, Protocol::Sctp, SocketAddr::new(dst, port), n)
    }

    /// `n` TCP connections, each from a new source port.
    pub fn tcp_repeat(&self, from: &Host, dst: IpAddr, port: u16, n: usize) -> Result<Tally> {
        self.probe(from, Protocol::Tcp, SocketAddr::new(dst, port), n)
    }

    /// [`Cluster::tcp_repeat`] with `interval` between connections, on a thread of its own,
    /// so the test can act meanwhile (restart the proxy under this load); join the handle
    /// for the tally.
    pub fn tcp_repeat_in_background(
        &self,
        from: &Host,
        dst: SocketAddr,
        n: usize,
        interval: Duration,
    ) -> Result<std::thread::JoinHandle<Result<Tally>>> {
        self.own_namespace(&from.ns)?;
        let mut command = self.flow_tool(&from.ns, "probe", Protocol::Tcp, dst);
        command.args(["--count".to_owned(), n.to_string()]);
        command.args(["--interval-ms".to_owned(), interval.as_millis().to_string()]);
        let flows = u32::try_from(n).unwrap_or(u32::MAX);
        let deadline = self
            .probe_timeout
            .saturating_mul(2)
            .saturating_add(interval)
            .saturating_mul(flows)
            .saturating_add(PROBE_SLACK);
        Ok(std::thread::spawn(move || {
            let stdout = finish(&mut command, deadline)?;
            let outcomes = stdout
                .lines()
                .map(parse_outcome)
                .collect::<Result<Vec<_>>>()?;
            Ok(Tally::new(outcomes))
        }))
    }

    /// `n` UDP exchanges, each from a new source port.
    pub fn udp_repeat(&self, from: &Host, dst: IpAddr, port: u16, n: usize) -> Result<Tally> {
        self.probe(from, Protocol::Udp, SocketAddr::new(dst, port), n)
    }

    /// Opens a long-lived TCP connection from `from` to `dst:port`; check
    /// [`Session::greeting`] for whether it connected.
    pub fn connect(&self, from: &Host, dst: IpAddr, port: u16) -> Result<Session> {
        self.session(from, SocketAddr::new(dst, port), "tcp")
    }

    /// Opens a connected UDP socket from `from` to `dst:port` (`kp-echo session --proto
    /// udp`): the greeting is the answer to a first datagram; after a failed call the helper
    /// connects the socket again, as an application would, and prints the failure.
    pub fn connect_udp(&self, from: &Host, dst: IpAddr, port: u16) -> Result<Session> {
        self.session(from, SocketAddr::new(dst, port), "udp")
    }

    /// `kp-echo session --proto PROTO` from `from` to `to`.
    fn session(&self, from: &Host, to: SocketAddr, proto: &str) -> Result<Session> {
        self.own_namespace(&from.ns)?;
        let mut command = self.echo_tool(&from.ns);
        command
            .args([
                "session".to_owned(),
                "--proto".to_owned(),
                proto.to_owned(),
                "--to".to_owned(),
                to.to_string(),
                "--timeout-ms".to_owned(),
                self.probe_timeout.as_millis().to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let child = command.spawn().map_err(|source| TestbedError::Spawn {
            command: describe(&command),
            source,
        })?;
        Session::open(
            child,
            self.probe_timeout
                .saturating_mul(2)
                .saturating_add(PROBE_SLACK),
        )
    }

    /// Resolver-like UDP queries from `from` to `dst` ([`BurstReport`]): `sockets` sockets
    /// of `per_socket` queries each, sent two at a time.
    pub fn udp_burst(
        &self,
        from: &Host,
        dst: SocketAddr,
        sockets: usize,
        per_socket: usize,
    ) -> Result<BurstReport> {
        self.own_namespace(&from.ns)?;
        let mut command = self.echo_tool(&from.ns);
        command.args([
            "burst".to_owned(),
            "--to".to_owned(),
            dst.to_string(),
            "--sockets".to_owned(),
            sockets.to_string(),
            "--per-socket".to_owned(),
            per_socket.to_string(),
            "--timeout-ms".to_owned(),
            self.probe_timeout.as_millis().to_string(),
        ]);
        // Every pair may wait for its timeout at worst.
        let pairs = u32::try_from(per_socket.div_ceil(2)).unwrap_or(u32::MAX);
        let deadline = self
            .probe_timeout
            .saturating_mul(pairs.saturating_mul(2))
            .saturating_add(PROBE_SLACK);
        let stdout = finish(&mut command, deadline)?;
        serde_json::from_str(stdout.trim()).map_err(|e| TestbedError::ProbeOutput {
            output: stdout.clone(),
            detail: e.to_string(),
        })
    }

    /// Tears the cluster down now, reporting failures (dropping it does the same silently,
    /// apart from a message on standard error).
    pub fn teardown(mut self) -> Result<()> {
        self.echoes().clear();
        self.namespaces.remove_all()
    }
}

/// Runs a `kp-echo` flow command within `deadline`; its standard output, or why it failed.
fn finish(command: &mut std::process::Command, deadline: Duration) -> Result<String> {
    let finished = run(command, None, deadline)?;
    if !finished.status.success() {
        return Err(TestbedError::CommandFailed {
            command: describe(command),
            status: finished.status.to_string(),
            stderr: finished.stderr.trim().to_owned(),
        });
    }
    Ok(finished.stdout)
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Echo servers first: a namespace with processes inside outlives `ip netns delete`.
        self.echoes().clear();
    }
}

impl Cluster {
    /// Whether the node's end of `pod`'s veth has no address (this node's pods in the
    /// link-local shape).
    fn address_less_veth(&self, pod: &Host) -> bool {
        self.link_local.is_some() && pod.role == (Role::Pod { remote: false })
    }

    /// The gateway addresses for a pod: the node's end of its veth, or in the link-local
    /// shape this node's own address.
    fn gateways(&self, pod: &Host) -> (Ipv4Addr, Ipv6Addr) {
        let node_index = if pod.role == (Role::Pod { remote: true }) {
            2
        } else {
            1
        };
        let v4 = if self.address_less_veth(pod) {
            self.node.ipv4
        } else {
            pod_v4(node_index, 1)
        };
        (v4, pod_v6(node_index, 1))
    }
}

/// Runs steps, batching consecutive lines for the same namespace into one `ip` call.
fn run_steps(steps: &[Step]) -> Result<()> {
    let mut index = 0;
    while let Some((ns, _)) = steps.get(index) {
        let lines: Vec<String> = steps[index..]
            .iter()
            .take_while(|(other, _)| other == ns)
            .map(|(_, line)| line.clone())
            .collect();
        index += lines.len();
        ip_batch(ns, &lines)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(validate_pod_name("pod-a").is_ok());
        assert!(validate_pod_name("").is_err());
        assert!(validate_pod_name("Pod").is_err());
        assert!(validate_pod_name("a b").is_err());
        assert!(validate_pod_name(&"x".repeat(MAX_POD_NAME_LEN + 1)).is_err());
        assert!(validate_prefix("kpt-").is_ok());
        assert!(validate_prefix("kpt").is_err());
    }
}
