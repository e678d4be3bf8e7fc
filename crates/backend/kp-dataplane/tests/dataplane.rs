//! kp-dataplane's integration tests, in one binary (one link, one run; issue 37): each module
//! is one suite, named as its file (`cargo test -p kp-dataplane --test dataplane nft_kernel::`).
//! Most program the kernel, each test in a network namespace of its own
//! (`kp_testbed::isolated`), and skip without root (failing under `CI`).

mod nft_tools;
mod xt_dumps;

mod conntrack_kernel;
mod ipset_kernel;
mod iptables_netlink_kernel;
mod ipvs_kernel;
mod kernel;
mod nft_foreign;
mod nft_kernel;
mod nft_layout_classes;
mod nft_layout_forget;
mod nftnl_kernel;
mod nftnl_register_concat;
mod sysctl_kernel;
