//! The API server source against a fake Kubernetes API server speaking list/watch
//! (`kp_testbed::apiserver`, shared with the fault suite).
//!
//! The fake serves Services, EndpointSlices, Nodes (and ServiceCIDRs where asked): paged lists
//! with a resourceVersion, and watches as chunked newline-delimited JSON events that the test
//! sends. A TCP proxy in front of it lets a test cut every connection or make the server
//! unreachable.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_sources::api::{self, ApiError, ApiMetrics, ApiSource, ClientOptions, RetryPolicy};
use kp_testbed::apiserver::{FakeApiServer, NODES, Request, SERVICE_CIDRS, SERVICES, SLICES};
use kube::ResourceExt;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use tokio_util::sync::CancellationToken;

/// Upper bound for anything the test waits for; generous for slow shared CI machines.
const WAIT: Duration = Duration::from_secs(10);
/// How long "nothing happens" is observed.
const QUIET: Duration = Duration::from_millis(400);
/// Retry delay given to the source so reconnects are fast.
const RETRY: Duration = Duration::from_millis(20);

/// Upstream's one selector for Services and EndpointSlices alike.
const SELECTOR: &str = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name";

// ---------------------------------------------------------------------------------------------
// Objects

fn svc(name: &str, labels: Value) -> Value {
    json!({ "metadata": { "namespace": "default", "name": name, "labels": labels },
            "spec": { "type": "ClusterIP", "clusterIP": "10.96.0.10",
                      "ports": [{ "name": "http", "port": 80, "protocol": "TCP" }] } })
}

fn slice(name: &str, service: &str, extra_labels: Value) -> Value {
    let mut labels = json!({ "kubernetes.io/service-name": service });
    if let (Some(l), Some(extra)) = (labels.as_object_mut(), extra_labels.as_object()) {
        l.extend(extra.clone());
    }
    json!({ "metadata": { "namespace": "default", "name": name, "labels": labels },
            "addressType": "IPv4",
            "endpoints": [{ "addresses": ["10.244.1.5"], "conditions": { "ready": true } }],
            "ports": [{ "name": "http", "port": 8080, "protocol": "TCP" }] })
}

fn node(name: &str, zone: &str) -> Value {
    json!({ "metadata": { "name": name, "labels": { "topology.kubernetes.io/zone": zone } } })
}

// ---------------------------------------------------------------------------------------------
// TCP proxy in front of the fake, to cut connections or refuse them

struct Proxy {
    addr: SocketAddr,
    backend: SocketAddr,
    conns: Arc<Mutex<CancellationToken>>,
    accept: Option<JoinHandle<()>>,
}

impl Proxy {
    async fn start(backend: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let mut proxy = Proxy {
            addr: listener.local_addr().expect("proxy address"),
            backend,
            conns: Arc::new(Mutex::new(CancellationToken::new())),
            accept: None,
        };
        proxy.serve(listener);
        proxy
    }

    fn serve(&mut self, listener: TcpListener) {
        let conns = self.conns.clone();
        let backend = self.backend;
        self.accept = Some(tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let token = conns.lock().expect("proxy lock").clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(backend).await else {
                        return;
                    };
                    tokio::select! {
                        () = token.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                });
            }
        }));
    }

    /// Closes every open connection; new ones are still accepted.
    fn cut_connections(&self) {
        let mut token = self.conns.lock().expect("proxy lock");
        token.cancel();
        *token = CancellationToken::new();
    }

    /// Stops listening (connections are refused) and closes every open connection.
    async fn down(&mut self) {
        if let Some(accept) = self.accept.take() {
            accept.abort();
            let _ = accept.await;
        }
        self.cut_connections();
    }

    async fn up(&mut self) {
        let listener = TcpListener::bind(self.addr)
            .await
            .expect("rebind proxy port");
        self.serve(listener);
    }
}

// ---------------------------------------------------------------------------------------------
// Harness

struct Harness {
    fake: FakeApiServer,
    requests: HashMap<&'static str, mpsc::UnboundedReceiver<Request>>,
    proxy: Proxy,
    backend: SocketAddr,
    rx: Option<mpsc::Receiver<SourceEvent>>,
    shutdown: CancellationToken,
    task: Option<JoinHandle<Result<(), ApiError>>>,
    metrics: Option<ApiMetrics>,
}

impl Harness {
    async fn new() -> Self {
        Self::serving(false).await
    }

    /// A fake API server that serves ServiceCIDRs (`service_cidrs`) or not.
    async fn serving(service_cidrs: bool) -> Self {
        let fake = FakeApiServer::new(100);
        let requests = [SERVICES, SLICES, NODES, SERVICE_CIDRS]
            .into_iter()
            .map(|res| (res, fake.requests(res)))
            .collect();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind fake");
        let backend = listener.local_addr().expect("fake address");
        let app = fake.router(service_cidrs);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        let proxy = Proxy::start(backend).await;
        Harness {
            fake,
            requests,
            proxy,
            backend,
            rx: None,
            shutdown: CancellationToken::new(),
            task: None,
            metrics: None,
        }
    }

    fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.proxy.addr).parse().expect("url");
        kube::Client::try_from(kube::Config::new(url)).expect("client")
    }

    /// Starts the source for node `node-a` with a short retry delay, customised by `build`.
    fn start(&mut self, build: impl FnOnce(ApiSource) -> ApiSource) {
        let source = build(ApiSource::new(self.client(), "node-a").retry_delay(RETRY));
        self.start_source(source);
    }

    fn start_source(&mut self, source: ApiSource) {
        let (tx, rx) = mpsc::channel(64);
        self.rx = Some(rx);
        self.metrics = Some(source.metrics());
        self.task = Some(tokio::spawn(source.run(tx, self.shutdown.clone())));
    }

    async fn next_request(&mut self, res: &str) -> Request {
        let rx = self.requests.get_mut(res).expect("known resource");
        timeout(WAIT, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no request for {res}"))
            .expect("fake server alive")
    }

    /// Waits for the next watch on `res`, asserting no list happens before it.
    async fn expect_watch(&mut self, res: &str) -> Request {
        let req = self.next_request(res).await;
        assert!(req.watch, "{res}: expected a watch, got a list {req:?}");
        req
    }

    fn no_more_requests(&mut self, res: &str) {
        let rx = self.requests.get_mut(res).expect("known resource");
        if let Ok(req) = rx.try_recv() {
            panic!("{res}: unexpected request {req:?}");
        }
    }

    async fn recv(&mut self) -> String {
        let rx = self.rx.as_mut().expect("started");
        let ev = timeout(WAIT, rx.recv())
            .await
            .expect("an event in time")
            .expect("source still running");
        describe(&ev)
    }

    /// Collects events until `n` Synced events have arrived.
    async fn until_synced(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        while out
            .iter()
            .filter(|e: &&String| e.ends_with(" synced"))
            .count()
            < n
        {
            out.push(self.recv().await);
        }
        out
    }

    async fn assert_quiet(&mut self) {
        let rx = self.rx.as_mut().expect("started");
        if let Ok(Some(ev)) = timeout(QUIET, rx.recv()).await {
            panic!("unexpected event {}", describe(&ev));
        }
    }

    /// Initial list + first watch of every kind; returns the events of the initial sync.
    async fn initial_sync(&mut self) -> Vec<String> {
        let events = self.until_synced(3).await;
        for res in [SERVICES, SLICES, NODES] {
            let mut req = self.next_request(res).await;
            assert!(!req.watch, "{res}: first request is a list");
            while !req.watch {
                req = self.next_request(res).await;
            }
            let watch = req;
            assert_eq!(watch.param("allowWatchBookmarks"), Some("true"));
            assert!(watch.param("timeoutSeconds").is_some());
            assert!(
                watch
                    .param("resourceVersion")
                    .is_some_and(|rv| !rv.is_empty())
            );
        }
        events
    }

    /// The source's metrics as `/metrics` shows them.
    fn metrics_text(&self) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = self.metrics.as_ref().expect("started");
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        text
    }

    /// Asserts that the source's metrics have every line.
    fn assert_metrics(&self, lines: &[&str]) {
        let text = self.metrics_text();
        for line in lines {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
    }

    /// The server answers again: every watch resumes without a list and nothing is
    /// reported; then the server no longer has history that old, and the relist reports only
    /// `default/b` (removed meanwhile) gone.
    async fn resume_then_relist_without_b(&mut self) {
        self.proxy.up().await;
        for res in [SERVICES, SLICES, NODES] {
            self.expect_watch(res).await;
        }
        self.assert_quiet().await;
        self.fake.expire(SERVICES);
        let events = self.until_synced(1).await;
        assert_eq!(
            events,
            [
                "Service applied default/a",
                "Service deleted default/b",
                "Service synced"
            ]
        );
    }

    /// The value of the counter `series` (name and labels) in the source's metrics.
    fn counter(&self, series: &str) -> u64 {
        let text = self.metrics_text();
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    /// Waits (bounded) until the source's metrics have `line`.
    async fn eventually_metric(&self, line: &str) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !self.metrics_text().contains(line) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{line} never showed in:\n{}",
                self.metrics_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        let task = self.task.take().expect("started");
        let result = timeout(WAIT, task).await.expect("run returns promptly");
        result.expect("run did not panic").expect("run returns Ok");
    }
}

fn describe(ev: &SourceEvent) -> String {
    fn one<K: ResourceExt>(kind: &str, ev: &ObjectEvent<K>) -> String {
        let name = |o: &K| match o.namespace() {
            Some(ns) => format!("{ns}/{}", o.name_any()),
            None => o.name_any(),
        };
        match ev {
            ObjectEvent::Applied(o) => format!("{kind} applied {}", name(o)),
            ObjectEvent::Deleted(o) => format!("{kind} deleted {}", name(o)),
            ObjectEvent::Synced => format!("{kind} synced"),
        }
    }
    match ev {
        SourceEvent::Service(e) => one("Service", e),
        SourceEvent::EndpointSlice(e) => one("EndpointSlice", e),
        SourceEvent::Node(e) => one("Node", e),
        SourceEvent::ServiceCidr(e) => one("ServiceCIDR", e),
        // The API source sends single events only.
        SourceEvent::Batch(events) => {
            let inner: Vec<String> = events.iter().map(describe).collect();
            format!("Batch [{}]", inner.join(", "))
        }
    }
}

fn of_kind(events: &[String], kind: &str) -> Vec<String> {
    let prefix = format!("{kind} ");
    events
        .iter()
        .filter(|e| e.starts_with(&prefix))
        .cloned()
        .collect()
}

fn no_deletions(events: &[String]) {
    assert!(
        events.iter().all(|e| !e.contains(" deleted ")),
        "unexpected deletions in {events:?}"
    );
}

/// The usual cluster: two Services and a slice the proxy handles, plus objects it must not see.
fn seed(fake: &FakeApiServer) {
    fake.put(SERVICES, svc("a", json!({})));
    fake.put(SERVICES, svc("b", json!({})));
    fake.put(
        SERVICES,
        svc("foreign", json!({ api::SERVICE_PROXY_NAME_LABEL: "other" })),
    );
    fake.put(SLICES, slice("a-1", "a", json!({})));
    fake.put(
        SLICES,
        slice("headless-1", "h", json!({ api::HEADLESS_LABEL: "" })),
    );
    fake.put(NODES, node("node-a", "zone-1"));
    fake.put(NODES, node("node-b", "zone-2"));
}

// ---------------------------------------------------------------------------------------------
// Scenarios

#[tokio::test]
async fn initial_list_then_watch_events() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.start(|s| s);

    let events = h.until_synced(3).await;
    assert_eq!(
        of_kind(&events, "Service"),
        [
            "Service applied default/a",
            "Service applied default/b",
            "Service synced"
        ]
    );
    assert_eq!(
        of_kind(&events, "EndpointSlice"),
        ["EndpointSlice applied default/a-1", "EndpointSlice synced"]
    );
    assert_eq!(
        of_kind(&events, "Node"),
        ["Node applied node-a", "Node synced"]
    );

    // Selectors reach the server on lists and watches.
    for (res, param, want) in [
        (SERVICES, "labelSelector", SELECTOR),
        (SLICES, "labelSelector", SELECTOR),
        (NODES, "fieldSelector", "metadata.name=node-a"),
    ] {
        let list = h.next_request(res).await;
        assert!(!list.watch);
        assert_eq!(list.param(param), Some(want), "{res} list");
        assert_eq!(list.param("limit"), Some("500"), "{res} list is paged");
        let watch = h.expect_watch(res).await;
        assert_eq!(watch.param(param), Some(want), "{res} watch");
        assert_eq!(watch.param("allowWatchBookmarks"), Some("true"));
        assert!(watch.param("timeoutSeconds").is_some());
        let other = if param == "labelSelector" {
            "fieldSelector"
        } else {
            "labelSelector"
        };
        assert_eq!(list.param(other), None, "{res} list");
        assert_eq!(watch.param(other), None, "{res} watch");
    }

    h.fake.apply(SERVICES, "ADDED", svc("c", json!({})));
    assert_eq!(h.recv().await, "Service applied default/c");
    h.fake
        .apply(SERVICES, "MODIFIED", svc("a", json!({ "app": "x" })));
    assert_eq!(h.recv().await, "Service applied default/a");
    h.fake.delete(SLICES, "default/a-1");
    assert_eq!(h.recv().await, "EndpointSlice deleted default/a-1");
    h.fake.apply(NODES, "MODIFIED", node("node-a", "zone-9"));
    assert_eq!(h.recv().await, "Node applied node-a");
    h.fake.delete(SERVICES, "default/b");
    assert_eq!(h.recv().await, "Service deleted default/b");
    h.assert_quiet().await;
    h.stop().await;
}

#[tokio::test]
async fn service_cidrs_are_watched_where_served() {
    let cidr = |name: &str, cidrs: Value| {
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
               "metadata": {"name": name}, "spec": {"cidrs": cidrs}})
    };
    let mut h = Harness::serving(true).await;
    seed(&h.fake);
    h.fake
        .put(SERVICE_CIDRS, cidr("kubernetes", json!(["10.96.0.0/16"])));
    h.start(|s| s);
    let events = h.until_synced(4).await;
    assert_eq!(
        of_kind(&events, "ServiceCIDR"),
        ["ServiceCIDR applied kubernetes", "ServiceCIDR synced"]
    );
    let list = h.next_request(SERVICE_CIDRS).await;
    assert!(!list.watch, "first a list");
    h.expect_watch(SERVICE_CIDRS).await;
    h.fake.apply(
        SERVICE_CIDRS,
        "ADDED",
        cidr("extra", json!(["10.97.0.0/16"])),
    );
    assert_eq!(h.recv().await, "ServiceCIDR applied extra");
    h.fake.delete(SERVICE_CIDRS, "extra");
    assert_eq!(h.recv().await, "ServiceCIDR deleted extra");
    h.stop().await;

    // Not served (the other tests' fake): one list, a 404, no events and no retries.
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.start(|s| s);
    let events = h.until_synced(3).await;
    assert!(of_kind(&events, "ServiceCIDR").is_empty(), "{events:?}");
    h.assert_quiet().await;
    h.stop().await;
}

#[tokio::test]
async fn gone_relists_and_deletes_only_what_vanished() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.fake.put(SERVICES, svc("c", json!({})));
    h.start(|s| s.list_page_size(2));
    let events = h.initial_sync().await;
    assert_eq!(
        of_kind(&events, "Service"),
        [
            "Service applied default/a",
            "Service applied default/b",
            "Service applied default/c",
            "Service synced"
        ]
    );

    // While the watch was stale, b went away and d appeared; the server then says 410 Gone.
    h.fake.remove(SERVICES, "default/b");
    h.fake.put(SERVICES, svc("d", json!({})));
    h.fake.expire(SERVICES);
    let events = h.until_synced(1).await;
    assert_eq!(
        events,
        [
            "Service applied default/a",
            "Service applied default/c",
            "Service applied default/d",
            "Service deleted default/b",
            "Service synced"
        ]
    );

    // The relist is paged (3 objects, pages of 2), then the watch resumes from its version.
    let first = h.next_request(SERVICES).await;
    assert!(!first.watch);
    assert_eq!(
        (first.param("limit"), first.param("continue")),
        (Some("2"), None)
    );
    let second = h.next_request(SERVICES).await;
    assert!(!second.watch);
    assert_eq!(second.param("continue"), Some("2"));
    let watch = h.expect_watch(SERVICES).await;
    assert_eq!(watch.param("resourceVersion"), Some(h.fake.rv().as_str()));
    h.no_more_requests(SLICES);
    h.no_more_requests(NODES);
    h.assert_quiet().await;

    h.fake
        .apply(SERVICES, "MODIFIED", svc("a", json!({ "v": "2" })));
    assert_eq!(h.recv().await, "Service applied default/a");
    h.stop().await;
}

#[tokio::test]
async fn dropped_connections_resume_without_relist_or_deletions() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.start(|s| s);
    h.initial_sync().await;

    // The server ends the watch response cleanly (as at timeoutSeconds): resume from the last
    // resourceVersion seen, here a bookmark's.
    h.fake.bookmark(SERVICES, "5000");
    h.fake.close_watches(SERVICES);
    let watch = h.expect_watch(SERVICES).await;
    assert_eq!(watch.param("resourceVersion"), Some("5000"));
    let rv = h
        .fake
        .apply(SERVICES, "MODIFIED", svc("a", json!({ "v": "2" })));
    assert_eq!(h.recv().await, "Service applied default/a");

    // Every TCP connection is cut: all three watches come back without relisting, the
    // Services one from the last event's resourceVersion.
    h.proxy.cut_connections();
    let watch = h.expect_watch(SERVICES).await;
    assert_eq!(watch.param("resourceVersion"), Some(rv.as_str()));
    for res in [SLICES, NODES] {
        h.expect_watch(res).await;
    }
    h.assert_quiet().await;
    h.fake
        .apply(SLICES, "MODIFIED", slice("a-1", "a", json!({ "v": "2" })));
    assert_eq!(h.recv().await, "EndpointSlice applied default/a-1");
    h.fake.apply(NODES, "MODIFIED", node("node-a", "zone-3"));
    assert_eq!(h.recv().await, "Node applied node-a");
    h.fake.delete(SERVICES, "default/b");
    assert_eq!(h.recv().await, "Service deleted default/b");
    h.assert_quiet().await;
    h.stop().await;
}

#[tokio::test]
async fn unreachable_server_deletes_nothing_and_converges_after() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.start(|s| s);
    h.initial_sync().await;

    // Connections are refused for a while (dozens of retries at RETRY): nothing is reported.
    h.proxy.down().await;
    h.assert_quiet().await;
    h.assert_quiet().await;
    h.assert_metrics(&["kube_proxy_rs_api_server_unreachable 1\n"]);
    // Meanwhile b is deleted on the server.
    h.fake.remove(SERVICES, "default/b");
    h.resume_then_relist_without_b().await;
    // One outage, ended by the first answer; one relist.
    h.assert_metrics(&[
        "kube_proxy_rs_api_server_unreachable 0\n",
        "kube_proxy_rs_api_server_outages_total 1\n",
        "kube_proxy_rs_api_server_outage_duration_seconds_count 1\n",
        "kube_proxy_rs_watch_relists_total{kind=\"Service\"} 1\n",
        "kube_proxy_rs_watch_failures_total{kind=\"Service\",reason=\"expired\"} 1\n",
    ]);
    // Every broken watch is back: the relisted one, and the resumed ones (open, quiet).
    h.eventually_metric("kube_proxy_rs_api_server_recovery_duration_seconds_count 1\n")
        .await;
    h.fake.apply(NODES, "MODIFIED", node("node-a", "zone-3"));
    assert_eq!(h.recv().await, "Node applied node-a");
    h.stop().await;
}

/// An outage under the default curve's shape, scaled down (50 ms doubling to a 400 ms cap,
/// jittered): the retries thin out to one per capped delay (a fixed 20 ms would make 150 in
/// the 3 s, doubling without the cap 6), and once the server answers again every watch
/// resumes and a relist deletes what vanished meanwhile.
#[tokio::test]
async fn an_outage_is_retried_with_the_capped_backoff_and_recovers() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    let policy = RetryPolicy {
        initial: Duration::from_millis(50),
        max: Duration::from_millis(400),
        reset_after: Duration::from_secs(60),
        jitter: true,
    };
    h.start(|s| s.retry(policy));
    h.initial_sync().await;
    h.proxy.down().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    h.fake.remove(SERVICES, "default/b");
    let failures =
        h.counter("kube_proxy_rs_watch_failures_total{kind=\"Service\",reason=\"unreachable\"}");
    // At least 1 + 3 + 6 (delays of at most 50, 100, 200, then 400 ms), at most 1 + 4 + 13
    // (at least 25, 50, 100, then 200 ms); a little slack for a loaded machine.
    assert!(
        (8..=20).contains(&failures),
        "{failures} failed attempts in 3 s"
    );
    h.resume_then_relist_without_b().await;
    h.eventually_metric("kube_proxy_rs_api_server_recovery_duration_seconds_count 1\n")
        .await;
    h.stop().await;
}

#[tokio::test]
async fn expired_relists_at_once_whatever_the_backoff() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    // A retry delay far longer than the test waits for anything: only a relist that does not
    // wait for it passes.
    h.start(|s| s.retry(RetryPolicy::fixed(Duration::from_secs(600))));
    h.initial_sync().await;
    h.fake.remove(SERVICES, "default/b");
    h.fake.expire(SERVICES);
    let events = h.until_synced(1).await;
    assert_eq!(
        events,
        [
            "Service applied default/a",
            "Service deleted default/b",
            "Service synced"
        ]
    );
    // The relisted watch is open: it delivers.
    while !h.next_request(SERVICES).await.watch {}
    h.fake.apply(SERVICES, "ADDED", svc("c", json!({})));
    assert_eq!(h.recv().await, "Service applied default/c");
    h.assert_metrics(&[
        "kube_proxy_rs_watch_relists_total{kind=\"Service\"} 1\n",
        "kube_proxy_rs_watch_failures_total{kind=\"Service\",reason=\"expired\"} 1\n",
        "kube_proxy_rs_api_server_outages_total 0\n",
    ]);
    h.stop().await;
}

#[tokio::test]
async fn unreachable_from_start_reports_nothing_and_stops_promptly() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.proxy.down().await;
    // Default backoff: shutdown must not wait for a backoff sleep to end.
    let source = ApiSource::new(h.client(), "node-a");
    h.start_source(source);
    h.assert_quiet().await;
    h.stop().await;
}

#[tokio::test]
async fn returns_when_receiver_is_dropped() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    h.start(|s| s);
    let events = h.initial_sync().await;
    no_deletions(&events);
    drop(h.rx.take());
    let task = h.task.take().expect("started");
    let result = timeout(WAIT, task).await.expect("run returns promptly");
    result.expect("no panic").expect("Ok");
}

#[tokio::test]
async fn empty_node_name_is_an_error() {
    let h = Harness::new().await;
    let (tx, _rx) = mpsc::channel(1);
    let result = ApiSource::new(h.client(), "")
        .run(tx, CancellationToken::new())
        .await;
    assert!(matches!(result, Err(ApiError::EmptyNodeName)), "{result:?}");
}

#[tokio::test]
async fn service_proxy_name_selects_own_and_unlabelled_objects() {
    let mut h = Harness::new().await;
    seed(&h.fake);
    let mine = json!({ api::SERVICE_PROXY_NAME_LABEL: "mine" });
    h.fake.put(SERVICES, svc("mine", mine.clone()));
    h.fake.put(SLICES, slice("mine-1", "mine", mine));
    h.start(|s| s.service_proxy_name("mine"));

    let events = h.until_synced(3).await;
    assert_eq!(
        of_kind(&events, "Service"),
        [
            "Service applied default/a",
            "Service applied default/b",
            "Service applied default/mine",
            "Service synced"
        ]
    );
    assert_eq!(
        of_kind(&events, "EndpointSlice"),
        [
            "EndpointSlice applied default/a-1",
            "EndpointSlice applied default/mine-1",
            "EndpointSlice synced"
        ]
    );
    let list = h.next_request(SERVICES).await;
    assert_eq!(
        list.param("labelSelector"),
        Some("!service.kubernetes.io/headless")
    );
    let list = h.next_request(SLICES).await;
    assert_eq!(
        list.param("labelSelector"),
        Some("!service.kubernetes.io/headless")
    );
    h.expect_watch(SERVICES).await;

    // Handed over to another proxy: gone for us. Changes to foreign objects say nothing.
    let other = json!({ api::SERVICE_PROXY_NAME_LABEL: "other" });
    h.fake.apply(SERVICES, "MODIFIED", svc("a", other.clone()));
    assert_eq!(h.recv().await, "Service deleted default/a");
    h.fake.apply(SERVICES, "MODIFIED", svc("foreign", other));
    h.assert_quiet().await;
    h.stop().await;
}

// ---------------------------------------------------------------------------------------------
// client()

async fn node_names(client: kube::Client) -> Vec<String> {
    let nodes = kube::Api::<Node>::all(client)
        .list(&kube::api::ListParams::default())
        .await
        .expect("list nodes");
    nodes.items.iter().map(|n| n.name_any()).collect()
}

#[tokio::test]
async fn client_from_master_url() {
    let h = Harness::new().await;
    seed(&h.fake);
    for master in [format!("http://{}", h.backend), h.backend.to_string()] {
        let opts = ClientOptions {
            master: Some(master.clone()),
            ..ClientOptions::default()
        };
        let client = api::client(&opts).await.expect("client");
        assert_eq!(node_names(client).await, ["node-a", "node-b"], "{master}");
    }
}

fn write_kubeconfig(dir: &tempfile::TempDir, server: &str) -> std::path::PathBuf {
    let path = dir.path().join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n\
         clusters:\n- name: fake\n  cluster:\n    server: {server}\n\
         contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
         users:\n- name: fake\n  user: {{}}\n"
    );
    std::fs::write(&path, text).expect("write kubeconfig");
    path
}

#[tokio::test]
async fn client_from_kubeconfig_and_master_override() {
    let h = Harness::new().await;
    seed(&h.fake);
    let dir = tempfile::tempdir().expect("tempdir");

    let path = write_kubeconfig(&dir, &format!("http://{}", h.backend));
    let opts = ClientOptions {
        kubeconfig: Some(path),
        ..ClientOptions::default()
    };
    let client = api::client(&opts).await.expect("client from kubeconfig");
    assert_eq!(node_names(client).await, ["node-a", "node-b"]);

    // --master replaces the kubeconfig's (here unusable) server.
    let path = write_kubeconfig(&dir, "http://127.0.0.1:1");
    let opts = ClientOptions {
        kubeconfig: Some(path),
        master: Some(format!("http://{}", h.backend)),
        ..ClientOptions::default()
    };
    let client = api::client(&opts).await.expect("client with --master");
    assert_eq!(node_names(client).await, ["node-a", "node-b"]);
}

#[tokio::test]
async fn client_errors_say_what_was_tried() {
    let missing = std::path::PathBuf::from("/nonexistent/kp-sources-test/kubeconfig");
    let opts = ClientOptions {
        kubeconfig: Some(missing.clone()),
        ..ClientOptions::default()
    };
    let Err(err) = api::client(&opts).await else {
        panic!("a missing kubeconfig is an error");
    };
    assert!(matches!(&err, ApiError::Kubeconfig { path, .. } if *path == missing));
    assert!(
        err.to_string()
            .contains("/nonexistent/kp-sources-test/kubeconfig"),
        "{err}"
    );

    let opts = ClientOptions {
        master: Some("http://bad host:80".into()),
        ..ClientOptions::default()
    };
    let Err(err) = api::client(&opts).await else {
        panic!("a bad --master is an error");
    };
    assert!(matches!(err, ApiError::InvalidMaster { .. }), "{err:?}");
    assert!(err.to_string().contains("--master"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Objects the API server stores that a strict decode refuses

/// `obj` with the odd values a real API server keeps in fields the proxy never reads: Go's
/// zero time as `null` (the conformance spec "should complete a service status lifecycle"
/// writes one), a malformed timestamp, managed fields and a field no type knows.
fn odd(mut obj: Value) -> Value {
    obj["metadata"]["creationTimestamp"] = json!("not a time");
    obj["metadata"]["managedFields"] = json!([{ "manager": 7, "time": null }]);
    obj["status"]["conditions"] = json!([{ "type": "StatusUpdate", "status": "True",
        "reason": "E2E", "message": "x", "lastTransitionTime": null }]);
    obj["fieldFromANewerServer"] = json!({ "x": [1, null] });
    obj
}

/// `svc(name)` whose port number, which the proxy reads, is not a number.
fn broken_svc(name: &str) -> Value {
    let mut obj = odd(svc(name, json!({})));
    obj["spec"]["ports"][0]["port"] = json!("eighty");
    obj
}

fn skipped(kind: &str, n: u64) -> String {
    format!("kube_proxy_rs_watch_skipped_objects_total{{kind=\"{kind}\"}} {n}\n")
}

#[tokio::test]
async fn odd_objects_are_applied_and_unusable_ones_lose_only_themselves() {
    let cidr = json!({ "metadata": { "name": "kubernetes" },
                       "spec": { "cidrs": ["10.96.0.0/16"] } });
    let mut h = Harness::serving(true).await;
    h.fake.put(SERVICES, svc("a", json!({})));
    h.fake.put(SERVICES, odd(svc("odd", json!({}))));
    h.fake.put(SERVICES, broken_svc("broken"));
    h.fake.put(SLICES, slice("a-1", "a", json!({})));
    h.fake.put(SLICES, odd(slice("odd-1", "odd", json!({}))));
    h.fake.put(NODES, odd(node("node-a", "zone-1")));
    h.fake.put(SERVICE_CIDRS, odd(cidr));
    h.start(|s| s);

    // At list time: every usable object, the unusable one skipped, nothing failed.
    let events = h.until_synced(4).await;
    assert_eq!(
        of_kind(&events, "Service"),
        [
            "Service applied default/a",
            "Service applied default/odd",
            "Service synced"
        ]
    );
    assert_eq!(
        of_kind(&events, "EndpointSlice"),
        [
            "EndpointSlice applied default/a-1",
            "EndpointSlice applied default/odd-1",
            "EndpointSlice synced"
        ]
    );
    assert_eq!(
        of_kind(&events, "Node"),
        ["Node applied node-a", "Node synced"]
    );
    assert_eq!(
        of_kind(&events, "ServiceCIDR"),
        ["ServiceCIDR applied kubernetes", "ServiceCIDR synced"]
    );
    h.assert_metrics(&[&skipped("Service", 1)]);
    let failures = h.metrics_text();
    assert!(
        !failures.contains("kube_proxy_rs_watch_failures_total{"),
        "no list or watch failed:\n{failures}"
    );
    for res in [SERVICES, SLICES, NODES, SERVICE_CIDRS] {
        while !h.next_request(res).await.watch {}
    }

    // In the watch stream: odd objects apply as ADDED and MODIFIED...
    h.fake
        .apply(SERVICES, "ADDED", odd(svc("odd-2", json!({ "x": "1" }))));
    assert_eq!(h.recv().await, "Service applied default/odd-2");
    h.fake.apply(
        SLICES,
        "MODIFIED",
        odd(slice("odd-1", "odd", json!({ "x": "1" }))),
    );
    assert_eq!(h.recv().await, "EndpointSlice applied default/odd-1");
    h.fake
        .apply(NODES, "MODIFIED", odd(node("node-a", "zone-2")));
    assert_eq!(h.recv().await, "Node applied node-a");
    // ...a version that cannot be used is skipped (its last good version stays)...
    h.fake.apply(SERVICES, "MODIFIED", broken_svc("odd"));
    h.eventually_metric(&skipped("Service", 2)).await;
    h.assert_quiet().await;
    // ...and the watch goes on: a later event still arrives.
    h.fake.apply(SERVICES, "ADDED", svc("c", json!({})));
    assert_eq!(h.recv().await, "Service applied default/c");

    // Deletions apply whatever the deleted body holds.
    h.fake.delete(SERVICES, "default/odd");
    assert_eq!(h.recv().await, "Service deleted default/odd");
    h.fake.delete(SERVICES, "default/broken");
    h.fake.delete(SLICES, "default/odd-1");
    assert_eq!(h.recv().await, "EndpointSlice deleted default/odd-1");
    h.fake.delete(SERVICE_CIDRS, "kubernetes");
    assert_eq!(h.recv().await, "ServiceCIDR deleted kubernetes");
    h.fake.delete(NODES, "node-a");
    assert_eq!(h.recv().await, "Node deleted node-a");
    h.assert_quiet().await;
    h.stop().await;
}

/// A list that cannot be decoded at all (not an object list) is retried with the growing
/// backoff, not twice a second: the watcher's `Init` before the failing list is no success.
#[tokio::test]
async fn an_undecodable_list_is_retried_with_backoff() {
    use axum::routing::get;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    let lists = Arc::new(Mutex::new(Vec::new()));
    let seen = lists.clone();
    let app = axum::Router::new().route(
        "/api/v1/services",
        get(move || {
            let seen = seen.clone();
            async move {
                seen.lock().expect("lock").push(tokio::time::Instant::now());
                "[\"not a list\"]"
            }
        }),
    );
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let client = kube::Client::try_from(kube::Config::new(
        format!("http://{addr}").parse().expect("url"),
    ))
    .expect("client");
    let policy = RetryPolicy {
        initial: Duration::from_millis(100),
        max: Duration::from_millis(800),
        reset_after: Duration::from_secs(60),
        jitter: false,
    };
    let source = ApiSource::new(client, "node-a").retry(policy);
    let (tx, _rx) = mpsc::channel(64);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(source.run(tx, shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    shutdown.cancel();
    let _ = timeout(WAIT, task).await;
    let times = lists.lock().expect("lock").clone();
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    // 100, 200, 400, 800, 800 ms: at most six lists in 2.5 s (twice a second with no backoff
    // would be ten or more), each gap at least as long as the one before.
    assert!(
        (3..=6).contains(&times.len()),
        "{} lists: {gaps:?}",
        times.len()
    );
    assert!(
        gaps.windows(2)
            .all(|w| w[1] + Duration::from_millis(50) >= w[0]),
        "{gaps:?}"
    );
    assert!(
        gaps.last()
            .is_some_and(|g| *g >= Duration::from_millis(350)),
        "{gaps:?}"
    );
}
