//! How the verdict-free layout reaches the kernel: [`LayoutIo`], over nf_tables netlink
//! (elements, slot-count classes, reads) and `nft` (scripts) ([`NetlinkLayoutIo`]). Its recording fake is `FakeLayoutIo` (`test-util`).

use std::sync::{Arc, Mutex, PoisonError};

use kp_core::model::IpFamily;
use kp_nftnl::class::push_class_changes;
use kp_nftnl::layout::{
    Forget, Readback, forget_clients_of, push_elements, read_chains, read_table,
};
use kp_nftnl::monitor::Quiet;
use kp_nftnl::{ApplyError, Batch, Family, NftSocket};
use kp_rules::nftables::layout::class::ClassObject;
use kp_rules::nftables::layout::{Changes, Element};

use crate::exec::ExecError;
use crate::nftables::ExecNft;

/// How netlink failures are named in [`ExecError::Failed`].
pub(super) const PROGRAM: &str = "nf_tables netlink";

/// The operations of the layout. The element and read operations block (netlink);
/// the caller keeps them off the runtime's other tasks.
pub trait LayoutIo: Send + Sync {
    /// Apply `script` (nft statements) as one transaction (`nft -f -`).
    fn apply_script(&self, script: &str) -> impl Future<Output = Result<(), ExecError>> + Send;

    /// Delete `delete`, then add `add`, in one transaction on `family`'s table.
    fn apply_elements(
        &self,
        family: IpFamily,
        delete: &[Element],
        add: &[Element],
    ) -> Result<(), ExecError>;

    /// Create `classes` (sets, maps and rules of new classes) and apply `changes`' elements
    /// (its deletions first), in one transaction on `family`'s table.
    fn apply_classes(
        &self,
        family: IpFamily,
        classes: &[ClassObject],
        changes: &Changes,
    ) -> Result<(), ExecError>;

    /// `family`'s table read back; `None` when there is none.
    fn read_table(&self, family: IpFamily) -> Result<Option<Readback>, ExecError>;

    /// The chains of `family`'s table (the canary check); `None` when there is no table.
    fn chains(&self, family: IpFamily) -> Result<Option<Vec<String>>, ExecError>;

    /// The nf_tables generation (every commit, anyone's, moves it by one).
    fn generation(&self) -> Result<u32, ExecError>;

    /// This process's nf_tables watch out of the notification group until the result is
    /// dropped (the kernel then skips building one notification per element).
    fn quiet(&self) -> Quiet;

    /// Deletes the clients each of `pins` holds pinned to one of its removed addresses;
    /// returns how many.
    fn forget_clients(&self, family: IpFamily, pins: &[Forget]) -> Result<usize, ExecError>;
}

/// Elements and reads over one netlink socket, scripts with `nft`. Clones share the socket.
#[derive(Clone, Debug, Default)]
pub struct NetlinkLayoutIo {
    socket: Arc<Mutex<Option<NftSocket>>>,
    nft: ExecNft,
}

impl NetlinkLayoutIo {
    fn with_socket<T>(
        &self,
        f: impl FnOnce(&mut NftSocket) -> Result<T, ApplyError>,
    ) -> Result<T, ExecError> {
        let mut guard = self.socket.lock().unwrap_or_else(PoisonError::into_inner);
        let open = match guard.as_mut() {
            Some(open) => open,
            None => guard.insert(NftSocket::open().map_err(exec_error)?),
        };
        let result = f(open);
        if matches!(result, Err(ApplyError::Socket(_))) {
            *guard = None;
        }
        result.map_err(exec_error)
    }
}

fn exec_error(err: ApplyError) -> ExecError {
    ExecError::Failed {
        program: PROGRAM.to_owned(),
        code: err.errno(),
        stderr: format!("Error: {err}"),
    }
}

fn nft_family(family: IpFamily) -> Family {
    match family {
        IpFamily::V4 => Family::Ipv4,
        IpFamily::V6 => Family::Ipv6,
    }
}

impl LayoutIo for NetlinkLayoutIo {
    async fn apply_script(&self, script: &str) -> Result<(), ExecError> {
        self.nft.apply_script(script).await
    }

    fn apply_elements(
        &self,
        family: IpFamily,
        delete: &[Element],
        add: &[Element],
    ) -> Result<(), ExecError> {
        let mut batch = Batch::new(1);
        push_elements(&mut batch, nft_family(family), false, delete);
        push_elements(&mut batch, nft_family(family), true, add);
        self.with_socket(|socket| socket.apply_batch(batch))
    }

    fn apply_classes(
        &self,
        family: IpFamily,
        classes: &[ClassObject],
        changes: &Changes,
    ) -> Result<(), ExecError> {
        let mut batch = Batch::new(1);
        push_class_changes(&mut batch, family, classes, changes).map_err(|err| {
            ExecError::Failed {
                program: PROGRAM.to_owned(),
                code: None,
                stderr: format!("Error: {err}"),
            }
        })?;
        self.with_socket(|socket| socket.apply_batch(batch))
    }

    fn read_table(&self, family: IpFamily) -> Result<Option<Readback>, ExecError> {
        self.with_socket(|socket| read_table(socket, nft_family(family)))
    }

    fn chains(&self, family: IpFamily) -> Result<Option<Vec<String>>, ExecError> {
        self.with_socket(|socket| read_chains(socket, nft_family(family)))
    }

    fn generation(&self) -> Result<u32, ExecError> {
        self.with_socket(NftSocket::generation)
    }

    fn quiet(&self) -> Quiet {
        kp_nftnl::monitor::quiet()
    }

    fn forget_clients(&self, family: IpFamily, pins: &[Forget]) -> Result<usize, ExecError> {
        self.with_socket(|socket| forget_clients_of(socket, nft_family(family), pins))
    }
}
