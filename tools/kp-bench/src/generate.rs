//! Synthetic Services and EndpointSlices, written as the YAML a user would `kubectl apply`.
//!
//! The shape is fixed and deterministic, so runs at the same scale are comparable:
//!
//! - service `i` is `bench-<i % 10>/svc-<i>` with ClusterIP `10.96.0.0 + 16 + i`;
//! - every 10th service (`i % 10 == 9`) is UDP (port 53, like DNS), the rest TCP port 80;
//! - every 5th service (`i % 5 == 0`) has a second TCP port, `metrics` 9090;
//! - every 3rd service (`i % 3 == 0`) is `type: NodePort`, its ports numbered upwards from
//!   30000 (past 2,767 node ports this needs a wider `--service-node-port-range` than the
//!   API server's default, which the proxy does not check);
//! - one EndpointSlice per service with `M` ready endpoints from `10.128.0.0/9`, spread over
//!   50 nodes of which this one ([`NODE_NAME`]) has every 50th endpoint;
//! - services and their slices go into a few files (`services-NNN.yaml`, at least 500
//!   services each, at most 8 files), plus `node.yaml` with this node's Node object.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::Ipv4Addr;

/// The node the proxy runs as (`--hostname-override`).
pub const NODE_NAME: &str = "bench-node";
/// Namespaces the services are spread over.
pub const NAMESPACES: usize = 10;
/// Nodes the endpoints are spread over (one of them is [`NODE_NAME`]).
pub const NODES: usize = 50;
/// The first NodePort handed out.
pub const FIRST_NODE_PORT: u32 = 30000;
/// Services per file, at least.
const MIN_SERVICES_PER_FILE: usize = 500;
/// Files, at most (services go into this many files once there are enough).
const MAX_FILES: usize = 8;
/// ClusterIPs start here (plus [`CLUSTER_IP_OFFSET`]).
const SERVICE_CIDR: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 0);
const CLUSTER_IP_OFFSET: u32 = 16;
/// Endpoint addresses start here (plus one).
const POD_CIDR: Ipv4Addr = Ipv4Addr::new(10, 128, 0, 0);
/// Replacement endpoint addresses for edits come from here, so they never collide.
const EDIT_CIDR: Ipv4Addr = Ipv4Addr::new(10, 64, 0, 0);
/// externalIPs of [`Change::ExternalIpAdded`].
const EDIT_EXTERNAL_CIDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 0);
/// LoadBalancer ingress IPs of [`Change::LoadBalancerIpAdded`].
const EDIT_LB_CIDR: Ipv4Addr = Ipv4Addr::new(172, 20, 0, 0);

/// How many services and endpoints to generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    /// Services.
    pub services: usize,
    /// Endpoints per service (all in one EndpointSlice).
    pub endpoints: usize,
}

impl Scale {
    /// `services` × `endpoints`.
    pub fn new(services: usize, endpoints: usize) -> Self {
        Self {
            services,
            endpoints,
        }
    }

    /// Services per file.
    pub fn services_per_file(&self) -> usize {
        self.services.div_ceil(MAX_FILES).max(MIN_SERVICES_PER_FILE)
    }

    /// Number of `services-NNN.yaml` files.
    pub fn files(&self) -> usize {
        self.services.div_ceil(self.services_per_file())
    }

    /// The file that holds service `index` and its slice.
    pub fn file_of(&self, index: usize) -> usize {
        index / self.services_per_file()
    }

    /// Service ports in total (services with a second port count twice).
    pub fn service_ports(&self) -> usize {
        (0..self.services).map(|i| ports(i).len()).sum()
    }

    /// NodePorts in total.
    pub fn node_ports(&self) -> usize {
        (0..self.services)
            .filter(|i| is_node_port(*i))
            .map(|i| ports(i).len())
            .sum()
    }
}

/// One port of a generated service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenPort {
    /// Port name.
    pub name: &'static str,
    /// `TCP` or `UDP`.
    pub protocol: &'static str,
    /// Service port.
    pub port: u16,
    /// Endpoint (target) port.
    pub target: u16,
}

/// The ports of service `index`.
pub fn ports(index: usize) -> Vec<GenPort> {
    let mut ports = Vec::with_capacity(2);
    if is_udp(index) {
        ports.push(GenPort {
            name: "dns",
            protocol: "UDP",
            port: 53,
            target: 5353,
        });
    } else {
        ports.push(GenPort {
            name: "http",
            protocol: "TCP",
            port: 80,
            target: 8080,
        });
    }
    if index.is_multiple_of(5) {
        ports.push(GenPort {
            name: "metrics",
            protocol: "TCP",
            port: 9090,
            target: 9090,
        });
    }
    ports
}

/// Whether service `index` is UDP.
pub fn is_udp(index: usize) -> bool {
    index % 10 == 9
}

/// Whether service `index` is `type: NodePort`.
pub fn is_node_port(index: usize) -> bool {
    index.is_multiple_of(3)
}

/// Namespace of service `index`.
pub fn namespace(index: usize) -> String {
    format!("bench-{}", index % NAMESPACES)
}

/// Name of service `index`.
pub fn service_name(index: usize) -> String {
    format!("svc-{index:05}")
}

/// ClusterIP of service `index`.
pub fn cluster_ip(index: usize) -> Ipv4Addr {
    offset(SERVICE_CIDR, CLUSTER_IP_OFFSET as usize + index)
}

fn offset(base: Ipv4Addr, by: usize) -> Ipv4Addr {
    let by = u32::try_from(by).unwrap_or(u32::MAX);
    Ipv4Addr::from(u32::from(base).saturating_add(by))
}

/// A change to one service's EndpointSlice: its last endpoint (or, with no endpoints, a new
/// one) gets an address from a range no generated endpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edit {
    /// The service whose objects change (at least [`Scale::services`] for
    /// [`Change::ServiceAdded`]).
    pub service: usize,
    /// Makes each edit of the same service distinct (`1`, `2`, ...).
    pub generation: usize,
    /// What changes.
    pub change: Change,
}

impl Edit {
    /// The edit kp-scale and kp-churn have always made: the slice's last endpoint moved to
    /// another address.
    pub fn replace(service: usize, generation: usize) -> Self {
        Self {
            service,
            generation,
            change: Change::EndpointReplaced,
        }
    }
}

/// A kind of one-service change (kp-scale's `--changes`): the partial syncs issue 33 asks to
/// stay flat whatever the cluster's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Change {
    /// The slice's last endpoint gets another address.
    EndpointReplaced,
    /// The slice gains an endpoint.
    EndpointAdded,
    /// The slice loses its last endpoint.
    EndpointRemoved,
    /// The last endpoint stops being ready (and serving).
    NotReady,
    /// The last endpoint is terminating, still serving.
    Terminating,
    /// A new Service (and its slice).
    ServiceAdded,
    /// The Service and its slice are deleted.
    ServiceRemoved,
    /// The Service gains a TCP port (and the slice its target).
    PortAdded,
    /// A ClusterIP Service becomes a NodePort one.
    NodePortAdded,
    /// The Service gains an externalIP.
    ExternalIpAdded,
    /// A NodePort Service becomes a LoadBalancer with an ingress IP.
    LoadBalancerIpAdded,
    /// `sessionAffinity: ClientIP` on.
    AffinityOn,
    /// `sessionAffinity: ClientIP` off again (after [`Change::AffinityOn`]).
    AffinityOff,
    /// `externalTrafficPolicy: Local` (a NodePort Service).
    PolicyLocal,
    /// `externalTrafficPolicy: Cluster` again (after [`Change::PolicyLocal`]).
    PolicyCluster,
}

/// Service `index` as the edits made to it so far leave it, on top of the generated shape.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Shape {
    /// The generation of the latest endpoint replacement.
    replaced: Option<usize>,
    added_endpoints: usize,
    removed_endpoints: usize,
    not_ready: bool,
    terminating: bool,
    removed: bool,
    extra_port: bool,
    node_port: bool,
    external_ip: bool,
    load_balancer: bool,
    affinity: bool,
    local: bool,
}

impl Shape {
    fn of(index: usize, edits: &[Edit]) -> Self {
        let mut shape = Self::default();
        for edit in edits.iter().filter(|e| e.service == index) {
            match edit.change {
                Change::EndpointReplaced => shape.replaced = Some(edit.generation),
                Change::EndpointAdded => shape.added_endpoints += 1,
                Change::EndpointRemoved => shape.removed_endpoints += 1,
                Change::NotReady => shape.not_ready = true,
                Change::Terminating => shape.terminating = true,
                Change::ServiceAdded => shape.removed = false,
                Change::ServiceRemoved => shape.removed = true,
                Change::PortAdded => shape.extra_port = true,
                Change::NodePortAdded => shape.node_port = true,
                Change::ExternalIpAdded => shape.external_ip = true,
                Change::LoadBalancerIpAdded => shape.load_balancer = true,
                Change::AffinityOn => shape.affinity = true,
                Change::AffinityOff => shape.affinity = false,
                Change::PolicyLocal => shape.local = true,
                Change::PolicyCluster => shape.local = false,
            }
        }
        shape
    }

    /// Whether the Service is of a NodePort kind (generated so, or made so).
    fn has_node_ports(&self, index: usize) -> bool {
        is_node_port(index) || self.node_port || self.load_balancer
    }
}

/// The edit kp-scale makes for `change` after `previous`: a service no earlier edit touched
/// that fits it (TCP; a ClusterIP one to gain NodePorts, a NodePort one to become a
/// LoadBalancer or switch its policy), the service [`Change::AffinityOn`] /
/// [`Change::PolicyLocal`] changed for their reversals, and a new index for
/// [`Change::ServiceAdded`]. `None` when the scale has no such service.
pub fn next_edit(scale: Scale, change: Change, previous: &[Edit]) -> Option<Edit> {
    let generation = 1;
    let reverting = |of: Change| {
        previous
            .iter()
            .rev()
            .find(|e| e.change == of)
            .map(|e| e.service)
    };
    let service = match change {
        Change::AffinityOff => reverting(Change::AffinityOn)?,
        Change::PolicyCluster => reverting(Change::PolicyLocal)?,
        Change::ServiceAdded => {
            scale.services
                + previous
                    .iter()
                    .filter(|e| e.change == Change::ServiceAdded)
                    .count()
        }
        _ => {
            let fits = |i: usize| match change {
                Change::NodePortAdded => !is_node_port(i),
                Change::LoadBalancerIpAdded | Change::PolicyLocal => is_node_port(i),
                _ => true,
            };
            (1..scale.services)
                .find(|&i| !is_udp(i) && fits(i) && previous.iter().all(|e| e.service != i))?
        }
    };
    Some(Edit {
        service,
        generation,
        change,
    })
}

/// NodePorts of edits come from here (the generated ones count up from 30000), two per
/// service, so they never collide with generated ones or each other.
const EDIT_NODE_PORTS: usize = 50_000;
/// Health-check node ports of [`Change::PolicyLocal`].
const EDIT_HEALTH_PORTS: usize = 45_000;

/// The generated manifests: file names (relative) and contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Manifests {
    /// `(file name, text)`, `node.yaml` first.
    pub files: Vec<(String, String)>,
}

impl Manifests {
    /// Total size in bytes.
    pub fn bytes(&self) -> usize {
        self.files.iter().map(|(_, text)| text.len()).sum()
    }
}

/// Everything for `scale`.
pub fn generate(scale: Scale) -> Manifests {
    let mut files = vec![("node.yaml".to_owned(), node_yaml())];
    for file in 0..scale.files() {
        files.push((file_name(file), chunk(scale, file, &[])));
    }
    Manifests { files }
}

/// The file holding `edit.service`, rewritten with `edits` applied: `(file name, text)`.
/// Pass every edit made so far to that file so earlier ones are kept.
pub fn edited_file(scale: Scale, edits: &[Edit]) -> Option<(String, String)> {
    let first = edits.first()?;
    let file = scale
        .file_of(first.service)
        .min(scale.files().saturating_sub(1));
    Some((file_name(file), chunk(scale, file, edits)))
}

/// Service `index`'s EndpointSlice alone, after `generation` endpoint replacements (see
/// [`Edit::replace`]), as one YAML document: what an API server sends when only that slice
/// changes.
pub fn slice_yaml(scale: Scale, index: usize, generation: Option<usize>) -> String {
    let edits: Vec<Edit> = generation
        .map(|g| Edit::replace(index, g))
        .into_iter()
        .collect();
    objects_yaml(scale, index, &edits).1
}

/// Service `index` and its EndpointSlice after `edits`, as two YAML documents (empty for a
/// removed service): what an API server sends when that service changes.
pub fn objects_yaml(scale: Scale, index: usize, edits: &[Edit]) -> (String, String) {
    let shape = Shape::of(index, edits);
    if shape.removed {
        return (String::new(), String::new());
    }
    let mut node_port = first_node_port(index);
    let (mut svc, mut eps) = (String::new(), String::new());
    service(&mut svc, index, &mut node_port, &shape);
    slice(&mut eps, scale, index, &shape);
    (svc, eps)
}

/// The first generated NodePort of service `index` (those before it count up from 30000).
fn first_node_port(index: usize) -> u32 {
    let before: usize = (0..index)
        .filter(|i| is_node_port(*i))
        .map(|i| ports(i).len())
        .sum();
    FIRST_NODE_PORT + u32::try_from(before).unwrap_or(0)
}

/// The name of the one file of [`generate_single`].
pub const SINGLE_FILE: &str = "services.yaml";

/// Everything for `scale` in one file ([`SINGLE_FILE`], every Service and EndpointSlice,
/// the same documents as [`generate`]'s files in the same order) next to `node.yaml`: the
/// single-file layout, where an edit of one slice rewrites a file holding all of them.
pub fn generate_single(scale: Scale) -> Manifests {
    let mut files = vec![("node.yaml".to_owned(), node_yaml())];
    files.push((SINGLE_FILE.to_owned(), single(scale, &[])));
    Manifests { files }
}

/// [`SINGLE_FILE`] rewritten with `edits` applied (every edit made so far).
pub fn edited_single(scale: Scale, edits: &[Edit]) -> (String, String) {
    (SINGLE_FILE.to_owned(), single(scale, edits))
}

fn single(scale: Scale, edits: &[Edit]) -> String {
    (0..scale.files())
        .map(|file| chunk(scale, file, edits))
        .collect()
}

/// `services-NNN.yaml`.
pub fn file_name(file: usize) -> String {
    format!("services-{file:03}.yaml")
}

fn node_yaml() -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {NODE_NAME}\n  labels:\n    \
         kubernetes.io/hostname: {NODE_NAME}\n    topology.kubernetes.io/zone: zone-a\n\
         status:\n  addresses:\n    - type: InternalIP\n      address: 10.0.0.1\n"
    )
}

/// Services `[file * per_file, (file + 1) * per_file)` and their slices.
fn chunk(scale: Scale, file: usize, edits: &[Edit]) -> String {
    let per_file = scale.services_per_file();
    let start = file * per_file;
    let end = (start + per_file).min(scale.services);
    let mut out = String::with_capacity((end - start) * (600 + 110 * scale.endpoints));
    let mut node_port = first_node_port(start);
    // Services added by edits go into the last file.
    let added = edits
        .iter()
        .filter(|e| e.service >= scale.services && file + 1 == scale.files())
        .map(|e| e.service);
    let indices: BTreeSet<usize> = (start..end).chain(added).collect();
    for index in indices {
        let shape = Shape::of(index, edits);
        if shape.removed {
            // The services after it keep their NodePorts.
            if is_node_port(index) {
                node_port += u32::try_from(ports(index).len()).unwrap_or(0);
            }
            continue;
        }
        service(&mut out, index, &mut node_port, &shape);
        slice(&mut out, scale, index, &shape);
    }
    out
}

/// The ports of service `index` as `shape` leaves them.
fn shaped_ports(index: usize, shape: &Shape) -> Vec<GenPort> {
    let mut list = ports(index);
    if shape.extra_port {
        list.push(GenPort {
            name: "extra",
            protocol: "TCP",
            port: 8443,
            target: 8443,
        });
    }
    list
}

fn service(out: &mut String, index: usize, node_port: &mut u32, shape: &Shape) {
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {}\n  namespace: {}\n  \
         labels:\n    app: {}\nspec:\n",
        service_name(index),
        namespace(index),
        service_name(index),
    );
    if shape.load_balancer {
        out.push_str("  type: LoadBalancer\n");
    } else if shape.has_node_ports(index) {
        out.push_str("  type: NodePort\n");
    }
    if shape.local {
        let health = EDIT_HEALTH_PORTS + index % 5_000;
        let _ = write!(
            out,
            "  externalTrafficPolicy: Local\n  healthCheckNodePort: {health}\n"
        );
    }
    if shape.affinity {
        out.push_str("  sessionAffinity: ClientIP\n");
    }
    if shape.external_ip {
        let _ = writeln!(
            out,
            "  externalIPs: [{}]",
            offset(EDIT_EXTERNAL_CIDR, index + 1)
        );
    }
    let _ = write!(
        out,
        "  clusterIP: {}\n  selector:\n    app: {}\n  ports:\n",
        cluster_ip(index),
        service_name(index)
    );
    for (n, port) in shaped_ports(index, shape).into_iter().enumerate() {
        let _ = write!(
            out,
            "    - name: {}\n      protocol: {}\n      port: {}\n      targetPort: {}\n",
            port.name, port.protocol, port.port, port.target
        );
        let generated = is_node_port(index) && n < ports(index).len();
        if generated {
            let _ = writeln!(out, "      nodePort: {node_port}");
            *node_port += 1;
        } else if shape.has_node_ports(index) {
            let _ = writeln!(
                out,
                "      nodePort: {}",
                EDIT_NODE_PORTS + (index % 7_000) * 2 + n
            );
        }
    }
    if shape.load_balancer {
        let _ = write!(
            out,
            "status:\n  loadBalancer:\n    ingress:\n      - ip: {}\n",
            offset(EDIT_LB_CIDR, index + 1)
        );
    }
}

fn slice(out: &mut String, scale: Scale, index: usize, shape: &Shape) {
    let _ = write!(
        out,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
         name: {slice}\n  namespace: {ns}\n  labels:\n    \
         kubernetes.io/service-name: {name}\n    \
         endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n\
         addressType: IPv4\nports:\n",
        name = service_name(index),
        slice = slice_name(index),
        ns = namespace(index),
    );
    for port in shaped_ports(index, shape) {
        let _ = write!(
            out,
            "  - name: {}\n    protocol: {}\n    port: {}\n",
            port.name, port.protocol, port.target
        );
    }
    let mut addresses: Vec<(Ipv4Addr, usize)> = (0..scale.endpoints)
        .map(|j| {
            let global = index * scale.endpoints + j;
            (offset(POD_CIDR, global + 1), global)
        })
        .collect();
    if let Some(generation) = shape.replaced {
        let replacement = offset(EDIT_CIDR, generation * 997 + index % 997 + 1);
        match addresses.last_mut() {
            Some(last) => last.0 = replacement,
            None => addresses.push((replacement, index)),
        }
    }
    for added in 0..shape.added_endpoints {
        // Above the replacements' range (997 per generation, a few generations).
        let ip = offset(EDIT_CIDR, (1 << 20) | ((index % 4096) << 6) | (added % 64));
        addresses.push((ip, index * scale.endpoints + added));
    }
    addresses.truncate(addresses.len().saturating_sub(shape.removed_endpoints));
    if addresses.is_empty() {
        out.push_str("endpoints: []\n");
        return;
    }
    out.push_str("endpoints:\n");
    let last = addresses.len() - 1;
    for (n, (ip, global)) in addresses.into_iter().enumerate() {
        let conditions = match (n == last, shape.terminating, shape.not_ready) {
            (true, true, _) => "ready: false\n      serving: true\n      terminating: true",
            (true, false, true) => "ready: false\n      serving: false",
            _ => "ready: true",
        };
        let node = global % NODES;
        let node_name = if node == 0 {
            NODE_NAME.to_owned()
        } else {
            format!("node-{node:02}")
        };
        let zone = ["zone-a", "zone-b", "zone-c"][node % 3];
        let _ = write!(
            out,
            "  - addresses: [{ip}]\n    conditions:\n      {conditions}\n    \
             nodeName: {node_name}\n    zone: {zone}\n"
        );
    }
}

/// The name of service `index`'s EndpointSlice.
pub fn slice_name(index: usize) -> String {
    format!("{}-{}", service_name(index), slice_suffix(index))
}

/// Five lowercase letters derived from the index, like the API server's generated names.
fn slice_suffix(index: usize) -> String {
    let mut x = (index as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17);
    (0..5)
        .map(|_| {
            let c = char::from(b'a' + (x % 26) as u8);
            x /= 26;
            c
        })
        .collect()
}
