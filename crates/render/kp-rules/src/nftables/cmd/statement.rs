//! [`Command`], one `nft -f` statement, and the text it prints.

use std::fmt;
use std::net::IpAddr;

use kp_core::model::IpFamily;

use super::{
    Action, ElementKey, ElementValue, Hook, MapKey, Match, Name, Rule, SetItem, SetKind, TABLE,
};

/// One statement on the family's `kube-proxy` table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// `add table T { comment "..." ; }`.
    AddTable {
        /// The table comment.
        comment: Option<String>,
    },
    /// `delete table T`, with everything in it.
    DeleteTable,
    /// `add chain T NAME [{ type K hook H priority P ; } | { comment "..." ; }]`.
    AddChain {
        /// The chain.
        chain: Name,
        /// For a base chain: its hook.
        hook: Option<Hook>,
        /// The chain comment (regular chains only).
        comment: Option<String>,
    },
    /// `flush chain T NAME`: delete its rules.
    FlushChain(Name),
    /// `delete chain T NAME`.
    DeleteChain(Name),
    /// `add set|map T NAME { type ... ; ... }`.
    AddSet {
        /// The set or map.
        set: Name,
        /// What it holds.
        kind: SetKind,
        /// The comment.
        comment: Option<String>,
    },
    /// `flush set|map T NAME`: delete its elements.
    FlushSet {
        /// The set or map.
        set: Name,
        /// Whether it is a map (only the keyword differs).
        map: bool,
    },
    /// `delete set T NAME`.
    DeleteSet(Name),
    /// `add rule T CHAIN RULE`: append.
    AddRule {
        /// The chain.
        chain: Name,
        /// The rule.
        rule: Rule,
    },
    /// `add element T SET { KEY [comment "..."] [: VERDICT] }`.
    AddElement {
        /// The set or map.
        set: Name,
        /// The key.
        key: ElementKey,
        /// Verdict and comment.
        value: ElementValue,
    },
    /// `delete element T SET { KEY }`.
    DeleteElement {
        /// The set or map.
        set: Name,
        /// The key.
        key: ElementKey,
    },
    /// `add counter T NAME`: a named counter (an existing one keeps its values).
    AddCounter(Name),
    /// `delete counter T NAME`.
    DeleteCounter(Name),
}

/// The `ip` / `ip6` keyword of a family (table family and address matches).
pub fn family_keyword(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "ip",
        IpFamily::V6 => "ip6",
    }
}

/// `commands` as `nft -f` text on `family`'s table, one statement a line.
pub fn script<'a>(family: IpFamily, commands: impl IntoIterator<Item = &'a Command>) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for command in commands {
        let _ = writeln!(out, "{}", command.display(family));
    }
    out
}

impl Command {
    /// The statement as `nft -f` takes it (without the newline), on `family`'s table.
    pub fn display(&self, family: IpFamily) -> Statement<'_> {
        Statement {
            family,
            command: self,
        }
    }
}

/// A [`Command`] with its family, to print.
#[derive(Clone, Copy, Debug)]
pub struct Statement<'a> {
    family: IpFamily,
    command: &'a Command,
}

/// ` comment "TEXT"` when there is one.
struct TrailingComment<'a>(Option<&'a str>);

impl fmt::Display for TrailingComment<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(text) => write!(f, " comment \"{text}\""),
            None => Ok(()),
        }
    }
}

impl fmt::Display for Statement<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ip = family_keyword(self.family);
        let table = format_args!("{ip} {TABLE}");
        match self.command {
            Command::AddTable { comment } => match comment {
                Some(text) => write!(f, "add table {table} {{ comment \"{text}\" ; }}"),
                None => write!(f, "add table {table}"),
            },
            Command::DeleteTable => write!(f, "delete table {table}"),
            Command::AddChain {
                chain,
                hook,
                comment,
            } => {
                write!(f, "add chain {table} {chain}")?;
                if let Some(hook) = hook {
                    write!(
                        f,
                        " {{ type {} hook {} priority {} ; }}",
                        hook.kind, hook.hook, hook.priority
                    )?;
                } else if let Some(text) = comment {
                    write!(f, " {{ comment \"{text}\" ; }}")?;
                }
                Ok(())
            }
            Command::FlushChain(chain) => write!(f, "flush chain {table} {chain}"),
            Command::DeleteChain(chain) => write!(f, "delete chain {table} {chain}"),
            Command::AddSet { set, kind, comment } => {
                let addr = match self.family {
                    IpFamily::V4 => "ipv4_addr",
                    IpFamily::V6 => "ipv6_addr",
                };
                match kind {
                    SetKind::Addresses { .. } => write!(f, "add set {table} {set} {{ type {addr}")?,
                    SetKind::VerdictMap(key) => {
                        write!(f, "add map {table} {set} {{ type ")?;
                        if *key == MapKey::AddrProtoPort {
                            write!(f, "{addr} . ")?;
                        }
                        f.write_str("inet_proto . inet_service : verdict")?;
                    }
                    SetKind::ProtoPorts => {
                        write!(f, "add set {table} {set} {{ type inet_proto . inet_service")?;
                    }
                }
                f.write_str(" ; ")?;
                if let SetKind::Addresses {
                    timeout: Some(seconds),
                } = kind
                {
                    write!(f, "flags dynamic,timeout ; timeout {seconds}s ; ")?;
                }
                if let Some(text) = comment {
                    write!(f, "comment \"{text}\" ; ")?;
                }
                f.write_str("}")
            }
            Command::FlushSet { set, map } => {
                let object = if *map { "map" } else { "set" };
                write!(f, "flush {object} {table} {set}")
            }
            Command::DeleteSet(set) => write!(f, "delete set {table} {set}"),
            Command::AddRule { chain, rule } => {
                write!(f, "add rule {table} {chain} ")?;
                write_rule(f, ip, rule)
            }
            Command::AddElement { set, key, value } => {
                write!(
                    f,
                    "add element {table} {set} {{ {key}{}",
                    TrailingComment(value.comment.as_deref())
                )?;
                if let Some(verdict) = &value.verdict {
                    write!(f, " : {verdict}")?;
                }
                f.write_str(" }")
            }
            Command::DeleteElement { set, key } => {
                write!(f, "delete element {table} {set} {{ {key} }}")
            }
            Command::AddCounter(counter) => write!(f, "add counter {table} {counter}"),
            Command::DeleteCounter(counter) => write!(f, "delete counter {table} {counter}"),
        }
    }
}

fn write_rule(f: &mut fmt::Formatter<'_>, ip: &str, rule: &Rule) -> fmt::Result {
    let not = |negate: bool| if negate { "!= " } else { "" };
    for m in &rule.matches {
        match m {
            Match::Addr {
                field,
                negate,
                value,
            } => write!(f, "{ip} {field} {}{value} ", not(*negate))?,
            Match::AddrIn {
                field,
                negate,
                nets,
            } => {
                write!(f, "{ip} {field} {}{{ ", not(*negate))?;
                for (i, net) in nets.iter().enumerate() {
                    let sep = if i == 0 { "" } else { ", " };
                    write!(f, "{sep}{}", SetItem(net))?;
                }
                f.write_str(" } ")?;
            }
            Match::AddrInSet { field, set } => write!(f, "{ip} {field} @{set} ")?,
            Match::Iifname {
                negate,
                name,
                wildcard,
            } => {
                let star = if *wildcard { "*" } else { "" };
                write!(f, "iifname {}\"{name}{star}\" ", not(*negate))?;
            }
            Match::FibLocal(field) => write!(f, "fib {field} type local ")?,
            Match::CtStateNew => f.write_str("ct state new ")?,
            Match::MarkAnd { mask, value } => write!(f, "mark and {mask:#x} == {value} ")?,
            Match::L4Proto(proto) => write!(f, "meta l4proto {} ", proto.as_str())?,
            Match::ProtoPortInSet(set) => write!(f, "meta l4proto . th dport @{set} ")?,
            Match::Numgen { modulus, value } => {
                write!(f, "numgen random mod {modulus} {value} ")?;
            }
        }
    }
    match &rule.action {
        Action::Verdict(verdict) => write!(f, "{verdict}")?,
        Action::Vmap { key, map } => {
            if *key == MapKey::AddrProtoPort {
                write!(f, "{ip} daddr . ")?;
            }
            write!(f, "meta l4proto . th dport vmap @{map}")?;
        }
        Action::NumgenVmap(chains) => {
            write!(f, "numgen random mod {} vmap {{ ", chains.len())?;
            for (i, chain) in chains.iter().enumerate() {
                let sep = if i == 0 { "" } else { " , " };
                write!(f, "{sep}{i} : goto {chain}")?;
            }
            f.write_str(" }")?;
        }
        Action::Reject => f.write_str("reject")?,
        Action::CountedReject { counter, tcp_reset } => {
            let with = if *tcp_reset { " with tcp reset" } else { "" };
            write!(f, "counter name {counter} reject{with}")?;
        }
        Action::Masquerade { fully_random } => {
            f.write_str(if *fully_random {
                "masquerade fully-random"
            } else {
                "masquerade"
            })?;
        }
        Action::MarkOr(value) => write!(f, "mark set mark or {value:#x}")?,
        Action::MarkXor(value) => write!(f, "mark set mark xor {value:#x}")?,
        Action::UpdateSourceSet(set) => write!(f, "update @{set} {{ {ip} saddr }}")?,
        Action::Dnat { addr, port } => match addr {
            IpAddr::V4(v4) => write!(f, "dnat to {v4}:{port}")?,
            IpAddr::V6(v6) => write!(f, "dnat to [{v6}]:{port}")?,
        },
    }
    write!(f, "{}", TrailingComment(rule.comment.as_deref()))
}
