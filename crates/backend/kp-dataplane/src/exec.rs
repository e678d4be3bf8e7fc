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

use std::collections::BTreeMap;
#[cfg(any(test, feature = "test-util"))]
use std::collections::{BTreeSet, VecDeque};
#[cfg(any(test, feature = "test-util"))]
use std::fmt;
use std::io::{Read as _, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_core::model::IpFamily;
use kp_rules::iptables::Table;
use tokio::io::AsyncWriteExt as _;
use tokio::process::Command;

use crate::blocking::blocking;

/// How long to wait for the xtables lock (`-w`). Upstream waits 5 s; another agent holding
/// the lock longer than that is stuck, and failing lets the runner retry with a full sync.
pub const DEFAULT_LOCK_WAIT_SECONDS: u32 = 5;

/// Keep at most this much of a tool's stderr in an error: `iptables-restore` names the
/// failing line in its first lines, and an unbounded message would bloat logs.
const MAX_STDERR_BYTES: usize = 4096;

/// Why running an iptables tool failed.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The program could not be started: missing binary, wrong path, no permission.
    #[error("cannot run {program}")]
    Spawn {
        /// The program.
        program: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// The program ran and exited unsuccessfully.
    #[error("{program} failed (exit code {}): {stderr}", code.map_or("none".to_owned(), |c| c.to_string()))]
    Failed {
        /// The program.
        program: String,
        /// Its exit code (`None` if a signal killed it).
        code: Option<i32>,
        /// Its standard error, trimmed and cut to a few KiB.
        stderr: String,
    },
    /// Feeding the input or collecting the output failed although the program succeeded.
    #[error("talking to {program} failed")]
    Io {
        /// The program.
        program: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

impl ExecError {
    /// The program that failed.
    pub fn program(&self) -> &str {
        match self {
            ExecError::Spawn { program, .. }
            | ExecError::Failed { program, .. }
            | ExecError::Io { program, .. } => program,
        }
    }

    /// The exit code, if the program ran and failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            ExecError::Failed { code, .. } => *code,
            _ => None,
        }
    }
}

/// Which iptables binaries to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IptablesVariant {
    /// `iptables`, `iptables-save`, ...: whatever the system's alternatives point at (as
    /// upstream).
    #[default]
    System,
    /// `iptables-legacy`, ...: the xtables backend (much faster restores at scale here).
    Legacy,
    /// `iptables-nft`, ...: the nf_tables backend.
    Nft,
}

/// The paths (or `PATH`-relative names) of the six tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tools {
    /// The backend they belong to (for logs; the paths decide what runs).
    pub variant: IptablesVariant,
    /// `iptables`.
    pub iptables: PathBuf,
    /// `iptables-save`.
    pub iptables_save: PathBuf,
    /// `iptables-restore`.
    pub iptables_restore: PathBuf,
    /// `ip6tables`.
    pub ip6tables: PathBuf,
    /// `ip6tables-save`.
    pub ip6tables_save: PathBuf,
    /// `ip6tables-restore`.
    pub ip6tables_restore: PathBuf,
}

impl Tools {
    /// The tools of one variant, looked up on the `PATH`.
    pub fn new(variant: IptablesVariant) -> Self {
        let infix = match variant {
            IptablesVariant::System => "",
            IptablesVariant::Legacy => "-legacy",
            IptablesVariant::Nft => "-nft",
        };
        let name = |base: &str, suffix: &str| PathBuf::from(format!("{base}{infix}{suffix}"));
        Self {
            variant,
            iptables: name("iptables", ""),
            iptables_save: name("iptables", "-save"),
            iptables_restore: name("iptables", "-restore"),
            ip6tables: name("ip6tables", ""),
            ip6tables_save: name("ip6tables", "-save"),
            ip6tables_restore: name("ip6tables", "-restore"),
        }
    }

    /// `iptables` or `ip6tables`.
    pub fn iptables(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables,
            IpFamily::V6 => &self.ip6tables,
        }
    }

    /// `iptables-save` or `ip6tables-save`.
    pub fn save(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables_save,
            IpFamily::V6 => &self.ip6tables_save,
        }
    }

    /// `iptables-restore` or `ip6tables-restore`.
    pub fn restore(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables_restore,
            IpFamily::V6 => &self.ip6tables_restore,
        }
    }
}

/// The system's tools ([`IptablesVariant::System`]): what the `PATH` names `iptables`.
impl Default for Tools {
    fn default() -> Self {
        Self::new(IptablesVariant::System)
    }
}

/// The kernel backend an `iptables --version` line reports: `nf_tables` and `legacy` are
/// printed in parentheses by iptables >= 1.8; older versions only have the legacy backend.
pub fn backend_of_version(version: &str) -> IptablesVariant {
    if version.contains("(nf_tables)") {
        IptablesVariant::Nft
    } else {
        IptablesVariant::Legacy
    }
}

/// The three operations iptables mode needs. Implementations must be safe to share between
/// tasks; each call is independent.
pub trait RuleRunner: Send + Sync {
    /// Apply `input` atomically with `iptables-restore --noflush` (or `ip6tables-restore`).
    fn restore(
        &self,
        family: IpFamily,
        input: &str,
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// Apply `input` with `iptables-restore` in a new, empty network namespace that is then
    /// thrown away: everything the kernel checks when a restore commits is checked, and
    /// nothing on the node changes. Used to find which service breaks a restore whose error
    /// names no line of its own.
    fn restore_isolated(
        &self,
        family: IpFamily,
        input: &str,
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// [`RuleRunner::restore`] or [`RuleRunner::restore_isolated`] (`into`) of the input
    /// `feed` writes, which it may write in pieces as it produces them so that the whole
    /// input never has to exist at once (`kp_rules::iptables::render_to`). The default
    /// collects it and calls the other method; [`ExecRunner`] pipes it to the tool as it
    /// comes.
    fn restore_from<F>(
        &self,
        family: IpFamily,
        into: RestoreInto,
        feed: F,
    ) -> impl Future<Output = Result<(), ExecError>> + Send
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()> + Send,
    {
        async move {
            let mut input = Vec::new();
            feed(&mut input).map_err(|source| ExecError::Io {
                program: "restore input".to_owned(),
                source,
            })?;
            let input = String::from_utf8_lossy(&input);
            match into {
                RestoreInto::Node => self.restore(family, &input).await,
                RestoreInto::EmptyNamespace => self.restore_isolated(family, &input).await,
            }
        }
    }

    /// The output of `iptables-save -t <table>`.
    fn save(
        &self,
        family: IpFamily,
        table: Table,
    ) -> impl Future<Output = Result<String, ExecError>> + Send;

    /// The output of `iptables-save -t <table>` for each of `tables`: one run per table
    /// unless the runner reads them together ([`ExecRunner`] runs `iptables-save` once for
    /// all of them, where every run costs a process start and a read of the ruleset).
    fn save_tables(
        &self,
        family: IpFamily,
        tables: &[Table],
    ) -> impl Future<Output = Result<BTreeMap<Table, String>, ExecError>> + Send {
        async move {
            let mut saved = BTreeMap::new();
            for table in tables {
                saved.insert(*table, self.save(family, *table).await?);
            }
            Ok(saved)
        }
    }

    /// One `iptables` call (`-t nat -N CHAIN`, `-C ...`, `-I ... 1 ...`). Exit code 1 is an
    /// [`ExecError::Failed`] like any other; callers interpret it (rule or chain absent or
    /// present).
    fn run(
        &self,
        family: IpFamily,
        args: &[String],
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// The backend the tools belong to, for sync logs (`None`: not a real one, e.g. a fake).
    fn variant(&self) -> Option<IptablesVariant> {
        None
    }
}

/// Where [`RuleRunner::restore_from`] applies its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RestoreInto {
    /// This node's namespace, as [`RuleRunner::restore`].
    Node,
    /// A new, empty network namespace, as [`RuleRunner::restore_isolated`].
    EmptyNamespace,
}

/// util-linux's `unshare`, on the `PATH`: runs a restore in a network namespace of its own
/// ([`RuleRunner::restore_isolated`]); needs the `CAP_SYS_ADMIN` a kube-proxy pod has.
pub const UNSHARE_BINARY: &str = "unshare";

/// Runs the real tools with `tokio::process`.
#[derive(Clone, Debug, Default)]
pub struct ExecRunner {
    tools: Tools,
}

impl ExecRunner {
    /// A runner for `tools`.
    pub fn new(tools: Tools) -> Self {
        Self { tools }
    }

    /// The tools it runs.
    pub fn tools(&self) -> &Tools {
        &self.tools
    }

    /// `iptables --version`, for the start-up log (see [`backend_of_version`]).
    pub async fn version(&self) -> Result<String, ExecError> {
        let program = &self.tools.iptables;
        let output = run_program(program, &["--version".to_owned()], None).await?;
        Ok(output.trim().to_owned())
    }
}

impl ExecRunner {
    /// The program and arguments of a restore `into`.
    fn restore_command(&self, family: IpFamily, into: RestoreInto) -> (PathBuf, Vec<String>) {
        let restore = vec![
            "--noflush".to_owned(),
            format!("--wait={DEFAULT_LOCK_WAIT_SECONDS}"),
        ];
        match into {
            RestoreInto::Node => (self.tools.restore(family).clone(), restore),
            RestoreInto::EmptyNamespace => {
                let mut args = vec![
                    "--net".to_owned(),
                    "--".to_owned(),
                    self.tools.restore(family).display().to_string(),
                ];
                args.extend(restore);
                (PathBuf::from(UNSHARE_BINARY), args)
            }
        }
    }
}

impl RuleRunner for ExecRunner {
    async fn restore(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let (program, args) = self.restore_command(family, RestoreInto::Node);
        run_program(&program, &args, Some(input)).await?;
        Ok(())
    }

    async fn restore_isolated(&self, family: IpFamily, input: &str) -> Result<(), ExecError> {
        let (program, args) = self.restore_command(family, RestoreInto::EmptyNamespace);
        run_program(&program, &args, Some(input))
            .await
            .map_err(unshare_failure)?;
        Ok(())
    }

    /// The tool reads the input while `feed` produces it. `feed` is synchronous (a render),
    /// so this runs on the calling thread, handed over as a blocking section
    /// (`block_in_place`) on a multi-threaded runtime so the worker's other tasks move on.
    async fn restore_from<F>(
        &self,
        family: IpFamily,
        into: RestoreInto,
        feed: F,
    ) -> Result<(), ExecError>
    where
        F: FnOnce(&mut dyn Write) -> std::io::Result<()> + Send,
    {
        let (program, args) = self.restore_command(family, into);
        let result = blocking(|| stream_program(&program, &args, feed));
        match into {
            RestoreInto::Node => result,
            RestoreInto::EmptyNamespace => result.map_err(unshare_failure),
        }
    }

    async fn save(&self, family: IpFamily, table: Table) -> Result<String, ExecError> {
        let args = ["-t".to_owned(), table.as_str().to_owned()];
        run_program(self.tools.save(family), &args, None).await
    }

    /// One `iptables-save` of every table, cut into the ones asked for (a table the kernel
    /// does not have reads as empty, as `-t` of it prints nothing).
    async fn save_tables(
        &self,
        family: IpFamily,
        tables: &[Table],
    ) -> Result<BTreeMap<Table, String>, ExecError> {
        if tables.len() < 2 {
            let mut saved = BTreeMap::new();
            for table in tables {
                saved.insert(*table, self.save(family, *table).await?);
            }
            return Ok(saved);
        }
        let all = run_program(self.tools.save(family), &[], None).await?;
        Ok(split_save(&all, tables))
    }

    async fn run(&self, family: IpFamily, args: &[String]) -> Result<(), ExecError> {
        let mut full = vec!["-w".to_owned(), DEFAULT_LOCK_WAIT_SECONDS.to_string()];
        full.extend_from_slice(args);
        run_program(self.tools.iptables(family), &full, None).await?;
        Ok(())
    }

    fn variant(&self) -> Option<IptablesVariant> {
        Some(self.tools.variant)
    }
}

/// The sections (`*table` to `COMMIT`) of an `iptables-save` dump for each of `tables`; a
/// table the dump lacks is empty.
pub fn split_save(all: &str, tables: &[Table]) -> BTreeMap<Table, String> {
    let mut saved: BTreeMap<Table, String> = tables.iter().map(|t| (*t, String::new())).collect();
    let mut current: Option<Table> = None;
    for line in all.lines() {
        if let Some(name) = line.strip_prefix('*') {
            current = tables.iter().copied().find(|t| t.as_str() == name);
        }
        if let Some(text) = current.and_then(|t| saved.get_mut(&t)) {
            text.push_str(line);
            text.push('\n');
        }
        if line == "COMMIT" {
            current = None;
        }
    }
    saved
}

/// Runs `program args`, feeding `input` on stdin, and returns its stdout.
/// `unshare` itself failing (no `CAP_SYS_ADMIN` in an unprivileged container: "unshare:
/// unshare failed: Operation not permitted") exits 1 like a failing restore. It must not be
/// taken for the restore's verdict, or the search for a bad service would blame good ones;
/// it becomes [`ExecError::Spawn`] (the restore could not be run at all).
fn unshare_failure(error: ExecError) -> ExecError {
    match error {
        ExecError::Failed { stderr, .. } if stderr.starts_with("unshare:") => ExecError::Spawn {
            program: UNSHARE_BINARY.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, stderr),
        },
        other => other,
    }
}

pub(crate) async fn run_program(
    program: &PathBuf,
    args: &[String],
    input: Option<&str>,
) -> Result<String, ExecError> {
    let name = program.display().to_string();
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // A cancelled sync must not leave a restore running behind the next one. Killing a
        // restore is safe: it commits atomically or not at all.
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| ExecError::Spawn {
            program: name.clone(),
            source,
        })?;
    let stdin = child.stdin.take();
    // Write and wait concurrently: the tool may fill its stderr pipe before reading all input.
    let write = async {
        match (stdin, input) {
            (Some(mut stdin), Some(input)) => {
                let result = stdin.write_all(input.as_bytes()).await;
                drop(stdin);
                result
            }
            _ => Ok(()),
        }
    };
    let (written, output) = tokio::join!(write, child.wait_with_output());
    let output = output.map_err(|source| ExecError::Io {
        program: name.clone(),
        source,
    })?;
    if !output.status.success() {
        // A failed write (broken pipe) is a consequence of the tool exiting; its stderr says why.
        return Err(failed(name, output.status, &output.stderr));
    }
    written.map_err(|source| ExecError::Io {
        program: name,
        source,
    })?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `program args` with `feed` writing its standard input as it goes (blocking), and
/// checks its exit status; standard output is discarded. If `feed` fails for another reason
/// than the program closing its input, the program is killed before it sees the end of
/// the input, so a truncated input is never applied.
fn stream_program<F>(program: &Path, args: &[String], feed: F) -> Result<(), ExecError>
where
    F: FnOnce(&mut dyn Write) -> std::io::Result<()>,
{
    let name = program.display().to_string();
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ExecError::Spawn {
            program: name.clone(),
            source,
        })?;
    // Drained on a thread of its own: the tool may fill its stderr pipe before it reads all
    // of its input.
    let stderr = child.stderr.take();
    let drain = std::thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(mut stderr) = stderr {
            // Whatever could be read is the message.
            let _ = stderr.read_to_end(&mut text);
        }
        text
    });
    let mut stdin = child.stdin.take();
    let fed = match stdin.as_mut() {
        Some(stdin) => feed(stdin),
        None => Ok(()),
    };
    let killed = match &fed {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => {
            // Already exited if this fails; either way it must not commit what it got.
            let _ = child.kill();
            true
        }
        _ => false,
    };
    // Closing its input only now: a killed tool never sees the end of it.
    drop(stdin);
    let status = child.wait();
    let stderr = drain.join().unwrap_or_default();
    let status = status.map_err(|source| ExecError::Io {
        program: name.clone(),
        source,
    })?;
    if !status.success() && !killed {
        // A failed write (broken pipe) is a consequence of the tool exiting; its stderr says why.
        return Err(failed(name, status, &stderr));
    }
    fed.map_err(|source| ExecError::Io {
        program: name,
        source,
    })
}

/// The failure of `program`, which exited with `status` and wrote `stderr`. A tool killed
/// by a signal (nft 1.0.x segfaulting on another table's set, kubernetes#136786) prints
/// nothing itself, so the signal is named where its message would be.
pub(crate) fn failed(
    program: String,
    status: std::process::ExitStatus,
    stderr: &[u8],
) -> ExecError {
    use std::os::unix::process::ExitStatusExt as _;
    let mut stderr = trimmed(stderr);
    if let Some(signal) = status.signal() {
        let sep = if stderr.is_empty() { "" } else { "; " };
        stderr = format!("{stderr}{sep}killed by signal {signal}");
    }
    ExecError::Failed {
        program,
        code: status.code(),
        stderr,
    }
}

/// Standard error as one readable string of bounded size.
fn trimmed(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let text = text.trim();
    if text.len() <= MAX_STDERR_BYTES {
        return text.to_owned();
    }
    let mut end = MAX_STDERR_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// Split a rule specification the way `iptables-restore` and a shell do for our rules:
/// on spaces, with double-quoted parts (comments) kept whole and the quotes removed.
///
/// Comments are percent-encoded by the renderer, so they never contain quotes or
/// backslashes; `iptables-save` output uses the same quoting.
pub fn split_args(spec: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut current = String::new();
    let mut in_quotes = false;
    let mut has_token = false;
    for c in spec.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                has_token = true;
            }
            ' ' | '\t' if !in_quotes => {
                if has_token {
                    args.push(std::mem::take(&mut current));
                    has_token = false;
                }
            }
            _ => {
                current.push(c);
                has_token = true;
            }
        }
    }
    if has_token {
        args.push(current);
    }
    args
}

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
/// Decides whether a fake restore fails, given its input.
type RestoreFailure = Box<dyn Fn(IpFamily, &str) -> bool + Send>;

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
/// A [`RuleRunner`] that records every call and never touches the kernel.
///
/// It models just enough of `iptables` for setup logic: `-N` fails with exit code 1 if the
/// chain exists, `-C` succeeds iff an equal rule was inserted, `-I`/`-A`/`-D` maintain that
/// set. Restores succeed unless scripted to fail. Clones share the record.
#[derive(Clone, Default)]
pub struct FakeRunner {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
impl fmt::Debug for FakeRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeRunner")
            .field("calls", &self.lock().calls.len())
            .finish()
    }
}

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
/// The fake's stand-in for a failing command.
fn fake_failure(program: &str, code: i32, stderr: &str) -> ExecError {
    ExecError::Failed {
        program: program.to_owned(),
        code: Some(code),
        stderr: stderr.to_owned(),
    }
}

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unshare_refused_is_not_a_restore_verdict() {
        // What util-linux prints without CAP_SYS_ADMIN (measured here under
        // `setpriv --bounding-set=-sys_admin`).
        let refused = ExecError::Failed {
            program: UNSHARE_BINARY.to_owned(),
            code: Some(1),
            stderr: "unshare: unshare failed: Operation not permitted".to_owned(),
        };
        assert!(matches!(
            unshare_failure(refused),
            ExecError::Spawn { ref program, .. } if program == UNSHARE_BINARY
        ));
        let restore_failed = ExecError::Failed {
            program: UNSHARE_BINARY.to_owned(),
            code: Some(2),
            stderr: "iptables-restore: line 5 failed".to_owned(),
        };
        assert_eq!(unshare_failure(restore_failed).exit_code(), Some(2));
    }

    #[test]
    fn one_save_is_cut_into_the_tables_asked_for() {
        let all = "# Generated by iptables-nft-save\n*mangle\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n\
                   *nat\n:KUBE-SERVICES - [0:0]\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n\
                   *filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n# Completed\n";
        let saved = split_save(all, &[Table::Nat, Table::Filter]);
        let none = split_save("*filter\nCOMMIT\n", &[Table::Mangle]);
        assert_eq!(none[&Table::Mangle], "");
        assert_eq!(
            saved[&Table::Nat],
            "*nat\n:KUBE-SERVICES - [0:0]\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n"
        );
        assert_eq!(
            saved[&Table::Filter],
            "*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n"
        );
        assert_eq!(saved.len(), 2);
    }

    #[test]
    fn split_keeps_quoted_comments_whole() {
        let spec = "-m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES";
        assert_eq!(
            split_args(spec),
            [
                "-m",
                "conntrack",
                "--ctstate",
                "NEW",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES"
            ]
        );
        assert_eq!(split_args("  -j   X  "), ["-j", "X"]);
        assert_eq!(
            split_args("--comment \"\" -j X"),
            ["--comment", "", "-j", "X"]
        );
    }

    #[test]
    fn variants_name_the_right_binaries() {
        let legacy = Tools::new(IptablesVariant::Legacy);
        assert_eq!(
            legacy.restore(IpFamily::V4),
            &PathBuf::from("iptables-legacy-restore")
        );
        assert_eq!(
            legacy.save(IpFamily::V6),
            &PathBuf::from("ip6tables-legacy-save")
        );
        let system = Tools::new(IptablesVariant::System);
        assert_eq!(system.iptables(IpFamily::V4), &PathBuf::from("iptables"));
        assert_eq!(
            Tools::new(IptablesVariant::Nft).restore(IpFamily::V6),
            &PathBuf::from("ip6tables-nft-restore")
        );
    }

    #[test]
    fn version_lines_name_the_backend() {
        assert_eq!(
            backend_of_version("iptables v1.8.9 (nf_tables)"),
            IptablesVariant::Nft
        );
        assert_eq!(
            backend_of_version("iptables v1.8.9 (legacy)"),
            IptablesVariant::Legacy
        );
        assert_eq!(
            backend_of_version("iptables v1.6.1"),
            IptablesVariant::Legacy
        );
    }

    #[test]
    fn long_stderr_is_cut_on_a_char_boundary() {
        let long = "é".repeat(MAX_STDERR_BYTES);
        let out = trimmed(long.as_bytes());
        assert!(out.len() <= MAX_STDERR_BYTES + 3);
        assert!(out.ends_with("..."));
    }

    #[tokio::test]
    async fn a_missing_binary_is_a_spawn_error() {
        let tools = Tools {
            iptables_restore: PathBuf::from("/nonexistent/kp-dataplane-test/iptables-restore"),
            ..Tools::default()
        };
        let runner = ExecRunner::new(tools);
        let err = runner
            .restore(IpFamily::V4, "*nat\nCOMMIT\n")
            .await
            .expect_err("a missing binary cannot succeed");
        assert!(matches!(err, ExecError::Spawn { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/kp-dataplane-test"));
    }

    #[tokio::test]
    async fn failures_carry_exit_code_and_stderr() {
        // `sh` stands in for a restore tool: reads its input, complains, fails.
        let err = run_program(
            &PathBuf::from("sh"),
            &[
                "-c".to_owned(),
                "cat >/dev/null; echo 'line 3: bad' >&2; exit 2".to_owned(),
            ],
            Some("*nat\nCOMMIT\n"),
        )
        .await
        .expect_err("exit 2 is a failure");
        assert_eq!(err.exit_code(), Some(2));
        assert!(err.to_string().contains("line 3: bad"), "{err}");
    }

    #[tokio::test]
    async fn a_tool_killed_by_a_signal_is_named_so() {
        // As nft 1.0.x segfaulting on another table's set: nothing on stderr, no exit code.
        let err = run_program(
            &PathBuf::from("sh"),
            &["-c".to_owned(), "cat >/dev/null; kill -SEGV $$".to_owned()],
            Some("add table ip t\n"),
        )
        .await
        .expect_err("a signal is a failure");
        assert_eq!(err.exit_code(), None);
        assert!(err.to_string().contains("killed by signal 11"), "{err}");
    }

    #[tokio::test]
    async fn large_inputs_are_fed_completely() {
        let input = "x".repeat(1 << 20);
        let out = run_program(
            &PathBuf::from("sh"),
            &["-c".to_owned(), "wc -c".to_owned()],
            Some(&input),
        )
        .await
        .expect("wc succeeds");
        assert_eq!(out.trim(), (1 << 20).to_string());
    }

    /// `feed` writes 1 MiB in 1 KiB pieces.
    fn mebibyte(out: &mut dyn Write) -> std::io::Result<()> {
        for _ in 0..1024 {
            out.write_all(&[b'x'; 1024])?;
        }
        Ok(())
    }

    #[test]
    fn streamed_inputs_are_fed_completely_and_failures_keep_stderr() {
        let sh = PathBuf::from("sh");
        let script = |s: &str| ["-c".to_owned(), s.to_owned()];
        stream_program(&sh, &script("test \"$(wc -c)\" = 1048576"), mebibyte)
            .expect("the whole input arrives");
        // Exits before reading: the broken pipe is a consequence, the exit code the verdict.
        let err = stream_program(&sh, &script("echo 'line 3: bad' >&2; exit 2"), mebibyte)
            .expect_err("exit 2 is a failure");
        assert_eq!(err.exit_code(), Some(2));
        assert!(err.to_string().contains("line 3: bad"), "{err}");
    }

    #[test]
    fn a_feed_that_fails_kills_the_tool_before_it_sees_the_end() {
        let marker = std::env::temp_dir().join(format!("kp-exec-feed-{}", std::process::id()));
        let _ = std::fs::remove_file(&marker);
        // Would create the marker only after reading to the end of its input.
        let script = format!("cat >/dev/null && touch {}", marker.display());
        let err = stream_program(
            &PathBuf::from("sh"),
            &["-c".to_owned(), script],
            |out: &mut dyn Write| {
                out.write_all(b"*nat\n")?;
                Err(std::io::Error::other("render stopped"))
            },
        )
        .expect_err("the feed failed");
        assert!(matches!(err, ExecError::Io { .. }), "{err}");
        assert!(
            !marker.exists(),
            "the tool saw the end of a truncated input"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn streamed_restores_run_on_a_multi_threaded_runtime() {
        let tools = Tools {
            iptables_restore: PathBuf::from("/nonexistent/kp-dataplane-test/iptables-restore"),
            ..Tools::default()
        };
        let err = ExecRunner::new(tools)
            .restore_from(IpFamily::V4, RestoreInto::Node, mebibyte)
            .await
            .expect_err("a missing binary cannot succeed");
        assert!(matches!(err, ExecError::Spawn { .. }), "{err}");
    }

    #[tokio::test]
    async fn fake_models_chain_and_rule_checks() {
        let fake = FakeRunner::new();
        let args = |s: &str| split_args(s);
        let family = IpFamily::V4;
        assert!(fake.run(family, &args("-t nat -N KUBE-X")).await.is_ok());
        let again = fake.run(family, &args("-t nat -N KUBE-X")).await;
        assert_eq!(again.expect_err("exists").exit_code(), Some(1));
        let check = fake.run(family, &args("-t nat -C OUTPUT -j KUBE-X")).await;
        assert_eq!(check.expect_err("absent").exit_code(), Some(1));
        assert!(
            fake.run(family, &args("-t nat -I OUTPUT 1 -j KUBE-X"))
                .await
                .is_ok()
        );
        assert!(
            fake.run(family, &args("-t nat -C OUTPUT -j KUBE-X"))
                .await
                .is_ok()
        );
        // Other family, other table: independent.
        assert!(
            fake.run(IpFamily::V6, &args("-t nat -C OUTPUT -j KUBE-X"))
                .await
                .is_err()
        );
        fake.script_restores([true, false]);
        assert!(fake.restore(family, "a").await.is_err());
        assert!(fake.restore(family, "b").await.is_ok());
        assert_eq!(fake.restores().len(), 2);
    }
}
