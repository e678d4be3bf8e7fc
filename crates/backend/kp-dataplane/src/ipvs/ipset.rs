//! Running `ipset save` and `ipset restore`, and reading every set's entry count over
//! netlink (module `netlink`), behind [`IpsetRunner`] with an in-memory fake that applies
//! restore input the way ipset does.

mod netlink;

use std::future::Future;
use std::path::PathBuf;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

#[cfg(any(test, feature = "test-util"))]
use kp_rules::ipvs::ipset::{SavedSets, parse_save};

use crate::exec::{ExecError, run_program};

pub use netlink::{Counts, IpsetNetlinkError};

/// The ipset operations ipvs mode needs.
pub trait IpsetRunner: Send + Sync {
    /// `ipset save` output.
    fn save(&self) -> impl Future<Output = Result<String, ExecError>> + Send;
    /// Every set's entry count (`None` where the kernel reports none), read from the sets'
    /// headers alone: the canary check.
    fn entry_counts(&self) -> impl Future<Output = Result<Counts, IpsetNetlinkError>> + Send;
    /// `ipset restore` with `input` on stdin.
    fn restore(&self, input: &str) -> impl Future<Output = Result<(), ExecError>> + Send;
}

/// The `ipset` binary on the `PATH`.
pub const DEFAULT_IPSET_BINARY: &str = "ipset";

/// The real `ipset` binary (`DEFAULT_IPSET_BINARY`), run through the shared exec layer
/// (killed when a cancelled sync drops it, as every tool the backends run); entry counts come
/// over netlink, on a blocking thread.
#[derive(Clone, Debug, Default)]
pub struct ExecIpset;

impl IpsetRunner for ExecIpset {
    async fn save(&self) -> Result<String, ExecError> {
        run_program(
            &PathBuf::from(DEFAULT_IPSET_BINARY),
            &["save".to_owned()],
            None,
        )
        .await
    }

    async fn entry_counts(&self) -> Result<Counts, IpsetNetlinkError> {
        tokio::task::spawn_blocking(netlink::entry_counts)
            .await
            .map_err(|e| IpsetNetlinkError::Socket(std::io::Error::other(e)))?
    }

    async fn restore(&self, input: &str) -> Result<(), ExecError> {
        run_program(
            &PathBuf::from(DEFAULT_IPSET_BINARY),
            &["restore".to_owned()],
            Some(input),
        )
        .await
        .map(drop)
    }
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeState {
    sets: SavedSets,
    restores: Vec<String>,
    saves: usize,
}

#[cfg(any(test, feature = "test-util"))]
/// In-memory ipset: `create`, `add`, `del`, `flush`, `destroy` lines change its sets; `save`
/// prints them. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct FakeIpset {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
impl FakeIpset {
    /// No sets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every restore input so far.
    pub fn restores(&self) -> Vec<String> {
        self.lock().restores.clone()
    }

    /// How many times `ipset save` ran.
    pub fn saves(&self) -> usize {
        self.lock().saves
    }

    /// The sets now.
    pub fn sets(&self) -> SavedSets {
        self.lock().sets.clone()
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
impl IpsetRunner for FakeIpset {
    async fn save(&self) -> Result<String, ExecError> {
        let mut state = self.lock();
        state.saves += 1;
        let mut out = String::new();
        for (name, entries) in &state.sets {
            out.push_str(&format!("create {name} hash:ip\n"));
            for e in entries {
                out.push_str(&format!("add {name} {e}\n"));
            }
        }
        // Round-trips through the real parser, as the backend reads it.
        debug_assert_eq!(parse_save(&out), state.sets);
        Ok(out)
    }

    async fn entry_counts(&self) -> Result<Counts, IpsetNetlinkError> {
        let state = self.lock();
        Ok(state
            .sets
            .iter()
            .map(|(name, entries)| (name.clone(), Some(entries.len())))
            .collect())
    }

    async fn restore(&self, input: &str) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.restores.push(input.to_owned());
        for line in input.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["create", name, ..] => {
                    state.sets.entry((*name).to_owned()).or_default();
                }
                ["add", name, entry, ..] => {
                    state
                        .sets
                        .entry((*name).to_owned())
                        .or_default()
                        .insert((*entry).to_owned());
                }
                ["del", name, entry, ..] => {
                    if let Some(s) = state.sets.get_mut(*name) {
                        s.remove(*entry);
                    }
                }
                ["flush", name] => {
                    if let Some(s) = state.sets.get_mut(*name) {
                        s.clear();
                    }
                }
                ["destroy", name] => {
                    state.sets.remove(*name);
                }
                _ => {}
            }
        }
        Ok(())
    }
}
