//! The part of a kernel backend's sync that every mode shares, written once: the families of
//! one sync with the first error winning ([`FamilyErrors`]), and the stale-flow bookkeeping:
//! the UDP/SCTP part of the last programmed state and the deletion of the conntrack entries a
//! sync made stale, over ctnetlink by default ([`SyncState::succeeded`]).
//!
//! Whether a sync is full or partial is the core's decision ([`SyncRequest::kind`]); a backend
//! runs it (or, when it must, a full one) and reports the kind that ran. It keeps what is its
//! own (render, apply, its own view of the kernel) and calls these in this order:
//!
//! ```text
//! let mut errors = FamilyErrors::new(MODE);
//! for family in self.sync.families().to_vec() {
//!     if let Some(out) = errors.check(family, self.apply(family, request.kind).await) { ... }
//! }
//! errors.into_result()?;                           // the core asks for a full sync next
//! self.sync.succeeded(request, ran, &skipped).await; // conntrack cleanup, bookkeeping
//! ```

use kp_core::report::ErrorChain as _;
use std::collections::BTreeSet;
use std::time::Instant;

use kp_core::backend::{BackendError, SyncKind, SyncRequest};
use kp_core::model::{IpFamily, ServiceName};
use kp_core::tracker::ProxyState;
use tracing::{debug, warn};

use crate::conntrack::{
    Conntrack, DefaultConntrack, FlowFilter, delete_flows, delete_stale, refresh_conntrack_relevant,
};

/// What every kernel backend keeps between syncs: its families and the UDP/SCTP part of
/// the last programmed state.
#[derive(Debug)]
pub struct SyncState<C = DefaultConntrack> {
    families: Vec<IpFamily>,
    conntrack: C,
    /// The UDP/SCTP part of the last successfully programmed state (conntrack cleanup).
    programmed: Option<ProxyState>,
}

impl<C: Conntrack> SyncState<C> {
    /// Nothing synced yet: the first sync finds no stale flows.
    pub fn new(families: Vec<IpFamily>, conntrack: C) -> Self {
        Self {
            families,
            conntrack,
            programmed: None,
        }
    }

    /// The same bookkeeping deleting stale entries through `conntrack`.
    pub fn with_conntrack<D: Conntrack>(self, conntrack: D) -> SyncState<D> {
        SyncState {
            families: self.families,
            conntrack,
            programmed: self.programmed,
        }
    }

    /// The families to program, in order.
    pub fn families(&self) -> &[IpFamily] {
        &self.families
    }

    /// What deletes stale conntrack entries.
    pub fn conntrack(&self) -> &C {
        &self.conntrack
    }

    /// The UDP/SCTP part of the last programmed state; `None` before the first success.
    pub fn programmed(&self) -> Option<&ProxyState> {
        self.programmed.as_ref()
    }

    /// The kernel was changed behind the bookkeeping (cleanup): nothing is known programmed.
    pub fn reset(&mut self) {
        self.programmed = None;
    }

    /// After a successful sync that ran as `kind`: deletes the conntrack entries the change from the
    /// last programmed state made stale (when the core says some may be), and remembers the
    /// new state. `skipped` services count as not programmed, so the sync that programs them
    /// treats them as new.
    pub async fn succeeded(
        &mut self,
        request: &SyncRequest<'_>,
        kind: SyncKind,
        skipped: &BTreeSet<ServiceName>,
    ) {
        let full = kind == SyncKind::Full;
        if request.conntrack_cleanup_required {
            let started = Instant::now();
            // The core accumulates `changed` until a sync succeeds, so partial syncs need
            // only look at those services; full ones check everything.
            delete_stale(
                &self.conntrack,
                self.programmed.as_ref(),
                request.state,
                (!full).then_some(request.changed),
                &self.families,
            )
            .await;
            debug!(took = ?started.elapsed(), "conntrack cleanup finished");
        }
        refresh_conntrack_relevant(
            &mut self.programmed,
            request.state,
            (!full).then_some(request.changed),
        );
        if let Some(programmed) = self.programmed.as_mut()
            && !skipped.is_empty()
        {
            programmed
                .services
                .retain(|name, _| !skipped.contains(&name.service));
            programmed
                .endpoints
                .retain(|name, _| !skipped.contains(&name.service));
        }
    }

    /// Deletes the entries matching `filters` (a mode's own notion of stale, such as the
    /// userspace relay's moved ports) in one pass; failures are logged, as upstream does
    /// (the entries time out eventually). Returns how many were deleted.
    pub async fn delete_flows(&self, filters: &[FlowFilter]) -> usize {
        delete_flows(&self.conntrack, filters).await
    }
}

/// The families of one sync: each is programmed even when another fails, and the first
/// error is the sync's ([`FamilyErrors::into_result`]).
#[derive(Debug)]
#[must_use = "end it with FamilyErrors::into_result"]
pub struct FamilyErrors<E = BackendError> {
    mode: &'static str,
    first: Option<E>,
}

impl<E: std::error::Error + 'static> FamilyErrors<E> {
    /// For one sync of `mode` (named in the log).
    pub fn new(mode: &'static str) -> Self {
        Self { mode, first: None }
    }

    /// `family`'s result: its value, or `None` with the error logged and kept if it is the
    /// first.
    pub fn check<T>(&mut self, family: IpFamily, result: Result<T, E>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            // The other family is independent: the caller still programs it.
            Err(err) => {
                warn!(?family, mode = self.mode, error = %err.chain(), "sync failed; previous rules stay");
                self.first.get_or_insert(err);
                None
            }
        }
    }

    /// The first error, if a family failed.
    pub fn into_result(self) -> Result<(), E> {
        self.first.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use kp_core::model::Protocol;

    use super::*;
    use crate::conntrack::FakeConntrack;
    use crate::testutil::{block_on, endpoint, request, service, state};

    fn dns(ep: &str) -> ProxyState {
        state(vec![(
            service("kube-system", "dns", Protocol::Udp, "10.96.0.10", 53),
            vec![endpoint(ep, 53)],
        )])
    }

    fn fail(what: &str) -> Result<(), BackendError> {
        Err(kp_core::backend::ApplyError::Injected {
            what: what.to_owned(),
        }
        .into())
    }

    #[test]
    fn the_first_error_of_the_families_is_the_syncs() {
        let mut errors = FamilyErrors::new("test");
        assert_eq!(errors.check(IpFamily::V4, Ok(1)), Some(1));
        assert!(errors.check(IpFamily::V6, fail("first")).is_none());
        assert!(errors.check(IpFamily::V4, fail("second")).is_none());
        let err = errors.into_result().expect_err("a family failed");
        assert_eq!(err.apply().map(|e| e.what()), Some("first"), "{err}");
        assert!(
            FamilyErrors::<BackendError>::new("test")
                .into_result()
                .is_ok()
        );
    }

    #[test]
    fn stale_flows_follow_the_last_programmed_state_and_skip_skipped_services() {
        let conntrack = FakeConntrack::new();
        let mut sync = SyncState::new(vec![IpFamily::V4], conntrack.clone());
        let none = BTreeSet::new();
        let (first, second, third) = (dns("10.244.1.1"), dns("10.244.1.2"), dns("10.244.1.3"));
        block_on(sync.succeeded(
            &request(&first, SyncKind::Full, &none, true),
            SyncKind::Full,
            &none,
        ));
        assert!(conntrack.deleted().is_empty(), "nothing known before");
        // The service was skipped: its endpoint change is not what the kernel saw.
        let dns_name: BTreeSet<ServiceName> =
            first.services.keys().map(|n| n.service.clone()).collect();
        block_on(sync.succeeded(
            &request(&second, SyncKind::Full, &none, true),
            SyncKind::Full,
            &dns_name,
        ));
        let deleted = conntrack.deleted();
        assert_eq!(deleted.len(), 1, "{deleted:?}");
        assert_eq!(
            deleted[0].reply_src,
            Some("10.244.1.1".parse().expect("ip"))
        );
        conntrack.clear();
        // Programmed again: it counts as new (its IP's entries go), not as a moved endpoint.
        block_on(sync.succeeded(
            &request(&third, SyncKind::Partial, &dns_name, true),
            SyncKind::Partial,
            &none,
        ));
        let deleted = conntrack.deleted();
        assert_eq!(deleted.len(), 1, "{deleted:?}");
        assert_eq!(deleted[0].reply_src, None);
        assert_eq!(deleted[0].orig_dst, Some("10.96.0.10".parse().expect("ip")));
    }
}
