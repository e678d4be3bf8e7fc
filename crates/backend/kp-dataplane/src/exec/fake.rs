//! [`FakeRunner`] (`test-util`): a [`RuleRunner`] that records every call ([`RunnerCall`])
//! and models just enough of `iptables` for the setup logic, never touching the kernel.

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_core::model::IpFamily;
use kp_rules::iptables::Table;

use super::{ExecError, RuleRunner, split_args};

/// One call seen by [`FakeRunner`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunnerCall {
    /// [`RuleRunner::restore`].
    Restore {
        /// The family.
        family: IpFamily,
        /// The restore input.
        input: String,
    },
    /// [`RuleRunner::restore_isolated`].
    RestoreIsolated {
        /// The family.
        family: IpFamily,
        /// The restore input.
        input: String,
    },
    /// [`RuleRunner::save`].
    Save {
        /// The family.
        family: IpFamily,
        /// The table.
        table: Table,
    },
    /// [`RuleRunner::run`].
    Run {
        /// The family.
        family: IpFamily,
        /// The arguments.
        args: Vec<String>,
    },
}

impl fmt::Display for RunnerCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RunnerCall::Restore { family, input } => {
                write!(f, "restore {family:?} ({} lines)", input.lines().count())
            }
            RunnerCall::RestoreIsolated { family, input } => write!(
                f,
                "restore in an empty namespace {family:?} ({} lines)",
                input.lines().count()
            ),
            RunnerCall::Save { family, table } => write!(f, "save {family:?} {}", table.as_str()),
            RunnerCall::Run { family, args } => write!(f, "run {family:?} {}", args.join(" ")),
        }
    }
}

/// Decides whether a fake restore fails, given its input.
type RestoreFailure = Box<dyn Fn(IpFamily, &str) -> bool + Send>;

#[derive(Default)]
struct FakeState {
    calls: Vec<RunnerCall>,
    /// Outcomes of the next restores, in order (`true`: fail).
    scripted: VecDeque<bool>,
    /// Consulted when nothing is scripted.
    fail_when: Option<RestoreFailure>,
    /// `iptables-save` output per family and table.
    saves: Vec<((IpFamily, Table), String)>,
    /// Chains created with `-N`.
    chains: BTreeSet<(IpFamily, String, String)>,
    /// Rules inserted with `-I` or `-A`: (family, table, chain, spec).
    rules: BTreeSet<(IpFamily, String, String, String)>,
    /// `save` without a set output prints the modelled chains and rules.
    save_modelled: bool,
}

/// A [`RuleRunner`] that records every call and never touches the kernel.
///
/// It models just enough of `iptables` for setup logic: `-N` fails with exit code 1 if the
/// chain exists, `-C` succeeds iff an equal rule was inserted, `-I`/`-A`/`-D` maintain that
/// set. Restores succeed unless scripted to fail. Clones share the record.
#[derive(Clone, Default)]
pub struct FakeRunner {
    state: Arc<Mutex<FakeState>>,
}

impl fmt::Debug for FakeRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeRunner")
            .field("calls", &self.lock().calls.len())
            .finish()
    }
}

impl FakeRunner {
    /// A fake whose restores succeed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Make the next `n` restores fail.
    pub fn fail_next_restores(&self, n: usize) {
        self.lock().scripted.extend(std::iter::repeat_n(true, n));
    }

    /// Script the outcome of the next restores in order (`true`: fail).
    pub fn script_restores(&self, outcomes: impl IntoIterator<Item = bool>) {
        self.lock().scripted.extend(outcomes);
    }

    /// Fail every unscripted restore for which `fail` returns true.
    pub fn fail_restores_when(&self, fail: impl Fn(IpFamily, &str) -> bool + Send + 'static) {
        self.lock().fail_when = Some(Box::new(fail));
    }

    /// What `save(family, table)` returns (default: an empty string).
    pub fn set_save(&self, family: IpFamily, table: Table, output: impl Into<String>) {
        let mut state = self.lock();
        state.saves.retain(|(key, _)| *key != (family, table));
        state.saves.push(((family, table), output.into()));
    }

    /// From now on `save(family, table)` without an output set by
    /// [`FakeRunner::set_save`] prints the chains and rules modelled from `-N`, `-I`, `-A`
    /// and `-D` calls and from successful restores (a declared chain is created or flushed,
    /// its `-A` and `-I` lines added; rule order is not modelled).
    pub fn save_modelled(&self) {
        self.lock().save_modelled = true;
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<RunnerCall> {
        self.lock().calls.clone()
    }

    /// The inputs of every restore so far (failed ones included).
    pub fn restores(&self) -> Vec<(IpFamily, String)> {
        self.lock()
            .calls
            .iter()
            .filter_map(|call| match call {
                RunnerCall::Restore { family, input } => Some((*family, input.clone())),
                _ => None,
            })
            .collect()
    }

    /// Forget the recorded calls (the modelled chains and rules stay).
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        // Only a panicking test can poison this; keep the record usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl FakeState {
    /// Applies restore `input` to the modelled chains and rules ([`FakeRunner::save_modelled`]).
    fn model_restore(&mut self, family: IpFamily, input: &str) {
        let mut table = String::new();
        for line in input.lines() {
            if let Some(name) = line.strip_prefix('*') {
                table = name.to_owned();
            } else if let Some(rest) = line.strip_prefix(':') {
                let chain = rest.split(' ').next().unwrap_or_default().to_owned();
                self.rules
                    .retain(|(f, t, c, _)| !(*f == family && *t == table && *c == chain));
                self.chains.insert((family, table.clone(), chain));
            } else {
                let words = split_args(line);
                let (chain, spec) = match words.as_slice() {
                    [op, chain, spec @ ..] if op == "-A" => (chain, spec),
                    [op, chain, _position, spec @ ..] if op == "-I" => (chain, spec),
                    _ => continue,
                };
                let key = (family, table.clone(), chain.clone(), spec.join(" "));
                self.rules.insert(key);
            }
        }
    }

    /// The modelled chains and rules of one table, as `iptables-save -t` prints them.
    fn modelled(&self, family: IpFamily, table: &str) -> String {
        let mut out = format!("*{table}\n");
        for (_, _, chain) in self
            .chains
            .iter()
            .filter(|(f, t, _)| *f == family && t == table)
        {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for (_, _, chain, spec) in self
            .rules
            .iter()
            .filter(|(f, t, _, _)| *f == family && t == table)
        {
            out.push_str(&format!("-A {chain} {spec}\n"));
        }
        out.push_str("COMMIT\n");
        out
    }
}

/// The fake's stand-in for a failing command.
fn fake_failure(program: &str, code: i32, stderr: &str) -> ExecError {
    ExecError::Failed {
        program: program.to_owned(),
        code: Some(code),
        stderr: stderr.to_owned(),
    }
}

impl RuleRunner for FakeRunner {
    async fn restore(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.calls.push(RunnerCall::Restore {
            family,
            input: input.to_owned(),
        });
        let fail = match state.scripted.pop_front() {
            Some(fail) => fail,
            None => state.fail_when.as_ref().is_some_and(|f| f(family, input)),
        };
        if fail {
            return Err(fake_failure(
                "fake-iptables-restore",
                1,
                "injected failure\nError occurred at line: 1",
            ));
        }
        if state.save_modelled {
            state.model_restore(family, input);
        }
        Ok(())
    }

    /// Fails iff [`FakeRunner::fail_restores_when`] says so: a failure that depends on the
    /// content reproduces in an empty namespace; scripted ones model the node and do not.
    async fn restore_isolated(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.calls.push(RunnerCall::RestoreIsolated {
            family,
            input: input.to_owned(),
        });
        if state.fail_when.as_ref().is_some_and(|f| f(family, input)) {
            return Err(fake_failure(
                "fake-iptables-restore",
                1,
                "injected failure\nError occurred at line: 1",
            ));
        }
        Ok(())
    }

    async fn save(&self, family: IpFamily, table: Table) -> Result<String, ExecError> {
        let mut state = self.lock();
        state.calls.push(RunnerCall::Save { family, table });
        let set = state
            .saves
            .iter()
            .find(|(key, _)| *key == (family, table))
            .map(|(_, text)| text.clone());
        Ok(match set {
            Some(text) => text,
            None if state.save_modelled => state.modelled(family, table.as_str()),
            None => String::new(),
        })
    }

    async fn run(&self, family: IpFamily, args: &[String]) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.calls.push(RunnerCall::Run {
            family,
            args: args.to_vec(),
        });
        let (table, rest) = match args {
            [flag, table, rest @ ..] if flag == "-t" => (table.clone(), rest),
            rest => ("filter".to_owned(), rest),
        };
        match rest {
            [op, chain] if op == "-N" => {
                if state.chains.insert((family, table, chain.clone())) {
                    Ok(())
                } else {
                    Err(fake_failure("fake-iptables", 1, "Chain already exists."))
                }
            }
            [op, chain, spec @ ..] if op == "-C" => {
                let key = (family, table, chain.clone(), spec.join(" "));
                if state.rules.contains(&key) {
                    Ok(())
                } else {
                    Err(fake_failure("fake-iptables", 1, "Bad rule"))
                }
            }
            [op, chain, _position, spec @ ..] if op == "-I" => {
                state
                    .rules
                    .insert((family, table, chain.clone(), spec.join(" ")));
                Ok(())
            }
            [op, chain, spec @ ..] if op == "-A" => {
                state
                    .rules
                    .insert((family, table, chain.clone(), spec.join(" ")));
                Ok(())
            }
            [op, chain, spec @ ..] if op == "-D" => {
                let key = (family, table, chain.clone(), spec.join(" "));
                if state.rules.remove(&key) {
                    Ok(())
                } else {
                    Err(fake_failure("fake-iptables", 1, "Bad rule"))
                }
            }
            _ => Ok(()),
        }
    }
}
