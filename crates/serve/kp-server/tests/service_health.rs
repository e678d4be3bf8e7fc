//! Per-service health-check node ports on the wire.

use crate::common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{Response, eventually, free_port, request};
use kp_core::health::{ProxyHealth, ServiceHealth, ServiceHealthMap};
use kp_core::model::ServiceName;
use kp_server::ServiceHealthServers;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn name(ns: &str, n: &str) -> ServiceName {
    ServiceName {
        namespace: ns.into(),
        name: n.into(),
    }
}

fn map(entries: &[(&ServiceName, u16, usize)]) -> ServiceHealthMap {
    entries
        .iter()
        .map(|(svc, port, local)| {
            (
                (*svc).clone(),
                ServiceHealth {
                    node_port: *port,
                    local_endpoints: *local,
                },
            )
        })
        .collect()
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::new(LOCALHOST, port)
}

struct Running {
    updates: watch::Sender<ServiceHealthMap>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

fn start(servers: ServiceHealthServers, initial: ServiceHealthMap) -> Running {
    let (updates, rx) = watch::channel(initial);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(servers.run(rx, shutdown.clone()));
    Running {
        updates,
        shutdown,
        task,
    }
}

fn servers(health: Arc<ProxyHealth>) -> ServiceHealthServers {
    ServiceHealthServers::new(vec![LOCALHOST], health)
        .with_retry_interval(Duration::from_secs(3600))
}

fn healthy() -> Arc<ProxyHealth> {
    Arc::new(ProxyHealth::new(Duration::from_secs(30)))
}

/// Waits until the port answers, with a response satisfying `want`.
async fn answered(port: u16, path: &str, want: impl Fn(&Response) -> bool) -> Response {
    eventually(&format!("a matching answer on port {port}"), || async {
        request(addr(port), "GET", path)
            .await
            .ok()
            .filter(|r| want(r))
    })
    .await
}

async fn closed(port: u16) {
    eventually(&format!("port {port} to close"), || async {
        TcpStream::connect(addr(port)).await.err()
    })
    .await;
}

#[tokio::test]
async fn local_endpoints_answer_200_with_weight_and_json() {
    let svc = name("shop", "web");
    let port = free_port().await;
    let run = start(servers(healthy()), map(&[(&svc, port, 2)]));

    let resp = answered(port, "/any/path?x=1", |_| true).await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-load-balancing-endpoint-weight"), Some("2"));
    assert_eq!(resp.header("content-type"), Some("application/json"));
    assert_eq!(resp.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(
        resp.json(),
        serde_json::json!({
            "service": { "namespace": "shop", "name": "web" },
            "localEndpoints": 2,
            "serviceProxyHealthy": true
        })
    );
    run.shutdown.cancel();
}

#[tokio::test]
async fn no_local_endpoints_is_503_until_one_appears() {
    let svc = name("shop", "web");
    let port = free_port().await;
    let run = start(servers(healthy()), map(&[(&svc, port, 0)]));

    let resp = answered(port, "/", |_| true).await;
    assert_eq!(resp.status, 503);
    assert_eq!(resp.header("x-load-balancing-endpoint-weight"), Some("0"));
    let body = resp.json();
    assert_eq!(body["localEndpoints"], 0);
    assert_eq!(body["serviceProxyHealthy"], true);

    // The count is read from the latest map: no relisten needed.
    run.updates.send_replace(map(&[(&svc, port, 1)]));
    let resp = answered(port, "/", |r| r.status == 200).await;
    assert_eq!(resp.header("x-load-balancing-endpoint-weight"), Some("1"));
    run.shutdown.cancel();
}

#[tokio::test]
async fn unhealthy_proxy_is_503_despite_local_endpoints() {
    let health = Arc::new(ProxyHealth::with_timeout(Duration::ZERO));
    health.queued_update();
    let svc = name("shop", "web");
    let port = free_port().await;
    let run = start(servers(health), map(&[(&svc, port, 3)]));

    let resp = answered(port, "/healthz", |_| true).await;
    assert_eq!(resp.status, 503);
    assert_eq!(resp.header("x-load-balancing-endpoint-weight"), Some("3"));
    assert_eq!(resp.json()["serviceProxyHealthy"], false);
    run.shutdown.cancel();
}

#[tokio::test]
async fn listeners_follow_the_published_services() {
    let (a, b) = (name("ns", "a"), name("ns", "b"));
    let (port_a, port_b, port_b2) = (free_port().await, free_port().await, free_port().await);
    let run = start(servers(healthy()), ServiceHealthMap::new());

    // Added when it appears.
    run.updates.send_replace(map(&[(&a, port_a, 1)]));
    let resp = answered(port_a, "/", |_| true).await;
    assert_eq!(resp.json()["service"]["name"], "a");

    run.updates
        .send_replace(map(&[(&a, port_a, 1), (&b, port_b, 1)]));
    assert_eq!(
        answered(port_b, "/", |_| true).await.json()["service"]["name"],
        "b"
    );

    // Closed when removed; the other service keeps serving.
    run.updates.send_replace(map(&[(&b, port_b, 1)]));
    closed(port_a).await;
    assert_eq!(
        request(addr(port_b), "GET", "/")
            .await
            .expect("b still served")
            .status,
        200
    );

    // A changed port moves the listener.
    run.updates.send_replace(map(&[(&b, port_b2, 1)]));
    closed(port_b).await;
    assert_eq!(
        answered(port_b2, "/", |_| true).await.json()["service"]["name"],
        "b"
    );
    run.shutdown.cancel();
}

#[tokio::test]
async fn port_in_use_is_retried_on_the_next_update_without_affecting_others() {
    let (a, b) = (name("ns", "a"), name("ns", "b"));
    let squatter = TcpListener::bind(addr(0)).await.expect("bind");
    let busy = squatter.local_addr().expect("addr").port();
    let port_b = free_port().await;
    let run = start(servers(healthy()), map(&[(&a, busy, 1), (&b, port_b, 1)]));

    assert_eq!(answered(port_b, "/", |_| true).await.status, 200);
    drop(squatter);
    // Same services, new endpoint count: the update triggers the retry.
    run.updates
        .send_replace(map(&[(&a, busy, 2), (&b, port_b, 1)]));
    let resp = answered(busy, "/", |_| true).await;
    assert_eq!(resp.json()["service"]["name"], "a");
    assert_eq!(resp.header("x-load-balancing-endpoint-weight"), Some("2"));
    run.shutdown.cancel();
}

#[tokio::test]
async fn port_in_use_is_retried_periodically() {
    let (a, b) = (name("ns", "a"), name("ns", "b"));
    let squatter = TcpListener::bind(addr(0)).await.expect("bind");
    let busy = squatter.local_addr().expect("addr").port();
    let port_b = free_port().await;
    let servers = ServiceHealthServers::new(vec![LOCALHOST], healthy())
        .with_retry_interval(Duration::from_millis(50));
    let run = start(servers, map(&[(&a, busy, 1), (&b, port_b, 1)]));

    // `b` answering means the first pass (which tried `a` first) has run and failed on `a`.
    answered(port_b, "/", |_| true).await;
    drop(squatter);
    // No update is sent: only the retry timer can open `a`.
    let resp = answered(busy, "/", |r| r.status == 200).await;
    assert_eq!(resp.json()["service"]["name"], "a");
    run.shutdown.cancel();
}

#[tokio::test]
async fn shutdown_closes_every_listener_and_ends_run() {
    let (a, b) = (name("ns", "a"), name("ns", "b"));
    let (port_a, port_b) = (free_port().await, free_port().await);
    let run = start(servers(healthy()), map(&[(&a, port_a, 1), (&b, port_b, 0)]));
    answered(port_a, "/", |_| true).await;
    answered(port_b, "/", |_| true).await;

    run.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(2), run.task)
        .await
        .expect("run ends promptly")
        .expect("no panic");
    assert!(TcpStream::connect(addr(port_a)).await.is_err());
    assert!(TcpStream::connect(addr(port_b)).await.is_err());
}

/// Serves one healthy service on `addresses` and checks it answers on 127.0.0.1 and [::1].
async fn answers_on_both_loopbacks(addresses: Vec<IpAddr>) {
    let svc = name("shop", "web");
    let port = free_port().await;
    let servers = ServiceHealthServers::new(addresses, healthy())
        .with_retry_interval(Duration::from_secs(3600));
    let run = start(servers, map(&[(&svc, port, 1)]));
    assert_eq!(answered(port, "/", |_| true).await.status, 200);
    let v6 = SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), port);
    let resp = eventually("an answer on [::1]", || async {
        request(v6, "GET", "/").await.ok()
    })
    .await;
    assert_eq!(resp.status, 200);
    run.shutdown.cancel();
}

#[tokio::test]
async fn an_ipv4_address_and_every_ipv6_address_listen_side_by_side() {
    // nodePortAddresses restricting IPv4 only: the node IP, plus `::` for unrestricted IPv6.
    // A dual-stack `::` socket would take the IPv4 port too and fail the IPv4 bind.
    answers_on_both_loopbacks(vec![LOCALHOST, IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)]).await;
}

#[tokio::test]
async fn unrestricted_listens_on_both_families() {
    // nodePortAddresses unset: every address of both families, as upstream's listener.
    answers_on_both_loopbacks(Vec::new()).await;
}
