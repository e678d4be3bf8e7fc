//! The shared traffic suite: the real `kube-proxy` binary, run inside the node namespace of a
//! `kp-testbed` cluster, programs a kernel proxy mode from manifests, and real TCP/UDP flows
//! from pods, the node and external clients check what it programmed: which endpoints answer,
//! whether the source was masqueraded, and whether unanswered flows are refused or dropped.
//!
//! Each mode gets a module with one test per scenario group; the scenarios themselves are
//! functions of the [`support::Mode`] (both in `kp-suite`). The binary also holds the other
//! suites that run clusters: `faults::`, `winuserspace::`, and the VM's `sctp_traffic::` and
//! `ipvs_traffic::`. Needs root; build the echo helper first:
//! `cargo build -p kp-testbed --bins && cargo test -p kube-proxy --test traffic`.

#[path = "traffic/differential.rs"]
mod differential;
#[path = "faults.rs"]
mod faults;
#[path = "ipvs_traffic.rs"]
mod ipvs_traffic;
#[path = "traffic/localhost.rs"]
mod localhost;
use kp_suite::scenarios;
#[path = "sctp_traffic.rs"]
mod sctp_traffic;
#[path = "traffic/socket_lb.rs"]
mod socket_lb;
#[path = "winuserspace.rs"]
mod winuserspace;
use kp_suite::support;

/// One test per scenario group for the `MODE` in scope, each with the given attributes.
macro_rules! scenario_tests {
    ($(#[$attr:meta])*) => {
        #[test]
        $(#[$attr])*
        fn cluster_ip() {
            scenarios::cluster_ip(MODE);
        }

        #[test]
        $(#[$attr])*
        fn external() {
            scenarios::external(MODE);
        }

        #[test]
        $(#[$attr])*
        fn udp_endpoint_replaced() {
            scenarios::udp_endpoint_replaced(MODE);
        }

        #[test]
        $(#[$attr])*
        fn edits_and_restart() {
            scenarios::edits_and_restart(MODE);
        }

        #[test]
        $(#[$attr])*
        fn ipv6_cluster_ip() {
            scenarios::ipv6_cluster_ip(MODE);
        }

        #[test]
        $(#[$attr])*
        fn node_addresses_and_cleanup() {
            scenarios::node_addresses_and_cleanup(MODE);
        }

        #[test]
        $(#[$attr])*
        fn restricted_node_ports() {
            scenarios::restricted_node_ports(MODE);
        }

        #[test]
        $(#[$attr])*
        fn masquerade_all_and_invalid_input() {
            scenarios::masquerade_all_and_invalid_input(MODE);
        }

        #[test]
        $(#[$attr])*
        fn interface_name_prefix() {
            scenarios::interface_name_prefix(MODE);
        }

        #[test]
        $(#[$attr])*
        fn unallocated_cluster_ips() {
            scenarios::unallocated_cluster_ips(MODE);
        }

        #[test]
        $(#[$attr])*
        fn affinity_and_node_traffic() {
            scenarios::affinity_and_node_traffic(MODE);
        }

        #[test]
        $(#[$attr])*
        fn link_local_node() {
            scenarios::link_local_node(MODE);
        }

        #[test]
        $(#[$attr])*
        fn node_port_address_forms() {
            scenarios::node_port_address_forms(MODE);
        }
    };
}

/// One module per mode, each with one test per scenario group.
macro_rules! mode_tests {
    ($module:ident, $mode:expr) => {
        mod $module {
            use crate::scenarios;
            use crate::support::Mode;

            const MODE: Mode = $mode;

            scenario_tests!();
        }
    };
}

mode_tests!(iptables, Mode::Iptables);
mode_tests!(iptables_restore, Mode::IptablesRestore);
mode_tests!(nftables, Mode::Nftables);
mode_tests!(userspace, Mode::Userspace);

/// Localhost NodePorts through the userspace listener (KEP-6032): nftables mode only (the
/// chain layout's: `nftables_chains::localhost_node_ports`).
#[test]
fn nftables_localhost_node_ports() {
    localhost::localhost_node_ports(support::Mode::Nftables);
}

/// The table's rejects of localhost NodePort traffic the listeners do not serve (KEP-6032),
/// counted (the chain layout's: `nftables_chains::localhost_rejects`).
#[test]
fn nftables_localhost_rejects() {
    localhost::localhost_rejects(support::Mode::Nftables);
}

/// `--socket-lb` beside nftables mode: the programs translate the client pod's sockets (see
/// the module), in either layout.
#[test]
fn nftables_socket_lb() {
    socket_lb::socket_lb(support::Mode::Nftables);
}

/// [`nftables_socket_lb`] over the chain layout.
#[test]
fn nftables_chains_socket_lb() {
    socket_lb::socket_lb(support::Mode::NftablesChains);
}

/// `--socket-lb` on a dual-stack cluster: an IPv6 Service through the proxy, and a burst of
/// resolver-like queries to a UDP Service, without NAT (the default layout: the programs do
/// not depend on it).
#[test]
fn nftables_socket_lb_ipv6_and_dns_burst() {
    socket_lb::ipv6_and_dns_burst(support::Mode::Nftables);
}

/// nftables mode's no-endpoint filters after DNAT, in the default layout (the chain layout's:
/// `nftables_chains::filters_after_dnat`; the other modes' filters are in `cluster_ip` and
/// `external`).
#[test]
fn nftables_filters_after_dnat() {
    scenarios::nftables_filters_after_dnat(support::Mode::Nftables);
}

/// nftables mode's previous layout (`--nftables-layout=chains`): a smoke suite beside the
/// differential test below, which compares it with the default case by case.
mod nftables_chains {
    use crate::scenarios;
    use crate::support::Mode;

    const MODE: Mode = Mode::NftablesChains;

    #[test]
    fn cluster_ip() {
        scenarios::cluster_ip(MODE);
    }

    #[test]
    fn edits_and_restart() {
        scenarios::edits_and_restart(MODE);
    }

    #[test]
    fn affinity_and_node_traffic() {
        scenarios::affinity_and_node_traffic(MODE);
    }

    #[test]
    fn filters_after_dnat() {
        scenarios::nftables_filters_after_dnat(MODE);
    }

    #[test]
    fn localhost_node_ports() {
        crate::localhost::localhost_node_ports(MODE);
    }

    #[test]
    fn localhost_rejects() {
        crate::localhost::localhost_rejects(MODE);
    }
}

/// nftables mode's two layouts on generated cluster states: every probe must end the same
/// way in both (`KP_DIFF_SEEDS`, `KP_DIFF_CASES`: see the module).
#[test]
fn nftables_layouts_agree() {
    differential::layouts_agree();
}

/// ipvs mode: this machine's kernel has no IPVS, so one boot of the test VM (tools/kp-vm)
/// runs the `#[ignore]`d scenarios below in Debian's kernel: the whole suite. By-design
/// differences are stated in each scenario where the mode is matched.
mod ipvs {
    use crate::scenarios;
    use crate::support::{Mode, ipvs_vm};

    const MODE: Mode = Mode::Ipvs;
    /// The ignored scenarios below: every one must pass inside the VM.
    const GUEST_TESTS: usize = 13;

    #[test]
    fn ipvs_scenarios_in_the_vm() {
        let out = ipvs_vm()
            .run_current_exe(&[
                "--ignored",
                "--test-threads=1",
                "ipvs::",
                "--skip",
                "faults::",
            ])
            .unwrap_or_else(|e| panic!("the IPVS VM did not run: {e}"));
        println!("VM run took {:.1} s", out.elapsed.as_secs_f64());
        out.assert_tests_passed(GUEST_TESTS);
    }

    scenario_tests!(#[ignore = "runs inside the IPVS VM (ipvs_scenarios_in_the_vm)"]);
}
