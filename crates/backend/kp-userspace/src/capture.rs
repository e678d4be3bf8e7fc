//! Capture: how service traffic reaches the relay's frontends. The relay does not care; a
//! [`Capture`] turns a [`CapturePlan`] (which service addresses go to which relay port, and
//! which are refused or dropped) into the platform's rules. [`iptables`](crate::iptables) is
//! the Linux one; `FakeCapture` (`test-util`) records plans for tests.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, PoisonError};

use kp_core::backend::{ApplyError, SyncKind};
use kp_core::model::{IpFamily, ServicePortName};
pub use kp_rules::userspace::{CapturedPort, Target};

/// Every captured service port, per family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapturePlan {
    /// Per family, its service ports with that family's addresses.
    pub families: BTreeMap<IpFamily, Vec<CapturedPort>>,
    /// Per family, the local address the relay's frontends listen on, to DNAT to; a family
    /// without one is REDIRECTed (frontends on the wildcard address).
    pub relay_addresses: BTreeMap<IpFamily, IpAddr>,
}

impl CapturePlan {
    /// Number of captured service ports over all families.
    pub fn len(&self) -> usize {
        self.families.values().map(Vec::len).sum()
    }

    /// Whether nothing is captured.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why capturing failed. The previous rules stay; the next sync is full.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The platform rejected the rules (what was applied, for example `iptables-restore
    /// (V4)`, and the tool's error).
    #[error(transparent)]
    Apply(#[from] ApplyError),
}

/// Steers service traffic to the relay.
pub trait Capture: Send {
    /// Make the platform's rules match `plan`. `changed` is `None` for a full rewrite, or
    /// the service ports whose rules changed (their relay ports or targets); the others'
    /// rules may be left as they are. Returns the kind that ran: full when asked, or when
    /// the capture had to rewrite everything.
    fn apply(
        &mut self,
        plan: &CapturePlan,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> impl Future<Output = Result<SyncKind, CaptureError>> + Send;

    /// Remove every rule this capture (or any other kube-proxy mode) installed.
    fn cleanup(&mut self) -> impl Future<Output = Result<(), CaptureError>> + Send;

    /// The canary check: what another program removed of the last apply's rules (see
    /// [`kp_core::backend::Backend::verify`]).
    fn verify(
        &mut self,
        check: kp_core::foreign::Check,
    ) -> impl Future<Output = Result<Vec<kp_core::foreign::ForeignChange>, CaptureError>> + Send
    {
        let _ = check;
        std::future::ready(Ok(Vec::new()))
    }
}

#[cfg(any(test, feature = "test-util"))]
/// One `apply` as [`FakeCapture`] saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedApply {
    /// The plan.
    pub plan: CapturePlan,
    /// The changed set (`None`: full).
    pub changed: Option<BTreeSet<ServicePortName>>,
}

#[cfg(any(test, feature = "test-util"))]
/// A capture that records plans and installs nothing. Clones share the record.
#[derive(Clone, Debug, Default)]
pub struct FakeCapture {
    record: Arc<Mutex<FakeRecord>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeRecord {
    applies: Vec<RecordedApply>,
    failures_left: usize,
    cleanups: usize,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeCapture {
    /// A fake that succeeds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `n` applies fail.
    pub fn fail_next(&self, n: usize) {
        self.lock().failures_left = n;
    }

    /// Every apply so far (failed ones included).
    pub fn applies(&self) -> Vec<RecordedApply> {
        self.lock().applies.clone()
    }

    /// How many times `cleanup` ran.
    pub fn cleanups(&self) -> usize {
        self.lock().cleanups
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeRecord> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
impl Capture for FakeCapture {
    async fn apply(
        &mut self,
        plan: &CapturePlan,
        changed: Option<&BTreeSet<ServicePortName>>,
    ) -> Result<SyncKind, CaptureError> {
        let mut record = self.lock();
        record.applies.push(RecordedApply {
            plan: plan.clone(),
            changed: changed.cloned(),
        });
        if record.failures_left > 0 {
            record.failures_left -= 1;
            return Err(ApplyError::Injected {
                what: "fake capture".into(),
            }
            .into());
        }
        Ok(match changed {
            None => SyncKind::Full,
            Some(_) => SyncKind::Partial,
        })
    }

    async fn cleanup(&mut self) -> Result<(), CaptureError> {
        self.lock().cleanups += 1;
        Ok(())
    }
}
