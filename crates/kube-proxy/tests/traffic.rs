//! The shared traffic suite: the real `kube-proxy` binary, run inside the node namespace of a
//! `kp-testbed` cluster, programs a kernel proxy mode from manifests, and real TCP/UDP flows
//! from pods, the node and external clients check what it programmed: which endpoints answer,
//! whether the source was masqueraded, and whether unanswered flows are refused or dropped.
//!
//! Each mode gets a module with one test per scenario group; the scenarios themselves are
//! functions of the [`support::Mode`]. Needs root; build the echo helper first:
//! `cargo build -p kp-testbed --bins && cargo test -p kube-proxy --test traffic`.

#[path = "traffic/scenarios.rs"]
mod scenarios;
#[path = "traffic/support.rs"]
mod support;

/// One module per mode, each with one test per scenario group.
macro_rules! mode_tests {
    ($module:ident, $mode:expr) => {
        mod $module {
            use crate::scenarios;
            use crate::support::Mode;

            const MODE: Mode = $mode;

            #[test]
            fn cluster_ip() {
                scenarios::cluster_ip(MODE);
            }

            #[test]
            fn external() {
                scenarios::external(MODE);
            }

            #[test]
            fn udp_endpoint_replaced() {
                scenarios::udp_endpoint_replaced(MODE);
            }

            #[test]
            fn edits_and_restart() {
                scenarios::edits_and_restart(MODE);
            }

            #[test]
            fn ipv6_cluster_ip() {
                scenarios::ipv6_cluster_ip(MODE);
            }

            #[test]
            fn node_addresses_and_cleanup() {
                scenarios::node_addresses_and_cleanup(MODE);
            }

            #[test]
            fn restricted_node_ports() {
                scenarios::restricted_node_ports(MODE);
            }

            #[test]
            fn masquerade_all_and_invalid_input() {
                scenarios::masquerade_all_and_invalid_input(MODE);
            }

            #[test]
            fn interface_name_prefix() {
                scenarios::interface_name_prefix(MODE);
            }

            #[test]
            fn unallocated_cluster_ips() {
                scenarios::unallocated_cluster_ips(MODE);
            }
        }
    };
}

mode_tests!(iptables, Mode::Iptables);
mode_tests!(nftables, Mode::Nftables);
mode_tests!(userspace, Mode::Userspace);

/// ipvs mode: this machine's kernel has no IPVS, so one boot of the test VM (crates/kp-vm)
/// runs the `#[ignore]`d scenarios below in Debian's kernel. By-design differences are
/// stated in each scenario where the mode is matched; the scenarios not listed here do not
/// run in ipvs mode yet (their ipvs arms panic, so adding one forces deciding them).
mod ipvs {
    use crate::scenarios;
    use crate::support::{KUBE_PROXY, Mode};

    const MODE: Mode = Mode::Ipvs;
    /// The ignored scenarios below: every one must pass inside the VM.
    const GUEST_TESTS: usize = 3;

    #[test]
    fn ipvs_scenarios_in_the_vm() {
        let echo = kp_testbed::echo_binary().unwrap_or_else(|e| panic!("{e}"));
        let out = kp_vm::Vm::from_env()
            .iptables()
            .program("ipvsadm")
            .program("ipset")
            .program("conntrack")
            .program(KUBE_PROXY)
            .program(&echo.to_string_lossy())
            .run_current_exe(&["--ignored", "--test-threads=1", "ipvs::"])
            .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
        println!("VM run took {:.1} s", out.elapsed.as_secs_f64());
        out.assert_tests_passed(GUEST_TESTS);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_scenarios_in_the_vm)"]
    fn cluster_ip() {
        scenarios::cluster_ip(MODE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_scenarios_in_the_vm)"]
    fn udp_endpoint_replaced() {
        scenarios::udp_endpoint_replaced(MODE);
    }

    #[test]
    #[ignore = "runs inside the IPVS VM (ipvs_scenarios_in_the_vm)"]
    fn unallocated_cluster_ips() {
        scenarios::unallocated_cluster_ips(MODE);
    }

    // `edits_and_restart` is not run in ipvs mode yet: in one of about five VM runs a service
    // added while the proxy runs refused the first connection after its sync (the virtual
    // server and its real servers were in place when the failure was dumped). Open in issue 6.
}
