//! A blocking `NETLINK_NETFILTER` socket that applies the renderer's transactions.
//!
//! The kernel runs a batch while `sendmsg` delivers it, and only answers messages that fail
//! (none of ours asks for an acknowledgement), so after the batch we send one request that
//! does ask for one (`NFT_MSG_GETGEN`, see [`crate::codec::fence`]); every error of the batch
//! is queued before that answer. Nothing is ever dumped, so the cost does not grow with the
//! size of the table.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};

use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::{Socket, SocketAddr};

use kp_core::model::IpFamily;
use kp_netlink::{Message, NFGENMSG_LEN, NLMSG_DONE, NLMSG_ERROR, messages};
use kp_rules::nftables::{Command, Transaction};

use crate::abi::NFTA_GEN_ID;
use crate::codec::{Batch, Family, MsgKind, Writer, attributes, dump_request, fence};
use crate::lower::{LowerError, lower};

/// Receive buffer: room for the errors of a batch whose messages all fail (errors are
/// capped to the failed message's header, see `NETLINK_CAP_ACK`).
const DEFAULT_RECV_BUFFER: usize = 8 << 20;

/// At most this many commands per transaction when a full sync is split into steps
/// ([`Transaction::steps`]): about 7 MB of netlink messages, against ~100 MB for the whole
/// first sync of 10k services × 10 endpoints (666k commands). Larger steps hold more memory;
/// smaller ones cost more commits (each validates the table's loops once its base chains
/// reach the new chains, ~0.2 s at 10k×10 on a loaded table).
pub const DEFAULT_MAX_STEP_COMMANDS: usize = 50_000;

/// Why a transaction was not applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// A command holds a value that cannot be sent as nft would send it. Nothing was
    /// applied unless `committed` (earlier steps of a split sync were).
    #[error("{error}")]
    Lower {
        /// Which command.
        error: LowerError,
        /// Whether earlier steps of the sync were applied already.
        committed: bool,
    },
    /// The kernel rejected a statement; its transaction was discarded (earlier steps of a
    /// split sync stay applied).
    #[error("statement {line}: {statement}")]
    Kernel {
        /// 1-based position of the statement among those sent for the transaction (its line
        /// in the `nft -f` script when the transaction was not split).
        line: usize,
        /// The statement, as `nft -f` text.
        statement: String,
        /// The kernel's error.
        source: io::Error,
    },
    /// The kernel rejected the batch as a whole, or answered with a sequence number that
    /// is none of ours.
    #[error("nf_tables rejected the batch: {0}")]
    Batch(io::Error),
    /// Opening, configuring or using the socket failed. When this happens after the batch
    /// was sent, whether it was applied is unknown; callers treat it as a failure (the next
    /// sync is then full, which converges either way).
    #[error("netfilter netlink socket: {0}")]
    Socket(io::Error),
}

impl ApplyError {
    /// The `errno` behind the error, if there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            ApplyError::Kernel { source, .. }
            | ApplyError::Batch(source)
            | ApplyError::Socket(source) => source.raw_os_error(),
            ApplyError::Lower { .. } => None,
        }
    }
}

/// nf_tables over netlink in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct NftSocket {
    socket: Socket,
    seq: u32,
    send_buffer: usize,
    /// The kernel's address of this socket, in [`own_portids`] while it is open.
    portid: Option<u32>,
}

/// The netlink port ids of this process's open [`NftSocket`]s: the kernel stamps every
/// change notification with the port id of the socket whose transaction made it, so a
/// watcher can tell the proxy's own transactions from others' ([`crate::monitor`]).
static OWN_PORTIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// Whether `portid` is one of this process's open [`NftSocket`]s.
pub fn is_own_portid(portid: u32) -> bool {
    OWN_PORTIDS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&portid)
}

impl Drop for NftSocket {
    fn drop(&mut self) {
        if let Some(portid) = self.portid {
            let mut own = OWN_PORTIDS.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(at) = own.iter().position(|p| *p == portid) {
                own.swap_remove(at);
            }
        }
    }
}

impl NftSocket {
    /// Open and bind a socket.
    pub fn open() -> Result<Self, ApplyError> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(ApplyError::Socket)?;
        socket.bind_auto().map_err(ApplyError::Socket)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(ApplyError::Socket)?;
        // Errors carry the failed message's header only, not the whole message.
        socket.set_cap_ack(true).map_err(ApplyError::Socket)?;
        rustix::net::sockopt::set_socket_recv_buffer_size_force(&socket, DEFAULT_RECV_BUFFER)
            .or_else(|_| {
                rustix::net::sockopt::set_socket_recv_buffer_size(&socket, DEFAULT_RECV_BUFFER)
            })
            .map_err(|e| ApplyError::Socket(e.into()))?;
        let mut address = SocketAddr::new(0, 0);
        let portid = socket
            .get_address(&mut address)
            .ok()
            .map(|()| address.port_number());
        if let Some(portid) = portid {
            OWN_PORTIDS
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(portid);
        }
        Ok(Self {
            socket,
            // Any start works; the kernel only echoes it.
            seq: 1,
            send_buffer: 0,
            portid,
        })
    }

    /// Apply `transaction`: as one transaction, or, for a large full sync, as the steps of
    /// [`Transaction::steps`] with at most `max_step` commands each, each encoded only once
    /// the step before it is applied. On error, nothing of the failed step was applied
    /// (earlier steps were: see [`Transaction::steps`] for what the caller must then do).
    pub fn apply(&mut self, transaction: &Transaction, max_step: usize) -> Result<(), ApplyError> {
        let family = transaction.family();
        let mut sent = 0;
        for (index, step) in transaction.steps(max_step).iter().enumerate() {
            self.apply_commands(family, step, sent)
                .map_err(|err| match err {
                    ApplyError::Lower { error, .. } => ApplyError::Lower {
                        error,
                        committed: index > 0,
                    },
                    other => other,
                })?;
            sent += step.len();
        }
        Ok(())
    }

    /// Apply `commands` (on `family`'s table) as one transaction; a kernel error names the
    /// statement at its position after `offset` others.
    pub fn apply_commands(
        &mut self,
        family: IpFamily,
        commands: &[&Command],
        offset: usize,
    ) -> Result<(), ApplyError> {
        let mut batch = Batch::new(self.seq);
        for (index, command) in commands.iter().enumerate() {
            let lowered = lower(family, command).map_err(|error| ApplyError::Lower {
                error,
                committed: false,
            })?;
            batch.push(&lowered, index);
        }
        self.send_batch(batch).map_err(|err| match err {
            ApplyError::Kernel { line, source, .. } => ApplyError::Kernel {
                line: offset + line + 1,
                statement: commands
                    .get(line)
                    .map(|c| c.display(family).to_string())
                    .unwrap_or_default(),
                source,
            },
            other => other,
        })
    }

    /// Apply `batch` (built with [`Batch::raw`] or [`Batch::push`]) as one transaction. On
    /// error nothing was applied; a kernel error names the owner the message was pushed with.
    pub fn apply_batch(&mut self, batch: Batch) -> Result<(), ApplyError> {
        self.send_batch(batch)
    }

    /// Like [`NftSocket::apply_batch`], also returning what the kernel echoed for messages
    /// sent with `NLM_F_ECHO` (a created rule, with its handle): each echo's owner (see
    /// [`Batch::push`]) and the message without its netlink header.
    pub fn apply_batch_echoed(
        &mut self,
        batch: Batch,
    ) -> Result<Vec<(usize, Vec<u8>)>, ApplyError> {
        let mut echoes = Vec::new();
        self.send_batch_collecting(batch, Some(&mut echoes))?;
        Ok(echoes)
    }

    /// Dump objects of `kind` (`GetTable`, `GetChain`, `GetRule`) of `family`, filtered by
    /// the attributes `filter` writes. Each message is returned without its netlink header
    /// (starting with `struct nfgenmsg`). An object that does not exist (the table or chain
    /// filtered on) is an empty answer, not an error.
    pub fn dump(
        &mut self,
        kind: MsgKind,
        family: Family,
        filter: impl FnOnce(&mut Writer),
    ) -> Result<Vec<Vec<u8>>, ApplyError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        let request = dump_request(kind, family, seq, filter);
        self.socket.send(&request, 0).map_err(ApplyError::Socket)?;
        let mut out = Vec::new();
        let code = self.until_fence(seq, 1 << 20, |reply| {
            if reply.seq == seq {
                out.push(reply.payload.to_vec());
            }
        })?;
        // Done, acknowledged, or no such table or chain (an empty dump); else refused.
        match code {
            Some(code) if code != 0 && code != -libc_enoent() => {
                Err(ApplyError::Batch(io::Error::from_raw_os_error(-code)))
            }
            _ => Ok(out),
        }
    }

    /// The nf_tables generation of this network namespace: every committed transaction,
    /// whoever's, moves it by one, so two readings bracketing transactions of ours tell
    /// whether anyone else committed in between (see `crate::monitor::quiet`).
    pub fn generation(&mut self) -> Result<u32, ApplyError> {
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(1);
        self.socket
            .send(&fence(seq), 0)
            .map_err(ApplyError::Socket)?;
        let mut generation = None;
        let code = self.until_fence(seq, 1 << 12, |reply| {
            if reply.seq == seq {
                // NFT_MSG_NEWGEN: `struct nfgenmsg`, then NFTA_GEN_ID, big-endian.
                generation = reply
                    .payload
                    .get(NFGENMSG_LEN..)
                    .and_then(|attrs| attributes(attrs).find(|(ty, _)| *ty == NFTA_GEN_ID))
                    .and_then(|(_, value)| <[u8; 4]>::try_from(value).ok())
                    .map(u32::from_be_bytes);
            }
        })?;
        if let Some(code) = code.filter(|code| *code != 0) {
            return Err(ApplyError::Batch(io::Error::from_raw_os_error(-code)));
        }
        generation
            .ok_or_else(|| ApplyError::Socket(io::Error::other("no NFTA_GEN_ID in NFT_MSG_NEWGEN")))
    }

    /// Reads replies until the acknowledgement of the request numbered `fence` (returning
    /// its error code, 0 for none), handing every other reply to `each`.
    fn until_fence(
        &mut self,
        fence: u32,
        buffer: usize,
        mut each: impl FnMut(&Message<'_>),
    ) -> Result<Option<i32>, ApplyError> {
        let mut buf = vec![0u8; buffer];
        loop {
            let n = self
                .socket
                .recv(&mut &mut buf[..], 0)
                .map_err(ApplyError::Socket)?;
            for reply in replies(&buf[..n]) {
                let reply = reply.map_err(ApplyError::Socket)?;
                if reply.seq == fence && (reply.kind == NLMSG_ERROR || reply.kind == NLMSG_DONE) {
                    return Ok(reply.error_code());
                }
                each(&reply);
            }
        }
    }

    /// Send `batch` and collect the kernel's verdict on it.
    fn send_batch(&mut self, batch: Batch) -> Result<(), ApplyError> {
        self.send_batch_collecting(batch, None)
    }

    /// [`NftSocket::send_batch`], keeping the echoes of the batch's messages in `echoes`.
    fn send_batch_collecting(
        &mut self,
        batch: Batch,
        mut echoes: Option<&mut Vec<(usize, Vec<u8>)>>,
    ) -> Result<(), ApplyError> {
        if batch.is_empty() {
            return Ok(());
        }
        let encoded = batch.finish();
        self.seq = encoded.fence_seq.wrapping_add(1);
        // The whole batch must arrive in one message (the kernel runs a batch per skb).
        let needed = encoded.bytes.len() + 4096;
        if needed > self.send_buffer {
            rustix::net::sockopt::set_socket_send_buffer_size_force(&self.socket, needed)
                .or_else(|_| {
                    rustix::net::sockopt::set_socket_send_buffer_size(&self.socket, needed)
                })
                .map_err(|e| ApplyError::Socket(e.into()))?;
            self.send_buffer = needed;
        }
        let sent = self
            .socket
            .send(&encoded.bytes, 0)
            .map_err(ApplyError::Socket)?;
        if sent != encoded.bytes.len() {
            return Err(ApplyError::Socket(io::Error::other(format!(
                "sent {sent} of {} bytes",
                encoded.bytes.len()
            ))));
        }
        self.socket
            .send(&fence(encoded.fence_seq), 0)
            .map_err(ApplyError::Socket)?;

        let mut first_error: Option<ApplyError> = None;
        self.until_fence(encoded.fence_seq, 1 << 16, |reply| {
            if reply.seq == encoded.fence_seq {
                // The generation itself: the acknowledgement follows.
                return;
            }
            if reply.kind != NLMSG_ERROR {
                if let (Some(echoes), Some(owner)) =
                    (echoes.as_deref_mut(), encoded.owner(reply.seq))
                {
                    echoes.push((owner, reply.payload.to_vec()));
                }
                return;
            }
            let Some(code) = reply.error_code().filter(|code| *code != 0) else {
                return;
            };
            let source = io::Error::from_raw_os_error(-code);
            let error = match encoded.owner(reply.seq) {
                // The command's index; [`Self::apply_commands`] names it.
                Some(line) => ApplyError::Kernel {
                    line,
                    statement: String::new(),
                    source,
                },
                None => ApplyError::Batch(source),
            };
            first_error.get_or_insert(error);
        })?;
        first_error.map_or(Ok(()), Err)
    }
}

/// One [`NftSocket`] shared by clones: opened on first use (in the network namespace of the
/// thread that first uses it) and dropped after an I/O error, so the next use starts over
/// with a fresh one.
#[derive(Clone, Debug, Default)]
pub struct SharedSocket {
    inner: Arc<Mutex<Option<NftSocket>>>,
}

impl SharedSocket {
    /// Run `f` on the socket, opening it if needed. Blocks while another clone uses it.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&mut NftSocket) -> Result<T, ApplyError>,
    ) -> Result<T, ApplyError> {
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let open = match guard.as_mut() {
            Some(open) => open,
            None => guard.insert(NftSocket::open()?),
        };
        let result = f(open);
        if matches!(result, Err(ApplyError::Socket(_))) {
            *guard = None;
        }
        result
    }
}

/// `ENOENT`: the kernel's answer to a dump filtered on a table or chain that does not exist.
fn libc_enoent() -> i32 {
    rustix::io::Errno::NOENT.raw_os_error()
}

/// The messages in one datagram (`kp_netlink`'s framing; broken framing is a socket error).
fn replies(data: &[u8]) -> impl Iterator<Item = io::Result<Message<'_>>> + '_ {
    messages(data).map(|message| message.map_err(io::Error::other))
}
