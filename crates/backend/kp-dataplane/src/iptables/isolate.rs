//! Failure isolation for full restores: which service a failed `iptables-restore` line
//! belongs to, so the restore can be retried without it.
//!
//! `iptables-restore` names the failing line (`iptables-restore: line N failed` from the
//! legacy variant, `Error occurred at line: N` from the nf_tables one). A line belongs to a
//! service when it declares or appends to one of its chains (`KUBE-SVC/SVL/EXT/FW/SEP`),
//! jumps to one of them, or carries a comment starting with one of its ports' display
//! names (the dispatch and REJECT rules in the shared chains). Anything else (the shared
//! chains themselves, stale-chain deletions, `COMMIT`) is unmappable.

use std::collections::{BTreeMap, BTreeSet};

use kp_core::model::{ServiceName, ServicePortName};
use kp_core::tracker::ProxyState;
use kp_rules::iptables::comment::sanitize;
use kp_rules::iptables::names::{ServiceChains, endpoint_chain};

/// At most this many services are excluded from one full restore before the sync fails as
/// it did without isolation. Each exclusion costs one more render and restore (seconds in a
/// large cluster, under the xtables lock), and several distinct services failing at once
/// points at a node-wide problem (missing kernel module, broken binary) that excluding
/// services cannot fix.
pub(super) const MAX_ISOLATED_SERVICES: usize = 3;

/// The 1-based input line `iptables-restore`'s error message names, if any.
pub(super) fn failed_line(message: &str) -> Option<usize> {
    const MARKERS: [(&str, &str); 2] = [("Error occurred at line: ", ""), ("line ", " failed")];
    for (before, after) in MARKERS {
        for (start, _) in message.match_indices(before) {
            let rest = &message[start + before.len()..];
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 || !rest[digits..].starts_with(after) {
                continue;
            }
            if let Ok(line) = rest[..digits].parse() {
                return Some(line);
            }
        }
    }
    None
}

/// A writer that keeps only line `line` (1-based, without its newline) of what is written
/// through it, so the failing line of a restore input can be found again without holding
/// the whole input.
pub(super) struct LineFinder {
    /// Newlines still to pass before the wanted line starts.
    before: usize,
    line: Vec<u8>,
    done: bool,
}

impl LineFinder {
    pub(super) fn new(line: usize) -> Self {
        Self {
            // Line 0 does not exist: never reached.
            before: line.checked_sub(1).unwrap_or(usize::MAX),
            line: Vec::new(),
            done: false,
        }
    }

    /// The line, if the input had it.
    pub(super) fn into_line(self) -> Option<String> {
        (self.before == 0 && (self.done || !self.line.is_empty()))
            .then(|| String::from_utf8_lossy(&self.line).into_owned())
    }
}

impl std::io::Write for LineFinder {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut rest = buf;
        while self.before > 0 {
            let Some(at) = rest.iter().position(|b| *b == b'\n') else {
                return Ok(buf.len());
            };
            self.before -= 1;
            rest = &rest[at + 1..];
        }
        if !self.done {
            match rest.iter().position(|b| *b == b'\n') {
                Some(at) => {
                    self.line.extend_from_slice(&rest[..at]);
                    self.done = true;
                }
                None => self.line.extend_from_slice(rest),
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The service that `line` (one line of a restore input rendered from `state`) belongs to.
pub(super) fn service_of_line(line: &str, state: &ProxyState) -> Option<ServiceName> {
    // Comments are percent-encoded and quoted, so the first `"` after `--comment ` closes it.
    let (rule, comment) = match line.split_once("--comment \"") {
        Some((before, rest)) => {
            let (comment, after) = rest.split_once('"').unwrap_or((rest, ""));
            (format!("{before} {after}"), Some(comment))
        }
        None => (line.to_owned(), None),
    };
    let owners = chain_owners(state);
    let tokens: Vec<&str> = rule.split_whitespace().collect();
    // `:CHAIN - [0:0]` declares, `-A CHAIN` appends to a chain.
    let own_chain = match tokens.as_slice() {
        [declared, ..] if declared.starts_with(':') => Some(&declared[1..]),
        ["-A", chain, ..] => Some(*chain),
        _ => None,
    };
    if let Some(service) = own_chain.and_then(|chain| owners.get(chain)) {
        return Some((*service).clone());
    }
    let jump = tokens
        .windows(2)
        .find(|pair| matches!(pair[0], "-j" | "-g") && owners.contains_key(pair[1]));
    if let Some(pair) = jump {
        return owners.get(pair[1]).map(|service| (*service).clone());
    }
    comment.and_then(|comment| comment_owner(comment, state))
}

/// Every per-service chain `state` can produce, with its service.
fn chain_owners(state: &ProxyState) -> BTreeMap<String, &ServiceName> {
    let mut owners = BTreeMap::new();
    for name in state.services.keys() {
        let chains = ServiceChains::new(name);
        for chain in [chains.svc, chains.svl, chains.ext, chains.fw] {
            owners.insert(chain, &name.service);
        }
    }
    for (name, endpoints) in &state.endpoints {
        for endpoint in endpoints {
            owners.insert(
                endpoint_chain(name, endpoint.ip, endpoint.port),
                &name.service,
            );
        }
    }
    owners
}

/// The service whose port's display name the (sanitized) comment starts with; the longest
/// match wins (`ns/a` vs `ns/a:p`).
fn comment_owner(comment: &str, state: &ProxyState) -> Option<ServiceName> {
    state
        .services
        .keys()
        .map(|name| (sanitize(&name.to_string()), name))
        .filter(|(display, _)| {
            comment
                .strip_prefix(display.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(' '))
        })
        .max_by_key(|(display, _)| display.len())
        .map(|(_, name)| name.service.clone())
}

/// `state` without any port or endpoint of `excluded`.
pub(super) fn without(state: &ProxyState, excluded: &BTreeSet<ServiceName>) -> ProxyState {
    let keep = |name: &ServicePortName| !excluded.contains(&name.service);
    let mut reduced = state.clone();
    reduced.services.retain(|name, _| keep(name));
    reduced.endpoints.retain(|name, _| keep(name));
    reduced
}

/// The per-service chains of `excluded` in `state`: left alone (neither written nor
/// deleted) by a restore that excludes them.
pub(super) fn chains_of(state: &ProxyState, excluded: &BTreeSet<ServiceName>) -> BTreeSet<String> {
    chain_owners(state)
        .into_iter()
        .filter(|(_, service)| excluded.contains(*service))
        .map(|(chain, _)| chain)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_finder_keeps_one_line_across_pieces() {
        use std::io::Write as _;
        let text = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j X\nCOMMIT\n";
        for line in 0..=6 {
            for piece in [1, 3, 7, text.len()] {
                let mut finder = LineFinder::new(line);
                for chunk in text.as_bytes().chunks(piece) {
                    finder.write_all(chunk).expect("never fails");
                }
                let want = line.checked_sub(1).and_then(|n| text.lines().nth(n));
                assert_eq!(
                    finder.into_line().as_deref(),
                    want,
                    "line {line}, pieces of {piece}"
                );
            }
        }
    }

    #[test]
    fn finds_the_line_in_both_variants() {
        assert_eq!(failed_line("iptables-restore: line 12 failed"), Some(12));
        assert_eq!(
            failed_line(
                "ip6tables-restore v1.8.9 (nf_tables): unknown option \"--x\"\n\
                 Error occurred at line: 7\nTry `ip6tables-restore -h' for more information."
            ),
            Some(7)
        );
        assert_eq!(
            failed_line("iptables-restore: unable to initialize table 'nat'"),
            None
        );
        assert_eq!(failed_line("line x failed"), None);
    }
}
