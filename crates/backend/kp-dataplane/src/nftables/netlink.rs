//! [`NetlinkNft`]: applies the renderer's transactions over nf_tables netlink
//! ([`kp_nftnl`], encoding the typed commands) instead of `nft -f -`, falling back to `nft`
//! (with the transaction's text) for a command holding a value the encoder cannot send as
//! nft would.
//!
//! Why: before any command on a table, `nft` 1.0.6 dumps every chain of it into its cache
//! (0.3 s and 100 MB for one `add element` once the table holds 100k chains), and a large
//! script spends about half its time in nft's own parser. The encoded batch is the same
//! atomic transaction, without the dump; a large full sync goes as several transactions in
//! a safe order ([`kp_rules::nftables::Transaction::steps`]), each applied as soon as it is
//! rendered ([`NftRunner::apply_in_steps`]), so neither the commands nor the netlink bytes of
//! the whole sync are in memory at once.

use std::sync::{Arc, Mutex, PoisonError};

use kp_core::model::IpFamily;
use kp_nftnl::abi::NFTA_TABLE_NAME;
use kp_nftnl::codec::{MsgKind, attributes};
use kp_nftnl::{ApplyError, DEFAULT_MAX_STEP_COMMANDS, Family, NftSocket};
use kp_rules::nftables::{Command, StepSink, TABLE, Transaction};
use prometheus_client::metrics::counter::Counter;
use tracing::debug;

use super::runner::{ExecNft, NftRunner, StepFailed};
use crate::blocking::blocking;
use crate::exec::ExecError;

/// How netlink failures are named in [`ExecError::Failed`].
pub(crate) const PROGRAM: &str = "nf_tables netlink";

/// An [`NftRunner`] that sends transactions over netlink itself; listings and transactions
/// the encoder refuses go to `nft` ([`ExecNft`]). Clones share the socket.
#[derive(Clone, Debug)]
pub struct NetlinkNft {
    /// Opened on first use (in the namespace of the process), dropped after an I/O error.
    socket: Arc<Mutex<Option<NftSocket>>>,
    /// At most this many commands per kernel transaction of a split full sync.
    max_step: usize,
    fallback: ExecNft,
    fallbacks: Counter,
}

impl NetlinkNft {
    /// Fall back to `fallback`, counting each fallback in `fallbacks`.
    pub fn new(fallback: ExecNft, fallbacks: Counter) -> Self {
        Self {
            socket: Arc::new(Mutex::new(None)),
            max_step: DEFAULT_MAX_STEP_COMMANDS,
            fallback,
            fallbacks,
        }
    }

    /// Split full syncs into kernel transactions of at most `max_step` commands (default
    /// [`DEFAULT_MAX_STEP_COMMANDS`]; `usize::MAX`: never split).
    pub fn with_max_step(mut self, max_step: usize) -> Self {
        self.max_step = max_step.max(1);
        self
    }

    /// How many transactions went to `nft` because the encoder refused a command.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.get()
    }
}

impl Default for NetlinkNft {
    fn default() -> Self {
        Self::new(ExecNft::default(), Counter::default())
    }
}

/// Apply `transaction` through `socket` (opened if needed): the blocking part. Commands are
/// encoded one at a time into the batch of their step, so only the transaction and the
/// encoded bytes of one step are in memory at once.
fn apply_blocking(
    socket: &Mutex<Option<NftSocket>>,
    transaction: &Transaction,
    max_step: usize,
) -> Result<(), ApplyError> {
    let mut guard = socket.lock().unwrap_or_else(PoisonError::into_inner);
    let open = match guard.as_mut() {
        Some(open) => open,
        None => guard.insert(NftSocket::open()?),
    };
    let result = open.apply(transaction, max_step);
    if matches!(result, Err(ApplyError::Socket(_))) {
        // Start over with a fresh socket next time.
        *guard = None;
    }
    result
}

/// The sink of [`NftRunner::apply_in_steps`]: each step is encoded and sent as one kernel
/// transaction, then dropped by the renderer before the next is rendered.
struct NetlinkSteps<'a> {
    socket: &'a Mutex<Option<NftSocket>>,
    max_step: usize,
    /// Commands applied by earlier steps, so a kernel error names the statement's position
    /// in the whole sync.
    sent: usize,
}

impl StepSink for NetlinkSteps<'_> {
    type Error = StepFailed;

    fn max_commands(&self) -> usize {
        self.max_step
    }

    fn apply_step(&mut self, family: IpFamily, commands: &[Command]) -> Result<(), StepFailed> {
        let mut guard = self.socket.lock().unwrap_or_else(PoisonError::into_inner);
        let open = match guard.as_mut() {
            Some(open) => open,
            None => match NftSocket::open() {
                Ok(socket) => guard.insert(socket),
                Err(err) => return Err(StepFailed::Failed(exec_error(err))),
            },
        };
        let refs: Vec<&Command> = commands.iter().collect();
        match open.apply_commands(family, &refs, self.sent) {
            Ok(()) => {
                self.sent += commands.len();
                Ok(())
            }
            Err(ApplyError::Lower { error, .. }) => Err(StepFailed::Refused(error.to_string())),
            Err(err) => {
                if matches!(err, ApplyError::Socket(_)) {
                    // Start over with a fresh socket next time.
                    *guard = None;
                }
                Err(StepFailed::Failed(exec_error(err)))
            }
        }
    }
}

/// A netlink failure as the `ExecError` the backend reports (and logs) for `nft` failures.
fn exec_error(err: ApplyError) -> ExecError {
    let code = err.errno();
    let stderr = match err {
        ApplyError::Kernel {
            line,
            statement,
            source,
        } => format!("Error: {source} (statement {line}): {statement}"),
        other => format!("Error: {other}"),
    };
    ExecError::Failed {
        program: PROGRAM.to_owned(),
        code,
        stderr,
    }
}

impl NftRunner for NetlinkNft {
    async fn apply(&self, transaction: &Transaction) -> Result<(), ExecError> {
        // Blocking (up to seconds for a full sync of a large table), but the transaction is
        // borrowed: hand the worker's other tasks away instead of copying it into a blocking
        // task.
        let outcome = blocking(|| apply_blocking(&self.socket, transaction, self.max_step));
        match outcome {
            Ok(()) => Ok(()),
            // Only while nothing was applied: after earlier steps, `nft` would apply the
            // whole transaction on top of them.
            Err(ApplyError::Lower {
                error,
                committed: false,
            }) => {
                self.fallbacks.inc();
                debug!(statement = %error.statement, "statement not supported over netlink; applying the transaction with nft");
                self.fallback.apply(transaction).await
            }
            Err(err) => Err(exec_error(err)),
        }
    }

    fn apply_in_steps<T>(
        &self,
        render: impl FnOnce(&mut dyn StepSink<Error = StepFailed>) -> T,
    ) -> Option<T> {
        let mut sink = NetlinkSteps {
            socket: &self.socket,
            max_step: self.max_step,
            sent: 0,
        };
        // Rendering and applying block for seconds on a large table: as in `apply`.
        Some(blocking(|| render(&mut sink)))
    }

    fn splits(&self, transaction: &Transaction) -> bool {
        transaction.steps(self.max_step).len() > 1
    }

    async fn list_table(&self, family: IpFamily) -> Result<Option<String>, ExecError> {
        self.fallback.list_table(family).await
    }

    /// One dump of the family's tables (a handful), not of the table's contents.
    async fn table_exists(&self, family: IpFamily) -> Result<bool, ExecError> {
        let mut guard = self.socket.lock().unwrap_or_else(PoisonError::into_inner);
        let open = match guard.as_mut() {
            Some(open) => open,
            None => guard.insert(NftSocket::open().map_err(exec_error)?),
        };
        let tables = open
            .dump(MsgKind::GetTable, nft_family(family), |_| {})
            .map_err(exec_error)?;
        Ok(tables.iter().any(|table| {
            // After `struct nfgenmsg`: NFTA_TABLE_NAME, NUL-terminated.
            table.get(4..).is_some_and(|attrs| {
                attributes(attrs).any(|(ty, name)| {
                    ty == NFTA_TABLE_NAME && name.strip_suffix(b"\0") == Some(TABLE.as_bytes())
                })
            })
        }))
    }
}

fn nft_family(family: IpFamily) -> Family {
    match family {
        IpFamily::V4 => Family::Ipv4,
        IpFamily::V6 => Family::Ipv6,
    }
}
