//! The cost of the socket-destroy pass (issue 36: sockets of removed endpoints) on a node
//! with many pods, in this kernel (as root):
//!
//! ```text
//! cargo run --release -p kp-socklb --example destroy_cost -- [NAMESPACES] [SOCKETS] [RUNS]
//! ```
//!
//! Starts NAMESPACES processes, each in a network namespace of its own (`unshare --net`, as
//! pods are), opens SOCKETS sockets in each (half connected UDP sockets, half the two ends
//! of TCP connections over its loopback), loads the programs (not attached) and runs the
//! pass RUNS times for one removed (Service port, endpoint) pair: the `setns` and the two
//! iterator runs in every network namespace of the node (the ones other programs of the
//! host have included, counted in the output). No socket is the programs' own, so none is
//! destroyed: this is the walk every sync that removed endpoints pays. Prints p50 / max and
//! the load. Measurements only. Needs `ulimit -n` above NAMESPACES × SOCKETS.

use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kp_core::model::Protocol;
use kp_socklb::{ServiceKey, SocketPrograms};

/// A process in a network namespace of its own, killed on drop.
struct Pod(Child);

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn pod() -> std::io::Result<Pod> {
    let child = Command::new("unshare")
        .args(["--net", "sh", "-c", "ip link set lo up && exec sleep 3600"])
        .stdin(Stdio::null())
        .spawn()?;
    Ok(Pod(child))
}

/// Opens `sockets` sockets in the network namespace of `pid` (from a thread that enters it).
fn fill(pid: u32, sockets: usize) -> std::io::Result<Vec<OwnedFd>> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                rustix::thread::move_into_link_name_space(
                    ns.as_fd(),
                    Some(rustix::thread::LinkNameSpaceType::Network),
                )?;
                open_sockets(sockets)
            })
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the filling thread panicked")))
    })
}

fn open_sockets(sockets: usize) -> std::io::Result<Vec<OwnedFd>> {
    let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let mut held = Vec::with_capacity(sockets);
    for _ in 0..sockets / 2 {
        let udp = UdpSocket::bind(lo)?;
        udp.connect((Ipv4Addr::LOCALHOST, 9))?;
        held.push(OwnedFd::from(udp));
    }
    let listener = TcpListener::bind(lo)?;
    let to = listener.local_addr()?;
    for _ in 0..sockets / 4 {
        let client = TcpStream::connect(to)?;
        let (server, _) = listener.accept()?;
        held.push(OwnedFd::from(client));
        held.push(OwnedFd::from(server));
    }
    Ok(held)
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let namespaces: usize = args.next().map_or(Ok(100), |a| a.parse())?;
    let sockets: usize = args.next().map_or(Ok(1_000), |a| a.parse())?;
    let runs: usize = args.next().map_or(Ok(20), |a| a.parse())?;
    println!("load before: {}", load());
    let pods = (0..namespaces)
        .map(|_| pod())
        .collect::<Result<Vec<_>, _>>()?;
    // Let each `unshare` enter its namespace (and bring its loopback up) before filling it.
    std::thread::sleep(Duration::from_millis(500));
    let mut held = Vec::new();
    for pod in &pods {
        held.push(fill(pod.0.id(), sockets)?);
    }
    let opened: usize = held.iter().map(Vec::len).sum();
    let (mut programs, _maps) = SocketPrograms::load()?;
    let key = ServiceKey::new("10.96.0.10:80".parse()?, Protocol::Tcp);
    let removed = [(key, "10.244.0.99:8080".parse()?)];
    let mut samples = Vec::with_capacity(runs);
    let mut walked = 0;
    for _ in 0..runs {
        let started = Instant::now();
        let report = programs.destroy_sockets(&removed)?;
        samples.push(started.elapsed());
        walked = report.namespaces;
    }
    samples.sort_unstable();
    println!(
        "{namespaces} namespaces x {sockets} sockets ({opened} open; {walked} \
         namespaces walked in all): pass p50 {:?}, max {:?} over {runs} runs \
         (load after: {})",
        samples[samples.len() / 2],
        samples.last().copied().unwrap_or_default(),
        load()
    );
    drop(held);
    drop(pods);
    Ok(())
}
