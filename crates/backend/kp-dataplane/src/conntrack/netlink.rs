//! Deleting conntrack entries over ctnetlink (a `NETLINK_NETFILTER` socket) instead of
//! exec'ing `conntrack -D`.
//!
//! ctnetlink deletes one entry per request, named by its original tuple, and deletes the whole
//! table when a request names none, so filters are applied here: one dump per address family
//! (`IPCTNL_MSG_CT_GET` with `NLM_F_DUMP`) is matched against every filter of a sync, then
//! each matching entry is deleted by its original tuple, its zone and its id (the id makes
//! the kernel refuse to delete a new entry that reused the tuple since the dump). This is
//! what upstream's netlink cleanup does too (kubernetes#126847).
//!
//! The messages are built and read by pure functions ([`dump_request`], [`delete_request`],
//! [`parse_replies`]) tested against golden bytes; [`NetlinkConntrack`] only moves them
//! through a socket, on a blocking thread.

use kp_core::report::ErrorChain as _;
use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;

use kp_core::model::{IpFamily, Protocol};
use netlink_packet_core::{
    DefaultNla, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage,
    NetlinkPayload, Nla,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use tracing::{debug, warn};

use super::{Conntrack, ConntrackError, FlowFilter};

/// `CTA_ID` (include/uapi/linux/netfilter/nfnetlink_conntrack.h): the entry's id, a
/// big-endian u32.
const CTA_ID: u16 = 12;
/// `CTA_ZONE`: the entry's conntrack zone, a big-endian u16 (absent for zone 0).
const CTA_ZONE: u16 = 18;

/// Receive buffer size. A dump sends batches of entries in datagrams of at most 32 KiB
/// (the kernel's cap for netlink dumps); anything larger than that never truncates.
const RECV_BUFFER_BYTES: usize = 64 * 1024;

/// One end of a conntrack entry's tuple.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FlowTuple {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port (absent for protocols without ports).
    pub src_port: Option<u16>,
    /// Destination port.
    pub dst_port: Option<u16>,
}

/// A conntrack entry as a dump reports it: what filters match on and what deleting it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowEntry {
    /// Address family (from the tuple's addresses).
    pub family: IpFamily,
    /// IP protocol number (17 UDP, 6 TCP, 132 SCTP, ...).
    pub protocol: u8,
    /// Client -> service, as the packet arrived.
    pub orig: FlowTuple,
    /// Endpoint -> client after DNAT.
    pub reply: FlowTuple,
    /// `CTA_ZONE` as the kernel sent it, echoed back on delete (entries in another zone are
    /// not found without it).
    zone: Option<DefaultNla>,
    /// `CTA_ID` as the kernel sent it, echoed back on delete.
    id: Option<DefaultNla>,
}

impl FlowEntry {
    /// The entry's conntrack id, if the kernel reported one.
    pub fn id(&self) -> Option<u32> {
        self.id
            .as_ref()
            .and_then(|nla| <[u8; 4]>::try_from(nla_value(nla).as_slice()).ok())
            .map(u32::from_be_bytes)
    }
}

/// What one netlink message in a reply said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// A conntrack entry (a dump's payload).
    Entry(FlowEntry),
    /// An entry this code cannot read (kept apart so one odd entry never stops a dump).
    Unreadable(String),
    /// The end of a dump.
    Done,
    /// An acknowledgement: `0` for success, else a negative errno.
    Ack(i32),
    /// Any other message (ignored).
    Other,
}

/// The IP protocol number conntrack uses for `protocol`.
pub fn protocol_number(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    }
}

impl FlowFilter {
    /// Whether `entry` is one of the entries this filter selects.
    pub fn matches(&self, entry: &FlowEntry) -> bool {
        fn same<T: PartialEq>(want: Option<T>, have: Option<T>) -> bool {
            want.is_none_or(|w| Some(w) == have)
        }
        self.family == entry.family
            && protocol_number(self.protocol) == entry.protocol
            && same(self.orig_dst, Some(entry.orig.dst))
            && same(self.orig_dst_port, entry.orig.dst_port)
            && same(self.reply_src, Some(entry.reply.src))
            && same(self.reply_src_port, entry.reply.src_port)
    }
}

fn nf_family(family: IpFamily) -> NetfilterProtoFamily {
    match family {
        IpFamily::V4 => NetfilterProtoFamily::IPv4,
        IpFamily::V6 => NetfilterProtoFamily::IPv6,
    }
}

fn serialize(family: IpFamily, flags: u16, sequence: u32, message: ConntrackMessage) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = sequence;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(nf_family(family), 0, 0),
            message,
        )),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    buf
}

/// A request for every conntrack entry of `family`.
pub fn dump_request(family: IpFamily, sequence: u32) -> Vec<u8> {
    serialize(
        family,
        NLM_F_REQUEST | NLM_F_DUMP,
        sequence,
        ConntrackMessage::Get(Vec::new()),
    )
}

/// A request deleting exactly `entry` (its original tuple, zone and id), acknowledged.
pub fn delete_request(entry: &FlowEntry, sequence: u32) -> Vec<u8> {
    let mut proto = vec![ProtoTuple::Protocol(entry.protocol.into())];
    proto.extend(entry.orig.src_port.map(ProtoTuple::SourcePort));
    proto.extend(entry.orig.dst_port.map(ProtoTuple::DestinationPort));
    let mut attributes = vec![ConntrackAttribute::CtaTupleOrig(vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(entry.orig.src),
            IPTuple::DestinationAddress(entry.orig.dst),
        ]),
        Tuple::Proto(proto),
    ])];
    attributes.extend(entry.zone.iter().cloned().map(ConntrackAttribute::Other));
    attributes.extend(entry.id.iter().cloned().map(ConntrackAttribute::Other));
    serialize(
        entry.family,
        NLM_F_REQUEST | NLM_F_ACK,
        sequence,
        ConntrackMessage::Delete(attributes),
    )
}

/// Read every netlink message in one received datagram.
///
/// Errors only when the framing itself is broken (then nothing after it can be trusted); an
/// entry whose attributes cannot be read becomes [`Reply::Unreadable`].
pub fn parse_replies(buf: &[u8]) -> Result<Vec<Reply>, ConntrackError> {
    kp_netlink::messages(buf)
        .map(|message| {
            message
                .map(|m| parse_one(m.bytes))
                .map_err(|err| ConntrackError::Decode(err.to_string()))
        })
        .collect()
}

fn parse_one(message: &[u8]) -> Reply {
    let parsed = match NetlinkMessage::<NetfilterMessage>::deserialize(message) {
        Ok(parsed) => parsed,
        Err(err) => return Reply::Unreadable(err.to_string()),
    };
    match parsed.payload {
        NetlinkPayload::Done(_) => Reply::Done,
        NetlinkPayload::Error(err) => Reply::Ack(err.raw_code()),
        NetlinkPayload::InnerMessage(NetfilterMessage {
            header,
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)),
            ..
        }) => match entry_of(header.family, attributes) {
            Ok(entry) => Reply::Entry(entry),
            Err(reason) => Reply::Unreadable(reason),
        },
        _ => Reply::Other,
    }
}

fn entry_of(
    family: NetfilterProtoFamily,
    attributes: Vec<ConntrackAttribute>,
) -> Result<FlowEntry, String> {
    let mut orig = None;
    let mut reply = None;
    let mut zone = None;
    let mut id = None;
    for attribute in attributes {
        match attribute {
            ConntrackAttribute::CtaTupleOrig(tuple) => orig = Some(tuple_of(tuple)?),
            ConntrackAttribute::CtaTupleReply(tuple) => reply = Some(tuple_of(tuple)?),
            ConntrackAttribute::Other(nla) if nla.kind() == CTA_ZONE => zone = Some(nla),
            ConntrackAttribute::Other(nla) if nla.kind() == CTA_ID => id = Some(nla),
            _ => {}
        }
    }
    let (orig, protocol) = orig.ok_or("entry without an original tuple")?;
    let (reply, _) = reply.ok_or("entry without a reply tuple")?;
    let family = match (family, orig.src) {
        (NetfilterProtoFamily::IPv4, IpAddr::V4(_)) => IpFamily::V4,
        (NetfilterProtoFamily::IPv6, IpAddr::V6(_)) => IpFamily::V6,
        (family, src) => return Err(format!("family {family:?} with address {src}")),
    };
    Ok(FlowEntry {
        family,
        protocol,
        orig,
        reply,
        zone,
        id,
    })
}

fn tuple_of(parts: Vec<Tuple>) -> Result<(FlowTuple, u8), String> {
    let (mut src, mut dst, mut protocol, mut src_port, mut dst_port) =
        (None, None, None, None, None);
    for part in parts {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(a),
                        IPTuple::DestinationAddress(a) => dst = Some(a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(protos) => {
                for proto in protos {
                    match proto {
                        ProtoTuple::Protocol(p) => protocol = Some(u8::from(p)),
                        ProtoTuple::SourcePort(p) => src_port = Some(p),
                        ProtoTuple::DestinationPort(p) => dst_port = Some(p),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    match (src, dst, protocol) {
        (Some(src), Some(dst), Some(protocol)) => Ok((
            FlowTuple {
                src,
                dst,
                src_port,
                dst_port,
            },
            protocol,
        )),
        _ => Err("tuple without addresses or protocol".into()),
    }
}

fn nla_value(nla: &DefaultNla) -> Vec<u8> {
    let mut value = vec![0; nla.value_len()];
    nla.emit_value(&mut value);
    value
}

/// `ENOENT`: the entry went away (timed out, or deleted by someone else) since the dump.
const ENOENT: i32 = 2;

/// Deletes conntrack entries over ctnetlink (see the module docs).
///
/// Each call opens its own socket in the calling thread's network namespace and works on a
/// blocking thread, so a sync never stalls the runtime and no state outlives a failure.
#[derive(Clone, Debug, Default)]
pub struct NetlinkConntrack {
    _private: (),
}

impl NetlinkConntrack {
    /// A ctnetlink client (needs `CAP_NET_ADMIN` when used).
    pub fn new() -> Self {
        Self::default()
    }

    /// Every conntrack entry of `family` (blocking).
    pub fn list(family: IpFamily) -> Result<Vec<FlowEntry>, ConntrackError> {
        let socket = Socket::open()?;
        socket.dump(family, |_| true)
    }

    /// Delete the entries matching any of `filters` (blocking); returns how many.
    pub fn delete_matching_blocking(filters: &[FlowFilter]) -> Result<usize, ConntrackError> {
        if filters.is_empty() {
            return Ok(0);
        }
        let socket = Socket::open()?;
        let families: BTreeSet<IpFamily> = filters.iter().map(|f| f.family).collect();
        let mut deleted = 0;
        // The kernel refusing one family's dump or one entry's delete does not stop the
        // rest; a broken socket does (what it would read next cannot be trusted).
        let mut failed = 0usize;
        let mut first_error = None;
        let mut refused = |err: ConntrackError| {
            failed += 1;
            first_error.get_or_insert(err);
        };
        for family in families {
            let stale = match socket.dump(family, |entry| filters.iter().any(|f| f.matches(entry)))
            {
                Ok(stale) => stale,
                Err(err @ ConntrackError::Kernel { .. }) => {
                    refused(err);
                    continue;
                }
                Err(err) => return Err(err),
            };
            for entry in &stale {
                match socket.delete(entry) {
                    Ok(true) => deleted += 1,
                    Ok(false) => {}
                    Err(err @ ConntrackError::Kernel { .. }) => refused(err),
                    Err(err) => return Err(err),
                }
            }
        }
        match first_error {
            Some(err) if deleted == 0 => Err(err),
            Some(err) => {
                warn!(failed, deleted, error = %err.chain(), "some conntrack entries were not deleted");
                Ok(deleted)
            }
            None => Ok(deleted),
        }
    }
}

impl Conntrack for NetlinkConntrack {
    async fn delete(&self, filter: &FlowFilter) -> Result<usize, ConntrackError> {
        self.delete_matching(std::slice::from_ref(filter)).await
    }

    async fn delete_matching(&self, filters: &[FlowFilter]) -> Result<usize, ConntrackError> {
        let filters = filters.to_vec();
        tokio::task::spawn_blocking(move || Self::delete_matching_blocking(&filters))
            .await
            .map_err(|err| ConntrackError::Socket(io::Error::other(err)))?
    }
}

/// A connected `NETLINK_NETFILTER` socket and the next sequence number.
struct Socket {
    inner: netlink_sys::Socket,
    sequence: std::cell::Cell<u32>,
}

impl Socket {
    fn open() -> Result<Self, ConntrackError> {
        let mut inner = netlink_sys::Socket::new(netlink_sys::protocols::NETLINK_NETFILTER)
            .map_err(ConntrackError::Socket)?;
        inner.bind_auto().map_err(ConntrackError::Socket)?;
        inner
            .connect(&netlink_sys::SocketAddr::new(0, 0))
            .map_err(ConntrackError::Socket)?;
        Ok(Self {
            inner,
            sequence: std::cell::Cell::new(1),
        })
    }

    fn next_sequence(&self) -> u32 {
        let sequence = self.sequence.get();
        self.sequence.set(sequence.wrapping_add(1));
        sequence
    }

    fn send(&self, request: &[u8]) -> Result<(), ConntrackError> {
        self.inner
            .send(request, 0)
            .map_err(ConntrackError::Socket)?;
        Ok(())
    }

    fn receive(&self, buf: &mut Vec<u8>) -> Result<Vec<Reply>, ConntrackError> {
        buf.clear();
        let size = self.inner.recv(buf, 0).map_err(ConntrackError::Socket)?;
        if size > buf.len() {
            return Err(ConntrackError::Decode(format!(
                "netlink datagram of {size} bytes truncated to {}",
                buf.len()
            )));
        }
        parse_replies(buf)
    }

    /// The entries of `family` that `keep` accepts (the rest are dropped as they arrive, so
    /// a large table is never held in memory).
    fn dump(
        &self,
        family: IpFamily,
        keep: impl Fn(&FlowEntry) -> bool,
    ) -> Result<Vec<FlowEntry>, ConntrackError> {
        self.send(&dump_request(family, self.next_sequence()))?;
        let mut buf = Vec::with_capacity(RECV_BUFFER_BYTES);
        let mut entries = Vec::new();
        let mut unreadable = 0usize;
        loop {
            for reply in self.receive(&mut buf)? {
                match reply {
                    // Only the requested family: older kernels ignore the family on dumps.
                    Reply::Entry(entry) if entry.family == family && keep(&entry) => {
                        entries.push(entry)
                    }
                    Reply::Entry(_) | Reply::Other => {}
                    Reply::Unreadable(reason) => {
                        unreadable += 1;
                        debug!(%reason, "skipping an unreadable conntrack entry");
                    }
                    Reply::Ack(0) => {}
                    Reply::Ack(code) => {
                        return Err(ConntrackError::Kernel {
                            request: "dump",
                            error: io::Error::from_raw_os_error(-code),
                        });
                    }
                    Reply::Done => {
                        if unreadable > 0 {
                            debug!(unreadable, "conntrack dump had unreadable entries");
                        }
                        return Ok(entries);
                    }
                }
            }
        }
    }

    /// Delete `entry`; false when it was already gone.
    fn delete(&self, entry: &FlowEntry) -> Result<bool, ConntrackError> {
        self.send(&delete_request(entry, self.next_sequence()))?;
        let mut buf = Vec::with_capacity(RECV_BUFFER_BYTES);
        loop {
            for reply in self.receive(&mut buf)? {
                match reply {
                    Reply::Ack(0) => return Ok(true),
                    Reply::Ack(code) if -code == ENOENT => return Ok(false),
                    Reply::Ack(code) => {
                        return Err(ConntrackError::Kernel {
                            request: "delete",
                            error: io::Error::from_raw_os_error(-code),
                        });
                    }
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("literal address")
    }

    fn udp_entry() -> FlowEntry {
        FlowEntry {
            family: IpFamily::V4,
            protocol: 17,
            orig: FlowTuple {
                src: ip("10.0.0.1"),
                dst: ip("10.96.0.10"),
                src_port: Some(1234),
                dst_port: Some(53),
            },
            reply: FlowTuple {
                src: ip("10.244.1.5"),
                dst: ip("10.0.0.1"),
                src_port: Some(5353),
                dst_port: Some(1234),
            },
            zone: None,
            id: Some(DefaultNla::new(CTA_ID, vec![0xde, 0xad, 0xbe, 0xef])),
        }
    }

    /// Hex without separators, for byte-exact comparisons that read like a packet dump.
    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|pair| {
                let text = std::str::from_utf8(pair).expect("ascii");
                u8::from_str_radix(text, 16).expect("hex digits")
            })
            .collect()
    }

    // The golden bytes below are written from the kernel's uapi layouts (struct nlmsghdr in
    // host order, little-endian here; struct nfgenmsg; nlattrs with NLA_F_NESTED on nests;
    // payloads in network order), not from this code's output.
    #[cfg(target_endian = "little")]
    #[test]
    fn dump_request_golden_bytes() {
        let expected = unhex(
            "14000000 0101 0103 07000000 00000000 \
             02 00 0000",
        );
        assert_eq!(hex(&dump_request(IpFamily::V4, 7)), hex(&expected));
        let v6 = dump_request(IpFamily::V6, 7);
        assert_eq!(v6[16], 10, "nfgen_family AF_INET6");
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn delete_request_golden_bytes_udp_ipv4() {
        let expected = unhex(
            "50000000 0201 0500 03000000 00000000 \
             02 00 0000 \
             3400 0180 \
               1400 0180 0800 0100 0a000001 0800 0200 0a60000a \
               1c00 0280 0500 0100 11000000 0600 0200 04d20000 0600 0300 00350000 \
             0800 0c00 deadbeef",
        );
        assert_eq!(hex(&delete_request(&udp_entry(), 3)), hex(&expected));
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn delete_request_golden_bytes_sctp_ipv6_in_a_zone() {
        let entry = FlowEntry {
            family: IpFamily::V6,
            protocol: protocol_number(Protocol::Sctp),
            orig: FlowTuple {
                src: ip("fd00::1"),
                dst: ip("fd00::10"),
                src_port: Some(40000),
                dst_port: Some(30053),
            },
            reply: FlowTuple {
                src: ip("fd00:10::5"),
                dst: ip("fd00::1"),
                src_port: Some(5353),
                dst_port: Some(40000),
            },
            zone: Some(DefaultNla::new(CTA_ZONE, vec![0x00, 0x07])),
            id: None,
        };
        let expected = unhex(
            "68000000 0201 0500 09000000 00000000 \
             0a 00 0000 \
             4c00 0180 \
               2c00 0180 \
                 1400 0300 fd000000000000000000000000000001 \
                 1400 0400 fd000000000000000000000000000010 \
               1c00 0280 0500 0100 84000000 0600 0200 9c400000 0600 0300 75650000 \
             0600 1200 00070000",
        );
        assert_eq!(hex(&delete_request(&entry, 9)), hex(&expected));
    }

    /// One dump datagram as the kernel sends it: an entry (orig and reply tuples, status,
    /// timeout, id, zone) followed by NLMSG_DONE.
    #[cfg(target_endian = "little")]
    fn dump_datagram() -> Vec<u8> {
        unhex(
            "9c000000 0001 0200 07000000 00000000 \
             02 00 0000 \
             3400 0180 \
               1400 0180 0800 0100 0a000001 0800 0200 0a60000a \
               1c00 0280 0500 0100 11000000 0600 0200 04d20000 0600 0300 00350000 \
             3400 0280 \
               1400 0180 0800 0100 0af40105 0800 0200 0a000001 \
               1c00 0280 0500 0100 11000000 0600 0200 14e90000 0600 0300 04d20000 \
             0800 0300 00000188 \
             0800 0700 0000003b \
             0800 0c00 deadbeef \
             0600 1200 00000000 \
             14000000 0300 0200 07000000 00000000 00000000",
        )
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn a_dump_datagram_parses_into_entries_and_done() {
        let replies = parse_replies(&dump_datagram()).expect("well framed");
        let mut expected = udp_entry();
        expected.zone = Some(DefaultNla::new(CTA_ZONE, vec![0, 0]));
        assert_eq!(replies, vec![Reply::Entry(expected.clone()), Reply::Done]);
        assert_eq!(expected.id(), Some(0xdead_beef));
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn a_parsed_entry_is_deleted_with_the_zone_and_id_it_came_with() {
        let replies = parse_replies(&dump_datagram()).expect("well framed");
        let Some(Reply::Entry(entry)) = replies.first() else {
            panic!("an entry: {replies:?}");
        };
        let request = delete_request(entry, 3);
        assert_eq!(
            hex(&request[request.len() - 16..]),
            "060012000000000008000c00deadbeef"
        );
    }

    #[cfg(target_endian = "little")]
    #[test]
    fn acks_and_errors_parse() {
        // NLMSG_ERROR with error 0 (ack) and -ENOENT, each followed by the request header.
        let ack = unhex(
            "24000000 0200 0001 03000000 00000000 00000000 \
             50000000 0201 0500 03000000 00000000 \
             24000000 0200 0001 04000000 00000000 feffffff \
             50000000 0201 0500 04000000 00000000",
        );
        assert_eq!(
            parse_replies(&ack).expect("well framed"),
            vec![Reply::Ack(0), Reply::Ack(-ENOENT)]
        );
    }

    #[test]
    fn broken_framing_is_an_error_and_a_broken_entry_is_not() {
        let mut datagram = vec![0u8; 16];
        datagram[0] = 200; // claims 200 bytes in a 16-byte datagram
        assert!(matches!(
            parse_replies(&datagram),
            Err(ConntrackError::Decode(_))
        ));
        // A conntrack message whose attribute overruns its message.
        let mut bad = vec![0u8; 24];
        bad[0] = 24;
        bad[4] = 0x00; // IPCTNL_MSG_CT_NEW
        bad[5] = 0x01; // NFNL_SUBSYS_CTNETLINK
        bad[16] = 2; // AF_INET
        bad[20] = 0x40; // nla_len 64 > what is left
        bad[22] = 1;
        let replies = parse_replies(&bad).expect("framing is fine");
        assert!(
            matches!(replies.as_slice(), [Reply::Unreadable(_)]),
            "{replies:?}"
        );
    }

    #[test]
    fn filters_match_on_every_field_they_set() {
        let entry = udp_entry();
        let all = FlowFilter {
            family: IpFamily::V4,
            protocol: Protocol::Udp,
            orig_dst: None,
            orig_dst_port: None,
            reply_src: None,
            reply_src_port: None,
        };
        assert!(all.matches(&entry));
        let service = FlowFilter {
            orig_dst: Some(ip("10.96.0.10")),
            orig_dst_port: Some(53),
            ..all.clone()
        };
        assert!(service.matches(&entry));
        let endpoint = FlowFilter {
            reply_src: Some(ip("10.244.1.5")),
            reply_src_port: Some(5353),
            ..service.clone()
        };
        assert!(endpoint.matches(&entry));
        for other in [
            FlowFilter {
                family: IpFamily::V6,
                ..all.clone()
            },
            FlowFilter {
                protocol: Protocol::Sctp,
                ..all.clone()
            },
            FlowFilter {
                orig_dst: Some(ip("10.96.0.11")),
                ..service.clone()
            },
            FlowFilter {
                orig_dst_port: Some(54),
                ..service.clone()
            },
            FlowFilter {
                reply_src: Some(ip("10.244.1.6")),
                ..endpoint.clone()
            },
            FlowFilter {
                reply_src_port: Some(5354),
                ..endpoint.clone()
            },
            // The NodePort filter names the original destination port only; the client's
            // own port 1234 is not it.
            FlowFilter {
                orig_dst_port: Some(1234),
                ..all.clone()
            },
        ] {
            assert!(!other.matches(&entry), "{other} must not match");
        }
    }
}
