//! Every ipset's entry count over netlink: one `IPSET_CMD_LIST` dump with the header-only
//! flag, what `ipset list -t` asks the kernel for, without starting the tool. The canary
//! check reads it every canary period, where an `ipset` run costs milliseconds on a real
//! node and most of a second in the emulated test VM.
//!
//! The messages are built and read by pure functions ([`list_headers_request`],
//! [`parse_datagram`]) on `kp-netlink`'s framing, the request tested against hand-made
//! bytes; [`entry_counts`] only moves them through a `NETLINK_NETFILTER` socket. Constants from the kernel's
//! `include/uapi/linux/netfilter/ipset/ip_set.h`.

use std::collections::BTreeMap;
use std::io;

use kp_netlink::{
    FrameError, NFGENMSG_LEN, NLA_F_NET_BYTEORDER, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE,
    NLMSG_ERROR, Writer, messages, try_attributes,
};

/// `NFNL_SUBSYS_IPSET`: ipset's nfnetlink subsystem.
const NFNL_SUBSYS_IPSET: u16 = 6;
/// `IPSET_CMD_LIST`.
const IPSET_CMD_LIST: u16 = 7;
/// The protocol version asked for: `IPSET_PROTOCOL_MIN`, which every kernel since 3.x
/// accepts.
const IPSET_PROTOCOL: u8 = 6;
/// Command-level attributes.
const IPSET_ATTR_PROTOCOL: u16 = 1;
const IPSET_ATTR_SETNAME: u16 = 2;
const IPSET_ATTR_FLAGS: u16 = 6;
const IPSET_ATTR_DATA: u16 = 7;
/// Inside `IPSET_ATTR_DATA`: the set's entry count (big-endian u32, kernels since 4.x).
const IPSET_ATTR_ELEMENTS: u16 = 24;
/// `IPSET_FLAG_LIST_HEADER`: headers only, no entries.
const IPSET_FLAG_LIST_HEADER: u32 = 1 << 2;

const AF_INET: u8 = 2;
/// A dump's datagrams are at most 32 KiB; twice that never truncates.
const RECV_BUFFER_BYTES: usize = 64 * 1024;

/// Why the counts could not be read.
#[derive(Debug, thiserror::Error)]
pub enum IpsetNetlinkError {
    /// The socket could not be opened, or sending or receiving failed.
    #[error("ipset netlink socket")]
    Socket(#[source] io::Error),
    /// The kernel refused the dump.
    #[error("the kernel refused the ipset list")]
    Kernel(#[source] io::Error),
    /// A reply that does not parse.
    #[error("ipset netlink reply: {0}")]
    Decode(String),
    /// A reply whose framing is broken.
    #[error("ipset netlink reply")]
    Frame(#[from] FrameError),
}

/// Entry count per set name; `None` where the kernel reports none (older than 4.x).
pub type Counts = BTreeMap<String, Option<usize>>;

/// One datagram's worth of a dump.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Datagram {
    /// The sets it describes.
    pub sets: Counts,
    /// The dump ended (`NLMSG_DONE`).
    pub done: bool,
}

/// A dump request for every set's header.
pub fn list_headers_request(sequence: u32) -> Vec<u8> {
    let mut w = Writer::new();
    let kind = NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST;
    let m = w.begin_nfnl(kind, NLM_F_REQUEST | NLM_F_DUMP, sequence, AF_INET, 0);
    w.put(IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
    w.put_u32(
        IPSET_ATTR_FLAGS | NLA_F_NET_BYTEORDER,
        IPSET_FLAG_LIST_HEADER,
    );
    w.end(m);
    w.into_bytes()
}

/// `(type, value)` of each attribute in `buf`.
fn attrs(buf: &[u8]) -> Result<Vec<(u16, &[u8])>, IpsetNetlinkError> {
    Ok(try_attributes(buf).collect::<Result<_, _>>()?)
}

/// The name and entry count of one `IPSET_CMD_LIST` message's set.
fn set_of(payload: &[u8]) -> Result<Option<(String, Option<usize>)>, IpsetNetlinkError> {
    let attributes = attrs(payload.get(NFGENMSG_LEN..).unwrap_or_default())?;
    let mut name = None;
    let mut count = None;
    for (kind, value) in attributes {
        match kind {
            IPSET_ATTR_SETNAME => {
                let text = value.split(|b| *b == 0).next().unwrap_or_default();
                name = Some(String::from_utf8_lossy(text).into_owned());
            }
            IPSET_ATTR_DATA => {
                for (inner, value) in attrs(value)? {
                    if inner == IPSET_ATTR_ELEMENTS {
                        let bytes = <[u8; 4]>::try_from(value).map_err(|_| {
                            IpsetNetlinkError::Decode("entry count not 4 bytes".to_owned())
                        })?;
                        count = usize::try_from(u32::from_be_bytes(bytes)).ok();
                    }
                }
            }
            _ => {}
        }
    }
    Ok(name.map(|name| (name, count)))
}

/// Reads one received datagram of the dump.
pub fn parse_datagram(buf: &[u8]) -> Result<Datagram, IpsetNetlinkError> {
    let mut out = Datagram::default();
    for message in messages(buf) {
        let message = message?;
        match message.kind {
            NLMSG_DONE => out.done = true,
            NLMSG_ERROR => {
                let code = message.error_code().unwrap_or(0);
                if code != 0 {
                    let error = io::Error::from_raw_os_error(-code);
                    return Err(IpsetNetlinkError::Kernel(error));
                }
            }
            k if k == NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST => {
                if let Some((name, count)) = set_of(message.payload)? {
                    out.sets.insert(name, count);
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Every set of this network namespace with its entry count (blocking; a few netlink round
/// trips however many entries the sets hold).
pub fn entry_counts() -> Result<Counts, IpsetNetlinkError> {
    let mut socket = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)
        .map_err(IpsetNetlinkError::Socket)?;
    socket.bind_auto().map_err(IpsetNetlinkError::Socket)?;
    socket
        .connect(&netlink_sys::SocketAddr::new(0, 0))
        .map_err(IpsetNetlinkError::Socket)?;
    socket
        .send(&list_headers_request(1), 0)
        .map_err(IpsetNetlinkError::Socket)?;
    let mut counts = Counts::new();
    let mut buf = Vec::with_capacity(RECV_BUFFER_BYTES);
    loop {
        buf.clear();
        let size = socket
            .recv(&mut buf, 0)
            .map_err(IpsetNetlinkError::Socket)?;
        if size > buf.len() {
            let message = format!("datagram of {size} bytes truncated to {}", buf.len());
            return Err(IpsetNetlinkError::Decode(message));
        }
        let datagram = parse_datagram(&buf)?;
        counts.extend(datagram.sets);
        if datagram.done {
            return Ok(counts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One netlink message of `kind` with `payload`.
    fn message(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut w = Writer::new();
        let m = w.begin(kind, 0, 0);
        w.buffer_mut().extend_from_slice(payload);
        w.end(m);
        w.into_bytes()
    }

    /// A header message for set `name` (`count`: its `IPSET_ATTR_ELEMENTS`), as the kernel
    /// sends it: protocol, name, type, family, revision, then the nested data.
    fn header(name: &str, count: Option<u32>) -> Vec<u8> {
        let mut w = Writer::new();
        let m = w.begin_nfnl(NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST, 0, 0, AF_INET, 0);
        w.put(IPSET_ATTR_PROTOCOL, &[6]);
        w.put_str(IPSET_ATTR_SETNAME, name);
        w.put_str(3, "hash:ip,port");
        w.put(5, &[AF_INET]);
        w.put(4, &[5]);
        let data = w.nest(IPSET_ATTR_DATA);
        w.put_u32(18 | NLA_F_NET_BYTEORDER, 1024);
        if let Some(count) = count {
            w.put_u32(IPSET_ATTR_ELEMENTS | NLA_F_NET_BYTEORDER, count);
        }
        w.put_u32(25 | NLA_F_NET_BYTEORDER, 1);
        w.nest_end(data);
        w.end(m);
        w.into_bytes()
    }

    #[test]
    fn the_request_asks_for_headers_only_with_the_minimum_protocol() {
        let request = list_headers_request(7);
        let expected: Vec<u8> = [
            &36u32.to_ne_bytes()[..],
            &0x0607u16.to_ne_bytes(),
            &0x0301u16.to_ne_bytes(),
            &7u32.to_ne_bytes(),
            &0u32.to_ne_bytes(),
            &[2, 0, 0, 0],
            // IPSET_ATTR_PROTOCOL = 6, padded.
            &5u16.to_ne_bytes(),
            &1u16.to_ne_bytes(),
            &[6, 0, 0, 0],
            // IPSET_ATTR_FLAGS (net byte order) = IPSET_FLAG_LIST_HEADER.
            &8u16.to_ne_bytes(),
            &0x4006u16.to_ne_bytes(),
            &[0, 0, 0, 4],
        ]
        .concat();
        assert_eq!(request, expected);
    }

    #[test]
    fn a_dump_reads_as_names_and_counts_until_done() {
        let mut datagram = header("KUBE-CLUSTER-IP", Some(3));
        datagram.extend(header("KUBE-LOOP-BACK", Some(0)));
        datagram.extend(header("OLD-KERNEL", None));
        let parsed = parse_datagram(&datagram).expect("parses");
        let want: Counts = [
            ("KUBE-CLUSTER-IP".to_owned(), Some(3)),
            ("KUBE-LOOP-BACK".to_owned(), Some(0)),
            ("OLD-KERNEL".to_owned(), None),
        ]
        .into();
        assert_eq!(
            parsed,
            Datagram {
                sets: want,
                done: false
            }
        );
        let done = parse_datagram(&message(NLMSG_DONE, &0i32.to_ne_bytes())).expect("parses");
        assert!(done.done && done.sets.is_empty());
    }

    #[test]
    fn a_refusal_and_broken_framing_are_errors() {
        let refused = message(NLMSG_ERROR, &(-1i32).to_ne_bytes());
        assert!(matches!(
            parse_datagram(&refused),
            Err(IpsetNetlinkError::Kernel(e)) if e.raw_os_error() == Some(1)
        ));
        let mut short = header("A", Some(1));
        short.truncate(20);
        assert!(matches!(
            parse_datagram(&short),
            Err(IpsetNetlinkError::Frame(_))
        ));
    }
}
