//! Creating, emptying and deleting the harness's named network namespaces.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::command::{COMMAND_DEADLINE, check_prerequisites, in_namespace, ip, run_checked};
use crate::error::{Result, TestbedError};

/// Distinguishes the namespace sets one process creates (tests run in parallel threads).
static NEXT_RUN: AtomicU64 = AtomicU64::new(0);

/// The base of a new set of namespace names, `<prefix><pid>-<n>-`: unique in this process,
/// and of the form [`sweep_stale`] recognises.
pub(crate) fn next_base(prefix: &str) -> String {
    let run = NEXT_RUN.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}-{run}-", std::process::id())
}

/// Runs `args` (program first) inside `ns`, feeding `input`; its standard output, or an
/// error with its standard error.
pub(crate) fn exec_in(ns: &str, args: &[&str], input: Option<&str>) -> Result<String> {
    let Some((program, rest)) = args.split_first() else {
        return Err(TestbedError::InvalidName {
            name: String::new(),
            reason: "exec needs a program",
        });
    };
    let mut command = in_namespace(ns, program);
    command.args(rest);
    run_checked(&mut command, input, COMMAND_DEADLINE)
}

/// One network namespace of its own, for a proxy run that needs no cluster (a benchmark, a
/// check of what the proxy writes on an empty node): named like a cluster's namespaces
/// (`<prefix><pid>-<n>-<role>`, so [`sweep_stale`] removes it after a crash), loopback up,
/// and deleted, with every process still inside it, when dropped.
#[derive(Debug)]
pub struct Namespace {
    name: String,
    // Deletes the namespace on drop.
    _set: NamespaceSet,
}

impl Namespace {
    /// Creates `<prefix><pid>-<n>-<role>` (first removing leftovers of crashed runs under
    /// `prefix`) and brings its loopback up. Needs root, like a cluster.
    pub fn create(prefix: &str, role: &str) -> Result<Self> {
        check_prerequisites()?;
        crate::cluster::validate_prefix(prefix)?;
        sweep_stale(prefix)?;
        let name = format!("{}{role}", next_base(prefix));
        let mut set = NamespaceSet::default();
        set.create(&name)?;
        ip(["-n", &name, "link", "set", "lo", "up"])?;
        Ok(Self { name, _set: set })
    }

    /// The namespace's name (for `ip netns exec` and [`crate::proxy::ProxyLaunch::new`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `args` (program first) inside the namespace and returns its standard output;
    /// a non-zero exit is an error carrying its standard error.
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        exec_in(&self.name, args, None)
    }

    /// A command running `program` inside the namespace (`ip netns exec`, which execs it),
    /// for callers that want its status and output as they are.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        in_namespace(&self.name, program)
    }
}

/// The names of all named network namespaces (`ip netns list`).
pub fn list_namespaces() -> Result<Vec<String>> {
    let listing = ip(["netns", "list"])?;
    // Each line is `name` or `name (id: N)`.
    Ok(listing
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// Kills every process still inside `ns` (echo servers, a proxy under test a test forgot)
/// and deletes it. A namespace lives on while a process is inside it, with its veths, so
/// the processes must go first. Only ever called on this harness's own namespaces.
fn remove(ns: &str) -> Result<()> {
    let pids = ip(["netns", "pids", ns])?;
    for pid in pids.split_whitespace() {
        if pid.parse::<u32>().is_ok() {
            // Fails only if the process already exited.
            let _ = run_checked(
                Command::new("kill").args(["-KILL", pid]),
                None,
                COMMAND_DEADLINE,
            );
        }
    }
    ip(["netns", "delete", ns]).map(drop)
}

/// The namespaces one cluster created; dropping it deletes them (newest first), so
/// a failed build, a failed test or a panic leaves nothing behind.
#[derive(Debug, Default)]
pub(crate) struct NamespaceSet {
    names: Vec<String>,
}

impl NamespaceSet {
    /// Creates `name` and takes ownership of it.
    pub(crate) fn create(&mut self, name: &str) -> Result<()> {
        ip(["netns", "add", name])?;
        self.names.push(name.to_owned());
        Ok(())
    }

    /// Whether `name` is one of these namespaces.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Deletes every namespace, continuing past failures; returns the first failure.
    pub(crate) fn remove_all(&mut self) -> Result<()> {
        let mut first_error = None;
        while let Some(name) = self.names.pop() {
            if let Err(error) = remove(&name) {
                tracing::warn!(namespace = %name, %error, "could not delete test namespace");
                first_error.get_or_insert(error);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for NamespaceSet {
    fn drop(&mut self) {
        if let Err(error) = self.remove_all() {
            // Drop cannot fail; say it where test output shows it.
            eprintln!("kp-testbed: cleanup incomplete: {error}");
        }
    }
}

/// The process id embedded in a harness namespace name `<prefix><pid>-<n>-<role>`, or
/// `None` when the name is not one of this harness's under `prefix`.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let (pid, rest) = rest.split_once('-')?;
    let (run, _role) = rest.split_once('-')?;
    run.parse::<u64>().ok()?;
    pid.parse().ok()
}

/// Removes namespaces under `prefix` left by earlier runs that crashed or were killed
/// before their `Drop` ran (a process exit by signal skips destructors).
///
/// Only names of the harness's form `<prefix><pid>-<n>-<role>` whose `<pid>` is no longer a
/// running process are removed, so concurrently running suites keep theirs. Processes left
/// inside them are killed first. Returns the removed names. [`crate::ClusterBuilder::build`]
/// calls this for its prefix.
pub fn sweep_stale(prefix: &str) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for name in list_namespaces()? {
        let Some(pid) = owner_pid(&name, prefix) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        remove(&name)?;
        removed.push(name);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_only_matches_the_harness_form() {
        assert_eq!(owner_pid("kpt-123-4-node", "kpt-"), Some(123));
        assert_eq!(owner_pid("kpt-123-4-p-a", "kpt-"), Some(123));
        assert_eq!(owner_pid("kpt-x-123-4-node", "kpt-"), None);
        assert_eq!(owner_pid("kpt-123-node", "kpt-"), None);
        assert_eq!(owner_pid("other-123-4-node", "kpt-"), None);
    }
}
