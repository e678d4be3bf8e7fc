//! What a network namespace's iptables-nft tables look like, three ways, for comparing the
//! rules `iptables-nft-restore` made in one namespace with those our netlink path made in
//! another: `iptables-nft-save` (what iptables reads back), `nft --debug=netlink list
//! ruleset` (every expression, with rule handles), and the kernel's own netlink dump of
//! every table, chain and rule (`NFT_MSG_GET*`, byte for byte, x_tables info structs
//! included, which the two texts do not show).

#![allow(dead_code)]

use std::process::Command;

use kp_nftnl::NftSocket;
use kp_nftnl::codec::{Family, MsgKind};

/// Runs `program args` (stdin from `input`), panicking with its stderr on failure.
pub fn run(program: &str, args: &[&str], input: Option<&str>) -> String {
    use std::io::Write as _;
    let mut child = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    if let Some(input) = input {
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input.as_bytes())
            .expect("write stdin");
    }
    drop(child.stdin.take());
    let output = child.wait_with_output().expect("wait");
    assert!(
        output.status.success(),
        "`{program} {}` failed: {}\n--- input ---\n{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr),
        input.unwrap_or_default()
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The three views of the namespace's tables.
#[derive(Debug, PartialEq, Eq)]
pub struct Dumps {
    /// `iptables-nft-save` and `ip6tables-nft-save`, without their date comments.
    pub save: String,
    /// `nft --debug=netlink list ruleset`.
    pub nft: String,
    /// The kernel's dump of every table, chain and rule of both families, hex per
    /// message, without the generation number (which counts transactions, not content).
    pub raw: String,
    /// `raw` without the handles of rules and chains, and rule positions.
    pub raw_unhandled: String,
}

impl Dumps {
    /// The views without rule handles (for syncs that edit by handle, where only the
    /// contents and order must agree).
    pub fn without_handles(&self) -> Dumps {
        let nft = self
            .nft
            .lines()
            .map(|line| {
                let tokens: Vec<&str> = line.split(' ').collect();
                let rule_header = (tokens.first() == Some(&"ip") || tokens.first() == Some(&"ip6"))
                    && tokens.len() >= 4
                    && tokens[3..].iter().all(|t| t.parse::<u64>().is_ok());
                if rule_header {
                    tokens[..3].join(" ")
                } else {
                    line.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n");
        Dumps {
            save: self.save.clone(),
            nft,
            raw: self.raw_unhandled.clone(),
            raw_unhandled: self.raw_unhandled.clone(),
        }
    }
}

/// `NFTA_RULE_HANDLE` and `NFTA_RULE_POSITION`.
const RULE_HANDLE: u16 = 3;
const RULE_POSITION: u16 = 6;
/// `NFTA_CHAIN_HANDLE`.
const CHAIN_HANDLE: u16 = 2;

/// The message's top-level attributes, as raw bytes, without those of types `strip`.
fn strip_handles(attrs: &[u8], strip: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= attrs.len() {
        let len = usize::from(u16::from_ne_bytes([attrs[at], attrs[at + 1]]));
        let ty = u16::from_ne_bytes([attrs[at + 2], attrs[at + 3]]) & 0x7fff;
        if len < 4 {
            break;
        }
        let end = (at + len).min(attrs.len());
        if !strip.contains(&ty) {
            out.extend_from_slice(&attrs[at..end]);
        }
        at += len.next_multiple_of(4);
    }
    out
}

/// The three views of this thread's namespace.
pub fn dumps() -> Dumps {
    let mut save = String::new();
    for tool in ["iptables-nft-save", "ip6tables-nft-save"] {
        for line in run(tool, &[], None).lines() {
            if !line.starts_with('#') {
                save.push_str(line);
                save.push('\n');
            }
        }
    }
    let nft = run("nft", &["--debug=netlink", "list", "ruleset"], None);
    let mut raw = String::new();
    let mut raw_unhandled = String::new();
    let mut socket = NftSocket::open().expect("netlink socket");
    for family in [Family::Ipv4, Family::Ipv6] {
        for kind in [MsgKind::GetTable, MsgKind::GetChain, MsgKind::GetRule] {
            for message in socket.dump(kind, family, |_| {}).expect("dump") {
                // struct nfgenmsg: family, version, then the generation (res_id).
                raw.push_str(&format!("{kind:?} {:02x}{:02x} ", message[0], message[1]));
                for byte in &message[4..] {
                    raw.push_str(&format!("{byte:02x}"));
                }
                raw.push('\n');
                raw_unhandled.push_str(&format!("{kind:?} {:02x}{:02x} ", message[0], message[1]));
                let attrs = match kind {
                    MsgKind::GetRule => strip_handles(&message[4..], &[RULE_HANDLE, RULE_POSITION]),
                    MsgKind::GetChain => strip_handles(&message[4..], &[CHAIN_HANDLE]),
                    _ => message[4..].to_vec(),
                };
                for byte in attrs {
                    raw_unhandled.push_str(&format!("{byte:02x}"));
                }
                raw_unhandled.push('\n');
            }
        }
    }
    Dumps {
        save,
        nft,
        raw,
        raw_unhandled,
    }
}

/// Asserts the two namespaces' views are equal, showing the first differing line of each.
pub fn assert_same(what: &str, reference: &Dumps, ours: &Dumps) {
    for (view, a, b) in [
        ("iptables-nft-save", &reference.save, &ours.save),
        ("nft --debug=netlink", &reference.nft, &ours.nft),
        ("netlink dump", &reference.raw, &ours.raw),
    ] {
        if a != b {
            let first = a
                .lines()
                .zip(b.lines())
                .position(|(x, y)| x != y)
                .unwrap_or(a.lines().count().min(b.lines().count()));
            let line = |text: &str| text.lines().nth(first).unwrap_or("<end>").to_owned();
            panic!(
                "{what}: {view} differs at line {}:\n  iptables-nft-restore: {}\n  netlink:              {}\n--- iptables-nft-restore ---\n{a}\n--- netlink ---\n{b}",
                first + 1,
                line(a),
                line(b),
            );
        }
    }
}
