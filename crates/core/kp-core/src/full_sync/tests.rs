//! The per-mode schedule of periodic full syncs, on paused tokio time.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::*;
use crate::model::Protocol;
use crate::testutil::{cluster_ip_port, endpoint_at, node_with, port_name, state_on};

const IPTABLES: PeriodicFullSync = PeriodicFullSync::Hourly {
    spare_large_clusters: true,
};
const NFTABLES: PeriodicFullSync = PeriodicFullSync::Hourly {
    spare_large_clusters: false,
};

/// A state with `v4` IPv4 and `v6` IPv6 endpoints, spread over service ports of 100 each.
fn state(v4: usize, v6: usize) -> ProxyState {
    let addresses = (0..v4)
        .map(|i| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + u32::try_from(i).unwrap_or(0))))
        .chain((0..v6).map(|i| {
            IpAddr::V6(Ipv6Addr::from(
                (0xfd00_u128 << 112) | u128::try_from(i).unwrap_or(0),
            ))
        }));
    let endpoints: Vec<_> = addresses.map(|ip| endpoint_at(ip, 8080, false)).collect();
    let items = endpoints
        .chunks(100)
        .enumerate()
        .map(|(i, chunk)| {
            let name = port_name("ns", &format!("svc-{i}"), "", Protocol::Tcp);
            (cluster_ip_port(name, "172.30.0.1", 80), chunk.to_vec())
        })
        .collect();
    state_on(node_with(&["192.0.2.1"]), items)
}

#[test]
fn each_mode_gets_upstreams_schedule() {
    assert_eq!(PeriodicFullSync::for_mode("iptables"), IPTABLES);
    assert_eq!(PeriodicFullSync::for_mode("nftables"), NFTABLES);
    assert_eq!(
        PeriodicFullSync::for_mode("ipvs"),
        PeriodicFullSync::EveryPeriodicRun
    );
    for mode in ["userspace", "winuserspace", "fake"] {
        assert_eq!(
            PeriodicFullSync::for_mode(mode),
            PeriodicFullSync::Never,
            "{mode}"
        );
    }
}

#[test]
fn endpoints_are_counted_per_family_for_programmed_service_ports_only() {
    assert_eq!(largest_family_endpoints(&state(700, 600)), 700);
    assert_eq!(largest_family_endpoints(&state(0, 1001)), 1001);
    // Endpoints of a service port the state does not hold (the Service is gone) do not count.
    let mut orphaned = state(1000, 0);
    let name = port_name("ns", "gone", "", Protocol::Tcp);
    let ip = IpAddr::V4(Ipv4Addr::new(10, 9, 9, 9));
    orphaned
        .endpoints
        .insert(name, vec![endpoint_at(ip, 8080, false)]);
    assert_eq!(largest_family_endpoints(&orphaned), 1000);
}

#[tokio::test(start_paused = true)]
async fn iptables_resyncs_hourly_unless_the_cluster_is_large() {
    let last = Instant::now();
    let reason = RunReason::Periodic;
    let just_before = last + FULL_SYNC_PERIOD - Duration::from_secs(1);
    let after = last + FULL_SYNC_PERIOD;
    // At 1,000 endpoints the cluster is not large yet; at 1,001 in one family it is.
    assert_eq!(
        IPTABLES.due(reason, Some(last), just_before, &state(1000, 0)),
        None
    );
    assert!(
        IPTABLES
            .due(reason, Some(last), after, &state(1000, 1000))
            .is_some()
    );
    assert_eq!(
        IPTABLES.due(reason, Some(last), after, &state(1001, 0)),
        None
    );
    assert_eq!(
        IPTABLES.due(reason, Some(last), after, &state(10, 1001)),
        None
    );
    // Any run may be the one that is due, not only a periodic one.
    let requested = RunReason::Requested;
    assert!(
        IPTABLES
            .due(requested, Some(last), after, &state(5, 0))
            .is_some()
    );
    // Before the first full sync nothing is periodic (the first sync is full anyway).
    assert_eq!(IPTABLES.due(reason, None, after, &state(5, 0)), None);
}

#[tokio::test(start_paused = true)]
async fn nftables_resyncs_hourly_whatever_the_size() {
    let last = Instant::now();
    let after = last + FULL_SYNC_PERIOD;
    let large = state(50_000, 0);
    assert!(
        NFTABLES
            .due(RunReason::Periodic, Some(last), after, &large)
            .is_some()
    );
    let before = after - Duration::from_millis(1);
    assert_eq!(
        NFTABLES.due(RunReason::Periodic, Some(last), before, &large),
        None
    );
}

#[tokio::test(start_paused = true)]
async fn ipvs_resyncs_on_every_periodic_run_only() {
    let ipvs = PeriodicFullSync::EveryPeriodicRun;
    let now = Instant::now();
    let large = state(5000, 0);
    assert!(
        ipvs.due(RunReason::Periodic, Some(now), now, &large)
            .is_some()
    );
    for reason in [RunReason::Requested, RunReason::Retry, RunReason::Recheck] {
        let later = now + FULL_SYNC_PERIOD * 2;
        assert_eq!(
            ipvs.due(reason, Some(now), later, &large),
            None,
            "{reason:?}"
        );
    }
    let never = PeriodicFullSync::Never;
    assert_eq!(
        never.due(
            RunReason::Periodic,
            Some(now),
            now + FULL_SYNC_PERIOD * 2,
            &large
        ),
        None
    );
}
