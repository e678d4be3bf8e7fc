//! nf_tables change notifications (the `NFNLGRP_NFTABLES` multicast group, what `nft
//! monitor` reads): a sans-I/O parser ([`parse`]) and a blocking subscriber ([`Monitor`]).
//!
//! The kernel sends one message per table, chain, rule, set or element a transaction added
//! or deleted, then `NFT_MSG_NEWGEN` naming the process (and thread) that committed it, so
//! a reader can tell whose transaction the messages before it were.
//!
//! The kernel builds those messages only while some socket is in the group (each element is
//! a message of its own, ~40 % of a 290k-element load's kernel time, measured with `perf`),
//! so a large load of the proxy's own can take this process's monitors out of it for a
//! while ([`quiet`]); the writer then learns from the generation
//! ([`crate::socket::NftSocket::generation`]) whether anyone else committed meanwhile.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kp_netlink::{NFGENMSG_LEN, messages};
use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::{Socket, SocketAddr};

use crate::abi::{
    NFNL_SUBSYS_NFTABLES, NFNLGRP_NFTABLES, NFT_MSG_NEWGEN, NFTA_CHAIN_NAME, NFTA_GEN_PROC_NAME,
    NFTA_GEN_PROC_PID, NFTA_RULE_CHAIN, NFTA_SET_ELEM_LIST_SET, NFTA_SET_NAME, NFTA_TABLE_NAME,
};
use crate::codec::{MsgKind, attributes};

/// The object messages notified, each with its kind, whether it deletes, and the attribute
/// naming the object (a rule's is its chain, an element's its set; a table's is the table).
const OBJECT_MESSAGES: [(MsgKind, Object, bool, Option<u16>); 10] = [
    (MsgKind::NewTable, Object::Table, false, None),
    (MsgKind::DelTable, Object::Table, true, None),
    (
        MsgKind::NewChain,
        Object::Chain,
        false,
        Some(NFTA_CHAIN_NAME),
    ),
    (
        MsgKind::DelChain,
        Object::Chain,
        true,
        Some(NFTA_CHAIN_NAME),
    ),
    (MsgKind::NewRule, Object::Rule, false, Some(NFTA_RULE_CHAIN)),
    (MsgKind::DelRule, Object::Rule, true, Some(NFTA_RULE_CHAIN)),
    (MsgKind::NewSet, Object::Set, false, Some(NFTA_SET_NAME)),
    (MsgKind::DelSet, Object::Set, true, Some(NFTA_SET_NAME)),
    (
        MsgKind::NewSetElem,
        Object::Element,
        false,
        Some(NFTA_SET_ELEM_LIST_SET),
    ),
    (
        MsgKind::DelSetElem,
        Object::Element,
        true,
        Some(NFTA_SET_ELEM_LIST_SET),
    ),
];
/// Large: `nft flush ruleset` on a 10k-service table is some 100k messages at once.
const RECV_BUFFER: usize = 32 << 20;

/// What kind of object a notification is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Object {
    /// A table.
    Table,
    /// A chain.
    Chain,
    /// A rule (of `chain`).
    Rule,
    /// A set or map.
    Set,
    /// Elements of a set or map (`name` is the set).
    Element,
}

impl Object {
    /// The word for it, used as a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Object::Table => "table",
            Object::Chain => "chain",
            Object::Rule => "rule",
            Object::Set => "set",
            Object::Element => "element",
        }
    }
}

/// One notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// An object was added (`deleted: false`) or deleted.
    Object {
        /// What kind.
        object: Object,
        /// Deleted rather than added.
        deleted: bool,
        /// `NFPROTO_*` (2: ip, 10: ip6).
        family: u8,
        /// The table's name.
        table: String,
        /// The chain (tables: none; rules: their chain) or set (sets, elements).
        name: Option<String>,
    },
    /// The end of a transaction: the netlink port, thread id and process name that
    /// committed it.
    Generation {
        /// The committing socket's port id (`nlmsg_pid`).
        portid: u32,
        /// `NFTA_GEN_PROC_PID` (the committing thread's id).
        pid: Option<u32>,
        /// `NFTA_GEN_PROC_NAME`.
        process: Option<String>,
    },
}

/// The nf_tables notifications in one datagram (others are skipped; broken framing ends
/// the datagram).
pub fn parse(data: &[u8]) -> Vec<Message> {
    messages(data)
        .map_while(Result::ok)
        .filter_map(|m| parse_one(m.kind, m.port, m.payload))
        .collect()
}

fn parse_one(ty: u16, portid: u32, body: &[u8]) -> Option<Message> {
    if ty >> 8 != NFNL_SUBSYS_NFTABLES || body.len() < NFGENMSG_LEN {
        return None;
    }
    let family = body[0];
    let attrs = &body[NFGENMSG_LEN..];
    let msg = ty & 0xff;
    if msg == NFT_MSG_NEWGEN {
        return Some(generation(portid, attrs));
    }
    let &(_, object, deleted, name_attr) = OBJECT_MESSAGES
        .iter()
        .find(|(kind, ..)| *kind as u16 == msg)?;
    // The table is attribute 1 in every one of these (`NFTA_CHAIN_TABLE`, `NFTA_RULE_TABLE`...).
    let table = string_attr(attrs, NFTA_TABLE_NAME)?;
    let name = name_attr.and_then(|n| string_attr(attrs, n));
    Some(Message::Object {
        object,
        deleted,
        family,
        table,
        name,
    })
}

fn generation(portid: u32, attrs: &[u8]) -> Message {
    let pid = attributes(attrs)
        .find(|(ty, _)| *ty == NFTA_GEN_PROC_PID)
        .and_then(|(_, v)| <[u8; 4]>::try_from(v).ok())
        .map(u32::from_be_bytes);
    Message::Generation {
        portid,
        pid,
        process: string_attr(attrs, NFTA_GEN_PROC_NAME),
    }
}

fn string_attr(attrs: &[u8], wanted: u16) -> Option<String> {
    let (_, value) = attributes(attrs).find(|(ty, _)| *ty == wanted)?;
    let value = value.split(|b| *b == 0).next().unwrap_or_default();
    Some(String::from_utf8_lossy(value).into_owned())
}

/// What [`Monitor::recv`] got.
#[derive(Debug)]
pub enum Received {
    /// Notifications (possibly none of interest).
    Messages(Vec<Message>),
    /// Nothing within the timeout.
    Timeout,
    /// The kernel dropped notifications (the buffer overflowed): anything may have changed.
    Overrun,
}

/// This process's monitors' sockets (shared with them), so that [`quiet`] can take them
/// out of the group without reaching the threads that read them.
static SUBSCRIBED: Mutex<Vec<Arc<Socket>>> = Mutex::new(Vec::new());

/// This process's monitors out of the notification group until it is dropped (the kernel
/// then builds no notification for what is committed meanwhile: nobody else listening, it
/// skips the work). Whoever holds it must find out another way whether others committed in
/// that time (the generation). A monitor opened meanwhile stays in the group.
#[derive(Debug, Default)]
#[must_use = "the monitors rejoin when this is dropped"]
pub struct Quiet {
    left: Vec<Arc<Socket>>,
}

impl Quiet {
    /// How many monitors left the group.
    pub fn monitors(&self) -> usize {
        self.left.len()
    }
}

impl Drop for Quiet {
    fn drop(&mut self) {
        for socket in self.left.drain(..) {
            // Failing to rejoin leaves that monitor deaf: its canary checks remain.
            let _ = socket.add_membership(NFNLGRP_NFTABLES);
        }
    }
}

/// Takes every monitor of this process out of the notification group (see [`Quiet`]).
pub fn quiet() -> Quiet {
    let subscribed = SUBSCRIBED.lock().unwrap_or_else(PoisonError::into_inner);
    Quiet {
        left: subscribed
            .iter()
            .filter(|socket| socket.drop_membership(NFNLGRP_NFTABLES).is_ok())
            .cloned()
            .collect(),
    }
}

/// A socket subscribed to nf_tables notifications of this network namespace.
pub struct Monitor {
    /// Also listed in [`SUBSCRIBED`].
    socket: Arc<Socket>,
    buf: Vec<u8>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        SUBSCRIBED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|socket| !Arc::ptr_eq(socket, &self.socket));
    }
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").finish_non_exhaustive()
    }
}

impl Monitor {
    /// Subscribes; `timeout` bounds each [`recv`](Self::recv), so the caller can stop.
    pub fn open(timeout: Duration) -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_NETFILTER)?;
        socket.bind(&SocketAddr::new(0, 0))?;
        socket.add_membership(NFNLGRP_NFTABLES)?;
        rustix::net::sockopt::set_socket_recv_buffer_size_force(&socket, RECV_BUFFER)
            .or_else(|_| rustix::net::sockopt::set_socket_recv_buffer_size(&socket, RECV_BUFFER))
            .map_err(io::Error::from)?;
        rustix::net::sockopt::set_socket_timeout(
            &socket,
            rustix::net::sockopt::Timeout::Recv,
            Some(timeout),
        )
        .map_err(io::Error::from)?;
        let socket = Arc::new(socket);
        SUBSCRIBED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(socket.clone());
        Ok(Self {
            socket,
            buf: vec![0; 1 << 20],
        })
    }

    /// The next datagram's notifications.
    pub fn recv(&mut self) -> io::Result<Received> {
        match self.socket.recv(&mut &mut self.buf[..], 0) {
            Ok(n) => Ok(Received::Messages(parse(&self.buf[..n]))),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Ok(Received::Timeout)
            }
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOBUFS.raw_os_error()) => {
                Ok(Received::Overrun)
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One message: nlmsghdr, nfgenmsg (family), then `attrs` (type, value).
    fn message(msg: u16, family: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![family, 0, 0, 0];
        for (ty, value) in attrs {
            let len = u16::try_from(4 + value.len()).expect("short");
            body.extend(len.to_ne_bytes());
            body.extend(ty.to_ne_bytes());
            body.extend(*value);
            body.resize(body.len().next_multiple_of(4), 0);
        }
        let mut out = Vec::new();
        out.extend(u32::try_from(16 + body.len()).expect("short").to_ne_bytes());
        out.extend(((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
        out.extend([0u8; 6]); // flags, seq
        out.extend(77u32.to_ne_bytes()); // nlmsg_pid
        out.extend(body);
        out
    }

    #[test]
    fn parses_a_flushed_chain_and_the_generation_that_ends_it() {
        let mut data = message(8, 2, &[(1, b"nat\0"), (2, b"KUBE-SERVICES\0")]);
        data.extend(message(
            15,
            0,
            &[
                (1, &7u32.to_be_bytes()),
                (2, &4242u32.to_be_bytes()),
                (3, b"iptables\0"),
            ],
        ));
        data.extend(message(2, 10, &[(1, b"kube-proxy\0")]));
        assert_eq!(
            parse(&data),
            vec![
                Message::Object {
                    object: Object::Rule,
                    deleted: true,
                    family: 2,
                    table: "nat".into(),
                    name: Some("KUBE-SERVICES".into()),
                },
                Message::Generation {
                    portid: 77,
                    pid: Some(4242),
                    process: Some("iptables".into()),
                },
                Message::Object {
                    object: Object::Table,
                    deleted: true,
                    family: 10,
                    table: "kube-proxy".into(),
                    name: None,
                },
            ]
        );
    }

    #[test]
    fn skips_other_subsystems_and_truncated_input() {
        let mut other = message(8, 2, &[(1, b"nat\0")]);
        other[5] = 1; // another nfnetlink subsystem (ctnetlink)
        assert_eq!(parse(&other), vec![]);
        let whole = message(5, 2, &[(1, b"filter\0"), (3, b"KUBE-FORWARD\0")]);
        assert_eq!(parse(&whole[..whole.len() - 3]), vec![]);
        assert_eq!(parse(&whole).len(), 1);
    }
}
