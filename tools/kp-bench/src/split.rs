//! Splitting one `iptables-restore --noflush` input into several transactions, to measure
//! whether smaller restores are cheaper in total with the nf_tables backend.
//!
//! Every chain stays whole (declaration and all its rules in one part, in their order), and
//! parts are ordered so that a jump target is declared in the same or an earlier part: leaf
//! chains (`KUBE-SEP-*`) first, dispatch chains (`KUBE-SERVICES`) last. Each part is thus a
//! valid restore on its own once the earlier ones are in. Tables other than `nat` go into
//! the first part unchanged; lines of `nat` that are neither declarations nor `-A` rules
//! (stale-chain `-X`) go into the last. This gives up the single transaction's atomicity: a
//! real proxy doing this would expose intermediate states (new leaves before their
//! dispatch), which is harmless only in this order.

use std::collections::{BTreeMap, BTreeSet};

/// `text` as at most `parts` restore inputs of roughly equal `nat` rule counts.
pub fn split_restore(text: &str, parts: usize) -> Vec<String> {
    let parts = parts.max(1);
    let mut head = String::new();
    let mut nat = NatTable::default();
    let mut table: Option<&str> = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = Some(name);
            if name != "nat" {
                push_line(&mut head, line);
            }
            continue;
        }
        match table {
            Some("nat") => nat.line(line),
            _ => push_line(&mut head, line),
        }
        if line == "COMMIT" {
            table = None;
        }
    }
    if !nat.seen {
        return vec![text.to_owned()];
    }

    let order = nat.dependency_order();
    let total: usize = nat.rules.values().map(Vec::len).sum();
    let target = total.div_ceil(parts).max(1);
    let mut groups: Vec<Vec<&str>> = vec![Vec::new()];
    let mut in_group = 0;
    for chain in order {
        let count = nat.rules.get(chain).map_or(0, Vec::len);
        if in_group >= target && groups.len() < parts {
            groups.push(Vec::new());
            in_group = 0;
        }
        if let Some(group) = groups.last_mut() {
            group.push(chain);
        }
        in_group += count;
    }

    let last = groups.len() - 1;
    groups
        .iter()
        .enumerate()
        .map(|(i, chains)| {
            let mut out = if i == 0 { head.clone() } else { String::new() };
            out.push_str("*nat\n");
            for chain in chains {
                if let Some(decl) = nat.declarations.get(chain) {
                    push_line(&mut out, decl);
                }
            }
            for chain in chains {
                for rule in nat.rules.get(chain).into_iter().flatten() {
                    push_line(&mut out, rule);
                }
            }
            if i == last {
                for other in &nat.other {
                    push_line(&mut out, other);
                }
            }
            out.push_str("COMMIT\n");
            out
        })
        .collect()
}

fn push_line(out: &mut String, line: &str) {
    out.push_str(line);
    out.push('\n');
}

#[derive(Default)]
struct NatTable<'a> {
    seen: bool,
    /// Chains in first-seen order.
    chains: Vec<&'a str>,
    declarations: BTreeMap<&'a str, &'a str>,
    rules: BTreeMap<&'a str, Vec<&'a str>>,
    other: Vec<&'a str>,
}

impl<'a> NatTable<'a> {
    fn line(&mut self, line: &'a str) {
        self.seen = true;
        if line == "COMMIT" {
            return;
        }
        if let Some(decl) = line.strip_prefix(':') {
            let name = decl.split(' ').next().unwrap_or(decl);
            self.note(name);
            self.declarations.insert(name, line);
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let chain = rule.split(' ').next().unwrap_or(rule);
            self.note(chain);
            self.rules.entry(chain).or_default().push(line);
        } else if !line.trim().is_empty() {
            self.other.push(line);
        }
    }

    fn note(&mut self, chain: &'a str) {
        if !self.declarations.contains_key(chain) && !self.rules.contains_key(chain) {
            self.chains.push(chain);
        }
    }

    /// Chains such that every jump target comes before the chain jumping to it.
    fn dependency_order(&self) -> Vec<&'a str> {
        let known: BTreeSet<&str> = self.chains.iter().copied().collect();
        let mut done = BTreeSet::new();
        let mut visiting = BTreeSet::new();
        let mut order = Vec::with_capacity(self.chains.len());
        for &chain in &self.chains {
            // Iterative post-order DFS (chains can be deep only in theory, but be safe).
            let mut stack = vec![(chain, false)];
            while let Some((node, expanded)) = stack.pop() {
                if done.contains(node) {
                    continue;
                }
                if expanded {
                    done.insert(node);
                    order.push(node);
                    continue;
                }
                if !visiting.insert(node) {
                    continue; // already expanded higher up: a cycle, which iptables rejects
                }
                stack.push((node, true));
                for rule in self.rules.get(node).into_iter().flatten() {
                    for target in jump_targets(rule) {
                        if known.contains(target) && !done.contains(target) && target != node {
                            stack.push((target, false));
                        }
                    }
                }
            }
        }
        order
    }
}

/// The chains a rule jumps or goes to (`-j X`, `-g X`).
fn jump_targets(rule: &str) -> impl Iterator<Item = &str> {
    let mut words = rule.split(' ').peekable();
    std::iter::from_fn(move || {
        while let Some(word) = words.next() {
            if word == "-j" || word == "-g" || word == "--jump" || word == "--goto" {
                return words.next();
            }
        }
        None
    })
}
