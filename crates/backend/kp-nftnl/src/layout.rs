//! The element transactions of the verdict-free layout (`kp_rules::nftables::layout`) as
//! netlink messages: keys and data laid out as nft lays out the concatenations the layout's
//! sets are declared with (each part padded to 4 bytes; a slot is a 32-bit integer in host
//! byte order, as `numgen` writes it).
//!
//! The layout's fixed part and a new class's sets and rules are still `nft -f` text
//! ([`kp_rules::nftables::layout::fixed`]); only elements go through here. Not wired to the
//! backend yet.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use kp_core::model::Protocol;
use kp_rules::nftables::TABLE;
use kp_rules::nftables::layout::{Changes, Element, Entry};

use crate::codec::{
    Batch, Family, MsgKind, NFTA_LIST_ELEM, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS, NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_TABLE, NLM_F_CREATE,
};

/// `NFTA_SET_ELEM_KEY_END`: the last key of a range in a concatenation with intervals.
const NFTA_SET_ELEM_KEY_END: u16 = 10;
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
            key.extend_from_slice(&slot.to_ne_bytes());
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
    }
    Encoded { key, key_end, data }
}

/// Append `changes`' deletions, then its additions, to `batch`: one message per set and
/// direction holding up to [`PER_MESSAGE`] elements. The caller creates new classes' sets
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
    let mut by_set: BTreeMap<String, Vec<Encoded>> = BTreeMap::new();
    for element in elements {
        let mut encoded = encode(element);
        if !add {
            encoded.data = None;
        }
        by_set.entry(element.set_name()).or_default().push(encoded);
    }
    let flags = if add { NLM_F_CREATE } else { 0 };
    for (set, items) in &by_set {
        for chunk in items.chunks(PER_MESSAGE) {
            batch.raw(kind, flags, family, 0, |w| {
                w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
                w.put_str(NFTA_SET_ELEM_LIST_SET, set);
                let list = w.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
                for item in chunk {
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
}
