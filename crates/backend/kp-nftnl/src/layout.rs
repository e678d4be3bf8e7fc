//! The element transactions of the verdict-free layout (`kp_rules::nftables::layout`) as
//! netlink messages: keys and data laid out as nft lays out the concatenations the layout's
//! sets are declared with (each part padded to 4 bytes; a slot is a 32-bit integer in host
//! byte order, as `numgen` writes it).
//!
//! The layout's fixed part and a new affinity class are still `nft -f` text
//! ([`kp_rules::nftables::layout::fixed`]); a new slot-count class goes over netlink with
//! the elements ([`crate::class`]). Elements go through here, both ways:
//! [`read_table`] reads a table's chains, sets and elements back (a restart, or a full sync
//! after another program changed the table) and [`decode`] is [`encode`]'s inverse.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::Protocol;
use kp_rules::nftables::TABLE;
use kp_rules::nftables::layout::{Changes, Element, Entry};

use kp_rules::nftables::layout::SetOf;

use crate::abi::{
    NFTA_CHAIN_NAME, NFTA_CHAIN_TABLE, NFTA_DATA_VALUE, NFTA_LIST_ELEM, NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_KEY_END, NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_NAME, NFTA_SET_TABLE, NFTA_TABLE_NAME,
};
use kp_netlink::NLM_F_CREATE;

use crate::codec::{Batch, Family, MsgKind, attributes};
use crate::socket::{ApplyError, NftSocket};

/// Elements per message: large enough that a full sync is few messages, small enough to
/// stay well under a netlink message's 64 KiB attribute limit.
const PER_MESSAGE: usize = 256;

/// One element as the kernel takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    /// Key bytes.
    pub key: Vec<u8>,
    /// For a range: the last key.
    pub key_end: Option<Vec<u8>>,
    /// For a map: the data bytes.
    pub data: Option<Vec<u8>>,
}

fn push_addr(out: &mut Vec<u8>, addr: IpAddr) {
    match addr {
        IpAddr::V4(v4) => out.extend_from_slice(&v4.octets()),
        IpAddr::V6(v6) => out.extend_from_slice(&v6.octets()),
    }
}

fn push_proto(out: &mut Vec<u8>, proto: Protocol) {
    let number = match proto {
        Protocol::Tcp => 6,
        Protocol::Udp => 17,
        Protocol::Sctp => 132,
    };
    out.extend_from_slice(&[number, 0, 0, 0]);
}

fn push_port(out: &mut Vec<u8>, port: u16) {
    out.extend_from_slice(&port.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
}

fn push_entry(out: &mut Vec<u8>, entry: &Entry) {
    match entry {
        Entry::Ip { addr, proto, port } => {
            push_addr(out, *addr);
            push_proto(out, *proto);
            push_port(out, *port);
        }
        Entry::NodePort { proto, port } => {
            push_proto(out, *proto);
            push_port(out, *port);
        }
    }
}

/// The last address of `net`.
fn last(net: &IpNet) -> IpAddr {
    net.broadcast()
}

/// `element`'s key, range end and data.
pub fn encode(element: &Element) -> Encoded {
    let mut key = Vec::with_capacity(40);
    let (mut key_end, mut data) = (None, None);
    match element {
        Element::Entry(_, entry) => push_entry(&mut key, entry),
        Element::Slot {
            entry,
            slot,
            addr,
            port,
            ..
        } => {
            push_entry(&mut key, entry);
            key.extend_from_slice(&u32::from(*slot).to_ne_bytes());
            let mut value = Vec::with_capacity(20);
            push_addr(&mut value, *addr);
            push_port(&mut value, *port);
            data = Some(value);
        }
        Element::Allow(entry, net) => {
            push_entry(&mut key, entry);
            let mut end = key.clone();
            push_addr(&mut key, net.network());
            push_addr(&mut end, last(net));
            key_end = Some(end);
        }
        Element::Hairpin(addr) => {
            push_addr(&mut key, *addr);
            push_addr(&mut key, *addr);
        }
        Element::ClusterIp(addr) => push_addr(&mut key, *addr),
        Element::AffinityEntry(_, _, entry) => push_entry(&mut key, entry),
        Element::AffinityEndpoint(_, _, addr, port) => {
            push_addr(&mut key, *addr);
            push_port(&mut key, *port);
        }
    }
    Encoded { key, key_end, data }
}

/// Append `changes`' deletions, then its additions, to `batch`: one message per set and
/// direction holding up to `PER_MESSAGE` elements. The caller creates new classes' sets
/// (`changes.classes`) before this batch is applied.
pub fn push_changes(batch: &mut Batch, family: Family, changes: &Changes) {
    push_elements(batch, family, false, &changes.delete);
    push_elements(batch, family, true, &changes.add);
}

/// Append the addition (or deletion) of `elements` to `batch` (a large first sync sends its
/// additions in several batches, so that no single one holds them all).
pub fn push_elements(batch: &mut Batch, family: Family, add: bool, elements: &[Element]) {
    let kind = if add {
        MsgKind::NewSetElem
    } else {
        MsgKind::DelSetElem
    };
    // Grouped by set without naming each element's set, and encoded straight into the
    // batch: a first sync sends 290k elements at 10k services × 10 endpoints.
    let mut by_set: BTreeMap<SetOf, Vec<&Element>> = BTreeMap::new();
    for element in elements {
        by_set.entry(element.set_of()).or_default().push(element);
    }
    let flags = if add { NLM_F_CREATE } else { 0 };
    for items in by_set.values() {
        let Some(first) = items.first() else {
            continue;
        };
        let set = first.set_name();
        for chunk in items.chunks(PER_MESSAGE) {
            batch.raw(kind, flags, family, 0, |w| {
                w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                w.put_str(NFTA_SET_ELEM_LIST_SET, &set);
                let list = w.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
                for element in chunk {
                    let mut item = encode(element);
                    if !add {
                        item.data = None;
                    }
                    let elem = w.nest(NFTA_LIST_ELEM);
                    w.put_data(NFTA_SET_ELEM_KEY, &item.key);
                    if let Some(end) = &item.key_end {
                        w.put_data(NFTA_SET_ELEM_KEY_END, end);
                    }
                    if let Some(data) = &item.data {
                        w.put_data(NFTA_SET_ELEM_DATA, data);
                    }
                    w.nest_end(elem);
                }
                w.nest_end(list);
            });
        }
    }
}

/// Reads `N` bytes of `bytes` from `at` on.
fn take<'a>(bytes: &'a [u8], at: &mut usize, n: usize) -> Option<&'a [u8]> {
    let out = bytes.get(*at..*at + n)?;
    *at += n;
    Some(out)
}

fn read_addr(bytes: &[u8], at: &mut usize, family: Family) -> Option<IpAddr> {
    match family {
        Family::Ipv4 => {
            let b: [u8; 4] = take(bytes, at, 4)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
        Family::Ipv6 => {
            let b: [u8; 16] = take(bytes, at, 16)?.try_into().ok()?;
            Some(IpAddr::from(b))
        }
    }
}

fn read_proto(bytes: &[u8], at: &mut usize) -> Option<Protocol> {
    match take(bytes, at, 4)?.first()? {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        132 => Some(Protocol::Sctp),
        _ => None,
    }
}

fn read_port(bytes: &[u8], at: &mut usize) -> Option<u16> {
    let b = take(bytes, at, 4)?;
    Some(u16::from_be_bytes([b[0], b[1]]))
}

fn read_entry(bytes: &[u8], at: &mut usize, family: Family, node_port: bool) -> Option<Entry> {
    if node_port {
        let proto = read_proto(bytes, at)?;
        return Some(Entry::NodePort {
            proto,
            port: read_port(bytes, at)?,
        });
    }
    let addr = read_addr(bytes, at, family)?;
    let proto = read_proto(bytes, at)?;
    Some(Entry::Ip {
        addr,
        proto,
        port: read_port(bytes, at)?,
    })
}

/// The network from `first` to `last`, when that range is exactly one.
fn network(first: IpAddr, last: IpAddr) -> Option<IpNet> {
    let (a, b, bits) = match (first, last) {
        (IpAddr::V4(a), IpAddr::V4(b)) => (u128::from(u32::from(a)), u128::from(u32::from(b)), 32),
        (IpAddr::V6(a), IpAddr::V6(b)) => (u128::from(a), u128::from(b), 128),
        _ => return None,
    };
    let host_bits = 128 - (a ^ b).leading_zeros();
    let prefix = u8::try_from(bits - host_bits).ok()?;
    let net = IpNet::new(first, prefix).ok()?;
    (net.network() == first && net.broadcast() == last).then_some(net)
}

/// The element of the set `set` (of `family`'s table) with these key, range end and data
/// bytes: [`encode`]'s inverse. `None` for bytes this layout never writes.
pub fn decode(set: SetOf, family: Family, encoded: &Encoded) -> Option<Element> {
    let key = &encoded.key;
    let mut at = 0;
    let element = match set {
        SetOf::Entries(entry_set, node_port) => {
            Element::Entry(entry_set, read_entry(key, &mut at, family, node_port)?)
        }
        SetOf::Slots(slots, count, node_port, proto) => {
            let entry = read_entry(key, &mut at, family, node_port)?;
            (kp_rules::nftables::layout::element::entry_protocol(&entry) == proto).then_some(())?;
            let slot = u32::from_ne_bytes(take(key, &mut at, 4)?.try_into().ok()?);
            let (slot, count) = (u16::try_from(slot).ok()?, u16::try_from(count).ok()?);
            let data = encoded.data.as_deref()?;
            let mut d = 0;
            let addr = read_addr(data, &mut d, family)?;
            // A slot beyond its class's count is no element of ours.
            (slot < count).then_some(())?;
            Element::Slot {
                slots,
                count,
                entry,
                slot,
                addr,
                port: read_port(data, &mut d)?,
            }
        }
        SetOf::FirewallAllow => {
            let entry = read_entry(key, &mut at, family, false)?;
            let first = read_addr(key, &mut at, family)?;
            let end = encoded.key_end.as_deref()?;
            let mut e = at - first_len(family);
            let last = read_addr(end, &mut e, family)?;
            Element::Allow(entry, network(first, last)?)
        }
        SetOf::Hairpin => {
            let addr = read_addr(key, &mut at, family)?;
            (read_addr(key, &mut at, family)? == addr).then_some(())?;
            Element::Hairpin(addr)
        }
        SetOf::ClusterIps => Element::ClusterIp(read_addr(key, &mut at, family)?),
        SetOf::AffinityEntries(port, set, node_port) => {
            let entry = read_entry(key, &mut at, family, node_port)?;
            (kp_rules::nftables::layout::element::entry_protocol(&entry) == port.proto)
                .then_some(())?;
            Element::AffinityEntry(port, set, entry)
        }
        SetOf::AffinityEndpoints(port, list) => {
            let addr = read_addr(key, &mut at, family)?;
            Element::AffinityEndpoint(port, list, addr, read_port(key, &mut at)?)
        }
    };
    (at == key.len()).then_some(element)
}

fn first_len(family: Family) -> usize {
    match family {
        Family::Ipv4 => 4,
        Family::Ipv6 => 16,
    }
}

/// What one family's `kube-proxy` table holds, read back.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Readback {
    /// Its chains.
    pub chains: Vec<String>,
    /// Its sets and maps.
    pub sets: Vec<String>,
    /// The elements of the layout's per-service sets (see [`SetOf::parse`]); an element this
    /// layout would not write is left out (the next full sync cannot delete it, but no rule
    /// reaches it with a meaning of ours either).
    pub elements: Vec<Element>,
    /// Elements that could not be decoded (for the log).
    pub undecoded: usize,
}

impl Readback {
    /// Whether the table is this layout (its `dispatch` chain exists) rather than another
    /// (kube-proxy-rs' chain-per-service layout, or upstream's) or this layout's earlier
    /// version with endpoints maps shared by every class, which is replaced whole too.
    pub fn is_this_layout(&self) -> bool {
        use kp_rules::nftables::layout::element::is_shared_slot_map;
        self.chains
            .iter()
            .any(|c| c == kp_rules::nftables::layout::fixed::DISPATCH)
            && !self.sets.iter().any(|s| is_shared_slot_map(s))
    }
}

/// The first attribute of type `ty` in `attrs` as a string without its NUL.
fn string_attr(attrs: &[u8], ty: u16) -> Option<String> {
    attributes(attrs)
        .find(|(t, _)| *t == ty)
        .and_then(|(_, v)| std::str::from_utf8(v.strip_suffix(b"\0").unwrap_or(v)).ok())
        .map(str::to_owned)
}

/// The names (attribute `name_attr`) of objects of `kind` in our table of `family`.
fn names(
    socket: &mut NftSocket,
    kind: MsgKind,
    family: Family,
    table_attr: u16,
    name_attr: u16,
) -> Result<Vec<String>, ApplyError> {
    let messages = socket.dump(kind, family, |w| w.put_str(table_attr, TABLE))?;
    Ok(messages
        .iter()
        .filter_map(|m| m.get(4..))
        .filter(|attrs| string_attr(attrs, table_attr).as_deref() == Some(TABLE))
        .filter_map(|attrs| string_attr(attrs, name_attr))
        .collect())
}

/// The value inside an `NFTA_DATA_VALUE` nest.
fn data_value(nest: &[u8]) -> Option<Vec<u8>> {
    attributes(nest)
        .find(|(t, _)| *t == NFTA_DATA_VALUE)
        .map(|(_, v)| v.to_vec())
}

/// The elements of `set` as the kernel holds them.
fn set_elements(
    socket: &mut NftSocket,
    family: Family,
    set: &str,
) -> Result<Vec<Encoded>, ApplyError> {
    let messages = socket.dump(MsgKind::GetSetElem, family, |w| {
        w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
        w.put_str(NFTA_SET_ELEM_LIST_SET, set);
    })?;
    let mut out = Vec::new();
    for message in &messages {
        let Some(attrs) = message.get(4..) else {
            continue;
        };
        for (_, list) in attributes(attrs).filter(|(t, _)| *t == NFTA_SET_ELEM_LIST_ELEMENTS) {
            for (_, elem) in attributes(list).filter(|(t, _)| *t == NFTA_LIST_ELEM) {
                let mut encoded = Encoded {
                    key: Vec::new(),
                    key_end: None,
                    data: None,
                };
                for (ty, value) in attributes(elem) {
                    match ty {
                        NFTA_SET_ELEM_KEY => encoded.key = data_value(value).unwrap_or_default(),
                        NFTA_SET_ELEM_KEY_END => encoded.key_end = data_value(value),
                        NFTA_SET_ELEM_DATA => encoded.data = data_value(value),
                        _ => {}
                    }
                }
                out.push(encoded);
            }
        }
    }
    Ok(out)
}

/// One list's pins of an affinity port (its address and port maps, keyed by the client's
/// address) and the endpoint addresses whose clients are to be forgotten.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forget {
    /// The map of pinned addresses (`saddr : addr`).
    pub addresses: String,
    /// The map of pinned ports (`saddr : port`), keyed as `addresses`.
    pub ports: String,
    /// The addresses removed from the list.
    pub gone: std::collections::BTreeSet<IpAddr>,
}

/// Deletes, from each of `pins`' maps of `family`'s table, every client pinned to an address
/// in its `gone` (so no client stays pinned to a removed endpoint until its timeout).
/// Returns how many were deleted.
pub fn forget_clients_of(
    socket: &mut NftSocket,
    family: Family,
    pins: &[Forget],
) -> Result<usize, ApplyError> {
    let mut batch = Batch::new(1);
    let mut deleted = 0;
    for pin in pins {
        let stale: Vec<Vec<u8>> = set_elements(socket, family, &pin.addresses)?
            .into_iter()
            .filter(|element| {
                element.data.as_deref().is_some_and(|data| {
                    read_addr(data, &mut 0, family).is_some_and(|addr| pin.gone.contains(&addr))
                })
            })
            .map(|element| element.key)
            .collect();
        let ports: std::collections::BTreeSet<Vec<u8>> = set_elements(socket, family, &pin.ports)?
            .into_iter()
            .map(|element| element.key)
            .collect();
        deleted += stale.len();
        delete_keys(&mut batch, family, &pin.addresses, &stale);
        let stale_ports: Vec<Vec<u8>> = stale.into_iter().filter(|k| ports.contains(k)).collect();
        delete_keys(&mut batch, family, &pin.ports, &stale_ports);
    }
    if deleted > 0 {
        // A client whose entry expired meanwhile makes the kernel answer ENOENT for the
        // whole batch; the next removal sweeps again.
        socket.apply_batch(batch)?;
    }
    Ok(deleted)
}

/// Appends the deletion of the elements with `keys` from `map` to `batch`.
fn delete_keys(batch: &mut Batch, family: Family, map: &str, keys: &[Vec<u8>]) {
    for chunk in keys.chunks(PER_MESSAGE) {
        batch.raw(MsgKind::DelSetElem, 0, family, 0, |w| {
            w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            w.put_str(NFTA_SET_ELEM_LIST_SET, map);
            let list = w.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
            for key in chunk {
                let elem = w.nest(NFTA_LIST_ELEM);
                w.put_data(NFTA_SET_ELEM_KEY, key);
                w.nest_end(elem);
            }
            w.nest_end(list);
        });
    }
}

/// The chains of `family`'s `kube-proxy` table; `None` when there is no such table (the
/// canary check: two small dumps).
pub fn read_chains(
    socket: &mut NftSocket,
    family: Family,
) -> Result<Option<Vec<String>>, ApplyError> {
    let tables = socket.dump(MsgKind::GetTable, family, |_| {})?;
    let exists = tables
        .iter()
        .filter_map(|m| m.get(4..))
        .any(|attrs| string_attr(attrs, NFTA_TABLE_NAME).as_deref() == Some(TABLE));
    if !exists {
        return Ok(None);
    }
    names(
        socket,
        MsgKind::GetChain,
        family,
        NFTA_CHAIN_TABLE,
        NFTA_CHAIN_NAME,
    )
    .map(Some)
}

/// Reads `family`'s `kube-proxy` table back: `None` when there is none. Dumps its chains
/// and sets, and the elements of each of the layout's per-service sets (not those of the
/// affinity maps, which the packet path writes).
pub fn read_table(socket: &mut NftSocket, family: Family) -> Result<Option<Readback>, ApplyError> {
    let Some(chains) = read_chains(socket, family)? else {
        return Ok(None);
    };
    let mut back = Readback {
        chains,
        sets: names(
            socket,
            MsgKind::GetSet,
            family,
            NFTA_SET_TABLE,
            NFTA_SET_NAME,
        )?,
        ..Readback::default()
    };
    if !back.is_this_layout() {
        return Ok(Some(back));
    }
    for set in back.sets.clone() {
        let Some(of) = SetOf::parse(&set) else {
            continue;
        };
        for encoded in set_elements(socket, family, &set)? {
            match decode(of, family, &encoded) {
                Some(element) => back.elements.push(element),
                None => back.undecoded += 1,
            }
        }
    }
    Ok(Some(back))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use kp_rules::nftables::layout::Slots;

    use super::*;

    #[test]
    fn keys_are_laid_out_as_nft_lays_out_the_concatenations() {
        let entry = Entry::Ip {
            addr: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 1)),
            proto: Protocol::Udp,
            port: 53,
        };
        let slot = encode(&Element::Slot {
            slots: Slots::Policy,
            count: 3,
            entry,
            slot: 2,
            addr: IpAddr::V4(Ipv4Addr::new(10, 244, 0, 7)),
            port: 5353,
        });
        let mut key = vec![10, 96, 0, 1, 17, 0, 0, 0, 0, 53, 0, 0];
        key.extend_from_slice(&2u32.to_ne_bytes());
        assert_eq!(slot.key, key);
        assert_eq!(slot.data, Some(vec![10, 244, 0, 7, 0x14, 0xe9, 0, 0]));
        let allow = encode(&Element::Allow(
            entry,
            "198.51.100.0/24".parse().expect("literal"),
        ));
        assert_eq!(&allow.key[12..], &[198, 51, 100, 0]);
        assert_eq!(
            allow.key_end.as_deref().map(|k| &k[12..]),
            Some(&[198, 51, 100, 255][..])
        );
        let nodeport = encode(&Element::Entry(
            kp_rules::nftables::layout::EntrySet::Reject,
            Entry::NodePort {
                proto: Protocol::Sctp,
                port: 30000,
            },
        ));
        assert_eq!(nodeport.key, vec![132, 0, 0, 0, 0x75, 0x30, 0, 0]);
    }

    fn nodeport_sctp() -> Entry {
        Entry::NodePort {
            proto: Protocol::Sctp,
            port: 30132,
        }
    }

    #[test]
    fn decoding_reads_back_what_encoding_wrote() {
        use kp_rules::nftables::layout::EntrySet;
        let v6: IpAddr = "fd00::10".parse().expect("literal");
        let entry = Entry::Ip {
            addr: v6,
            proto: Protocol::Sctp,
            port: 9000,
        };
        let nodeport = Entry::NodePort {
            proto: Protocol::Udp,
            port: 30053,
        };
        let cases = [
            (
                Element::Entry(EntrySet::Count(Slots::Policy, 3), entry),
                "slots-3",
            ),
            (
                Element::Entry(EntrySet::Reject, nodeport),
                "nodeport-reject-services",
            ),
            (
                Element::Slot {
                    slots: Slots::ShortCircuit,
                    count: 8,
                    entry: nodeport,
                    slot: 7,
                    addr: "fd00::7".parse().expect("literal"),
                    port: 8443,
                },
                "nodeport-short-circuit-endpoints-8-udp",
            ),
            (
                Element::Allow(entry, "2001:db8::/48".parse().expect("literal")),
                "firewall-allow",
            ),
            (Element::Hairpin(v6), "hairpin"),
            (Element::ClusterIp(v6), "cluster-ips"),
        ];
        for (element, set) in cases {
            assert_eq!(element.set_name(), set);
            let of = SetOf::parse(set).expect("a set of the layout");
            let back = decode(of, Family::Ipv6, &encode(&element));
            assert_eq!(back.as_ref(), Some(&element), "{set}");
        }
        let port = kp_rules::nftables::layout::AffinityPort::new(
            &kp_core::model::ServicePortName {
                service: kp_core::model::ServiceName {
                    namespace: "ns".into(),
                    name: "web".into(),
                },
                port: "".into(),
                protocol: Protocol::Sctp,
            },
            10800,
        );
        use kp_rules::nftables::layout::{AffinitySet, PinList};
        for element in [
            Element::AffinityEntry(port, AffinitySet::Record, entry),
            Element::AffinityEntry(port, AffinitySet::ShortCircuit, nodeport_sctp()),
            Element::AffinityEndpoint(port, PinList::Local, v6, 8443),
        ] {
            let set = element.set_name();
            let of = SetOf::parse(&set).expect("a set of the layout");
            let back = decode(of, Family::Ipv6, &encode(&element));
            assert_eq!(back.as_ref(), Some(&element), "{set}");
        }
        // An entry of another protocol than its port's is not ours.
        let udp = Element::AffinityEntry(port, AffinitySet::Cluster, nodeport);
        let of = SetOf::parse(&udp.set_name()).expect("a set of the layout");
        assert_eq!(decode(of, Family::Ipv6, &encode(&udp)), None);
        // A key of the wrong length is not an element of ours.
        let mut short = encode(&Element::ClusterIp(v6));
        short.key.pop();
        assert_eq!(decode(SetOf::ClusterIps, Family::Ipv6, &short), None);
        assert_eq!(SetOf::parse("slots-03"), None);
        assert_eq!(SetOf::parse("affinity-10800"), None);
    }
}
