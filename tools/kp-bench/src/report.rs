//! Markdown rows for the figures of a run.

use std::fmt::Write as _;
use std::time::Duration;

/// A measured duration, or why there is none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Figure {
    /// Measured.
    Took(Duration),
    /// Still running when the run gave up after this long.
    DidNotFinish(Duration),
    /// Not applicable or not measured.
    None,
}

impl Figure {
    /// From an optional duration.
    pub fn from_option(value: Option<Duration>) -> Self {
        value.map_or(Figure::None, Figure::Took)
    }
}

impl std::fmt::Display for Figure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Figure::Took(d) => f.write_str(&human(*d)),
            Figure::DidNotFinish(limit) => write!(f, "did not finish in {} s", limit.as_secs()),
            Figure::None => f.write_str("-"),
        }
    }
}

/// `1.23 s`, `45.6 ms`, `789 µs`.
pub fn human(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs >= 100.0 {
        format!("{secs:.0} s")
    } else if secs >= 1.0 {
        format!("{secs:.2} s")
    } else if secs >= 0.1 {
        format!("{:.0} ms", secs * 1e3)
    } else if secs >= 0.001 {
        format!("{:.1} ms", secs * 1e3)
    } else {
        format!("{:.0} µs", secs * 1e6)
    }
}

/// Bytes as MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A markdown table: header, separator, rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    /// Column names.
    pub header: Vec<String>,
    /// Cells per row.
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns.
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row (missing cells print as `-`).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The header and separator lines.
    pub fn head(&self) -> String {
        let mut out = String::new();
        line(&mut out, &self.header);
        let sep: Vec<String> = self.header.iter().map(|_| "---".to_owned()).collect();
        line(&mut out, &sep);
        out
    }

    /// The rows only.
    pub fn body(&self) -> String {
        let mut out = String::new();
        for row in &self.rows {
            let mut cells = row.clone();
            cells.resize(self.header.len(), "-".to_owned());
            line(&mut out, &cells);
        }
        out
    }

    /// Header, separator and rows.
    pub fn render(&self) -> String {
        self.head() + &self.body()
    }
}

fn line(out: &mut String, cells: &[String]) {
    out.push('|');
    for cell in cells {
        let _ = write!(out, " {} |", cell.replace('|', "\\|"));
    }
    out.push('\n');
}
