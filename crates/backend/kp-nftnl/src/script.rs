//! From nft script text to [`Command`]s.
//!
//! This is not an nft parser: it accepts exactly the statement shapes the nftables renderer
//! (`kp_rules::nftables`) writes, one statement per line, and answers
//! [`ScriptError::Unsupported`] for anything else, so that the caller can apply the whole
//! script with `nft -f -` instead. Names are nft identifiers (`[A-Za-z0-9_./-]`, the
//! renderer guarantees it); quoted strings hold no quote or backslash (comments are
//! percent-encoded by the renderer). Anything else is refused rather than guessed at.

use std::net::IpAddr;
use std::sync::Arc;

use crate::codec::{Family, udata_u32s};
use crate::expr::{
    CmpOp, Expr, META_IIFNAME, META_L4PROTO, META_MARK, PAYLOAD_NETWORK, PAYLOAD_TRANSPORT, REG_1,
    REG_2, REG_VERDICT, Verdict,
};

/// Why a script cannot be translated.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ScriptError {
    /// A statement whose shape this translator does not know; `nft` has to apply the
    /// script.
    #[error("statement not supported over netlink (line {line}): {statement}")]
    Unsupported {
        /// 1-based line number.
        line: usize,
        /// The statement.
        statement: String,
    },
}

/// What a base chain hooks into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseChain {
    /// `filter` or `nat`.
    pub kind: &'static str,
    /// `NF_INET_*` hook number.
    pub hook: u32,
    /// Priority.
    pub priority: i32,
}

/// A set's (or map's) declaration, as the kernel wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetSpec {
    /// `NFT_SET_*` flags.
    pub flags: u32,
    /// nft's data type id of the key (concatenations combine ids).
    pub key_type: u32,
    /// Key length in bytes.
    pub key_len: u32,
    /// Data type and length, for maps.
    pub data: Option<(u32, u32)>,
    /// Default element timeout.
    pub timeout_ms: Option<u64>,
    /// User data nft writes before the comment (byte orders, ...).
    pub udata_prefix: Vec<u8>,
    /// The comment, shown by `nft list`.
    pub comment: Option<String>,
}

/// One operation on a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// `add table`.
    AddTable {
        /// Table comment.
        comment: Option<String>,
    },
    /// `delete table` (with everything in it).
    DeleteTable,
    /// `add chain`.
    AddChain {
        /// Chain name.
        chain: String,
        /// For base chains: the hook.
        base: Option<BaseChain>,
        /// Chain comment.
        comment: Option<String>,
    },
    /// `flush chain`.
    FlushChain {
        /// Chain name.
        chain: String,
    },
    /// `delete chain`.
    DeleteChain {
        /// Chain name.
        chain: String,
    },
    /// `add set` / `add map`.
    AddSet {
        /// Set name.
        set: String,
        /// Declaration.
        spec: SetSpec,
    },
    /// `flush set` / `flush map`.
    FlushSet {
        /// Set name.
        set: String,
    },
    /// `delete set` / `delete map`.
    DeleteSet {
        /// Set name.
        set: String,
    },
    /// `add rule`.
    AddRule {
        /// Chain name.
        chain: String,
        /// The rule's expressions.
        exprs: Vec<Expr>,
        /// Rule comment.
        comment: Option<String>,
        /// The anonymous set or map the rule looks up, created just before it.
        anonymous: Option<AnonymousSet>,
    },
    /// `add element` (one element).
    AddElement {
        /// Set name.
        set: String,
        /// The key, encoded.
        key: Vec<u8>,
        /// The value, for verdict maps.
        verdict: Option<Verdict>,
        /// Element comment.
        comment: Option<String>,
    },
    /// `delete element` (one element).
    DeleteElement {
        /// Set name.
        set: String,
        /// The key, encoded.
        key: Vec<u8>,
    },
}

/// An anonymous (constant) set or map, as nft creates one for `{ ... }` in a rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AnonymousSet {
    /// Address prefixes: an interval set, with the elements nft sends for it (see
    /// [`IntervalMark`]).
    Prefixes {
        /// The table's family (the key type).
        family: Family,
        /// Whether the rule matches the source (else destination) address.
        source: bool,
        /// Keys in ascending order.
        elements: Vec<(Vec<u8>, IntervalMark)>,
    },
    /// `numgen ... vmap { i : verdict, ... }`: integer keys (host order).
    NumgenMap {
        /// Key `i` maps to `verdicts[i]`.
        verdicts: Vec<Verdict>,
    },
}

/// One statement, translated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    /// The table's family.
    pub family: Family,
    /// The table (shared by the commands of one script).
    pub table: Arc<str>,
    /// What to do.
    pub op: Op,
    /// 1-based line number in the script, for error messages.
    pub line: usize,
}

/// Translate every statement of `script` (blank lines are skipped).
pub fn parse_script(script: &str) -> Result<Vec<Command>, ScriptError> {
    let mut out = Vec::new();
    for_each_command(script, |command| out.push(command))?;
    Ok(out)
}

/// Translate `script` one statement at a time, handing each command to `each` (which may
/// encode it at once, so a large script never exists as commands all at the same time).
/// Stops at the first statement that cannot be translated.
pub fn for_each_command(script: &str, mut each: impl FnMut(Command)) -> Result<(), ScriptError> {
    // Every statement names the table; share one allocation per table.
    let mut table: Option<Arc<str>> = None;
    let mut tokens = Vec::new();
    for (index, text) in script.lines().enumerate() {
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let unsupported = || ScriptError::Unsupported {
            line: index + 1,
            statement: text.to_owned(),
        };
        tokenize(text, &mut tokens).ok_or_else(unsupported)?;
        let command = parse_statement(&tokens, index + 1, &mut table).ok_or_else(unsupported)?;
        each(command);
    }
    Ok(())
}

/// Split on spaces and tabs (what nft's scanner skips); a `"..."` string (no quote or
/// backslash inside) is one token, kept with its quotes. `None` for a quote or backslash
/// anywhere else. Works on bytes: every split point is an ASCII byte, so a char boundary.
fn tokenize<'a>(text: &'a str, tokens: &mut Vec<&'a str>) -> Option<()> {
    tokens.clear();
    let bytes = text.as_bytes();
    let blank = |b: u8| b == b' ' || b == b'\t';
    let mut i = 0;
    while i < bytes.len() {
        if blank(bytes[i]) {
            i += 1;
        } else if bytes[i] == b'"' {
            let end = i + 1 + bytes[i + 1..].iter().position(|b| *b == b'"')?;
            // A string holds no backslash and must end its token.
            if bytes[i + 1..end].contains(&b'\\') || bytes.get(end + 1).is_some_and(|b| !blank(*b))
            {
                return None;
            }
            tokens.push(&text[i..=end]);
            i = end + 1;
        } else {
            let start = i;
            while i < bytes.len() && !blank(bytes[i]) {
                if bytes[i] == b'"' || bytes[i] == b'\\' {
                    return None;
                }
                i += 1;
            }
            tokens.push(&text[start..i]);
        }
    }
    Some(())
}

/// Whether `name` is a plain nft identifier (what the renderer writes).
fn identifier(name: &str) -> Option<String> {
    let mut chars = name.chars();
    let first = chars.next()?;
    let ok = first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-'))
        && name.len() < 256;
    ok.then(|| name.to_owned())
}

/// The text of a quoted string token (nft's limit for comments is 128 bytes).
fn quoted(token: &str) -> Option<String> {
    let inner = token.strip_prefix('"')?.strip_suffix('"')?;
    (inner.len() <= 128).then(|| inner.to_owned())
}

fn parse_statement(
    tokens: &[&str],
    line: usize,
    last_table: &mut Option<Arc<str>>,
) -> Option<Command> {
    let [verb, object, family, table, rest @ ..] = tokens else {
        return None;
    };
    let family = match *family {
        "ip" => Family::Ipv4,
        "ip6" => Family::Ipv6,
        _ => return None,
    };
    let table = match last_table {
        Some(last) if **last == **table => Arc::clone(last),
        _ => {
            let name: Arc<str> = identifier(table)?.into();
            *last_table = Some(Arc::clone(&name));
            name
        }
    };
    let op = match (*verb, *object) {
        ("add", "table") => parse_add_table(rest)?,
        ("delete", "table") if rest.is_empty() => Op::DeleteTable,
        ("add", "chain") => parse_add_chain(rest)?,
        ("flush", "chain") => Op::FlushChain {
            chain: single_name(rest)?,
        },
        ("delete", "chain") => Op::DeleteChain {
            chain: single_name(rest)?,
        },
        ("add", "set") => parse_add_set(family, rest)?,
        ("add", "map") => parse_add_map(family, rest)?,
        ("flush", "set" | "map") => Op::FlushSet {
            set: single_name(rest)?,
        },
        ("delete", "set" | "map") => Op::DeleteSet {
            set: single_name(rest)?,
        },
        ("add", "rule") => {
            let [chain, rule @ ..] = rest else {
                return None;
            };
            let (exprs, comment, anonymous) = parse_rule(family, rule)?;
            Op::AddRule {
                chain: identifier(chain)?,
                exprs,
                comment,
                anonymous,
            }
        }
        ("add", "element") => parse_element(rest, true)?,
        ("delete", "element") => parse_element(rest, false)?,
        _ => return None,
    };
    Some(Command {
        family,
        table,
        op,
        line,
    })
}

fn single_name(rest: &[&str]) -> Option<String> {
    match rest {
        [name] => identifier(name),
        _ => None,
    }
}

/// `{ comment "..." ; }` or nothing.
fn parse_comment_block(rest: &[&str]) -> Option<Option<String>> {
    match rest {
        [] => Some(None),
        ["{", "comment", text, ";", "}"] => Some(Some(quoted(text)?)),
        _ => None,
    }
}

fn parse_add_table(rest: &[&str]) -> Option<Op> {
    Some(Op::AddTable {
        comment: parse_comment_block(rest)?,
    })
}

fn parse_add_chain(rest: &[&str]) -> Option<Op> {
    let [name, block @ ..] = rest else {
        return None;
    };
    let chain = identifier(name)?;
    if let [
        "{",
        "type",
        kind,
        "hook",
        hook,
        "priority",
        priority,
        ";",
        "}",
    ] = block
    {
        let kind = match *kind {
            "filter" => "filter",
            "nat" => "nat",
            _ => return None,
        };
        let hook = match *hook {
            "prerouting" => 0,
            "input" => 1,
            "forward" => 2,
            "output" => 3,
            "postrouting" => 4,
            _ => return None,
        };
        let priority: i32 = priority.parse().ok()?;
        return Some(Op::AddChain {
            chain,
            base: Some(BaseChain {
                kind,
                hook,
                priority,
            }),
            comment: None,
        });
    }
    Some(Op::AddChain {
        chain,
        base: None,
        comment: parse_comment_block(block)?,
    })
}

/// nft's data type ids.
const TYPE_IPV4_ADDR: u32 = 7;
const TYPE_IPV6_ADDR: u32 = 8;
/// `NFT_SET_TIMEOUT`.
const SET_TIMEOUT: u32 = 0x10;
/// `NFT_SET_EVAL`: the set is updated from the packet path (`dynamic`).
const SET_EVAL: u32 = 0x20;
/// libnftnl user data: the key's byte order is big endian (`NFTNL_UDATA_SET_KEYBYTEORDER`,
/// `BYTEORDER_BIG_ENDIAN`, as a host-order `u32`).
fn key_byteorder_big_endian() -> Vec<u8> {
    let mut out = vec![0u8, 4];
    out.extend_from_slice(&2u32.to_ne_bytes());
    out
}

/// `add set NAME { type ipv4_addr|ipv6_addr ; [flags dynamic,timeout ; timeout Ns ;]
/// [comment "..." ;] }`.
fn parse_add_set(family: Family, rest: &[&str]) -> Option<Op> {
    let [name, "{", "type", ty, ";", tail @ ..] = rest else {
        return None;
    };
    let (key_type, key_len) = match (family, *ty) {
        (Family::Ipv4, "ipv4_addr") => (TYPE_IPV4_ADDR, 4),
        (Family::Ipv6, "ipv6_addr") => (TYPE_IPV6_ADDR, 16),
        _ => return None,
    };
    let (flags, timeout_ms, comment) = match tail {
        [
            "flags",
            "dynamic,timeout",
            ";",
            "timeout",
            timeout,
            ";",
            "}",
        ] => {
            let seconds: u64 = timeout.strip_suffix('s')?.parse().ok()?;
            (
                SET_TIMEOUT | SET_EVAL,
                Some(seconds.checked_mul(1000)?),
                None,
            )
        }
        ["comment", text, ";", "}"] => (0, None, Some(quoted(text)?)),
        ["}"] => (0, None, None),
        _ => return None,
    };
    Some(Op::AddSet {
        set: identifier(name)?,
        spec: SetSpec {
            flags,
            key_type,
            key_len,
            data: None,
            timeout_ms,
            udata_prefix: key_byteorder_big_endian(),
            comment,
        },
    })
}

fn parse_verdict(tokens: &[&str]) -> Option<Verdict> {
    match tokens {
        ["drop"] => Some(Verdict::Drop),
        ["accept"] => Some(Verdict::Accept),
        ["return"] => Some(Verdict::Return),
        ["jump", chain] => Some(Verdict::Jump(identifier(chain)?)),
        ["goto", chain] => Some(Verdict::Goto(identifier(chain)?)),
        _ => None,
    }
}

/// `NAME { KEY [comment "..."] [: VERDICT] }`.
fn parse_element(rest: &[&str], add: bool) -> Option<Op> {
    let [name, "{", inner @ .., "}"] = rest else {
        return None;
    };
    let set = identifier(name)?;
    let colon = inner.iter().position(|t| *t == ":");
    let (before, verdict) = match colon {
        Some(i) => (&inner[..i], Some(parse_verdict(&inner[i + 1..])?)),
        None => (inner, None),
    };
    let (key_tokens, comment) = match before {
        [key @ .., "comment", text] => (key, Some(quoted(text)?)),
        key => (key, None),
    };
    let key = parse_key(key_tokens)?;
    if add {
        Some(Op::AddElement {
            set,
            key,
            verdict,
            comment,
        })
    } else if verdict.is_none() && comment.is_none() {
        Some(Op::DeleteElement { set, key })
    } else {
        None
    }
}

/// An element key: `ADDR`, `ADDR . PROTO . PORT` or `PROTO . PORT`; each part of a
/// concatenation takes a multiple of 4 bytes, as the kernel lays registers out.
fn parse_key(tokens: &[&str]) -> Option<Vec<u8>> {
    let parts: Vec<&str> = tokens
        .split(|t| *t == ".")
        .map(|p| match p {
            [one] => Some(*one),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let mut key = Vec::new();
    match parts.as_slice() {
        [addr] => key.extend(addr_bytes(addr.parse().ok()?)),
        [addr, proto, port] => {
            key.extend(addr_bytes(addr.parse().ok()?));
            push_proto_port(&mut key, proto, port)?;
        }
        [proto, port] => push_proto_port(&mut key, proto, port)?,
        _ => return None,
    }
    Some(key)
}

fn push_proto_port(key: &mut Vec<u8>, proto: &str, port: &str) -> Option<()> {
    key.extend_from_slice(&[protocol_number(proto)?, 0, 0, 0]);
    let port: u16 = port.parse().ok()?;
    key.extend_from_slice(&port.to_be_bytes());
    key.extend_from_slice(&[0, 0]);
    Some(())
}

fn protocol_number(name: &str) -> Option<u8> {
    match name {
        "tcp" => Some(6),
        "udp" => Some(17),
        "sctp" => Some(132),
        _ => None,
    }
}

fn addr_bytes(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// Header offsets of the source and destination addresses.
fn addr_offset(family: Family, which: &str) -> Option<(u32, u32)> {
    match (family, which) {
        (Family::Ipv4, "saddr") => Some((12, 4)),
        (Family::Ipv4, "daddr") => Some((16, 4)),
        (Family::Ipv6, "saddr") => Some((8, 16)),
        (Family::Ipv6, "daddr") => Some((24, 16)),
        _ => None,
    }
}

/// Load the whole source or destination address into the first register.
fn load_addr(exprs: &mut Vec<Expr>, family: Family, which: &str) -> Option<()> {
    let (offset, len) = addr_offset(family, which)?;
    exprs.push(Expr::Payload {
        base: PAYLOAD_NETWORK,
        offset,
        len,
        dreg: REG_1,
    });
    Some(())
}

/// Match an address against a host or prefix, as nft compiles it: a whole-byte prefix
/// loads only its bytes; any other prefix loads the address and masks it.
fn match_prefix(
    exprs: &mut Vec<Expr>,
    family: Family,
    which: &str,
    op: CmpOp,
    value: &str,
) -> Option<()> {
    let (offset, len) = addr_offset(family, which)?;
    let (addr, prefix) = match value.split_once('/') {
        Some((addr, prefix)) => (addr.parse::<IpAddr>().ok()?, prefix.parse::<u32>().ok()?),
        None => (value.parse::<IpAddr>().ok()?, len * 8),
    };
    let bytes = addr_bytes(addr);
    if bytes.len() as u32 != len || prefix > len * 8 {
        return None;
    }
    let mask: Vec<u8> = (0..len)
        .map(|i| {
            let bits = prefix.saturating_sub(i * 8).min(8);
            (0xffu16 << (8 - bits)) as u8
        })
        .collect();
    // The renderer writes canonical (truncated) prefixes; anything else is not ours.
    if bytes.iter().zip(&mask).any(|(b, m)| b & !m != 0) {
        return None;
    }
    // A /0 is masked too (nft does not load zero bytes).
    if prefix % 8 == 0 && prefix > 0 {
        let n = prefix / 8;
        exprs.push(Expr::Payload {
            base: PAYLOAD_NETWORK,
            offset,
            len: n,
            dreg: REG_1,
        });
        exprs.push(Expr::Cmp {
            sreg: REG_1,
            op,
            data: bytes[..n as usize].to_vec(),
        });
    } else {
        exprs.push(Expr::Payload {
            base: PAYLOAD_NETWORK,
            offset,
            len,
            dreg: REG_1,
        });
        exprs.push(Expr::Bitwise {
            sreg: REG_1,
            dreg: REG_1,
            xor: vec![0; mask.len()],
            mask,
        });
        exprs.push(Expr::Cmp {
            sreg: REG_1,
            op,
            data: bytes,
        });
    }
    Some(())
}

/// `iifname [!=] "name"` or `"prefix*"`.
fn match_iifname(exprs: &mut Vec<Expr>, op: CmpOp, value: &str) -> Option<()> {
    let name = quoted(value)?;
    let data = match name.strip_suffix('*') {
        Some(prefix) if !prefix.is_empty() && !prefix.contains('*') => prefix.as_bytes().to_vec(),
        Some(_) => return None,
        None => {
            // IFNAMSIZ, NUL-padded.
            if name.is_empty() || name.len() >= 16 || name.contains('*') {
                return None;
            }
            let mut data = name.into_bytes();
            data.resize(16, 0);
            data
        }
    };
    exprs.push(Expr::Meta {
        key: META_IIFNAME,
        dreg: REG_1,
    });
    exprs.push(Expr::Cmp {
        sreg: REG_1,
        op,
        data,
    });
    Some(())
}

/// The rule part of `add rule T CHAIN <rule>`: matches, then one final statement, then an
/// optional comment.
fn parse_rule(
    family: Family,
    tokens: &[&str],
) -> Option<(Vec<Expr>, Option<String>, Option<AnonymousSet>)> {
    let (tokens, comment) = match tokens {
        [rule @ .., "comment", text] => (rule, Some(quoted(text)?)),
        rule => (rule, None),
    };
    let ip = family.keyword();
    let mut exprs = Vec::new();
    let mut anonymous = None;
    let mut rest = tokens;
    loop {
        match rest {
            // `ip saddr [!=] { PREFIX, ... }`: an anonymous interval set.
            [kw, which @ ("saddr" | "daddr"), tail @ ..]
                if *kw == ip
                    && anonymous.is_none()
                    && matches!(tail, ["{", ..] | ["!=", "{", ..]) =>
            {
                let (invert, tail) = match tail {
                    ["!=", tail @ ..] => (true, tail),
                    tail => (false, tail),
                };
                let close = tail.iter().position(|t| *t == "}")?;
                let items = prefix_items(family, &tail[1..close])?;
                rest = &tail[close + 1..];
                let op = if invert { CmpOp::Neq } else { CmpOp::Eq };
                if let [(value, prefix)] = items.as_slice() {
                    // nft compiles a one-element set as a plain match.
                    let bits = family_bits(family);
                    let addr = match family {
                        Family::Ipv4 => IpAddr::from(std::net::Ipv4Addr::from(*value as u32)),
                        Family::Ipv6 => IpAddr::from(std::net::Ipv6Addr::from(*value)),
                    };
                    let text = if *prefix == bits {
                        addr.to_string()
                    } else {
                        format!("{addr}/{prefix}")
                    };
                    match_prefix(&mut exprs, family, which, op, &text)?;
                    continue;
                }
                let elements = prefix_intervals(family, &items);
                load_addr(&mut exprs, family, which)?;
                exprs.push(Expr::LookupAnonymous {
                    sreg: REG_1,
                    dreg: None,
                    invert,
                });
                anonymous = Some(AnonymousSet::Prefixes {
                    family,
                    source: *which == "saddr",
                    elements,
                });
            }
            // Address matches.
            [kw, which @ ("saddr" | "daddr"), value, tail @ ..] if *kw == ip && *value != "." => {
                if let Some(set) = value.strip_prefix('@') {
                    load_addr(&mut exprs, family, which)?;
                    exprs.push(Expr::Lookup {
                        set: identifier(set)?,
                        sreg: REG_1,
                        dreg: None,
                    });
                } else if *value == "!=" {
                    let [value, tail2 @ ..] = tail else {
                        return None;
                    };
                    match_prefix(&mut exprs, family, which, CmpOp::Neq, value)?;
                    rest = tail2;
                    continue;
                } else {
                    match_prefix(&mut exprs, family, which, CmpOp::Eq, value)?;
                }
                rest = tail;
            }
            ["iifname", "!=", value, tail @ ..] => {
                match_iifname(&mut exprs, CmpOp::Neq, value)?;
                rest = tail;
            }
            ["iifname", value, tail @ ..] => {
                match_iifname(&mut exprs, CmpOp::Eq, value)?;
                rest = tail;
            }
            [
                "fib",
                which @ ("saddr" | "daddr"),
                "type",
                "local",
                tail @ ..,
            ] => {
                exprs.push(Expr::FibAddrType {
                    flags: if *which == "saddr" { 1 } else { 2 },
                    dreg: REG_1,
                });
                // RTN_LOCAL, host order.
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: 2u32.to_ne_bytes().to_vec(),
                });
                rest = tail;
            }
            ["numgen", "random", "mod", modulus, value, tail @ ..]
                if value.chars().all(|c| c.is_ascii_digit()) =>
            {
                let modulus: u32 = modulus.parse().ok()?;
                let value: u32 = value.parse().ok()?;
                if modulus == 0 || value >= modulus {
                    return None;
                }
                exprs.push(Expr::NumgenRandom {
                    dreg: REG_1,
                    modulus,
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: value.to_ne_bytes().to_vec(),
                });
                rest = tail;
            }
            ["meta", "l4proto", proto, tail @ ..] if protocol_number(proto).is_some() => {
                exprs.push(Expr::Meta {
                    key: META_L4PROTO,
                    dreg: REG_1,
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: vec![protocol_number(proto)?],
                });
                rest = tail;
            }
            ["ct", "state", "new", tail @ ..] => {
                exprs.push(Expr::CtState { dreg: REG_1 });
                exprs.push(Expr::Bitwise {
                    sreg: REG_1,
                    dreg: REG_1,
                    mask: CT_STATE_NEW.to_ne_bytes().to_vec(),
                    xor: vec![0; 4],
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Neq,
                    data: vec![0; 4],
                });
                rest = tail;
            }
            ["mark", "and", mask, "==", value, tail @ ..] => {
                exprs.push(Expr::Meta {
                    key: META_MARK,
                    dreg: REG_1,
                });
                exprs.push(Expr::Bitwise {
                    sreg: REG_1,
                    dreg: REG_1,
                    mask: parse_u32(mask)?.to_ne_bytes().to_vec(),
                    xor: vec![0; 4],
                });
                exprs.push(Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: parse_u32(value)?.to_ne_bytes().to_vec(),
                });
                rest = tail;
            }
            _ => break,
        }
    }
    // The final statement.
    match rest {
        [
            "numgen",
            "random",
            "mod",
            modulus,
            "vmap",
            "{",
            arms @ ..,
            "}",
        ] if anonymous.is_none() => {
            let modulus: u32 = modulus.parse().ok()?;
            let mut verdicts = Vec::new();
            for (index, arm) in arms.split(|t| *t == ",").enumerate() {
                let [key, ":", verdict @ ..] = arm else {
                    return None;
                };
                if key.parse::<usize>().ok()? != index {
                    return None;
                }
                verdicts.push(parse_verdict(verdict)?);
            }
            if verdicts.len() != modulus as usize || modulus == 0 {
                return None;
            }
            exprs.push(Expr::NumgenRandom {
                dreg: REG_1,
                modulus,
            });
            exprs.push(Expr::LookupAnonymous {
                sreg: REG_1,
                dreg: Some(REG_VERDICT),
                invert: false,
            });
            anonymous = Some(AnonymousSet::NumgenMap { verdicts });
        }
        [
            kw,
            "daddr",
            ".",
            "meta",
            "l4proto",
            ".",
            "th",
            "dport",
            "vmap",
            map,
        ] if *kw == ip => {
            let (offset, len) = addr_offset(family, "daddr")?;
            exprs.push(Expr::Payload {
                base: PAYLOAD_NETWORK,
                offset,
                len,
                dreg: REG_1,
            });
            push_proto_port_load(&mut exprs, len);
            push_vmap(&mut exprs, map)?;
        }
        ["meta", "l4proto", ".", "th", "dport", "vmap", map] => {
            push_proto_port_load(&mut exprs, 0);
            push_vmap(&mut exprs, map)?;
        }
        ["reject"] => exprs.push(Expr::Reject {
            icmp_code: match family {
                // ICMP_PORT_UNREACH, ICMPV6_PORT_UNREACH.
                Family::Ipv4 => 3,
                Family::Ipv6 => 4,
            },
        }),
        ["masquerade"] => exprs.push(Expr::Masquerade { flags: None }),
        ["masquerade", "fully-random"] => exprs.push(Expr::Masquerade {
            flags: Some(NAT_RANGE_PROTO_RANDOM_FULLY),
        }),
        ["mark", "set", "mark", op @ ("or" | "xor"), value] => {
            let value = parse_u32(value)?;
            // nft computes `mark | v` as `(mark & !v) ^ v` and `mark ^ v` as
            // `(mark & all) ^ v`.
            let mask = if *op == "or" { !value } else { u32::MAX };
            exprs.push(Expr::Meta {
                key: META_MARK,
                dreg: REG_1,
            });
            exprs.push(Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: mask.to_ne_bytes().to_vec(),
                xor: value.to_ne_bytes().to_vec(),
            });
            exprs.push(Expr::MetaSet {
                key: META_MARK,
                sreg: REG_1,
            });
        }
        ["update", set, "{", kw, "saddr", "}"] if *kw == ip => {
            let set = identifier(set.strip_prefix('@')?)?;
            load_addr(&mut exprs, family, "saddr")?;
            exprs.push(Expr::DynsetUpdate {
                set,
                sreg_key: REG_1,
            });
        }
        ["dnat", "to", target] => {
            let (addr, port) = parse_socket(family, target)?;
            exprs.push(Expr::ImmediateData {
                dreg: REG_1,
                data: addr,
            });
            exprs.push(Expr::ImmediateData {
                dreg: REG_2,
                data: port.to_be_bytes().to_vec(),
            });
            exprs.push(Expr::Dnat {
                family: u32::from(family.nfproto()),
                reg_addr: REG_1,
                reg_proto: REG_2,
            });
        }
        verdict => exprs.push(Expr::Immediate(parse_verdict(verdict)?)),
    }
    Some((exprs, comment, anonymous))
}

/// One element nft sends for an interval set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntervalMark {
    /// The first key of an interval.
    Start,
    /// The first key of an interval that runs to the top of the address space (it has no
    /// end element; nft flags it in the element's user data).
    StartOpen,
    /// The first key after an interval.
    End,
}

/// The items of `{ PREFIX, PREFIX, ... }` (commas may end a token): `(address, prefix
/// length)`, canonical prefixes only.
fn prefix_items(family: Family, tokens: &[&str]) -> Option<Vec<(u128, u32)>> {
    let text = tokens.join(" ");
    let bits = family_bits(family);
    text.split(',')
        .map(|item| {
            let item = item.trim();
            let (addr, prefix) = match item.split_once('/') {
                Some((addr, prefix)) => (addr.parse::<IpAddr>().ok()?, prefix.parse::<u32>().ok()?),
                None => (item.parse::<IpAddr>().ok()?, bits),
            };
            let value = match (family, addr) {
                (Family::Ipv4, IpAddr::V4(v4)) => u128::from(u32::from(v4)),
                (Family::Ipv6, IpAddr::V6(v6)) => u128::from(v6),
                _ => return None,
            };
            let host_bits = bits.checked_sub(prefix)?;
            let size = 1u128.checked_shl(host_bits).unwrap_or(0);
            // A /0 (size wraps to 0) must be all zeros; others must have no host bits.
            let canonical = if size == 0 {
                value == 0
            } else {
                value % size == 0
            };
            canonical.then_some((value, prefix))
        })
        .collect()
}

fn family_bits(family: Family) -> u32 {
    match family {
        Family::Ipv4 => 32,
        Family::Ipv6 => 128,
    }
}

/// The elements nft sends for an interval set of `items`: overlapping and adjacent
/// intervals merged; a leading end at zero unless the first interval starts there; no end
/// after an interval that reaches the top.
fn prefix_intervals(family: Family, items: &[(u128, u32)]) -> Vec<(Vec<u8>, IntervalMark)> {
    let bits = family_bits(family);
    let max = if bits == 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    let mut ranges: Vec<(u128, u128)> = items
        .iter()
        .map(|(value, prefix)| {
            let span = if *prefix == 0 {
                max
            } else {
                (1u128 << (bits - prefix)) - 1
            };
            (*value, value + span)
        })
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (start, end) in ranges {
        match merged.last_mut() {
            Some(last) if start <= last.1.saturating_add(1) => last.1 = last.1.max(end),
            _ => merged.push((start, end)),
        }
    }
    let key = |value: u128| -> Vec<u8> { value.to_be_bytes()[16 - (bits as usize / 8)..].to_vec() };
    let mut elements = Vec::new();
    if merged.first().is_some_and(|first| first.0 != 0) {
        elements.push((key(0), IntervalMark::End));
    }
    for (start, end) in merged {
        if end == max {
            elements.push((key(start), IntervalMark::StartOpen));
        } else {
            elements.push((key(start), IntervalMark::Start));
            elements.push((key(end + 1), IntervalMark::End));
        }
    }
    elements
}

/// `ct state new`: the `NF_CT_STATE_BIT(IP_CT_NEW)` bit.
const CT_STATE_NEW: u32 = 8;
/// `NF_NAT_RANGE_PROTO_RANDOM_FULLY`.
const NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;

/// A number as the renderer writes marks: `0x4000` or decimal.
fn parse_u32(text: &str) -> Option<u32> {
    match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// The register holding byte `offset` of a concatenation: a 16-byte register when the
/// offset is aligned to one (as nft picks), else a 4-byte one (`NFT_REG32_00` is 8).
fn concat_register(offset: u32) -> u32 {
    if offset.is_multiple_of(16) {
        offset / 16 + 1
    } else {
        8 + offset / 4
    }
}

/// `meta l4proto . th dport`, loaded after `offset` bytes of a concatenation.
fn push_proto_port_load(exprs: &mut Vec<Expr>, offset: u32) {
    exprs.push(Expr::Meta {
        key: META_L4PROTO,
        dreg: concat_register(offset),
    });
    exprs.push(Expr::Payload {
        base: PAYLOAD_TRANSPORT,
        offset: 2,
        len: 2,
        dreg: concat_register(offset + 4),
    });
}

/// `vmap @map` over the concatenation loaded from the first register.
fn push_vmap(exprs: &mut Vec<Expr>, map: &str) -> Option<()> {
    exprs.push(Expr::Lookup {
        set: identifier(map.strip_prefix('@')?)?,
        sreg: REG_1,
        dreg: Some(REG_VERDICT),
    });
    Some(())
}

/// nft's id of a concatenated type: each part's id shifted in 6 bits at a time.
fn concat_type(parts: &[u32]) -> u32 {
    parts.iter().fold(0, |acc, part| (acc << 6) | part)
}

const TYPE_INET_PROTO: u32 = 12;
const TYPE_INET_SERVICE: u32 = 13;
/// nft's id of the verdict type.
const TYPE_VERDICT: u32 = 0xffff_ff00;
/// `NFT_SET_MAP`.
const SET_MAP: u32 = 0x8;

/// The user data nft 1.0.6 writes for our verdict maps before their comment: key and data
/// byte order unset, the concatenation's typeof record, no data interval.
fn map_udata_prefix() -> Vec<u8> {
    udata_u32s(&[
        (&[0, 4], 0, &[]),
        (&[1, 4], 0, &[]),
        (&[3, 8, 0, 4], TYPE_INET_SERVICE, &[1, 0]),
        (&[6, 4], 0, &[]),
    ])
}

/// `add map NAME { type [ADDR .] inet_proto . inet_service : verdict ; comment "..." ; }`.
fn parse_add_map(family: Family, rest: &[&str]) -> Option<Op> {
    let [
        name,
        "{",
        "type",
        spec @ ..,
        ":",
        "verdict",
        ";",
        "comment",
        text,
        ";",
        "}",
    ] = rest
    else {
        return None;
    };
    let (key_type, key_len) = match (family, spec) {
        (Family::Ipv4, ["ipv4_addr", ".", "inet_proto", ".", "inet_service"]) => (
            concat_type(&[TYPE_IPV4_ADDR, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            12,
        ),
        (Family::Ipv6, ["ipv6_addr", ".", "inet_proto", ".", "inet_service"]) => (
            concat_type(&[TYPE_IPV6_ADDR, TYPE_INET_PROTO, TYPE_INET_SERVICE]),
            24,
        ),
        (_, ["inet_proto", ".", "inet_service"]) => {
            (concat_type(&[TYPE_INET_PROTO, TYPE_INET_SERVICE]), 8)
        }
        _ => return None,
    };
    Some(Op::AddSet {
        set: identifier(name)?,
        spec: SetSpec {
            flags: SET_MAP,
            key_type,
            key_len,
            data: Some((TYPE_VERDICT, 0)),
            timeout_ms: None,
            udata_prefix: map_udata_prefix(),
            comment: Some(quoted(text)?),
        },
    })
}

/// `A.B.C.D:port` or `[v6]:port`, in the table's family.
fn parse_socket(family: Family, text: &str) -> Option<(Vec<u8>, u16)> {
    let (addr, port) = match family {
        Family::Ipv4 => text.rsplit_once(':')?,
        Family::Ipv6 => {
            let inner = text.strip_prefix('[')?;
            inner.split_once("]:")?
        }
    };
    let addr: IpAddr = addr.parse().ok()?;
    match (family, addr) {
        (Family::Ipv4, IpAddr::V4(_)) | (Family::Ipv6, IpAddr::V6(_)) => {}
        _ => return None,
    }
    Some((addr_bytes(addr), port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unsupported(statement: &str) -> bool {
        matches!(
            parse_script(statement),
            Err(ScriptError::Unsupported { line: 1, .. })
        )
    }

    #[test]
    fn shapes_outside_the_renderer_are_refused() {
        for statement in [
            // Prefixes that are not canonical.
            "add rule ip kube-proxy fw ip saddr != { 10.0.0.1/8, 192.0.2.1 } drop",
            "add rule ip kube-proxy fw ip saddr != { 0.0.0.1/0 } drop",
            "add rule ip kube-proxy s numgen random mod 3 vmap { 0 : goto a , 1 : goto b }",
            "add rule ip kube-proxy s numgen random mod 2 vmap { 1 : goto a , 0 : goto b }",
            // Quotes, escapes and odd names never pass.
            "add rule ip kube-proxy c goto a comment \"x\\\" ; drop\"",
            "add rule ip kube-proxy c\"x goto a",
            "add chain ip kube-proxy 1abc",
            "add chain ip kube-proxy a\u{a0}b",
            "add rule ip kube-proxy c goto a comment \"x\"y",
            "add rule ip kube-proxy c goto a comment \"unterminated",
            "add element ip kube-proxy service-ips { 10.0.0.1 . icmp . 1 : drop }",
            "add rule ip kube-proxy c ip saddr 10.0.0.1/8 goto a",
            "add rule ip kube-proxy c ip6 saddr ::1 goto a",
            "insert rule ip kube-proxy c goto a",
            "add table inet kube-proxy",
        ] {
            assert!(unsupported(statement), "{statement}");
        }
    }

    #[test]
    fn element_keys_are_laid_out_in_registers() {
        let commands = parse_script(
            "add element ip6 kube-proxy service-ips { fd00::1 . sctp . 443 comment \"ns/a:p\" : goto service-X }\n\
             delete element ip kube-proxy service-nodeports { udp . 30053 }\n",
        )
        .expect("supported");
        let Op::AddElement {
            key,
            verdict,
            comment,
            ..
        } = &commands[0].op
        else {
            panic!("{commands:?}");
        };
        let mut expected = vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        expected.extend([132, 0, 0, 0, 0x01, 0xbb, 0, 0]);
        assert_eq!(key, &expected);
        assert_eq!(verdict, &Some(Verdict::Goto("service-X".into())));
        assert_eq!(comment.as_deref(), Some("ns/a:p"));
        assert_eq!(commands[1].line, 2);
        assert_eq!(
            commands[1].op,
            Op::DeleteElement {
                set: "service-nodeports".into(),
                key: vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
            }
        );
    }

    #[test]
    fn anonymous_prefix_sets_are_intervals_merged_as_nft_merges_them() {
        let commands = parse_script(
            "add rule ip kube-proxy fw ip saddr != { 10.0.0.2/31, 10.0.0.1, 192.0.2.0/24 } drop",
        )
        .expect("supported");
        let Op::AddRule {
            anonymous:
                Some(AnonymousSet::Prefixes {
                    elements, source, ..
                }),
            exprs,
            ..
        } = &commands[0].op
        else {
            panic!("{commands:?}");
        };
        assert!(source);
        assert!(matches!(
            exprs[1],
            Expr::LookupAnonymous {
                invert: true,
                dreg: None,
                ..
            }
        ));
        use IntervalMark::*;
        assert_eq!(
            elements,
            &vec![
                (vec![0, 0, 0, 0], End),
                (vec![10, 0, 0, 1], Start),
                (vec![10, 0, 0, 4], End),
                (vec![192, 0, 2, 0], Start),
                (vec![192, 0, 3, 0], End),
            ]
        );
        // From zero, and to the top: no leading end, no final end.
        let commands =
            parse_script("add rule ip kube-proxy fw ip saddr != { 0.0.0.0/2, 192.0.0.0/2 } drop")
                .expect("supported");
        let Op::AddRule {
            anonymous: Some(AnonymousSet::Prefixes { elements, .. }),
            ..
        } = &commands[0].op
        else {
            panic!("{commands:?}");
        };
        assert_eq!(
            elements,
            &vec![
                (vec![0, 0, 0, 0], Start),
                (vec![64, 0, 0, 0], End),
                (vec![192, 0, 0, 0], StartOpen),
            ]
        );
        // One element is a plain match, as nft compiles it.
        let commands = parse_script("add rule ip kube-proxy fw ip saddr != { 0.0.0.0/0 } drop")
            .expect("supported");
        let Op::AddRule {
            anonymous: None,
            exprs,
            ..
        } = &commands[0].op
        else {
            panic!("{commands:?}");
        };
        assert_eq!(
            exprs[1],
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: vec![0; 4],
                xor: vec![0; 4]
            }
        );
    }

    #[test]
    fn prefixes_compile_as_nft_compiles_them() {
        let rule = |text: &str| match parse_script(text).expect("supported").remove(0).op {
            Op::AddRule { exprs, .. } => exprs,
            other => panic!("{other:?}"),
        };
        // A whole-byte prefix loads only its bytes.
        let exprs = rule("add rule ip kube-proxy c ip saddr 10.1.0.0/16 goto a");
        assert_eq!(
            exprs[..2],
            [
                Expr::Payload {
                    base: PAYLOAD_NETWORK,
                    offset: 12,
                    len: 2,
                    dreg: REG_1
                },
                Expr::Cmp {
                    sreg: REG_1,
                    op: CmpOp::Eq,
                    data: vec![10, 1]
                }
            ]
        );
        // Any other prefix is masked.
        let exprs = rule("add rule ip kube-proxy c ip saddr != 10.16.0.0/12 goto a");
        assert_eq!(
            exprs[1],
            Expr::Bitwise {
                sreg: REG_1,
                dreg: REG_1,
                mask: vec![0xff, 0xf0, 0, 0],
                xor: vec![0; 4]
            }
        );
        assert!(matches!(exprs[2], Expr::Cmp { op: CmpOp::Neq, .. }));
    }
}
