//! What the proxy binary's traffic suites share (issue 37: one library instead of a file
//! included into six test binaries): the mode under test, its flags and manifests
//! ([`support`]), and the scenarios every kernel mode runs ([`scenarios`]), which the
//! `traffic` suite runs against the built binary and the `image` suite inside the runtime
//! image.
//!
//! The suites are `kube-proxy`'s test binaries (`traffic`, `faults`, `image`,
//! `sctp_traffic`, `ipvs_traffic`, `winuserspace`); [`support::kube_proxy`] finds the binary
//! cargo built for them next to the running test executable.

pub mod scenarios;
pub mod support;
