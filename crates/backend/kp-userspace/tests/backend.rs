//! Userspace mode's backend with a fake capture and frontends on 127.0.0.1: what it tells the
//! capture (targets, partial sets), and that the frontends it opens relay to the right
//! endpoints by traffic policy.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};

use kp_core::backend::{ApplyError, Backend, SyncKind, SyncRequest};
use kp_core::model::{Endpoint, IpFamily, Protocol, ServiceName, ServicePort, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_userspace::backend::BindAddresses;
use kp_userspace::capture::{CapturedPort, Target};
use kp_userspace::{FakeCapture, FrontendKey, RelayConfig, RelayMetrics, Scope, UserspaceBackend};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpStream};

use kp_core::testutil::{cluster_ip_port, endpoint_at, node_with, port_name, state_on};

fn name(svc: &str) -> ServicePortName {
    port_name("ns", svc, "p", Protocol::Tcp)
}

fn service(svc: &str, cluster_ip: &str) -> ServicePort {
    cluster_ip_port(name(svc), cluster_ip, 80)
}

/// A ready endpoint at `addr`, on this node when `local`.
fn endpoint(addr: SocketAddr, local: bool) -> Endpoint {
    endpoint_at(addr.ip(), addr.port(), local)
}

/// A state on this node (192.168.0.2) holding `items`.
fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    state_on(node_with(&["192.168.0.2"]), items)
}

/// A TCP backend greeting each connection with `name`.
async fn greeter(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(format!("{name}\n").as_bytes()).await;
        }
    });
    addr
}

async fn greeted_by(port: u16) -> String {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the frontend");
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .await
        .expect("greeting");
    line.trim().to_owned()
}

fn backend(capture: FakeCapture) -> UserspaceBackend<FakeCapture> {
    backend_with(RelayConfig::default(), RelayMetrics::default(), capture)
}

fn backend_with(
    config: RelayConfig,
    metrics: RelayMetrics,
    capture: FakeCapture,
) -> UserspaceBackend<FakeCapture> {
    UserspaceBackend::new(config, metrics, capture, vec![IpFamily::V4, IpFamily::V6])
        .with_bind_addresses(BindAddresses {
            v4: "127.0.0.1".parse().expect("literal"),
            v6: "::1".parse().expect("literal"),
        })
}

async fn sync(
    backend: &mut UserspaceBackend<FakeCapture>,
    state: &ProxyState,
    kind: SyncKind,
    changed: &[&str],
) {
    let changed: BTreeSet<ServiceName> = changed.iter().map(|s| name(s).service).collect();
    backend
        .sync(&SyncRequest {
            state,
            kind,
            changed: &changed,
            conntrack_cleanup_required: false,
        })
        .await
        .expect("sync");
}

fn captured(capture: &FakeCapture, svc: &str) -> CapturedPort {
    let applies = capture.applies();
    let last = applies.last().expect("an apply");
    last.plan.families[&IpFamily::V4]
        .iter()
        .find(|p| p.name == name(svc))
        .cloned()
        .expect("captured port")
}

fn redirect_port(target: Target) -> u16 {
    match target {
        Target::Redirect(port) => port,
        other => panic!("expected a redirect, got {other:?}"),
    }
}

#[tokio::test]
async fn frontends_follow_the_traffic_policies() {
    let local = greeter("local").await;
    let remote = greeter("remote").await;
    let mut svc = service("web", "10.96.0.10");
    svc.node_port = Some(30080);
    svc.external_policy_local = true;
    let endpoints = vec![endpoint(local, true), endpoint(remote, false)];
    let capture = FakeCapture::new();
    let mut b = backend(capture.clone());
    sync(&mut b, &state(vec![(svc, endpoints)]), SyncKind::Full, &[]).await;

    let port = captured(&capture, "web");
    assert_eq!(port.node_port, Some(30080));
    // ClusterIP traffic: both endpoints, round robin.
    let internal = redirect_port(port.internal);
    let mut seen = BTreeSet::new();
    for _ in 0..4 {
        seen.insert(greeted_by(internal).await);
    }
    assert_eq!(seen, ["local", "remote"].map(String::from).into());
    // NodePort traffic with eTP Local: only the local endpoint.
    let external = redirect_port(port.external);
    for _ in 0..4 {
        assert_eq!(greeted_by(external).await, "local");
    }
    assert_eq!(b.relay().keys().count(), 2);
}

#[tokio::test]
async fn without_endpoints_traffic_is_rejected_or_dropped_and_no_frontend_opens() {
    let remote = greeter("remote").await;
    let empty = service("empty", "10.96.0.11");
    let mut local_only = service("local", "10.96.0.12");
    local_only.load_balancer_ips = vec!["198.51.100.1".parse().expect("literal")];
    local_only.external_policy_local = true;
    let capture = FakeCapture::new();
    let mut b = backend(capture.clone());
    let s = state(vec![
        (empty, vec![]),
        (local_only, vec![endpoint(remote, false)]),
    ]);
    sync(&mut b, &s, SyncKind::Full, &[]).await;
    let empty = captured(&capture, "empty");
    assert_eq!(empty.internal, Target::Reject);
    let local = captured(&capture, "local");
    assert!(matches!(local.internal, Target::Redirect(_)));
    assert_eq!(
        local.external,
        Target::Drop,
        "eTP Local without a local endpoint"
    );
    let keys: Vec<FrontendKey> = b.relay().keys().cloned().collect();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(keys[0].scope, Scope::Internal);
}

#[tokio::test]
async fn partial_syncs_name_changed_reopened_and_deleted_ports() {
    let a = greeter("a").await;
    let capture = FakeCapture::new();
    let mut b = backend(capture.clone());
    let one = state(vec![
        (service("keep", "10.96.0.20"), vec![endpoint(a, true)]),
        (service("gone", "10.96.0.21"), vec![endpoint(a, true)]),
        (service("later", "10.96.0.22"), vec![]),
    ]);
    sync(&mut b, &one, SyncKind::Full, &[]).await;
    assert_eq!(capture.applies()[0].changed, None, "the first sync is full");
    let keep_port = redirect_port(captured(&capture, "keep").internal);

    // `gone` is deleted, `later` gets an endpoint (a frontend opens).
    let two = state(vec![
        (service("keep", "10.96.0.20"), vec![endpoint(a, true)]),
        (service("later", "10.96.0.22"), vec![endpoint(a, true)]),
    ]);
    sync(&mut b, &two, SyncKind::Partial, &["gone", "later"]).await;
    let last = capture.applies().pop().expect("apply");
    let changed = last.changed.expect("partial");
    assert_eq!(changed, [name("gone"), name("later")].into());
    assert_eq!(
        redirect_port(captured(&capture, "keep").internal),
        keep_port,
        "an unchanged frontend keeps its port"
    );
    assert_eq!(
        greeted_by(redirect_port(captured(&capture, "later").internal)).await,
        "a"
    );
    assert_eq!(b.relay().keys().count(), 2, "gone's frontend closed");
}

#[tokio::test]
async fn a_failed_capture_fails_the_sync_and_reports_say_what_ran() {
    let a = greeter("a").await;
    let capture = FakeCapture::new();
    let mut b = backend(capture.clone());
    let s = state(vec![(
        service("web", "10.96.0.30"),
        vec![endpoint(a, true)],
    )]);
    let changed: BTreeSet<ServiceName> = [name("web").service].into();
    let request = |kind| SyncRequest {
        state: &s,
        kind,
        changed: &changed,
        conntrack_cleanup_required: false,
    };
    let report = b.sync(&request(SyncKind::Full)).await.expect("sync");
    assert_eq!(report.kind, SyncKind::Full);
    let report = b.sync(&request(SyncKind::Partial)).await.expect("sync");
    assert_eq!(report.kind, SyncKind::Partial);
    capture.fail_next(1);
    let failed = b.sync(&request(SyncKind::Partial)).await;
    let err = failed.expect_err("the capture failed");
    assert!(
        matches!(err.apply(), Some(ApplyError::Capture { what, .. }) if what == "userspace capture"),
        "{err:?}"
    );
    // The core asks for a full sync next: the capture is asked to rewrite everything.
    let report = b.sync(&request(SyncKind::Full)).await.expect("sync");
    assert_eq!(report.kind, SyncKind::Full);
    assert_eq!(capture.applies().pop().expect("apply").changed, None);
}

#[tokio::test]
async fn dual_stack_services_get_a_frontend_per_family() {
    let v4 = greeter("v4").await;
    let listener = TcpListener::bind("[::1]:0").await.expect("bind ::1");
    let v6 = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(b"v6\n").await;
        }
    });
    let mut svc = service("dual", "10.96.0.40");
    svc.cluster_ips
        .push("fd00:96::40".parse::<IpAddr>().expect("literal"));
    let capture = FakeCapture::new();
    let mut b = backend(capture.clone());
    let s = state(vec![(svc, vec![endpoint(v4, true), endpoint(v6, true)])]);
    sync(&mut b, &s, SyncKind::Full, &[]).await;
    let plan = capture.applies().pop().expect("apply").plan;
    let v6_port = &plan.families[&IpFamily::V6][0];
    assert_eq!(
        v6_port.cluster_ip,
        "fd00:96::40".parse::<IpAddr>().expect("literal")
    );
    let port = redirect_port(v6_port.internal);
    let stream = TcpStream::connect(("::1", port)).await.expect("connect");
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .await
        .expect("greeting");
    assert_eq!(
        line.trim(),
        "v6",
        "an IPv6 frontend relays to IPv6 endpoints only"
    );
    assert_eq!(
        greeted_by(redirect_port(captured(&capture, "dual").internal)).await,
        "v4"
    );
}

/// Connects to `port` on loopback; `Some(greeting)` if a backend answered, `None` if the
/// relay closed the connection first. The stream stays open (holding its place in the
/// service's budget) until dropped.
async fn try_greeting(port: u16) -> (Option<String>, BufReader<TcpStream>) {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the frontend");
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let read = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        reader.read_line(&mut line),
    )
    .await
    .expect("an answer in time");
    let greeting = matches!(read, Ok(n) if n > 0).then(|| line.trim().to_owned());
    (greeting, reader)
}

#[tokio::test]
async fn a_service_s_internal_and_external_frontends_share_its_connection_cap() {
    let a = greeter("a").await;
    let mut web = service("web", "10.96.0.50");
    web.node_port = Some(30050);
    let capture = FakeCapture::new();
    let metrics = RelayMetrics::default();
    let mut b = backend_with(
        RelayConfig::default().with_max_connections(1),
        metrics.clone(),
        capture.clone(),
    );
    let s = state(vec![
        (web, vec![endpoint(a, true)]),
        (service("api", "10.96.0.51"), vec![endpoint(a, true)]),
    ]);
    sync(&mut b, &s, SyncKind::Full, &[]).await;
    let web = captured(&capture, "web");
    let (internal, external) = (redirect_port(web.internal), redirect_port(web.external));
    assert_ne!(internal, external, "two frontends");
    let (greeting, _held) = try_greeting(internal).await;
    assert_eq!(greeting.as_deref(), Some("a"));
    // The NodePort frontend is a different listener of the same service: no place left.
    let (greeting, _) = try_greeting(external).await;
    assert_eq!(greeting, None, "over ns/web's cap");
    let label = |service: &str| kp_userspace::metrics::ServiceLabel {
        service: service.into(),
        protocol: "tcp",
    };
    assert_eq!(
        metrics
            .limit_rejections
            .get_or_create(&label("ns/web"))
            .get(),
        1
    );
    // Another service is not affected.
    let api = redirect_port(captured(&capture, "api").internal);
    let (greeting, _also_held) = try_greeting(api).await;
    assert_eq!(greeting.as_deref(), Some("a"));
    assert_eq!(
        metrics
            .limit_rejections
            .get_or_create(&label("ns/api"))
            .get(),
        0
    );
}

#[tokio::test]
async fn with_a_port_range_frontends_listen_inside_it() {
    let a = greeter("a").await;
    // A port the kernel just handed out is free; holding it makes the range full.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = holder.local_addr().expect("address").port();
    let capture = FakeCapture::new();
    let config = RelayConfig::default().with_port_range(Some(port..=port));
    let mut b = backend_with(config, RelayMetrics::default(), capture.clone());
    let s = state(vec![(
        service("web", "10.96.0.60"),
        vec![endpoint(a, true)],
    )]);
    let changed = BTreeSet::new();
    let request = SyncRequest {
        state: &s,
        kind: SyncKind::Full,
        changed: &changed,
        conntrack_cleanup_required: false,
    };
    let report = b.sync(&request).await.expect("sync");
    assert_eq!(
        report.skipped,
        [name("web").service],
        "no free port: skipped"
    );
    assert_eq!(b.relay().keys().count(), 0);
    drop(holder);
    let report = b.sync(&request).await.expect("sync");
    assert!(report.skipped.is_empty(), "{report:?}");
    let web = redirect_port(captured(&capture, "web").internal);
    assert_eq!(web, port, "the range's only port");
    assert_eq!(greeted_by(web).await, "a");
}

/// What the capture is told about the node's own traffic: under eTP Local with iTP Cluster
/// it is internal; a node IP (192.168.0.2 in the test state) inside the source ranges admits
/// the LB IPs as sources. Without a local node address nothing is DNATed (REDIRECT).
#[tokio::test]
async fn node_traffic_flags_and_no_relay_address_without_a_local_node_address() {
    let up = greeter("up").await;
    let mut local = service("local", "10.96.0.20");
    local.external_policy_local = true;
    local.node_port = Some(30020);
    let mut both_local = service("both", "10.96.0.21");
    both_local.external_policy_local = true;
    both_local.internal_policy_local = true;
    both_local.node_port = Some(30021);
    let mut ranged = service("ranged", "10.96.0.22");
    ranged.load_balancer_ips = vec!["198.51.100.22".parse().expect("literal")];
    ranged.load_balancer_source_ranges = vec!["192.168.0.0/24".parse().expect("literal")];
    let mut elsewhere = ranged.clone();
    elsewhere.name = name("elsewhere");
    elsewhere.cluster_ips = vec!["10.96.0.23".parse().expect("literal")];
    elsewhere.load_balancer_source_ranges = vec!["203.0.113.0/24".parse().expect("literal")];
    let eps = || vec![endpoint(up, true)];
    let mut st = state(vec![
        (local, eps()),
        (both_local, eps()),
        (ranged, eps()),
        (elsewhere, eps()),
    ]);
    // Not this machine's addresses (the loopback one never serves as the relay's).
    st.node.addresses = vec![
        "192.168.0.2".parse().expect("literal"),
        "127.0.0.1".parse().expect("literal"),
    ];
    let capture = FakeCapture::new();
    let mut b = UserspaceBackend::new(
        RelayConfig::default(),
        RelayMetrics::default(),
        capture.clone(),
        vec![IpFamily::V4],
    );
    sync(&mut b, &st, SyncKind::Full, &[]).await;
    assert!(captured(&capture, "local").local_source_internal);
    assert!(!captured(&capture, "both").local_source_internal);
    assert!(captured(&capture, "ranged").allow_from_node);
    assert!(!captured(&capture, "elsewhere").allow_from_node);
    let applies = capture.applies();
    let plan = &applies.last().expect("an apply").plan;
    if std::net::UdpSocket::bind("192.168.0.2:0").is_err() {
        assert!(
            plan.relay_addresses.is_empty(),
            "{:?}",
            plan.relay_addresses
        );
    }
}
