//! Proxy health as upstream's `ProxyHealthServer` reports it, and per-service health for
//! `externalTrafficPolicy: Local` health-check node ports.
//!
//! The proxy is unhealthy when an update has been queued and no successful sync followed
//! within the health timeout (2 × syncPeriod upstream). Start-up counts as healthy. `/healthz`
//! additionally fails when the node is not eligible (missing, being deleted, or tainted for
//! deletion by the cluster autoscaler); `/livez` ignores eligibility.

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
}

/// A point-in-time view of [`ProxyHealth`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

    #[tokio::test(start_paused = true)]
    async fn eligibility_is_reported() {
        let health = ProxyHealth::new(Duration::from_secs(30));
        health.set_node_eligible(false);
        let s = health.snapshot();
        assert!(s.healthy);
        assert!(!s.node_eligible);
    }
}
