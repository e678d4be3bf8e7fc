//! The proxy under demonstration: this binary, re-run inside the node namespace.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::time::{Duration, Instant};

use kp_testbed::Cluster;

use super::{DemoError, check};

/// The line the proxy logs once its rules are first in place (kp-core's proxier).
const FIRST_SYNC: &str = "first sync of proxy rules complete";

/// How long the first sync may take. Three services sync in well under a second; the bound
/// covers a heavily loaded machine and a cold page cache.
const FIRST_SYNC_DEADLINE: Duration = Duration::from_secs(60);

/// How long the proxy gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// How many log lines an error shows.
const LOG_TAIL: usize = 30;

/// A running `kube-proxy` in the node namespace; stopped (and if need be killed) on drop.
pub(super) struct DemoProxy {
    child: Option<Child>,
    lines: mpsc::Receiver<String>,
    log: Arc<Mutex<Vec<String>>>,
}

impl DemoProxy {
    /// Starts `exe` in `cluster`'s node namespace in `mode`, reading `manifests`.
    ///
    /// Flags beyond the mode keep it from touching anything global: no conntrack table size
    /// (a host-wide setting) and no conntrack timeouts; its admin servers listen inside the
    /// node namespace only.
    pub(super) fn start(
        exe: &Path,
        cluster: &Cluster,
        manifests: &Path,
        mode: &str,
        node: &str,
    ) -> Result<Self, DemoError> {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", cluster.node_ns()])
            .arg(exe)
            .arg(format!("--manifests={}", manifests.display()))
            .arg(format!("--proxy-mode={mode}"))
            .arg(format!("--hostname-override={node}"))
            .arg("--cluster-cidr=10.244.0.0/16")
            .arg("--conntrack-max-per-core=0")
            .arg("--conntrack-tcp-timeout-established=0s")
            .arg("--conntrack-tcp-timeout-close-wait=0s")
            .arg("--iptables-min-sync-period=0s")
            .arg("--healthz-bind-address=127.0.0.1:10256")
            .arg("--metrics-bind-address=127.0.0.1:10249")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().map_err(|error| DemoError::Proxy {
            what: format!("cannot start {}: {error}", exe.display()),
            log: String::new(),
        })?;
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = child.stderr.take() {
            let keep = Arc::clone(&log);
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    keep.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(line.clone());
                    // The receiver goes away once the first sync was seen; keep logging.
                    let _ = tx.send(line);
                }
            });
        }
        Ok(Self {
            child: Some(child),
            lines,
            log,
        })
    }

    /// Waits for the first sync and returns its log line's details (services, time taken).
    pub(super) fn wait_first_sync(&mut self, stop: &AtomicBool) -> Result<String, DemoError> {
        let deadline = Instant::now() + FIRST_SYNC_DEADLINE;
        loop {
            check(stop)?;
            if Instant::now() >= deadline {
                return Err(self.failed(format!(
                    "kube-proxy did not complete its first sync within {FIRST_SYNC_DEADLINE:?}"
                )));
            }
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    if let Some((_, details)) = line.split_once(FIRST_SYNC) {
                        return Ok(format!("first sync done ({})", details.trim()));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self
                        .child
                        .as_mut()
                        .and_then(|c| c.wait().ok())
                        .map_or_else(|| "unknown".to_owned(), |s| s.to_string());
                    return Err(self.failed(format!("kube-proxy exited ({status})")));
                }
            }
        }
    }

    fn failed(&self, what: String) -> DemoError {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        let start = log.len().saturating_sub(LOG_TAIL);
        DemoError::Proxy {
            what,
            log: log[start..].join("\n"),
        }
    }

    /// SIGTERM, a bounded wait, then SIGKILL.
    pub(super) fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if matches!(child.try_wait(), Ok(None)) {
            // `ip netns exec` execs the proxy, so the child's pid is the proxy's.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + STOP_GRACE;
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for DemoProxy {
    fn drop(&mut self) {
        self.stop();
    }
}
