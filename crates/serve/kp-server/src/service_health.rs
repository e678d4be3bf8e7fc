//! Health-check node ports of `externalTrafficPolicy: Local` services, as upstream's
//! `ServiceHealthServer`.
//!
//! Cloud load balancers probe `spec.healthCheckNodePort` on every node to find the nodes
//! that have local endpoints. For each service in the proxier's published
//! [`ServiceHealthMap`], [`ServiceHealthServers`] listens on that port on every configured
//! address and answers any path with 200 when the service has at least one local ready
//! endpoint and the proxy is healthy, else 503, with the local endpoint count in the
//! `X-Load-Balancing-Endpoint-Weight` header and a JSON body.
//!
//! Listeners are reconciled on every published map: services that disappear (or whose port
//! changes) are closed, new ones opened. A port that cannot be bound (usually in use by
//! another process) is logged and retried on the next update and every
//! [`DEFAULT_BIND_RETRY_INTERVAL`]; it never affects other services. Handlers read the
//! endpoint count from the latest map, so endpoint changes need no reconciliation.

use kp_core::report::ErrorChain as _;
use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::header::HeaderName;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use kp_core::health::{ProxyHealth, ServiceHealthMap};
use kp_core::model::ServiceName;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::{json_response, serve_router};

/// How often ports that could not be bound are retried without a new update. The proxier
/// publishes only on changes, so without this a port freed by another process would stay
/// unserved until some unrelated service changed; 5 s matches upstream's health server
/// bind retry.
pub const DEFAULT_BIND_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// The header load balancers (e.g. GCE) read as this node's weight for the service.
pub const ENDPOINT_WEIGHT_HEADER: HeaderName =
    HeaderName::from_static("x-load-balancing-endpoint-weight");

/// Why a service's health check could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServiceHealthError {
    /// Listening on one of the configured addresses failed, typically because the port is
    /// already in use. Addresses already bound for the service are released again, so a
    /// retry starts clean, as upstream does.
    #[error("cannot listen for health checks of service {service} on {addr}")]
    Bind {
        /// The service.
        service: ServiceName,
        /// The address that failed.
        addr: SocketAddr,
        /// The underlying error.
        source: io::Error,
    },
}

/// Reconciles one health-check listener set per service from the proxier's updates.
#[derive(Debug)]
pub struct ServiceHealthServers {
    addresses: Vec<IpAddr>,
    /// `addresses` is the dual-stack `[::]` (nodePortAddresses unrestricted).
    dual_stack: bool,
    health: Arc<ProxyHealth>,
    retry_interval: Duration,
}

/// The listeners of one service.
struct Running {
    port: u16,
    /// Cancelling stops all of the service's listeners.
    stop: CancellationToken,
}

#[derive(Clone)]
struct ServiceState {
    service: ServiceName,
    updates: watch::Receiver<ServiceHealthMap>,
    health: Arc<ProxyHealth>,
}

/// The JSON body, as upstream's.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ServiceBody<'a> {
    service: &'a ServiceName,
    local_endpoints: usize,
    service_proxy_healthy: bool,
}

impl ServiceHealthServers {
    /// Listens on `addresses`: the node IPs allowed by `nodePortAddresses`. An empty list
    /// means every address of both families: one dual-stack `[::]` socket, as Go's listener
    /// on `0.0.0.0` is upstream (`0.0.0.0` alone where the kernel has no IPv6). In a list,
    /// `::` stands for every IPv6 address and is bound IPv6-only, so it neither takes IPv4
    /// connections nor collides with the listed IPv4 addresses (a family nodePortAddresses
    /// does not restrict is unrestricted, as upstream).
    ///
    /// `health` is the proxy health: a service is only reported healthy while the proxy is
    /// (node eligibility is not considered, as upstream).
    pub fn new(addresses: Vec<IpAddr>, health: Arc<ProxyHealth>) -> Self {
        let dual_stack = addresses.is_empty();
        let addresses = if dual_stack {
            vec![IpAddr::V6(Ipv6Addr::UNSPECIFIED)]
        } else {
            addresses
        };
        Self {
            addresses,
            dual_stack,
            health,
            retry_interval: DEFAULT_BIND_RETRY_INTERVAL,
        }
    }

    /// Overrides [`DEFAULT_BIND_RETRY_INTERVAL`].
    pub fn with_retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = interval;
        self
    }

    /// Serves the services of `updates` until `shutdown` is cancelled, then waits for every
    /// listener to stop. If the sender goes away, the last published set keeps being served.
    pub async fn run(
        self,
        mut updates: watch::Receiver<ServiceHealthMap>,
        shutdown: CancellationToken,
    ) {
        let mut running: BTreeMap<ServiceName, Running> = BTreeMap::new();
        // Services whose port could not be bound, with that port: warned about once.
        let mut failed: BTreeMap<ServiceName, u16> = BTreeMap::new();
        let mut tasks = JoinSet::new();
        let mut updates_open = true;
        loop {
            let desired = updates.borrow_and_update().clone();
            self.reconcile(
                &desired,
                &updates,
                &mut running,
                &mut failed,
                &mut tasks,
                &shutdown,
            )
            .await;
            while tasks.try_join_next().is_some() {}
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = updates.changed(), if updates_open => {
                    if changed.is_err() {
                        tracing::debug!("service health updates ended; keeping the last set");
                        updates_open = false;
                    }
                }
                () = tokio::time::sleep(self.retry_interval), if !failed.is_empty() => {}
            }
        }
        // Every listener's token is a child of `shutdown`, so all are stopping.
        while tasks.join_next().await.is_some() {}
    }

    async fn reconcile(
        &self,
        desired: &ServiceHealthMap,
        updates: &watch::Receiver<ServiceHealthMap>,
        running: &mut BTreeMap<ServiceName, Running>,
        failed: &mut BTreeMap<ServiceName, u16>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) {
        running.retain(|service, run| {
            let keep = desired
                .get(service)
                .is_some_and(|want| want.node_port == run.port);
            if !keep {
                tracing::info!(%service, port = run.port, "closing service health check");
                run.stop.cancel();
            }
            keep
        });
        failed.retain(|service, port| {
            desired
                .get(service)
                .is_some_and(|want| want.node_port == *port)
        });

        for (service, want) in desired {
            if running.contains_key(service) {
                continue;
            }
            let port = want.node_port;
            if port == 0 {
                tracing::debug!(%service, "no health check node port; skipping");
                continue;
            }
            match self.open(service, port, updates, tasks, shutdown).await {
                Ok(stop) => {
                    tracing::info!(%service, port, "opened service health check");
                    failed.remove(service);
                    running.insert(service.clone(), Running { port, stop });
                }
                Err(error) => {
                    if failed.insert(service.clone(), port) == Some(port) {
                        tracing::debug!(error = %error.chain(), "service health check still not listening");
                    } else {
                        tracing::warn!(error = %error.chain(), "failed to start service health check; will retry");
                    }
                }
            }
        }
    }

    /// Binds every address first, so a failure leaves nothing half-open; then serves them.
    async fn open(
        &self,
        service: &ServiceName,
        port: u16,
        updates: &watch::Receiver<ServiceHealthMap>,
        tasks: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) -> Result<CancellationToken, ServiceHealthError> {
        let mut listeners = Vec::with_capacity(self.addresses.len());
        for ip in &self.addresses {
            let addr = SocketAddr::new(*ip, port);
            let listener =
                bind(addr, self.dual_stack).map_err(|source| ServiceHealthError::Bind {
                    service: service.clone(),
                    addr,
                    source,
                })?;
            listeners.push(listener);
        }
        let state = ServiceState {
            service: service.clone(),
            updates: updates.clone(),
            health: self.health.clone(),
        };
        let router = Router::new().fallback(service_health).with_state(state);
        let stop = shutdown.child_token();
        for listener in listeners {
            let (router, stop, service) = (router.clone(), stop.clone(), service.clone());
            tasks.spawn(async move {
                if let Err(error) = serve_router("service health", listener, router, stop).await {
                    tracing::error!(%service, error = %error.chain(), "service health check stopped");
                }
            });
        }
        Ok(stop)
    }
}

/// Binds `addr` as tokio's `TcpListener::bind` does (address reuse, so a restart does not
/// wait for TIME_WAIT); IPv6 sockets IPv6-only unless `dual_stack`. A dual-stack `[::]` the
/// kernel cannot open (no IPv6) becomes `0.0.0.0`.
fn bind(addr: SocketAddr, dual_stack: bool) -> io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    /// The backlog tokio uses.
    const BACKLOG: i32 = 1024;
    let socket = match Socket::new(Domain::for_address(addr), Type::STREAM, None) {
        Err(_) if dual_stack => {
            let v4 = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), addr.port());
            return bind(v4, false);
        }
        other => other?,
    };
    if addr.is_ipv6() {
        socket.set_only_v6(!dual_stack)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)?;
    TcpListener::from_std(socket.into())
}

async fn service_health(State(state): State<ServiceState>) -> Response {
    let local_endpoints = state
        .updates
        .borrow()
        .get(&state.service)
        .map_or(0, |s| s.local_endpoints);
    let proxy_healthy = state.health.snapshot().healthy;
    let status = if local_endpoints > 0 && proxy_healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = ServiceBody {
        service: &state.service,
        local_endpoints,
        service_proxy_healthy: proxy_healthy,
    };
    let mut response = json_response(status, &body);
    response
        .headers_mut()
        .insert(ENDPOINT_WEIGHT_HEADER, HeaderValue::from(local_endpoints));
    response
}
