//! Creating, emptying and deleting the harness's named network namespaces.

use std::path::Path;
use std::process::Command;

use crate::command::{COMMAND_DEADLINE, ip, run_checked};
use crate::error::Result;

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
