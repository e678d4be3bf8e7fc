//! The boundary between the core and a proxy mode.
//!
//! A backend turns the desired state into kernel state. The core decides *when* to sync,
//! *what* changed and whether the sync is full or partial; the backend decides *how*, and
//! reports the kind that ran ([`SyncReport::kind`]): it may have to run a partial sync fully
//! (a retry, a changed fixed part), never the other way round. Backends must keep the last
//! good rules in place when a sync fails, and report the failure so the core asks for a full
//! sync next.

use std::collections::BTreeSet;
use std::future::Future;

use crate::foreign::{Check, ForeignChange};
use crate::model::ServiceName;
use crate::tracker::ProxyState;

/// Whether a sync may touch only what changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// Rewrite everything: at start, after any failure or change behind the backend's back,
    /// and after node label changes.
    Full,
    /// Rewrite only the services in [`SyncRequest::changed`] (plus top-level dispatch).
    Partial,
}

/// Everything a backend needs for one sync.
#[derive(Debug)]
pub struct SyncRequest<'a> {
    /// The complete desired state.
    pub state: &'a ProxyState,
    /// Full or partial, as the core decided: partial only right after a successful sync of
    /// this backend, with no failure, cleanup or foreign change since. The backend keeps no
    /// flag of its own; driving it directly, ask for a full sync first.
    pub kind: SyncKind,
    /// Services whose Service or EndpointSlices changed since the last successful sync.
    pub changed: &'a BTreeSet<ServiceName>,
    /// Stale UDP/SCTP conntrack entries may exist (a changed service has a UDP/SCTP port).
    pub conntrack_cleanup_required: bool,
}

/// What a successful sync did, for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncReport {
    /// The kind that ran: [`SyncKind::Full`] when asked, or when the backend had to rewrite
    /// everything although a partial sync was asked. The core counts the sync as this kind.
    pub kind: SyncKind,
    /// Number of rules (or map elements, or virtual servers) written.
    pub rules_written: usize,
    /// Services skipped because they could not be programmed; the rest were.
    pub skipped: Vec<ServiceName>,
}

impl SyncReport {
    /// A sync of `kind` that wrote nothing and skipped nothing (yet).
    pub fn new(kind: SyncKind) -> Self {
        Self {
            kind,
            rules_written: 0,
            skipped: Vec::new(),
        }
    }
}

/// Why a sync failed. The previous rules stay in place; the next sync is full.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Applying the rules to the kernel failed (a restore or netlink transaction).
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// The mode is not available on this node (missing kernel feature or binary).
    #[error("proxy mode unavailable: {0}")]
    Unavailable(String),
}

impl BackendError {
    /// The apply error, if applying failed.
    pub fn apply(&self) -> Option<&ApplyError> {
        match self {
            BackendError::Apply(err) => Some(err),
            BackendError::Unavailable(_) => None,
        }
    }
}

/// The error underneath an [`ApplyError`], of the I/O layer's own type (the core cannot name
/// those types; `downcast_ref` finds them again).
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why applying failed, by the path that failed. Each names what was applied (`what`, for
/// example `iptables-restore`, shown first in the message) and keeps the error underneath as
/// its source.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// Running a tool: `iptables-restore`, `iptables`, `ipset`, `nft`.
    #[error("applying {what} failed")]
    Tool {
        /// What was applied.
        what: String,
        /// The tool's error (its exit code and stderr, or why it could not run).
        source: Cause,
    },
    /// An nf_tables netlink transaction or request.
    #[error("applying {what} failed")]
    Netfilter {
        /// What was applied.
        what: String,
        /// The kernel's or the socket's error.
        source: Cause,
    },
    /// An IPVS (generic netlink) request.
    #[error("applying {what} failed")]
    Ipvs {
        /// What was applied.
        what: String,
        /// The kernel's or the socket's error.
        source: Cause,
    },
    /// An rtnetlink request: a device or its addresses.
    #[error("applying {what} failed")]
    Link {
        /// What was applied.
        what: String,
        /// The kernel's or the socket's error.
        source: Cause,
    },
    /// Rendering the rules failed (a renderer bug: the configuration was validated).
    #[error("applying {what} failed")]
    Render {
        /// What was rendered.
        what: String,
        /// The renderer's error.
        source: Cause,
    },
    /// The userspace relay's capture of service traffic, or its service addresses.
    #[error("applying {what} failed")]
    Capture {
        /// What was applied.
        what: String,
        /// The capture's error.
        source: Cause,
    },
    /// A failure a test injected (`FakeBackend::fail_next` and the other fakes).
    #[error("applying {what} failed: injected failure")]
    Injected {
        /// Which fake.
        what: String,
    },
}

impl ApplyError {
    /// What was being applied.
    pub fn what(&self) -> &str {
        match self {
            ApplyError::Tool { what, .. }
            | ApplyError::Netfilter { what, .. }
            | ApplyError::Ipvs { what, .. }
            | ApplyError::Link { what, .. }
            | ApplyError::Render { what, .. }
            | ApplyError::Capture { what, .. }
            | ApplyError::Injected { what } => what,
        }
    }

    /// [`ApplyError::Tool`].
    pub fn tool(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Tool {
            what: what.into(),
            source: source.into(),
        }
    }

    /// [`ApplyError::Netfilter`].
    pub fn netfilter(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Netfilter {
            what: what.into(),
            source: source.into(),
        }
    }

    /// [`ApplyError::Ipvs`].
    pub fn ipvs(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Ipvs {
            what: what.into(),
            source: source.into(),
        }
    }

    /// [`ApplyError::Link`].
    pub fn link(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Link {
            what: what.into(),
            source: source.into(),
        }
    }

    /// [`ApplyError::Render`].
    pub fn render(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Render {
            what: what.into(),
            source: source.into(),
        }
    }

    /// [`ApplyError::Capture`].
    pub fn capture(what: impl Into<String>, source: impl Into<Cause>) -> Self {
        ApplyError::Capture {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// A proxy mode. Implementations live in the dataplane crates; `FakeBackend` (the `test-util`
/// feature) records syncs.
pub trait Backend: Send {
    /// The mode's name as served on `/proxyMode`, for example `iptables`.
    fn mode(&self) -> &'static str;

    /// Make the kernel match `request.state`.
    fn sync(
        &mut self,
        request: &SyncRequest<'_>,
    ) -> impl Future<Output = Result<SyncReport, BackendError>> + Send;

    /// Remove everything this mode ever installed (`--cleanup`).
    fn cleanup(&mut self) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// After a successful sync: how soon the kernel needs another look even if nothing
    /// changes (ipvs mode's real servers draining at weight 0, deleted once their
    /// connections are gone). The runner syncs by then at the latest; `None`: no need.
    fn recheck_after(&self) -> Option<std::time::Duration> {
        None
    }

    /// Check cheaply that the kernel still holds what the last successful sync wrote (the
    /// canaries: jumps from the built-in chains, our tables, devices). Called on the canary
    /// period, before every periodic sync and when a watcher cannot tell whose a change was;
    /// never during a sync. Each finding is one foreign change; empty: all in place.
    fn verify(
        &mut self,
        check: Check,
    ) -> impl Future<Output = Result<Vec<ForeignChange>, BackendError>> + Send {
        let _ = check;
        std::future::ready(Ok(Vec::new()))
    }

    /// Another program changed the kernel: what the backend believes it holds may be wrong,
    /// so the next (full) sync must read it again instead of trusting its bookkeeping.
    fn kernel_changed_behind_our_back(&mut self) {}
}

#[cfg(any(test, feature = "test-util"))]
/// One sync as seen by [`FakeBackend`].
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedSync {
    /// Full or partial.
    pub kind: SyncKind,
    /// Which services were reported as changed.
    pub changed: BTreeSet<ServiceName>,
    /// The number of service ports in the state.
    pub service_ports: usize,
    /// The number of endpoints across all service ports.
    pub endpoints: usize,
    /// Whether conntrack cleanup was requested.
    pub conntrack_cleanup_required: bool,
    /// A copy of the state it was asked to program.
    pub state: ProxyState,
}

#[cfg(any(test, feature = "test-util"))]
/// A backend that programs nothing and records every sync, for tests. (`--proxy-mode fake`
/// is the binary's own dry-run backend, which logs each sync instead.)
///
/// Clones share the record, so a test keeps one clone and hands the other to the proxier.
#[derive(Clone, Debug, Default)]
pub struct FakeBackend {
    record: std::sync::Arc<std::sync::Mutex<FakeRecord>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeRecord {
    syncs: Vec<RecordedSync>,
    failures_left: usize,
    /// Partial syncs still to run fully, as a backend whose fixed part changed would.
    promotions_left: usize,
    cleanups: usize,
    /// How long each sync takes (tokio time).
    takes: std::time::Duration,
    /// What the next `verify` finds (then nothing).
    foreign: Vec<ForeignChange>,
    verifies: usize,
    /// How long each `verify` takes (tokio time).
    verify_takes: std::time::Duration,
    forgotten: usize,
    /// What the next successful sync reports as skipped (then nothing).
    skip: Vec<ServiceName>,
    /// What `recheck_after` answers.
    recheck_after: Option<std::time::Duration>,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeBackend {
    /// A fake that succeeds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Make the next `n` syncs fail with [`ApplyError::Injected`].
    pub fn fail_next(&self, n: usize) {
        self.lock().failures_left = n;
    }

    /// Make the next `n` partial syncs run (and report) full, as a backend does when it must
    /// rewrite everything.
    pub fn run_full_next(&self, n: usize) {
        self.lock().promotions_left = n;
    }

    /// Make every sync take `duration` of tokio time, as a large cluster's would (the sync
    /// runner rests in proportion to how long syncs take).
    pub fn take(&self, duration: std::time::Duration) {
        self.lock().takes = duration;
    }

    /// Make the next successful sync report `services` as skipped (not programmed).
    pub fn skip_next(&self, services: Vec<ServiceName>) {
        self.lock().skip = services;
    }

    /// Make every successful sync ask for another look within `after`, as ipvs mode does
    /// while real servers drain.
    pub fn recheck_within(&self, after: std::time::Duration) {
        self.lock().recheck_after = Some(after);
    }

    /// Every sync attempted so far (failed ones included).
    pub fn syncs(&self) -> Vec<RecordedSync> {
        self.lock().syncs.clone()
    }

    /// Make the next `verify` find `changes`.
    pub fn find_on_verify(&self, changes: Vec<ForeignChange>) {
        self.lock().foreign = changes;
    }

    /// Make every `verify` take `duration` of tokio time, as a slow machine's would.
    pub fn verify_take(&self, duration: std::time::Duration) {
        self.lock().verify_takes = duration;
    }

    /// How many times `verify` ran.
    pub fn verifies(&self) -> usize {
        self.lock().verifies
    }

    /// How many times the proxier said the kernel changed behind the backend's back.
    pub fn forgotten(&self) -> usize {
        self.lock().forgotten
    }

    /// How many times `cleanup` ran.
    pub fn cleanups(&self) -> usize {
        self.lock().cleanups
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeRecord> {
        // A panic while holding this lock can only come from a test; keep the record usable.
        self.record
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Backend for FakeBackend {
    fn mode(&self) -> &'static str {
        "fake"
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let (fail, takes, kind) = {
            let mut record = self.lock();
            record.syncs.push(RecordedSync {
                kind: request.kind,
                changed: request.changed.clone(),
                service_ports: request.state.services.len(),
                endpoints: request.state.endpoints.values().map(Vec::len).sum(),
                conntrack_cleanup_required: request.conntrack_cleanup_required,
                state: request.state.clone(),
            });
            let fail = record.failures_left > 0;
            record.failures_left = record.failures_left.saturating_sub(1);
            let mut kind = request.kind;
            if kind == SyncKind::Partial && record.promotions_left > 0 {
                record.promotions_left -= 1;
                kind = SyncKind::Full;
            }
            (fail, record.takes, kind)
        };
        if !takes.is_zero() {
            tokio::time::sleep(takes).await;
        }
        if fail {
            return Err(ApplyError::Injected {
                what: "fake".into(),
            }
            .into());
        }
        Ok(SyncReport {
            kind,
            rules_written: request.state.services.len(),
            skipped: std::mem::take(&mut self.lock().skip),
        })
    }

    fn recheck_after(&self) -> Option<std::time::Duration> {
        self.lock().recheck_after
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        self.lock().cleanups += 1;
        Ok(())
    }

    async fn verify(&mut self, _check: Check) -> Result<Vec<ForeignChange>, BackendError> {
        let takes = {
            let mut record = self.lock();
            record.verifies += 1;
            record.verify_takes
        };
        if !takes.is_zero() {
            tokio::time::sleep(takes).await;
        }
        Ok(std::mem::take(&mut self.lock().foreign))
    }

    fn kernel_changed_behind_our_back(&mut self) {
        self.lock().forgotten += 1;
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn apply_errors_read_as_before_and_keep_their_source() {
        let refused = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let err = BackendError::from(ApplyError::tool("iptables-restore", refused));
        assert_eq!(
            crate::report::Chain(&err).to_string(),
            "applying iptables-restore failed: denied"
        );
        let Some(ApplyError::Tool { what, .. }) = err.apply() else {
            panic!("{err:?}");
        };
        assert_eq!(what, "iptables-restore");
        let source = err.source().expect("the tool's error");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("of its own type");
        assert_eq!(io.kind(), std::io::ErrorKind::PermissionDenied);
        let injected = BackendError::from(ApplyError::Injected {
            what: "fake".into(),
        });
        assert_eq!(
            injected.to_string(),
            "applying fake failed: injected failure"
        );
        assert!(
            BackendError::Unavailable("no IPVS".into())
                .apply()
                .is_none()
        );
    }
}
