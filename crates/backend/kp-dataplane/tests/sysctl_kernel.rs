//! The sysctl record against the real per-namespace settings, in a throwaway network
//! namespace (`kp_testbed::isolated`): what start-up changes, `--cleanup` puts back, across a restart.

use kp_core::model::IpFamily;
use kp_dataplane::sysctls::{
    self, ConntrackSettings, FsSysctl, ROUTE_LOCALNET, Sysctl, SysctlRecord,
    TCP_TIMEOUT_ESTABLISHED,
};
use kp_rules::iptables::RenderConfig;
use kp_testbed::isolated::{self, sh};

/// A setting as the shell reads it, independent of the code under test.
fn proc_sys(name: &str) -> String {
    sh(&format!("cat /proc/sys/{}", name.replace('.', "/")))
        .trim()
        .to_owned()
}

#[test]
fn cleanup_restores_route_localnet_and_timeouts_in_a_netns() {
    isolated::run(
        "cleanup_restores_route_localnet_and_timeouts_in_a_netns",
        || isolated::missing(&["conntrack"], &["true"]),
        || {
            // A known starting point that differs from what the proxy writes. Listing the
            // table loads nf_conntrack, which creates the namespace's conntrack settings.
            sh("conntrack -L >/dev/null 2>&1; \
                echo 0 > /proc/sys/net/ipv4/conf/all/route_localnet && \
                echo 432000 > /proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established");
            let host = FsSysctl::host();
            let state = tempfile::tempdir().expect("state dir");
            let record = || SysctlRecord::new(state.path().join("sysctls"));

            // Start-up as iptables mode does it (the global table size is left alone: only
            // the initial namespace may write it).
            let mut plan: Vec<_> = sysctls::conntrack_plan(&ConntrackSettings::default(), 1)
                .into_iter()
                .filter(|s| sysctls::restored_on_cleanup(s.key))
                .collect();
            plan.extend(sysctls::route_localnet_plan(
                &RenderConfig::default(),
                &[IpFamily::V4],
            ));
            let report = sysctls::apply(&host, &plan).expect("writable in the namespace");
            record().note(&report.applied).expect("recorded");
            assert_eq!(proc_sys("net.ipv4.conf.all.route_localnet"), "1");
            assert_eq!(
                proc_sys("net.netfilter.nf_conntrack_tcp_timeout_established"),
                "86400"
            );

            // A restart writes nothing and keeps the originals.
            let again = sysctls::apply(&host, &plan).expect("readable");
            assert!(again.applied.is_empty(), "{:?}", again.applied);
            record().note(&again.applied).expect("recorded");
            let recorded = record().load().expect("readable");
            assert_eq!(recorded[ROUTE_LOCALNET].original, 0);
            assert_eq!(recorded[TCP_TIMEOUT_ESTABLISHED].original, 432_000);

            // --cleanup.
            let restored = record().restore(&host).expect("restores");
            assert_eq!(restored.restored.len(), 3, "{restored:?}");
            assert_eq!(proc_sys("net.ipv4.conf.all.route_localnet"), "0");
            assert_eq!(
                proc_sys("net.netfilter.nf_conntrack_tcp_timeout_established"),
                "432000"
            );
            assert!(!record().path().exists(), "the record is forgotten");
            assert_eq!(host.read(ROUTE_LOCALNET).expect("readable"), "0");
        },
    );
}
