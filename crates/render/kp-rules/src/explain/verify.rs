//! `explain --verify`: compare the rules that should implement the explained service ports
//! with what the kernel holds.
//!
//! Both sides are parsed with [`RuleSet::parse`]: the desired side is the renderer's
//! `iptables-restore` input, the actual side is `iptables-save` output. The kernel prints a
//! rule differently from how it was written (`-d 10.0.0.1/32` first, `--probability
//! 0.50000000000`, `MARK --set-xmark`, default options such as `--rsource` or
//! `--reject-with icmp-port-unreachable` spelled out), so every rule is reduced to a
//! canonical form before comparing: base matches sorted, each match module's options sorted
//! with defaults dropped, values normalised. The order of match modules and of rules in a
//! chain is kept, since both matter to the kernel. Counters and whitespace are ignored.
//!
//! Only what implements the explained service ports is compared: each port's own chains
//! (`KUBE-SVC/SVL/EXT/FW-…` and its endpoints' `KUBE-SEP-…`), and in the shared chains
//! (`KUBE-SERVICES`, `KUBE-NODEPORTS`, …) the rules that jump to those chains or carry the
//! port's comment, plus the NodePort dispatch rule when a NodePort matched.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use ipnet::IpNet;
use serde::Serialize;

use super::{Explanation, MatchKind};
use crate::iptables::comment::sanitize;
use crate::iptables::{KUBE_EXTERNAL_SERVICES, KUBE_NODEPORTS, KUBE_PROXY_FIREWALL, KUBE_SERVICES};

/// Shared chains in which individual service rules live, per table.
const SHARED_CHAINS: [(&str, &str); 6] = [
    ("nat", KUBE_SERVICES),
    ("nat", KUBE_NODEPORTS),
    ("filter", KUBE_SERVICES),
    ("filter", KUBE_EXTERNAL_SERVICES),
    ("filter", KUBE_PROXY_FIREWALL),
    ("filter", KUBE_NODEPORTS),
];

/// Why rules text could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// A chain or rule line before any `*table` line.
    #[error("line {0}: rule or chain outside a table")]
    OutsideTable(usize),
    /// A double quote that is never closed.
    #[error("line {0}: unbalanced quote")]
    UnbalancedQuote(usize),
    /// A line that is none of `*table`, `:CHAIN`, `-A`, `-N`, `-X`, `COMMIT` or a comment.
    #[error("line {line}: cannot parse {text:?}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The line.
        text: String,
    },
}

/// One rule: as written, and canonical.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The line as written (counters stripped), for reports.
    pub text: String,
    /// The canonical form compared.
    pub canonical: String,
    /// The `-j`/`-g` target, if any.
    pub target: Option<String>,
    /// The `--comment` value, if any.
    pub comment: Option<String>,
}

/// The chains and rules of some tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleSet {
    tables: BTreeMap<String, BTreeMap<String, Vec<Rule>>>,
}

impl RuleSet {
    /// Parses `iptables-save` output or `iptables-restore` input. Declaring a chain
    /// (`:NAME`) starts it empty, as a restore flushes it; `-X` removes it.
    pub fn parse(text: &str) -> Result<RuleSet, ParseError> {
        let mut tables: BTreeMap<String, BTreeMap<String, Vec<Rule>>> = BTreeMap::new();
        let mut table: Option<String> = None;
        for (index, raw) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') || line == "COMMIT" {
                continue;
            }
            if let Some(name) = line.strip_prefix('*') {
                let name = name.trim().to_owned();
                tables.entry(name.clone()).or_default();
                table = Some(name);
                continue;
            }
            let chains = match &table {
                Some(t) => tables.entry(t.clone()).or_default(),
                None => return Err(ParseError::OutsideTable(line_no)),
            };
            let malformed = || ParseError::Malformed {
                line: line_no,
                text: raw.to_owned(),
            };
            if let Some(decl) = line.strip_prefix(':') {
                let name = decl.split_whitespace().next().ok_or_else(malformed)?;
                chains.insert(name.to_owned(), Vec::new());
                continue;
            }
            // `iptables-save -c` prefixes rules with `[packets:bytes]`.
            let line = match line.strip_prefix('[') {
                Some(rest) => rest.split_once(']').ok_or_else(malformed)?.1.trim_start(),
                None => line,
            };
            let tokens = tokenize(line).ok_or(ParseError::UnbalancedQuote(line_no))?;
            match tokens.as_slice() {
                [op, chain, rest @ ..]
                    if !op.quoted && (op.text == "-A" || op.text == "--append") =>
                {
                    let rule = canonical_rule(rest, line);
                    chains.entry(chain.text.clone()).or_default().push(rule);
                }
                [op, chain] if !op.quoted && op.text == "-N" => {
                    chains.entry(chain.text.clone()).or_default();
                }
                [op, chain] if !op.quoted && op.text == "-X" => {
                    chains.remove(&chain.text);
                }
                _ => return Err(malformed()),
            }
        }
        Ok(RuleSet { tables })
    }

    /// The rules of a chain; `None` if the chain does not exist.
    pub fn chain(&self, table: &str, chain: &str) -> Option<&[Rule]> {
        self.tables
            .get(table)
            .and_then(|t| t.get(chain))
            .map(Vec::as_slice)
    }
}

/// A difference between the desired and the actual rules.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(tag = "kind")]
pub enum Difference {
    /// A chain that should exist does not.
    MissingChain {
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// Rules it should hold.
        rules: usize,
    },
    /// A chain of the service port exists but should not.
    UnexpectedChain {
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// Rules it holds.
        rules: usize,
    },
    /// A rule that should be in a chain is not (or is elsewhere in it).
    MissingRule {
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// 1-based position in the desired chain.
        position: usize,
        /// The rule as rendered.
        rule: String,
    },
    /// A rule in a chain that should not be there (or not there).
    UnexpectedRule {
        /// Table.
        table: String,
        /// Chain.
        chain: String,
        /// 1-based position in the kernel's chain (`iptables -D CHAIN <position>`).
        position: usize,
        /// The rule as the kernel prints it.
        rule: String,
    },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Difference::MissingChain {
                table,
                chain,
                rules,
            } => write!(
                f,
                "missing chain {table} {chain} (should hold {rules} rules)"
            ),
            Difference::UnexpectedChain {
                table,
                chain,
                rules,
            } => write!(f, "unexpected chain {table} {chain} (holds {rules} rules)"),
            Difference::MissingRule {
                table,
                chain,
                position,
                rule,
            } => write!(f, "missing rule {table} {chain} #{position}: {rule}"),
            Difference::UnexpectedRule {
                table,
                chain,
                position,
                rule,
            } => write!(f, "unexpected rule {table} {chain} #{position}: {rule}"),
        }
    }
}

/// A chain that was compared.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct CheckedChain {
    /// Table.
    pub table: String,
    /// Chain.
    pub chain: String,
    /// Rules of the service ports compared (all rules for their own chains).
    pub rules: usize,
}

/// The result of [`verify`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// What was compared.
    pub checked: Vec<CheckedChain>,
    /// Every difference found; empty when the kernel matches.
    pub differences: Vec<Difference>,
}

impl VerifyReport {
    /// No differences.
    pub fn is_clean(&self) -> bool {
        self.differences.is_empty()
    }
}

/// Compare, for every service port in `explanation`, the desired rules with the actual ones.
pub fn verify(explanation: &Explanation, desired: &RuleSet, actual: &RuleSet) -> VerifyReport {
    let mut checked: BTreeSet<CheckedChain> = BTreeSet::new();
    let mut differences: Vec<Difference> = Vec::new();
    let mut seen_ports = BTreeSet::new();
    let node_port = explanation
        .matches
        .iter()
        .any(|m| m.how == MatchKind::NodePort);

    for m in &explanation.matches {
        if !seen_ports.insert(m.name.clone()) {
            continue;
        }
        let mut own: Vec<&str> = vec![&m.chains.svc, &m.chains.svl, &m.chains.ext, &m.chains.fw];
        own.extend(m.endpoints.iter().filter_map(|e| e.chain.as_deref()));
        let own_set: BTreeSet<&str> = own.iter().copied().collect();
        for chain in &own_set {
            let want = desired.chain("nat", chain);
            let have = actual.chain("nat", chain);
            match (want, have) {
                (None, None) => {}
                (Some(want), None) => differences.push(Difference::MissingChain {
                    table: "nat".into(),
                    chain: (*chain).to_owned(),
                    rules: want.len(),
                }),
                (None, Some(have)) => differences.push(Difference::UnexpectedChain {
                    table: "nat".into(),
                    chain: (*chain).to_owned(),
                    rules: have.len(),
                }),
                (Some(want), Some(have)) => {
                    checked.insert(CheckedChain {
                        table: "nat".into(),
                        chain: (*chain).to_owned(),
                        rules: want.len(),
                    });
                    let want: Vec<(usize, &Rule)> = want.iter().enumerate().collect();
                    let have: Vec<(usize, &Rule)> = have.iter().enumerate().collect();
                    diff_rules("nat", chain, &want, &have, &mut differences);
                }
            }
        }

        let comment = sanitize(&m.service_port);
        let relevant = |table: &str, chain: &str, rule: &Rule| {
            rule.target.as_deref().is_some_and(|t| own_set.contains(t))
                || rule.comment.as_deref().is_some_and(|c| {
                    c == comment
                        || c.strip_prefix(comment.as_str())
                            .is_some_and(|rest| rest.starts_with(' '))
                })
                || (node_port
                    && table == "nat"
                    && chain == KUBE_SERVICES
                    && rule.target.as_deref() == Some(KUBE_NODEPORTS))
        };
        for (table, chain) in SHARED_CHAINS {
            let pick = |rules: Option<&[Rule]>| -> Vec<(usize, Rule)> {
                rules
                    .unwrap_or(&[])
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| relevant(table, chain, r))
                    .map(|(i, r)| (i, r.clone()))
                    .collect()
            };
            let want = pick(desired.chain(table, chain));
            let have_chain = actual.chain(table, chain);
            if have_chain.is_none() && !want.is_empty() {
                differences.push(Difference::MissingChain {
                    table: table.into(),
                    chain: chain.into(),
                    rules: want.len(),
                });
                continue;
            }
            let have = pick(have_chain);
            if want.is_empty() && have.is_empty() {
                continue;
            }
            checked.insert(CheckedChain {
                table: table.into(),
                chain: chain.into(),
                rules: want.len(),
            });
            let want: Vec<(usize, &Rule)> = want.iter().map(|(i, r)| (*i, r)).collect();
            let have: Vec<(usize, &Rule)> = have.iter().map(|(i, r)| (*i, r)).collect();
            diff_rules(table, chain, &want, &have, &mut differences);
        }
    }
    // Two service ports share the NodePort dispatch rule: report it once.
    let mut unique = BTreeSet::new();
    differences.retain(|d| unique.insert(d.clone()));
    VerifyReport {
        checked: checked.into_iter().collect(),
        differences,
    }
}

/// Longest-common-subsequence diff of two rule lists (chains are short); the positions are
/// the rules' indexes in their full chains.
fn diff_rules(
    table: &str,
    chain: &str,
    want: &[(usize, &Rule)],
    have: &[(usize, &Rule)],
    out: &mut Vec<Difference>,
) {
    let (n, m) = (want.len(), have.len());
    // lcs[i][j]: LCS length of want[i..] and have[j..].
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if want[i].1.canonical == have[j].1.canonical {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let missing = |(pos, rule): (usize, &Rule)| Difference::MissingRule {
        table: table.into(),
        chain: chain.into(),
        position: pos + 1,
        rule: rule.text.clone(),
    };
    let unexpected = |(pos, rule): (usize, &Rule)| Difference::UnexpectedRule {
        table: table.into(),
        chain: chain.into(),
        position: pos + 1,
        rule: rule.text.clone(),
    };
    while i < n && j < m {
        if want[i].1.canonical == have[j].1.canonical {
            i += 1;
            j += 1;
        } else if lcs[i + 1][j] >= lcs[i][j + 1] {
            out.push(missing(want[i]));
            i += 1;
        } else {
            out.push(unexpected(have[j]));
            j += 1;
        }
    }
    out.extend(want[i..].iter().copied().map(missing));
    out.extend(have[j..].iter().copied().map(unexpected));
}

/// One token of a rule line; quoted tokens are always values.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Token {
    text: String,
    quoted: bool,
}

/// Splits on whitespace, honouring double quotes with backslash escapes inside them (what
/// `iptables-save` writes). `None` on an unclosed quote.
fn tokenize(line: &str) -> Option<Vec<Token>> {
    let mut tokens = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(tokens);
        }
        let mut text = String::new();
        let mut quoted = false;
        while let Some(&c) = chars.peek() {
            if c.is_whitespace() {
                break;
            }
            chars.next();
            if c == '"' {
                quoted = true;
                loop {
                    match chars.next()? {
                        '"' => break,
                        '\\' => text.push(chars.next()?),
                        other => text.push(other),
                    }
                }
            } else {
                text.push(c);
            }
        }
        tokens.push(Token { text, quoted });
    }
}

/// An option with its values, e.g. `! --ctstate NEW`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Opt {
    name: String,
    negated: bool,
    values: Vec<String>,
}

impl fmt::Display for Opt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.negated {
            f.write_str("! ")?;
        }
        f.write_str(&self.name)?;
        for v in &self.values {
            write!(f, " {v:?}")?;
        }
        Ok(())
    }
}

/// Base (non-module) options and their canonical short names.
fn base_option(token: &str) -> Option<&'static str> {
    Some(match token {
        "-s" | "--source" | "--src" => "-s",
        "-d" | "--destination" | "--dst" => "-d",
        "-p" | "--protocol" => "-p",
        "-i" | "--in-interface" => "-i",
        "-o" | "--out-interface" => "-o",
        _ => return None,
    })
}

fn is_option(token: &Token) -> bool {
    !token.quoted && (token.text == "!" || (token.text.len() > 1 && token.text.starts_with('-')))
}

/// The canonical form of the rule spec after `-A CHAIN`.
fn canonical_rule(tokens: &[Token], line: &str) -> Rule {
    let mut base: Vec<Opt> = Vec::new();
    let mut modules: Vec<(String, Vec<Opt>)> = Vec::new();
    let mut target: Option<(String, Vec<Opt>)> = None;
    let mut stray: Vec<String> = Vec::new();
    let mut negated = false;
    let mut i = 0;
    while i < tokens.len() {
        let token = &tokens[i];
        i += 1;
        if token.quoted {
            stray.push(token.text.clone());
            continue;
        }
        let value = tokens.get(i).map(|t| t.text.clone()).unwrap_or_default();
        match token.text.as_str() {
            "!" => {
                negated = true;
                continue;
            }
            "-m" | "--match" => {
                modules.push((value, Vec::new()));
                i += 1;
            }
            "-j" | "--jump" => {
                target = Some((value, Vec::new()));
                i += 1;
            }
            "-g" | "--goto" => {
                target = Some((format!("goto {value}"), Vec::new()));
                i += 1;
            }
            text => {
                if let Some(name) = base_option(text) {
                    let value = match name {
                        "-s" | "-d" => canonical_address(&value),
                        "-p" => value.to_ascii_lowercase(),
                        _ => value,
                    };
                    base.push(Opt {
                        name: name.to_owned(),
                        negated,
                        values: vec![value],
                    });
                    i += 1;
                } else if text.starts_with('-') {
                    let mut values = Vec::new();
                    if text == "--comment" {
                        // One value, which may look like an option when unquoted.
                        if let Some(t) = tokens.get(i) {
                            values.push(t.text.clone());
                            i += 1;
                        }
                    } else {
                        while let Some(t) = tokens.get(i).filter(|t| !is_option(t)) {
                            values.push(t.text.clone());
                            i += 1;
                        }
                    }
                    let opt = Opt {
                        name: text.to_owned(),
                        negated,
                        values,
                    };
                    if let Some((_, opts)) = &mut target {
                        opts.push(opt);
                    } else if let Some((_, opts)) = modules.last_mut() {
                        opts.push(opt);
                    } else {
                        base.push(opt);
                    }
                } else {
                    stray.push(text.to_owned());
                }
            }
        }
        negated = false;
    }

    let mut comment = None;
    for (name, opts) in &mut modules {
        normalize_module(name, opts);
        if name == "comment" {
            comment = opts
                .iter()
                .find(|o| o.name == "--comment")
                .and_then(|o| o.values.first().cloned());
        }
        opts.sort();
    }
    if let Some((name, opts)) = &mut target {
        normalize_target(name, opts);
        opts.sort();
    }
    base.sort();

    let mut canonical = String::new();
    let mut push = |part: String| {
        if !canonical.is_empty() {
            canonical.push(' ');
        }
        canonical.push_str(&part);
    };
    for opt in &base {
        push(opt.to_string());
    }
    for (name, opts) in &modules {
        push(format!("-m {name}"));
        for opt in opts {
            push(opt.to_string());
        }
    }
    if let Some((name, opts)) = &target {
        push(format!("-j {name}"));
        for opt in opts {
            push(opt.to_string());
        }
    }
    for s in &stray {
        push(format!("?{s:?}"));
    }
    Rule {
        text: line.to_owned(),
        canonical,
        target: target.map(|(name, _)| name),
        comment,
    }
}

/// `10.0.0.1` and `10.0.0.1/32` are the same match; networks are written truncated.
fn canonical_address(value: &str) -> String {
    if let Ok(net) = value.parse::<IpNet>() {
        return net.trunc().to_string();
    }
    match value.parse::<std::net::IpAddr>() {
        Ok(ip) => IpNet::from(ip).to_string(),
        Err(_) => value.to_owned(),
    }
}

/// A 32-bit number written in hex or decimal.
fn parse_u32(text: &str) -> Option<u32> {
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// `VALUE[/MASK]` as `0xV/0xM` (a missing mask is all ones).
fn value_mask(text: &str) -> Option<String> {
    let (value, mask) = match text.split_once('/') {
        Some((v, m)) => (parse_u32(v)?, parse_u32(m)?),
        None => (parse_u32(text)?, u32::MAX),
    };
    Some(format!("{value:#x}/{mask:#x}"))
}

fn normalize_module(name: &str, opts: &mut Vec<Opt>) {
    match name {
        "statistic" => {
            for opt in opts.iter_mut().filter(|o| o.name == "--probability") {
                // The kernel keeps the probability as a fraction of 2^31 and prints it with
                // 11 decimals; compare the stored integer.
                if let Some(p) = opt.values.first().and_then(|v| v.parse::<f64>().ok()) {
                    opt.values = vec![format!("{}", (p * 2_147_483_648.0).round() as u64)];
                }
            }
        }
        "recent" => opts.retain(|o| {
            // `--rsource` and an all-ones mask are the defaults the kernel prints.
            !(o.name == "--rsource"
                || (o.name == "--mask"
                    && o.values.first().is_some_and(|m| {
                        m == "255.255.255.255" || m == "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"
                    })))
        }),
        "conntrack" => {
            for opt in opts
                .iter_mut()
                .filter(|o| o.name == "--ctstate" || o.name == "--ctstatus")
            {
                for v in &mut opt.values {
                    let mut states: Vec<&str> = v.split(',').collect();
                    states.sort_unstable();
                    *v = states.join(",");
                }
            }
        }
        "mark" => {
            for opt in opts.iter_mut().filter(|o| o.name == "--mark") {
                for v in &mut opt.values {
                    if let Some(norm) = value_mask(v) {
                        *v = norm;
                    }
                }
            }
        }
        "tcp" | "udp" | "sctp" => {
            for opt in opts.iter_mut() {
                match opt.name.as_str() {
                    "--destination-port" => opt.name = "--dport".into(),
                    "--source-port" => opt.name = "--sport".into(),
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

fn normalize_target(name: &str, opts: &mut Vec<Opt>) {
    match name {
        "MARK" => {
            // The kernel stores every MARK variant as "xor value / mask" and prints that.
            for opt in opts.iter_mut() {
                let Some(value) = opt.values.first().and_then(|v| parse_u32(v)) else {
                    if opt.name == "--set-xmark"
                        && let Some(norm) = opt.values.first().and_then(|v| value_mask(v))
                    {
                        opt.values = vec![norm];
                    }
                    continue;
                };
                let xmark = match opt.name.as_str() {
                    "--or-mark" => Some((value, value)),
                    "--xor-mark" => Some((value, 0)),
                    "--and-mark" => Some((0, !value)),
                    "--set-xmark" => Some((value, u32::MAX)),
                    _ => None,
                };
                if let Some((v, m)) = xmark {
                    opt.name = "--set-xmark".into();
                    opt.values = vec![format!("{v:#x}/{m:#x}")];
                }
            }
        }
        "REJECT" => opts.retain(|o| {
            !(o.name == "--reject-with"
                && o.values
                    .first()
                    .is_some_and(|v| v == "icmp-port-unreachable" || v == "icmp6-port-unreachable"))
        }),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(spec: &str) -> String {
        let tokens = tokenize(spec).expect("balanced");
        canonical_rule(&tokens, spec).canonical
    }

    #[test]
    fn rendered_and_saved_forms_agree() {
        // Pairs seen from iptables v1.8.9 (nf_tables): what we write, what the kernel prints.
        let pairs = [
            (
                r#"-m comment --comment "ns/web:http cluster IP" -m tcp -p tcp -d 10.96.0.10 --dport 80 ! -s 10.244.0.0/16 -j KUBE-MARK-MASQ"#,
                r#"! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "ns/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ"#,
            ),
            (
                r#"-m comment --comment "a -> 10.0.0.1:80" -m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-X"#,
                r#"-m comment --comment "a -> 10.0.0.1:80" -m statistic --mode random --probability 0.33333333349 -j KUBE-SEP-X"#,
            ),
            (
                r#"-m comment --comment "a" -m recent --name KUBE-SEP-X --set -m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80"#,
                r#"-p tcp -m comment --comment a -m recent --set --name KUBE-SEP-X --mask 255.255.255.255 --rsource -m tcp -j DNAT --to-destination 10.0.0.1:80"#,
            ),
            (
                r#"-m recent --name KUBE-SEP-X --rcheck --seconds 10800 --reap -j KUBE-SEP-X"#,
                r#"-m recent --rcheck --seconds 10800 --reap --name KUBE-SEP-X --mask 255.255.255.255 --rsource -j KUBE-SEP-X"#,
            ),
            (
                "-j MARK --or-mark 0x4000",
                "-j MARK --set-xmark 0x4000/0x4000",
            ),
            (
                "-j MARK --xor-mark 0x4000",
                "-j MARK --set-xmark 0x4000/0x0",
            ),
            (
                "-m udp -p udp -d 10.96.0.1 --dport 53 -j REJECT",
                "-d 10.96.0.1/32 -p udp -m udp --dport 53 -j REJECT --reject-with icmp-port-unreachable",
            ),
            (
                "-m mark ! --mark 0x4000/0x4000 -j RETURN",
                "-m mark ! --mark 0x4000/0x4000 -j RETURN",
            ),
        ];
        for (ours, kernel) in pairs {
            assert_eq!(canon(ours), canon(kernel), "{ours}\nvs\n{kernel}");
        }
    }

    #[test]
    fn real_differences_stay_different() {
        let base = "-m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80";
        for other in [
            "-m tcp -p tcp -j DNAT --to-destination 10.0.0.2:80",
            "-m udp -p udp -j DNAT --to-destination 10.0.0.1:80",
            "-m tcp -p tcp -s 10.0.0.1 -j DNAT --to-destination 10.0.0.1:80",
            "-m tcp -p tcp -j DNAT --to-destination 10.0.0.1:80 --random",
        ] {
            assert_ne!(canon(base), canon(other), "{other}");
        }
        assert_ne!(
            canon("! -s 10.0.0.0/8 -j X"),
            canon("-s 10.0.0.0/8 -j X"),
            "negation counts"
        );
        assert_ne!(
            canon(r#"-m comment --comment "a b" -j X"#),
            canon(r#"-m comment --comment "a c" -j X"#)
        );
    }

    #[test]
    fn parse_reads_both_formats() {
        let saved = "# Generated by iptables-save\n*nat\n:PREROUTING ACCEPT [0:0]\n\
                     :KUBE-SVC-X - [0:0]\n[3:180] -A KUBE-SVC-X -j KUBE-SEP-Y\nCOMMIT\n";
        let set = RuleSet::parse(saved).expect("parses");
        let rules = set.chain("nat", "KUBE-SVC-X").expect("chain");
        assert_eq!(rules.len(), 1);
        assert_eq!(rules[0].target.as_deref(), Some("KUBE-SEP-Y"));
        assert_eq!(rules[0].text, "-A KUBE-SVC-X -j KUBE-SEP-Y");
        assert!(
            set.chain("nat", "PREROUTING")
                .is_some_and(<[Rule]>::is_empty)
        );

        let restore = "*nat\n:KUBE-SEP-OLD - [0:0]\n-X KUBE-SEP-OLD\nCOMMIT\n";
        let set = RuleSet::parse(restore).expect("parses");
        assert!(set.chain("nat", "KUBE-SEP-OLD").is_none(), "-X deletes");

        assert_eq!(
            RuleSet::parse(":X - [0:0]\n"),
            Err(ParseError::OutsideTable(1))
        );
        assert_eq!(
            RuleSet::parse("*nat\n-A X -m comment --comment \"open\n"),
            Err(ParseError::UnbalancedQuote(2))
        );
        assert!(matches!(
            RuleSet::parse("*nat\nbogus\n"),
            Err(ParseError::Malformed { line: 2, .. })
        ));
    }

    #[test]
    fn diff_reports_missing_unexpected_and_positions() {
        let rule = |spec: &str| {
            let tokens = tokenize(spec).expect("balanced");
            canonical_rule(&tokens, spec)
        };
        let want = [rule("-j A"), rule("-j B"), rule("-j C")];
        let have = [rule("-j A"), rule("-j X"), rule("-j C")];
        let want: Vec<(usize, &Rule)> = want.iter().enumerate().collect();
        let have: Vec<(usize, &Rule)> = have.iter().enumerate().collect();
        let mut out = Vec::new();
        diff_rules("nat", "K", &want, &have, &mut out);
        assert_eq!(
            out,
            vec![
                Difference::MissingRule {
                    table: "nat".into(),
                    chain: "K".into(),
                    position: 2,
                    rule: "-j B".into()
                },
                Difference::UnexpectedRule {
                    table: "nat".into(),
                    chain: "K".into(),
                    position: 2,
                    rule: "-j X".into()
                },
            ]
        );
    }
}
