//! The tools' text: an `iptables-save` dump cut into its tables, and a rule specification
//! split into arguments as `iptables-restore` and a shell split it.

use std::collections::BTreeMap;

use kp_rules::iptables::Table;

/// The sections (`*table` to `COMMIT`) of an `iptables-save` dump for each of `tables`; a
/// table the dump lacks is empty.
pub fn split_save(all: &str, tables: &[Table]) -> BTreeMap<Table, String> {
    let mut saved: BTreeMap<Table, String> = tables.iter().map(|t| (*t, String::new())).collect();
    let mut current: Option<Table> = None;
    for line in all.lines() {
        if let Some(name) = line.strip_prefix('*') {
            current = tables.iter().copied().find(|t| t.as_str() == name);
        }
        if let Some(text) = current.and_then(|t| saved.get_mut(&t)) {
            text.push_str(line);
            text.push('\n');
        }
        if line == "COMMIT" {
            current = None;
        }
    }
    saved
}

/// Split a rule specification the way `iptables-restore` and a shell do for our rules:
/// on spaces, with double-quoted parts (comments) kept whole and the quotes removed.
///
/// Comments are percent-encoded by the renderer, so they never contain quotes or
/// backslashes; `iptables-save` output uses the same quoting.
pub fn split_args(spec: &str) -> Vec<String> {
    let mut args = Vec::new();
    let mut current = String::new();
    let mut in_quotes = false;
    let mut has_token = false;
    for c in spec.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                has_token = true;
            }
            ' ' | '\t' if !in_quotes => {
                if has_token {
                    args.push(std::mem::take(&mut current));
                    has_token = false;
                }
            }
            _ => {
                current.push(c);
                has_token = true;
            }
        }
    }
    if has_token {
        args.push(current);
    }
    args
}
