//! Every ipset's entry count over netlink: one `IPSET_CMD_LIST` dump with the header-only
//! flag, what `ipset list -t` asks the kernel for, without starting the tool. The canary
//! check reads it every canary period, where an `ipset` run costs milliseconds on a real
//! node and most of a second in the emulated test VM.
//!
//! The messages are built and read by pure functions ([`list_headers_request`],
//! [`parse_datagram`]) tested against hand-made bytes; [`entry_counts`] only moves them
//! through a `NETLINK_NETFILTER` socket. Constants from the kernel's
//! `include/uapi/linux/netfilter/ipset/ip_set.h`.

use std::collections::BTreeMap;
use std::io;

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

const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_F_NET_BYTEORDER: u16 = 1 << 14;
const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
const AF_INET: u8 = 2;
const NLMSG_HEADER_BYTES: usize = 16;
const NFGENMSG_BYTES: usize = 4;
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
    let mut attrs = Vec::new();
    put_attr(&mut attrs, IPSET_ATTR_PROTOCOL, &[IPSET_PROTOCOL]);
    put_attr(
        &mut attrs,
        IPSET_ATTR_FLAGS | NLA_F_NET_BYTEORDER,
        &IPSET_FLAG_LIST_HEADER.to_be_bytes(),
    );
    let len = NLMSG_HEADER_BYTES + NFGENMSG_BYTES + attrs.len();
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    out.extend_from_slice(&(NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST).to_ne_bytes());
    out.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    out.extend_from_slice(&sequence.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, NFNETLINK_V0, resource id 0 (big-endian).
    out.extend_from_slice(&[AF_INET, 0, 0, 0]);
    out.extend_from_slice(&attrs);
    out
}

fn put_attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// `(type, value)` of each attribute in `buf`.
fn attrs(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, IpsetNetlinkError> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            let message = format!("attribute of {len} bytes in {}", buf.len());
            return Err(IpsetNetlinkError::Decode(message));
        }
        out.push((kind, &buf[4..len]));
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    Ok(out)
}

/// The name and entry count of one `IPSET_CMD_LIST` message's set.
fn set_of(payload: &[u8]) -> Result<Option<(String, Option<usize>)>, IpsetNetlinkError> {
    let attributes = attrs(payload.get(NFGENMSG_BYTES..).unwrap_or_default())?;
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
pub fn parse_datagram(mut buf: &[u8]) -> Result<Datagram, IpsetNetlinkError> {
    let mut out = Datagram::default();
    while buf.len() >= NLMSG_HEADER_BYTES {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < NLMSG_HEADER_BYTES || len > buf.len() {
            let message = format!("netlink message of {len} bytes in {} received", buf.len());
            return Err(IpsetNetlinkError::Decode(message));
        }
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let payload = &buf[NLMSG_HEADER_BYTES..len];
        match kind {
            NLMSG_DONE => out.done = true,
            NLMSG_ERROR => {
                let code = payload
                    .get(..4)
                    .and_then(|b| <[u8; 4]>::try_from(b).ok())
                    .map_or(0, i32::from_ne_bytes);
                if code != 0 {
                    let error = io::Error::from_raw_os_error(-code);
                    return Err(IpsetNetlinkError::Kernel(error));
                }
            }
            k if k == NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST => {
                if let Some((name, count)) = set_of(payload)? {
                    out.sets.insert(name, count);
                }
            }
            _ => {}
        }
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
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
        let len = NLMSG_HEADER_BYTES + payload.len();
        let mut out = Vec::new();
        out.extend_from_slice(&u32::try_from(len).expect("small").to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(&[0; 10]);
        out.extend_from_slice(payload);
        out.resize(out.len().next_multiple_of(4), 0);
        out
    }

    /// A header message for set `name` (`count`: its `IPSET_ATTR_ELEMENTS`), as the kernel
    /// sends it: protocol, name, type, family, revision, then the nested data.
    fn header(name: &str, count: Option<u32>) -> Vec<u8> {
        let mut payload = vec![AF_INET, 0, 0, 0];
        put_attr(&mut payload, IPSET_ATTR_PROTOCOL, &[6]);
        put_attr(
            &mut payload,
            IPSET_ATTR_SETNAME,
            format!("{name}\0").as_bytes(),
        );
        put_attr(&mut payload, 3, b"hash:ip,port\0");
        put_attr(&mut payload, 5, &[AF_INET]);
        put_attr(&mut payload, 4, &[5]);
        let mut data = Vec::new();
        put_attr(&mut data, 18 | NLA_F_NET_BYTEORDER, &1024u32.to_be_bytes());
        if let Some(count) = count {
            put_attr(
                &mut data,
                IPSET_ATTR_ELEMENTS | NLA_F_NET_BYTEORDER,
                &count.to_be_bytes(),
            );
        }
        put_attr(&mut data, 25 | NLA_F_NET_BYTEORDER, &1u32.to_be_bytes());
        put_attr(&mut payload, IPSET_ATTR_DATA | NLA_F_NESTED, &data);
        message(NFNL_SUBSYS_IPSET << 8 | IPSET_CMD_LIST, &payload)
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
            Err(IpsetNetlinkError::Decode(_))
        ));
    }
}
