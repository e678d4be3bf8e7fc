//! Kernel probe for the verdict-free nftables layout of issue 24 (see
//! bench/notes/2026-11-28-nftables-verdict-free-layout.md and docs/nftables-layout.md).
//!
//! `ip netns exec NS nft_layout SERVICES ENDPOINTS ROUNDS` writes, into the current network
//! namespace, the layout's fixed part with `nft -f -` (a few chains and rules, written
//! once) and then every per-service and per-endpoint fact as elements of verdict-free sets
//! and maps over netlink, timed as the "first sync" of the layout. Each round then times,
//! on the same socket and alternating so that all see the same load:
//!
//! - **move**: service 0's first endpoint moves (its `endpoints` element and its `hairpin`
//!   element replaced): the commit of the one-service partial sync;
//! - **resize**: service 0 gains (or loses) an endpoint, so it leaves one slot-count set for
//!   another and one `endpoints` element is added (removed);
//! - **rule**: a chain nothing reaches and one `jump` rule in it (the transaction the kernel
//!   validates the table for: what adding a new slot count costs);
//! - **empty**: the same chain without the rule (a commit that validates nothing).
//!
//! The elements are encoded here by hand (kp-nftnl's typed commands do not know the new
//! sets yet): the point is what the kernel does with them. Prints one line per round and
//! the medians (wall and time on a CPU, from `/proc/thread-self/schedstat`: the kernel runs
//! the batch in this thread).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::bail;
use kp_bench::probe::{median, nft_apply, timed, validation_probe};
use kp_nftnl::abi::{
    NFTA_LIST_ELEM, NFTA_SET_ELEM_DATA, NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET, NFTA_SET_ELEM_LIST_TABLE,
};
use kp_nftnl::codec::{MsgKind, Writer};
use kp_nftnl::{Batch, Family, NftSocket};

/// The table every probe object lives in.
const TABLE: &str = "kube-proxy";
/// `NLM_F_CREATE`: the netlink flag of element messages.
const NLM_F_CREATE: u16 = 0x400;
/// Elements per message when loading.
const PER_MESSAGE: usize = 512;
/// Messages per transaction when loading.
const PER_BATCH: usize = 200;
/// IPPROTO_TCP: every probe service is TCP.
const PROTO_TCP: u8 = 6;
const SERVICE_PORT: u16 = 80;
const TARGET_PORT: u16 = 8080;

/// The fixed part: tables, sets, maps, chains and rules, written once. `classes` are the
/// slot counts in use (one membership set and one rule each).
fn fixed_part(classes: &[u32], size: Option<usize>) -> String {
    let mut s = String::new();
    let size = size.map_or(String::new(), |n| format!(" size {n} ;"));
    let t = format!("ip {TABLE}");
    s += &format!("add table {t}\n");
    s += &format!(
        "add map {t} endpoints {{ typeof ip daddr . meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport ;{size} }}\n"
    );
    s += &format!(
        "add map {t} nodeport-endpoints {{ typeof meta l4proto . th dport . numgen random mod 1 : ip daddr . th dport ; }}\n"
    );
    s += &format!("add set {t} hairpin {{ type ipv4_addr . ipv4_addr ;{size} }}\n");
    s += &format!("add set {t} no-endpoints {{ type ipv4_addr . inet_proto . inet_service ; }}\n");
    s += &format!("add set {t} firewall {{ type ipv4_addr . inet_proto . inet_service ; }}\n");
    s += &format!(
        "add set {t} firewall-allow {{ type ipv4_addr . inet_proto . inet_service . ipv4_addr ; flags interval ; }}\n"
    );
    s += &format!(
        "add map {t} affinity-10800 {{ typeof ip saddr . ip daddr . meta l4proto . th dport : ip daddr . th dport ; flags dynamic,timeout ; timeout 10800s ; size 1048576 ; }}\n"
    );
    s += &format!(
        "add set {t} affinity-services-10800 {{ type ipv4_addr . inet_proto . inet_service ; }}\n"
    );
    for chain in [
        "nat-prerouting { type nat hook prerouting priority -100 ; }",
        "nat-output { type nat hook output priority -100 ; }",
        "nat-postrouting { type nat hook postrouting priority 100 ; }",
        "filter-forward { type filter hook forward priority -110 ; }",
        "filter-output { type filter hook output priority -110 ; }",
        "services",
        "mark-for-masquerade",
    ] {
        s += &format!("add chain {t} {chain}\n");
    }
    s += &format!("add rule {t} mark-for-masquerade mark set mark or 0x4000\n");
    s += &format!("add rule {t} nat-prerouting jump services\n");
    s += &format!("add rule {t} nat-output jump services\n");
    s += &format!(
        "add rule {t} services ip daddr . meta l4proto . th dport @affinity-services-10800 dnat ip to ip saddr . ip daddr . meta l4proto . th dport map @affinity-10800\n"
    );
    for n in classes {
        s += &class_part(*n);
    }
    for proto in ["tcp", "udp", "sctp"] {
        s += &format!(
            "add rule {t} nat-postrouting meta l4proto {proto} ct status dnat ct original ip daddr . meta l4proto . ct original proto-dst @affinity-services-10800 update @affinity-10800 {{ ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst : ip daddr . th dport }}\n"
        );
    }
    s += &format!("add rule {t} nat-postrouting ip saddr . ip daddr @hairpin masquerade\n");
    for chain in ["filter-forward", "filter-output"] {
        s += &format!(
            "add rule {t} {chain} ct state new ip daddr . meta l4proto . th dport @no-endpoints reject\n"
        );
        s += &format!(
            "add rule {t} {chain} ip daddr . meta l4proto . th dport @firewall ip daddr . meta l4proto . th dport . ip saddr != @firewall-allow drop\n"
        );
    }
    s
}

/// The membership sets and the two rules of one slot count.
fn class_part(n: u32) -> String {
    let t = format!("ip {TABLE}");
    format!(
        "add set {t} slots-{n} {{ type ipv4_addr . inet_proto . inet_service ; }}\n\
         add set {t} nodeport-slots-{n} {{ type inet_proto . inet_service ; }}\n\
         add rule {t} services ip daddr . meta l4proto . th dport @slots-{n} dnat ip to ip daddr . meta l4proto . th dport . numgen random mod {n} map @endpoints\n\
         add rule {t} services fib daddr type local meta l4proto . th dport @nodeport-slots-{n} dnat ip to meta l4proto . th dport . numgen random mod {n} map @nodeport-endpoints\n"
    )
}

/// The cluster IP of service `i`.
fn cluster_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i as u32)
}

/// Endpoint `j` of service `i` (`generation` moves endpoint 0).
fn endpoint(i: usize, j: usize, generation: usize) -> Ipv4Addr {
    let base = 0x0b00_0000 + (i as u32) * 128 + j as u32;
    if j == 0 && generation > 0 {
        Ipv4Addr::from(0x0c00_0000 + (i as u32) * 128 + generation as u32 % 100)
    } else {
        Ipv4Addr::from(base)
    }
}

/// The NodePort of service `i`, if it has one (every tenth).
fn node_port(i: usize) -> Option<u16> {
    (i.is_multiple_of(10) && i / 10 < 30_000).then(|| 30_000 + (i / 10) as u16)
}

/// `proto . port` as nft lays it out in a concatenation (each part padded to 4 bytes).
fn proto_port(key: &mut Vec<u8>, port: u16) {
    key.extend_from_slice(&[PROTO_TCP, 0, 0, 0]);
    key.extend_from_slice(&port.to_be_bytes());
    key.extend_from_slice(&[0, 0]);
}

/// `addr . proto . port`.
fn tuple(addr: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut key = addr.octets().to_vec();
    proto_port(&mut key, port);
    key
}

/// A slot: numgen's result is a 32-bit integer in host byte order.
fn with_slot(mut key: Vec<u8>, slot: u32) -> Vec<u8> {
    key.extend_from_slice(&slot.to_ne_bytes());
    key
}

/// `addr . port`, the data of an endpoints element.
fn addr_port(addr: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut data = addr.octets().to_vec();
    data.extend_from_slice(&port.to_be_bytes());
    data.extend_from_slice(&[0, 0]);
    data
}

/// A key and, for a map, its data.
type Item = (Vec<u8>, Option<Vec<u8>>);

/// One set's elements to add or delete: key and (for maps) data.
struct Elements<'a> {
    set: &'a str,
    add: bool,
    items: Vec<Item>,
}

/// Append `elements` to `batch` as messages of at most [`PER_MESSAGE`] elements.
fn push_elements(batch: &mut Batch, elements: &Elements<'_>) {
    let kind = if elements.add {
        MsgKind::NewSetElem
    } else {
        MsgKind::DelSetElem
    };
    let flags = if elements.add { NLM_F_CREATE } else { 0 };
    for (owner, chunk) in elements.items.chunks(PER_MESSAGE).enumerate() {
        batch.raw(kind, flags, Family::Ipv4, owner, |w: &mut Writer| {
            w.put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE);
            w.put_str(NFTA_SET_ELEM_LIST_SET, elements.set);
            let list = w.nest(NFTA_SET_ELEM_LIST_ELEMENTS);
            for (key, data) in chunk {
                let elem = w.nest(NFTA_LIST_ELEM);
                w.put_data(NFTA_SET_ELEM_KEY, key);
                if let Some(data) = data {
                    w.put_data(NFTA_SET_ELEM_DATA, data);
                }
                w.nest_end(elem);
            }
            w.nest_end(list);
        });
    }
}

/// Every element of service `i` with `endpoints` endpoints, by set.
fn service_elements(i: usize, endpoints: usize) -> Vec<(String, Vec<u8>, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    let ip = cluster_ip(i);
    out.push((format!("slots-{endpoints}"), tuple(ip, SERVICE_PORT), None));
    for j in 0..endpoints {
        let ep = endpoint(i, j, 0);
        let data = Some(addr_port(ep, TARGET_PORT));
        out.push((
            "endpoints".into(),
            with_slot(tuple(ip, SERVICE_PORT), j as u32),
            data.clone(),
        ));
        let mut pair = ep.octets().to_vec();
        pair.extend_from_slice(&ep.octets());
        out.push(("hairpin".into(), pair, None));
        if let Some(port) = node_port(i) {
            let mut key = Vec::new();
            proto_port(&mut key, port);
            out.push(("nodeport-endpoints".into(), with_slot(key, j as u32), data));
        }
    }
    if let Some(port) = node_port(i) {
        let mut key = Vec::new();
        proto_port(&mut key, port);
        out.push((format!("nodeport-slots-{endpoints}"), key, None));
    }
    out
}

/// Load every service's elements, [`PER_BATCH`] messages per transaction.
fn load(socket: &mut NftSocket, services: usize, endpoints: usize) -> anyhow::Result<usize> {
    let mut by_set: std::collections::BTreeMap<String, Vec<Item>> = Default::default();
    for i in 0..services {
        for (set, key, data) in service_elements(i, endpoints) {
            by_set.entry(set).or_default().push((key, data));
        }
    }
    let total = by_set.values().map(Vec::len).sum();
    let mut batch = Batch::new(1);
    for (set, items) in by_set {
        for chunk in items.chunks(PER_MESSAGE) {
            push_elements(
                &mut batch,
                &Elements {
                    set: &set,
                    add: true,
                    items: chunk.to_vec(),
                },
            );
            if batch.len() >= PER_BATCH {
                socket.apply_batch(std::mem::replace(&mut batch, Batch::new(1)))?;
            }
        }
    }
    if !batch.is_empty() {
        socket.apply_batch(batch)?;
    }
    Ok(total)
}

/// Service 0's first endpoint moves from generation `from` to `to`.
fn move_batch(from: usize, to: usize) -> Batch {
    let ip = cluster_ip(0);
    let (old, new) = (endpoint(0, 0, from), endpoint(0, 0, to));
    let key = with_slot(tuple(ip, SERVICE_PORT), 0);
    let pair = |a: Ipv4Addr| [a.octets(), a.octets()].concat();
    let mut batch = Batch::new(1);
    for elements in [
        Elements {
            set: "endpoints",
            add: false,
            items: vec![(key.clone(), None)],
        },
        Elements {
            set: "endpoints",
            add: true,
            items: vec![(key, Some(addr_port(new, TARGET_PORT)))],
        },
        Elements {
            set: "hairpin",
            add: false,
            items: vec![(pair(old), None)],
        },
        Elements {
            set: "hairpin",
            add: true,
            items: vec![(pair(new), None)],
        },
    ] {
        push_elements(&mut batch, &elements);
    }
    batch
}

/// Service 0 goes from `from` endpoints to `to` (one more or one fewer): it changes slot
/// count set and the last slot's element is added or removed.
fn resize_batch(from: usize, to: usize) -> Batch {
    let ip = cluster_ip(0);
    let service = tuple(ip, SERVICE_PORT);
    let mut batch = Batch::new(1);
    let (last, grow) = (from.max(to) - 1, to > from);
    let slot = with_slot(service.clone(), last as u32);
    let ep = Some(addr_port(endpoint(0, last, 0), TARGET_PORT));
    let from_set = format!("slots-{from}");
    let to_set = format!("slots-{to}");
    let mut list = vec![
        Elements {
            set: &from_set,
            add: false,
            items: vec![(service.clone(), None)],
        },
        Elements {
            set: &to_set,
            add: true,
            items: vec![(service, None)],
        },
    ];
    list.push(Elements {
        set: "endpoints",
        add: grow,
        items: vec![(slot, if grow { ep } else { None })],
    });
    for elements in &list {
        push_elements(&mut batch, elements);
    }
    batch
}

/// A chain nothing reaches, with (`rule`) or without one `jump` rule.
fn probe(rule: bool) -> String {
    let mut s = format!("add chain ip {TABLE} probe\nflush chain ip {TABLE} probe\n");
    if rule {
        s += &format!("add rule ip {TABLE} probe jump mark-for-masquerade\n");
    }
    s
}

/// Wall and on-CPU samples of one kind of transaction.
#[derive(Default)]
struct Samples {
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
}

impl Samples {
    fn push(&mut self, (wall, cpu): (Duration, Duration)) {
        self.wall.push(wall);
        self.cpu.push(cpu);
    }

    fn summary(&mut self) -> String {
        format!(
            "{:?} (on CPU {:?})",
            median(&mut self.wall),
            median(&mut self.cpu)
        )
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let services: usize = args.next().unwrap_or_else(|| "1000".into()).parse()?;
    let endpoints: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    let rounds: usize = args.next().unwrap_or_else(|| "10".into()).parse()?;
    if endpoints == 0 || endpoints > 100 {
        bail!("ENDPOINTS must be 1..=100");
    }
    let classes = [endpoints as u32, endpoints as u32 + 1];
    let started = Instant::now();
    // SIZE=N declares `endpoints` and `hairpin` with `size N` (the kernel sizes their hash
    // tables for N elements up front instead of growing them during the load).
    let size = std::env::var("SIZE")
        .ok()
        .filter(|v| !v.is_empty())
        .map(|v| v.parse())
        .transpose()?;
    nft_apply(&fixed_part(&classes, size))?;
    let fixed = started.elapsed();
    let mut socket = NftSocket::open()?;
    let started = Instant::now();
    let count = load(&mut socket, services, endpoints)?;
    eprintln!(
        "fixed part (nft -f) {fixed:?}; {count} elements over netlink in {:?}",
        started.elapsed()
    );
    eprintln!("rounds: {rounds}");
    let mut moves = Samples::default();
    let mut resizes = Samples::default();
    let mut rules = Samples::default();
    let mut empties = Samples::default();
    let mut rules_nft = Samples::default();
    for round in 1..=rounds {
        let m = timed(|| Ok(socket.apply_batch(move_batch(round - 1, round))?))?;
        let (from, to) = if round % 2 == 1 {
            (endpoints, endpoints + 1)
        } else {
            (endpoints + 1, endpoints)
        };
        let r = timed(|| Ok(socket.apply_batch(resize_batch(from, to))?))?;
        let j = timed(|| Ok(socket.apply(&validation_probe("probe", true), usize::MAX)?))?;
        let e = timed(|| Ok(socket.apply(&validation_probe("probe", false), usize::MAX)?))?;
        let n = timed(|| nft_apply(&probe(true)))?;
        println!(
            "round {round}: move {:?} ({:?}), resize {:?} ({:?}), rule {:?} ({:?}), empty {:?} ({:?}), rule via nft -f {:?}",
            m.0, m.1, r.0, r.1, j.0, j.1, e.0, e.1, n.0
        );
        moves.push(m);
        resizes.push(r);
        rules.push(j);
        empties.push(e);
        rules_nft.push(n);
    }
    println!(
        "{services}x{endpoints}, {count} elements, median of {rounds}: move {}; resize {}; one jump rule {}; empty commit {}; jump rule with nft -f (wall, its cache included) {}",
        moves.summary(),
        resizes.summary(),
        rules.summary(),
        empties.summary(),
        rules_nft.summary()
    );
    Ok(())
}
