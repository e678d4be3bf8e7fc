//! The three-namespace path the data-path benchmarks (`kp-connect`, `kp-datapath`) measure:
//! client → node (forwarding; the proxy runs here) → server, joined by two veth pairs
//! (10.200.1.0/24 and 10.200.2.0/24), plus the child processes they start in those
//! namespaces, killed with their descendants when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::Context as _;

use crate::sys::{self, Netns};

/// The server's address on its veth.
pub const SERVER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 200, 2, 2);

/// A child process killed (by pid) with its descendants when dropped.
pub struct Guard(Child);

impl Guard {
    /// The process id (of `ip netns exec`, which execs the program).
    pub fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for pid in sys::descendants(self.0.id()) {
            sys::kill(pid, "KILL");
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How the node is addressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// 10.200.1.1/24 towards the client, 10.200.2.1/24 towards the server.
    Subnets,
    /// The node's only address is 169.254.100.2/30 on the server's link (the server holds
    /// 169.254.100.1 there as well as [`SERVER`]/32), no default route; client and server
    /// are on `/32` routes behind veths without an address on the node's side and use
    /// 169.254.100.2 as their gateway.
    LinkLocal,
}

/// The node's address in [`Shape::LinkLocal`].
pub const LINK_LOCAL_NODE: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 100, 2);

/// The three namespaces, deleted when dropped.
pub struct Topology {
    /// Where the client runs (10.200.1.2, default route via the node).
    pub client: Netns,
    /// The node (10.200.1.1 and 10.200.2.1, forwarding on).
    pub node: Netns,
    /// Where the servers run ([`SERVER`], default route via the node).
    pub server: Netns,
    /// The node's address the client side reaches it by (its Node object's InternalIP).
    pub node_ip: std::net::Ipv4Addr,
}

/// Runs `args[0] args[1..]` in `ns`.
pub fn ns_run(ns: &Netns, args: &[&str]) -> anyhow::Result<()> {
    ns.output(args[0], &args[1..]).map(|_| ())
}

/// Creates `<prefix>-<pid>-<n>-<tag>-{cl,node,srv}` and wires them up ([`Shape::Subnets`]).
pub fn topology(prefix: &str, tag: &str) -> anyhow::Result<Topology> {
    topology_of(Shape::Subnets, prefix, tag)
}

/// Creates `<prefix>-<pid>-<n>-<tag>-{cl,node,srv}` and wires them up as `shape`.
pub fn topology_of(shape: Shape, prefix: &str, tag: &str) -> anyhow::Result<Topology> {
    let prefix = format!("{prefix}-");
    let client = Netns::create(&prefix, &format!("{tag}-cl"))?;
    let node = Netns::create(&prefix, &format!("{tag}-node"))?;
    let server = Netns::create(&prefix, &format!("{tag}-srv"))?;
    let (c, s) = (client.name(), server.name());
    for (dev, peer, ns) in [("n0", "c0", c), ("n1", "s0", s)] {
        ns_run(
            &node,
            &[
                "ip", "link", "add", dev, "type", "veth", "peer", "name", peer, "netns", ns,
            ],
        )?;
    }
    let node_ip = match shape {
        Shape::Subnets => {
            for (ns, dev, addr) in [
                (&client, "c0", "10.200.1.2/24"),
                (&node, "n0", "10.200.1.1/24"),
                (&node, "n1", "10.200.2.1/24"),
                (&server, "s0", "10.200.2.2/24"),
            ] {
                ns_run(ns, &["ip", "addr", "add", addr, "dev", dev])?;
                ns_run(ns, &["ip", "link", "set", dev, "up"])?;
            }
            for (ns, gateway) in [(&client, "10.200.1.1"), (&server, "10.200.2.1")] {
                ns_run(ns, &["ip", "route", "add", "default", "via", gateway])?;
            }
            std::net::Ipv4Addr::new(10, 200, 1, 1)
        }
        Shape::LinkLocal => {
            for (ns, dev, addrs) in [
                (&client, "c0", &["10.200.1.2/32"][..]),
                (&node, "n0", &[][..]),
                (&node, "n1", &["169.254.100.2/30"][..]),
                (&server, "s0", &["10.200.2.2/32", "169.254.100.1/30"][..]),
            ] {
                for addr in addrs {
                    ns_run(ns, &["ip", "addr", "add", addr, "dev", dev])?;
                }
                ns_run(ns, &["ip", "link", "set", dev, "up"])?;
            }
            let gateway = LINK_LOCAL_NODE.to_string();
            for (ns, dev) in [(&client, "c0"), (&server, "s0")] {
                ns_run(
                    ns,
                    &["ip", "route", "add", &format!("{gateway}/32"), "dev", dev],
                )?;
                ns_run(
                    ns,
                    &[
                        "ip", "route", "replace", "default", "via", &gateway, "dev", dev,
                    ],
                )?;
            }
            for (pod, dev) in [("10.200.1.2/32", "n0"), ("10.200.2.2/32", "n1")] {
                ns_run(&node, &["ip", "route", "add", pod, "dev", dev])?;
            }
            LINK_LOCAL_NODE
        }
    };
    ns_run(&node, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    Ok(Topology {
        client,
        node,
        server,
        node_ip,
    })
}

/// Starts `program args` in `ns` with `env`, and the namespace's own state directory (so a
/// proxy's record of the sysctls it changed stays with the namespace).
pub fn spawn_in(
    ns: &Netns,
    program: impl AsRef<Path>,
    args: &[&str],
    stderr: Stdio,
    env: &[(&str, &str)],
) -> anyhow::Result<Guard> {
    let program = program.as_ref();
    let child = Command::new("ip")
        .envs(env.iter().copied())
        .env(kp_dataplane::sysctls::STATE_DIR_ENV, ns.state_dir())
        .args(["netns", "exec", ns.name()])
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("starting {} in {}", program.display(), ns.name()))?;
    Ok(Guard(child))
}
