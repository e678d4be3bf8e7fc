//! Running `ipset save` and `ipset restore`, behind [`IpsetRunner`] with an in-memory fake
//! that applies restore input the way ipset does.

use std::future::Future;
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_rules::ipvs::ipset::{SavedSets, parse_save};
use tokio::io::AsyncWriteExt as _;

use crate::exec::ExecError;

/// The two ipset operations ipvs mode needs.
pub trait IpsetRunner: Send + Sync {
    /// `ipset save` output.
    fn save(&self) -> impl Future<Output = Result<String, ExecError>> + Send;
    /// `ipset restore` with `input` on stdin.
    fn restore(&self, input: &str) -> impl Future<Output = Result<(), ExecError>> + Send;
}

/// The real `ipset` binary.
#[derive(Clone, Debug, Default)]
pub struct ExecIpset;

async fn run(args: &[&str], input: Option<&str>) -> Result<String, ExecError> {
    let command = format!("ipset {}", args.join(" "));
    let mut child = tokio::process::Command::new("ipset")
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ExecError::Spawn {
            program: command.clone(),
            source,
        })?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        stdin
            .write_all(text.as_bytes())
            .await
            .map_err(|source| ExecError::Io {
                program: command.clone(),
                source,
            })?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|source| ExecError::Io {
            program: command.clone(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(ExecError::Failed {
            program: command,
            code: out.status.code(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

impl IpsetRunner for ExecIpset {
    async fn save(&self) -> Result<String, ExecError> {
        run(&["save"], None).await
    }

    async fn restore(&self, input: &str) -> Result<(), ExecError> {
        run(&["restore"], Some(input)).await.map(drop)
    }
}

#[derive(Debug, Default)]
struct FakeState {
    sets: SavedSets,
    restores: Vec<String>,
}

/// In-memory ipset: `create`, `add`, `del`, `flush`, `destroy` lines change its sets; `save`
/// prints them. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct FakeIpset {
    state: Arc<Mutex<FakeState>>,
}

impl FakeIpset {
    /// No sets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every restore input so far.
    pub fn restores(&self) -> Vec<String> {
        self.lock().restores.clone()
    }

    /// The sets now.
    pub fn sets(&self) -> SavedSets {
        self.lock().sets.clone()
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl IpsetRunner for FakeIpset {
    async fn save(&self) -> Result<String, ExecError> {
        let state = self.lock();
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
