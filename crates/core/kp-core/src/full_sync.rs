//! Which runs are full syncs besides the ones the proxier must run full (the first, after a
//! failure, after this node's labels changed, after another program changed the rules):
//! upstream's periodic full syncs, which differ by mode.
//!
//! - iptables: a full sync once the last one is [`FULL_SYNC_PERIOD`] old, except in a large
//!   cluster (more than [`LARGE_CLUSTER_ENDPOINTS`] endpoints in one IP family), where
//!   rewriting every rule costs seconds and disturbs traffic (#138571: upstream 1.37, and the
//!   1.34.9, 1.35.6 and 1.36.3 patch releases; 1.33 and earlier do it in every cluster).
//! - nftables: one every [`FULL_SYNC_PERIOD`] whatever the size (#138571 left it alone).
//! - ipvs: every periodic run, one every `syncPeriod`: upstream's ipvs proxier reconciles
//!   everything on each sync, and its runner forces one every `syncPeriod`, which the 1.34
//!   runner rewrite (#131615) made hourly and #135631 restored (1.35, and 1.34.9).
//! - other modes: none.
//!
//! Between full syncs the proxier's periodic runs are partial, preceded by a check of the
//! rules in the kernel (the canaries), so drift is found and repaired without them.

use std::net::IpAddr;
use std::time::Duration;

use tokio::time::Instant;

use crate::runner::RunReason;
use crate::tracker::ProxyState;

/// Upstream's `FullSyncPeriod` (`pkg/proxy/util`): the longest iptables and nftables modes go
/// without rewriting everything.
pub const FULL_SYNC_PERIOD: Duration = Duration::from_secs(3600);

/// Upstream's `largeClusterEndpointsThreshold`: above this many endpoints (in one IP family)
/// iptables mode is in its large-cluster mode.
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// A mode's periodic full syncs; see the [module documentation](self).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeriodicFullSync {
    /// None: only the syncs the proxier must run full.
    Never,
    /// One when the last full sync is [`FULL_SYNC_PERIOD`] old; with `spare_large_clusters`,
    /// none while the cluster has more than [`LARGE_CLUSTER_ENDPOINTS`] endpoints.
    Hourly {
        /// iptables mode's large-cluster exception.
        spare_large_clusters: bool,
    },
    /// Every periodic run (every `syncPeriod`).
    EveryPeriodicRun,
}

impl PeriodicFullSync {
    /// Upstream's schedule for the backend mode named `mode` (`Backend::mode`).
    pub fn for_mode(mode: &str) -> Self {
        match mode {
            "iptables" => Self::Hourly {
                spare_large_clusters: true,
            },
            "nftables" => Self::Hourly {
                spare_large_clusters: false,
            },
            "ipvs" => Self::EveryPeriodicRun,
            _ => Self::Never,
        }
    }

    /// Why the run starting `now` for `reason` is a periodic full sync, if it is one;
    /// `last_full` is when the last full sync ended (`None` before the first).
    pub fn due(
        self,
        reason: RunReason,
        last_full: Option<Instant>,
        now: Instant,
        state: &ProxyState,
    ) -> Option<&'static str> {
        match self {
            Self::Never => None,
            Self::EveryPeriodicRun => {
                (reason == RunReason::Periodic).then_some("the periodic resync of every rule")
            }
            Self::Hourly {
                spare_large_clusters,
            } => {
                let last = last_full?;
                if now.saturating_duration_since(last) < FULL_SYNC_PERIOD {
                    return None;
                }
                if spare_large_clusters && largest_family_endpoints(state) > LARGE_CLUSTER_ENDPOINTS
                {
                    return None;
                }
                Some("the hourly full sync")
            }
        }
    }
}

/// The endpoints of the state's service ports in its larger IP family, as upstream's
/// per-family proxiers count them to decide whether the cluster is large.
pub fn largest_family_endpoints(state: &ProxyState) -> usize {
    let (mut v4, mut v6) = (0, 0);
    for (name, endpoints) in &state.endpoints {
        if !state.services.contains_key(name) {
            continue;
        }
        for endpoint in endpoints {
            match endpoint.ip {
                IpAddr::V4(_) => v4 += 1,
                IpAddr::V6(_) => v6 += 1,
            }
        }
    }
    usize::max(v4, v6)
}

#[cfg(test)]
mod tests;
