//! A verdict-free layout class ([`ClassObject`]s of `kp_rules::nftables::layout::class`)
//! as the operations nft 1.0.6 sends for its statements. A slot count's: entry sets and
//! slot maps (with the `typeof` user data `nft list` prints them from) and the pick rules (a
//! concatenated key lookup, `numgen` into the concatenation's last register, the map lookup
//! writing the `dnat` address and port registers). An affinity port's: its dynamic pin maps
//! (timeout, size), endpoint sets, pin lookups (the source address looked up twice, into the
//! `dnat` address and port registers) and record rules (`ct status dnat`, the original
//! destination's key, the endpoint's, two `update`s). Golden tests compare bytes with nft's.

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};
use kp_rules::nftables::TABLE;
use kp_rules::nftables::cmd::AddrField;
use kp_rules::nftables::layout::Changes;
use kp_rules::nftables::layout::class::{
    AFFINITY_SIZE, ClassObject, NodePortDst, PickRule, PinLookup, PinRecord, PodMatch, Source,
};
use kp_rules::nftables::layout::fixed::{AFFINITY, AFFINITY_RECORD};

use crate::codec::{Batch, Family, udata_u32s};
use crate::expr::{
    CT_DST_IP, CT_DST_IP6, CT_PROTO_DST, CmpOp, Expr, META_L4PROTO, PAYLOAD_TRANSPORT, REG_1, REG_2,
};
use crate::lower::{
    Lowered, Op, SET_EVAL, SET_TIMEOUT, SetSpec, TYPE_INET_PROTO, TYPE_INET_SERVICE,
    TYPE_IPV4_ADDR, TYPE_IPV6_ADDR, addr_offset, concat_register, concat_type, load_addr,
    load_addr_to, match_iifname, match_prefix, match_proto, push_proto_port_load,
};

/// nft's id of the integer type (`numgen`'s).
const TYPE_INTEGER: u32 = 4;
/// `NFT_SET_MAP`.
const SET_MAP: u32 = 0x8;
/// `NFPROTO_IPV4`, `NFPROTO_IPV6`.
const NFPROTO_IPV4: u32 = 2;
const NFPROTO_IPV6: u32 = 10;

/// A value of a class object the kernel could not take as nft sends it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("class statement not supported over netlink: {statement}")]
pub struct ClassError {
    /// The statement, as `nft -f` text.
    pub statement: String,
}

/// The operations of `objects` on `family`'s table, in a batch whose next set id is
/// `first_set_id` (rules name the sets created with them by their ids, as nft's do).
pub fn lower_objects(
    family: IpFamily,
    objects: &[ClassObject],
    first_set_id: u32,
) -> Result<Vec<Lowered>, ClassError> {
    lower_with_ids(family, objects, first_set_id, Vec::new())
}

/// [`lower_objects`], with the batch ids of sets that exist already (`nodeport-ips`): nft
/// sends one of its own for them, which the kernel ignores (it finds the set by name
/// first), so only the golden tests pass any.
fn lower_with_ids<'a>(
    family: IpFamily,
    objects: &'a [ClassObject],
    first_set_id: u32,
    mut ids: Vec<(&'a str, u32)>,
) -> Result<Vec<Lowered>, ClassError> {
    let nl = crate::lower::family(family);
    let known = ids.len() as u32;
    let mut out = Vec::with_capacity(objects.len());
    for object in objects {
        let op = match object {
            ClassObject::EntrySet { name, node_port } => {
                ids.push((name, first_set_id + ids.len() as u32 - known));
                Some(Op::AddSet {
                    set: name.clone(),
                    spec: entry_set_spec(nl, *node_port),
                })
            }
            ClassObject::SlotMap {
                name,
                node_port,
                proto,
            } => {
                ids.push((name, first_set_id + ids.len() as u32 - known));
                Some(Op::AddSet {
                    set: name.clone(),
                    spec: slot_map_spec(nl, *node_port, *proto),
                })
            }
            ClassObject::Pick(rule) => {
                pick_exprs(nl, rule, &ids).map(|exprs| add_rule(rule.chain, exprs))
            }
            ClassObject::PinMap {
                name,
                ports,
                proto,
                seconds,
            } => {
                ids.push((name, first_set_id + ids.len() as u32 - known));
                Some(Op::AddSet {
                    set: name.clone(),
                    spec: pin_map_spec(nl, *ports, *proto, *seconds),
                })
            }
            ClassObject::EndpointSet { name } => {
                ids.push((name, first_set_id + ids.len() as u32 - known));
                Some(Op::AddSet {
                    set: name.clone(),
                    spec: endpoint_set_spec(nl),
                })
            }
            ClassObject::PinLookup(rule) => {
                pin_lookup_exprs(nl, rule, &ids).map(|exprs| add_rule(AFFINITY, exprs))
            }
            ClassObject::PinRecord(rule) => {
                Some(add_rule(AFFINITY_RECORD, pin_record_exprs(nl, rule, &ids)))
            }
        };
        let op = op.ok_or_else(|| ClassError {
            statement: object.statement(family),
        })?;
        out.push(Lowered {
            family: nl,
            table: TABLE,
            op,
        });
    }
    Ok(out)
}

fn add_rule(chain: &str, exprs: Vec<Expr>) -> Op {
    Op::AddRule {
        chain: chain.to_owned(),
        exprs,
        comment: None,
        anonymous: None,
    }
}

/// The batch id of `set` when `ids` (the sets created in this batch so far) holds it.
fn batch_id(set: &str, ids: &[(&str, u32)]) -> Option<u32> {
    ids.iter().find(|(name, _)| *name == set).map(|(_, id)| *id)
}

/// A lookup of `set` from register 1: by name and batch id when this batch creates it,
/// else by name.
fn lookup(set: &str, ids: &[(&str, u32)], dreg: Option<u32>) -> Expr {
    Expr::Lookup {
        set: set.to_owned(),
        set_id: batch_id(set, ids),
        sreg: REG_1,
        dreg,
    }
}

/// Append `changes` to `batch` as one transaction: its deletions, the sets, maps and rules
/// of `classes` (its new classes' objects), then its additions.
pub fn push_class_changes(
    batch: &mut Batch,
    family: IpFamily,
    classes: &[ClassObject],
    changes: &Changes,
) -> Result<(), ClassError> {
    let lowered = lower_objects(family, classes, batch.next_set_id())?;
    let nl = crate::lower::family(family);
    crate::layout::push_elements(batch, nl, false, &changes.delete);
    for (owner, op) in lowered.iter().enumerate() {
        batch.push(op, owner);
    }
    crate::layout::push_elements(batch, nl, true, &changes.add);
    Ok(())
}

fn addr(family: Family) -> (u32, u32) {
    match family {
        Family::Ipv4 => (TYPE_IPV4_ADDR, 4),
        Family::Ipv6 => (TYPE_IPV6_ADDR, 16),
    }
}

/// `type [<addr> .] inet_proto . inet_service`: key byte order unset, an empty concat
/// typeof record (what nft writes for a concatenated `type`).
fn entry_set_spec(family: Family, node_port: bool) -> SetSpec {
    let (addr_type, addr_len) = addr(family);
    let (key_type, key_len) = if node_port {
        (concat_type(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]), 8)
    } else {
        (
            concat_type(&[addr_type, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            addr_len + 8,
        )
    };
    SetSpec {
        flags: 0,
        key_type,
        key_len,
        data: None,
        timeout_ms: None,
        size: None,
        udata_prefix: udata_u32s(&[(&[0, 4], 0, &[]), (&[3, 8, 0, 4], EXPR_CONCAT, &[1, 0])]),
        comment: None,
    }
}

/// `typeof <key> . numgen random mod 1 : <ip> daddr . <proto> dport`.
fn slot_map_spec(family: Family, node_port: bool, proto: Protocol) -> SetSpec {
    let (addr_type, addr_len) = addr(family);
    let mut key = Vec::new();
    if !node_port {
        key.push(addr_type);
    }
    key.extend([TYPE_INET_PROTO, TYPE_INET_SERVICE, TYPE_INTEGER]);
    let key_len = if node_port { 12 } else { addr_len + 12 };
    SetSpec {
        flags: SET_MAP,
        key_type: concat_type(&key),
        key_len,
        data: Some((concat_type(&[addr_type, TYPE_INET_SERVICE]), addr_len + 4)),
        timeout_ms: None,
        size: None,
        udata_prefix: slot_map_udata(family, node_port, proto),
        comment: None,
    }
}

// nft's user data of a `typeof` map (src/expression.c, payload.c, meta.c, numgen.c):
// records `(type u8, length u8, value)`; each expression is its type, then its own records.
const UDATA_SET_KEY_TYPEOF: u8 = 3;
const UDATA_SET_DATA_TYPEOF: u8 = 4;
const UDATA_SET_DATA_INTERVAL: u8 = 6;
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;
/// `proto_ip`, `proto_ip6`, `proto_th` and the transport protocols' descriptor ids.
const DESC_IP: u32 = 12;
const DESC_IP6: u32 = 13;
const DESC_TH: u32 = 11;
/// `IPHDR_SADDR`, `IPHDR_DADDR`, `IP6HDR_SADDR`, `IP6HDR_DADDR`, the `dport` field of `tcp`, `udp`, `sctp`, `th`.
const IPHDR_SADDR: u32 = 11;
const IPHDR_DADDR: u32 = 12;
const IP6HDR_SADDR: u32 = 8;
const IP6HDR_DADDR: u32 = 9;
const FIELD_DPORT: u32 = 2;

fn record(out: &mut Vec<u8>, ty: u8, value: &[u8]) {
    out.push(ty);
    // Every record here is far below 256 bytes (the largest, a key, is under 100).
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

fn expression(ty: u32, fields: &[u32]) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, field) in fields.iter().enumerate() {
        record(&mut body, i as u8, &field.to_ne_bytes());
    }
    let mut out = Vec::new();
    record(&mut out, 0, &ty.to_ne_bytes());
    record(&mut out, 1, &body);
    out
}

fn concat(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, part) in parts.iter().enumerate() {
        record(&mut body, i as u8, part);
    }
    let mut out = Vec::new();
    record(&mut out, 0, &EXPR_CONCAT.to_ne_bytes());
    record(&mut out, 1, &body);
    out
}

fn saddr(family: Family) -> Vec<u8> {
    match family {
        Family::Ipv4 => expression(EXPR_PAYLOAD, &[DESC_IP, IPHDR_SADDR]),
        Family::Ipv6 => expression(EXPR_PAYLOAD, &[DESC_IP6, IP6HDR_SADDR]),
    }
}

fn daddr(family: Family) -> Vec<u8> {
    match family {
        Family::Ipv4 => expression(EXPR_PAYLOAD, &[DESC_IP, IPHDR_DADDR]),
        Family::Ipv6 => expression(EXPR_PAYLOAD, &[DESC_IP6, IP6HDR_DADDR]),
    }
}

fn proto_desc(proto: Protocol) -> u32 {
    match proto {
        Protocol::Tcp => 8,
        Protocol::Udp => 6,
        Protocol::Sctp => 10,
    }
}

fn slot_map_udata(family: Family, node_port: bool, proto: Protocol) -> Vec<u8> {
    let mut key = Vec::new();
    if !node_port {
        key.push(daddr(family));
    }
    key.push(expression(EXPR_META, &[META_L4PROTO]));
    key.push(expression(EXPR_PAYLOAD, &[DESC_TH, FIELD_DPORT]));
    key.push(expression(EXPR_NUMGEN, &[1, 1, 0]));
    let data = [
        daddr(family),
        expression(EXPR_PAYLOAD, &[proto_desc(proto), FIELD_DPORT]),
    ];
    let mut out = udata_u32s(&[(&[0, 4], 0, &[]), (&[1, 4], 0, &[])]);
    record(&mut out, UDATA_SET_KEY_TYPEOF, &concat(&key));
    record(&mut out, UDATA_SET_DATA_TYPEOF, &concat(&data));
    record(&mut out, UDATA_SET_DATA_INTERVAL, &0u32.to_ne_bytes());
    out
}

/// The entry key (`[<ip> daddr .] meta l4proto . th dport`) from register 1 on; returns
/// its length in bytes.
fn load_key(exprs: &mut Vec<Expr>, family: Family, node_port: bool) -> u32 {
    let offset = if node_port {
        0
    } else {
        load_addr(exprs, family, AddrField::Destination);
        addr_offset(family, AddrField::Destination).1
    };
    push_proto_port_load(exprs, offset);
    offset + 8
}

fn cmp_local(exprs: &mut Vec<Expr>, field: AddrField) {
    exprs.push(Expr::FibAddrType {
        flags: if field == AddrField::Source { 1 } else { 2 },
        dreg: REG_1,
    });
    // RTN_LOCAL, host order.
    exprs.push(Expr::Cmp {
        sreg: REG_1,
        op: CmpOp::Eq,
        data: 2u32.to_ne_bytes().to_vec(),
    });
}

fn loopback(family: Family) -> IpNet {
    match family {
        Family::Ipv4 => {
            IpNet::V4(ipnet::Ipv4Net::new_assert(std::net::Ipv4Addr::LOCALHOST, 8)).trunc()
        }
        Family::Ipv6 => IpNet::V6(ipnet::Ipv6Net::new_assert(
            std::net::Ipv6Addr::LOCALHOST,
            128,
        )),
    }
}

/// A NodePort entry's destination match, if any.
fn match_node_port_dst(
    exprs: &mut Vec<Expr>,
    family: Family,
    dst: Option<NodePortDst>,
    ids: &[(&str, u32)],
) -> Option<()> {
    match dst {
        Some(NodePortDst::Ips) => {
            load_addr(exprs, family, AddrField::Destination);
            exprs.push(lookup("nodeport-ips", ids, None));
        }
        Some(NodePortDst::LocalNotLoopback) => {
            cmp_local(exprs, AddrField::Destination);
            match_prefix(
                exprs,
                family,
                AddrField::Destination,
                CmpOp::Neq,
                loopback(family),
            )?;
        }
        None => {}
    }
    Some(())
}

fn match_source(exprs: &mut Vec<Expr>, family: Family, source: &Source) -> Option<()> {
    match source {
        Source::Any => {}
        Source::Local => cmp_local(exprs, AddrField::Source),
        Source::Pods(PodMatch::Cidr(net)) => {
            match_prefix(exprs, family, AddrField::Source, CmpOp::Eq, *net)?;
        }
        Source::Pods(PodMatch::Iifname { name, wildcard }) => {
            match_iifname(exprs, CmpOp::Eq, name, *wildcard)?;
        }
    }
    Some(())
}

fn nat_family(family: Family) -> (u32, u32) {
    match family {
        Family::Ipv4 => (NFPROTO_IPV4, 4),
        Family::Ipv6 => (NFPROTO_IPV6, 16),
    }
}

/// The expressions of a pick rule, or `None` for a value nft would not send as is.
fn pick_exprs(family: Family, rule: &PickRule, ids: &[(&str, u32)]) -> Option<Vec<Expr>> {
    let mut exprs = Vec::new();
    match_proto(&mut exprs, rule.proto);
    match_node_port_dst(&mut exprs, family, rule.node_port, ids)?;
    match_source(&mut exprs, family, &rule.source)?;
    let node_port = rule.node_port.is_some();
    load_key(&mut exprs, family, node_port);
    exprs.push(lookup(&rule.set, ids, None));
    let len = load_key(&mut exprs, family, node_port);
    exprs.push(Expr::NumgenRandom {
        dreg: concat_register(len),
        modulus: rule.count,
    });
    exprs.push(lookup(&rule.map, ids, Some(REG_1)));
    let (nfproto, addr_len) = nat_family(family);
    exprs.push(Expr::DnatMap {
        family: nfproto,
        reg_addr: REG_1,
        reg_proto: concat_register(addr_len),
    });
    Some(exprs)
}

/// `typeof <ip> saddr : <ip> daddr` (or `: <proto> dport`), `flags dynamic,timeout`, the
/// port's timeout and [`AFFINITY_SIZE`].
fn pin_map_spec(family: Family, ports: bool, proto: Protocol, seconds: u32) -> SetSpec {
    let (addr_type, addr_len) = addr(family);
    let data = if ports {
        (TYPE_INET_SERVICE, 2)
    } else {
        (addr_type, addr_len)
    };
    SetSpec {
        flags: SET_MAP | SET_TIMEOUT | SET_EVAL,
        key_type: addr_type,
        key_len: addr_len,
        data: Some(data),
        timeout_ms: Some(u64::from(seconds) * 1000),
        size: Some(AFFINITY_SIZE),
        udata_prefix: pin_map_udata(family, ports, proto),
        comment: None,
    }
}

/// Big-endian key and data, the key's and data's `typeof` records, no data interval.
fn pin_map_udata(family: Family, ports: bool, proto: Protocol) -> Vec<u8> {
    let data = if ports {
        expression(EXPR_PAYLOAD, &[proto_desc(proto), FIELD_DPORT])
    } else {
        daddr(family)
    };
    let mut out = udata_u32s(&[(&[0, 4], 2, &[]), (&[1, 4], 2, &[])]);
    record(&mut out, UDATA_SET_KEY_TYPEOF, &saddr(family));
    record(&mut out, UDATA_SET_DATA_TYPEOF, &data);
    record(&mut out, UDATA_SET_DATA_INTERVAL, &0u32.to_ne_bytes());
    out
}

/// `type <addr> . inet_service`.
fn endpoint_set_spec(family: Family) -> SetSpec {
    let (addr_type, addr_len) = addr(family);
    SetSpec {
        flags: 0,
        key_type: concat_type(&[addr_type, TYPE_INET_SERVICE]),
        key_len: addr_len + 4,
        data: None,
        timeout_ms: None,
        size: None,
        udata_prefix: udata_u32s(&[(&[0, 4], 0, &[]), (&[3, 8, 0, 4], EXPR_CONCAT, &[1, 0])]),
        comment: None,
    }
}

/// `th dport` into `dreg`.
fn load_dport(exprs: &mut Vec<Expr>, dreg: u32) {
    exprs.push(Expr::Payload {
        base: PAYLOAD_TRANSPORT,
        offset: 2,
        len: 2,
        dreg,
    });
}

/// The expressions of a pin lookup, or `None` for a value nft would not send as is.
fn pin_lookup_exprs(family: Family, rule: &PinLookup, ids: &[(&str, u32)]) -> Option<Vec<Expr>> {
    let mut exprs = Vec::new();
    match_source(&mut exprs, family, &rule.source)?;
    match_proto(&mut exprs, rule.proto);
    match_node_port_dst(&mut exprs, family, rule.node_port, ids)?;
    load_key(&mut exprs, family, rule.node_port.is_some());
    exprs.push(lookup(&rule.set, ids, None));
    for (map, reg) in [(&rule.addrs, REG_1), (&rule.ports, REG_2)] {
        load_addr_to(&mut exprs, family, AddrField::Source, reg);
        exprs.push(Expr::Lookup {
            set: map.clone(),
            set_id: batch_id(map, ids),
            sreg: reg,
            dreg: Some(reg),
        });
    }
    exprs.push(Expr::Dnat {
        family: nat_family(family).0,
        reg_addr: REG_1,
        reg_proto: REG_2,
    });
    Some(exprs)
}

/// `IPS_DST_NAT`: the connection was DNATed.
const CT_STATUS_DST_NAT: u32 = 0x20;

/// The expressions of a pin record.
fn pin_record_exprs(family: Family, rule: &PinRecord, ids: &[(&str, u32)]) -> Vec<Expr> {
    let mut exprs = Vec::new();
    match_proto(&mut exprs, rule.proto);
    exprs.push(Expr::CtStatus { dreg: REG_1 });
    exprs.push(Expr::Bitwise {
        sreg: REG_1,
        dreg: REG_1,
        mask: CT_STATUS_DST_NAT.to_ne_bytes().to_vec(),
        xor: 0u32.to_ne_bytes().to_vec(),
    });
    exprs.push(Expr::Cmp {
        sreg: REG_1,
        op: CmpOp::Neq,
        data: 0u32.to_ne_bytes().to_vec(),
    });
    let (ct_daddr, addr_len) = match family {
        Family::Ipv4 => (CT_DST_IP, 4),
        Family::Ipv6 => (CT_DST_IP6, 16),
    };
    let offset = if rule.node_port {
        0
    } else {
        exprs.push(Expr::CtOriginal {
            key: ct_daddr,
            dreg: REG_1,
        });
        addr_len
    };
    exprs.push(Expr::Meta {
        key: META_L4PROTO,
        dreg: concat_register(offset),
    });
    exprs.push(Expr::CtOriginal {
        key: CT_PROTO_DST,
        dreg: concat_register(offset + 4),
    });
    exprs.push(lookup(&rule.entries, ids, None));
    load_addr(&mut exprs, family, AddrField::Destination);
    load_dport(&mut exprs, concat_register(addr_len));
    exprs.push(lookup(&rule.endpoints, ids, None));
    for (map, ports) in [(&rule.addrs, false), (&rule.ports, true)] {
        load_addr_to(&mut exprs, family, AddrField::Source, REG_1);
        if ports {
            load_dport(&mut exprs, REG_2);
        } else {
            load_addr_to(&mut exprs, family, AddrField::Destination, REG_2);
        }
        exprs.push(Expr::DynsetUpdate {
            set: map.clone(),
            set_id: batch_id(map, ids),
            sreg_key: REG_1,
            sreg_data: Some(REG_2),
        });
    }
    exprs
}

#[cfg(test)]
mod tests {
    use kp_core::model::{ServiceName, ServicePortName};
    use kp_rules::config::{LocalDetector, NodePortAddresses};
    use kp_rules::nftables::layout::AffinityPort;
    use kp_rules::nftables::layout::FixedConfig;
    use kp_rules::nftables::layout::Slots;
    use kp_rules::nftables::layout::class::{affinity_objects, count_objects};

    use super::*;

    fn config(family: IpFamily, detector: LocalDetector, np: NodePortAddresses) -> FixedConfig {
        FixedConfig {
            family,
            mark: 0x4000,
            random_fully: false,
            detector,
            node_port_addresses: np,
            service_cidrs: Vec::new(),
            localhost_rejects: &[],
        }
    }

    /// Each line of a capture: the statement nft was given, the message type and the
    /// message after its netlink header, as nft 1.0.6 sent them in one `nft -f` run
    /// (testdata/*.tsv; set ids count from 1 in that batch, as in ours).
    fn assert_golden(
        family: IpFamily,
        objects: &[ClassObject],
        golden: &str,
        nft_ids: Vec<(&str, u32)>,
    ) {
        let lines: Vec<&str> = golden.lines().collect();
        assert_eq!(objects.len(), lines.len(), "one message per object");
        let mut batch = Batch::new(100);
        let lowered =
            lower_with_ids(family, objects, batch.next_set_id(), nft_ids).expect("lowered");
        for (owner, op) in lowered.iter().enumerate() {
            batch.push(op, owner);
        }
        let encoded = batch.finish();
        let mut at = 20;
        for (object, line) in objects.iter().zip(lines) {
            let mut fields = line.split('\t');
            let (statement, ty, body) = (fields.next(), fields.next(), fields.next());
            assert_eq!(Some(object.statement(family).as_str()), statement);
            let message = &encoded.bytes[at..];
            let len = u32::from_ne_bytes([message[0], message[1], message[2], message[3]]);
            let message = &message[..len as usize];
            let kind = u16::from_ne_bytes([message[4], message[5]]).to_string();
            assert_eq!(Some(kind.as_str()), ty, "{line}");
            let hex: String = message[16..].iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(Some(hex.as_str()), body, "{line}");
            at += (len as usize).next_multiple_of(4);
        }
        assert_eq!(at + 20, encoded.bytes.len(), "then only END");
    }

    #[test]
    fn a_short_circuit_class_is_what_nft_sends() {
        let config = config(
            IpFamily::V4,
            LocalDetector::Cidrs(vec!["10.0.0.0/8".parse().expect("cidr")]),
            NodePortAddresses::All,
        );
        let objects = count_objects(&config, Slots::ShortCircuit, 2);
        assert_golden(
            IpFamily::V4,
            &objects,
            include_str!("../testdata/class-short-circuit-v4.tsv"),
            Vec::new(),
        );
    }

    #[test]
    fn a_policy_class_with_nodeport_addresses_is_what_nft_sends() {
        let config = config(
            IpFamily::V6,
            LocalDetector::None,
            NodePortAddresses::Ips(vec!["fd00::1".parse().expect("ip")]),
        );
        let objects = count_objects(&config, Slots::Policy, 3);
        assert_golden(
            IpFamily::V6,
            &objects,
            include_str!("../testdata/class-policy-v6.tsv"),
            // The id nft 1.0.6 gave the existing set in that run (after the eight new ones).
            vec![("nodeport-ips", 9)],
        );
    }

    /// The affinity port of the captures: `ns/web` TCP, 60 s.
    fn web() -> AffinityPort {
        let name = ServicePortName {
            service: ServiceName {
                namespace: "ns".into(),
                name: "web".into(),
            },
            port: "".into(),
            protocol: Protocol::Tcp,
        };
        AffinityPort::new(&name, 60)
    }

    #[test]
    fn an_affinity_class_is_what_nft_sends() {
        let config = config(
            IpFamily::V4,
            LocalDetector::Cidrs(vec!["10.244.0.0/16".parse().expect("cidr")]),
            NodePortAddresses::All,
        );
        let objects = affinity_objects(&config, web());
        assert_golden(
            IpFamily::V4,
            &objects,
            include_str!("../testdata/class-affinity-v4.tsv"),
            Vec::new(),
        );
    }

    #[test]
    fn an_ipv6_affinity_class_with_nodeport_addresses_is_what_nft_sends() {
        let config = config(
            IpFamily::V6,
            LocalDetector::BridgeInterface("cbr0".into()),
            NodePortAddresses::Ips(vec!["fd00::1".parse().expect("ip")]),
        );
        let objects = affinity_objects(&config, web());
        assert_golden(
            IpFamily::V6,
            &objects,
            include_str!("../testdata/class-affinity-v6.tsv"),
            // The id nft 1.0.6 gave the existing set in that run.
            vec![("nodeport-ips", 30)],
        );
    }
}
