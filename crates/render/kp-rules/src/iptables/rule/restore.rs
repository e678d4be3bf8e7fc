//! The sinks rules go to ([`super::RuleSink`]): a restore input kept as values
//! ([`Restore`], [`TableRestore`], [`Entry`]) or written as text straight into buffers
//! ([`RestoreText`], and the head and tail of a streamed restore).

use std::fmt;

use super::Table;
use super::{Rule, RuleSink};

/// One entry after a table's chain declarations.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `-A ...`.
    Rule(Rule<'static>),
    /// `-X CHAIN`.
    DeleteChain(String),
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Rule(rule) => write!(f, "{rule}"),
            Entry::DeleteChain(chain) => write!(f, "-X {chain}"),
        }
    }
}

/// One table's part of a restore: chain declarations, then rules and deletions in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableRestore {
    /// The table.
    pub table: Table,
    /// Declared (created or flushed) chains, in order.
    pub chains: Vec<String>,
    /// Everything after the declarations, in order.
    pub entries: Vec<Entry>,
}

impl fmt::Display for TableRestore {
    /// `*table`, the `:CHAIN - [0:0]` lines, the entries, `COMMIT`, each line ending in `\n`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "*{}", self.table.as_str())?;
        for chain in &self.chains {
            writeln!(f, ":{chain} - [0:0]")?;
        }
        for entry in &self.entries {
            writeln!(f, "{entry}")?;
        }
        f.write_str("COMMIT\n")
    }
}

/// A whole restore input as typed values: a [`RuleSink`] that keeps everything, tables in the
/// order they were first used. `Display` gives the `iptables-restore` text.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Restore {
    /// The tables, in order of first use.
    pub tables: Vec<TableRestore>,
}

impl Restore {
    /// The part for `table`, added at the end when new.
    fn table(&mut self, table: Table) -> &mut TableRestore {
        let at = match self.tables.iter().position(|t| t.table == table) {
            Some(at) => at,
            None => {
                self.tables.push(TableRestore {
                    table,
                    chains: Vec::new(),
                    entries: Vec::new(),
                });
                self.tables.len() - 1
            }
        };
        &mut self.tables[at]
    }

    /// Every rule of every table, with its table.
    pub fn rules(&self) -> impl Iterator<Item = (Table, &Rule<'static>)> {
        self.tables.iter().flat_map(|t| {
            t.entries.iter().filter_map(move |entry| match entry {
                Entry::Rule(rule) => Some((t.table, rule)),
                Entry::DeleteChain(_) => None,
            })
        })
    }
}

impl RuleSink for Restore {
    fn chain(&mut self, table: Table, chain: &str) {
        self.table(table).chains.push(chain.to_owned());
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        self.table(table)
            .entries
            .push(Entry::Rule(rule.into_owned()));
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        self.table(table)
            .entries
            .push(Entry::DeleteChain(chain.to_owned()));
    }
}

impl fmt::Display for Restore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for table in &self.tables {
            write!(f, "{table}")?;
        }
        Ok(())
    }
}

/// A [`RuleSink`] that formats straight into restore text (no typed rule is kept): what the
/// `iptables-restore` backend applies. Same text as [`Restore`]'s `Display`.
#[derive(Debug, Default)]
pub struct RestoreText {
    /// Per table in order of first use: `(table, chain lines, rule lines)`.
    tables: Vec<(Table, String, String)>,
}

impl RestoreText {
    fn table(&mut self, table: Table) -> &mut (Table, String, String) {
        let at = match self.tables.iter().position(|t| t.0 == table) {
            Some(at) => at,
            None => {
                self.tables.push((table, String::new(), String::new()));
                self.tables.len() - 1
            }
        };
        &mut self.tables[at]
    }

    /// The restore input.
    pub fn finish(self) -> String {
        let len = self
            .tables
            .iter()
            .map(|(_, chains, rules)| chains.len() + rules.len() + 24)
            .sum();
        let mut text = String::with_capacity(len);
        for (table, chains, rules) in &self.tables {
            text.push('*');
            text.push_str(table.as_str());
            text.push('\n');
            text.push_str(chains);
            text.push_str(rules);
            text.push_str("COMMIT\n");
        }
        text
    }
}

impl RestoreText {
    /// Whether `table` is the last table used (so its rules end the input).
    pub(crate) fn ends_with(&self, table: Table) -> bool {
        self.tables.last().is_some_and(|t| t.0 == table)
    }

    /// The input up to where the last table's rules go: every table before it whole, then
    /// its header and chain declarations and whatever rules it holds, without `COMMIT`.
    pub(crate) fn write_open<W: std::io::Write + ?Sized>(
        &self,
        out: &mut W,
    ) -> std::io::Result<()> {
        let last = self.tables.len().saturating_sub(1);
        for (at, (table, chains, rules)) in self.tables.iter().enumerate() {
            out.write_all(b"*")?;
            out.write_all(table.as_str().as_bytes())?;
            out.write_all(b"\n")?;
            out.write_all(chains.as_bytes())?;
            out.write_all(rules.as_bytes())?;
            if at != last {
                out.write_all(b"COMMIT\n")?;
            }
        }
        Ok(())
    }
}

/// The first pass of [`crate::iptables::render_to`]: a [`RestoreText`] that keeps everything but the
/// rules and deletions of `streamed` (the big nat table), which the second pass writes.
#[derive(Debug)]
pub(crate) struct RestoreHead {
    /// The table left out.
    pub(crate) streamed: Table,
    /// Everything else.
    pub(crate) text: RestoreText,
}

impl RuleSink for RestoreHead {
    fn chain(&mut self, table: Table, chain: &str) {
        self.text.chain(table, chain);
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if table != self.streamed {
            self.text.rule(table, rule);
        }
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        if table != self.streamed {
            self.text.delete_chain(table, chain);
        }
    }
}

/// The second pass of [`crate::iptables::render_to`]: the rule and deletion lines of `table`, written
/// to `out` as they come (one line formatted at a time); everything else is ignored. Keeps
/// the first write error and writes nothing after it.
pub(crate) struct RestoreTail<'w, W: std::io::Write + ?Sized> {
    /// The table written.
    pub(crate) table: Table,
    /// Where the lines go.
    pub(crate) out: &'w mut W,
    /// The line being formatted (reused).
    pub(crate) line: String,
    /// The first write error.
    pub(crate) error: Option<std::io::Error>,
}

impl<W: std::io::Write + ?Sized> RestoreTail<'_, W> {
    fn emit(&mut self) {
        if self.error.is_none()
            && let Err(err) = self.out.write_all(self.line.as_bytes())
        {
            self.error = Some(err);
        }
    }
}

impl<W: std::io::Write + ?Sized> RuleSink for RestoreTail<'_, W> {
    fn chain(&mut self, _table: Table, _chain: &str) {}

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        if table != self.table || self.error.is_some() {
            return;
        }
        self.line.clear();
        // Writing into a String cannot fail.
        let _ = rule.write(&mut self.line);
        self.line.push('\n');
        self.emit();
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        if table != self.table || self.error.is_some() {
            return;
        }
        self.line.clear();
        self.line.push_str("-X ");
        self.line.push_str(chain);
        self.line.push('\n');
        self.emit();
    }
}

impl RuleSink for RestoreText {
    fn chain(&mut self, table: Table, chain: &str) {
        let chains = &mut self.table(table).1;
        chains.push(':');
        chains.push_str(chain);
        chains.push_str(" - [0:0]\n");
    }

    fn rule(&mut self, table: Table, rule: Rule<'_>) {
        let rules = &mut self.table(table).2;
        // Writing into a String cannot fail.
        let _ = rule.write(rules);
        rules.push('\n');
    }

    fn delete_chain(&mut self, table: Table, chain: &str) {
        let rules = &mut self.table(table).2;
        rules.push_str("-X ");
        rules.push_str(chain);
        rules.push('\n');
    }
}
