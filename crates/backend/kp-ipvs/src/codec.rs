//! The IPVS generic netlink family, sans I/O: request messages as bytes and reply bytes as
//! messages. Attribute numbers and layouts are those of the kernel's `linux/ip_vs.h` (family
//! `IPVS`, version 1); framing (netlink and genl headers, attribute alignment) comes from
//! `netlink-packet-core` and `netlink-packet-generic`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_packet_core::{
    DecodeError, DefaultNla, Emitable, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer,
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla, NlaBuffer,
    NlasIterator, Parseable, ParseableParametrized, emit_u16, emit_u16_be, emit_u32, parse_string,
    parse_u16, parse_u16_be, parse_u32,
};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::{GenlFamily, GenlHeader, GenlMessage};

use crate::types::{
    FLAG_HASHED, Forward, ListedRealServer, Protocol, RealServer, ServiceKey, Timeouts,
    VirtualServer,
};

/// The generic netlink family name the kernel registers for IPVS.
pub const FAMILY_NAME: &str = "IPVS";
/// `IPVS_GENL_VERSION`.
pub const FAMILY_VERSION: u8 = 1;

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// `IPVS_CMD_*`.
#[allow(missing_docs)]
pub mod cmd {
    pub const NEW_SERVICE: u8 = 1;
    pub const SET_SERVICE: u8 = 2;
    pub const DEL_SERVICE: u8 = 3;
    pub const GET_SERVICE: u8 = 4;
    pub const NEW_DEST: u8 = 5;
    pub const SET_DEST: u8 = 6;
    pub const DEL_DEST: u8 = 7;
    pub const GET_DEST: u8 = 8;
    pub const SET_CONFIG: u8 = 12;
    pub const GET_CONFIG: u8 = 13;
    pub const FLUSH: u8 = 17;
}

// IPVS_CMD_ATTR_*
const CMD_ATTR_SERVICE: u16 = 1;
const CMD_ATTR_DEST: u16 = 2;
const CMD_ATTR_TIMEOUT_TCP: u16 = 4;
const CMD_ATTR_TIMEOUT_TCP_FIN: u16 = 5;
const CMD_ATTR_TIMEOUT_UDP: u16 = 6;

// IPVS_SVC_ATTR_*
const SVC_ATTR_AF: u16 = 1;
const SVC_ATTR_PROTOCOL: u16 = 2;
const SVC_ATTR_ADDR: u16 = 3;
const SVC_ATTR_PORT: u16 = 4;
const SVC_ATTR_FWMARK: u16 = 5;
const SVC_ATTR_SCHED_NAME: u16 = 6;
const SVC_ATTR_FLAGS: u16 = 7;
const SVC_ATTR_TIMEOUT: u16 = 8;
const SVC_ATTR_NETMASK: u16 = 9;

// IPVS_DEST_ATTR_*
const DEST_ATTR_ADDR: u16 = 1;
const DEST_ATTR_PORT: u16 = 2;
const DEST_ATTR_FWD_METHOD: u16 = 3;
const DEST_ATTR_WEIGHT: u16 = 4;
const DEST_ATTR_U_THRESH: u16 = 5;
const DEST_ATTR_L_THRESH: u16 = 6;
const DEST_ATTR_ACTIVE_CONNS: u16 = 7;
const DEST_ATTR_INACT_CONNS: u16 = 8;
const DEST_ATTR_ADDR_FAMILY: u16 = 11;

/// A top-level attribute of an IPVS message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attr {
    /// `IPVS_CMD_ATTR_SERVICE`: a nested service.
    Service(Vec<ServiceAttr>),
    /// `IPVS_CMD_ATTR_DEST`: a nested destination.
    Dest(Vec<DestAttr>),
    /// `IPVS_CMD_ATTR_TIMEOUT_TCP` (seconds).
    TimeoutTcp(u32),
    /// `IPVS_CMD_ATTR_TIMEOUT_TCP_FIN` (seconds).
    TimeoutTcpFin(u32),
    /// `IPVS_CMD_ATTR_TIMEOUT_UDP` (seconds).
    TimeoutUdp(u32),
    /// Anything else, kept as bytes.
    Other(DefaultNla),
}

/// An attribute nested in [`Attr::Service`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceAttr {
    /// Address family (`AF_INET`, `AF_INET6`).
    Af(u16),
    /// IP protocol number.
    Protocol(u16),
    /// Address: 16 bytes, IPv4 in the first four (`union nf_inet_addr`).
    Addr([u8; 16]),
    /// Port (network byte order on the wire).
    Port(u16),
    /// Firewall mark (instead of address, protocol and port).
    Fwmark(u32),
    /// Scheduler name.
    SchedName(String),
    /// `struct ip_vs_flags { flags, mask }`.
    Flags {
        /// Flag values.
        flags: u32,
        /// Which flags to change.
        mask: u32,
    },
    /// Persistence timeout (seconds).
    Timeout(u32),
    /// Persistence granularity: a netmask for IPv4, a prefix length for IPv6.
    Netmask(u32),
    /// Anything else (statistics, persistence engine), kept as bytes.
    Other(DefaultNla),
}

/// An attribute nested in [`Attr::Dest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DestAttr {
    /// Address, as [`ServiceAttr::Addr`].
    Addr([u8; 16]),
    /// Port (network byte order on the wire).
    Port(u16),
    /// Forwarding method (`IP_VS_CONN_F_*`).
    FwdMethod(u32),
    /// Weight.
    Weight(u32),
    /// Upper connection threshold (0: none).
    UThresh(u32),
    /// Lower connection threshold (0: none).
    LThresh(u32),
    /// Active connections (read only).
    ActiveConns(u32),
    /// Inactive connections (read only).
    InactConns(u32),
    /// The real server's address family.
    AddrFamily(u16),
    /// Anything else (statistics, tunnel settings), kept as bytes.
    Other(DefaultNla),
}

impl Nla for Attr {
    fn value_len(&self) -> usize {
        match self {
            Self::Service(v) => v.as_slice().buffer_len(),
            Self::Dest(v) => v.as_slice().buffer_len(),
            Self::TimeoutTcp(_) | Self::TimeoutTcpFin(_) | Self::TimeoutUdp(_) => 4,
            Self::Other(n) => n.value_len(),
        }
    }

    fn kind(&self) -> u16 {
        match self {
            Self::Service(_) => CMD_ATTR_SERVICE,
            Self::Dest(_) => CMD_ATTR_DEST,
            Self::TimeoutTcp(_) => CMD_ATTR_TIMEOUT_TCP,
            Self::TimeoutTcpFin(_) => CMD_ATTR_TIMEOUT_TCP_FIN,
            Self::TimeoutUdp(_) => CMD_ATTR_TIMEOUT_UDP,
            Self::Other(n) => n.kind(),
        }
    }

    fn emit_value(&self, buffer: &mut [u8]) {
        match self {
            Self::Service(v) => v.as_slice().emit(buffer),
            Self::Dest(v) => v.as_slice().emit(buffer),
            Self::TimeoutTcp(x) | Self::TimeoutTcpFin(x) | Self::TimeoutUdp(x) => {
                put_u32(buffer, *x)
            }
            Self::Other(n) => n.emit_value(buffer),
        }
    }
}

impl Nla for ServiceAttr {
    fn value_len(&self) -> usize {
        match self {
            Self::Af(_) | Self::Protocol(_) | Self::Port(_) => 2,
            Self::Addr(_) => 16,
            Self::Fwmark(_) | Self::Timeout(_) | Self::Netmask(_) => 4,
            Self::SchedName(s) => s.len() + 1,
            Self::Flags { .. } => 8,
            Self::Other(n) => n.value_len(),
        }
    }

    fn kind(&self) -> u16 {
        match self {
            Self::Af(_) => SVC_ATTR_AF,
            Self::Protocol(_) => SVC_ATTR_PROTOCOL,
            Self::Addr(_) => SVC_ATTR_ADDR,
            Self::Port(_) => SVC_ATTR_PORT,
            Self::Fwmark(_) => SVC_ATTR_FWMARK,
            Self::SchedName(_) => SVC_ATTR_SCHED_NAME,
            Self::Flags { .. } => SVC_ATTR_FLAGS,
            Self::Timeout(_) => SVC_ATTR_TIMEOUT,
            Self::Netmask(_) => SVC_ATTR_NETMASK,
            Self::Other(n) => n.kind(),
        }
    }

    fn emit_value(&self, buffer: &mut [u8]) {
        match self {
            Self::Af(x) | Self::Protocol(x) => put_u16(buffer, *x),
            Self::Port(x) => put_u16_be(buffer, *x),
            Self::Addr(a) => buffer[..16].copy_from_slice(a),
            Self::Fwmark(x) | Self::Timeout(x) | Self::Netmask(x) => put_u32(buffer, *x),
            Self::SchedName(s) => {
                buffer[..s.len()].copy_from_slice(s.as_bytes());
                buffer[s.len()] = 0;
            }
            Self::Flags { flags, mask } => {
                put_u32(&mut buffer[..4], *flags);
                put_u32(&mut buffer[4..8], *mask);
            }
            Self::Other(n) => n.emit_value(buffer),
        }
    }
}

impl Nla for DestAttr {
    fn value_len(&self) -> usize {
        match self {
            Self::Addr(_) => 16,
            Self::Port(_) | Self::AddrFamily(_) => 2,
            Self::FwdMethod(_)
            | Self::Weight(_)
            | Self::UThresh(_)
            | Self::LThresh(_)
            | Self::ActiveConns(_)
            | Self::InactConns(_) => 4,
            Self::Other(n) => n.value_len(),
        }
    }

    fn kind(&self) -> u16 {
        match self {
            Self::Addr(_) => DEST_ATTR_ADDR,
            Self::Port(_) => DEST_ATTR_PORT,
            Self::FwdMethod(_) => DEST_ATTR_FWD_METHOD,
            Self::Weight(_) => DEST_ATTR_WEIGHT,
            Self::UThresh(_) => DEST_ATTR_U_THRESH,
            Self::LThresh(_) => DEST_ATTR_L_THRESH,
            Self::ActiveConns(_) => DEST_ATTR_ACTIVE_CONNS,
            Self::InactConns(_) => DEST_ATTR_INACT_CONNS,
            Self::AddrFamily(_) => DEST_ATTR_ADDR_FAMILY,
            Self::Other(n) => n.kind(),
        }
    }

    fn emit_value(&self, buffer: &mut [u8]) {
        match self {
            Self::Addr(a) => buffer[..16].copy_from_slice(a),
            Self::Port(x) => put_u16_be(buffer, *x),
            Self::AddrFamily(x) => put_u16(buffer, *x),
            Self::FwdMethod(x)
            | Self::Weight(x)
            | Self::UThresh(x)
            | Self::LThresh(x)
            | Self::ActiveConns(x)
            | Self::InactConns(x) => put_u32(buffer, *x),
            Self::Other(n) => n.emit_value(buffer),
        }
    }
}

// The emit helpers only fail on a short buffer, which `value_len` rules out.
fn put_u16(buffer: &mut [u8], v: u16) {
    let _ = emit_u16(buffer, v);
}
fn put_u16_be(buffer: &mut [u8], v: u16) {
    let _ = emit_u16_be(buffer, v);
}
fn put_u32(buffer: &mut [u8], v: u32) {
    let _ = emit_u32(buffer, v);
}

fn parse_addr(value: &[u8]) -> Result<[u8; 16], DecodeError> {
    let mut out = [0; 16];
    match value.len() {
        4 | 16 => {
            out[..value.len()].copy_from_slice(value);
            Ok(out)
        }
        n => Err(DecodeError::invalid_ip_address(n)),
    }
}

fn parse_nested<T>(
    value: &[u8],
    parse: impl Fn(&NlaBuffer<&[u8]>) -> Result<T, DecodeError>,
) -> Result<Vec<T>, DecodeError> {
    NlasIterator::new(value)
        .map(|nla| nla.and_then(|nla| parse(&nla)))
        .collect()
}

fn other(buf: &NlaBuffer<&[u8]>) -> Result<DefaultNla, DecodeError> {
    DefaultNla::parse(buf)
}

impl Attr {
    fn parse(buf: &NlaBuffer<&[u8]>) -> Result<Self, DecodeError> {
        let v = buf.value();
        Ok(match buf.kind() {
            CMD_ATTR_SERVICE => Self::Service(parse_nested(v, ServiceAttr::parse)?),
            CMD_ATTR_DEST => Self::Dest(parse_nested(v, DestAttr::parse)?),
            CMD_ATTR_TIMEOUT_TCP => Self::TimeoutTcp(parse_u32(v)?),
            CMD_ATTR_TIMEOUT_TCP_FIN => Self::TimeoutTcpFin(parse_u32(v)?),
            CMD_ATTR_TIMEOUT_UDP => Self::TimeoutUdp(parse_u32(v)?),
            _ => Self::Other(other(buf)?),
        })
    }
}

impl ServiceAttr {
    fn parse(buf: &NlaBuffer<&[u8]>) -> Result<Self, DecodeError> {
        let v = buf.value();
        Ok(match buf.kind() {
            SVC_ATTR_AF => Self::Af(parse_u16(v)?),
            SVC_ATTR_PROTOCOL => Self::Protocol(parse_u16(v)?),
            SVC_ATTR_ADDR => Self::Addr(parse_addr(v)?),
            SVC_ATTR_PORT => Self::Port(parse_u16_be(v)?),
            SVC_ATTR_FWMARK => Self::Fwmark(parse_u32(v)?),
            SVC_ATTR_SCHED_NAME => Self::SchedName(parse_string(v)?),
            SVC_ATTR_FLAGS if v.len() >= 8 => Self::Flags {
                flags: parse_u32(&v[..4])?,
                mask: parse_u32(&v[4..8])?,
            },
            SVC_ATTR_TIMEOUT => Self::Timeout(parse_u32(v)?),
            SVC_ATTR_NETMASK => Self::Netmask(parse_u32(v)?),
            _ => Self::Other(other(buf)?),
        })
    }
}

impl DestAttr {
    fn parse(buf: &NlaBuffer<&[u8]>) -> Result<Self, DecodeError> {
        let v = buf.value();
        Ok(match buf.kind() {
            DEST_ATTR_ADDR => Self::Addr(parse_addr(v)?),
            DEST_ATTR_PORT => Self::Port(parse_u16_be(v)?),
            DEST_ATTR_FWD_METHOD => Self::FwdMethod(parse_u32(v)?),
            DEST_ATTR_WEIGHT => Self::Weight(parse_u32(v)?),
            DEST_ATTR_U_THRESH => Self::UThresh(parse_u32(v)?),
            DEST_ATTR_L_THRESH => Self::LThresh(parse_u32(v)?),
            DEST_ATTR_ACTIVE_CONNS => Self::ActiveConns(parse_u32(v)?),
            DEST_ATTR_INACT_CONNS => Self::InactConns(parse_u32(v)?),
            DEST_ATTR_ADDR_FAMILY => Self::AddrFamily(parse_u16(v)?),
            _ => Self::Other(other(buf)?),
        })
    }
}

/// One IPVS generic netlink message: a command and its attributes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpvsMessage {
    /// `IPVS_CMD_*` (see [`cmd`]).
    pub command: u8,
    /// Top-level attributes.
    pub attrs: Vec<Attr>,
}

impl GenlFamily for IpvsMessage {
    fn family_name() -> &'static str {
        FAMILY_NAME
    }
    fn command(&self) -> u8 {
        self.command
    }
    fn version(&self) -> u8 {
        FAMILY_VERSION
    }
}

impl Emitable for IpvsMessage {
    fn buffer_len(&self) -> usize {
        self.attrs.as_slice().buffer_len()
    }
    fn emit(&self, buffer: &mut [u8]) {
        self.attrs.as_slice().emit(buffer);
    }
}

impl ParseableParametrized<[u8], GenlHeader> for IpvsMessage {
    fn parse_with_param(buf: &[u8], header: GenlHeader) -> Result<Self, DecodeError> {
        Ok(Self {
            command: header.cmd,
            attrs: parse_nested(buf, Attr::parse)?,
        })
    }
}

fn family(address: IpAddr) -> u16 {
    match address {
        IpAddr::V4(_) => AF_INET,
        IpAddr::V6(_) => AF_INET6,
    }
}

fn addr_bytes(address: IpAddr) -> [u8; 16] {
    let mut out = [0; 16];
    match address {
        IpAddr::V4(a) => out[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => out = a.octets(),
    }
    out
}

fn addr_from(af: u16, bytes: &[u8; 16]) -> Option<IpAddr> {
    match af {
        AF_INET => Some(IpAddr::V4(Ipv4Addr::new(
            bytes[0], bytes[1], bytes[2], bytes[3],
        ))),
        AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(*bytes))),
        _ => None,
    }
}

/// The attributes that identify a service (enough for delete and for listing its dests).
fn service_id(key: &ServiceKey) -> Vec<ServiceAttr> {
    vec![
        ServiceAttr::Af(family(key.address)),
        ServiceAttr::Protocol(key.protocol.number()),
        ServiceAttr::Addr(addr_bytes(key.address)),
        ServiceAttr::Port(key.port),
    ]
}

/// The full service entry the kernel requires for add and edit.
fn service_full(vs: &VirtualServer) -> Vec<ServiceAttr> {
    let mut attrs = service_id(&vs.key);
    attrs.extend([
        ServiceAttr::SchedName(vs.scheduler.clone()),
        ServiceAttr::Flags {
            flags: vs.flags & !FLAG_HASHED,
            mask: u32::MAX,
        },
        ServiceAttr::Timeout(vs.timeout),
        // Persistence is per client address: a full netmask (IPv4) or prefix (IPv6).
        ServiceAttr::Netmask(match vs.key.address {
            IpAddr::V4(_) => u32::MAX,
            IpAddr::V6(_) => 128,
        }),
    ]);
    attrs
}

fn dest_full(rs: &RealServer) -> Vec<DestAttr> {
    vec![
        DestAttr::Addr(addr_bytes(rs.address)),
        DestAttr::Port(rs.port),
        DestAttr::FwdMethod(rs.forward.value()),
        DestAttr::Weight(rs.weight),
        DestAttr::UThresh(0),
        DestAttr::LThresh(0),
        DestAttr::AddrFamily(family(rs.address)),
    ]
}

fn message(command: u8, attrs: Vec<Attr>) -> IpvsMessage {
    IpvsMessage { command, attrs }
}

/// `IPVS_CMD_NEW_SERVICE`.
pub fn new_service(vs: &VirtualServer) -> IpvsMessage {
    message(cmd::NEW_SERVICE, vec![Attr::Service(service_full(vs))])
}

/// `IPVS_CMD_SET_SERVICE`: change scheduler, flags or timeout in place (connections stay).
pub fn set_service(vs: &VirtualServer) -> IpvsMessage {
    message(cmd::SET_SERVICE, vec![Attr::Service(service_full(vs))])
}

/// `IPVS_CMD_DEL_SERVICE`.
pub fn del_service(key: &ServiceKey) -> IpvsMessage {
    message(cmd::DEL_SERVICE, vec![Attr::Service(service_id(key))])
}

/// `IPVS_CMD_GET_SERVICE`, sent as a dump: every service.
pub fn get_services() -> IpvsMessage {
    message(cmd::GET_SERVICE, Vec::new())
}

/// `IPVS_CMD_NEW_DEST`.
pub fn new_dest(key: &ServiceKey, rs: &RealServer) -> IpvsMessage {
    message(
        cmd::NEW_DEST,
        vec![Attr::Service(service_id(key)), Attr::Dest(dest_full(rs))],
    )
}

/// `IPVS_CMD_SET_DEST`: change weight (or forwarding) in place.
pub fn set_dest(key: &ServiceKey, rs: &RealServer) -> IpvsMessage {
    message(
        cmd::SET_DEST,
        vec![Attr::Service(service_id(key)), Attr::Dest(dest_full(rs))],
    )
}

/// `IPVS_CMD_DEL_DEST`.
pub fn del_dest(key: &ServiceKey, address: IpAddr, port: u16) -> IpvsMessage {
    message(
        cmd::DEL_DEST,
        vec![
            Attr::Service(service_id(key)),
            Attr::Dest(vec![
                DestAttr::Addr(addr_bytes(address)),
                DestAttr::Port(port),
            ]),
        ],
    )
}

/// `IPVS_CMD_GET_DEST`, sent as a dump: the real servers of one service.
pub fn get_dests(key: &ServiceKey) -> IpvsMessage {
    message(cmd::GET_DEST, vec![Attr::Service(service_id(key))])
}

/// `IPVS_CMD_SET_CONFIG` with the non-zero timeouts.
/// Zero ones are left out: the kernel keeps the current value of an absent attribute.
pub fn set_config(t: &Timeouts) -> IpvsMessage {
    let attrs = [
        (t.tcp, Attr::TimeoutTcp(t.tcp)),
        (t.tcp_fin, Attr::TimeoutTcpFin(t.tcp_fin)),
        (t.udp, Attr::TimeoutUdp(t.udp)),
    ]
    .into_iter()
    .filter(|(v, _)| *v != 0)
    .map(|(_, a)| a)
    .collect();
    message(cmd::SET_CONFIG, attrs)
}

/// `IPVS_CMD_GET_CONFIG`.
pub fn get_config() -> IpvsMessage {
    message(cmd::GET_CONFIG, Vec::new())
}

/// `IPVS_CMD_FLUSH`: removes every virtual server.
pub fn flush() -> IpvsMessage {
    message(cmd::FLUSH, Vec::new())
}

/// Whether a request is a dump (a list reply ended by `NLMSG_DONE`) rather than one ACK.
pub fn is_dump(msg: &IpvsMessage) -> bool {
    matches!(msg.command, cmd::GET_SERVICE | cmd::GET_DEST)
}

/// Frames `payload` as a request with sequence number `seq` to family `family_id`.
fn frame<F>(payload: F, family_id: u16, seq: u32, flags: u16) -> Vec<u8>
where
    F: GenlFamily + Emitable + std::fmt::Debug,
{
    let mut genl = GenlMessage::from_payload(payload);
    genl.set_resolved_family_id(family_id);
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut msg = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(genl));
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

/// A complete netlink request for `msg`: a dump for [`is_dump`] ones (ended by
/// `NLMSG_DONE`), otherwise with an ACK requested (after `GET_CONFIG`'s one data message).
pub fn encode(msg: IpvsMessage, family_id: u16, seq: u32) -> Vec<u8> {
    let flags = if is_dump(&msg) {
        NLM_F_REQUEST | NLM_F_DUMP
    } else {
        NLM_F_REQUEST | NLM_F_ACK
    };
    frame(msg, family_id, seq, flags)
}

/// `CTRL_CMD_GETFAMILY` for [`FAMILY_NAME`]: the reply carries the family's id.
pub fn encode_family_request(seq: u32) -> Vec<u8> {
    let ctrl = GenlCtrl {
        cmd: GenlCtrlCmd::GetFamily,
        nlas: vec![GenlCtrlAttrs::FamilyName(FAMILY_NAME.to_owned())],
    };
    frame(ctrl, 0, seq, NLM_F_REQUEST | NLM_F_ACK)
}

/// One message of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply<T> {
    /// A data message.
    Data(T),
    /// `NLMSG_ERROR` with code 0: the request succeeded.
    Ack,
    /// `NLMSG_ERROR` with a negative errno.
    Error(i32),
    /// `NLMSG_DONE`: the end of a dump.
    Done,
}

/// One message and its sequence number.
pub type Sequenced<T> = (u32, Reply<T>);

/// Splits a datagram into its netlink messages and decodes each.
pub fn decode<T>(mut buf: &[u8]) -> Result<Vec<Sequenced<T>>, DecodeError>
where
    T: NetlinkDeserializable + std::fmt::Debug,
{
    let mut out = Vec::new();
    while !buf.is_empty() {
        let len = NetlinkBuffer::new_checked(buf)?.length() as usize;
        let aligned = ((len + 3) & !3).min(buf.len());
        let msg = NetlinkMessage::<T>::deserialize(&buf[..len])?;
        let seq = msg.header.sequence_number;
        let reply = match msg.payload {
            NetlinkPayload::InnerMessage(m) => Reply::Data(m),
            NetlinkPayload::Error(e) => match e.code {
                None => Reply::Ack,
                Some(code) => Reply::Error(code.get()),
            },
            NetlinkPayload::Done(_) => Reply::Done,
            _ => {
                buf = &buf[aligned..];
                continue;
            }
        };
        out.push((seq, reply));
        buf = &buf[aligned..];
    }
    Ok(out)
}

/// The family id from a `CTRL_CMD_GETFAMILY` reply.
pub fn family_id(reply: &GenlMessage<GenlCtrl>) -> Option<u16> {
    reply.payload.nlas.iter().find_map(|a| match a {
        GenlCtrlAttrs::FamilyId(id) => Some(*id),
        _ => None,
    })
}

/// Why a listed object could not be understood.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot read an IPVS {what} from the kernel: {reason}")]
pub struct ParseError {
    /// `service` or `destination`.
    pub what: &'static str,
    /// What was missing or odd.
    pub reason: String,
}

fn bad(what: &'static str, reason: impl Into<String>) -> ParseError {
    ParseError {
        what,
        reason: reason.into(),
    }
}

/// The virtual server in a `GET_SERVICE` reply. `Ok(None)` for services kube-proxy does not
/// program (firewall-mark services, unknown protocols): they are left alone.
pub fn service_of(msg: &IpvsMessage) -> Result<Option<VirtualServer>, ParseError> {
    let attrs = msg
        .attrs
        .iter()
        .find_map(|a| match a {
            Attr::Service(s) => Some(s),
            _ => None,
        })
        .ok_or_else(|| bad("service", "no service attribute"))?;
    let (mut af, mut proto, mut addr, mut port) = (None, None, None, None);
    let (mut sched, mut flags, mut timeout, mut fwmark) = (String::new(), 0, 0, 0);
    for a in attrs {
        match a {
            ServiceAttr::Af(x) => af = Some(*x),
            ServiceAttr::Protocol(x) => proto = Some(*x),
            ServiceAttr::Addr(x) => addr = Some(*x),
            ServiceAttr::Port(x) => port = Some(*x),
            ServiceAttr::Fwmark(x) => fwmark = *x,
            ServiceAttr::SchedName(x) => sched.clone_from(x),
            ServiceAttr::Flags { flags: f, .. } => flags = *f,
            ServiceAttr::Timeout(x) => timeout = *x,
            ServiceAttr::Netmask(_) | ServiceAttr::Other(_) => {}
        }
    }
    if fwmark != 0 {
        return Ok(None);
    }
    let af = af.ok_or_else(|| bad("service", "no address family"))?;
    let Some(protocol) = proto.and_then(Protocol::from_number) else {
        return Ok(None);
    };
    let address = addr
        .and_then(|a| addr_from(af, &a))
        .ok_or_else(|| bad("service", format!("no usable address (family {af})")))?;
    let port = port.ok_or_else(|| bad("service", "no port"))?;
    Ok(Some(VirtualServer {
        key: ServiceKey {
            address,
            protocol,
            port,
        },
        scheduler: sched,
        flags: flags & !FLAG_HASHED,
        timeout,
    }))
}

/// The real server in a `GET_DEST` reply; `service_af` is its service's family (older
/// kernels send no per-destination family).
pub fn dest_of(msg: &IpvsMessage, service_af: IpAddr) -> Result<ListedRealServer, ParseError> {
    let attrs = msg
        .attrs
        .iter()
        .find_map(|a| match a {
            Attr::Dest(d) => Some(d),
            _ => None,
        })
        .ok_or_else(|| bad("destination", "no destination attribute"))?;
    let mut af = family(service_af);
    let (mut addr, mut port, mut weight, mut fwd) = (None, None, 0, 0);
    let (mut active, mut inactive) = (0, 0);
    for a in attrs {
        match a {
            DestAttr::Addr(x) => addr = Some(*x),
            DestAttr::Port(x) => port = Some(*x),
            DestAttr::Weight(x) => weight = *x,
            DestAttr::FwdMethod(x) => fwd = *x,
            DestAttr::ActiveConns(x) => active = *x,
            DestAttr::InactConns(x) => inactive = *x,
            DestAttr::AddrFamily(x) => af = *x,
            DestAttr::UThresh(_) | DestAttr::LThresh(_) | DestAttr::Other(_) => {}
        }
    }
    let address = addr
        .and_then(|a| addr_from(af, &a))
        .ok_or_else(|| bad("destination", "no usable address"))?;
    Ok(ListedRealServer {
        server: RealServer {
            address,
            port: port.ok_or_else(|| bad("destination", "no port"))?,
            weight,
            forward: Forward::from_value(fwd)
                .ok_or_else(|| bad("destination", format!("forwarding method {fwd}")))?,
        },
        active_connections: active,
        inactive_connections: inactive,
    })
}

/// The timeouts in a `GET_CONFIG` reply.
pub fn timeouts_of(msg: &IpvsMessage) -> Timeouts {
    let mut t = Timeouts::default();
    for a in &msg.attrs {
        match a {
            Attr::TimeoutTcp(x) => t.tcp = *x,
            Attr::TimeoutTcpFin(x) => t.tcp_fin = *x,
            Attr::TimeoutUdp(x) => t.udp = *x,
            _ => {}
        }
    }
    t
}
