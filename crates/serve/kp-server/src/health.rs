//! The proxy health server: `/healthz` and `/livez` as upstream's `ProxyHealthServer`.
//!
//! Both answer 200 while no queued update has waited longer than the health timeout, else
//! 503. `/healthz` is what cloud load balancers probe, so it also fails when the node is not
//! eligible (being deleted or drained by the cluster autoscaler); `/livez` is for liveness
//! probes and ignores eligibility, so a draining node's proxy is not restarted.
//!
//! The JSON body mirrors upstream's: `lastUpdated`, `currentTime`, (`/healthz` only)
//! `nodeEligible`, `healthy` (proxy health only, without eligibility, as upstream) and a
//! `status` map keyed `IPv4`/`IPv6` with each configured family's `lastUpdated` and
//! `healthy`. Like upstream, a family appears in `status` only after its first successful
//! sync, and on success the top-level `lastUpdated` is "now" for backward compatibility
//! (older releases reported the last sync-loop run, which was always recent when healthy).
//! An unhealthy answer adds `reason` (this project's): how long changes have waited and the
//! last sync's error, so the probe's failure says what the kernel refused.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::any;
use kp_core::health::{HealthSnapshot, ProxyHealth};
use kp_core::model::IpFamily;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{ServerError, json_response, serve_router};

/// What Go's `time.Time{}` encodes to: upstream reports it as `lastUpdated` when unhealthy
/// before the first successful sync.
pub const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// Counters of `/healthz` and `/livez` responses by HTTP status code.
///
/// Cloning shares the counters, so a clone can be handed to the server after registering.
#[derive(Clone, Debug, Default)]
pub struct HealthMetrics {
    healthz: Family<CodeLabel, Counter>,
    livez: Family<CodeLabel, Counter>,
}

/// The `code` label of the health counters.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabel {
    code: u16,
}

impl HealthMetrics {
    /// Creates the counters and registers them as `kubeproxy_proxy_healthz_total{code}` and
    /// `kubeproxy_proxy_livez_total{code}` (the encoder appends `_total` to counters).
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            metrics.healthz.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            metrics.livez.clone(),
        );
        metrics
    }
}

#[derive(Clone)]
struct HealthState {
    health: Arc<ProxyHealth>,
    families: Arc<[IpFamily]>,
    metrics: HealthMetrics,
}

/// Serves `/healthz` and `/livez` on `listener` until `shutdown` is cancelled.
///
/// `families` are the IP families the proxy programs (one, or both in dual-stack); each gets
/// an entry in the body's `status` map. Any method is accepted, as upstream's handlers do;
/// other paths get 404.
pub async fn serve_health(
    listener: TcpListener,
    health: Arc<ProxyHealth>,
    families: Vec<IpFamily>,
    metrics: HealthMetrics,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    let state = HealthState {
        health,
        families: families.into(),
        metrics,
    };
    let router = Router::new()
        .route("/healthz", any(healthz))
        .route("/livez", any(livez))
        .with_state(state);
    serve_router("proxy health", listener, router, shutdown).await
}

async fn healthz(State(state): State<HealthState>) -> Response {
    let snapshot = state.health.snapshot();
    let ok = snapshot.healthy && snapshot.node_eligible;
    let body = body(
        &snapshot,
        SystemTime::now(),
        &state.families,
        ok,
        Some(snapshot.node_eligible),
    );
    respond(&state.metrics.healthz, ok, &body)
}

async fn livez(State(state): State<HealthState>) -> Response {
    let snapshot = state.health.snapshot();
    let ok = snapshot.healthy;
    let body = body(&snapshot, SystemTime::now(), &state.families, ok, None);
    respond(&state.metrics.livez, ok, &body)
}

fn respond(counter: &Family<CodeLabel, Counter>, ok: bool, body: &HealthBody) -> Response {
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    counter
        .get_or_create(&CodeLabel {
            code: status.as_u16(),
        })
        .inc();
    json_response(status, body)
}

/// The response body, field for field (and in the same order) as upstream's `ProxyHealth`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct HealthBody {
    last_updated: String,
    current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    /// This project's: why the proxy is unhealthy (absent while healthy).
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, FamilyBody>,
}

/// One family's entry in `status` (upstream `ProxierHealth`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct FamilyBody {
    last_updated: String,
    healthy: bool,
}

/// Builds the body; `ok` is the response's success (which makes `lastUpdated` "now").
fn body(
    snapshot: &HealthSnapshot,
    wall_now: SystemTime,
    families: &[IpFamily],
    ok: bool,
    node_eligible: Option<bool>,
) -> HealthBody {
    let current_time = rfc3339(wall_now);
    let synced = snapshot
        .last_updated
        .map(|at| rfc3339(wall_clock(at, snapshot.now, wall_now)));
    let status = match &synced {
        Some(last) => families
            .iter()
            .map(|family| {
                (
                    family_name(*family),
                    FamilyBody {
                        last_updated: last.clone(),
                        healthy: snapshot.healthy,
                    },
                )
            })
            .collect(),
        None => BTreeMap::new(),
    };
    let last_updated = if ok {
        current_time.clone()
    } else {
        synced.unwrap_or_else(|| GO_ZERO_TIME.to_owned())
    };
    HealthBody {
        last_updated,
        current_time,
        node_eligible,
        healthy: snapshot.healthy,
        reason: snapshot.reason(),
        status,
    }
}

/// The Kubernetes `IPFamily` value.
fn family_name(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    }
}

/// The wall-clock time of `at`, given that `now` (monotonic) is `wall_now`.
fn wall_clock(at: Instant, now: Instant, wall_now: SystemTime) -> SystemTime {
    let ago = now.saturating_duration_since(at);
    wall_now.checked_sub(ago).unwrap_or(SystemTime::UNIX_EPOCH)
}

/// RFC 3339 in UTC with only the fractional digits needed, as Go's `time.Time` JSON
/// (`RFC3339Nano`) encodes a UTC time.
pub(crate) fn rfc3339(at: SystemTime) -> String {
    match jiff::Timestamp::try_from(at) {
        Ok(ts) => ts.to_string(),
        Err(_) => GO_ZERO_TIME.to_owned(),
    }
}

/// `at` to the second, as a Kubernetes `metav1.Time` is written.
pub(crate) fn rfc3339_seconds(at: SystemTime) -> String {
    let whole = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(d.as_secs()))
        .unwrap_or(at);
    rfc3339(whole)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn timestamps_look_like_go_rfc3339nano_in_utc() {
        let at = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 120_000_000);
        assert_eq!(rfc3339(at), "2023-11-14T22:13:20.12Z");
        let whole = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(rfc3339(whole), "2023-11-14T22:13:20Z");
        let nanos = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 1);
        assert_eq!(rfc3339(nanos), "2023-11-14T22:13:20.000000001Z");
    }

    #[tokio::test(start_paused = true)]
    async fn body_reports_last_sync_when_unhealthy_and_now_when_healthy() {
        let health = ProxyHealth::with_timeout(Duration::from_secs(10));
        health.updated();
        tokio::time::advance(Duration::from_secs(3)).await;
        health.queued_update();
        tokio::time::advance(Duration::from_secs(10)).await;
        let snapshot = health.snapshot();
        assert!(!snapshot.healthy);

        let wall_now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_013);
        let families = [IpFamily::V4, IpFamily::V6];
        let sick = body(&snapshot, wall_now, &families, false, Some(true));
        assert_eq!(sick.current_time, "2023-11-14T22:13:33Z");
        // The sync happened 13 s before `now`.
        assert_eq!(sick.last_updated, "2023-11-14T22:13:20Z");
        assert!(!sick.healthy);
        let reason = sick.reason.as_deref().unwrap_or_default();
        assert!(reason.contains("waited 10s"), "{reason}");
        let v6 = &sick.status["IPv6"];
        assert_eq!(
            (v6.last_updated.as_str(), v6.healthy),
            ("2023-11-14T22:13:20Z", false)
        );

        health.updated();
        let snapshot = health.snapshot();
        let fine = body(&snapshot, wall_now, &families, true, None);
        assert_eq!(fine.last_updated, fine.current_time);
        assert!(fine.healthy);
        let json = serde_json::to_value(&fine).expect("serializable");
        assert!(json.get("reason").is_none(), "{json}");
    }

    #[tokio::test(start_paused = true)]
    async fn never_synced_reports_go_zero_time_and_no_status() {
        let health = ProxyHealth::with_timeout(Duration::ZERO);
        health.queued_update();
        let snapshot = health.snapshot();
        let b = body(&snapshot, SystemTime::now(), &[IpFamily::V4], false, None);
        assert_eq!(b.last_updated, GO_ZERO_TIME);
        assert!(b.status.is_empty());
        let json = serde_json::to_value(&b).expect("serializable");
        assert!(json.get("status").is_none());
        assert!(json.get("nodeEligible").is_none());
    }
}
