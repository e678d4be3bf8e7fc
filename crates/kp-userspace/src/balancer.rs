//! Endpoint choice for one frontend, without I/O: round robin over the endpoints, with
//! sessionAffinity ClientIP pinning a client to the endpoint it last reached until the pin
//! has been unused for the affinity timeout.
//!
//! The caller passes the time in (`tokio::time::Instant`), so tests drive it with paused time.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::time::Instant;

/// Stale pins are swept once the map has grown to this many entries (and then whenever it
/// doubles), so memory stays bounded by the clients seen within one timeout.
const MIN_SWEEP_AT: usize = 1024;

/// Round robin with optional ClientIP affinity.
#[derive(Debug)]
pub struct Balancer {
    endpoints: Vec<SocketAddr>,
    next: usize,
    affinity: Option<Duration>,
    pins: HashMap<IpAddr, Pin>,
    sweep_at: usize,
}

/// Where one client goes, and when it last went there.
#[derive(Clone, Copy, Debug)]
struct Pin {
    endpoint: SocketAddr,
    last_used: Instant,
}

impl Default for Balancer {
    fn default() -> Self {
        Self::new()
    }
}

impl Balancer {
    /// No endpoints, no affinity.
    pub fn new() -> Self {
        Self {
            endpoints: Vec::new(),
            next: 0,
            affinity: None,
            pins: HashMap::new(),
            sweep_at: MIN_SWEEP_AT,
        }
    }

    /// The current endpoints, in the order round robin walks them.
    pub fn endpoints(&self) -> &[SocketAddr] {
        &self.endpoints
    }

    /// Replaces the endpoints. Pins to endpoints that are gone are dropped (their clients
    /// are balanced again); the others are kept.
    pub fn set_endpoints(&mut self, endpoints: Vec<SocketAddr>) {
        self.pins.retain(|_, pin| endpoints.contains(&pin.endpoint));
        self.next = if endpoints.is_empty() {
            0
        } else {
            self.next % endpoints.len()
        };
        self.endpoints = endpoints;
    }

    /// Turns ClientIP affinity on (with its timeout) or off (dropping every pin).
    pub fn set_affinity(&mut self, timeout: Option<Duration>) {
        if timeout.is_none() {
            self.pins.clear();
        }
        self.affinity = timeout;
    }

    /// The endpoints to try for a new connection from `client`, best first: the pinned
    /// endpoint if the client has a live pin, then the others in round robin order. Advances
    /// round robin unless a pin decided. Empty when there are no endpoints.
    pub fn candidates(&mut self, client: IpAddr, now: Instant) -> Vec<SocketAddr> {
        let count = self.endpoints.len();
        if count == 0 {
            return Vec::new();
        }
        let client = client.to_canonical();
        let pinned = self.live_pin(client, now);
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

    /// Records that `client` reached `endpoint`: with affinity on, the client is pinned to
    /// it (or its pin refreshed).
    pub fn connected(&mut self, client: IpAddr, endpoint: SocketAddr, now: Instant) {
        let Some(timeout) = self.affinity else {
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

    /// Number of clients currently pinned (live or not yet swept).
    pub fn pinned_clients(&self) -> usize {
        self.pins.len()
    }

    fn live_pin(&mut self, client: IpAddr, now: Instant) -> Option<SocketAddr> {
        let timeout = self.affinity?;
        let pin = self.pins.get(&client)?;
        if now.saturating_duration_since(pin.last_used) > timeout {
            self.pins.remove(&client);
            return None;
        }
        Some(pin.endpoint)
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
        assert_eq!(b.pinned_clients(), 0);
        assert_ne!(b.candidates(client(1), now)[0], addr(2));
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
