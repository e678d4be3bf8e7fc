//! UDP frontends: datagrams from one client address form a session with one backend (a
//! connected socket of its own), whose replies go back through the frontend's socket. A
//! session ends after the idle timeout without traffic either way, when its backend
//! refuses (ICMP port unreachable), when its endpoint is removed, or when the frontend is.

use kp_core::report::ErrorChain as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::MAX_DATAGRAM;
use crate::relay::Frontend;

/// After a failed receive on the frontend socket wait this long, so the loop cannot spin.
const RECV_ERROR_PAUSE: Duration = Duration::from_millis(10);

/// A live session as the frontend keeps it.
#[derive(Debug)]
pub(crate) struct SessionEntry {
    id: u64,
    endpoint: SocketAddr,
    upstream: Arc<UdpSocket>,
    last_seen: Arc<Mutex<Instant>>,
    stop: CancellationToken,
}

fn touch(last_seen: &Mutex<Instant>) {
    *last_seen.lock().unwrap_or_else(PoisonError::into_inner) = Instant::now();
}

fn last(last_seen: &Mutex<Instant>) -> Instant {
    *last_seen.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Receives on `socket` until `stop`, then ends every session.
pub(crate) async fn serve(socket: UdpSocket, frontend: Arc<Frontend>, stop: CancellationToken) {
    let socket = Arc::new(socket);
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let mut next_id: u64 = 0;
    loop {
        let received = tokio::select! {
            () = stop.cancelled() => break,
            received = socket.recv_from(&mut buf) => received,
        };
        let (len, client) = match received {
            Ok(received) => received,
            Err(error) => {
                debug!(frontend = %frontend.label, error = %error.chain(), "receive failed");
                tokio::time::sleep(RECV_ERROR_PAUSE).await;
                continue;
            }
        };
        let existing = frontend.sessions().get(&client).map(|s| {
            touch(&s.last_seen);
            s.upstream.clone()
        });
        let upstream = match existing {
            Some(upstream) => upstream,
            None => {
                next_id += 1;
                match open_session(&frontend, &socket, client, next_id).await {
                    Some(upstream) => upstream,
                    None => continue,
                }
            }
        };
        if let Err(error) = upstream.send(&buf[..len]).await {
            debug!(frontend = %frontend.label, %client, error = %error.chain(), "forwarding a datagram failed");
        }
    }
    for (_, session) in frontend.sessions().drain() {
        session.stop.cancel();
    }
}

/// Starts a session for `client` with the endpoint the balancer picks; `None` (datagram
/// dropped) without endpoints, at the service's cap, or when no socket can be opened.
async fn open_session(
    frontend: &Arc<Frontend>,
    socket: &Arc<UdpSocket>,
    client: SocketAddr,
    id: u64,
) -> Option<Arc<UdpSocket>> {
    let Ok(permit) = frontend.budget.udp_sessions.clone().try_acquire_owned() else {
        frontend.metrics.limit_hit(&frontend.budget.service, "udp");
        debug!(frontend = %frontend.label, %client, "the service's UDP session cap is reached; dropping");
        return None;
    };
    let now = Instant::now();
    let candidates = frontend.balancer().candidates(client.ip(), now);
    let Some(&endpoint) = candidates.first() else {
        frontend.metrics.unserved("no_endpoints", "udp");
        return None;
    };
    let any = match endpoint.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    // From the frontend's own address when the kernel has no source for the endpoint (see
    // `crate::source`); a frontend on the wildcard address has none to offer.
    let from = socket
        .local_addr()
        .ok()
        .and_then(|l| frontend.sources.source_for(endpoint.ip(), l.ip()))
        .unwrap_or(any);
    let upstream = match UdpSocket::bind(SocketAddr::new(from, 0)).await {
        Ok(upstream) => upstream,
        Err(error) => {
            debug!(frontend = %frontend.label, error = %error.chain(), "cannot open a UDP socket");
            return None;
        }
    };
    if let Err(error) = upstream.connect(endpoint).await {
        debug!(frontend = %frontend.label, %endpoint, error = %error.chain(), "cannot connect a UDP socket");
        return None;
    }
    frontend.balancer().connected(client.ip(), endpoint, now);
    let upstream = Arc::new(upstream);
    let last_seen = Arc::new(Mutex::new(now));
    let stop = CancellationToken::new();
    frontend.sessions().insert(
        client,
        SessionEntry {
            id,
            endpoint,
            upstream: upstream.clone(),
            last_seen: last_seen.clone(),
            stop: stop.clone(),
        },
    );
    frontend.metrics.udp_sessions.inc();
    tokio::spawn(replies(
        frontend.clone(),
        socket.clone(),
        upstream.clone(),
        client,
        last_seen,
        stop,
        id,
        permit,
    ));
    Some(upstream)
}

/// Copies the backend's replies to `client` until the session ends, holding the session's
/// place in the service's budget until then.
#[allow(clippy::too_many_arguments)]
async fn replies(
    frontend: Arc<Frontend>,
    socket: Arc<UdpSocket>,
    upstream: Arc<UdpSocket>,
    client: SocketAddr,
    last_seen: Arc<Mutex<Instant>>,
    stop: CancellationToken,
    id: u64,
    _permit: OwnedSemaphorePermit,
) {
    let idle = frontend.config.udp_idle_timeout;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let deadline = last(&last_seen) + idle;
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep_until(deadline) => {
                if Instant::now() >= last(&last_seen) + idle {
                    break;
                }
            }
            received = upstream.recv(&mut buf) => match received {
                Ok(len) => {
                    touch(&last_seen);
                    if let Err(error) = socket.send_to(&buf[..len], client).await {
                        debug!(frontend = %frontend.label, %client, error = %error.chain(), "returning a reply failed");
                    }
                }
                Err(error) => {
                    // A connected UDP socket reports the backend's ICMP port unreachable here:
                    // end the session so the next datagram is balanced afresh.
                    debug!(frontend = %frontend.label, %client, error = %error.chain(), "backend unreachable; ending the session");
                    break;
                }
            },
        }
    }
    let mut sessions = frontend.sessions();
    if sessions.get(&client).is_some_and(|s| s.id == id) {
        sessions.remove(&client);
    }
    drop(sessions);
    frontend.metrics.udp_sessions.dec();
}

/// Ends the sessions whose endpoint is not in `endpoints`.
pub(crate) fn end_sessions_not_in(frontend: &Frontend, endpoints: &[SocketAddr]) {
    frontend.sessions().retain(|_, session| {
        let keep = endpoints.contains(&session.endpoint);
        if !keep {
            session.stop.cancel();
        }
        keep
    });
}
