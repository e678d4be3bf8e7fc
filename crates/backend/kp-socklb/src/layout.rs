//! The BPF maps' keys and values as bytes, exactly as `bpf/socklb.bpf.c` declares them
//! (change both together). Keys and values are byte arrays rather than `#[repr(C)]` structs
//! so no `unsafe impl Pod` is needed: addresses and ports are in network byte order,
//! ids, counts and slots in the host's.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use kp_core::model::{IpFamily, Protocol};

/// `kp_services`: Service port -> where its endpoints are.
pub const SERVICES_MAP: &str = "kp_services";
/// `kp_slots`: (service id, slot) -> endpoint.
pub const SLOTS_MAP: &str = "kp_slots";
/// `kp_reverse`: (socket cookie, endpoint) -> the Service address it was translated from.
pub const REVERSE_MAP: &str = "kp_reverse";
/// The IPv6 maps (service ids are shared by both families).
pub const SERVICES6_MAP: &str = "kp_services6";
/// (service id, slot) -> IPv6 endpoint.
pub const SLOTS6_MAP: &str = "kp_slots6";
/// The IPv6 reverse map.
pub const REVERSE6_MAP: &str = "kp_reverse6";
/// `kp_affinity`: (client network namespace cookie, Service port) -> pinned endpoint and
/// last use (LRU).
pub const AFFINITY_MAP: &str = "kp_affinity";
/// The IPv6 pins.
pub const AFFINITY6_MAP: &str = "kp_affinity6";

/// A key or value of a family's map: IPv4's are 8 bytes, IPv6's 20 (`struct
/// kp_service_key6` and `struct kp_endpoint6` alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Bytes {
    /// An IPv4 map's.
    V4([u8; 8]),
    /// An IPv6 map's.
    V6([u8; 20]),
}

/// Address bytes, port in network order, then `tail` (2 bytes), padded.
fn addr_bytes(addr: SocketAddr, tail: [u8; 2]) -> Bytes {
    let [p, q] = addr.port().to_be_bytes();
    match addr.ip() {
        IpAddr::V4(ip) => {
            let [a, b, c, d] = ip.octets();
            Bytes::V4([a, b, c, d, p, q, tail[0], tail[1]])
        }
        IpAddr::V6(ip) => {
            let mut bytes = [0u8; 20];
            bytes[..16].copy_from_slice(&ip.octets());
            bytes[16..].copy_from_slice(&[p, q, tail[0], tail[1]]);
            Bytes::V6(bytes)
        }
    }
}

/// A Service port as the programs look it up: the address a socket connects or sends to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// ClusterIP, externalIP or load balancer IP.
    pub addr: SocketAddr,
    /// The socket's protocol.
    pub protocol: Protocol,
}

impl ServiceKey {
    /// A Service port at `addr` for `protocol`.
    pub fn new(addr: SocketAddr, protocol: Protocol) -> Self {
        Self { addr, protocol }
    }

    /// The address's family: which maps hold it.
    pub fn family(self) -> IpFamily {
        IpFamily::of(&self.addr.ip())
    }

    /// `struct kp_service_key(6)`: address, port, IP protocol number, padding.
    pub fn to_bytes(self) -> Bytes {
        addr_bytes(self.addr, [ip_protocol(self.protocol), 0])
    }

    /// Parses key bytes (a map read back); `None` for a protocol the crate never writes.
    pub fn from_bytes(bytes: Bytes) -> Option<Self> {
        let number = match bytes {
            Bytes::V4(b) => b[6],
            Bytes::V6(b) => b[18],
        };
        let protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
            .into_iter()
            .find(|&p| ip_protocol(p) == number)?;
        Some(Self::new(endpoint_from_bytes(bytes), protocol))
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

/// `struct kp_service`: the Service port's id in `kp_slots`, how many slots it uses (0: no
/// endpoints, refused) and its ClientIP affinity timeout in milliseconds (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceEntry {
    /// The key half of its slots.
    pub id: u32,
    /// Slots `0..count` hold its endpoints.
    pub count: u32,
    /// How long a client's pin lasts after its last connect, in ms (0: no affinity).
    pub affinity_ms: u32,
}

/// A `struct kp_service` value.
pub type ServiceBytes = [u8; 12];

impl ServiceEntry {
    /// The value bytes.
    pub fn to_bytes(self) -> ServiceBytes {
        let (mut bytes, [a, b, c, d]) = ([0u8; 12], self.affinity_ms.to_ne_bytes());
        bytes[..8].copy_from_slice(&join(self.id.to_ne_bytes(), self.count.to_ne_bytes()));
        bytes[8..].copy_from_slice(&[a, b, c, d]);
        bytes
    }

    /// Parses value bytes (a map read back).
    pub fn from_bytes(bytes: ServiceBytes) -> Self {
        let [a, b, c, d, e, f, g, h, i, j, k, l] = bytes;
        Self {
            id: u32::from_ne_bytes([a, b, c, d]),
            count: u32::from_ne_bytes([e, f, g, h]),
            affinity_ms: u32::from_ne_bytes([i, j, k, l]),
        }
    }
}

/// ClientIP affinity's timeout as the programs read it: milliseconds, at least 1 (0 would
/// mean none), at most `u32::MAX` (49 days; the API allows one).
pub fn affinity_ms(timeout: std::time::Duration) -> u32 {
    u32::try_from(timeout.as_millis())
        .unwrap_or(u32::MAX)
        .max(1)
}

/// The Service port of a `struct kp_affinity_key(6)` (after the 8-byte namespace cookie),
/// and the namespace cookie.
pub fn affinity_key_parts(key: &[u8]) -> Option<(u64, Bytes)> {
    let cookie = u64::from_ne_bytes(key.get(..8)?.try_into().ok()?);
    let service = match key.len() {
        16 => Bytes::V4(key[8..16].try_into().ok()?),
        32 => Bytes::V6(key[8..28].try_into().ok()?),
        _ => return None,
    };
    Some((cookie, service))
}

/// The endpoint of a `struct kp_affinity(6)` value (after the 8-byte last use).
pub fn affinity_endpoint(value: &[u8]) -> Option<SocketAddr> {
    let bytes = match value.len() {
        16 => Bytes::V4(value[8..16].try_into().ok()?),
        32 => Bytes::V6(value[8..28].try_into().ok()?),
        _ => return None,
    };
    Some(endpoint_from_bytes(bytes))
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

/// `struct kp_endpoint(6)`: an endpoint's address and port (the value of `kp_slots`, and
/// of `kp_reverse`, where it is the Service address).
pub fn endpoint_bytes(addr: SocketAddr) -> Bytes {
    addr_bytes(addr, [0, 0])
}

/// Parses `struct kp_endpoint(6)` bytes.
pub fn endpoint_from_bytes(bytes: Bytes) -> SocketAddr {
    match bytes {
        Bytes::V4([a, b, c, d, p, q, ..]) => {
            SocketAddrV4::new(Ipv4Addr::new(a, b, c, d), u16::from_be_bytes([p, q])).into()
        }
        Bytes::V6(bytes) => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&bytes[..16]);
            let port = u16::from_be_bytes([bytes[16], bytes[17]]);
            SocketAddrV6::new(Ipv6Addr::from(ip), port, 0, 0).into()
        }
    }
}

fn join(first: [u8; 4], second: [u8; 4]) -> [u8; 8] {
    let [a, b, c, d] = first;
    let [e, f, g, h] = second;
    [a, b, c, d, e, f, g, h]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_key_is_address_port_in_network_order_then_protocol() {
        let key = ServiceKey::new(addr("10.96.0.10:53"), Protocol::Udp);
        assert_eq!(key.to_bytes(), Bytes::V4([10, 96, 0, 10, 0, 53, 17, 0]));
        let tcp = ServiceKey::new(addr("10.96.0.1:443"), Protocol::Tcp);
        assert_eq!(tcp.to_bytes(), Bytes::V4([10, 96, 0, 1, 1, 187, 6, 0]));
        assert_eq!(ServiceKey::from_bytes(tcp.to_bytes()), Some(tcp));
        assert_eq!(
            ServiceKey::from_bytes(Bytes::V4([10, 96, 0, 1, 1, 187, 1, 0])),
            None
        );
        let Bytes::V6(six) = ServiceKey::new(addr("[fd00::a]:53"), Protocol::Udp).to_bytes() else {
            panic!("IPv6 key");
        };
        assert_eq!((six[0], six[1], six[15]), (0xfd, 0, 0xa));
        assert_eq!(six[16..], [0, 53, 17, 0]);
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().expect("literal")
    }

    #[test]
    fn endpoint_bytes_round_trip() {
        let four = addr("10.244.1.3:8080");
        assert_eq!(
            endpoint_bytes(four),
            Bytes::V4([10, 244, 1, 3, 0x1f, 0x90, 0, 0])
        );
        for endpoint in [four, addr("[fd00:10:244:1::3]:8080")] {
            assert_eq!(endpoint_from_bytes(endpoint_bytes(endpoint)), endpoint);
        }
    }

    #[test]
    fn counters_are_in_host_order() {
        let entry = ServiceEntry {
            id: 7,
            count: 3,
            affinity_ms: 10_800_000,
        };
        let bytes = entry.to_bytes();
        assert_eq!(bytes[..4], 7u32.to_ne_bytes());
        assert_eq!(bytes[8..], 10_800_000u32.to_ne_bytes());
        assert_eq!(ServiceEntry::from_bytes(bytes), entry);
        let slot = SlotKey { id: 7, slot: 2 }.to_bytes();
        assert_eq!(slot[4..], 2u32.to_ne_bytes());
    }

    #[test]
    fn affinity_keys_and_values_parse_as_the_programs_write_them() {
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&42u64.to_ne_bytes());
        key[8..].copy_from_slice(&[10, 96, 0, 10, 0, 80, 6, 0]);
        let service = ServiceKey::new(addr("10.96.0.10:80"), Protocol::Tcp);
        assert_eq!(affinity_key_parts(&key), Some((42, service.to_bytes())));
        let mut value = [0u8; 32];
        value[8..28].copy_from_slice(&[
            0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0x1f, 0x90, 0, 0,
        ]);
        assert_eq!(affinity_endpoint(&value), Some(addr("[fd00::3]:8080")));
        assert_eq!(affinity_endpoint(&value[..5]), None);
        assert_eq!(
            affinity_ms(std::time::Duration::from_secs(10_800)),
            10_800_000
        );
        assert_eq!(
            affinity_ms(std::time::Duration::ZERO),
            1,
            "0 would mean none"
        );
    }
}
