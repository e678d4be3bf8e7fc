//! Proptest strategies for model values, shared by the property tests of the renderers
//! (differential, hostile-name and kernel checks) so they draw addresses, prefixes and
//! endpoints the same way.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use proptest::prelude::*;

use crate::model::Endpoint;

/// Address `host` of small network `net`: 10.180.`net`.`host`, or fd00:10::`net`:`host`.
pub fn addr(v6: bool, net: u8, host: u8) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x10,
            0,
            0,
            0,
            0,
            u16::from(net),
            u16::from(host),
        ))
    } else {
        IpAddr::V4(Ipv4Addr::new(10, 180, net, host))
    }
}

/// One of a few [`addr`]s of either family: few enough that services and endpoints share
/// them.
pub fn any_ip() -> impl Strategy<Value = IpAddr> {
    (any::<bool>(), 0u8..3, 0u8..6).prop_map(|(v6, net, host)| addr(v6, net, host))
}

/// Any prefix of either family, host bits left as drawn (`10.1.2.3/8`), as a
/// `loadBalancerSourceRanges` entry may be written.
pub fn any_net() -> impl Strategy<Value = IpNet> {
    (any::<bool>(), any::<u128>(), 0u8..=128).prop_map(|(v6, bits, len)| {
        if v6 {
            IpNet::V6(ipnet::Ipv6Net::new(Ipv6Addr::from(bits), len).expect("len"))
        } else {
            IpNet::V4(ipnet::Ipv4Net::new(Ipv4Addr::from(bits as u32), len % 33).expect("len"))
        }
    })
}

/// The ClusterIPs of generated service `index`: 172.30.0.`index` unless the service is
/// IPv6 only, and fd00:172::`index` when `[v4, v6]` says IPv6.
pub fn cluster_ips(index: u8, [v4, v6]: [bool; 2]) -> Vec<IpAddr> {
    let mut ips = Vec::new();
    if v4 || !v6 {
        ips.push(IpAddr::V4(Ipv4Addr::new(172, 30, 0, index)));
    }
    if v6 {
        ips.push(IpAddr::V6(Ipv6Addr::new(
            0xfd00,
            0x172,
            0,
            0,
            0,
            0,
            0,
            u16::from(index),
        )));
    }
    ips
}

/// An endpoint at one of the [`any_ip`] addresses with a port from `ports` and any
/// conditions; local (on `node`) or on `other`.
pub fn endpoint(
    ports: impl Strategy<Value = u16>,
    node: &'static str,
    other: &'static str,
) -> impl Strategy<Value = Endpoint> {
    (any_ip(), ports, any::<[bool; 4]>()).prop_map(
        move |(ip, port, [ready, serving, terminating, local])| Endpoint {
            ip,
            port,
            ready,
            serving,
            terminating,
            node_name: Some(if local { node } else { other }.into()),
            zone: None,
            zone_hints: None,
            node_hints: None,
            is_local: local,
        },
    )
}

#[cfg(test)]
mod tests {
    use proptest::strategy::ValueTree as _;
    use proptest::test_runner::TestRunner;

    use super::*;

    #[test]
    fn addresses_stay_in_their_small_networks_and_endpoints_follow_locality() {
        let mut runner = TestRunner::deterministic();
        for _ in 0..200 {
            let ip = any_ip().new_tree(&mut runner).expect("tree").current();
            let in_pool = match ip {
                IpAddr::V4(v4) => v4.octets()[..2] == [10, 180] && v4.octets()[2] < 3,
                IpAddr::V6(v6) => v6.segments()[..2] == [0xfd00, 0x10] && v6.segments()[6] < 3,
            };
            assert!(in_pool, "{ip}");
            let ep = endpoint(Just(80u16), "here", "there")
                .new_tree(&mut runner)
                .expect("tree")
                .current();
            let expected = if ep.is_local { "here" } else { "there" };
            assert_eq!(ep.node_name.as_deref(), Some(expected));
            assert_eq!(ep.port, 80);
        }
    }
}
