//! End-to-end harness for every proxy mode: a small cluster built from network namespaces,
//! echo servers in the pods, and probes that classify what really happens to a flow.
//!
//! The proxy under test runs inside the `node` namespace and programs iptables/nftables
//! there; tests then send real TCP/UDP flows from clients and check who answered and which
//! source address the backend saw.
//!
//! # Topology
//!
//! Every namespace is named `<prefix><pid>-<n>-<name>` (default prefix `kpt-`, pods are
//! `p-<pod>`), and every veth is created with both ends inside namespaces: the host's own
//! network namespace is never touched.
//!
//! ```text
//!   external-in  203.0.113.2/25    2001:db8:1::2        external-out 203.0.113.130/25
//!        | eth0                                                 | eth0   2001:db8:2::2
//!        | xin 203.0.113.1                   xout 203.0.113.129 |
//!  +-----+------------------------------------------------------+------+
//!  | ext: router + bridge "lan" 192.168.50.1/24  fd00:50::1/64          |
//!  |      198.51.100.0/24 and 2001:db8:100::/64 (load balancer IPs)     |
//!  |      routed to the node                                            |
//!  +--------+ lan-node ----------------------------- lan-node2 +--------+
//!           | eth0 192.168.50.2  fd00:50::2        eth0 192.168.50.3 | fd00:50::3
//!  +--------+-------------------------+      +------------------------+---+
//!  | node   (proxy under test)        |      | node2  (remote node)       |
//!  | default via 192.168.50.1         |      | default via 192.168.50.1   |
//!  | 10.244.2.0/24 via 192.168.50.3   |      | 10.244.1.0/24 via .50.2    |
//!  | kpvN: 10.244.1.1/32 gw per pod   |      | kpvN: 10.244.2.1/32 gw     |
//!  +----+--------------+--------------+      +----+-----------------------+
//!       | kpv0         | kpv1 ...                 | kpvN
//!   client pod     pod "a", "b" ...           remote pods "c" ...
//!   10.244.1.2     10.244.1.3, .4 ...         10.244.2.2, .3 ...
//!   fd00:10:244:1::2 ...                      fd00:10:244:2::2 ...
//! ```
//!
//! Pods are routed point-to-point (each has `eth0` with a /32 and a default route via the
//! node's gateway address on its veth), like the CNI `ptp` plugin, so every pod packet,
//! including pod-to-pod and hairpin traffic on one node, passes the node's IP stack and its
//! netfilter hooks. Forwarding is on in `node`, `node2` and `ext`; ICMP rate limits and
//! reverse-path filtering are off everywhere. The constants in [`addresses`] name every
//! range. IPv6 is configured unless [`ClusterBuilder::dual_stack`]`(false)`.
//!
//! Each pod runs `kp-echo serve` on TCP and UDP [`DEFAULT_ECHO_PORT`]: a TCP connection is
//! greeted, and every line on it and every UDP datagram answered, with a JSON [`Reply`]
//! naming the pod and the client address it saw. Probes run `kp-echo probe` inside the
//! client's namespace (`ip netns exec`) and come back as an [`Outcome`]: `Answered`
//! (with [`Outcome::masqueraded`]), `Refused`, `TimedOut`, `NoRoute`, `Unreachable`, ...
//!
//! [`ClusterBuilder::link_local_node`] builds another node shape (IPv4 only): the node's only
//! address is `169.254.100.2/30` towards the router, without a default route, and its pods'
//! veths have no address on the node's side (routed CNIs such as Calico do this).
//!
//! SCTP (one-to-one style sockets, answered like TCP) needs a kernel with SCTP sockets, such
//! as the kp-vm guest's: pods answer it only with [`ClusterBuilder::echo_sctp_ports`], and
//! probing it elsewhere is [`TestbedError::SctpUnsupported`].
//!
//! [`proxy`] runs the proxy under test (or benchmark, or demonstration) inside a namespace:
//! spawned, its log captured, a bounded wait for its first sync (kp-core's
//! [`proxy::FIRST_SYNC_LOG`]), killed with its children on drop. Tests, the demo and the
//! benchmark binaries all start it this way.
//!
//! Every test that needs a network namespace gets it here: [`Namespace`] is one named
//! namespace without a cluster, [`isolated`] a namespace nobody names for a test body, a
//! thread or a shell script, with one rule for tests whose prerequisites are missing.
//!
//! # Using it from another crate's tests
//!
//! Add `kp-testbed.workspace = true` to `[dev-dependencies]`. Cargo builds a crate's
//! binaries only for its own tests, so build `kp-echo` first: `cargo test --workspace`
//! does, or `cargo build -p kp-testbed --bins` before `cargo test -p <crate>`;
//! [`echo_binary`] finds it next to the test executable and otherwise fails saying so.
//! Tests need root (CI runs as root) and fail, not skip, without it.
//!
//! ```no_run
//! use kp_testbed::{Cluster, Outcome};
//! # fn main() -> Result<(), kp_testbed::TestbedError> {
//! let cluster = Cluster::builder().pod("a").pod("b").remote_pod("c").build()?;
//! let a = cluster.pod("a")?.ip();
//! // Start the proxy under test inside `cluster.node_ns()`, feed it a service
//! // 10.96.0.10:80 -> a:8080, then:
//! let outcome = cluster.tcp(cluster.client(), "10.96.0.10".parse().expect("literal"), 80)?;
//! assert!(outcome.answered_by("a"));
//! assert_eq!(outcome.masqueraded(), Some(false));
//! let rules = cluster.exec(cluster.node_ns(), &["iptables-save"])?;
//! # let _ = (a, rules);
//! // Dropping `cluster` kills everything inside its namespaces, including a proxy you
//! // started there, and deletes them.
//! # Ok(())
//! # }
//! ```

pub mod addresses;
pub mod apiserver;
mod burst;
pub mod cgroup;
mod cluster;
mod command;
mod echo;
mod error;
pub mod isolated;
mod lines;
mod netns;
mod outcome;
pub mod proxy;
mod session;
pub mod tool;

pub use cluster::{
    CLIENT_POD, Cluster, ClusterBuilder, DEFAULT_ECHO_PORT, DEFAULT_PREFIX, Host, LinkLocalScope,
    Role,
};
pub use echo::{ECHO_BINARY_ENV, EchoSpec, echo_binary};
pub use error::{Result, TestbedError};
pub use netns::{Namespace, list_namespaces, sweep_stale};
pub use outcome::{BurstReport, Outcome, PeerReport, Protocol, Ready, Reply, Tally};
pub use session::Session;
