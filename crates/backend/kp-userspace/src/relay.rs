//! The relay: frontends (one listening socket each) keyed by the caller's key, their
//! endpoints and affinity, and the tasks that serve them.
//!
//! A frontend is added with a socket the caller bound (so tests use `127.0.0.1:0` and the
//! backend picks addresses), updated with new endpoints at any time, and removed when its
//! service goes away. Removing a frontend or an endpoint never cuts an established TCP
//! connection: each connection is its own task and ends when either side closes. UDP has no
//! such notion: sessions to a removed endpoint end at once (as kernel modes delete the
//! conntrack entries), so the next datagram goes to a current endpoint.
//!
//! Caps are per service, not per frontend: every frontend added with the same service name
//! (its ports, families and scopes) draws on one `Budget` of TCP connections and one of UDP
//! sessions, so a service cannot multiply its share of the node by having more ports.
//! ClientIP affinity is per service port: frontends added with the same service port share
//! one table of pins (see [`crate::balancer`]).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::Hash;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::balancer::{Balancer, lock};
use crate::config::RelayConfig;
use crate::metrics::RelayMetrics;
use crate::{tcp, udp};

/// What a frontend relays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// TCP: a listener; each accepted connection is copied to one backend connection.
    Tcp,
    /// UDP: one socket; datagrams are relayed per client session.
    Udp,
}

impl Transport {
    /// `tcp` or `udp`, as in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Udp => "udp",
        }
    }
}

/// Whose a frontend is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner<'a> {
    /// The service (`namespace/name`): its frontends share one budget of connections and
    /// sessions, and it labels the limit metric.
    pub service: &'a str,
    /// The service port (`namespace/name:port/protocol`): its frontends share one ClientIP
    /// affinity table, and it labels the affinity metric.
    pub service_port: &'a str,
}

/// One service's caps, shared by all of its frontends. A connection or session holds a
/// permit for its whole life, so the budget counts what is open, wherever it came in.
#[derive(Debug)]
pub(crate) struct Budget {
    /// The service (`namespace/name`): the limit metric's label.
    pub(crate) service: String,
    /// Permits for open TCP connections.
    pub(crate) connections: Arc<Semaphore>,
    /// Permits for live UDP sessions.
    pub(crate) udp_sessions: Arc<Semaphore>,
}

impl Budget {
    fn new(service: &str, config: &RelayConfig) -> Self {
        let permits = |n: usize| Arc::new(Semaphore::new(n.min(Semaphore::MAX_PERMITS)));
        Self {
            service: service.to_owned(),
            connections: permits(config.max_connections),
            udp_sessions: permits(config.max_udp_sessions),
        }
    }
}

/// What every task of one frontend shares.
#[derive(Debug)]
pub(crate) struct Frontend {
    /// The frontend's name in logs.
    pub(crate) label: String,
    pub(crate) balancer: Mutex<Balancer>,
    pub(crate) config: RelayConfig,
    pub(crate) metrics: RelayMetrics,
    /// The service's caps (shared with its other frontends).
    pub(crate) budget: Arc<Budget>,
    /// Live UDP sessions by client address (empty for TCP).
    pub(crate) sessions: Mutex<HashMap<SocketAddr, udp::SessionEntry>>,
    /// The service port (its affinity table's name).
    service_port: String,
    /// Which endpoints the relay must connect to from an explicit source.
    pub(crate) sources: crate::source::SourceCache,
}

impl Frontend {
    pub(crate) fn balancer(&self) -> MutexGuard<'_, Balancer> {
        self.balancer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn sessions(&self) -> MutexGuard<'_, HashMap<SocketAddr, udp::SessionEntry>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One frontend as the relay keeps it.
#[derive(Debug)]
struct Entry {
    shared: Arc<Frontend>,
    transport: Transport,
    local: SocketAddr,
    stop: CancellationToken,
}

/// A set of frontends. Must be used inside a tokio runtime (it spawns the serving tasks).
/// Dropping the relay stops every frontend's listener; established connections finish.
#[derive(Debug)]
pub struct Relay<K> {
    config: RelayConfig,
    metrics: RelayMetrics,
    frontends: HashMap<K, Entry>,
    /// Budgets by service. Weak: a budget lives while a frontend or a connection or session
    /// of the service does (each holds its frontend), so a service that comes back while old
    /// connections drain still counts them.
    budgets: HashMap<String, Weak<Budget>>,
    /// Service ports whose frontends' endpoints changed since the last
    /// [`Relay::forget_stale_pins`].
    changed_ports: HashSet<String>,
}

impl<K> Relay<K>
where
    K: Clone + Eq + Hash + fmt::Display,
{
    /// An empty relay.
    pub fn new(config: RelayConfig, metrics: RelayMetrics) -> Self {
        Self {
            config,
            metrics,
            frontends: HashMap::new(),
            budgets: HashMap::new(),
            changed_ports: HashSet::new(),
        }
    }

    /// Serves `listener` as TCP frontend `key` of `owner` (replacing any frontend of that
    /// key) and returns its local address. It has no endpoints until [`Relay::update`]; its
    /// connections count against the service's cap.
    pub fn add_tcp(
        &mut self,
        key: K,
        owner: Owner<'_>,
        listener: TcpListener,
    ) -> std::io::Result<SocketAddr> {
        let local = listener.local_addr()?;
        let (shared, stop) = self.insert(key, owner, Transport::Tcp, local);
        tokio::spawn(tcp::serve(listener, shared, stop));
        Ok(local)
    }

    /// Serves `socket` as UDP frontend `key` of `owner` (replacing any frontend of that
    /// key) and returns its local address; its sessions count against the service's cap.
    pub fn add_udp(
        &mut self,
        key: K,
        owner: Owner<'_>,
        socket: UdpSocket,
    ) -> std::io::Result<SocketAddr> {
        let local = socket.local_addr()?;
        let (shared, stop) = self.insert(key, owner, Transport::Udp, local);
        tokio::spawn(udp::serve(socket, shared, stop));
        Ok(local)
    }

    /// `service`'s budget: the live one, or a new one.
    fn budget(&mut self, service: &str) -> Arc<Budget> {
        if let Some(budget) = self.budgets.get(service).and_then(Weak::upgrade) {
            return budget;
        }
        self.budgets.retain(|_, b| b.strong_count() > 0);
        let budget = Arc::new(Budget::new(service, &self.config));
        self.budgets
            .insert(service.to_owned(), Arc::downgrade(&budget));
        budget
    }

    fn insert(
        &mut self,
        key: K,
        owner: Owner<'_>,
        transport: Transport,
        local: SocketAddr,
    ) -> (Arc<Frontend>, CancellationToken) {
        let affinity = self.metrics.affinity.table(owner.service_port);
        let shared = Arc::new(Frontend {
            label: key.to_string(),
            balancer: Mutex::new(Balancer::sharing(affinity)),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            budget: self.budget(owner.service),
            sessions: Mutex::new(HashMap::new()),
            service_port: owner.service_port.to_owned(),
            sources: crate::source::SourceCache::default(),
        });
        let stop = CancellationToken::new();
        let entry = Entry {
            shared: shared.clone(),
            transport,
            local,
            stop: stop.clone(),
        };
        if let Some(old) = self.frontends.insert(key, entry) {
            old.stop.cancel();
        }
        (shared, stop)
    }

    /// Sets frontend `key`'s endpoints and its service port's ClientIP affinity timeout. New
    /// connections use them at once; established TCP connections are left alone; UDP
    /// sessions whose endpoint is gone end. Returns false if there is no such frontend.
    /// Pins to endpoints gone from every frontend of the service port go at the next
    /// [`Relay::forget_stale_pins`].
    pub fn update(
        &mut self,
        key: &K,
        endpoints: Vec<SocketAddr>,
        affinity: Option<Duration>,
    ) -> bool {
        let Some(entry) = self.frontends.get(key) else {
            return false;
        };
        {
            let mut balancer = entry.shared.balancer();
            if balancer.endpoints() != endpoints.as_slice() {
                balancer.set_endpoints(endpoints.clone());
                entry.shared.sources.retain(&endpoints);
                self.changed_ports.insert(entry.shared.service_port.clone());
            }
            balancer.set_affinity(affinity);
        }
        if entry.transport == Transport::Udp {
            udp::end_sessions_not_in(&entry.shared, &endpoints);
        }
        true
    }

    /// Drops the pins to endpoints that no frontend of their service port has any more (for
    /// the service ports whose endpoints changed since the last call): their clients are
    /// balanced again, as upstream. Call after a round of [`Relay::update`]s.
    pub fn forget_stale_pins(&mut self) {
        if self.changed_ports.is_empty() {
            return;
        }
        let mut endpoints: HashMap<&str, HashSet<SocketAddr>> = self
            .changed_ports
            .iter()
            .map(|p| (p.as_str(), HashSet::new()))
            .collect();
        let mut tables = HashMap::new();
        for entry in self.frontends.values() {
            let port = entry.shared.service_port.as_str();
            if let Some(set) = endpoints.get_mut(port) {
                let balancer = entry.shared.balancer();
                set.extend(balancer.endpoints().iter().copied());
                tables.insert(port, balancer.affinity().clone());
            }
        }
        for (port, table) in tables {
            if let Some(set) = endpoints.get(port) {
                lock(&table).retain_endpoints(set);
            }
        }
        self.changed_ports.clear();
    }

    /// Stops frontend `key` from taking new clients. Established TCP connections finish;
    /// UDP sessions end (their replies went through the frontend's socket). Returns false if
    /// there was no such frontend.
    pub fn remove(&mut self, key: &K) -> bool {
        match self.frontends.remove(key) {
            Some(entry) => {
                entry.stop.cancel();
                true
            }
            None => false,
        }
    }

    /// The service ports' ClientIP affinity tables (shared with the metrics).
    pub fn affinity(&self) -> &crate::pins::AffinityTables {
        &self.metrics.affinity
    }

    /// The configuration the relay was made with.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The local address of frontend `key`.
    pub fn local_addr(&self, key: &K) -> Option<SocketAddr> {
        self.frontends.get(key).map(|e| e.local)
    }

    /// The frontends' keys.
    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.frontends.keys()
    }

    /// The current endpoints of frontend `key`.
    pub fn endpoints(&self, key: &K) -> Option<Vec<SocketAddr>> {
        self.frontends
            .get(key)
            .map(|e| e.shared.balancer().endpoints().to_vec())
    }

    /// The number of live UDP sessions of frontend `key`.
    pub fn udp_sessions(&self, key: &K) -> usize {
        self.frontends
            .get(key)
            .map_or(0, |e| e.shared.sessions().len())
    }
}

impl<K> Drop for Relay<K> {
    fn drop(&mut self) {
        for entry in self.frontends.values() {
            entry.stop.cancel();
        }
    }
}
