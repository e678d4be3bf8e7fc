//! TCP frontends: accept, pick a backend (retrying the next endpoint when a connect is
//! refused or times out), then copy both ways until both sides are done.

use kp_core::report::ErrorChain as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::relay::Frontend;

/// After a failed `accept` (for example out of file descriptors) wait this long before the
/// next, so the loop does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(50);

/// Accepts on `listener` until `stop`; each connection gets its own task, which outlives
/// `stop`.
pub(crate) async fn serve(listener: TcpListener, frontend: Arc<Frontend>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((client, peer)) => {
                let Ok(permit) = frontend.budget.connections.clone().try_acquire_owned() else {
                    frontend.metrics.limit_hit(&frontend.budget.service, "tcp");
                    debug!(frontend = %frontend.label, %peer, "the service's connection cap is reached; resetting");
                    reset(client);
                    continue;
                };
                tokio::spawn(relay(frontend.clone(), client, peer, permit));
            }
            Err(error) => {
                warn!(frontend = %frontend.label, error = %error.chain(), "accept failed");
                tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
            }
        }
    }
}

/// Closes `stream` with a RST, so the client sees the failure at once rather than an
/// orderly end of an empty response.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// One client connection: connect to the first endpoint that answers, then copy.
async fn relay(
    frontend: Arc<Frontend>,
    mut client: TcpStream,
    peer: SocketAddr,
    _permit: OwnedSemaphorePermit,
) {
    let candidates = frontend.balancer().candidates(peer.ip(), Instant::now());
    if candidates.is_empty() {
        frontend.metrics.unserved("no_endpoints", "tcp");
        reset(client);
        return;
    }
    // Where the client reached us (the address the capture sent it to): the source of last
    // resort toward endpoints the kernel has no source address for.
    let local = client.local_addr().map(|a| a.ip()).ok();
    let Some((mut backend, endpoint)) = connect_any(&frontend, &candidates, local).await else {
        frontend.metrics.unserved("all_endpoints_failed", "tcp");
        warn!(frontend = %frontend.label, %peer, tried = candidates.len(), "no endpoint accepted the connection");
        reset(client);
        return;
    };
    frontend
        .balancer()
        .connected(peer.ip(), endpoint, Instant::now());
    if frontend.config.nodelay {
        let _ = client.set_nodelay(true);
        let _ = backend.set_nodelay(true);
    }
    frontend.metrics.open_connections.inc();
    let size = frontend.config.buffer_bytes;
    #[cfg(target_os = "linux")]
    let result = if frontend.config.splice {
        crate::splice::copy_bidirectional(client, backend, frontend.config.pipe_bytes).await
    } else {
        tokio::io::copy_bidirectional_with_sizes(&mut client, &mut backend, size, size).await
    };
    #[cfg(not(target_os = "linux"))]
    let result =
        tokio::io::copy_bidirectional_with_sizes(&mut client, &mut backend, size, size).await;
    frontend.metrics.open_connections.dec();
    if let Err(error) = result {
        debug!(frontend = %frontend.label, %peer, %endpoint, error = %error.chain(), "connection ended with an error");
    }
}

/// Connects to `endpoint`, from `local` when the kernel has no source address for it.
async fn connect(
    frontend: &Frontend,
    endpoint: SocketAddr,
    local: Option<IpAddr>,
) -> std::io::Result<TcpStream> {
    let Some(source) = local.and_then(|l| frontend.sources.source_for(endpoint.ip(), l)) else {
        return TcpStream::connect(endpoint).await;
    };
    let socket = if endpoint.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.bind(SocketAddr::new(source, 0))?;
    socket.connect(endpoint).await
}

/// Tries `candidates` in order, each once, with the doubling attempt timeout.
async fn connect_any(
    frontend: &Frontend,
    candidates: &[SocketAddr],
    local: Option<IpAddr>,
) -> Option<(TcpStream, SocketAddr)> {
    for (attempt, endpoint) in candidates.iter().enumerate() {
        let timeout = frontend.config.attempt_timeout(attempt);
        match tokio::time::timeout(timeout, connect(frontend, *endpoint, local)).await {
            Ok(Ok(stream)) => return Some((stream, *endpoint)),
            Ok(Err(error)) => {
                debug!(frontend = %frontend.label, %endpoint, error = %error.chain(), "connect failed; trying the next endpoint");
            }
            Err(_) => {
                debug!(frontend = %frontend.label, %endpoint, ?timeout, "connect timed out; trying the next endpoint");
            }
        }
        frontend.metrics.connect_failures.inc();
    }
    None
}
