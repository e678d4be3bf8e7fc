//! Proxy health as upstream's `ProxyHealthServer` reports it, and per-service health for
//! `externalTrafficPolicy: Local` health-check node ports.
//!
//! The proxy is unhealthy when an update has been queued and no successful sync followed
//! within the health timeout (2 × syncPeriod upstream). Start-up counts as healthy. `/healthz`
//! additionally fails when the node is not eligible (missing, being deleted, or tainted for
//! deletion by the cluster autoscaler); `/livez` ignores eligibility.
//!
//! Unlike upstream (kubernetes#142068), a proxy whose syncs have never succeeded is judged
//! like any other: upstream only looks at families that synced once, so a node whose every
//! restore fails from the start (no Service rules at all) reports healthy forever. Here the
//! timeout runs from the first queued update whether or not a sync ever succeeded, and the
//! last sync's error is kept for the reason an unhealthy answer gives.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::model::ServiceName;

/// Upstream's health timeout is twice the sync period.
pub const HEALTH_TIMEOUT_SYNC_PERIODS: u32 = 2;

/// Shared proxy health, updated by the proxier and read by the health server.
#[derive(Debug)]
pub struct ProxyHealth {
    timeout: Duration,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The oldest update queued since the last successful sync.
    oldest_pending: Option<Instant>,
    /// The last successful sync, if any.
    last_updated: Option<Instant>,
    /// Node eligibility; `None` until the Node has been looked at.
    node_eligible: Option<bool>,
    /// The error of the last sync, if it failed, and how many failed in a row.
    last_error: Option<(String, u64)>,
}

/// A point-in-time view of [`ProxyHealth`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthSnapshot {
    /// No update has waited longer than the timeout.
    pub healthy: bool,
    /// The last successful sync.
    pub last_updated: Option<Instant>,
    /// The oldest update still waiting for a sync.
    pub oldest_pending: Option<Instant>,
    /// The node is eligible to receive traffic (for `/healthz`). Unknown counts as eligible
    /// until the node source has synced, so a clusterless proxy stays healthy.
    pub node_eligible: bool,
    /// When this snapshot was taken.
    pub now: Instant,
    /// The last sync's error and how many syncs failed in a row, while the last one failed.
    pub last_error: Option<(String, u64)>,
}

impl HealthSnapshot {
    /// Why the proxy is unhealthy, for people: `None` while it is healthy.
    pub fn reason(&self) -> Option<String> {
        if self.healthy {
            return None;
        }
        let waited = self
            .oldest_pending
            .map(|at| self.now.duration_since(at).as_secs())
            .unwrap_or_default();
        let synced = if self.last_updated.is_some() {
            "since the last successful sync"
        } else {
            "and no sync has succeeded since the start"
        };
        Some(match &self.last_error {
            Some((error, failures)) => format!(
                "changes have waited {waited}s to be programmed {synced}; the last {failures} \
                 sync(s) failed: {error}"
            ),
            None => format!("changes have waited {waited}s to be programmed {synced}"),
        })
    }
}

impl ProxyHealth {
    /// Health with upstream's timeout: [`HEALTH_TIMEOUT_SYNC_PERIODS`] × `sync_period`.
    pub fn new(sync_period: Duration) -> Self {
        Self::with_timeout(sync_period * HEALTH_TIMEOUT_SYNC_PERIODS)
    }

    /// Health with an explicit timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            inner: Mutex::new(Inner {
                oldest_pending: None,
                last_updated: None,
                node_eligible: None,
                last_error: None,
            }),
        }
    }

    /// The health timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A change arrived that needs a sync (upstream `QueuedUpdate`).
    pub fn queued_update(&self) {
        let mut inner = self.lock();
        if inner.oldest_pending.is_none() {
            inner.oldest_pending = Some(Instant::now());
        }
    }

    /// A sync succeeded (upstream `Updated`).
    pub fn updated(&self) {
        let mut inner = self.lock();
        inner.oldest_pending = None;
        inner.last_updated = Some(Instant::now());
        inner.last_error = None;
    }

    /// A sync failed with `error`: the pending updates stay pending.
    pub fn sync_failed(&self, error: &str) {
        let mut inner = self.lock();
        let failures = inner.last_error.as_ref().map_or(0, |(_, n)| *n) + 1;
        inner.last_error = Some((error.to_owned(), failures));
    }

    /// When the oldest pending update turns the proxy unhealthy, if one is pending.
    pub fn stale_at(&self) -> Option<Instant> {
        self.lock().oldest_pending.map(|at| at + self.timeout)
    }

    /// Record whether this node may receive traffic.
    pub fn set_node_eligible(&self, eligible: bool) {
        self.lock().node_eligible = Some(eligible);
    }

    /// The current state.
    pub fn snapshot(&self) -> HealthSnapshot {
        let now = Instant::now();
        let inner = self.lock();
        let healthy = match inner.oldest_pending {
            None => true,
            Some(queued) => now.duration_since(queued) < self.timeout,
        };
        HealthSnapshot {
            healthy,
            last_updated: inner.last_updated,
            oldest_pending: inner.oldest_pending,
            node_eligible: inner.node_eligible.unwrap_or(true),
            now,
            last_error: inner.last_error.clone(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The health-check node port of one eTP Local service and its local ready endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceHealth {
    /// `spec.healthCheckNodePort`.
    pub node_port: u16,
    /// Distinct local ready endpoint IPs across the service's ports.
    pub local_endpoints: usize,
}

/// Every service that needs a health-check node port, as published after each sync.
pub type ServiceHealthMap = BTreeMap<ServiceName, ServiceHealth>;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn startup_is_healthy_and_eligible() {
        let health = ProxyHealth::new(Duration::from_secs(30));
        let s = health.snapshot();
        assert!(s.healthy);
        assert!(s.node_eligible);
        assert_eq!(s.last_updated, None);
    }

    #[tokio::test(start_paused = true)]
    async fn pending_update_turns_unhealthy_after_timeout() {
        let health = ProxyHealth::new(Duration::from_secs(30));
        health.queued_update();
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(health.snapshot().healthy);
        // A later queued update does not move the oldest pending one.
        health.queued_update();
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!health.snapshot().healthy);
        health.updated();
        let s = health.snapshot();
        assert!(s.healthy);
        assert_eq!(s.last_updated, Some(s.now));
    }

    /// kubernetes#142068: every sync fails from the start; upstream stays healthy.
    #[tokio::test(start_paused = true)]
    async fn syncs_that_never_succeed_turn_unhealthy_with_their_error() {
        let health = ProxyHealth::new(Duration::from_secs(30));
        health.queued_update();
        assert_eq!(
            health.stale_at(),
            Some(Instant::now() + Duration::from_secs(60))
        );
        health.sync_failed("iptables-restore: line 7 failed");
        tokio::time::advance(Duration::from_secs(30)).await;
        health.sync_failed("iptables-restore: line 7 failed");
        let s = health.snapshot();
        assert!(s.healthy && s.reason().is_none());
        tokio::time::advance(Duration::from_secs(30)).await;
        let s = health.snapshot();
        assert!(!s.healthy);
        let reason = s.reason().unwrap_or_default();
        assert!(reason.contains("waited 60s"), "{reason}");
        assert!(reason.contains("no sync has succeeded"), "{reason}");
        assert!(
            reason.contains("the last 2 sync(s) failed: iptables-restore: line 7 failed"),
            "{reason}"
        );
        health.updated();
        let s = health.snapshot();
        assert!(s.healthy && s.last_error.is_none() && health.stale_at().is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn eligibility_is_reported() {
        let health = ProxyHealth::new(Duration::from_secs(30));
        health.set_node_eligible(false);
        let s = health.snapshot();
        assert!(s.healthy);
        assert!(!s.node_eligible);
    }
}
