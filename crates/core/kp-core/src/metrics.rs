//! Prometheus metric families with upstream kube-proxy's names, so existing dashboards and
//! alerts keep working.
//!
//! prometheus-client writes OpenMetrics text and appends `_total` to counter names itself, so
//! counters are registered without that suffix. Gauges whose upstream names end in `_total`
//! (`..._no_local_endpoints_total`) are registered as they are. Histograms are registered
//! without a unit, because registering one would append it again.
//!
//! With the `NativeHistograms` gate the proxier's histograms also keep native buckets
//! ([`native`]), which only the protobuf exposition shows.
//!
//! Upstream's newest releases add an `ip_family` label; this proxier programs both families
//! in one sync, so the label is not used.

pub mod native;

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use native::{NativeBuckets, NativeHistograms};

/// Upstream's sync-duration buckets start at 1 ms...
pub const SYNC_DURATION_BUCKET_START_SECONDS: f64 = 0.001;
/// ...and double 15 times (up to about 16 s).
pub const SYNC_DURATION_BUCKET_COUNT: u16 = 15;

/// The `traffic_policy` label of `kubeproxy_sync_proxy_rules_no_local_endpoints_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicyLabel {
    /// `internal` or `external`, as upstream.
    pub traffic_policy: &'static str,
}

/// The `kind` label of `kube_proxy_rs_invalid_objects_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `Service`, `EndpointSlice` or `Node`.
    pub kind: &'static str,
}

/// The labels of `kube_proxy_rs_foreign_changes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ForeignLabels {
    /// The proxy mode.
    pub mode: &'static str,
    /// What was changed: `table`, `chain`, `rule`, `jump`, `element`, ...
    pub what: &'static str,
}

/// A classic histogram that also keeps native buckets when the gate asks for them; the text
/// exposition shows the classic ones only.
#[derive(Clone, Debug)]
pub struct DurationHistogram {
    classic: Histogram,
    native: Option<NativeBuckets>,
}

impl DurationHistogram {
    /// Count one observation.
    pub fn observe(&self, value: f64) {
        self.classic.observe(value);
        if let Some(native) = &self.native {
            native.observe(value);
        }
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        self.classic.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A gauge holding seconds since the Unix epoch.
pub type TimestampGauge = Gauge<f64, AtomicU64>;

/// The proxier's metrics. Clones share the same series.
#[derive(Clone, Debug)]
pub struct Metrics {
    /// `kubeproxy_sync_proxy_rules_duration_seconds`: every successful sync.
    pub sync_duration: DurationHistogram,
    /// `kubeproxy_sync_full_proxy_rules_duration_seconds`: successful full syncs.
    pub sync_full_duration: DurationHistogram,
    /// `kubeproxy_sync_partial_proxy_rules_duration_seconds`: successful partial syncs.
    pub sync_partial_duration: DurationHistogram,
    /// `kubeproxy_network_programming_duration_seconds`: from an EndpointSlice's
    /// last-change-trigger-time to the sync that programmed it.
    pub network_programming_duration: DurationHistogram,
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds`: the last successful sync.
    pub last_sync_timestamp: TimestampGauge,
    /// `kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds`: the last queued change.
    pub last_queued_timestamp: TimestampGauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_pending`.
    pub endpoint_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_endpoint_changes_total`.
    pub endpoint_changes: Counter,
    /// `kubeproxy_sync_proxy_rules_service_changes_pending`.
    pub service_changes_pending: Gauge,
    /// `kubeproxy_sync_proxy_rules_service_changes_total`.
    pub service_changes: Counter,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}`: service ports
    /// with a Local policy, endpoints elsewhere, and none on this node.
    pub no_local_endpoints: Family<TrafficPolicyLabel, Gauge>,
    /// `kube_proxy_rs_invalid_objects_total{kind}`: objects skipped as invalid.
    pub invalid_objects: Family<KindLabel, Counter>,
    /// `kube_proxy_rs_sync_failures_total`: failed syncs (each is retried as a full sync).
    pub sync_failures: Counter,
    /// `kube_proxy_rs_sync_stale`: 1 while an update has waited longer than the health
    /// timeout for a successful sync (`/healthz` answers 503 meanwhile).
    pub sync_stale: Gauge,
    /// `kube_proxy_rs_foreign_changes_total{mode,what}`: changes another program made to
    /// the proxy's rules, each restored by a full sync.
    pub foreign_changes: Family<ForeignLabels, Counter>,
    /// `kube_proxy_rs_watch_losses_total`: times the watch for other programs' changes
    /// (nf_tables notifications) stopped, the canary checks taking over.
    pub watch_losses: Counter,
}

impl Metrics {
    /// Create the metrics and register them in `registry` (classic histograms only).
    pub fn register(registry: &mut Registry) -> Self {
        Self::register_with(registry, None)
    }

    /// [`Self::register`]; with `native` (the `NativeHistograms` gate on), the histograms
    /// also keep native buckets, listed there under their exposed names.
    pub fn register_with(registry: &mut Registry, native: Option<&NativeHistograms>) -> Self {
        let histogram = |name: &str, classic: Histogram| DurationHistogram {
            classic,
            native: native.map(|n| n.add(name)),
        };
        let sync_buckets = |name: &str| {
            let buckets = exponential_buckets(
                SYNC_DURATION_BUCKET_START_SECONDS,
                2.0,
                SYNC_DURATION_BUCKET_COUNT,
            );
            histogram(name, Histogram::new(buckets))
        };
        let metrics = Self {
            sync_duration: sync_buckets("kubeproxy_sync_proxy_rules_duration_seconds"),
            sync_full_duration: sync_buckets("kubeproxy_sync_full_proxy_rules_duration_seconds"),
            sync_partial_duration: sync_buckets(
                "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            ),
            network_programming_duration: histogram(
                "kubeproxy_network_programming_duration_seconds",
                Histogram::new(network_programming_buckets()),
            ),
            last_sync_timestamp: TimestampGauge::default(),
            last_queued_timestamp: TimestampGauge::default(),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes: Counter::default(),
            no_local_endpoints: Family::default(),
            invalid_objects: Family::default(),
            sync_failures: Counter::default(),
            sync_stale: Gauge::default(),
            foreign_changes: Family::default(),
            watch_losses: Counter::default(),
        };
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            metrics.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            metrics.sync_full_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            metrics.sync_partial_duration.clone(),
        );
        registry.register(
            "kubeproxy_network_programming_duration_seconds",
            "Time from an endpoints change being triggered to it being programmed, in seconds",
            metrics.network_programming_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced (seconds since the epoch)",
            metrics.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued (seconds since the epoch)",
            metrics.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            metrics.endpoint_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            metrics.endpoint_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            metrics.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            metrics.service_changes.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints on this node",
            metrics.no_local_endpoints.clone(),
        );
        registry.register(
            "kube_proxy_rs_invalid_objects",
            "Objects skipped because they are invalid",
            metrics.invalid_objects.clone(),
        );
        registry.register(
            "kube_proxy_rs_sync_failures",
            "Failed syncs of proxy rules",
            metrics.sync_failures.clone(),
        );
        registry.register(
            "kube_proxy_rs_sync_stale",
            "1 while an update has waited longer than the health timeout for a successful sync",
            metrics.sync_stale.clone(),
        );
        registry.register(
            "kube_proxy_rs_foreign_changes",
            "Changes another program made to the proxy's rules (each restored)",
            metrics.foreign_changes.clone(),
        );
        registry.register(
            "kube_proxy_rs_watch_losses",
            "Times the watch for other programs' changes stopped (the canary checks take over)",
            metrics.watch_losses.clone(),
        );
        metrics
    }
}

/// Upstream's network-programming buckets: 0.25 s and 0.5 s, every second to 59 s, every
/// 5 s to 115 s, every 30 s to 300 s.
fn network_programming_buckets() -> impl Iterator<Item = f64> {
    let quarter = [0.25, 0.5].into_iter();
    let seconds = (1..=59).map(f64::from);
    let five = (60..=115).step_by(5).map(f64::from);
    let thirty = (120..=300).step_by(30).map(f64::from);
    quarter.chain(seconds).chain(five).chain(thirty)
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    fn encoded(registry: &Registry) -> String {
        let mut text = String::new();
        encode(&mut text, registry).expect("encoding into a String cannot fail");
        text
    }

    /// Sample names (the part before labels or the value) in the exposition.
    fn sample_names(text: &str) -> Vec<&str> {
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| line.split([' ', '{']).next())
            .collect()
    }

    #[test]
    fn upstream_names_are_exposed() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.endpoint_changes.inc();
        metrics.service_changes.inc();
        metrics.sync_failures.inc();
        metrics
            .invalid_objects
            .get_or_create(&KindLabel { kind: "Service" })
            .inc();
        for policy in ["internal", "external"] {
            metrics
                .no_local_endpoints
                .get_or_create(&TrafficPolicyLabel {
                    traffic_policy: policy,
                })
                .set(1);
        }
        metrics.last_sync_timestamp.set(1_700_000_000.5);
        metrics.sync_duration.observe(0.003);
        let text = encoded(&registry);
        let names = sample_names(&text);

        for want in [
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
            "kubeproxy_sync_proxy_rules_duration_seconds_sum",
            "kubeproxy_sync_proxy_rules_duration_seconds_count",
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
            "kubeproxy_network_programming_duration_seconds_count",
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total",
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "kubeproxy_sync_proxy_rules_service_changes_total",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "kube_proxy_rs_invalid_objects_total",
            "kube_proxy_rs_sync_failures_total",
        ] {
            assert!(names.contains(&want), "{want} missing from:\n{text}");
        }
        assert!(!text.contains("_total_total"), "{text}");
        assert!(!text.contains("_seconds_seconds"), "{text}");
        assert!(text.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds 1700000000.5\n"));
        assert!(text.contains(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\"} 1\n"
        ));
        assert!(text.contains("kube_proxy_rs_invalid_objects_total{kind=\"Service\"} 1\n"));
        assert!(text.contains("kubeproxy_sync_proxy_rules_endpoint_changes_total 1\n"));
    }

    #[test]
    fn bucket_boundaries_match_upstream() {
        let mut registry = Registry::default();
        Metrics::register(&mut registry);
        let text = encoded(&registry);
        let les = |metric: &str| -> Vec<String> {
            let prefix = format!("{metric}_bucket{{le=\"");
            text.lines()
                .filter_map(|line| line.strip_prefix(prefix.as_str()))
                .filter_map(|rest| rest.split('"').next())
                .map(str::to_owned)
                .collect()
        };
        let sync = les("kubeproxy_sync_proxy_rules_duration_seconds");
        // 15 finite buckets plus +Inf: 0.001 ... 16.384.
        assert_eq!(sync.len(), 16, "{sync:?}");
        assert_eq!(sync.first().map(String::as_str), Some("0.001"));
        assert_eq!(sync[14], "16.384");
        assert_eq!(sync[15], "+Inf");

        let programming: Vec<f64> = les("kubeproxy_network_programming_duration_seconds")
            .iter()
            .filter_map(|le| le.parse().ok())
            .collect();
        assert_eq!(programming.len(), 2 + 59 + 12 + 7 + 1);
        assert_eq!(&programming[..4], &[0.25, 0.5, 1.0, 2.0]);
        assert!(programming.contains(&59.0) && programming.contains(&115.0));
        assert!(!programming.contains(&116.0) && programming.contains(&300.0));
        assert_eq!(programming.last(), Some(&f64::INFINITY));
    }
}
