//! Echo servers (`kp-echo serve`) running inside namespaces, and locating the binary.

use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::Duration;

use crate::command::{describe, in_namespace, kill_child};
use crate::error::{Result, TestbedError};
use crate::lines::{Lines, Next};
use crate::outcome::Ready;

/// Environment variable that overrides where [`echo_binary`] finds `kp-echo`.
pub const ECHO_BINARY_ENV: &str = "KP_TESTBED_ECHO_BIN";

/// The echo binary's file name (the `[[bin]]` target of this crate).
const ECHO_BINARY_NAME: &str = "kp-echo";

/// How long an echo server may take to bind its sockets: it needs milliseconds, the bound
/// only covers a loaded CI machine.
const READY_DEADLINE: Duration = Duration::from_secs(10);

/// Locates the `kp-echo` binary for tests of *other* crates.
///
/// Cargo builds a package's binaries only for that package's own tests, so a dependent
/// crate's test cannot use `env!("CARGO_BIN_EXE_kp-echo")`. This looks, in order, at
/// [`ECHO_BINARY_ENV`], then next to the running test executable's directory
/// (`target/<profile>/deps/<test>` → `target/<profile>/kp-echo`) and in that directory.
/// Dependents must therefore have built it first: `cargo test --workspace` (which builds
/// every binary) or `cargo build -p kp-testbed --bins`; otherwise this returns
/// [`TestbedError::EchoBinaryMissing`] saying so.
pub fn echo_binary() -> Result<PathBuf> {
    let mut searched = Vec::new();
    if let Some(path) = std::env::var_os(ECHO_BINARY_ENV) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        searched.push(path);
    }
    let exe = std::env::current_exe()?;
    let dirs = [exe.parent().and_then(Path::parent), exe.parent()];
    for dir in dirs.into_iter().flatten() {
        let candidate = dir.join(ECHO_BINARY_NAME);
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(candidate);
    }
    Err(TestbedError::EchoBinaryMissing { searched })
}

/// What an echo server is called and which ports it answers on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EchoSpec {
    name: String,
    tcp: Vec<u16>,
    udp: Vec<u16>,
    sctp: Vec<u16>,
    udp_bind: Vec<IpAddr>,
}

impl EchoSpec {
    /// An echo server reporting `name` (usually the pod's name), with no ports yet.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            tcp: Vec::new(),
            udp: Vec::new(),
            sctp: Vec::new(),
            udp_bind: Vec::new(),
        }
    }

    /// Also answer TCP on `port`.
    #[must_use]
    pub fn tcp(mut self, port: u16) -> Self {
        self.tcp.push(port);
        self
    }

    /// Also answer UDP on `port`.
    #[must_use]
    pub fn udp(mut self, port: u16) -> Self {
        self.udp.push(port);
        self
    }

    /// Also answer SCTP on `port` (needs a kernel with SCTP sockets).
    #[must_use]
    pub fn sctp(mut self, port: u16) -> Self {
        self.sctp.push(port);
        self
    }

    /// Binds the UDP ports to `addr` (repeatable) instead of the wildcard, so that replies
    /// leave from the address a datagram arrived on even in a namespace with several
    /// addresses. [`crate::Cluster::start_echo`] binds to the host's addresses when none
    /// are given; TCP always listens on every address.
    #[must_use]
    pub fn udp_bind(mut self, addr: IpAddr) -> Self {
        self.udp_bind.push(addr);
        self
    }

    /// The addresses UDP binds to (empty: the wildcard).
    pub fn udp_bind_addrs(&self) -> &[IpAddr] {
        &self.udp_bind
    }

    /// The name the server reports in each reply.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The TCP ports.
    pub fn tcp_ports(&self) -> &[u16] {
        &self.tcp
    }

    /// The UDP ports.
    pub fn udp_ports(&self) -> &[u16] {
        &self.udp
    }

    /// The SCTP ports.
    pub fn sctp_ports(&self) -> &[u16] {
        &self.sctp
    }
}

/// A running `kp-echo serve` process; dropping it kills the process.
#[derive(Debug)]
pub(crate) struct EchoServer {
    spec: EchoSpec,
    ns: String,
    child: Child,
}

impl EchoServer {
    /// Starts the server in `ns` and waits until it reports that every socket listens.
    /// `args` come before the tool's own subcommand (see
    /// [`crate::ClusterBuilder::echo_command`]).
    pub(crate) fn start(binary: &Path, args: &[String], ns: &str, spec: EchoSpec) -> Result<Self> {
        let mut command = in_namespace(ns, binary);
        command.args(args).args(["serve", "--name", &spec.name]);
        for port in &spec.tcp {
            command.args(["--tcp", &port.to_string()]);
        }
        for port in &spec.udp {
            command.args(["--udp", &port.to_string()]);
        }
        for port in &spec.sctp {
            command.args(["--sctp", &port.to_string()]);
        }
        for addr in &spec.udp_bind {
            command.args(["--udp-bind", &addr.to_string()]);
        }
        // stdin stays open as a lifeline: the server exits when this process dies.
        command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        tracing::debug!(command = %describe(&command), "starting echo server");
        let mut child = command.spawn().map_err(|source| TestbedError::Spawn {
            command: describe(&command),
            source,
        })?;
        let Some(stdout) = child.stdout.take() else {
            kill_child(&mut child);
            return Err(TestbedError::EchoStartFailed {
                name: spec.name,
                detail: "no stdout pipe".to_owned(),
            });
        };
        let lines = Lines::spawn(stdout);
        let failure = match lines.next(READY_DEADLINE) {
            Next::Line(line) => match serde_json::from_str::<Ready>(&line) {
                Ok(ready) if ready.ready == spec.name => None,
                _ => Some(format!("unexpected first line {line:?}")),
            },
            Next::Ended => Some("exited before listening".to_owned()),
            Next::Silent => Some(format!("not listening after {READY_DEADLINE:?}")),
        };
        if let Some(detail) = failure {
            kill_child(&mut child);
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            return Err(TestbedError::EchoStartFailed {
                name: spec.name,
                detail: format!("{detail}; stderr: {}", stderr.trim()),
            });
        }
        Ok(Self {
            spec,
            ns: ns.to_owned(),
            child,
        })
    }

    /// What this server was started with.
    pub(crate) fn spec(&self) -> &EchoSpec {
        &self.spec
    }

    /// The namespace it runs in.
    pub(crate) fn ns(&self) -> &str {
        &self.ns
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        kill_child(&mut self.child);
    }
}
