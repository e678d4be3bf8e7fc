//! The fixed address plan of a test cluster (the same in every cluster: namespaces isolate
//! concurrent clusters, so addresses never collide).
//!
//! IPv4 uses RFC 1918 and documentation ranges; IPv6 uses ULA (`fd00::/8`) inside the
//! cluster and documentation (`2001:db8::/32`) ranges outside it.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The router's address on the node LAN (`ext`'s bridge), the nodes' default gateway.
pub const ROUTER_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
/// This node's IP (where the proxy under test runs).
pub const NODE_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);
/// The remote node's IP.
pub const NODE2_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 3);
/// The node LAN.
pub const LAN_CIDR_V4: &str = "192.168.50.0/24";
/// The router's IPv6 address on the node LAN.
pub const ROUTER_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 1);
/// This node's IPv6 address.
pub const NODE_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 2);
/// The remote node's IPv6 address.
pub const NODE2_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 3);
/// The node LAN (IPv6).
pub const LAN_CIDR_V6: &str = "fd00:50::/64";

/// This node's only address in the link-local node shape
/// ([`crate::ClusterBuilder::link_local_node`]): a `/30` towards the router.
pub const LINK_LOCAL_NODE_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 100, 2);
/// The router's end of that `/30` (on the LAN bridge, next to its LAN address).
pub const LINK_LOCAL_PEER_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 100, 1);

// --- the extra addresses of a node shaped like real ones (`ClusterBuilder::real_node_shape`)

/// A secondary IPv4 address of this node on its LAN interface (after [`NODE_V4`], so the
/// kernel keeps choosing [`NODE_V4`] as source).
pub const NODE_SECONDARY_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 20);
/// A secondary IPv6 address of this node on its LAN interface.
pub const NODE_SECONDARY_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x20);
/// The router's address on the second NIC's network (this node's default gateway there).
pub const ROUTER_NIC2_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 1);
/// This node's address on its second NIC (`eth1`), a network of its own.
pub const NODE_NIC2_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 2);
/// The second NIC's network.
pub const NIC2_CIDR_V4: &str = "192.168.60.0/24";
/// The router's IPv6 address on the second NIC's network.
pub const ROUTER_NIC2_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 1);
/// This node's IPv6 address on its second NIC.
pub const NODE_NIC2_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 2);
/// The second NIC's IPv6 network.
pub const NIC2_CIDR_V6: &str = "fd00:60::/64";
/// A virtual IP on this node's `lo` (as kube-vip or a BGP speaker puts it), routed to the
/// node by the router.
pub const NODE_LO_VIP_V4: Ipv4Addr = Ipv4Addr::new(192, 168, 70, 10);
/// The IPv6 virtual IP on `lo`.
pub const NODE_LO_VIP_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x70, 0, 0, 0, 0, 0, 0x10);
/// NodeLocal DNSCache's link-local service address, on a dummy-like device of this node.
pub const LINK_LOCAL_SERVICE_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
/// The dummy-like device holding [`LINK_LOCAL_SERVICE_V4`] (a veth whose peer stays in the
/// node: this kernel may lack the `dummy` link type). NodeLocal DNSCache names its device so.
pub const LINK_LOCAL_DEVICE: &str = "nodelocaldns";
/// The name of this node's second NIC.
pub const NIC2_DEVICE: &str = "eth1";

/// The whole pod network (a proxy's `clusterCIDR`).
pub const CLUSTER_CIDR_V4: &str = "10.244.0.0/16";
/// The whole pod network, IPv6.
pub const CLUSTER_CIDR_V6: &str = "fd00:10:244::/48";
/// This node's pod subnet; `.1` is the node's gateway address on every pod veth.
pub const LOCAL_POD_CIDR_V4: &str = "10.244.1.0/24";
/// The remote node's pod subnet.
pub const REMOTE_POD_CIDR_V4: &str = "10.244.2.0/24";
/// This node's IPv6 pod subnet; `::1` is the gateway.
pub const LOCAL_POD_CIDR_V6: &str = "fd00:10:244:1::/64";
/// The remote node's IPv6 pod subnet.
pub const REMOTE_POD_CIDR_V6: &str = "fd00:10:244:2::/64";

/// A source range that contains [`EXTERNAL_IN_V4`] but not [`EXTERNAL_OUT_V4`] (for
/// `loadBalancerSourceRanges` tests).
pub const EXTERNAL_IN_RANGE_V4: &str = "203.0.113.0/25";
/// The external client inside [`EXTERNAL_IN_RANGE_V4`].
pub const EXTERNAL_IN_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// The external client outside [`EXTERNAL_IN_RANGE_V4`] (in `203.0.113.128/25`).
pub const EXTERNAL_OUT_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 130);
/// The IPv6 range containing [`EXTERNAL_IN_V6`] but not [`EXTERNAL_OUT_V6`].
pub const EXTERNAL_IN_RANGE_V6: &str = "2001:db8:1::/64";
/// The IPv6 external client inside [`EXTERNAL_IN_RANGE_V6`].
pub const EXTERNAL_IN_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 2);
/// The IPv6 external client outside it (in `2001:db8:2::/64`).
pub const EXTERNAL_OUT_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 2);

/// Addresses the router sends to this node: use them as LoadBalancer ingress IPs or
/// external IPs so external clients can reach them.
pub const LOAD_BALANCER_CIDR_V4: &str = "198.51.100.0/24";
/// The IPv6 range the router sends to this node.
pub const LOAD_BALANCER_CIDR_V6: &str = "2001:db8:100::/64";
/// A suggested service CIDR; nothing routes it, the proxy under test must DNAT it.
pub const SERVICE_CIDR_V4: &str = "10.96.0.0/16";
/// A suggested IPv6 service CIDR.
pub const SERVICE_CIDR_V6: &str = "fd00:10:96::/112";

/// The address pods of `node_index` (1 = this node, 2 = the remote node) get for `host`
/// (`1` is the gateway).
pub(crate) const fn pod_v4(node_index: u8, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, node_index, host)
}

/// The IPv6 counterpart of [`pod_v4`].
pub(crate) const fn pod_v6(node_index: u8, host: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x10, 0x244, node_index as u16, 0, 0, 0, host as u16)
}
