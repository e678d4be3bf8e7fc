//! The relay with real sockets on 127.0.0.1: balancing, affinity, retries past dead
//! endpoints, UDP sessions and their expiry, caps, and graceful endpoint removal. Nothing
//! here asserts on time: waits are bounded polls for an outcome.

use std::net::SocketAddr;
use std::time::Duration;

use kp_userspace::{Owner, Relay, RelayConfig, RelayMetrics};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};

/// How long a test waits for something that happens in milliseconds.
const PATIENCE: Duration = Duration::from_secs(10);

const LOOPBACK: &str = "127.0.0.1:0";

/// A TCP backend that greets every connection with `name\n`, then echoes.
async fn tcp_backend(name: &'static str) -> SocketAddr {
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind backend");
    let addr = listener.local_addr().expect("backend address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                if stream
                    .write_all(format!("{name}\n").as_bytes())
                    .await
                    .is_err()
                {
                    return;
                }
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// A UDP backend that answers every datagram with `name:payload`.
async fn udp_backend(name: &'static str) -> SocketAddr {
    let socket = UdpSocket::bind(LOOPBACK).await.expect("bind backend");
    let addr = socket.local_addr().expect("backend address");
    tokio::spawn(async move {
        let mut buf = vec![0u8; 2048];
        while let Ok((len, peer)) = socket.recv_from(&mut buf).await {
            let reply = format!("{name}:{}", String::from_utf8_lossy(&buf[..len]));
            let _ = socket.send_to(reply.as_bytes(), peer).await;
        }
    });
    addr
}

/// A port nothing listens on (bound, then released): connects to it are refused.
async fn dead_port() -> SocketAddr {
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind");
    listener.local_addr().expect("address")
}

/// A frontend of `service` whose key names its service port.
fn owner<'a>(service: &'a str, key: &'a str) -> Owner<'a> {
    Owner {
        service,
        service_port: key,
    }
}

/// A relay with one TCP frontend `svc` over `endpoints`.
async fn tcp_relay(
    config: RelayConfig,
    endpoints: Vec<SocketAddr>,
    affinity: Option<Duration>,
) -> (Relay<&'static str>, SocketAddr, RelayMetrics) {
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(config, metrics.clone());
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
    let front = relay
        .add_tcp("svc", owner("ns/svc", "svc"), listener)
        .expect("add frontend");
    assert!(relay.update(&"svc", endpoints, affinity));
    (relay, front, metrics)
}

/// Connects through the relay and reads the greeting: which backend answered.
async fn greeted_by(front: SocketAddr) -> (String, BufReader<TcpStream>) {
    let stream = tokio::time::timeout(PATIENCE, TcpStream::connect(front))
        .await
        .expect("connect in time")
        .expect("connect to the frontend");
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    tokio::time::timeout(PATIENCE, reader.read_line(&mut line))
        .await
        .expect("greeting in time")
        .expect("read the greeting");
    (line.trim().to_owned(), reader)
}

/// Sends `text` on an open connection and reads it back.
async fn echo(conn: &mut BufReader<TcpStream>, text: &str) -> String {
    conn.get_mut()
        .write_all(format!("{text}\n").as_bytes())
        .await
        .expect("write");
    let mut line = String::new();
    tokio::time::timeout(PATIENCE, conn.read_line(&mut line))
        .await
        .expect("echo in time")
        .expect("read echo");
    line.trim().to_owned()
}

/// Whether the relay closed `conn` without data (reset or EOF), within [`PATIENCE`].
async fn closed_without_data(mut stream: TcpStream) -> bool {
    let mut buf = [0u8; 16];
    match tokio::time::timeout(PATIENCE, stream.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) | Err(_) => false,
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} did not happen within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn round_robin_over_every_endpoint() {
    let endpoints = vec![
        tcp_backend("a").await,
        tcp_backend("b").await,
        tcp_backend("c").await,
    ];
    let (_relay, front, _) = tcp_relay(RelayConfig::default(), endpoints, None).await;
    let mut seen = Vec::new();
    for _ in 0..6 {
        let (who, mut conn) = greeted_by(front).await;
        assert_eq!(
            echo(&mut conn, "ping").await,
            "ping",
            "data flows both ways"
        );
        seen.push(who);
    }
    assert_eq!(seen, ["a", "b", "c", "a", "b", "c"]);
}

#[tokio::test]
async fn client_ip_affinity_pins_a_client() {
    let endpoints = vec![tcp_backend("a").await, tcp_backend("b").await];
    let (_relay, front, _) = tcp_relay(
        RelayConfig::default(),
        endpoints,
        Some(Duration::from_secs(60)),
    )
    .await;
    let mut seen = Vec::new();
    for _ in 0..8 {
        seen.push(greeted_by(front).await.0);
    }
    assert!(
        seen.iter().all(|w| *w == seen[0]),
        "one client, one endpoint: {seen:?}"
    );
}

/// Two frontends of one service port (its ClusterIP and its NodePort, say) and a TCP and a
/// UDP one: the pin made through one holds through the other of the same service port, the
/// metrics count it per endpoint, and a lookup (what `/debug/explain` shows) finds it.
#[tokio::test]
async fn frontends_of_one_service_port_share_client_ip_affinity() {
    let endpoints = vec![
        tcp_backend("a").await,
        tcp_backend("b").await,
        tcp_backend("c").await,
    ];
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(RelayConfig::default(), metrics.clone());
    let affinity = Some(Duration::from_secs(60));
    let mut fronts = Vec::new();
    for key in ["internal", "external"] {
        let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
        let owner = Owner {
            service: "ns/web",
            service_port: "ns/web:http/tcp",
        };
        fronts.push(relay.add_tcp(key, owner, listener).expect("add frontend"));
        assert!(relay.update(&key, endpoints.clone(), affinity));
    }
    relay.forget_stale_pins();
    // Another client moves the external frontend's round robin on, so that only a shared
    // pin can keep 127.0.0.1 there on the endpoint it got through the internal one.
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.2:0".parse().expect("literal"))
        .expect("bind another loopback address");
    let other = socket.connect(fronts[1]).await.expect("connect");
    let mut line = String::new();
    BufReader::new(other)
        .read_line(&mut line)
        .await
        .expect("greeting");
    let (first, _) = greeted_by(fronts[0]).await;
    assert_eq!(
        line.trim(),
        first,
        "both round robins started at the first endpoint"
    );
    for _ in 0..4 {
        assert_eq!(
            greeted_by(fronts[1]).await.0,
            first,
            "pin held across frontends"
        );
        assert_eq!(greeted_by(fronts[0]).await.0, first);
    }
    let pinned = endpoints[["a", "b", "c"]
        .iter()
        .position(|n| *n == first)
        .expect("a known backend")];
    match metrics
        .affinity
        .lookup("ns/web:http/tcp", "127.0.0.1".parse().expect("literal"))
    {
        kp_userspace::PinLookup::Pinned { endpoint, .. } => assert_eq!(endpoint, pinned),
        other => panic!("expected a pin, got {other:?}"),
    }
    assert_eq!(
        metrics
            .affinity
            .lookup("ns/other:http/tcp", "127.0.0.1".parse().expect("literal")),
        kp_userspace::PinLookup::NoAffinity
    );
    let mut registry = prometheus_client::registry::Registry::default();
    let registered = RelayMetrics::register(&mut registry);
    let mut relay2 = Relay::new(RelayConfig::default(), registered);
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
    let owner = Owner {
        service: "ns/web",
        service_port: "ns/web:http/tcp",
    };
    let front = relay2
        .add_tcp("one", owner, listener)
        .expect("add frontend");
    assert!(relay2.update(&"one", vec![pinned], affinity));
    assert_eq!(greeted_by(front).await.0, first);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    let series = format!(
        "kube_proxy_rs_userspace_affinity_clients{{service_port=\"ns/web:http/tcp\",endpoint=\"{pinned}\"}} 1"
    );
    assert!(text.contains(&series), "{series} in:\n{text}");

    // The endpoint leaves every frontend of the service port: the pin goes.
    for key in ["internal", "external"] {
        let rest: Vec<SocketAddr> = endpoints.iter().copied().filter(|e| *e != pinned).collect();
        assert!(relay.update(&key, rest, affinity));
    }
    relay.forget_stale_pins();
    assert!(matches!(
        metrics
            .affinity
            .lookup("ns/web:http/tcp", "127.0.0.1".parse().expect("literal")),
        kp_userspace::PinLookup::Unpinned { .. }
    ));
}

#[tokio::test]
async fn a_refused_connect_moves_on_to_the_next_endpoint() {
    let dead = dead_port().await;
    let endpoints = vec![dead, tcp_backend("live").await, dead];
    let (_relay, front, metrics) = tcp_relay(RelayConfig::default(), endpoints, None).await;
    // Whichever endpoint round robin starts at, every client reaches the live one.
    for _ in 0..6 {
        assert_eq!(greeted_by(front).await.0, "live");
    }
    assert!(metrics.connect_failures.get() >= 4, "refusals are counted");
}

#[tokio::test]
async fn a_timed_out_connect_moves_on_to_the_next_endpoint() {
    // A listener that never accepts, with its accept queue full: further SYNs are dropped,
    // so a connect to it times out rather than being refused.
    let socket = TcpSocket::new_v4().expect("socket");
    socket
        .bind(LOOPBACK.parse().expect("literal"))
        .expect("bind");
    let stuck = socket.listen(0).expect("listen");
    let stuck_addr = stuck.local_addr().expect("address");
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(stuck_addr)).await
        {
            fillers.push(s);
        }
    }
    let blocked = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(stuck_addr))
        .await
        .is_err();
    assert!(
        blocked,
        "precondition: connects to a listener with a full accept queue must hang"
    );
    let config = RelayConfig::default().with_connect_timeout(Duration::from_millis(100));
    let endpoints = vec![stuck_addr, tcp_backend("live").await];
    let (_relay, front, metrics) = tcp_relay(config, endpoints, None).await;
    for _ in 0..2 {
        assert_eq!(greeted_by(front).await.0, "live");
    }
    assert!(metrics.connect_failures.get() >= 1);
    drop(fillers);
}

#[tokio::test]
async fn every_endpoint_dead_or_none_resets_the_client() {
    let (mut relay, front, metrics) =
        tcp_relay(RelayConfig::default(), vec![dead_port().await], None).await;
    let stream = TcpStream::connect(front)
        .await
        .expect("the frontend accepts");
    assert!(closed_without_data(stream).await);
    relay.update(&"svc", Vec::new(), None);
    let stream = TcpStream::connect(front)
        .await
        .expect("the frontend accepts");
    assert!(closed_without_data(stream).await);
    let text = encode(&metrics);
    assert!(
        text.contains("kube_proxy_rs_userspace_unserved_total{reason=\"all_endpoints_failed\",protocol=\"tcp\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(
            "kube_proxy_rs_userspace_unserved_total{reason=\"no_endpoints\",protocol=\"tcp\"} 1"
        ),
        "{text}"
    );
}

/// The relay's `unserved` family as Prometheus text.
fn encode(metrics: &RelayMetrics) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register(
        "kube_proxy_rs_userspace_unserved",
        "",
        metrics.unserved.clone(),
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    text
}

#[tokio::test]
async fn the_connection_cap_resets_extra_clients_and_counts_them() {
    let config = RelayConfig::default().with_max_connections(2);
    let (_relay, front, metrics) = tcp_relay(config, vec![tcp_backend("a").await], None).await;
    let (_, mut first) = greeted_by(front).await;
    let (_, second) = greeted_by(front).await;
    let third = TcpStream::connect(front).await.expect("the kernel accepts");
    assert!(closed_without_data(third).await, "over the cap: reset");
    assert_eq!(rejections(&metrics, "ns/svc", "tcp"), 1);
    assert_eq!(echo(&mut first, "still-here").await, "still-here");
    // A closed connection frees its place.
    drop(second);
    eventually("the second connection's slot to free up", || {
        metrics.open_connections.get() == 1
    })
    .await;
    let (who, _) = greeted_by(front).await;
    assert_eq!(who, "a");
}

fn rejections(metrics: &RelayMetrics, service: &str, protocol: &'static str) -> u64 {
    metrics
        .limit_rejections
        .get_or_create(&kp_userspace::metrics::ServiceLabel {
            service: service.into(),
            protocol,
        })
        .get()
}

/// Frontends `web-80` and `web-443` of service `ns/web`, `other` of `ns/other`, all TCP
/// over `endpoint`.
async fn two_services(
    config: RelayConfig,
    endpoint: SocketAddr,
) -> (Relay<&'static str>, [SocketAddr; 3], RelayMetrics) {
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(config, metrics.clone());
    let mut fronts = Vec::new();
    for (key, service) in [
        ("web-80", "ns/web"),
        ("web-443", "ns/web"),
        ("other", "ns/other"),
    ] {
        let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
        fronts.push(
            relay
                .add_tcp(key, owner(service, key), listener)
                .expect("add frontend"),
        );
        assert!(relay.update(&key, vec![endpoint], None));
    }
    (relay, [fronts[0], fronts[1], fronts[2]], metrics)
}

#[tokio::test]
async fn the_connection_cap_is_one_budget_per_service_across_its_ports() {
    let config = RelayConfig::default().with_max_connections(2);
    let (_relay, [web80, web443, other], metrics) =
        two_services(config, tcp_backend("a").await).await;
    // One connection on each port of ns/web uses up its budget of two...
    let (_, mut first) = greeted_by(web80).await;
    let (_, _second) = greeted_by(web443).await;
    for front in [web80, web443] {
        let extra = TcpStream::connect(front).await.expect("the kernel accepts");
        assert!(closed_without_data(extra).await, "over ns/web's cap: reset");
    }
    assert_eq!(rejections(&metrics, "ns/web", "tcp"), 2);
    // ...while another service has a budget of its own.
    let (_, _third) = greeted_by(other).await;
    let (_, _fourth) = greeted_by(other).await;
    assert_eq!(rejections(&metrics, "ns/other", "tcp"), 0);
    assert_eq!(echo(&mut first, "still-here").await, "still-here");
    // Closing a connection on one port frees a place for the other.
    drop(first);
    eventually("ns/web's slot to free up", || {
        metrics.open_connections.get() == 3
    })
    .await;
    let (who, _) = greeted_by(web443).await;
    assert_eq!(who, "a");
    assert_eq!(rejections(&metrics, "ns/web", "tcp"), 2);
}

#[tokio::test]
async fn a_service_coming_back_counts_its_draining_connections() {
    let config = RelayConfig::default().with_max_connections(1);
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(config, metrics.clone());
    let a = tcp_backend("a").await;
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
    let old = relay
        .add_tcp("web-80", owner("ns/web", "web-80"), listener)
        .expect("add");
    relay.update(&"web-80", vec![a], None);
    let (_, mut draining) = greeted_by(old).await;
    // The service's last frontend goes and comes back while the connection lasts.
    relay.remove(&"web-80");
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind frontend");
    let new = relay
        .add_tcp("web-80", owner("ns/web", "web-80"), listener)
        .expect("add");
    relay.update(&"web-80", vec![a], None);
    let extra = TcpStream::connect(new).await.expect("the kernel accepts");
    assert!(
        closed_without_data(extra).await,
        "the draining one holds the place"
    );
    assert_eq!(rejections(&metrics, "ns/web", "tcp"), 1);
    assert_eq!(echo(&mut draining, "still-here").await, "still-here");
}

#[tokio::test]
async fn removed_endpoints_keep_their_connections_and_get_no_new_ones() {
    let a = tcp_backend("a").await;
    let b = tcp_backend("b").await;
    let (mut relay, front, _) = tcp_relay(RelayConfig::default(), vec![a], None).await;
    let (who, mut old) = greeted_by(front).await;
    assert_eq!(who, "a");
    relay.update(&"svc", vec![b], None);
    assert_eq!(echo(&mut old, "after-update").await, "after-update");
    for _ in 0..3 {
        assert_eq!(greeted_by(front).await.0, "b");
    }
    // Removing the whole frontend stops new connections, not the established one.
    relay.remove(&"svc");
    assert_eq!(echo(&mut old, "after-remove").await, "after-remove");
    eventually("the listener to close", || {
        std::net::TcpStream::connect_timeout(&front, Duration::from_secs(1)).is_err()
    })
    .await;
}

/// A relay with one UDP frontend over `endpoints`.
async fn udp_relay(
    config: RelayConfig,
    endpoints: Vec<SocketAddr>,
) -> (Relay<&'static str>, SocketAddr, RelayMetrics) {
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(config, metrics.clone());
    let socket = UdpSocket::bind(LOOPBACK).await.expect("bind frontend");
    let front = relay
        .add_udp("dns", owner("ns/dns", "dns"), socket)
        .expect("add frontend");
    relay.update(&"dns", endpoints, None);
    (relay, front, metrics)
}

/// A client socket connected to the frontend.
async fn udp_client(front: SocketAddr) -> UdpSocket {
    let socket = UdpSocket::bind(LOOPBACK).await.expect("bind client");
    socket.connect(front).await.expect("connect client");
    socket
}

/// Sends `payload` and waits for the reply (`name:payload`); `None` if none came within
/// `wait`.
async fn ask(socket: &UdpSocket, payload: &str, wait: Duration) -> Option<String> {
    socket.send(payload.as_bytes()).await.expect("send");
    let mut buf = [0u8; 2048];
    match tokio::time::timeout(wait, socket.recv(&mut buf)).await {
        Ok(Ok(len)) => Some(String::from_utf8_lossy(&buf[..len]).into_owned()),
        _ => None,
    }
}

#[tokio::test]
async fn udp_sessions_stick_per_client_and_spread_across_clients() {
    let endpoints = vec![udp_backend("a").await, udp_backend("b").await];
    let config = RelayConfig::default().with_udp_idle_timeout(Duration::from_secs(30));
    let (relay, front, metrics) = udp_relay(config, endpoints).await;
    let one = udp_client(front).await;
    let two = udp_client(front).await;
    let first = ask(&one, "q1", PATIENCE).await.expect("reply");
    let backend = first.split(':').next().expect("name").to_owned();
    for i in 0..5 {
        let reply = ask(&one, &format!("again{i}"), PATIENCE)
            .await
            .expect("reply");
        assert_eq!(
            reply,
            format!("{backend}:again{i}"),
            "same session, same backend"
        );
    }
    let other = ask(&two, "q2", PATIENCE).await.expect("reply");
    assert!(
        !other.starts_with(&format!("{backend}:")),
        "the next client goes to the next endpoint: {other}"
    );
    assert_eq!(relay.udp_sessions(&"dns"), 2);
    assert_eq!(metrics.udp_sessions.get(), 2);
}

#[tokio::test]
async fn idle_udp_sessions_expire() {
    let endpoints = vec![udp_backend("a").await, udp_backend("b").await];
    let config = RelayConfig::default().with_udp_idle_timeout(Duration::from_millis(50));
    let (relay, front, metrics) = udp_relay(config, endpoints).await;
    let client = udp_client(front).await;
    let first = ask(&client, "x", PATIENCE).await.expect("reply");
    eventually("the idle session to end", || {
        relay.udp_sessions(&"dns") == 0
    })
    .await;
    eventually("the gauge to drop", || metrics.udp_sessions.get() == 0).await;
    // A new session from the same client address is balanced afresh: the other endpoint.
    let second = ask(&client, "x", PATIENCE).await.expect("reply");
    assert_ne!(first, second, "a new session after expiry");
}

#[tokio::test]
async fn udp_sessions_to_a_removed_endpoint_end_at_once() {
    let a = udp_backend("a").await;
    let b = udp_backend("b").await;
    let config = RelayConfig::default().with_udp_idle_timeout(Duration::from_secs(30));
    let (mut relay, front, _) = udp_relay(config, vec![a]).await;
    let client = udp_client(front).await;
    assert_eq!(ask(&client, "1", PATIENCE).await.as_deref(), Some("a:1"));
    relay.update(&"dns", vec![b], None);
    assert_eq!(ask(&client, "2", PATIENCE).await.as_deref(), Some("b:2"));
}

#[tokio::test]
async fn the_udp_session_cap_drops_new_clients_and_counts_them() {
    let config = RelayConfig::default()
        .with_udp_idle_timeout(Duration::from_secs(30))
        .with_max_udp_sessions(1);
    let (relay, front, metrics) = udp_relay(config, vec![udp_backend("a").await]).await;
    let one = udp_client(front).await;
    let two = udp_client(front).await;
    assert_eq!(ask(&one, "1", PATIENCE).await.as_deref(), Some("a:1"));
    two.send(b"2").await.expect("send");
    let label = kp_userspace::metrics::ServiceLabel {
        service: "ns/dns".into(),
        protocol: "udp",
    };
    eventually("the cap to bite", || {
        metrics.limit_rejections.get_or_create(&label).get() == 1
    })
    .await;
    assert_eq!(relay.udp_sessions(&"dns"), 1);
    // The session inside the cap keeps working.
    assert_eq!(ask(&one, "3", PATIENCE).await.as_deref(), Some("a:3"));
}

#[tokio::test]
async fn the_udp_session_cap_is_one_budget_per_service_across_its_ports() {
    let config = RelayConfig::default()
        .with_udp_idle_timeout(Duration::from_secs(30))
        .with_max_udp_sessions(1);
    let metrics = RelayMetrics::default();
    let mut relay = Relay::new(config, metrics.clone());
    let a = udp_backend("a").await;
    let mut fronts = Vec::new();
    for (key, service) in [
        ("dns-53", "ns/dns"),
        ("dns-5353", "ns/dns"),
        ("ntp", "ns/ntp"),
    ] {
        let socket = UdpSocket::bind(LOOPBACK).await.expect("bind frontend");
        fronts.push(
            relay
                .add_udp(key, owner(service, key), socket)
                .expect("add frontend"),
        );
        relay.update(&key, vec![a], None);
    }
    let one = udp_client(fronts[0]).await;
    assert_eq!(ask(&one, "1", PATIENCE).await.as_deref(), Some("a:1"));
    // ns/dns's only session is taken: its other port drops new clients...
    let two = udp_client(fronts[1]).await;
    two.send(b"2").await.expect("send");
    eventually("ns/dns's cap to bite on its second port", || {
        rejections(&metrics, "ns/dns", "udp") == 1
    })
    .await;
    assert_eq!(relay.udp_sessions(&"dns-5353"), 0);
    // ...while ns/ntp has a session of its own.
    let three = udp_client(fronts[2]).await;
    assert_eq!(ask(&three, "3", PATIENCE).await.as_deref(), Some("a:3"));
    assert_eq!(rejections(&metrics, "ns/ntp", "udp"), 0);
    assert_eq!(ask(&one, "4", PATIENCE).await.as_deref(), Some("a:4"));
}

#[tokio::test]
async fn a_udp_backend_that_refuses_ends_its_session() {
    // Bound and released: datagrams to it draw ICMP port unreachable.
    let dead = UdpSocket::bind(LOOPBACK)
        .await
        .expect("bind")
        .local_addr()
        .expect("address");
    let live = udp_backend("live").await;
    let config = RelayConfig::default().with_udp_idle_timeout(Duration::from_secs(30));
    let (relay, front, _) = udp_relay(config, vec![dead, live]).await;
    let client = udp_client(front).await;
    // The first session goes to the dead endpoint; its refusal ends the session, and a
    // retry from the same client is balanced onto the live one.
    let mut reply = None;
    for _ in 0..20 {
        reply = ask(&client, "q", Duration::from_millis(200)).await;
        if reply.is_some() {
            break;
        }
    }
    assert_eq!(reply.as_deref(), Some("live:q"));
    assert_eq!(relay.udp_sessions(&"dns"), 1);
}

/// A TCP backend that echoes everything and closes after the client's end of stream.
async fn echo_backend() -> SocketAddr {
    let listener = TcpListener::bind(LOOPBACK).await.expect("bind backend");
    let addr = listener.local_addr().expect("backend address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = stream.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

/// Sends `len` patterned bytes through the relay, half-closes, and reads the echo to the end.
async fn round_trip(config: RelayConfig, len: usize) {
    let (_relay, front, _) = tcp_relay(config, vec![echo_backend().await], None).await;
    let stream = TcpStream::connect(front).await.expect("connect");
    let (mut r, mut w) = stream.into_split();
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        w.write_all(&sent).await.expect("write");
        w.shutdown().await.expect("half-close");
    });
    let mut echoed = Vec::with_capacity(len);
    tokio::time::timeout(PATIENCE, r.read_to_end(&mut echoed))
        .await
        .expect("the echo ends in time")
        .expect("read the echo");
    writer.await.expect("writer");
    assert_eq!(echoed.len(), payload.len());
    assert!(echoed == payload, "the bytes came back changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_and_half_close_with_splice() {
    round_trip(RelayConfig::default().with_splice(true), 8 << 20).await;
    // The kernel's default pipe size, and a pipe smaller than a segment.
    round_trip(
        RelayConfig::default()
            .with_splice(true)
            .with_pipe_bytes(64 << 10),
        1 << 20,
    )
    .await;
    round_trip(
        RelayConfig::default()
            .with_splice(true)
            .with_pipe_bytes(100),
        100_000,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transfers_and_half_close_with_buffers() {
    round_trip(RelayConfig::default().with_splice(false), 8 << 20).await;
}
