//! `kube-proxy demo`: a whole small cluster in network namespaces, the real proxy in its
//! node, real connections, and what they show, then everything removed again.
//!
//! The cluster is `kp-testbed`'s (node, second node, router, external clients, pods); the
//! pods' echo servers and the probes are this same binary re-run as `kube-proxy
//! testbed-echo ...` ([`ECHO_SUBCOMMAND`]), and the proxy is this binary re-run inside the
//! node namespace with `--manifests` pointing at the demo manifests of `examples/demo/`
//! (compiled in, written to a temporary directory). So `cargo run -p kube-proxy --features
//! demo -- demo` needs nothing else built, and the proxy under demonstration runs the
//! production code path.
//!
//! Nothing outside the namespaces changes: every link has both ends inside them, the proxy
//! is told not to touch the global conntrack sysctls, and its rules live in the node
//! namespace. Removal runs on success, on error, on panic (drop guards) and on SIGINT /
//! SIGTERM (the work checks a stop flag between steps, then unwinds the same way).

mod proxy;
mod report;

use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use kp_testbed::{Cluster, Host, TestbedError};

use proxy::DemoProxy;
use report::{Answer, Scenario};

use crate::ECHO_SUBCOMMAND;

/// Namespace prefix of the demo's cluster; names are `kpdemo-<pid>-<n>-<role>`, and a new
/// demo removes those of an earlier one that was killed before it could clean up.
const DEFAULT_PREFIX: &str = "kpdemo-";

/// The modes the demo can run. Others join this list once their backends exist.
const MODES: &[&str] = &["iptables", "nftables"];

/// This node's name in the demo manifests (`--hostname-override`).
const THIS_NODE: &str = "demo-node";

/// The demo manifests (`examples/demo/`), compiled in so the binary needs no checkout.
const MANIFESTS: [(&str, &str); 4] = [
    (
        "node.yaml",
        include_str!("../../../examples/demo/node.yaml"),
    ),
    ("web.yaml", include_str!("../../../examples/demo/web.yaml")),
    (
        "web-sticky.yaml",
        include_str!("../../../examples/demo/web-sticky.yaml"),
    ),
    (
        "web-nodeport.yaml",
        include_str!("../../../examples/demo/web-nodeport.yaml"),
    ),
];

/// The pods, in the order the testbed gives out addresses, with whether each lives on the
/// other node and the address the manifests expect it at.
const PODS: [(&str, bool, Ipv4Addr); 3] = [
    ("web-a", false, Ipv4Addr::new(10, 244, 1, 3)),
    ("web-b", false, Ipv4Addr::new(10, 244, 1, 4)),
    ("web-c", true, Ipv4Addr::new(10, 244, 2, 2)),
];

/// `default/web`: plain balancing.
const WEB: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)), 80);
/// `default/web-sticky`: ClientIP affinity.
const WEB_STICKY: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 11)), 80);
/// `default/web-nodeport`'s node port.
const NODE_PORT: u16 = 30080;

/// How long a probe waits for an answer. Answers take well under a millisecond between
/// namespaces; two seconds leaves room on a loaded machine and keeps a failure visible soon.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// How often a wait for Ctrl-C (`--keep`) looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(100);

/// `kube-proxy demo`'s flags.
#[derive(Debug, Parser)]
#[command(
    name = "kube-proxy demo",
    bin_name = "kube-proxy demo",
    about = "Build a small cluster in network namespaces, run the proxy in its node, send \
             traffic and show which pod answered; removes everything afterwards (needs root)"
)]
struct DemoArgs {
    /// Which proxy mode to demonstrate.
    #[arg(long = "proxy-mode", default_value = "iptables", value_parser = clap::builder::PossibleValuesParser::new(MODES))]
    proxy_mode: String,
    /// Connections per scenario.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u16).range(1..=200))]
    connections: u16,
    /// Keep the cluster after the traffic, printing commands to look inside, until Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// Network namespace name prefix.
    #[arg(long = "netns-prefix", default_value = DEFAULT_PREFIX, hide = true)]
    netns_prefix: String,
}

/// Why the demo stopped early.
#[derive(Debug, thiserror::Error)]
enum DemoError {
    /// Building, probing or removing the namespaces failed (not root, `ip` missing, ...).
    #[error(transparent)]
    Testbed(#[from] TestbedError),
    /// Writing the manifests or the output failed.
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The testbed gave a pod another address than the demo manifests use.
    #[error("pod {pod} got address {got}, but the demo manifests expect {expected}")]
    AddressMismatch {
        /// The pod.
        pod: &'static str,
        /// Its address in the testbed.
        got: IpAddr,
        /// Its address in the manifests.
        expected: Ipv4Addr,
    },
    /// The proxy could not start, exited, or never completed its first sync.
    #[error("{what}; the proxy's last log lines:\n{log}")]
    Proxy {
        /// What went wrong.
        what: String,
        /// The tail of its log.
        log: String,
    },
    /// Some connections were not answered as they should have been (printed above).
    #[error("{0} of the connections above did not behave as expected")]
    Unexpected(usize),
    /// SIGINT or SIGTERM arrived.
    #[error("interrupted")]
    Interrupted,
}

/// Runs `kube-proxy demo ARGS` (`args` starts with `demo`).
pub fn main(args: impl IntoIterator<Item = String>) -> ExitCode {
    let args = DemoArgs::parse_from(args);
    let stop = Arc::new(AtomicBool::new(false));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("kube-proxy demo: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let worker_stop = Arc::clone(&stop);
    let signal_stop = Arc::clone(&stop);
    let outcome = runtime.block_on(async move {
        let worker =
            tokio::task::spawn_blocking(move || run(&args, &worker_stop, &mut io::stdout()));
        tokio::pin!(worker);
        tokio::select! {
            joined = &mut worker => joined,
            signal = stop_signal() => {
                eprintln!("\n{signal} received: stopping the demo and removing its namespaces ...");
                signal_stop.store(true, Ordering::SeqCst);
                worker.await
            }
        }
    });
    // A Ctrl-C in a terminal reaches the demo's children too (same process group), so the
    // step in progress may fail before the demo notices the flag: that is still an interrupt.
    let interrupted = stop.load(Ordering::SeqCst);
    match outcome {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(_)) if interrupted => {
            eprintln!("kube-proxy demo: interrupted; everything it created was removed");
            ExitCode::from(130)
        }
        Ok(Err(error)) => {
            eprintln!("kube-proxy demo: {error}");
            eprintln!("(everything the demo created was removed)");
            ExitCode::FAILURE
        }
        Err(join) => {
            // The worker panicked: its drop guards ran while unwinding.
            eprintln!("kube-proxy demo: failed unexpectedly ({join}); its namespaces were removed");
            ExitCode::FAILURE
        }
    }
}

/// Resolves on SIGINT or SIGTERM, naming it; never when handlers cannot be installed (the
/// demo then still cleans up on every path but a signal).
async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        eprintln!("kube-proxy demo: cannot install signal handlers");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// Fails with [`DemoError::Interrupted`] once a signal has arrived.
fn check(stop: &AtomicBool) -> Result<(), DemoError> {
    if stop.load(Ordering::SeqCst) {
        Err(DemoError::Interrupted)
    } else {
        Ok(())
    }
}

/// The demo itself; every resource it makes is dropped (removed) when it returns or unwinds.
fn run(args: &DemoArgs, stop: &AtomicBool, out: &mut impl Write) -> Result<(), DemoError> {
    let exe = std::env::current_exe()?;
    let mode = args.proxy_mode.as_str();
    writeln!(
        out,
        "kube-proxy demo ({mode} mode): building a small cluster in network namespaces ..."
    )?;
    let mut builder = Cluster::builder()
        .prefix(&args.netns_prefix)
        .dual_stack(false)
        .probe_timeout(PROBE_TIMEOUT)
        .echo_command(&exe, &[ECHO_SUBCOMMAND]);
    for (name, remote, _) in PODS {
        builder = if remote {
            builder.remote_pod(name)
        } else {
            builder.pod(name)
        };
    }
    let cluster = builder.build()?;
    check(stop)?;
    for (name, _, expected) in PODS {
        let got = cluster.pod(name)?.ip();
        if got != IpAddr::V4(expected) {
            return Err(DemoError::AddressMismatch {
                pod: name,
                got,
                expected,
            });
        }
    }
    describe_cluster(&cluster, out)?;

    let manifests = tempfile::Builder::new()
        .prefix("kube-proxy-demo-")
        .tempdir()?;
    for (file, text) in MANIFESTS {
        std::fs::write(manifests.path().join(file), text)?;
    }
    writeln!(
        out,
        "\nStarting kube-proxy --proxy-mode={mode} in namespace {} with the manifests of examples/demo/ ...",
        cluster.node_ns()
    )?;
    let mut proxy = DemoProxy::start(&exe, &cluster, manifests.path(), mode, THIS_NODE)?;
    let first_sync = proxy.wait_first_sync(stop)?;
    writeln!(out, "kube-proxy is up: {first_sync}")?;
    check(stop)?;

    let count = usize::from(args.connections);
    let client = cluster.client();
    let mut unexpected = 0;
    let balancing = Scenario::new(
        format!(
            "1. Balancing: {count} connections from pod client ({}) to Service default/web at {WEB}",
            client.ip()
        ),
        answers(&cluster, client, WEB, count)?,
    );
    unexpected += balancing.print_balancing(out)?;
    check(stop)?;

    let sticky = Scenario::new(
        format!(
            "2. Session affinity (ClientIP): {count} connections from the same client to default/web-sticky at {WEB_STICKY}"
        ),
        answers(&cluster, client, WEB_STICKY, count)?,
    );
    unexpected += sticky.print_affinity(out)?;
    check(stop)?;

    let node_port = SocketAddr::new(cluster.node_ip(), NODE_PORT);
    let external = cluster.external_in();
    let nodeport = Scenario::new(
        format!(
            "3. NodePort: {count} connections from an external client ({}) to this node at {node_port}",
            external.ip()
        ),
        answers(&cluster, external, node_port, count)?,
    );
    unexpected += nodeport.print_node_port(out)?;

    writeln!(
        out,
        "\nWhy a packet went where it went: kube-proxy explain {WEB_STICKY} --from {} \
         --manifests examples/demo --hostname-override={THIS_NODE} --cluster-cidr=10.244.0.0/16",
        client.ip()
    )?;
    if args.keep {
        keep_until_stopped(&cluster, mode, stop, out)?;
    }
    check(stop)?;

    writeln!(
        out,
        "\nRemoving the demo: stopping kube-proxy, deleting {} namespaces ...",
        cluster.namespaces().len()
    )?;
    proxy.stop();
    drop(manifests);
    cluster.teardown()?;
    writeln!(
        out,
        "Done: nothing of the demo is left, and nothing outside its namespaces was changed."
    )?;
    if unexpected > 0 {
        return Err(DemoError::Unexpected(unexpected));
    }
    Ok(())
}

/// Prints who is where.
fn describe_cluster(cluster: &Cluster, out: &mut impl Write) -> io::Result<()> {
    writeln!(
        out,
        "  node   {THIS_NODE:<11} {:<12} namespace {}",
        cluster.node_ip(),
        cluster.node_ns()
    )?;
    for pod in cluster.pods() {
        let place = match pod.role() {
            kp_testbed::Role::Pod { remote: true } => "on the other node",
            _ => "on this node",
        };
        writeln!(
            out,
            "  pod    {:<11} {:<12} {place}, echo server on :{}",
            pod.name(),
            pod.ip(),
            kp_testbed::DEFAULT_ECHO_PORT
        )?;
    }
    writeln!(
        out,
        "  pod    {:<11} {:<12} the in-cluster client",
        cluster.client().name(),
        cluster.client().ip()
    )?;
    writeln!(
        out,
        "  client external-in {:<12} outside the cluster, behind a router",
        cluster.external_in().ip()
    )
}

/// `count` TCP connections from `from` to `to`, each from a new source port.
fn answers(
    cluster: &Cluster,
    from: &Host,
    to: SocketAddr,
    count: usize,
) -> Result<Vec<Answer>, DemoError> {
    let tally = cluster.tcp_repeat(from, to.ip(), to.port(), count)?;
    Ok(tally.outcomes().iter().map(Answer::from_outcome).collect())
}

/// `--keep`: prints how to look inside, then waits for Ctrl-C.
fn keep_until_stopped(
    cluster: &Cluster,
    mode: &str,
    stop: &AtomicBool,
    out: &mut impl Write,
) -> io::Result<()> {
    let node = cluster.node_ns();
    let rules = if mode == "nftables" {
        "nft list ruleset"
    } else {
        "iptables-save -t nat"
    };
    writeln!(
        out,
        "\nThe cluster stays up until Ctrl-C. Look inside:\n  ip netns exec {node} {rules}\n  \
         ip netns exec {} {} {ECHO_SUBCOMMAND} probe --proto tcp --to {WEB}",
        cluster.client().ns(),
        cluster.echo_binary_path().display()
    )?;
    out.flush()?;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(STOP_POLL);
    }
    Ok(())
}
