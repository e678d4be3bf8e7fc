//! Running `nft`: [`NftRunner`], its real implementation [`ExecNft`] and the recording fake
//! `FakeNft` (`test-util`).
//!
//! nftables mode needs two operations per family: apply a script as one transaction (`nft -f
//! -`, atomic: the kernel takes all of it or nothing) and list what the `kube-proxy` table
//! holds (`nft -t list table`, without set elements, which may be many) to adopt what a
//! previous process left. The listing is parsed by [`parse_listing`].

#[cfg(any(test, feature = "test-util"))]
use std::collections::VecDeque;
#[cfg(any(test, feature = "test-util"))]
use std::fmt;
use std::path::PathBuf;
#[cfg(any(test, feature = "test-util"))]
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kp_core::model::IpFamily;
use kp_rules::nftables::{StepSink, TABLE, Transaction};

use crate::exec::{ExecError, run_program};

/// The nft binary, looked up on the `PATH`.
pub const DEFAULT_NFT_BINARY: &str = "nft";

/// What `nft` prints when a table (or any object) does not exist.
const NOT_FOUND: &str = "No such file or directory";

/// The nftables family keyword of an IP family (`ip`, `ip6`).
pub fn table_family(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// The two operations nftables mode needs. Implementations must be safe to share between
/// tasks.
pub trait NftRunner: Send + Sync {
    /// Apply `transaction` (`nft -f -` with its text, or its commands over netlink). A
    /// large full sync may go as several kernel transactions in the safe order of
    /// [`Transaction::steps`]; on error, the failed one changed nothing.
    fn apply(
        &self,
        transaction: &Transaction,
    ) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// Whether [`NftRunner::apply`] sends `transaction` as several kernel transactions, so
    /// that a failure may leave some of them applied.
    fn splits(&self, transaction: &Transaction) -> bool {
        let _ = transaction;
        false
    }

    /// Run `render` (a full sync rendered with
    /// [`render_in_steps`](kp_rules::nftables::render_in_steps)) with a sink that applies
    /// each step as a kernel transaction of its own as soon as it is rendered (blocking), so
    /// that a large full sync is never in memory as a whole. `None` when this runner does not
    /// apply steps (the default): the caller renders the whole transaction and calls
    /// [`NftRunner::apply`].
    fn apply_in_steps<T>(
        &self,
        render: impl FnOnce(&mut dyn StepSink<Error = StepFailed>) -> T,
    ) -> Option<T> {
        let _ = render;
        None
    }

    /// The table `<family> kube-proxy` as `nft -t list table` prints it (set elements
    /// omitted), or `None` when there is no such table.
    fn list_table(
        &self,
        family: IpFamily,
    ) -> impl Future<Output = Result<Option<String>, ExecError>> + Send;

    /// Whether the table `<family> kube-proxy` exists (the canary check, so cheaper than a
    /// listing where the runner can).
    fn table_exists(
        &self,
        family: IpFamily,
    ) -> impl Future<Output = Result<bool, ExecError>> + Send {
        async move { Ok(self.list_table(family).await?.is_some()) }
    }
}

/// Why a step given to [`NftRunner::apply_in_steps`]'s sink was not applied; either way
/// nothing of that step was.
#[derive(Debug, thiserror::Error)]
pub enum StepFailed {
    /// The encoder refused a command of the step (nothing was sent): the sync may still go
    /// to `nft -f -` as a whole if no step before it was applied.
    #[error("statement not supported over netlink: {0}")]
    Refused(String),
    /// The kernel (or the socket) failed the step.
    #[error(transparent)]
    Failed(ExecError),
}

/// Runs the real `nft` with `tokio::process`.
#[derive(Clone, Debug)]
pub struct ExecNft {
    binary: PathBuf,
}

impl ExecNft {
    /// Run `binary` (for example [`DEFAULT_NFT_BINARY`]).
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
        }
    }

    /// `nft --version`, for the start-up log.
    pub async fn version(&self) -> Result<String, ExecError> {
        let out = run_program(&self.binary, &["--version".to_owned()], None).await?;
        Ok(out.trim().to_owned())
    }
}

impl Default for ExecNft {
    fn default() -> Self {
        Self::new(DEFAULT_NFT_BINARY)
    }
}

impl ExecNft {
    /// `nft -f -` with `script`: one transaction.
    pub async fn apply_script(&self, script: &str) -> Result<(), ExecError> {
        run_program(
            &self.binary,
            &["-f".to_owned(), "-".to_owned()],
            Some(script),
        )
        .await
        .map_err(with_crash_hint)?;
        Ok(())
    }
}

impl ExecNft {
    /// Whether `nft -f` runs on this host: a check-only transaction (`nft -c`, which applies
    /// nothing) on a table of its own, for which nft loads the ruleset into its cache as it
    /// does for each of our scripts. nft 1.0.x dies doing that when another table holds a
    /// set a newer nft wrote (kubernetes#136786): the error then has no exit code and carries
    /// the crash hint (`CRASH_HINT`). Blocking; for start-up.
    pub fn check_scripts(&self) -> Result<(), ExecError> {
        use std::io::Write as _;
        use std::process::{Command, Stdio};
        const PROBE: &str = "add table ip kube-proxy-probe\nadd chain ip kube-proxy-probe c\n\
                             add rule ip kube-proxy-probe c accept\n";
        let program = self.binary.display().to_string();
        let spawn_error = |source| ExecError::Spawn {
            program: program.clone(),
            source,
        };
        let mut child = Command::new(&self.binary)
            .args(["-c", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_error)?;
        if let Some(mut stdin) = child.stdin.take() {
            // A write error is the tool exiting early; its status says why.
            let _ = stdin.write_all(PROBE.as_bytes());
        }
        let output = child.wait_with_output().map_err(|source| ExecError::Io {
            program: program.clone(),
            source,
        })?;
        if output.status.success() {
            return Ok(());
        }
        Err(with_crash_hint(crate::exec::failed(
            program,
            output.status,
            &output.stderr,
        )))
    }
}

/// What a crashed `nft -f` most likely means, added to its error.
pub const CRASH_HINT: &str = "nft 1.0.x crashes loading a ruleset in which another table holds \
     a set written by nft 1.1.2 or newer (kubernetes#136786); see docs/nftables-integration.md";

/// `err` with [`CRASH_HINT`] when a signal killed nft: `nft -f` loads every table of every
/// family into its cache, so one foreign table it cannot read fails each of our scripts, and
/// nft itself prints nothing.
fn with_crash_hint(err: ExecError) -> ExecError {
    match err {
        ExecError::Failed {
            program,
            code: None,
            stderr,
        } => ExecError::Failed {
            program,
            code: None,
            stderr: format!("{stderr} ({CRASH_HINT})"),
        },
        other => other,
    }
}

impl NftRunner for ExecNft {
    async fn apply(&self, transaction: &Transaction) -> Result<(), ExecError> {
        self.apply_script(&transaction.to_string()).await
    }

    async fn list_table(&self, family: IpFamily) -> Result<Option<String>, ExecError> {
        let args = ["-t", "list", "table", table_family(family), TABLE].map(str::to_owned);
        match run_program(&self.binary, &args, None).await {
            Ok(text) => Ok(Some(text)),
            Err(ExecError::Failed { stderr, .. }) if stderr.contains(NOT_FOUND) => Ok(None),
            Err(err) => Err(err),
        }
    }
}

/// The chains and sets (maps included) an `nft list table` output declares, in order; each
/// set with its timeout in whole seconds (`None` when it has none, or one that is not whole
/// seconds).
pub fn parse_listing(text: &str) -> (Vec<String>, Vec<(String, Option<u64>)>) {
    let (mut chains, mut sets) = (Vec::new(), Vec::new());
    // Whether the lines are inside the declaration of the last set.
    let mut in_set = false;
    for line in text.lines() {
        let line = line.trim();
        if line == "}" {
            in_set = false;
            continue;
        }
        if in_set && let Some(value) = line.strip_prefix("timeout ") {
            if let Some((_, timeout)) = sets.last_mut() {
                *timeout = parse_duration(value.trim());
            }
            continue;
        }
        let Some(head) = line.strip_suffix('{') else {
            continue;
        };
        let Some((kind, name)) = head.trim().split_once(' ') else {
            continue;
        };
        // nft quotes names that are not plain identifiers.
        let name = name.trim().trim_matches('"').to_owned();
        in_set = false;
        match kind {
            "chain" => chains.push(name),
            "set" | "map" => {
                sets.push((name, None));
                in_set = true;
            }
            _ => {}
        }
    }
    (chains, sets)
}

/// A duration as nft prints it (`60s`, `3h`, `1d3h46m40s`, `1m30s500ms`), in whole seconds.
fn parse_duration(text: &str) -> Option<u64> {
    let mut millis: u64 = 0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        let value: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_len] {
            "d" => 86_400_000,
            "h" => 3_600_000,
            "m" => 60_000,
            "s" => 1000,
            "ms" => 1,
            _ => return None,
        };
        millis = millis.checked_add(value.checked_mul(factor)?)?;
        rest = &rest[unit_len..];
    }
    (!text.is_empty() && millis.is_multiple_of(1000)).then_some(millis / 1000)
}

#[cfg(any(test, feature = "test-util"))]
/// One call seen by [`FakeNft`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NftCall {
    /// [`NftRunner::apply`], with the transaction's `nft -f` text.
    Apply(String),
    /// [`NftRunner::list_table`].
    List(IpFamily),
}

#[cfg(any(test, feature = "test-util"))]
impl fmt::Display for NftCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NftCall::Apply(script) => write!(f, "nft -f - ({} lines)", script.lines().count()),
            NftCall::List(family) => write!(f, "nft list table {}", table_family(*family)),
        }
    }
}

#[cfg(any(test, feature = "test-util"))]
/// Decides whether a fake apply fails, given its script.
type ApplyFailure = Box<dyn Fn(&str) -> bool + Send>;

#[cfg(any(test, feature = "test-util"))]
#[derive(Default)]
struct FakeState {
    calls: Vec<NftCall>,
    /// Outcomes of the next applies, in order (`true`: fail).
    scripted: VecDeque<bool>,
    /// Consulted when nothing is scripted.
    fail_when: Option<ApplyFailure>,
    /// `list_table` output per family (`None`: no table).
    listings: Vec<(IpFamily, String)>,
    /// Make `list_table` fail.
    list_fails: bool,
}

#[cfg(any(test, feature = "test-util"))]
/// An [`NftRunner`] that records every call and never touches the kernel. Applies succeed
/// unless scripted to fail; listings are whatever [`FakeNft::set_listing`] set (no table by
/// default). Clones share the record.
#[derive(Clone, Default)]
pub struct FakeNft {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
impl fmt::Debug for FakeNft {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakeNft")
            .field("calls", &self.lock().calls.len())
            .finish()
    }
}

#[cfg(any(test, feature = "test-util"))]
impl FakeNft {
    /// A fake whose applies succeed and which lists no table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Make the next `n` applies fail.
    pub fn fail_next(&self, n: usize) {
        self.lock().scripted.extend(std::iter::repeat_n(true, n));
    }

    /// Script the outcome of the next applies in order (`true`: fail).
    pub fn script_applies(&self, outcomes: impl IntoIterator<Item = bool>) {
        self.lock().scripted.extend(outcomes);
    }

    /// Fail every unscripted apply whose script `fail` accepts.
    pub fn fail_when(&self, fail: impl Fn(&str) -> bool + Send + 'static) {
        self.lock().fail_when = Some(Box::new(fail));
    }

    /// What `list_table(family)` returns from now on.
    pub fn set_listing(&self, family: IpFamily, text: impl Into<String>) {
        let mut state = self.lock();
        state.listings.retain(|(f, _)| *f != family);
        state.listings.push((family, text.into()));
    }

    /// Make `list_table` fail.
    pub fn fail_listing(&self) {
        self.lock().list_fails = true;
    }

    /// Every call so far.
    pub fn calls(&self) -> Vec<NftCall> {
        self.lock().calls.clone()
    }

    /// Every script applied so far (failed ones included).
    pub fn scripts(&self) -> Vec<String> {
        self.lock()
            .calls
            .iter()
            .filter_map(|c| match c {
                NftCall::Apply(script) => Some(script.clone()),
                NftCall::List(_) => None,
            })
            .collect()
    }

    /// Forget the recorded calls.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        // Only a panicking test can poison this; keep the record usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(any(test, feature = "test-util"))]
fn fake_failure(stderr: &str) -> ExecError {
    ExecError::Failed {
        program: DEFAULT_NFT_BINARY.to_owned(),
        code: Some(1),
        stderr: stderr.to_owned(),
    }
}

#[cfg(any(test, feature = "test-util"))]
impl NftRunner for FakeNft {
    async fn apply(&self, transaction: &Transaction) -> Result<(), ExecError> {
        let script = transaction.to_string();
        let mut state = self.lock();
        let fail = match state.scripted.pop_front() {
            Some(fail) => fail,
            None => state.fail_when.as_ref().is_some_and(|f| f(&script)),
        };
        state.calls.push(NftCall::Apply(script));
        if fail {
            return Err(fake_failure(
                "Error: Could not process rule: Device or resource busy (injected)",
            ));
        }
        Ok(())
    }

    async fn list_table(&self, family: IpFamily) -> Result<Option<String>, ExecError> {
        let mut state = self.lock();
        state.calls.push(NftCall::List(family));
        if state.list_fails {
            return Err(fake_failure("Error: injected listing failure"));
        }
        Ok(state
            .listings
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, text)| text.clone()))
    }
}
