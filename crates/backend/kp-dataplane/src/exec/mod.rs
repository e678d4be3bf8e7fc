//! Running the iptables tools: [`RuleRunner`], its real implementation [`ExecRunner`] and the
//! recording fake `FakeRunner` (`test-util`).
//!
//! Everything the iptables mode does to the kernel goes through three operations: one atomic
//! `iptables-restore --noflush` per family and sync, `iptables-save -t <table>` to see what is
//! there, and single `iptables` calls for the few checks a restore cannot express (`-N`,
//! `-C`/`-I` of the jumps from the built-in chains).
//!
//! # Which iptables
//!
//! Mixing backends on one node is wrong (kubelet, the CNI plugin and the node's firewall must
//! share one), so the binary decides once at start-up which backend the node uses
//! ([`crate::xtables`], as upstream's image does with its iptables-wrapper) and passes that
//! backend's [`Tools`] (its `-legacy` or `-nft` binaries) to everything that runs one; there
//! is no process-wide choice. `Tools::default()` (and so `ExecRunner::default()`, for tests
//! and tools) is [`IptablesVariant::System`], whatever `iptables` the distribution's
//! alternatives point at. On our machines (`measured-here.md`) the legacy
//! backend restores upstream-shaped rulesets about 10x faster at scale (1,000 services x 10
//! endpoints: 0.84 s legacy vs 8.7 s nf_tables) and scales linearly, while the nf_tables
//! backend grows super-linearly with the size of one restore; [`backend_of_version`] tells
//! which one a binary uses, for logs.
//!
//! # Modules
//!
//! - `tools`: which binaries ([`IptablesVariant`], [`Tools`], [`backend_of_version`]);
//! - `runner`: the operations ([`RuleRunner`]) and the real runner ([`ExecRunner`]);
//! - `process`: running one program, and why it failed ([`ExecError`]);
//! - `text`: the tools' text ([`split_save`], [`split_args`]);
//! - `fake`: the recording fake (`FakeRunner`, `test-util`).

#[cfg(any(test, feature = "test-util"))]
mod fake;
mod process;
mod runner;
#[cfg(test)]
mod tests;
mod text;
mod tools;

#[cfg(any(test, feature = "test-util"))]
pub use fake::{FakeRunner, RunnerCall};
pub use process::ExecError;
pub(crate) use process::{failed, run_program};
pub use runner::{DEFAULT_LOCK_WAIT_SECONDS, ExecRunner, RestoreInto, RuleRunner, UNSHARE_BINARY};
pub use text::{split_args, split_save};
pub use tools::{IptablesVariant, Tools, backend_of_version};
