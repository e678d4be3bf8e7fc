//! Helpers of the traffic suite: the proxy mode under test, manifests for the harness's
//! cluster, the real `kube-proxy` binary running inside the node namespace, and a probe the
//! harness does not offer (an HTTP GET for health-check node ports).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kp_dataplane::iptables::netlink::{self, NETLINK_ENV};
use kp_testbed::proxy::{FIRST_SYNC_LOG, ProxyLaunch, ProxyProcess, SYNCED_LOG};
use kp_testbed::{Cluster, DEFAULT_ECHO_PORT, Host, Outcome, Role, Tally};

/// This node's name (`--hostname-override`, and `nodeName` of local endpoints).
pub const THIS_NODE: &str = "kpt-node";
/// The remote node's name (`nodeName` of endpoints on `node2`).
pub const OTHER_NODE: &str = "kpt-node2";
/// `--cluster-cidr` as the brief's command line has it (IPv4 pod network only).
pub const CLUSTER_CIDR_V4: &str = "10.244.0.0/16";
/// `--cluster-cidr` for a dual-stack cluster (the harness's IPv6 pod network included).
pub const CLUSTER_CIDR_DUAL: &str = "10.244.0.0/16,fd00:10:244::/48";
/// The node's address on every local pod's veth (the harness gives `.1` of this node's pod
/// subnet to the node end of each veth): what a masqueraded flow to a local pod shows.
pub const NODE_POD_GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
/// The name prefix of the node ends of the harness's pod veths (`kpv0` is the client's,
/// `kpv1`, ... the other pods'), for `--pod-interface-name-prefix`.
pub const POD_VETH_PREFIX: &str = "kpv";
/// The IPv6 counterpart of [`NODE_POD_GATEWAY_V4`].
pub const NODE_POD_GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 1);

/// How long the proxy may take for something it does within a second or two.
const PATIENCE: Duration = Duration::from_secs(30);

/// [`PATIENCE`] inside the test VM: software emulation on a loaded 2-core machine runs the
/// proxy's tools several times slower (seen: one `iptables` call 1-2 s, a first ipvs-mode
/// sync over 30 s at load 19).
const GUEST_PATIENCE: Duration = Duration::from_secs(120);

/// How long to wait for something the proxy should do soon, here or in the test VM;
/// `$KP_TEST_PATIENCE_SECS` for runs by hand at sizes that take longer (a 10k first sync in a
/// debug build).
fn patience() -> Duration {
    if let Some(secs) = std::env::var("KP_TEST_PATIENCE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Duration::from_secs(secs)
    } else if kp_vm::in_guest() {
        GUEST_PATIENCE
    } else {
        PATIENCE
    }
}
/// How many proxy log lines a failure message shows.
const LOG_TAIL: usize = 60;

/// A proxy mode the suite runs against. Each mode says how to start it and how to show
/// what it programmed when an assertion fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `--proxy-mode=iptables` (over nf_tables netlink where the host's iptables is the
    /// verified nf_tables version, `iptables-restore` otherwise).
    Iptables,
    /// `--proxy-mode=iptables` with the netlink path forced off
    /// (`KUBE_PROXY_RS_IPTABLES_NETLINK=off`): the `iptables-restore` fallback.
    IptablesRestore,
    /// `--proxy-mode=nftables` as a fresh install runs it: the verdict-free layout.
    Nftables,
    /// `--proxy-mode=nftables --nftables-layout=chains`: a chain per service and endpoint,
    /// as upstream.
    NftablesChains,
    /// `--proxy-mode=userspace`: the relay, with iptables rules redirecting to it.
    Userspace,
    /// `--proxy-mode=ipvs`: only inside the kp-vm guest (this machine's kernel has no IPVS,
    /// where the binary would fall back to iptables).
    Ipvs,
}

impl Mode {
    /// The `--proxy-mode` value.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Iptables | Mode::IptablesRestore => "iptables",
            Mode::NftablesChains | Mode::Nftables => "nftables",
            Mode::Userspace => "userspace",
            Mode::Ipvs => "ipvs",
        }
    }

    /// nftables mode, whichever layout it writes.
    pub fn is_nftables(self) -> bool {
        matches!(self, Mode::NftablesChains | Mode::Nftables)
    }

    /// iptables mode, whichever way its rules are written.
    pub fn is_iptables(self) -> bool {
        matches!(self, Mode::Iptables | Mode::IptablesRestore)
    }

    /// Flags this mode needs besides the common ones (sync immediately on every change).
    fn flags(self) -> Vec<String> {
        match self {
            // Upstream has no nftables flag of its own: this one sets both modes' period.
            Mode::Iptables | Mode::IptablesRestore | Mode::Nftables | Mode::Userspace => {
                vec!["--iptables-min-sync-period=0s".to_owned()]
            }
            Mode::NftablesChains => vec![
                "--iptables-min-sync-period=0s".to_owned(),
                "--nftables-layout=chains".to_owned(),
            ],
            Mode::Ipvs => vec![
                "--iptables-min-sync-period=0s".to_owned(),
                "--ipvs-min-sync-period=0s".to_owned(),
            ],
        }
    }

    /// What the mode programmed in the node namespace, for failure messages.
    fn dump(self, cluster: &Cluster) -> String {
        let tools: &[&[&str]] = match self {
            Mode::Iptables | Mode::IptablesRestore | Mode::Userspace => {
                &[&["iptables-save"], &["ip6tables-save"]]
            }
            Mode::NftablesChains | Mode::Nftables => &[&["nft", "list", "ruleset"]],
            Mode::Ipvs => &[&["ipvsadm", "-Ln"], &["ipset", "list"], &["iptables-save"]],
        };
        tools
            .iter()
            .map(|tool| {
                cluster
                    .exec(cluster.node_ns(), tool)
                    .unwrap_or_else(|e| format!("{tool:?} failed: {e}"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The first line of `iptables --version` on this host (empty if it cannot be run), as the
/// binary probes it.
fn host_iptables_version() -> String {
    std::process::Command::new("iptables")
        .arg("--version")
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .to_owned()
        })
        .unwrap_or_default()
}

/// A free loopback port (bind :0, read it, release it). The proxy binds it inside the node
/// namespace, whose ports are all free anyway.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.local_addr().expect("local address").port()
}

// --- manifests --------------------------------------------------------------------------

/// One service port; the target port is always the echo servers' port.
#[derive(Debug, Clone)]
struct Port {
    name: String,
    protocol: &'static str,
    port: u16,
    node_port: Option<u16>,
}

/// A Service and its one EndpointSlice, written as one manifest file.
#[derive(Debug, Clone)]
pub struct Service {
    name: String,
    namespace: String,
    cluster_ip: IpAddr,
    ports: Vec<Port>,
    load_balancer_ips: Vec<IpAddr>,
    external_ips: Vec<IpAddr>,
    source_ranges: Vec<String>,
    etp_local_health_port: Option<u16>,
    itp_local: bool,
    affinity_seconds: Option<u32>,
    /// Each endpoint's address, node and conditions (`None`: ready, the default).
    endpoints: Vec<(IpAddr, &'static str, Option<&'static str>)>,
}

impl Service {
    /// A ClusterIP service `name` (namespace `default`) at `cluster_ip`, without ports yet.
    pub fn new(name: &str, cluster_ip: &str) -> Self {
        Self {
            name: name.to_owned(),
            namespace: "default".to_owned(),
            cluster_ip: cluster_ip.parse().expect("literal cluster IP"),
            ports: Vec::new(),
            load_balancer_ips: Vec::new(),
            external_ips: Vec::new(),
            source_ranges: Vec::new(),
            etp_local_health_port: None,
            itp_local: false,
            affinity_seconds: None,
            endpoints: Vec::new(),
        }
    }

    /// Adds TCP port `port` (named `tcp`) -> echo port.
    pub fn tcp(mut self, port: u16) -> Self {
        self.ports.push(Port {
            name: "tcp".to_owned(),
            protocol: "TCP",
            port,
            node_port: None,
        });
        self
    }

    /// Adds UDP port `port` (named `udp`) -> echo port.
    pub fn udp(mut self, port: u16) -> Self {
        self.ports.push(Port {
            name: "udp".to_owned(),
            protocol: "UDP",
            port,
            node_port: None,
        });
        self
    }

    /// Adds SCTP port `port` (named `sctp`) -> echo port. Only a kernel with SCTP sockets
    /// (the kp-vm guest's) can probe it.
    pub fn sctp(mut self, port: u16) -> Self {
        self.ports.push(Port {
            name: "sctp".to_owned(),
            protocol: "SCTP",
            port,
            node_port: None,
        });
        self
    }

    /// Renames the last added port (in the Service and its EndpointSlice alike). The name
    /// is written as a quoted YAML scalar, so any text goes.
    pub fn port_name(mut self, name: &str) -> Self {
        self.ports.last_mut().expect("port_name after a port").name = name.to_owned();
        self
    }

    /// Puts the Service and its EndpointSlice into `namespace` instead of `default`.
    pub fn namespace(mut self, namespace: &str) -> Self {
        namespace.clone_into(&mut self.namespace);
        self
    }

    /// Gives the last added port a node port (and makes the service a NodePort).
    pub fn node_port(mut self, node_port: u16) -> Self {
        self.ports
            .last_mut()
            .expect("node_port after a port")
            .node_port = Some(node_port);
        self
    }

    /// Makes it a LoadBalancer with ingress IP `ip` in its status.
    pub fn load_balancer(mut self, ip: &str) -> Self {
        self.load_balancer_ips
            .push(ip.parse().expect("literal LB IP"));
        self
    }

    /// Adds an externalIP.
    pub fn external_ip(mut self, ip: &str) -> Self {
        self.external_ips
            .push(ip.parse().expect("literal external IP"));
        self
    }

    /// Adds a loadBalancerSourceRanges entry.
    pub fn source_range(mut self, cidr: &str) -> Self {
        self.source_ranges.push(cidr.to_owned());
        self
    }

    /// externalTrafficPolicy Local, with this healthCheckNodePort.
    pub fn etp_local(mut self, health_check_node_port: u16) -> Self {
        self.etp_local_health_port = Some(health_check_node_port);
        self
    }

    /// internalTrafficPolicy Local.
    pub fn itp_local(mut self) -> Self {
        self.itp_local = true;
        self
    }

    /// sessionAffinity ClientIP with this timeout.
    pub fn affinity(mut self, seconds: u32) -> Self {
        self.affinity_seconds = Some(seconds);
        self
    }

    /// The EndpointSlice lists these pods (in the service's IP family), each with the
    /// `nodeName` of the node it runs on. No pods: an empty slice.
    pub fn endpoints(mut self, cluster: &Cluster, pods: &[&str]) -> Self {
        self.endpoints = self.pod_endpoints(cluster, pods, None);
        self
    }

    /// Adds these pods to the EndpointSlice as terminating endpoints, still `serving` or not.
    pub fn terminating_endpoints(
        mut self,
        cluster: &Cluster,
        pods: &[&str],
        serving: bool,
    ) -> Self {
        let conditions = if serving {
            "{ready: false, serving: true, terminating: true}"
        } else {
            "{ready: false, serving: false, terminating: true}"
        };
        let more = self.pod_endpoints(cluster, pods, Some(conditions));
        self.endpoints.extend(more);
        self
    }

    /// The endpoints of `pods` (in the service's IP family) with these conditions.
    fn pod_endpoints(
        &self,
        cluster: &Cluster,
        pods: &[&str],
        conditions: Option<&'static str>,
    ) -> Vec<(IpAddr, &'static str, Option<&'static str>)> {
        let v6 = self.cluster_ip.is_ipv6();
        pods.iter()
            .map(|name| {
                let pod = cluster.pod(name).expect("pod of this cluster");
                let ip = if v6 {
                    IpAddr::V6(pod.ipv6().expect("dual-stack cluster"))
                } else {
                    pod.ip()
                };
                (ip, node_name(pod), conditions)
            })
            .collect()
    }

    fn service_type(&self) -> &'static str {
        if !self.load_balancer_ips.is_empty() {
            "LoadBalancer"
        } else if self.ports.iter().any(|p| p.node_port.is_some()) {
            "NodePort"
        } else {
            "ClusterIP"
        }
    }

    /// The Service and EndpointSlice as one multi-document YAML file.
    pub fn yaml(&self) -> String {
        let q = |ips: &[IpAddr]| {
            ips.iter()
                .map(|ip| format!("\"{ip}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut spec = format!(
            "  type: {}\n  clusterIP: \"{}\"\n",
            self.service_type(),
            self.cluster_ip
        );
        if let Some(port) = self.etp_local_health_port {
            spec += &format!("  externalTrafficPolicy: Local\n  healthCheckNodePort: {port}\n");
        }
        if self.itp_local {
            spec += "  internalTrafficPolicy: Local\n";
        }
        if let Some(seconds) = self.affinity_seconds {
            spec += &format!(
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {seconds}\n"
            );
        }
        if !self.external_ips.is_empty() {
            spec += &format!("  externalIPs: [{}]\n", q(&self.external_ips));
        }
        if !self.source_ranges.is_empty() {
            let ranges: Vec<String> = self
                .source_ranges
                .iter()
                .map(|r| format!("\"{r}\""))
                .collect();
            spec += &format!("  loadBalancerSourceRanges: [{}]\n", ranges.join(", "));
        }
        spec += "  ports:\n";
        for p in &self.ports {
            spec += &format!(
                "    - name: {}\n      protocol: {}\n      port: {}\n      targetPort: {DEFAULT_ECHO_PORT}\n",
                yaml_string(&p.name),
                p.protocol,
                p.port
            );
            if let Some(node_port) = p.node_port {
                spec += &format!("      nodePort: {node_port}\n");
            }
        }
        let status = if self.load_balancer_ips.is_empty() {
            String::new()
        } else {
            let ingress: Vec<String> = self
                .load_balancer_ips
                .iter()
                .map(|ip| format!("      - ip: \"{ip}\"\n"))
                .collect();
            format!(
                "status:\n  loadBalancer:\n    ingress:\n{}",
                ingress.concat()
            )
        };
        let family = if self.cluster_ip.is_ipv6() {
            "IPv6"
        } else {
            "IPv4"
        };
        let slice_ports: String = self
            .ports
            .iter()
            .map(|p| {
                format!(
                    "  - name: {}\n    protocol: {}\n    port: {DEFAULT_ECHO_PORT}\n",
                    yaml_string(&p.name),
                    p.protocol
                )
            })
            .collect();
        let endpoints = if self.endpoints.is_empty() {
            "endpoints: []\n".to_owned()
        } else {
            let list: String = self
                .endpoints
                .iter()
                .map(|(ip, node, conditions)| {
                    let conditions = conditions
                        .map(|c| format!("    conditions: {c}\n"))
                        .unwrap_or_default();
                    format!("  - addresses: [\"{ip}\"]\n    nodeName: {node}\n{conditions}")
                })
                .collect();
            format!("endpoints:\n{list}")
        };
        let name = &self.name;
        let namespace = &self.namespace;
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
             spec:\n{spec}{status}---\n\
             apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {name}\n\
             addressType: {family}\nports:\n{slice_ports}{endpoints}"
        )
    }
}

/// `text` as a double-quoted YAML scalar (JSON string syntax is valid YAML).
fn yaml_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string encodes as JSON")
}

/// The `nodeName` a pod's endpoints carry.
pub fn node_name(pod: &Host) -> &'static str {
    match pod.role() {
        Role::Pod { remote: true } => OTHER_NODE,
        _ => THIS_NODE,
    }
}

/// This node's Node object; `revision` goes into a label, so bumping it changes the labels
/// (which makes the proxy's next sync a full one).
pub fn node_yaml(cluster: &Cluster, revision: u32) -> String {
    let node = cluster.node();
    let v6 = node
        .ipv6()
        .map(|ip| format!("    - type: InternalIP\n      address: \"{ip}\"\n"))
        .unwrap_or_default();
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {THIS_NODE}\n  labels:\n    \
         kubernetes.io/hostname: {THIS_NODE}\n    kpt.example/revision: \"{revision}\"\n\
         spec:\n  podCIDR: 10.244.1.0/24\n  podCIDRs: [\"10.244.1.0/24\"]\n\
         status:\n  addresses:\n    - type: InternalIP\n      address: \"{}\"\n{v6}",
        node.ip()
    )
}

// --- the proxy ----------------------------------------------------------------------------

/// The real `kube-proxy` binary: the one cargo built for the running test executable, which
/// sits in the `deps/` directory beside it (`target/<profile>/deps/<suite>-<hash>`). Only a
/// test binary of the `kube-proxy` package is sure to have it built; from anywhere else this
/// panics, naming the path it looked for.
pub fn kube_proxy() -> &'static str {
    static BINARY: OnceLock<String> = OnceLock::new();
    BINARY.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test executable's path");
        let binary = exe
            .parent()
            .and_then(Path::parent)
            .map(|profile| profile.join("kube-proxy"))
            .filter(|binary| binary.is_file())
            .unwrap_or_else(|| {
                panic!(
                    "no kube-proxy binary beside {} (in its directory's parent): \
                     kp-suite serves the kube-proxy package's test binaries",
                    exe.display()
                )
            });
        binary.to_string_lossy().into_owned()
    })
}

/// The proxy's flags besides the common ones and the mode's own.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    /// `--cluster-cidr`; `None` leaves it unset (no ClusterCIDR local detector).
    pub cluster_cidr: Option<&'static str>,
    /// Further flags, e.g. `--masquerade-all`.
    pub extra: Vec<String>,
    /// `--master=URL`: watch this API server instead of reading the manifests directory.
    pub master: Option<String>,
    /// Environment variables of the proxy's process.
    pub env: Vec<(String, String)>,
}

impl Flags {
    /// Only `--cluster-cidr=<cidr>`.
    pub fn cluster_cidr(cidr: &'static str) -> Self {
        Self {
            cluster_cidr: Some(cidr),
            ..Self::default()
        }
    }

    /// Watch the API server at `url` (`--master`) instead of the manifests.
    pub fn master(mut self, url: String) -> Self {
        self.master = Some(url);
        self
    }

    /// Adds a flag (`--name=value` or a bare `--name`).
    pub fn flag(mut self, flag: &str) -> Self {
        self.extra.push(flag.to_owned());
        self
    }

    /// Sets `key` to `value` in the proxy's environment.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }
}

/// Appends the binary under test to `ip netns exec NODE`, with `--manifests` pointing at
/// `manifests` and its record of changed kernel settings kept in `state`; the proxy's other
/// flags follow.
pub type Launcher = fn(command: &mut Command, source: &ObjectSource<'_>, state: &Path);

/// Where the proxy under test reads its objects from.
#[derive(Debug)]
pub enum ObjectSource<'a> {
    /// `--manifests=PATH`.
    Manifests(&'a Path),
    /// `--master=URL` (a list/watch server).
    Master(&'a str),
}

impl ObjectSource<'_> {
    /// The flag naming this source, with `manifests` as the path the proxy sees.
    pub fn flag(&self, manifests: &Path) -> String {
        match self {
            ObjectSource::Manifests(_) => format!("--manifests={}", manifests.display()),
            ObjectSource::Master(url) => format!("--master={url}"),
        }
    }
}

/// How this test process starts the proxy: [`run_built_binary`] unless [`set_launcher`] chose
/// another way (the image test runs it chrooted into the runtime image).
static LAUNCHER: OnceLock<Launcher> = OnceLock::new();

/// Starts every proxy of this test process with `launcher` (only the first call counts).
pub fn set_launcher(launcher: Launcher) {
    let _ = LAUNCHER.set(launcher);
}

/// The default [`Launcher`]: the binary cargo built, as it is.
fn run_built_binary(command: &mut Command, source: &ObjectSource<'_>, state: &Path) {
    let manifests = match source {
        ObjectSource::Manifests(path) => *path,
        ObjectSource::Master(_) => Path::new(""),
    };
    command
        .arg(kube_proxy())
        .arg(source.flag(manifests))
        .env(kp_dataplane::sysctls::STATE_DIR_ENV, state);
}

/// The real binary running inside the node namespace (kp-testbed's proxy harness); its
/// stderr lines are collected. Killed on drop (the harness also kills whatever is left in its
/// namespaces).
#[derive(Debug)]
pub struct Proxy {
    process: ProxyProcess,
    metrics: SocketAddr,
    healthz: SocketAddr,
}

impl Proxy {
    /// Starts the proxy as [`Proxy::start`] does, without waiting for anything.
    fn spawn(mode: Mode, cluster: &Cluster, manifests: &Path, state: &Path, flags: &Flags) -> Self {
        let metrics = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), free_port());
        let healthz = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), free_port());
        let source = match &flags.master {
            Some(url) => ObjectSource::Master(url),
            None => ObjectSource::Manifests(manifests),
        };
        let mut launch = ProxyLaunch::in_namespace(cluster.node_ns());
        LAUNCHER.get().copied().unwrap_or(run_built_binary)(launch.command_mut(), &source, state);
        if mode == Mode::IptablesRestore {
            launch = launch.env(NETLINK_ENV, "off");
        }
        for (key, value) in &flags.env {
            launch = launch.env(key, value);
        }
        let process = launch
            .arg(format!("--proxy-mode={}", mode.name()))
            .arg(format!("--hostname-override={THIS_NODE}"))
            .args(flags.cluster_cidr.map(|c| format!("--cluster-cidr={c}")))
            .arg("--conntrack-max-per-core=0")
            .arg(format!("--healthz-bind-address={healthz}"))
            .arg(format!("--metrics-bind-address={metrics}"))
            .arg("-v=2")
            .args(mode.flags())
            .args(&flags.extra)
            .spawn()
            .unwrap_or_else(|e| panic!("start kube-proxy in the node namespace: {e}"));
        Self {
            process,
            metrics,
            healthz,
        }
    }

    /// Starts `kube-proxy --manifests DIR --proxy-mode=<mode>` (or `--master` from `flags`)
    /// inside the node namespace, keeping its record of changed kernel settings in `state`
    /// (not the host's `/run`), waits for its first sync, and checks that ipvs mode did not
    /// fall back to iptables.
    pub fn start(
        mode: Mode,
        cluster: &Cluster,
        manifests: &Path,
        state: &Path,
        flags: &Flags,
    ) -> Self {
        let mut proxy = Self::spawn(mode, cluster, manifests, state, flags);
        proxy.wait_first_sync();
        proxy.check_iptables_path(mode);
        if mode == Mode::Ipvs {
            // A kernel without IPVS makes the binary fall back to iptables: not this mode.
            assert!(
                !proxy
                    .logged(|l| l.contains("Using ipvs Proxier"))
                    .is_empty(),
                "ipvs mode must be used (no fallback):\n{}",
                proxy.tail()
            );
        }
        proxy
    }

    /// iptables mode wrote its rules the way `mode` means: through `iptables-restore` when the
    /// netlink path is forced off, over netlink when the host's iptables is a version whose
    /// encoding is verified (otherwise the binary rightly uses `iptables-restore`).
    fn check_iptables_path(&self, mode: Mode) {
        let restore = !self
            .logged(|l| l.contains("iptables rules go through iptables-restore"))
            .is_empty();
        let netlink = !self
            .logged(|l| l.contains("iptables rules go over nf_tables netlink"))
            .is_empty();
        match mode {
            Mode::IptablesRestore => assert!(
                restore && !netlink,
                "{NETLINK_ENV}=off must make iptables mode use iptables-restore:\n{}",
                self.tail()
            ),
            // Only for the built binary on this host: a launcher (the image) has its own tools.
            Mode::Iptables
                if LAUNCHER.get().is_none()
                    && netlink::usable(None, &host_iptables_version()).is_ok() =>
            {
                assert!(
                    netlink && !restore,
                    "iptables mode must write over nf_tables netlink on this host:\n{}",
                    self.tail()
                )
            }
            _ => {}
        }
    }

    /// The proxy's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// The address of the metrics server (inside the node namespace).
    pub fn metrics_address(&self) -> SocketAddr {
        self.metrics
    }

    /// The address of the health server (inside the node namespace).
    pub fn healthz_address(&self) -> SocketAddr {
        self.healthz
    }

    /// Every line logged so far that `matches` accepts.
    pub fn logged(&self, matches: impl Fn(&str) -> bool) -> Vec<String> {
        self.process.logged(matches)
    }

    /// The last lines the proxy logged.
    pub fn tail(&self) -> String {
        self.process.tail(LOG_TAIL)
    }

    /// Forgets lines logged so far, so the next wait only sees what happens from now on.
    pub fn mark(&mut self) {
        self.process.mark();
    }

    /// Waits (bounded) for a log line `matches` accepts and returns it.
    pub fn wait_for(&mut self, what: &str, matches: impl Fn(&str) -> bool) -> String {
        let patience = patience();
        match self.process.wait_for(what, patience, matches) {
            Ok(entry) => entry.line,
            Err(kp_testbed::TestbedError::ProxyExited { status, .. }) => panic!(
                "kube-proxy exited ({status}) before it logged {what}; log:\n{}",
                self.tail()
            ),
            Err(_) => panic!(
                "kube-proxy never logged {what} within {patience:?}; log:\n{}",
                self.tail()
            ),
        }
    }

    /// Waits for the first complete sync of the rules.
    pub fn wait_first_sync(&mut self) {
        self.wait_for("its first sync", |l| l.contains(FIRST_SYNC_LOG));
    }

    /// Waits for a sync that programmed at least one changed service port (call
    /// [`Proxy::mark`] before making the change).
    pub fn wait_change_synced(&mut self) -> String {
        self.wait_for("a sync of a change", |l| {
            l.contains(SYNCED_LOG) && !l.contains("changed=\"0\"")
        })
    }

    /// SIGKILL, and waits for the exit: none of the proxy's own shutdown runs.
    pub fn kill(mut self) {
        self.process.kill();
    }

    /// SIGTERM, then waits (bounded) for the exit.
    pub fn terminate(mut self) -> ExitStatus {
        self.process
            .terminate(patience())
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// The test VM with everything ipvs-mode scenarios run: the proxy, the echo helper, the
/// ipvs, ipset, iptables, conntrack and nft tools, and perl for the HTTP probe.
pub fn ipvs_vm() -> kp_vm::Vm {
    /// Debian's perl-base modules (IO::Socket::INET for the HTTP probe).
    const PERL_BASE: &str = "/usr/lib/x86_64-linux-gnu/perl-base";
    let echo = kp_testbed::echo_binary().unwrap_or_else(|e| panic!("{e}"));
    kp_vm::Vm::from_env()
        .iptables()
        .program("ipvsadm")
        .program("ipset")
        .program("conntrack")
        .program("nft")
        // The HTTP probe (health-check node ports, metrics) is a perl one-liner.
        .program("perl")
        .directory(PERL_BASE)
        .program(kube_proxy())
        .program(&echo.to_string_lossy())
}

// --- one scenario's world ----------------------------------------------------------------

/// A bpffs mounted at a directory, unmounted (lazily) on drop, which releases its pins.
#[derive(Debug)]
struct BpffsMount(PathBuf);

impl BpffsMount {
    fn at(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).expect("bpffs mount point");
        let status = Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mount -t bpf at {}: {status}",
            dir.display()
        );
        Self(dir.to_owned())
    }
}

impl Drop for BpffsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A cluster, its manifests directory and the proxy under test running over it.
#[derive(Debug)]
pub struct Env {
    // Field order is drop order: the proxy goes first, the namespaces last.
    proxy: Option<Proxy>,
    /// With `--socket-lb`: the bpffs its pins go to, mounted from outside the proxy's mount
    /// namespace so that they outlive the proxy, as a DaemonSet mounts the host's
    /// /sys/fs/bpf.
    _bpffs: Option<BpffsMount>,
    dir: tempfile::TempDir,
    /// The proxy's state directory (`KUBE_PROXY_RS_STATE_DIR`).
    state: tempfile::TempDir,
    flags: Flags,
    /// The proxy mode under test.
    pub mode: Mode,
    /// The harness's cluster.
    pub cluster: Cluster,
}

impl Env {
    /// Writes the Node and `services`, starts the proxy and waits for its first sync.
    pub fn start(
        mode: Mode,
        cluster: Cluster,
        cluster_cidr: &'static str,
        services: &[Service],
    ) -> Self {
        Self::start_with(
            mode,
            cluster,
            Flags::cluster_cidr(cluster_cidr),
            services,
            &[],
        )
    }

    /// Like [`Env::start`] with more flags, and with extra manifest files (name, text)
    /// written next to the services' (e.g. objects the proxy must skip).
    pub fn start_with(
        mode: Mode,
        cluster: Cluster,
        flags: Flags,
        services: &[Service],
        files: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("manifests tempdir");
        let state = tempfile::tempdir().expect("state tempdir");
        let bpffs = flags
            .extra
            .iter()
            .any(|f| f == "--socket-lb")
            .then(|| BpffsMount::at(&state.path().join("bpf")));
        let mut env = Self {
            proxy: None,
            _bpffs: bpffs,
            dir,
            state,
            flags,
            mode,
            cluster,
        };
        env.write("node.yaml", &node_yaml(&env.cluster, 0));
        for service in services {
            env.write(&format!("{}.yaml", service.name), &service.yaml());
        }
        for (file, text) in files {
            env.write(file, text);
        }
        env.start_proxy();
        env
    }

    fn start_proxy(&mut self) {
        self.proxy = Some(Proxy::start(
            self.mode,
            &self.cluster,
            self.dir.path(),
            self.state.path(),
            &self.flags,
        ));
    }

    /// The running proxy.
    pub fn proxy(&mut self) -> &mut Proxy {
        self.proxy.as_mut().expect("the proxy is running")
    }

    /// Writes a manifest file atomically (a dot-file, which the source skips, renamed over).
    fn write(&self, file: &str, text: &str) {
        let tmp = self.dir.path().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).expect("write manifest");
        std::fs::rename(&tmp, self.dir.path().join(file)).expect("rename manifest");
    }

    /// Writes (adds or replaces) `service`'s file and waits for the sync that programs it.
    pub fn apply(&mut self, service: &Service) -> String {
        self.proxy().mark();
        self.write(&format!("{}.yaml", service.name), &service.yaml());
        self.proxy().wait_change_synced()
    }

    /// Deletes `name`'s file and waits for the sync that removes it.
    pub fn delete(&mut self, name: &str) -> String {
        self.proxy().mark();
        std::fs::remove_file(self.dir.path().join(format!("{name}.yaml")))
            .expect("remove manifest");
        self.proxy().wait_change_synced()
    }

    /// Changes the Node's labels and waits for the full sync that follows.
    pub fn relabel_node(&mut self, revision: u32) -> String {
        self.proxy().mark();
        self.write("node.yaml", &node_yaml(&self.cluster, revision));
        self.proxy()
            .wait_for("a full sync after the Node changed", |l| {
                l.contains(SYNCED_LOG) && l.contains("kind=\"Full\"")
            })
    }

    /// Stops the proxy with SIGTERM (asserting a clean exit) and starts a new one over the
    /// same rules and manifests, waiting for its first sync.
    pub fn restart_proxy(&mut self) {
        let flags = self.flags.clone();
        self.restart_with(flags);
    }

    /// Kills the proxy (SIGKILL: no cleanup of any kind) and starts it again.
    pub fn kill_and_restart_proxy(&mut self) {
        self.proxy.take().expect("the proxy is running").kill();
        self.start_proxy();
    }

    /// Starts a second proxy beside the running one, with `flags` and the same manifests and
    /// state directory (ports of its own), and returns its exit status and log once it has
    /// exited; panics if it still runs after the usual patience (it is then killed).
    pub fn second_proxy_exit(&self, flags: &Flags) -> (std::process::ExitStatus, String) {
        let mut second = Proxy::spawn(
            self.mode,
            &self.cluster,
            self.dir.path(),
            self.state.path(),
            flags,
        );
        let deadline = std::time::Instant::now() + patience();
        while std::time::Instant::now() < deadline {
            if let Some(status) = second.process.try_exit_status() {
                // The reader may still be collecting the last lines.
                std::thread::sleep(std::time::Duration::from_millis(200));
                return (status, second.tail());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("the second proxy still runs; log:\n{}", second.tail());
    }

    /// The proxy's flags.
    pub fn flags(&self) -> &Flags {
        &self.flags
    }

    /// Like [`Env::restart_proxy`], with `flags` from now on.
    pub fn restart_with(&mut self, flags: Flags) {
        let proxy = self.proxy.take().expect("the proxy is running");
        let tail = proxy.tail();
        let status = proxy.terminate();
        assert!(
            status.success(),
            "exit status after SIGTERM: {status}; log:\n{tail}"
        );
        self.flags = flags;
        self.start_proxy();
    }

    /// Stops the proxy with SIGTERM, asserting a clean exit; its rules stay behind.
    pub fn stop_proxy(&mut self) {
        let proxy = self.proxy.take().expect("the proxy is running");
        let tail = proxy.tail();
        let status = proxy.terminate();
        assert!(
            status.success(),
            "exit status after SIGTERM: {status}; log:\n{tail}"
        );
    }

    /// The proxy's state directory (`KUBE_PROXY_RS_STATE_DIR`).
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// `KUBE_PROXY_RS_STATE_DIR=...` as the running proxy has it, for running the binary
    /// again by hand (`env` + this + `kube-proxy --cleanup`).
    pub fn state_env(&self) -> String {
        format!(
            "{}={}",
            kp_dataplane::sysctls::STATE_DIR_ENV,
            self.state.path().display()
        )
    }

    /// Runs `args` in the node namespace and returns its standard output (panics, with the
    /// error, when it fails).
    pub fn node_exec(&self, args: &[&str]) -> String {
        self.cluster
            .exec(self.cluster.node_ns(), args)
            .unwrap_or_else(|e| panic!("{args:?} in the node namespace: {e}{}", self.diag()))
    }

    /// Every line the running proxy logged so far that `matches` accepts.
    pub fn logged(&self, matches: impl Fn(&str) -> bool) -> Vec<String> {
        self.proxy
            .as_ref()
            .map(|p| p.logged(matches))
            .unwrap_or_default()
    }

    /// `GET /metrics` of the running proxy, from inside the node namespace.
    pub fn metrics(&self) -> String {
        let proxy = self.proxy.as_ref().expect("the proxy is running");
        let response = http_get_path(
            &self.cluster,
            self.cluster.node(),
            proxy.metrics_address(),
            "/metrics",
        );
        assert_eq!(response.status, 200, "GET /metrics: {response:?}");
        response.body
    }

    /// The running proxy's metrics (and `/debug/explain`) address, inside the node namespace.
    pub fn metrics_address(&self) -> SocketAddr {
        self.proxy
            .as_ref()
            .expect("the proxy is running")
            .metrics_address()
    }

    /// What a failing assertion should show: the rules and the proxy's latest log lines.
    pub fn diag(&self) -> String {
        let log = self.proxy.as_ref().map(Proxy::tail).unwrap_or_default();
        format!(
            "\n--- {} rules in the node namespace ---\n{}\n--- kube-proxy log (tail) ---\n{log}",
            self.mode.name(),
            self.mode.dump(&self.cluster)
        )
    }

    /// A pod (or the client) by name.
    pub fn pod(&self, name: &str) -> &Host {
        self.cluster.pod(name).expect("pod of this cluster")
    }
}

// --- expectations -------------------------------------------------------------------------

/// Which source address the endpoints must have seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The client's own address (not masqueraded).
    Preserved,
    /// Masqueraded to the node's address on the way to the endpoint: the veth gateway for a
    /// local pod, the node's LAN address for a remote pod.
    Masqueraded,
}

/// The address a masqueraded flow to `pod` leaves the node with: the veth gateway for a
/// local pod; for a remote pod, the source the node's kernel picks for the route to it (on
/// a real-shaped node with several IPv6 addresses on the LAN interface that need not be the
/// node IP: IPv6 has no "primary" address, and MASQUERADE takes the kernel's choice).
pub fn masquerade_address(cluster: &Cluster, pod: &Host, v6: bool) -> IpAddr {
    match (pod.role(), v6) {
        (Role::Pod { remote: true }, false) => route_source(cluster, pod.ip()),
        (Role::Pod { remote: true }, true) => {
            route_source(cluster, IpAddr::V6(pod.ipv6().expect("dual-stack cluster")))
        }
        (_, false) => IpAddr::V4(NODE_POD_GATEWAY_V4),
        (_, true) => IpAddr::V6(NODE_POD_GATEWAY_V6),
    }
}

/// The source address the node's kernel picks towards `dst` (`ip route get`).
fn route_source(cluster: &Cluster, dst: IpAddr) -> IpAddr {
    let out = cluster
        .exec(cluster.node_ns(), &["ip", "route", "get", &dst.to_string()])
        .unwrap_or_else(|e| panic!("ip route get {dst} in the node namespace: {e}"));
    let mut words = out.split_whitespace();
    words
        .find(|w| *w == "src")
        .and_then(|_| words.next())
        .and_then(|src| src.parse().ok())
        .unwrap_or_else(|| panic!("no source address in `ip route get {dst}`: {out}"))
}

/// Asserts that every flow was answered, that exactly the pods in `expected` answered (each
/// at least once), and that every answer saw the `source` expected.
pub fn assert_flows(env: &Env, what: &str, tally: &Tally, expected: &[&str], source: Source) {
    assert!(
        tally.all_answered(),
        "{what}: not every flow was answered: {:?}{}",
        tally.outcomes(),
        env.diag()
    );
    let answered: BTreeSet<String> = tally.by_pod().into_keys().collect();
    let wanted: BTreeSet<String> = expected.iter().map(|s| (*s).to_owned()).collect();
    assert_eq!(
        answered,
        wanted,
        "{what}: the set of answering endpoints (counts {:?}){}",
        tally.by_pod(),
        env.diag()
    );
    for outcome in tally.outcomes() {
        assert_source(env, what, outcome, source);
    }
}

/// Asserts one answered flow's source address.
pub fn assert_source(env: &Env, what: &str, outcome: &Outcome, source: Source) {
    let Outcome::Answered {
        pod,
        seen_source,
        client,
        ..
    } = outcome
    else {
        panic!("{what}: expected an answer, got {outcome:?}{}", env.diag());
    };
    let expected = match source {
        Source::Preserved => client.ip(),
        Source::Masqueraded => {
            masquerade_address(&env.cluster, env.pod(pod), client.ip().is_ipv6())
        }
    };
    assert_eq!(
        seen_source.ip(),
        expected,
        "{what}: source seen by {pod} ({source:?} expected): {outcome:?}{}",
        env.diag()
    );
}

/// Asserts that every one of `tally`'s flows ended as `expected` (e.g. `TimedOut`).
pub fn assert_all(env: &Env, what: &str, tally: &Tally, expected: &Outcome) {
    assert!(
        !tally.is_empty() && tally.outcomes().iter().all(|o| o == expected),
        "{what}: expected every flow to be {expected:?}, got {:?}{}",
        tally.outcomes(),
        env.diag()
    );
}

// --- probes the harness does not have ----------------------------------------------------

/// One UDP exchange from `from`, source port `sport`, to `dst`: the same 5-tuple on every
/// call, so a stale conntrack or IPVS entry would show.
pub fn udp_from_port(cluster: &Cluster, from: &Host, dst: SocketAddr, sport: u16) -> Outcome {
    cluster
        .udp_from_port(from, dst, sport)
        .expect("run the fixed-port UDP probe")
}

/// One HTTP GET of a path to `addr` from `from`; `connect-failed` when the connection failed.
const HTTP_GET: &str = r#"
use IO::Socket::INET;
my ($host, $port, $path) = @ARGV;
my $s = IO::Socket::INET->new(PeerAddr => $host, PeerPort => $port, Proto => 'tcp',
    Timeout => 2) or do { print "connect-failed $!\n"; exit 0 };
print $s "GET $path HTTP/1.1\r\nHost: $host\r\nConnection: close\r\n\r\n";
local $/; my $r = <$s>; print $r;
"#;

/// An HTTP response: status and headers (names lowercased).
#[derive(Debug)]
pub struct HttpResponse {
    /// The status code.
    pub status: u16,
    /// The headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// GETs `http://addr/` from `from`, retrying (bounded) while the port does not accept
/// connections yet (the proxy opens health-check ports right after a sync).
pub fn http_get(cluster: &Cluster, from: &Host, addr: SocketAddr) -> HttpResponse {
    http_get_path(cluster, from, addr, "/")
}

/// Like [`http_get`], for `path`.
pub fn http_get_path(cluster: &Cluster, from: &Host, addr: SocketAddr, path: &str) -> HttpResponse {
    let patience = patience();
    let deadline = Instant::now() + patience;
    loop {
        let out = cluster
            .exec(
                from.ns(),
                &[
                    "perl",
                    "-e",
                    HTTP_GET,
                    &addr.ip().to_string(),
                    &addr.port().to_string(),
                    path,
                ],
            )
            .expect("run the HTTP probe (perl)");
        if out.starts_with("connect-failed") {
            assert!(
                Instant::now() < deadline,
                "nothing accepted connections on {addr} within {patience:?}: {out}"
            );
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((out.as_str(), ""));
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response from {addr}: {out:?}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        return HttpResponse {
            status,
            headers,
            body: body.to_owned(),
        };
    }
}

// --- reading rules and metrics -------------------------------------------------------------

/// The sum of every series of metric `name` (e.g. `kube_proxy_rs_invalid_objects_total`) in a
/// Prometheus text exposition; `None` when it has no series at all.
pub fn metric_sum(exposition: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = exposition
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = if let Some(labelled) = rest.strip_prefix('{') {
                labelled.split_once('}')?.1
            } else if rest.starts_with(' ') {
                rest
            } else {
                return None;
            };
            rest.split_whitespace().next()?.parse().ok()
        })
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// The `iptables-save` lines (chain declarations and rules) that mention a `KUBE-` chain
/// other than `allowed` ones.
pub fn kube_lines<'a>(save: &'a str, allowed: &[&str]) -> Vec<&'a str> {
    save.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.split(|c: char| c.is_whitespace() || c == ':' || c == '"')
                .filter(|word| word.starts_with("KUBE-"))
                .any(|word| !allowed.contains(&word))
        })
        .collect()
}

/// An `iptables-save` dump without its timestamped comments and with counters zeroed, for
/// comparing dumps taken at different times.
pub fn normalized_save(save: &str) -> Vec<String> {
    save.lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| match line.rfind(" [") {
            Some(at) if line.starts_with(':') => format!("{} [0:0]", &line[..at]),
            _ => line.to_owned(),
        })
        .collect()
}
