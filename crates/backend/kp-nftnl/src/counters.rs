//! Named counters of a family's `kube-proxy` table, read back over netlink (one
//! `NFT_MSG_GETOBJ` dump, what `nft list counters table ip kube-proxy` shows): the values
//! behind metrics counted in the kernel, such as KEP-6032's rejected localhost NodePort
//! packets.

use kp_rules::nftables::TABLE;

use crate::codec::{Family, MsgKind, attributes};
use crate::socket::{ApplyError, NftSocket};

// linux/netfilter/nf_tables.h: a stateful object's attributes, and a counter's inside its data.
pub(crate) const NFTA_OBJ_TABLE: u16 = 1;
pub(crate) const NFTA_OBJ_NAME: u16 = 2;
pub(crate) const NFTA_OBJ_TYPE: u16 = 3;
pub(crate) const NFTA_OBJ_DATA: u16 = 4;
pub(crate) const NFT_OBJECT_COUNTER: u32 = 1;
pub(crate) const NFTA_COUNTER_BYTES: u16 = 1;
pub(crate) const NFTA_COUNTER_PACKETS: u16 = 2;

/// One named counter's values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedCounter {
    /// The counter's name.
    pub name: String,
    /// Packets counted.
    pub packets: u64,
    /// Bytes counted.
    pub bytes: u64,
}

/// The named counters of `family`'s `kube-proxy` table (none when there is no table).
pub fn read_counters(
    socket: &mut NftSocket,
    family: Family,
) -> Result<Vec<NamedCounter>, ApplyError> {
    let messages = socket.dump(MsgKind::GetObj, family, |w| {
        w.put_str(NFTA_OBJ_TABLE, TABLE);
        w.put_u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
    })?;
    Ok(messages
        .iter()
        .filter_map(|m| m.get(4..))
        .filter_map(parse_counter)
        .collect())
}

/// A counter object's attributes (after `struct nfgenmsg`); `None` for another table's
/// object or another type.
fn parse_counter(attrs: &[u8]) -> Option<NamedCounter> {
    let mut table = None;
    let mut name = None;
    let mut kind = None;
    let mut data = None;
    for (ty, value) in attributes(attrs) {
        match ty {
            NFTA_OBJ_TABLE => table = Some(c_string(value)?),
            NFTA_OBJ_NAME => name = Some(c_string(value)?),
            NFTA_OBJ_TYPE => kind = Some(u32::from_be_bytes(value.try_into().ok()?)),
            NFTA_OBJ_DATA => data = Some(value),
            _ => {}
        }
    }
    (table? == TABLE && kind? == NFT_OBJECT_COUNTER).then_some(())?;
    let (mut packets, mut bytes) = (0, 0);
    for (ty, value) in attributes(data?) {
        let value = u64::from_be_bytes(value.try_into().ok()?);
        match ty {
            NFTA_COUNTER_PACKETS => packets = value,
            NFTA_COUNTER_BYTES => bytes = value,
            _ => {}
        }
    }
    Some(NamedCounter {
        name: name?.to_owned(),
        packets,
        bytes,
    })
}

/// A NUL-terminated netlink string.
fn c_string(value: &[u8]) -> Option<&str> {
    std::str::from_utf8(value.strip_suffix(b"\0").unwrap_or(value)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Writer;

    fn object(table: &str, kind: u32, packets: u64) -> Vec<u8> {
        let mut w = Writer::default();
        w.put_str(NFTA_OBJ_TABLE, table);
        w.put_str(NFTA_OBJ_NAME, "localhost-nodeport-rejected-udp");
        w.put_u32(NFTA_OBJ_TYPE, kind);
        let nest = w.nest(NFTA_OBJ_DATA);
        w.put_u64(NFTA_COUNTER_BYTES, packets * 29);
        w.put_u64(NFTA_COUNTER_PACKETS, packets);
        w.nest_end(nest);
        w.bytes().to_vec()
    }

    #[test]
    fn parses_our_counters_only() {
        assert_eq!(
            parse_counter(&object(TABLE, NFT_OBJECT_COUNTER, 7)),
            Some(NamedCounter {
                name: "localhost-nodeport-rejected-udp".to_owned(),
                packets: 7,
                bytes: 203,
            })
        );
        assert_eq!(parse_counter(&object("other", NFT_OBJECT_COUNTER, 7)), None);
        assert_eq!(parse_counter(&object(TABLE, 2, 7)), None);
        assert_eq!(parse_counter(&[1, 2]), None);
    }
}
