//! Reading the proxy's klog-shaped log lines (`-v=2`) into the figures of one run.
//!
//! The lines used (message, then `key="value"` pairs):
//!
//! - `first sync of proxy rules complete` (kp-core proxier): `took`, `since_start`;
//! - `synced proxy rules` (proxier, debug): `kind`, `apply`, `backend`, `rules`;
//! - `rendered iptables rules` (kp-dataplane, debug): `family`, `kind`, `render`, `bytes`,
//!   `rules_written`;
//! - `applied iptables rules` (kp-dataplane, debug): `family`, `kind`, `restore`;
//! - `prepared iptables full sync` (kp-dataplane, debug): `family`, `setup`, `save`;
//! - `conntrack cleanup finished` (kp-dataplane, debug): `took`;
//! - `iptables sync finished` (kp-dataplane, debug): `full`, `rules_written`, `took`;
//! - `checked the rules in the kernel` (proxier, debug): `check` (`Canary` every canary
//!   period, `Thorough` before periodic syncs), `took`.

use std::collections::BTreeMap;
use std::time::Duration;

/// kp-dataplane nftables: one family's `nft -f -` transaction applied.
pub const NFT_APPLIED: &str = "applied nftables transaction";
/// kp-dataplane nftables: the backend's whole sync.
pub const NFT_SYNC: &str = "nftables sync finished";
/// The proxier: one self-healing check of the kernel's rules (debug).
pub use kp_core::proxier::VERIFIED_LOG as CHECKED;
/// The message of the proxier's first completed sync, and of every completed sync (debug).
pub use kp_core::proxier::{FIRST_SYNC_LOG as FIRST_SYNC, SYNCED_LOG as SYNCED};
/// kp-dataplane: one family rendered.
pub const RENDERED: &str = "rendered iptables rules";
/// kp-dataplane: one family restored.
pub const APPLIED: &str = "applied iptables rules";
/// kp-dataplane: the setup and listing before a full restore.
pub const PREPARED: &str = "prepared iptables full sync";
/// kp-dataplane: conntrack cleanup after a sync.
pub const CONNTRACK: &str = "conntrack cleanup finished";
/// kp-dataplane: the backend's whole sync.
pub const BACKEND_SYNC: &str = "iptables sync finished";

/// One parsed log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    /// `I`, `W` or `E`.
    pub severity: char,
    /// Source file and line, e.g. `proxier.rs:435`.
    pub source: String,
    /// The message.
    pub message: String,
    /// The `key="value"` pairs, unquoted.
    pub fields: BTreeMap<String, String>,
}

impl LogLine {
    /// Parse a klog line: `I1122 08:09:44.313052    1234 file.rs:12] message k="v" ...`.
    pub fn parse(line: &str) -> Option<Self> {
        let severity = line
            .chars()
            .next()
            .filter(|c| matches!(c, 'I' | 'W' | 'E'))?;
        let close = line.find("] ")?;
        let source = line[..close].rsplit(' ').next()?.to_owned();
        let rest = &line[close + 2..];
        let first_pair = pair_start(rest, 0);
        let message = rest[..first_pair.unwrap_or(rest.len())]
            .trim_end()
            .to_owned();
        let mut fields = BTreeMap::new();
        let mut at = first_pair;
        while let Some(start) = at {
            // ` key="value"`: key up to '=', then a quoted value with `\"` and `\\` escapes.
            let key_start = start + 1;
            let eq = key_start + rest[key_start..].find('=')?;
            let key = &rest[key_start..eq];
            let (value, end) = quoted(&rest[eq + 1..])?;
            fields.insert(key.to_owned(), value);
            at = pair_start(rest, eq + 1 + end);
        }
        Some(Self {
            severity,
            source,
            message,
            fields,
        })
    }

    /// A field's value.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.fields.get(key).map(String::as_str)
    }

    /// A field holding a Rust `Debug` duration.
    pub fn duration(&self, key: &str) -> Option<Duration> {
        parse_duration(self.field(key)?)
    }

    /// A field holding a number.
    pub fn number(&self, key: &str) -> Option<u64> {
        self.field(key)?.parse().ok()
    }
}

/// Where the next ` key="` starts at or after `from`.
fn pair_start(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut i = from;
    while i < bytes.len() {
        if bytes[i] == b' ' {
            let key_end = bytes[i + 1..]
                .iter()
                .position(|b| !(b.is_ascii_alphanumeric() || *b == b'_'))
                .map(|p| i + 1 + p);
            if let Some(end) = key_end
                && end > i + 1
                && bytes.get(end) == Some(&b'=')
                && bytes.get(end + 1) == Some(&b'"')
            {
                return Some(i);
            }
        }
        i += 1;
    }
    None
}

/// A double-quoted value at the start of `text`: the unescaped value and the byte length of
/// the quoted text.
fn quoted(text: &str) -> Option<(String, usize)> {
    let mut chars = text.char_indices();
    if chars.next()?.1 != '"' {
        return None;
    }
    let mut value = String::new();
    let mut escaped = false;
    for (i, c) in chars {
        if escaped {
            value.push(match c {
                'n' => '\n',
                't' => '\t',
                other => other,
            });
            escaped = false;
        } else if c == '\\' {
            escaped = true;
        } else if c == '"' {
            return Some((value, i + 1));
        } else {
            value.push(c);
        }
    }
    None
}

/// Parse a `Debug`-formatted [`Duration`]: `8.712345678s`, `12.5ms`, `950µs`, `3ns`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = text.strip_suffix("µs").or_else(|| text.strip_suffix("us")) {
        (n, 1e-6)
    } else if let Some(n) = text.strip_suffix("ns") {
        (n, 1e-9)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else {
        return None;
    };
    let value: f64 = number.parse().ok()?;
    (value.is_finite() && value >= 0.0).then(|| Duration::from_secs_f64(value * scale))
}

/// One family's render and restore within one sync.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FamilyPhase {
    /// `V4` or `V6`.
    pub family: String,
    /// Render time.
    pub render: Option<Duration>,
    /// Restore time (absent if the restore has not finished).
    pub restore: Option<Duration>,
    /// `-A` lines written.
    pub rules_written: Option<u64>,
    /// Size of the restore input.
    pub bytes: Option<u64>,
}

/// Everything logged about one sync, from its first phase line to the proxier's line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncPhases {
    /// `Full` or `Partial` (from the proxier line, else the phase lines).
    pub kind: String,
    /// Per family, in log order.
    pub families: Vec<FamilyPhase>,
    /// Setup (`-N`, `-C`/`-I`) before full restores, summed over families.
    pub setup: Option<Duration>,
    /// `iptables-save -t nat` before full restores, summed over families.
    pub save: Option<Duration>,
    /// Conntrack cleanup, if it ran.
    pub conntrack: Option<Duration>,
    /// The backend's own total.
    pub backend_total: Option<Duration>,
    /// Proxier: time before the backend (state apply).
    pub apply: Option<Duration>,
    /// Proxier: time in the backend.
    pub backend: Option<Duration>,
    /// Proxier: rules written (the backend's count).
    pub rules: Option<u64>,
    /// Proxier: services changed since the previous sync.
    pub changed: Option<u64>,
    /// The proxier's `synced proxy rules` line was seen: the sync completed.
    pub complete: bool,
}

impl SyncPhases {
    /// Render time summed over families.
    pub fn render(&self) -> Option<Duration> {
        sum(self.families.iter().map(|f| f.render))
    }

    /// Restore time summed over families.
    pub fn restore(&self) -> Option<Duration> {
        sum(self.families.iter().map(|f| f.restore))
    }

    /// Total sync time as the proxier measured it.
    pub fn total(&self) -> Option<Duration> {
        Some(self.apply? + self.backend?)
    }
}

fn sum(values: impl Iterator<Item = Option<Duration>>) -> Option<Duration> {
    let mut total = None;
    for value in values.flatten() {
        *total.get_or_insert(Duration::ZERO) += value;
    }
    total
}

/// Groups phase lines into syncs as they arrive.
#[derive(Clone, Debug, Default)]
pub struct SyncCollector {
    current: SyncPhases,
    /// Completed syncs, oldest first.
    pub completed: Vec<SyncPhases>,
    /// The first-sync line: (`took`, `since_start`).
    pub first_sync: Option<(Option<Duration>, Option<Duration>)>,
}

impl SyncCollector {
    /// Feed one line; returns the sync it completed, if any.
    pub fn feed(&mut self, line: &LogLine) -> Option<&SyncPhases> {
        let current = &mut self.current;
        let kind = line.field("kind").map(str::to_owned);
        match line.message.as_str() {
            RENDERED => {
                if let Some(kind) = kind {
                    current.kind = kind;
                }
                current.families.push(FamilyPhase {
                    family: line.field("family").unwrap_or_default().to_owned(),
                    render: line.duration("render"),
                    restore: None,
                    rules_written: line.number("rules_written"),
                    bytes: line.number("bytes"),
                });
            }
            APPLIED => {
                let family = line.field("family").unwrap_or_default();
                if let Some(phase) = current
                    .families
                    .iter_mut()
                    .rev()
                    .find(|f| f.family == family)
                {
                    phase.restore = line.duration("restore");
                }
            }
            NFT_APPLIED => {
                if let Some(kind) = kind {
                    current.kind = kind;
                }
                current.families.push(FamilyPhase {
                    family: line.field("family").unwrap_or_default().to_owned(),
                    render: line.duration("render"),
                    restore: line.duration("took"),
                    rules_written: line.number("operations"),
                    bytes: line.number("bytes"),
                });
            }
            NFT_SYNC => current.backend_total = line.duration("took"),
            PREPARED => {
                add(&mut current.setup, line.duration("setup"));
                add(&mut current.save, line.duration("save"));
            }
            CONNTRACK => current.conntrack = line.duration("took"),
            BACKEND_SYNC => current.backend_total = line.duration("took"),
            SYNCED => {
                if let Some(kind) = kind {
                    current.kind = kind;
                }
                current.apply = line.duration("apply");
                current.backend = line.duration("backend");
                current.rules = line.number("rules");
                current.changed = line.number("changed");
                current.complete = true;
                self.completed.push(std::mem::take(current));
                return self.completed.last();
            }
            FIRST_SYNC => {
                self.first_sync = Some((line.duration("took"), line.duration("since_start")));
            }
            _ => {}
        }
        None
    }

    /// The sync in progress (phases seen, not completed yet).
    pub fn in_progress(&self) -> &SyncPhases {
        &self.current
    }
}

fn add(total: &mut Option<Duration>, value: Option<Duration>) {
    if let Some(value) = value {
        *total.get_or_insert(Duration::ZERO) += value;
    }
}

/// The self-healing checks a run logged ([`CHECKED`]), in log order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checks {
    /// The short-period checks (every canary period, where nothing notifies).
    pub canary: Vec<Duration>,
    /// The checks before periodic syncs (and of changes a watcher could not attribute).
    pub thorough: Vec<Duration>,
}

impl Checks {
    /// Feed one line; a check line adds its `took`.
    pub fn feed(&mut self, line: &LogLine) {
        if line.message != CHECKED {
            return;
        }
        let Some(took) = line.duration("took") else {
            return;
        };
        match line.field("check") {
            Some("Canary") => self.canary.push(took),
            Some("Thorough") => self.thorough.push(took),
            _ => {}
        }
    }
}

/// The median of `values` (the upper one of an even count).
pub fn median(values: &[Duration]) -> Option<Duration> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted.get(sorted.len() / 2).copied()
}

#[cfg(test)]
mod checks_tests {
    use super::*;

    #[test]
    fn check_lines_are_told_apart_by_depth() {
        let mut checks = Checks::default();
        for line in [
            r#"I1128 10:00:00.000001    1 proxier.rs:433] checked the rules in the kernel check="Canary" took="61.2ms" found="0""#,
            r#"I1128 10:00:02.000001    1 proxier.rs:433] checked the rules in the kernel check="Thorough" took="4.24s" found="0""#,
            r#"I1128 10:00:04.000001    1 proxier.rs:433] checked the rules in the kernel check="Canary" took="58ms" found="1""#,
            r#"I1128 10:00:04.000001    1 proxier.rs:500] synced proxy rules kind="Full" took="1s""#,
        ] {
            checks.feed(&LogLine::parse(line).expect("parses"));
        }
        let ms = |n: f64| Duration::from_secs_f64(n / 1e3);
        assert_eq!(checks.canary, [ms(61.2), ms(58.0)]);
        assert_eq!(checks.thorough, [ms(4240.0)]);
        assert_eq!(median(&checks.canary), Some(ms(61.2)));
        assert_eq!(median(&[]), None);
    }
}
