//! Typed nft commands: what [`render`](super::render) produces.
//!
//! Each [`Command`] is one statement of an `nft -f` script on the family's `kube-proxy` table;
//! [`Command::display`] (and [`Transaction`]'s `Display`) give exactly the text `nft -f -`
//! takes, which is what the snapshots, the `nft` fallback and error messages show. Encoders
//! (kp-nftnl) consume the types, so a new statement is one new variant here, its `Display`
//! arm and its encoder arm: the compiler points at every place that needs it.
//!
//! The types carry only what the renderer writes (the table is always [`TABLE`], names are
//! the renderer's identifiers, comments are already percent-encoded and cut to
//! [`MAX_COMMENT_BYTES`](super::MAX_COMMENT_BYTES)); they are not a general nft model.

use std::fmt;
use std::net::IpAddr;
use std::ops::Deref;
use std::sync::Arc;

use ipnet::IpNet;
use kp_core::model::{IpFamily, Protocol};

use super::TABLE;

/// The name of a chain, set or map: a fixed one, or a per-service one shared (a reference
/// count, not a copy) by the command creating the object and the rules referring to it.
#[derive(Clone, Debug)]
pub enum Name {
    /// One of the table's fixed objects.
    Fixed(&'static str),
    /// A per-service object.
    Shared(Arc<str>),
}

impl Name {
    /// The name.
    pub fn as_str(&self) -> &str {
        match self {
            Name::Fixed(name) => name,
            Name::Shared(name) => name,
        }
    }
}

impl Deref for Name {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl PartialEq for Name {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Name {}

impl PartialOrd for Name {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Name {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.as_str().cmp(other.as_str())
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

impl From<&'static str> for Name {
    fn from(name: &'static str) -> Self {
        Name::Fixed(name)
    }
}

impl From<&String> for Name {
    fn from(name: &String) -> Self {
        Name::Shared(Arc::from(name.as_str()))
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A verdict: the end of a rule, or the value of a verdict-map element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `drop`.
    Drop,
    /// `accept`.
    Accept,
    /// `return`.
    Return,
    /// `jump CHAIN`.
    Jump(Name),
    /// `goto CHAIN`.
    Goto(Name),
}

impl Verdict {
    /// The chain a `jump` or `goto` enters.
    pub fn chain(&self) -> Option<&str> {
        match self {
            Verdict::Jump(chain) | Verdict::Goto(chain) => Some(chain),
            _ => None,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Drop => f.write_str("drop"),
            Verdict::Accept => f.write_str("accept"),
            Verdict::Return => f.write_str("return"),
            Verdict::Jump(chain) => write!(f, "jump {chain}"),
            Verdict::Goto(chain) => write!(f, "goto {chain}"),
        }
    }
}

/// Which address of the packet a match looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddrField {
    /// `saddr`.
    Source,
    /// `daddr`.
    Destination,
}

impl fmt::Display for AddrField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AddrField::Source => "saddr",
            AddrField::Destination => "daddr",
        })
    }
}

/// An address a rule compares with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Addr {
    /// One address, written bare.
    Host(IpAddr),
    /// A prefix (canonical: no host bits), written with its length even for a single host.
    Net(IpNet),
}

impl Addr {
    /// The address and prefix length.
    pub fn net(self) -> IpNet {
        match self {
            Addr::Host(ip) => IpNet::from(ip),
            Addr::Net(net) => net,
        }
    }
}

impl fmt::Display for Addr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Addr::Host(ip) => write!(f, "{ip}"),
            Addr::Net(net) => write!(f, "{net}"),
        }
    }
}

/// A prefix as an element of an anonymous set: bare for a single host.
struct SetItem<'a>(&'a IpNet);

impl fmt::Display for SetItem<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.prefix_len() == self.0.max_prefix_len() {
            write!(f, "{}", self.0.addr())
        } else {
            write!(f, "{}", self.0)
        }
    }
}

/// One match of a rule; a rule's matches all have to hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Match {
    /// `ip saddr [!=] ADDR`.
    Addr {
        /// Source or destination.
        field: AddrField,
        /// `!=`.
        negate: bool,
        /// The address or prefix.
        value: Addr,
    },
    /// `ip saddr [!=] { PREFIX, ... }`: an anonymous set of canonical prefixes (at least one).
    AddrIn {
        /// Source or destination.
        field: AddrField,
        /// `!=`.
        negate: bool,
        /// The prefixes, in the order written.
        nets: Vec<IpNet>,
    },
    /// `ip daddr @SET`.
    AddrInSet {
        /// Source or destination.
        field: AddrField,
        /// A named address set.
        set: Name,
    },
    /// `iifname [!=] "NAME"`, or `"PREFIX*"` with `wildcard`.
    Iifname {
        /// `!=`.
        negate: bool,
        /// The interface name or prefix (validated: no quote, backslash or `*`).
        name: String,
        /// Whether `name` is a prefix.
        wildcard: bool,
    },
    /// `fib saddr|daddr type local`.
    FibLocal(AddrField),
    /// `ct state new`.
    CtStateNew,
    /// `mark and MASK == VALUE`.
    MarkAnd {
        /// The mask, written in hex.
        mask: u32,
        /// The value compared with.
        value: u32,
    },
    /// `meta l4proto PROTO`.
    L4Proto(Protocol),
    /// `numgen random mod MODULUS VALUE`.
    Numgen {
        /// The modulus (at least 1).
        modulus: u32,
        /// The value matched (below `modulus`).
        value: u32,
    },
}

/// The key a verdict-map lookup builds from the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapKey {
    /// `ip daddr . meta l4proto . th dport`.
    AddrProtoPort,
    /// `meta l4proto . th dport`.
    ProtoPort,
}

/// What a rule does once its matches hold: its one statement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A verdict.
    Verdict(Verdict),
    /// `KEY vmap @MAP`.
    Vmap {
        /// What the lookup key is made of.
        key: MapKey,
        /// A named verdict map.
        map: Name,
    },
    /// `numgen random mod N vmap { 0 : goto C0 , 1 : goto C1 , ... }` (at least one chain).
    NumgenVmap(Vec<Name>),
    /// `reject` (the family's default: port unreachable).
    Reject,
    /// `masquerade [fully-random]`.
    Masquerade {
        /// `fully-random`.
        fully_random: bool,
    },
    /// `mark set mark or VALUE`.
    MarkOr(u32),
    /// `mark set mark xor VALUE`.
    MarkXor(u32),
    /// `update @SET { ip saddr }`.
    UpdateSourceSet(Name),
    /// `dnat to ADDR:PORT`.
    Dnat {
        /// Of the table's family.
        addr: IpAddr,
        /// The port.
        port: u16,
    },
}

/// One rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The matches, in order.
    pub matches: Vec<Match>,
    /// The statement.
    pub action: Action,
    /// The comment, already encoded.
    pub comment: Option<Box<str>>,
}

impl Rule {
    /// A rule without comment.
    pub fn new(matches: Vec<Match>, action: Action) -> Self {
        Self {
            matches,
            action,
            comment: None,
        }
    }

    /// A rule that only ends in `verdict`.
    pub fn verdict(matches: Vec<Match>, verdict: Verdict) -> Self {
        Self::new(matches, Action::Verdict(verdict))
    }

    /// With the (encoded) comment.
    pub fn with_comment(mut self, comment: String) -> Self {
        self.comment = Some(comment.into_boxed_str());
        self
    }
}

/// A base chain's hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    /// `filter` or `nat`.
    pub kind: &'static str,
    /// `prerouting`, `input`, `forward`, `output` or `postrouting`.
    pub hook: &'static str,
    /// The priority.
    pub priority: i32,
}

/// What a set or map holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetKind {
    /// Addresses of the table's family (`type ipv4_addr`); with a timeout, a set the packet
    /// path updates (`flags dynamic,timeout ; timeout Ns`).
    Addresses {
        /// The default element timeout in seconds.
        timeout: Option<u64>,
    },
    /// A verdict map.
    VerdictMap(MapKey),
}

/// The key of a set or map element.
#[derive(Clone, Debug)]
pub struct ElementKey {
    /// The nft text, which orders keys (as the state and the statements list them).
    text: Box<str>,
    parts: KeyParts,
}

/// The values making up an [`ElementKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyParts {
    /// `ADDR`.
    Addr(IpAddr),
    /// `ADDR . PROTO . PORT`.
    AddrProtoPort(IpAddr, Protocol, u16),
    /// `PROTO . PORT`.
    ProtoPort(Protocol, u16),
}

impl ElementKey {
    /// A key made of `parts`.
    pub fn new(parts: KeyParts) -> Self {
        let text = match parts {
            KeyParts::Addr(addr) => addr.to_string(),
            KeyParts::AddrProtoPort(addr, proto, port) => {
                format!("{addr} . {} . {port}", proto.as_str())
            }
            KeyParts::ProtoPort(proto, port) => format!("{} . {port}", proto.as_str()),
        };
        Self {
            text: text.into_boxed_str(),
            parts,
        }
    }

    /// The values.
    pub fn parts(&self) -> KeyParts {
        self.parts
    }

    /// The nft text.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl PartialEq for ElementKey {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for ElementKey {}

impl PartialOrd for ElementKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ElementKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.text.cmp(&other.text)
    }
}

impl std::borrow::Borrow<str> for ElementKey {
    fn borrow(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for ElementKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The data of one set or map element: what a diff compares.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElementValue {
    /// The verdict of a map element; `None` for a plain set element.
    pub verdict: Option<Verdict>,
    /// The element comment, already encoded.
    pub comment: Option<String>,
}

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

/// The commands one service port writes: its chains (created, and emptied when they may hold
/// rules), then its affinity sets and rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServiceCommands {
    /// `add chain` (and `flush chain`) of each chain.
    pub(crate) chains: Vec<Command>,
    /// `add set` of each affinity set, then `add rule` of each rule.
    pub(crate) body: Vec<Command>,
    /// Whether these commands may go in a transaction of their own before the rest (see
    /// [`Transaction::steps`]): false when one of its affinity sets is re-created.
    pub(crate) alone: bool,
}

/// The commands of one sync, in the order of one atomic transaction: the fixed part and
/// stale chains (`head`), every rewritten service's chains, deleted affinity sets, every
/// service's sets and rules, then map elements and deleted chains (`tail`).
///
/// `Display` prints the `nft -f -` script (one statement a line); [`Transaction::commands`]
/// walks the same order without building text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transaction {
    pub(crate) family: IpFamily,
    /// Commands that let service commands run in transactions of their own before the rest
    /// (`add table`, `add chain mark-for-masquerade`); empty unless the sync is full.
    pub(crate) prelude: Vec<Command>,
    pub(crate) head: Vec<Command>,
    pub(crate) services: Vec<ServiceCommands>,
    pub(crate) deleted_sets: Vec<Command>,
    pub(crate) tail: Vec<Command>,
}

impl Transaction {
    /// `commands` as one transaction on `family`'s table (tests and tools build their own).
    pub fn new(family: IpFamily, commands: Vec<Command>) -> Self {
        Self {
            family,
            prelude: Vec::new(),
            head: commands,
            services: Vec::new(),
            deleted_sets: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// Remove the table and everything in it; `add` first, so that an absent table is no
    /// error (`--cleanup`).
    pub fn remove_table(family: IpFamily) -> Self {
        Self::new(
            family,
            vec![Command::AddTable { comment: None }, Command::DeleteTable],
        )
    }

    /// The table's family.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// Every command, in transaction order.
    pub fn commands(&self) -> impl Iterator<Item = &Command> + '_ {
        self.head
            .iter()
            .chain(self.services.iter().flat_map(|s| &s.chains))
            .chain(&self.deleted_sets)
            .chain(self.services.iter().flat_map(|s| &s.body))
            .chain(&self.tail)
    }

    /// How many commands (statements) there are.
    pub fn len(&self) -> usize {
        self.head.len()
            + self
                .services
                .iter()
                .map(|s| s.chains.len() + s.body.len())
                .sum::<usize>()
            + self.deleted_sets.len()
            + self.tail.len()
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The same changes as a sequence of transactions of about `max_commands` commands each,
    /// to apply in order, so that no single transaction has to hold a whole large sync.
    ///
    /// Only a full sync is split (a partial one is a single step), and only in this safe
    /// order: first the services' own chains, affinity sets and rules, a group of whole
    /// services per step (each service's objects change atomically); nothing reaches them
    /// yet unless an element installed before already did, in which case the service is
    /// rewritten in one step, as in one transaction. The last step holds the rest in the
    /// order of one transaction: the fixed part (base chains, flushed and refilled maps),
    /// stale chains, the services that must stay there (one of their affinity sets is
    /// re-created), and the map elements that make the new chains reachable. If a step
    /// fails, the steps before it stay applied: the caller must then treat every chain as
    /// possibly holding rules ([`NftState::forget_chain_contents`](super::NftState)).
    pub fn steps(&self, max_commands: usize) -> Vec<Vec<&Command>> {
        let alone = self.services.iter().filter(|s| s.alone).count();
        if self.prelude.is_empty() || alone == 0 || self.len() <= max_commands {
            return vec![self.commands().collect()];
        }
        let mut steps: Vec<Vec<&Command>> = vec![self.prelude.iter().collect()];
        for service in self.services.iter().filter(|s| s.alone) {
            let size = service.chains.len() + service.body.len();
            if steps
                .last()
                .is_some_and(|step| !step.is_empty() && step.len() + size > max_commands)
            {
                steps.push(Vec::new());
            }
            if let Some(step) = steps.last_mut() {
                step.extend(service.chains.iter().chain(&service.body));
            }
        }
        let rest = self.services.iter().filter(|s| !s.alone);
        let last: Vec<&Command> = self
            .head
            .iter()
            .chain(rest.clone().flat_map(|s| &s.chains))
            .chain(&self.deleted_sets)
            .chain(rest.flat_map(|s| &s.body))
            .chain(&self.tail)
            .collect();
        steps.push(last);
        steps
    }
}

/// Takes the steps of a full sync as [`render_in_steps`](super::render_in_steps) renders
/// them, each to be applied as a kernel transaction of its own before the next is rendered,
/// so that a large full sync is never in memory as a whole.
pub trait StepSink {
    /// Why a step was not applied.
    type Error;

    /// At most this many commands per step (the `max_commands` of [`Transaction::steps`]).
    fn max_commands(&self) -> usize;

    /// Apply `commands` on `family`'s table as one transaction; on error nothing of it was
    /// applied (the steps before it stay).
    fn apply_step(&mut self, family: IpFamily, commands: &[Command]) -> Result<(), Self::Error>;
}

/// A [`StepSink`] that never takes a step: the whole transaction stays in the output.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoSteps;

impl StepSink for NoSteps {
    type Error = std::convert::Infallible;

    fn max_commands(&self) -> usize {
        usize::MAX
    }

    fn apply_step(&mut self, _: IpFamily, _: &[Command]) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Groups the services of a full sync into the steps of [`Transaction::steps`] as they are
/// rendered, and hands each complete step to a [`StepSink`]: until the services alone exceed
/// one step, nothing is applied (a small sync stays one transaction); from then on only the
/// step being filled and the services that must stay in the last step are kept.
pub(crate) struct StepWriter<'s, S: StepSink + ?Sized> {
    sink: &'s mut S,
    family: IpFamily,
    max: usize,
    /// Empty unless the sync is full (only full syncs are split).
    prelude: Vec<Command>,
    /// Services not applied yet, in order: all of them until stepping starts, then only
    /// those that must stay in the last step.
    services: Vec<ServiceCommands>,
    /// Commands of the `alone` services in `services`, before stepping starts.
    alone_len: usize,
    /// The step being filled, once stepping has started.
    step: Option<Vec<Command>>,
    /// Steps applied.
    pub(crate) applied: usize,
    /// Commands of the transaction in the applied steps (the prelude's are repeated later).
    applied_commands: usize,
}

impl<'s, S: StepSink + ?Sized> StepWriter<'s, S> {
    /// Steps for `family`'s sync; `prelude` as in [`Transaction`].
    pub(crate) fn new(sink: &'s mut S, family: IpFamily, prelude: Vec<Command>) -> Self {
        Self {
            max: sink.max_commands(),
            sink,
            family,
            prelude,
            services: Vec::new(),
            alone_len: 0,
            step: None,
            applied: 0,
            applied_commands: 0,
        }
    }

    /// Add the next service's commands (in service order).
    pub(crate) fn push(&mut self, service: ServiceCommands) -> Result<(), S::Error> {
        if self.step.is_some() {
            if service.alone {
                return self.add_to_step(service);
            }
            self.services.push(service);
            return Ok(());
        }
        if service.alone {
            self.alone_len += service.chains.len() + service.body.len();
        }
        self.services.push(service);
        if self.prelude.is_empty()
            || self.alone_len == 0
            || self.prelude.len() + self.alone_len <= self.max
        {
            return Ok(());
        }
        // The transaction is larger than a step: start stepping, as `Transaction::steps`
        // would group the services seen so far.
        self.step = Some(self.prelude.clone());
        let mut last = Vec::new();
        for service in std::mem::take(&mut self.services) {
            if service.alone {
                self.add_to_step(service)?;
            } else {
                last.push(service);
            }
        }
        self.services = last;
        Ok(())
    }

    /// Put `service` into the current step, applying that step first if it is full.
    fn add_to_step(&mut self, service: ServiceCommands) -> Result<(), S::Error> {
        let size = service.chains.len() + service.body.len();
        let full = self
            .step
            .as_ref()
            .is_some_and(|step| !step.is_empty() && step.len() + size > self.max);
        if full {
            self.apply_step()?;
        }
        if let Some(step) = self.step.as_mut() {
            step.extend(service.chains);
            step.extend(service.body);
        }
        Ok(())
    }

    /// Apply the step being filled, if it holds anything.
    fn apply_step(&mut self) -> Result<(), S::Error> {
        let Some(step) = self.step.as_mut() else {
            return Ok(());
        };
        if step.is_empty() {
            return Ok(());
        }
        self.sink.apply_step(self.family, step)?;
        self.applied += 1;
        self.applied_commands += step.len();
        step.clear();
        Ok(())
    }

    /// The rest of the sync: once stepping started, the step being filled is applied and
    /// the transaction returned is the last step (no prelude, so it is not split again);
    /// otherwise the whole transaction. Also returns how many steps and commands were
    /// applied.
    pub(crate) fn finish(
        mut self,
        head: Vec<Command>,
        deleted_sets: Vec<Command>,
        tail: Vec<Command>,
    ) -> Result<(Transaction, usize, usize), S::Error> {
        let (prelude, repeated) = if self.step.is_some() {
            self.apply_step()?;
            (Vec::new(), self.prelude.len())
        } else {
            (self.prelude, 0)
        };
        let transaction = Transaction {
            family: self.family,
            prelude,
            head,
            services: self.services,
            deleted_sets,
            tail,
        };
        Ok((
            transaction,
            self.applied,
            self.applied_commands.saturating_sub(repeated),
        ))
    }
}

impl fmt::Display for Transaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for command in self.commands() {
            writeln!(f, "{}", command.display(self.family))?;
        }
        Ok(())
    }
}
