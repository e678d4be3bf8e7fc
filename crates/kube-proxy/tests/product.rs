//! The proxy binary's integration tests that need no cluster, in one binary (one link, one
//! run; issue 37): each module is one suite, named as its file (`cargo test -p kube-proxy
//! --test product cleanup::`): flags and exits, `--cleanup`, `--init-only` and the deploy
//! files against a throwaway node namespace, `explain`, and the checks that README,
//! docs/ and CI agree with the code. The traffic suites (`traffic`, `faults`, `image`,
//! `sctp_traffic`, `ipvs_traffic`, `winuserspace`) and the demo stay binaries of their own:
//! each runs clusters of namespaces or a VM for minutes, and apart they run one after another.

#[path = "support/node.rs"]
mod node;

mod binary;
mod cleanup;
mod debug_explain;
mod deploy;
mod docs;
mod explain;
mod init_only;
mod iptables_backend;
mod ipvs_fallback;
mod readme;
