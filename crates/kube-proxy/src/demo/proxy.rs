//! The proxy under demonstration: this binary, re-run inside the node namespace.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kp_testbed::proxy::{FIRST_SYNC_LOG, ProxyLaunch, ProxyProcess};
use kp_testbed::{Cluster, TestbedError};

use super::DemoError;

/// How long the first sync may take. Three services sync in well under a second; the bound
/// covers a heavily loaded machine and a cold page cache.
const FIRST_SYNC_DEADLINE: Duration = Duration::from_secs(60);

/// How long the proxy gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// How many log lines an error shows.
const LOG_TAIL: usize = 30;

/// A running `kube-proxy` in the node namespace (kp-testbed's harness); stopped (and if need
/// be killed) on drop.
pub(super) struct DemoProxy {
    process: Option<ProxyProcess>,
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
        let process = ProxyLaunch::new(cluster.node_ns(), exe)
            .arg(format!("--manifests={}", manifests.display()))
            .arg(format!("--proxy-mode={mode}"))
            .arg(format!("--hostname-override={node}"))
            .args([
                "--cluster-cidr=10.244.0.0/16",
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0s",
                "--conntrack-tcp-timeout-close-wait=0s",
                "--iptables-min-sync-period=0s",
                "--healthz-bind-address=127.0.0.1:10256",
                "--metrics-bind-address=127.0.0.1:10249",
            ])
            .stop_grace(STOP_GRACE)
            .spawn()
            .map_err(|error| match error {
                TestbedError::Spawn { source, .. } => DemoError::Proxy {
                    what: format!("cannot start {}: {source}", exe.display()),
                    log: String::new(),
                },
                other => DemoError::Testbed(other),
            })?;
        Ok(Self {
            process: Some(process),
        })
    }

    /// Waits for the first sync and returns its log line's details (services, time taken).
    pub(super) fn wait_first_sync(&mut self, stop: &AtomicBool) -> Result<String, DemoError> {
        let Some(process) = self.process.as_mut() else {
            return Err(DemoError::Interrupted);
        };
        let tail = |process: &ProxyProcess| process.tail(LOG_TAIL);
        match process.wait_first_sync_unless(FIRST_SYNC_DEADLINE, || stop.load(Ordering::SeqCst)) {
            Ok(entry) => {
                let details = entry
                    .line
                    .split_once(FIRST_SYNC_LOG)
                    .map_or("", |(_, details)| details);
                Ok(format!("first sync done ({})", details.trim()))
            }
            Err(TestbedError::Interrupted) => Err(DemoError::Interrupted),
            Err(TestbedError::ProxyTimedOut { .. }) => Err(DemoError::Proxy {
                what: format!(
                    "kube-proxy did not complete its first sync within {FIRST_SYNC_DEADLINE:?}"
                ),
                log: tail(process),
            }),
            Err(TestbedError::ProxyExited { status, .. }) => Err(DemoError::Proxy {
                what: format!("kube-proxy exited ({status})"),
                log: tail(process),
            }),
            Err(other) => Err(DemoError::Testbed(other)),
        }
    }

    /// SIGTERM, a bounded wait, then SIGKILL.
    pub(super) fn stop(&mut self) {
        // The harness's drop does it (the grace was set at the start).
        self.process = None;
    }
}
