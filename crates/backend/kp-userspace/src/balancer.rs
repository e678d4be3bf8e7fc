//! Endpoint choice for one frontend, without I/O: round robin over the frontend's endpoints,
//! with sessionAffinity ClientIP pinning a client to the endpoint it last reached until the
//! pin has been unused for the affinity timeout.
//!
//! Pins live in an [`Affinity`] table of the service port, shared by all of its frontends
//! (ClusterIP, NodePort, externalIPs and LB IPs, of both families), as upstream's userspace
//! proxier keeps one table per service port: a client pinned through the ClusterIP stays on
//! that endpoint through the NodePort. A frontend honours a pin only to one of its own
//! endpoints (an external frontend under `externalTrafficPolicy: Local` has only the local
//! ones); otherwise it balances and the client is pinned to the new endpoint.
//!
//! The caller passes the time in (`tokio::time::Instant`), so tests drive it with paused time.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// Stale pins are swept once the map has grown to this many entries (and then whenever it
/// doubles), so memory stays bounded by the clients seen within one timeout.
const MIN_SWEEP_AT: usize = 1024;

/// One service port's ClientIP affinity: its timeout and the clients' pins.
#[derive(Debug)]
pub struct Affinity {
    timeout: Option<Duration>,
    pins: HashMap<IpAddr, Pin>,
    sweep_at: usize,
}

/// A service port's [`Affinity`] as its frontends share it.
pub type SharedAffinity = Arc<Mutex<Affinity>>;

/// Locks a shared table (a panic elsewhere never leaves it half-updated).
pub(crate) fn lock(affinity: &SharedAffinity) -> MutexGuard<'_, Affinity> {
    affinity.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where one client goes, and when it last went there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    /// The endpoint.
    pub endpoint: SocketAddr,
    /// When the client last reached it.
    pub last_used: Instant,
}

impl Default for Affinity {
    fn default() -> Self {
        Self::new()
    }
}

impl Affinity {
    /// Affinity off, no pins.
    pub fn new() -> Self {
        Self {
            timeout: None,
            pins: HashMap::new(),
            sweep_at: MIN_SWEEP_AT,
        }
    }

    /// Turns ClientIP affinity on (with its timeout) or off (dropping every pin).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        if timeout.is_none() {
            self.pins.clear();
        }
        self.timeout = timeout;
    }

    /// The timeout, if affinity is on.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// `client`'s pin if it is live at `now` (used within the timeout). Expired pins are
    /// not returned (they go at the next sweep or use).
    pub fn live_pin(&self, client: IpAddr, now: Instant) -> Option<Pin> {
        let timeout = self.timeout?;
        let pin = self.pins.get(&client.to_canonical())?;
        (now.saturating_duration_since(pin.last_used) <= timeout).then_some(*pin)
    }

    /// Like [`Affinity::live_pin`], removing `client`'s pin if it has expired.
    fn take_live_pin(&mut self, client: IpAddr, now: Instant) -> Option<Pin> {
        let live = self.live_pin(client, now);
        if live.is_none() && self.timeout.is_some() {
            self.pins.remove(&client.to_canonical());
        }
        live
    }

    /// Every live pin at `now`.
    pub fn live_pins(&self, now: Instant) -> impl Iterator<Item = (IpAddr, Pin)> + '_ {
        let timeout = self.timeout;
        self.pins.iter().filter_map(move |(client, pin)| {
            let live = now.saturating_duration_since(pin.last_used) <= timeout?;
            live.then_some((*client, *pin))
        })
    }

    /// Records that `client` reached `endpoint`: with affinity on, the client is pinned to
    /// it (or its pin refreshed).
    pub fn connected(&mut self, client: IpAddr, endpoint: SocketAddr, now: Instant) {
        let Some(timeout) = self.timeout else {
            return;
        };
        self.pins.insert(
            client.to_canonical(),
            Pin {
                endpoint,
                last_used: now,
            },
        );
        if self.pins.len() >= self.sweep_at {
            self.pins
                .retain(|_, pin| now.saturating_duration_since(pin.last_used) <= timeout);
            self.sweep_at = (self.pins.len() * 2).max(MIN_SWEEP_AT);
        }
    }

    /// Drops the pins to endpoints not in `endpoints` (every endpoint any frontend of the
    /// service port still has): their clients are balanced again, as upstream.
    pub fn retain_endpoints(&mut self, endpoints: &HashSet<SocketAddr>) {
        self.pins.retain(|_, pin| endpoints.contains(&pin.endpoint));
    }

    /// Number of clients pinned (live or not yet swept).
    pub fn pinned_clients(&self) -> usize {
        self.pins.len()
    }
}

/// Round robin over one frontend's endpoints, with its service port's [`Affinity`].
#[derive(Debug)]
pub struct Balancer {
    endpoints: Vec<SocketAddr>,
    next: usize,
    affinity: SharedAffinity,
}

impl Default for Balancer {
    fn default() -> Self {
        Self::new()
    }
}

impl Balancer {
    /// No endpoints, an affinity table of its own (off).
    pub fn new() -> Self {
        Self::sharing(SharedAffinity::default())
    }

    /// No endpoints, pinning clients in `affinity` (shared with other balancers).
    pub fn sharing(affinity: SharedAffinity) -> Self {
        Self {
            endpoints: Vec::new(),
            next: 0,
            affinity,
        }
    }

    /// The affinity table this balancer pins clients in.
    pub fn affinity(&self) -> &SharedAffinity {
        &self.affinity
    }

    /// The current endpoints, in the order round robin walks them.
    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    /// Replaces the endpoints. Pins are not touched here (other frontends of the service
    /// port may still have their endpoints; see [`Affinity::retain_endpoints`]); a pin to an
    /// endpoint this frontend no longer has is simply not honoured by it.
    pub fn set_endpoints(&mut self, endpoints: Vec<SocketAddr>) {
        self.next = if endpoints.is_empty() {
            0
        } else {
            self.next % endpoints.len()
        };
        self.endpoints = endpoints;
    }

    /// Turns ClientIP affinity on (with its timeout) or off (dropping every pin) for the
    /// whole service port.
    pub fn set_affinity(&mut self, timeout: Option<Duration>) {
        let mut affinity = lock(&self.affinity);
        if affinity.timeout() != timeout {
            affinity.set_timeout(timeout);
        }
    }

    /// The endpoints to try for a new connection from `client`, best first: the pinned
    /// endpoint if the client has a live pin to one of this frontend's endpoints, then the
    /// others in round robin order. Advances round robin unless a pin decided. Empty when
    /// there are no endpoints.
    pub fn candidates(&mut self, client: IpAddr, now: Instant) -> Vec<SocketAddr> {
        let count = self.endpoints.len();
        if count == 0 {
            return Vec::new();
        }
        let pinned = lock(&self.affinity)
            .take_live_pin(client, now)
            .map(|pin| pin.endpoint)
            .filter(|endpoint| self.endpoints.contains(endpoint));
        let start = self.next;
        if pinned.is_none() {
            self.next = (self.next + 1) % count;
        }
        let rotation = self.endpoints[start..]
            .iter()
            .chain(&self.endpoints[..start])
            .copied();
        match pinned {
            Some(first) => std::iter::once(first)
                .chain(rotation.filter(|e| *e != first))
                .collect(),
            None => rotation.collect(),
        }
    }

    /// Records that `client` reached `endpoint` (see [`Affinity::connected`]).
    pub fn connected(&mut self, client: IpAddr, endpoint: SocketAddr, now: Instant) {
        lock(&self.affinity).connected(client, endpoint, now);
    }

    /// Number of clients pinned in the service port's table (live or not yet swept).
    pub fn pinned_clients(&self) -> usize {
        lock(&self.affinity).pinned_clients()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(last: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, last], 80))
    }

    fn client(last: u8) -> IpAddr {
        IpAddr::from([192, 168, 0, last])
    }

    #[test]
    fn round_robin_walks_every_endpoint_in_turn() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1), addr(2), addr(3)]);
        let now = Instant::now();
        let firsts: Vec<SocketAddr> = (0..6).map(|_| b.candidates(client(1), now)[0]).collect();
        assert_eq!(
            firsts,
            vec![addr(1), addr(2), addr(3), addr(1), addr(2), addr(3)]
        );
        // Every candidate list holds each endpoint once, so a retry can reach all of them.
        let mut all = b.candidates(client(1), now);
        all.sort();
        assert_eq!(all, vec![addr(1), addr(2), addr(3)]);
    }

    #[test]
    fn no_endpoints_no_candidates() {
        let mut b = Balancer::new();
        assert!(b.candidates(client(1), Instant::now()).is_empty());
        b.set_endpoints(vec![addr(1)]);
        b.set_endpoints(Vec::new());
        assert!(b.candidates(client(1), Instant::now()).is_empty());
    }

    #[test]
    fn affinity_pins_until_the_timeout_passes_unused() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1), addr(2), addr(3)]);
        b.set_affinity(Some(Duration::from_secs(10)));
        let t0 = Instant::now();
        let first = b.candidates(client(1), t0)[0];
        b.connected(client(1), first, t0);
        // Other clients move round robin on; client 1 stays.
        for step in 1..=9u64 {
            let now = t0 + Duration::from_secs(step);
            let _ = b.candidates(client(2), now);
            assert_eq!(b.candidates(client(1), now)[0], first, "step {step}");
            b.connected(client(1), first, now);
        }
        // Unused for longer than the timeout: balanced again (and the pin is gone).
        let later = t0 + Duration::from_secs(9 + 11);
        let _ = b.candidates(client(1), later);
        assert_eq!(b.pinned_clients(), 0);
    }

    #[test]
    fn a_pin_to_a_removed_endpoint_is_dropped() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1), addr(2)]);
        b.set_affinity(Some(Duration::from_secs(60)));
        let now = Instant::now();
        b.connected(client(1), addr(2), now);
        assert_eq!(b.candidates(client(1), now)[0], addr(2));
        b.set_endpoints(vec![addr(1), addr(3)]);
        // Not honoured by a frontend without that endpoint ...
        assert_ne!(b.candidates(client(1), now)[0], addr(2));
        // ... and gone once no frontend of the service port has it.
        lock(b.affinity()).retain_endpoints(&[addr(1), addr(3)].into());
        assert_eq!(b.pinned_clients(), 0);
    }

    #[test]
    fn frontends_of_one_service_port_share_the_pins() {
        let shared = SharedAffinity::default();
        let mut internal = Balancer::sharing(shared.clone());
        let mut external = Balancer::sharing(shared.clone());
        internal.set_endpoints(vec![addr(1), addr(2), addr(3)]);
        external.set_endpoints(vec![addr(1), addr(2), addr(3)]);
        internal.set_affinity(Some(Duration::from_secs(60)));
        external.set_affinity(Some(Duration::from_secs(60)));
        let now = Instant::now();
        // Move the external frontend's round robin away from the internal one's.
        let _ = external.candidates(client(9), now);
        let first = internal.candidates(client(1), now)[0];
        internal.connected(client(1), first, now);
        for _ in 0..3 {
            assert_eq!(external.candidates(client(1), now)[0], first);
        }
        // A frontend whose endpoints lack the pinned one (eTP Local) balances among its own
        // and re-pins the client; the other frontend then follows the new pin.
        let mut local = Balancer::sharing(shared);
        local.set_endpoints(
            [addr(1), addr(2), addr(3)]
                .into_iter()
                .filter(|e| *e != first)
                .collect(),
        );
        let moved = local.candidates(client(1), now)[0];
        assert_ne!(moved, first);
        local.connected(client(1), moved, now);
        assert_eq!(internal.candidates(client(1), now)[0], moved);
    }

    #[test]
    fn ipv4_mapped_clients_share_the_pin_of_their_ipv4_address() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1), addr(2)]);
        b.set_affinity(Some(Duration::from_secs(60)));
        let now = Instant::now();
        b.connected(client(7), addr(2), now);
        let mapped: IpAddr = "::ffff:192.168.0.7".parse().expect("literal");
        assert_eq!(b.candidates(mapped, now)[0], addr(2));
    }

    #[test]
    fn turning_affinity_off_forgets_pins() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1), addr(2)]);
        b.set_affinity(Some(Duration::from_secs(60)));
        b.connected(client(1), addr(2), Instant::now());
        b.set_affinity(None);
        assert_eq!(b.pinned_clients(), 0);
        b.connected(client(1), addr(2), Instant::now());
        assert_eq!(b.pinned_clients(), 0, "no pins without affinity");
    }

    #[test]
    fn stale_pins_are_swept_as_the_map_grows() {
        let mut b = Balancer::new();
        b.set_endpoints(vec![addr(1)]);
        b.set_affinity(Some(Duration::from_secs(1)));
        let t0 = Instant::now();
        for i in 0..MIN_SWEEP_AT as u32 - 1 {
            b.connected(IpAddr::from(i.to_be_bytes()), addr(1), t0);
        }
        let later = t0 + Duration::from_secs(5);
        b.connected(client(1), addr(1), later);
        assert_eq!(
            b.pinned_clients(),
            1,
            "only the fresh pin survives the sweep"
        );
    }
}
