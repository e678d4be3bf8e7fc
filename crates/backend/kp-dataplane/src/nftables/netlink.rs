//! [`NetlinkNft`]: applies scripts over nf_tables netlink ([`kp_nftnl`]) instead of
//! `nft -f -`, falling back to `nft` for scripts holding a statement the translator does
//! not support.
//!
//! Why: before any command on a table, `nft` 1.0.6 dumps every chain of it into its cache
//! (0.3 s and 100 MB for one `add element` once the table holds 100k chains), and a large
//! script spends about half its time in nft's own parser. The translated batch is the same
//! single atomic transaction, without the dump.

use std::sync::{Arc, Mutex, PoisonError};

use kp_core::model::IpFamily;
use kp_nftnl::{ApplyError, NftSocket, ScriptError};
use prometheus_client::metrics::counter::Counter;
use tracing::debug;

use super::runner::{ExecNft, NftRunner};
use crate::exec::ExecError;

/// How netlink failures are named in [`ExecError::Failed`].
const PROGRAM: &str = "nf_tables netlink";

/// An [`NftRunner`] that sends transactions over netlink itself; listings and unsupported
/// scripts go to `nft` ([`ExecNft`]). Clones share the socket.
#[derive(Clone, Debug)]
pub struct NetlinkNft {
    /// Opened on first use (in the namespace of the process), dropped after an I/O error.
    socket: Arc<Mutex<Option<NftSocket>>>,
    fallback: ExecNft,
    fallbacks: Counter,
}

impl NetlinkNft {
    /// Fall back to `fallback`, counting each fallback in `fallbacks`.
    pub fn new(fallback: ExecNft, fallbacks: Counter) -> Self {
        Self {
            socket: Arc::new(Mutex::new(None)),
            fallback,
            fallbacks,
        }
    }

    /// How many scripts went to `nft` because of an unsupported statement.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks.get()
    }
}

impl Default for NetlinkNft {
    fn default() -> Self {
        Self::new(ExecNft::default(), Counter::default())
    }
}

/// Apply `script` through `socket` (opened if needed): the blocking part. Translation
/// and encoding run statement by statement into the batch, so only the script and the
/// encoded batch are ever in memory at once.
fn apply_blocking(socket: &Mutex<Option<NftSocket>>, script: &str) -> Result<(), ApplyError> {
    let mut guard = socket.lock().unwrap_or_else(PoisonError::into_inner);
    let open = match guard.as_mut() {
        Some(open) => open,
        None => guard.insert(NftSocket::open()?),
    };
    let result = open.apply_script(script);
    if matches!(result, Err(ApplyError::Socket(_))) {
        // Start over with a fresh socket next time.
        *guard = None;
    }
    result
}

/// A netlink failure as the `ExecError` the backend reports (and logs) for `nft` failures.
fn exec_error(err: ApplyError, script: &str) -> ExecError {
    let code = err.errno();
    let stderr = match err {
        ApplyError::Kernel { line, source, .. } => {
            let statement = script.lines().nth(line.saturating_sub(1)).unwrap_or("");
            format!("Error: {source} (line {line}): {statement}")
        }
        other => format!("Error: {other}"),
    };
    ExecError::Failed {
        program: PROGRAM.to_owned(),
        code,
        stderr,
    }
}

impl NftRunner for NetlinkNft {
    async fn apply(&self, script: &str) -> Result<(), ExecError> {
        // Blocking (up to seconds for a full sync of a large table), but the script is
        // borrowed: on a multi-threaded runtime hand the worker's other tasks away instead
        // of copying the script into a blocking task; a current-thread runtime (tests) just
        // blocks.
        let multi_thread = tokio::runtime::Handle::try_current().is_ok_and(|handle| {
            handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
        let outcome = if multi_thread {
            tokio::task::block_in_place(|| apply_blocking(&self.socket, script))
        } else {
            apply_blocking(&self.socket, script)
        };
        match outcome {
            Ok(()) => Ok(()),
            Err(ApplyError::Script(ScriptError::Unsupported { line, statement })) => {
                self.fallbacks.inc();
                debug!(line, %statement, "statement not supported over netlink; applying the script with nft");
                self.fallback.apply(script).await
            }
            Err(err) => Err(exec_error(err, script)),
        }
    }

    async fn list_table(&self, family: IpFamily) -> Result<Option<String>, ExecError> {
        self.fallback.list_table(family).await
    }
}
