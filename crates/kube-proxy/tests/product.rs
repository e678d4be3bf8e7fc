//! The proxy binary's integration tests that need no cluster, in one binary (one link, one
//! run; issue 37): each module is one suite, named as its file (`cargo test -p kube-proxy
//! --test product cleanup::`): flags and exits, `--cleanup`, `--init-only` and the deploy
//! files against a throwaway node namespace, `explain`, and the checks that README,
//! docs/ and CI agree with the code. The suites that run clusters of namespaces or the VM are
//! the `traffic` binary's; the image suite and the demo are binaries of their own
//! (docs/testing.md says why).

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
