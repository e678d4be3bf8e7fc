//! Proxier tests with the fake backend on paused tokio time. `run_for` lets virtual time pass
//! while the proxier task runs, so timing is exact and nothing really sleeps.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::backend::{FakeBackend, RecordedSync, SyncKind};
use crate::event::{ObjectEvent, SourceEvent};
use crate::fixtures::{self, EndpointSpec, NODE, applied, deleted, endpoint, name, names, node};
use crate::health::{ProxyHealth, ServiceHealth, ServiceHealthMap};
use crate::metrics::{KindLabel, Metrics, TrafficPolicyLabel};
use crate::tracker::{LAST_CHANGE_TRIGGER_TIME_ANNOTATION, ProxyState};

mod foreign;
mod late;
mod sync;

const SYNC_PERIOD: Duration = Duration::from_secs(30);
/// The injected wall clock starts here (2023-11-14T22:13:20Z).
const EPOCH_OFFSET: Duration = Duration::from_secs(1_700_000_000);

/// A ClusterIP service with one TCP port 80.
fn service(service: &str, ip: &str) -> Service {
    let spec = json!({"clusterIP": ip, "ports": [{"port": 80}]});
    fixtures::service("ns", service, spec)
}

/// `(ip, node, ready)` slice endpoints.
fn endpoints(list: &[(&str, Option<&str>, bool)]) -> Vec<EndpointSpec> {
    list.iter()
        .map(|(ip, node, ready)| endpoint(ip).ready(*ready).node(*node))
        .collect()
}

/// An IPv4 slice for port 80 with `(ip, node, ready)` endpoints.
fn slice(slice: &str, service: &str, list: &[(&str, Option<&str>, bool)]) -> EndpointSlice {
    let ports = json!([{"port": 8080}]);
    fixtures::slice("ns", slice, service, "IPv4", ports, &endpoints(list))
}

const SERVICES_SYNCED: SourceEvent = SourceEvent::Service(ObjectEvent::Synced);
const SLICES_SYNCED: SourceEvent = SourceEvent::EndpointSlice(ObjectEvent::Synced);

/// Let `d` of virtual time pass while the proxier works.
async fn run_for(d: Duration) {
    sleep(d).await;
}

/// Let the proxier handle what is queued, without timers firing.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

struct Harness {
    events: mpsc::Sender<SourceEvent>,
    foreign: mpsc::Sender<crate::foreign::ForeignEvent>,
    shutdown: CancellationToken,
    backend: FakeBackend,
    health: Arc<ProxyHealth>,
    metrics: Metrics,
    registry: Registry,
    service_health: watch::Receiver<ServiceHealthMap>,
    state: watch::Receiver<Arc<ProxyState>>,
    activity: Activity,
    task: JoinHandle<Result<(), ProxierError>>,
}

impl Harness {
    fn start() -> Self {
        Self::start_with(|config| config)
    }

    fn start_with(configure: impl FnOnce(ProxierConfig) -> ProxierConfig) -> Self {
        let start = Instant::now();
        // A wall clock that moves with paused tokio time.
        let clock: WallClock =
            Arc::new(move || SystemTime::UNIX_EPOCH + EPOCH_OFFSET + (Instant::now() - start));
        let config = configure(
            ProxierConfig::new(NODE)
                .with_sync_period(SYNC_PERIOD)
                .with_clock(clock),
        );
        let backend = FakeBackend::new();
        let health = Arc::new(ProxyHealth::new(SYNC_PERIOD));
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let proxier = Proxier::new(config, backend.clone(), health.clone(), metrics.clone())
            .expect("valid config");
        assert_eq!(proxier.mode(), "fake");
        let service_health = proxier.service_health();
        let state = proxier.state();
        let foreign = proxier.foreign_events();
        let activity = proxier.activity();
        let (events, receiver) = mpsc::channel(1024);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(proxier.run(receiver, shutdown.clone()));
        Self {
            events,
            foreign,
            shutdown,
            backend,
            health,
            metrics,
            registry,
            service_health,
            state,
            activity,
            task,
        }
    }

    async fn send(&self, event: SourceEvent) {
        self.events.send(event).await.expect("proxier running");
    }

    /// Send `objects` then both Synced markers, and let the first sync happen.
    async fn initialize(&self, objects: Vec<SourceEvent>) {
        for event in objects {
            self.send(event).await;
        }
        self.send(SERVICES_SYNCED).await;
        self.send(SLICES_SYNCED).await;
        settle().await;
    }

    /// The value of one unlabelled sample in the encoded registry.
    fn sample(&self, sample: &str) -> f64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("encode");
        let prefix = format!("{sample} ");
        text.lines()
            .find_map(|line| line.strip_prefix(prefix.as_str()))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("{sample} not in:\n{text}"))
    }

    fn syncs(&self) -> Vec<RecordedSync> {
        self.backend.syncs()
    }

    fn last_sync(&self) -> RecordedSync {
        self.syncs().pop().expect("a sync happened")
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let result = self.task.await.expect("proxier task did not panic");
        assert!(result.is_ok(), "{result:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn nothing_is_synced_before_services_and_slices_are_synced() {
    let h = Harness::start();
    h.send(applied(service("web", "172.30.0.41"))).await;
    h.send(applied(slice(
        "web-a",
        "web",
        &[("10.180.0.1", None, true)],
    )))
    .await;
    h.send(SERVICES_SYNCED).await;
    run_for(Duration::from_secs(600)).await;
    assert!(h.syncs().is_empty());
    // Nothing was queued, so the proxy stays healthy while it waits.
    assert!(h.health.snapshot().healthy);
    assert_eq!(h.health.snapshot().last_updated, None);

    h.send(SLICES_SYNCED).await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 1);
    assert_eq!(syncs[0].kind, SyncKind::Full);
    assert_eq!(syncs[0].changed, names(&["web"]));
    assert_eq!((syncs[0].service_ports, syncs[0].endpoints), (1, 1));
    assert!(h.health.snapshot().last_updated.is_some());
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn later_change_is_partial_with_exactly_the_changed_service() {
    let h = Harness::start();
    h.initialize(vec![
        applied(service("web", "172.30.0.41")),
        applied(service("db", "172.30.0.42")),
        applied(slice("web-a", "web", &[("10.180.0.1", None, true)])),
        applied(slice("db-a", "db", &[("10.180.0.2", None, true)])),
    ])
    .await;
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.last_sync().changed, names(&["db", "web"]));

    run_for(Duration::from_secs(5)).await;
    h.send(applied(slice("db-a", "db", &[("10.180.0.3", None, true)])))
        .await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Partial);
    assert_eq!(syncs[1].changed, names(&["db"]));
    assert!(!syncs[1].conntrack_cleanup_required);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_batch_is_recorded_whole_before_its_sync() {
    let h = Harness::start();
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    assert_eq!(h.syncs().len(), 1);

    // A Service and its EndpointSlice as one manifests file delivers them: the sync that
    // programs the Service already has its endpoint.
    run_for(Duration::from_secs(5)).await;
    h.send(SourceEvent::Batch(vec![
        applied(service("late", "172.30.0.42")),
        applied(slice("late-a", "late", &[("10.180.0.9", None, true)])),
    ]))
    .await;
    settle().await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2, "one sync for the batch");
    assert_eq!(syncs[1].changed, names(&["late"]));
    assert_eq!((syncs[1].service_ports, syncs[1].endpoints), (2, 1));
    // Each event of the batch is counted as a change of its kind.
    assert_eq!(
        h.sample("kubeproxy_sync_proxy_rules_endpoint_changes_total"),
        1.0
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_second_change_right_after_a_fast_sync_is_not_held_back() {
    let h = Harness::start();
    h.backend.take(Duration::from_millis(5));
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    h.send(applied(slice(
        "web-a",
        "web",
        &[("10.180.0.1", None, true)],
    )))
    .await;
    run_for(Duration::from_millis(100)).await;
    assert_eq!(h.syncs().len(), 2);
    // 300 ms later, a second change: the 5 ms sync earned 45 ms of rest, long over.
    run_for(Duration::from_millis(300)).await;
    let sent = Instant::now();
    h.send(applied(slice(
        "web-a",
        "web",
        &[("10.180.0.2", None, true)],
    )))
    .await;
    while h.syncs().len() < 3 {
        run_for(Duration::from_millis(1)).await;
    }
    assert!(Instant::now() - sent <= Duration::from_millis(1));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn burst_within_min_sync_period_after_a_slow_sync_is_one_sync() {
    let h = Harness::start();
    // A sync of a large cluster: it earns the whole min sync period of rest.
    h.backend.take(Duration::from_millis(150));
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    assert_eq!(h.syncs().len(), 1);

    // Ten changes spread over 900 ms right after a sync.
    for i in 0..10 {
        let ip = format!("10.180.0.{}", i + 1);
        h.send(applied(slice("web-a", "web", &[(&ip, None, true)])))
            .await;
        run_for(Duration::from_millis(90)).await;
    }
    assert_eq!(h.syncs().len(), 1, "min sync period not over yet");
    // The slow first sync ended 150 ms after it started; the rest runs to 1150 ms.
    run_for(Duration::from_millis(400)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].changed, names(&["web"]));
    let ips: Vec<String> = syncs[1]
        .state
        .endpoints
        .values()
        .flatten()
        .map(|e| e.ip.to_string())
        .collect();
    assert_eq!(ips, vec!["10.180.0.10"]);

    // Events queued together after a quiet period are one sync too.
    run_for(Duration::from_secs(5)).await;
    for service_name in ["a", "b", "c"] {
        h.send(applied(service(service_name, "172.30.0.50"))).await;
    }
    settle().await;
    assert_eq!(h.syncs().len(), 3);
    assert_eq!(h.last_sync().changed, names(&["a", "b", "c"]));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn failed_sync_is_retried_after_the_retry_interval_as_full() {
    let h = Harness::start();
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    run_for(Duration::from_secs(5)).await;

    h.backend.fail_next(1);
    h.send(applied(service("db", "172.30.0.42"))).await;
    settle().await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Partial);
    assert_eq!(h.metrics.sync_failures.get(), 1);

    // The retry comes one sync period (the default retry interval) later, as a full sync
    // still carrying the change.
    run_for(SYNC_PERIOD - Duration::from_millis(1)).await;
    assert_eq!(h.syncs().len(), 2);
    run_for(Duration::from_millis(2)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 3);
    assert_eq!(syncs[2].kind, SyncKind::Full);
    assert_eq!(syncs[2].changed, names(&["db"]));

    // After the successful retry, syncs are partial again.
    run_for(Duration::from_secs(5)).await;
    h.send(applied(service("db", "172.30.0.43"))).await;
    settle().await;
    assert_eq!(h.last_sync().kind, SyncKind::Partial);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_change_after_a_failure_syncs_fully_and_cancels_the_retry() {
    let h = Harness::start_with(|c| c.with_retry_interval(Duration::from_secs(10)));
    h.backend.fail_next(1);
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    assert_eq!(h.syncs().len(), 1);
    h.send(applied(service("db", "172.30.0.42"))).await;
    run_for(Duration::from_secs(2)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Full);
    assert_eq!(syncs[1].changed, names(&["db", "web"]));
    // No retry at 10 s: the next run is the periodic one.
    run_for(Duration::from_secs(20)).await;
    assert_eq!(h.syncs().len(), 2);
    run_for(Duration::from_secs(15)).await;
    assert_eq!(h.syncs().len(), 3);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn periodic_sync_is_partial_with_nothing_changed() {
    let h = Harness::start();
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    run_for(SYNC_PERIOD + Duration::from_millis(1)).await;
    let syncs = h.syncs();
    assert_eq!(syncs.len(), 2);
    assert_eq!(syncs[1].kind, SyncKind::Partial);
    assert!(syncs[1].changed.is_empty());
    assert_eq!(syncs[1].state, syncs[0].state);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn health_turns_unhealthy_while_syncs_fail_and_recovers() {
    let h = Harness::start();
    h.backend.fail_next(usize::MAX);
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    assert!(h.health.snapshot().healthy);
    // The health timeout is twice the sync period.
    run_for(2 * SYNC_PERIOD - Duration::from_millis(1)).await;
    assert!(h.health.snapshot().healthy);
    run_for(Duration::from_millis(2)).await;
    assert!(!h.health.snapshot().healthy);
    assert_eq!(h.health.snapshot().last_updated, None);

    h.backend.fail_next(0);
    run_for(SYNC_PERIOD).await;
    let snapshot = h.health.snapshot();
    assert!(snapshot.healthy);
    assert!(snapshot.last_updated.is_some());
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.metrics.sync_failures.get(), 3);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn node_eligibility_and_label_changes() {
    let h = Harness::start();
    let zone = |z: &str| json!({"topology.kubernetes.io/zone": z});
    h.initialize(vec![applied(node(NODE, zone("a"), json!({})))])
        .await;
    assert!(h.health.snapshot().node_eligible);
    assert_eq!(h.last_sync().state.node.zone(), Some("a"));
    run_for(Duration::from_secs(5)).await;

    // A change to another service plus a label change: full sync.
    h.send(applied(node(NODE, zone("b"), json!({})))).await;
    settle().await;
    assert_eq!(h.syncs().len(), 2);
    assert_eq!(h.last_sync().kind, SyncKind::Full);
    assert_eq!(h.last_sync().state.node.zone(), Some("b"));

    // Eligibility only: no sync, but /healthz sees it.
    let taint =
        json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]});
    h.send(applied(node(NODE, zone("b"), taint))).await;
    settle().await;
    assert!(!h.health.snapshot().node_eligible);
    assert_eq!(h.syncs().len(), 2);

    // Another node's object changes nothing.
    let mut other = node(NODE, zone("c"), json!({}));
    other.metadata.name = Some("other-node".to_owned());
    h.send(applied(other)).await;
    h.send(applied(node(NODE, zone("b"), json!({})))).await;
    settle().await;
    assert!(h.health.snapshot().node_eligible);

    h.send(deleted(node(NODE, zone("b"), json!({})))).await;
    settle().await;
    assert!(!h.health.snapshot().node_eligible);
    h.stop().await;
}

/// A LoadBalancer service with eTP Local and health-check node port 30000, ports 80 and 81.
fn etp_local_lb() -> Service {
    fixtures::service(
        "ns",
        "lb",
        json!({
            "type": "LoadBalancer",
            "clusterIP": "172.30.0.60",
            "externalTrafficPolicy": "Local",
            "healthCheckNodePort": 30000,
            "ports": [
                {"name": "a", "port": 80, "nodePort": 3001},
                {"name": "b", "port": 81, "nodePort": 3002},
            ],
        }),
    )
}

/// Its slice: both ports, `(ip, node, ready)` endpoints.
fn etp_local_lb_slice(list: &[(&str, Option<&str>, bool)]) -> EndpointSlice {
    let ports = json!([
        {"name": "a", "port": 8080},
        {"name": "b", "port": 8081},
    ]);
    fixtures::slice("ns", "lb-a", "lb", "IPv4", ports, &endpoints(list))
}

#[tokio::test(start_paused = true)]
async fn service_health_map_is_published_after_syncs() {
    let mut h = Harness::start();
    assert!(h.service_health.borrow().is_empty());
    h.initialize(vec![
        applied(etp_local_lb()),
        applied(service("web", "172.30.0.41")),
        applied(etp_local_lb_slice(&[
            ("10.180.0.1", Some(NODE), true),
            ("10.180.0.2", Some(NODE), false),
            ("10.180.0.3", Some("other"), true),
        ])),
    ])
    .await;
    assert!(h.service_health.has_changed().expect("sender alive"));
    let want: ServiceHealthMap = [(
        name("lb"),
        ServiceHealth {
            node_port: 30000,
            local_endpoints: 1,
        },
    )]
    .into_iter()
    .collect();
    assert_eq!(*h.service_health.borrow_and_update(), want);

    run_for(Duration::from_secs(5)).await;
    h.send(applied(etp_local_lb_slice(&[
        ("10.180.0.1", Some(NODE), false),
        ("10.180.0.3", Some("other"), true),
    ])))
    .await;
    settle().await;
    assert!(h.service_health.has_changed().expect("sender alive"));
    assert_eq!(
        h.service_health.borrow_and_update()[&name("lb")].local_endpoints,
        0
    );

    // A sync that changes no health-check service does not wake readers.
    run_for(Duration::from_secs(5)).await;
    h.send(applied(service("web", "172.30.0.42"))).await;
    settle().await;
    assert!(!h.service_health.has_changed().expect("sender alive"));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn state_is_published_after_successful_syncs_only() {
    let mut h = Harness::start();
    h.backend.fail_next(1);
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    assert!(!h.state.has_changed().expect("sender alive"));
    assert!(h.state.borrow().services.is_empty());
    run_for(SYNC_PERIOD + Duration::from_millis(1)).await;
    assert!(h.state.has_changed().expect("sender alive"));
    assert_eq!(h.state.borrow_and_update().services.len(), 1);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn no_local_endpoints_gauge() {
    let h = Harness::start();
    let itp_local = fixtures::service(
        "ns",
        "itp",
        json!({"clusterIP": "172.30.0.70", "internalTrafficPolicy": "Local", "ports": [{"port": 80}]}),
    );
    let etp_local = fixtures::service(
        "ns",
        "etp",
        json!({"type": "NodePort", "clusterIP": "172.30.0.71", "externalTrafficPolicy": "Local",
               "ports": [{"port": 80, "nodePort": 3001}]}),
    );
    let empty = fixtures::service(
        "ns",
        "empty",
        json!({"clusterIP": "172.30.0.72", "internalTrafficPolicy": "Local", "ports": [{"port": 80}]}),
    );
    h.initialize(vec![
        applied(itp_local),
        applied(etp_local),
        applied(empty),
        applied(slice(
            "itp-a",
            "itp",
            &[("10.180.0.1", Some("other"), true)],
        )),
        applied(slice("etp-a", "etp", &[("10.180.0.2", None, true)])),
    ])
    .await;
    let gauge = |policy: &'static str| {
        h.metrics
            .no_local_endpoints
            .get_or_create(&TrafficPolicyLabel {
                traffic_policy: policy,
            })
            .get()
    };
    assert_eq!((gauge("internal"), gauge("external")), (1, 1));

    // With local endpoints the gauges drop.
    run_for(Duration::from_secs(5)).await;
    h.send(applied(slice(
        "itp-a",
        "itp",
        &[("10.180.0.1", Some(NODE), true)],
    )))
    .await;
    h.send(applied(slice(
        "etp-a",
        "etp",
        &[("10.180.0.2", Some(NODE), true)],
    )))
    .await;
    settle().await;
    assert_eq!((gauge("internal"), gauge("external")), (0, 0));
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn metrics_follow_syncs_and_changes() {
    let h = Harness::start();
    run_for(Duration::from_secs(10)).await;
    let mut annotated = slice("web-a", "web", &[("10.180.0.1", None, true)]);
    // Triggered 2 s before now on the injected clock (which started 10 s ago).
    annotated.metadata.annotations = Some(
        [(
            LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(),
            "2023-11-14T22:13:28Z".to_owned(),
        )]
        .into_iter()
        .collect(),
    );
    // Triggered before the proxier started: not measured.
    let mut old = slice("db-a", "db", &[("10.180.0.2", None, true)]);
    old.metadata.annotations = Some(
        [(
            LAST_CHANGE_TRIGGER_TIME_ANNOTATION.to_owned(),
            "2023-11-14T22:00:00Z".to_owned(),
        )]
        .into_iter()
        .collect(),
    );
    let invalid = fixtures::service(
        "ns",
        "bad",
        json!({"clusterIP": "172.30.0.999", "ports": [{"port": 80}]}),
    );
    h.send(SourceEvent::Service(ObjectEvent::Synced)).await;
    h.send(applied(service("web", "172.30.0.41"))).await;
    h.send(applied(invalid)).await;
    h.send(applied(annotated)).await;
    h.send(applied(old)).await;
    settle().await;
    assert_eq!(h.metrics.service_changes.get(), 2);
    assert_eq!(h.metrics.endpoint_changes.get(), 2);
    assert_eq!(h.metrics.service_changes_pending.get(), 1);
    assert_eq!(h.metrics.endpoint_changes_pending.get(), 2);
    assert_eq!(
        h.metrics.last_queued_timestamp.get(),
        0.0,
        "not initialized yet"
    );

    h.send(SourceEvent::EndpointSlice(ObjectEvent::Synced))
        .await;
    settle().await;
    let now = (EPOCH_OFFSET + Duration::from_secs(10)).as_secs_f64();
    assert_eq!(h.metrics.last_queued_timestamp.get(), now);
    assert_eq!(h.metrics.last_sync_timestamp.get(), now);
    assert_eq!(h.metrics.service_changes_pending.get(), 0);
    assert_eq!(h.metrics.endpoint_changes_pending.get(), 0);
    assert_eq!(
        h.sample("kubeproxy_sync_proxy_rules_duration_seconds_count"),
        1.0
    );
    assert_eq!(
        h.sample("kubeproxy_sync_full_proxy_rules_duration_seconds_count"),
        1.0
    );
    assert_eq!(
        h.sample("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        0.0
    );
    assert_eq!(
        h.sample("kubeproxy_network_programming_duration_seconds_count"),
        1.0
    );
    assert_eq!(
        h.sample("kubeproxy_network_programming_duration_seconds_sum"),
        2.0
    );
    assert_eq!(
        h.metrics
            .invalid_objects
            .get_or_create(&KindLabel { kind: "Service" })
            .get(),
        1
    );

    run_for(Duration::from_secs(5)).await;
    h.send(applied(service("web", "172.30.0.42"))).await;
    settle().await;
    assert_eq!(
        h.sample("kubeproxy_sync_partial_proxy_rules_duration_seconds_count"),
        1.0
    );
    assert_eq!(
        h.sample("kubeproxy_sync_proxy_rules_duration_seconds_count"),
        2.0
    );

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &h.registry).expect("encode");
    assert!(
        text.contains("kubeproxy_sync_proxy_rules_service_changes_total 3\n"),
        "{text}"
    );
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn a_partial_sync_the_backend_ran_fully_counts_as_full() {
    let h = Harness::start();
    h.initialize(vec![applied(service("web", "172.30.0.41"))])
        .await;
    h.backend.run_full_next(1);
    h.send(applied(service("web", "172.30.0.42"))).await;
    settle().await;
    run_for(Duration::from_secs(2)).await;
    h.send(applied(service("web", "172.30.0.43"))).await;
    settle().await;
    let kinds: Vec<SyncKind> = h.syncs().iter().map(|s| s.kind).collect();
    assert_eq!(
        kinds,
        [SyncKind::Full, SyncKind::Partial, SyncKind::Partial],
        "the core asked for partial syncs; running one fully does not change what it asks next"
    );
    let count = |kind| {
        h.sample(&format!(
            "kubeproxy_sync_{kind}_proxy_rules_duration_seconds_count"
        ))
    };
    assert_eq!(count("full"), 2.0, "the first sync and the one run fully");
    assert_eq!(count("partial"), 1.0);
    h.stop().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_returns_promptly() {
    let h = Harness::start();
    h.initialize(vec![]).await;
    h.shutdown.cancel();
    settle().await;
    assert!(h.task.is_finished());
    let result = h.task.await.expect("no panic");
    assert!(result.is_ok());
}

#[tokio::test(start_paused = true)]
async fn closed_event_channel_keeps_state_and_periodic_syncs() {
    let Harness {
        events,
        shutdown,
        backend,
        task,
        ..
    } = Harness::start();
    for event in [
        applied(service("web", "172.30.0.41")),
        applied(slice("web-a", "web", &[("10.180.0.1", None, true)])),
        SERVICES_SYNCED,
        SLICES_SYNCED,
    ] {
        events.send(event).await.expect("running");
    }
    settle().await;
    drop(events);
    run_for(3 * SYNC_PERIOD + Duration::from_millis(1)).await;
    let syncs = backend.syncs();
    assert_eq!(syncs.len(), 4);
    for sync in &syncs[1..] {
        assert_eq!(sync.state, syncs[0].state);
        assert_eq!((sync.service_ports, sync.endpoints), (1, 1));
    }
    assert!(!task.is_finished());
    shutdown.cancel();
    assert!(task.await.expect("no panic").is_ok());
}

#[tokio::test(start_paused = true)]
async fn invalid_config_is_rejected() {
    let health = Arc::new(ProxyHealth::new(SYNC_PERIOD));
    let metrics = Metrics::register(&mut Registry::default());
    let config = ProxierConfig::new(NODE).with_sync_period(Duration::ZERO);
    let error = Proxier::new(config, FakeBackend::new(), health, metrics).expect_err("invalid");
    assert!(matches!(
        error,
        ProxierError::InvalidConfig {
            field: "syncPeriod",
            ..
        }
    ));

    let defaults = ProxierConfig::new(NODE);
    assert_eq!(defaults.min_sync_period(), DEFAULT_MIN_SYNC_PERIOD);
    assert_eq!(defaults.sync_period(), DEFAULT_SYNC_PERIOD);
    assert_eq!(defaults.retry_interval(), DEFAULT_SYNC_PERIOD);
    let custom = defaults.with_sync_period(Duration::from_secs(60));
    assert_eq!(custom.retry_interval(), Duration::from_secs(60));
}
