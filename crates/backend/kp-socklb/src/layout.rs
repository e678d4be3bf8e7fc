//! The BPF maps' keys and values as bytes, exactly as `bpf/socklb.bpf.c` declares them
//! (change both together). Keys and values are byte arrays rather than `#[repr(C)]` structs
//! so no `unsafe impl Pod` is needed: addresses and ports are in network byte order,
//! ids, counts and slots in the host's.

use std::net::{Ipv4Addr, SocketAddrV4};

use kp_core::model::Protocol;

/// `kp_services`: Service port -> where its endpoints are.
pub const SERVICES_MAP: &str = "kp_services";
/// `kp_slots`: (service id, slot) -> endpoint.
pub const SLOTS_MAP: &str = "kp_slots";
/// `kp_reverse`: (socket cookie, endpoint) -> the Service address it was translated from.
pub const REVERSE_MAP: &str = "kp_reverse";

/// A Service port as the programs look it up: the address a socket connects or sends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// ClusterIP, externalIP or load balancer IP.
    pub addr: SocketAddrV4,
    /// The socket's protocol.
    pub protocol: Protocol,
}

impl ServiceKey {
    /// A Service port at `addr` for `protocol`.
    pub fn new(addr: SocketAddrV4, protocol: Protocol) -> Self {
        Self { addr, protocol }
    }

    /// `struct kp_service_key`: address, port, IP protocol number, padding.
    pub fn to_bytes(self) -> [u8; 8] {
        let [a, b, c, d] = self.addr.ip().octets();
        let [p, q] = self.addr.port().to_be_bytes();
        [a, b, c, d, p, q, ip_protocol(self.protocol), 0]
    }
}

/// The IP protocol number the programs read from the socket (`ctx->protocol`).
pub fn ip_protocol(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

/// `struct kp_service`: the Service port's id in `kp_slots` and how many slots it uses
/// (0: no endpoints, refused).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    /// The key half of its slots.
    pub id: u32,
    /// Slots `0..count` hold its endpoints.
    pub count: u32,
}

impl ServiceEntry {
    /// The value bytes.
    pub fn to_bytes(self) -> [u8; 8] {
        join(self.id.to_ne_bytes(), self.count.to_ne_bytes())
    }

    /// Parses value bytes (a map read back).
    pub fn from_bytes(bytes: [u8; 8]) -> Self {
        let (id, count) = split(bytes);
        Self {
            id: u32::from_ne_bytes(id),
            count: u32::from_ne_bytes(count),
        }
    }
}

/// `struct kp_slot_key`: one endpoint slot of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotKey {
    /// The Service port's id.
    pub id: u32,
    /// The slot, below the service's count.
    pub slot: u32,
}

impl SlotKey {
    /// The key bytes.
    pub fn to_bytes(self) -> [u8; 8] {
        join(self.id.to_ne_bytes(), self.slot.to_ne_bytes())
    }
}

/// `struct kp_endpoint`: an endpoint's address and port (the value of `kp_slots`, and of
/// `kp_reverse`, where it is the Service address).
pub fn endpoint_bytes(addr: SocketAddrV4) -> [u8; 8] {
    let [a, b, c, d] = addr.ip().octets();
    let [p, q] = addr.port().to_be_bytes();
    [a, b, c, d, p, q, 0, 0]
}

/// Parses `struct kp_endpoint` bytes.
pub fn endpoint_from_bytes(bytes: [u8; 8]) -> SocketAddrV4 {
    let [a, b, c, d, p, q, ..] = bytes;
    SocketAddrV4::new(Ipv4Addr::new(a, b, c, d), u16::from_be_bytes([p, q]))
}

fn join(first: [u8; 4], second: [u8; 4]) -> [u8; 8] {
    let [a, b, c, d] = first;
    let [e, f, g, h] = second;
    [a, b, c, d, e, f, g, h]
}

fn split(bytes: [u8; 8]) -> ([u8; 4], [u8; 4]) {
    let [a, b, c, d, e, f, g, h] = bytes;
    ([a, b, c, d], [e, f, g, h])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_key_is_address_port_in_network_order_then_protocol() {
        let key = ServiceKey::new("10.96.0.10:53".parse().expect("literal"), Protocol::Udp);
        assert_eq!(key.to_bytes(), [10, 96, 0, 10, 0, 53, 17, 0]);
        let tcp = ServiceKey::new("10.96.0.1:443".parse().expect("literal"), Protocol::Tcp);
        assert_eq!(tcp.to_bytes(), [10, 96, 0, 1, 1, 187, 6, 0]);
    }

    #[test]
    fn endpoint_bytes_round_trip() {
        let addr: SocketAddrV4 = "10.244.1.3:8080".parse().expect("literal");
        assert_eq!(endpoint_bytes(addr), [10, 244, 1, 3, 0x1f, 0x90, 0, 0]);
        assert_eq!(endpoint_from_bytes(endpoint_bytes(addr)), addr);
    }

    #[test]
    fn counters_are_in_host_order() {
        let entry = ServiceEntry { id: 7, count: 3 };
        let bytes = entry.to_bytes();
        assert_eq!(bytes[..4], 7u32.to_ne_bytes());
        assert_eq!(ServiceEntry::from_bytes(bytes), entry);
        let slot = SlotKey { id: 7, slot: 2 }.to_bytes();
        assert_eq!(slot[4..], 2u32.to_ne_bytes());
    }
}
