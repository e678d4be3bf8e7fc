//! `/metrics` in the Prometheus protobuf exposition (`io.prometheus.client.MetricFamily`,
//! length-delimited), which a scraper asks for in its `Accept` header: the only format that
//! carries native histograms (`NativeHistograms`, upstream 1.36, KEP-5808), as client_golang
//! serves it. The families come from the registry's text exposition (prometheus-client
//! encodes no other format), re-read here, so both formats show the same samples; histograms
//! listed in [`NativeHistograms`] get their native fields beside the classic buckets.
//!
//! The encoder writes the few messages of `metrics.proto` (proto2) by field number: enough
//! for counters, gauges, info (as a gauge, `_info`), unknown (untyped) and histograms.

use kp_core::metrics::native::{NativeHistograms, Sparse, ZERO_THRESHOLD, spans_and_deltas};

/// The content type of the delimited protobuf exposition.
pub const PROTOBUF_CONTENT_TYPE: &str =
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited";

/// Why the text exposition could not be read back.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtobufError {
    /// A sample line that is not `name{labels} value`.
    #[error("cannot read metrics line {line}")]
    Sample {
        /// The line number (from 1).
        line: usize,
    },
}

/// Whether an `Accept` header asks for the delimited MetricFamily protobuf (as Prometheus
/// sends it, with other formats after it).
pub fn accepts_protobuf(accept: &str) -> bool {
    accept.split(',').any(|media| {
        let mut parts = media.split(';').map(str::trim);
        parts.next() == Some("application/vnd.google.protobuf") && {
            let params: Vec<&str> = parts.collect();
            params.contains(&"proto=io.prometheus.client.MetricFamily")
                && params.contains(&"encoding=delimited")
        }
    })
}

/// `text` (OpenMetrics, as prometheus-client writes it) as delimited MetricFamily messages,
/// with the native buckets of `native`'s histograms.
pub fn encode(text: &str, native: &NativeHistograms) -> Result<Vec<u8>, ProtobufError> {
    let families = parse(text)?;
    let mut out = Vec::new();
    for family in &families {
        let message = family_message(family, native);
        put_varint(&mut out, message.len() as u64);
        out.extend_from_slice(&message);
    }
    Ok(out)
}

/// One family read from the text: its name in the protobuf (counters with `_total`).
#[derive(Debug, Default, PartialEq)]
struct Family {
    name: String,
    help: String,
    kind: Kind,
    metrics: Vec<Metric>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
    #[default]
    Untyped,
}

/// One series (for a histogram: all its samples of one label set).
#[derive(Debug, Default, PartialEq)]
struct Metric {
    labels: Vec<(String, String)>,
    value: f64,
    count: u64,
    sum: f64,
    /// `(upper bound, cumulative count)`, without `+Inf` (the count), as client_golang.
    buckets: Vec<(f64, u64)>,
}

fn parse(text: &str) -> Result<Vec<Family>, ProtobufError> {
    let mut families: Vec<Family> = Vec::new();
    let mut base = String::new();
    for (number, line) in text.lines().enumerate() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            base = name.to_owned();
            families.push(Family {
                name: name.to_owned(),
                help: unescape(help),
                ..Family::default()
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if families.last().is_none_or(|f| f.name != name) {
                base = name.to_owned();
                families.push(Family {
                    name: name.to_owned(),
                    ..Family::default()
                });
            }
            if let Some(family) = families.last_mut() {
                (family.kind, family.name) = match kind {
                    "counter" => (Kind::Counter, format!("{name}_total")),
                    "gauge" => (Kind::Gauge, name.to_owned()),
                    "info" => (Kind::Gauge, format!("{name}_info")),
                    "histogram" => (Kind::Histogram, name.to_owned()),
                    _ => (Kind::Untyped, name.to_owned()),
                };
            }
        } else if line.starts_with('#') || line.is_empty() {
            continue;
        } else {
            let family = families
                .last_mut()
                .ok_or(ProtobufError::Sample { line: number + 1 })?;
            let sample = sample(line).ok_or(ProtobufError::Sample { line: number + 1 })?;
            add_sample(family, &base, sample);
        }
    }
    Ok(families)
}

/// `(suffix after the family's base name, labels, value)` of one sample line.
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

fn sample(line: &str) -> Option<Sample> {
    // Exemplars (` # {...}`) are not carried.
    let line = line.split(" # ").next()?;
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            (
                &line[..open],
                labels(&line[open + 1..close])?,
                &line[close + 1..],
            )
        }
        None => {
            let (name, rest) = line.split_once(' ')?;
            (name, Vec::new(), rest)
        }
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        other => other.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// `a="x",b="y\"z"` as pairs, values unescaped.
fn labels(text: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"")?;
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (_, c) => value.push(c),
            }
        };
        out.push((name.trim_start_matches(',').to_owned(), value));
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

fn unescape(text: &str) -> String {
    text.replace("\\n", "\n")
        .replace("\\\"", "\"")
        .replace("\\\\", "\\")
}

fn add_sample(family: &mut Family, base: &str, sample: Sample) {
    let suffix = sample.name.strip_prefix(base).unwrap_or("");
    if family.kind != Kind::Histogram {
        if suffix == "_created" {
            return;
        }
        family.metrics.push(Metric {
            labels: sample.labels,
            value: sample.value,
            ..Metric::default()
        });
        return;
    }
    let mut labels = sample.labels;
    let le = labels
        .iter()
        .position(|(name, _)| name == "le")
        .map(|at| labels.remove(at).1);
    let metric = match family.metrics.iter().position(|m| m.labels == labels) {
        Some(at) => &mut family.metrics[at],
        None => {
            family.metrics.push(Metric {
                labels,
                ..Metric::default()
            });
            let last = family.metrics.len() - 1;
            &mut family.metrics[last]
        }
    };
    match (suffix, le) {
        ("_bucket", Some(le)) if le != "+Inf" => {
            if let Ok(bound) = le.parse() {
                metric.buckets.push((bound, sample.value as u64));
            }
        }
        ("_count", _) => metric.count = sample.value as u64,
        ("_sum", _) => metric.sum = sample.value,
        _ => {}
    }
}

fn family_message(family: &Family, native: &NativeHistograms) -> Vec<u8> {
    let mut out = Vec::new();
    put_bytes(&mut out, 1, family.name.as_bytes());
    put_bytes(&mut out, 2, family.help.as_bytes());
    let kind = match family.kind {
        Kind::Counter => 0,
        Kind::Gauge => 1,
        Kind::Untyped => 3,
        Kind::Histogram => 4,
    };
    put_tag(&mut out, 3, 0);
    put_varint(&mut out, kind);
    let sparse = native.snapshot(&family.name);
    for metric in &family.metrics {
        let sparse = sparse.as_ref().filter(|_| metric.labels.is_empty());
        put_bytes(&mut out, 4, &metric_message(family.kind, metric, sparse));
    }
    out
}

fn metric_message(kind: Kind, metric: &Metric, sparse: Option<&Sparse>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in &metric.labels {
        let mut pair = Vec::new();
        put_bytes(&mut pair, 1, name.as_bytes());
        put_bytes(&mut pair, 2, value.as_bytes());
        put_bytes(&mut out, 1, &pair);
    }
    let (field, body) = match kind {
        Kind::Counter => (3, double_message(metric.value)),
        Kind::Gauge => (2, double_message(metric.value)),
        Kind::Untyped => (5, double_message(metric.value)),
        Kind::Histogram => (7, histogram_message(metric, sparse)),
    };
    put_bytes(&mut out, field, &body);
    out
}

/// `Counter`, `Gauge` and `Untyped`: `value = 1`.
fn double_message(value: f64) -> Vec<u8> {
    let mut out = Vec::new();
    put_double(&mut out, 1, value);
    out
}

fn histogram_message(metric: &Metric, sparse: Option<&Sparse>) -> Vec<u8> {
    let mut out = Vec::new();
    put_tag(&mut out, 1, 0);
    put_varint(&mut out, metric.count);
    put_double(&mut out, 2, metric.sum);
    for (bound, count) in &metric.buckets {
        let mut bucket = Vec::new();
        put_tag(&mut bucket, 1, 0);
        put_varint(&mut bucket, *count);
        put_double(&mut bucket, 2, *bound);
        put_bytes(&mut out, 3, &bucket);
    }
    let Some(sparse) = sparse else {
        return out;
    };
    put_tag(&mut out, 5, 0);
    put_varint(&mut out, zigzag(i64::from(sparse.schema)));
    put_double(&mut out, 6, ZERO_THRESHOLD);
    put_tag(&mut out, 7, 0);
    put_varint(&mut out, sparse.zero_count);
    let (mut positive_spans, positive_deltas) = spans_and_deltas(&sparse.positive);
    let (negative_spans, negative_deltas) = spans_and_deltas(&sparse.negative);
    if positive_spans.is_empty() && negative_spans.is_empty() && sparse.zero_count == 0 {
        // As client_golang: an empty span marks a native histogram without observations.
        positive_spans.push(kp_core::metrics::native::Span {
            offset: 0,
            length: 0,
        });
    }
    for (span_field, delta_field, spans, deltas) in [
        (9, 10, &negative_spans, &negative_deltas),
        (12, 13, &positive_spans, &positive_deltas),
    ] {
        for span in spans {
            let mut message = Vec::new();
            put_tag(&mut message, 1, 0);
            put_varint(&mut message, zigzag(i64::from(span.offset)));
            put_tag(&mut message, 2, 0);
            put_varint(&mut message, u64::from(span.length));
            put_bytes(&mut out, span_field, &message);
        }
        for delta in deltas {
            put_tag(&mut out, delta_field, 0);
            put_varint(&mut out, zigzag(*delta));
        }
    }
    out
}

fn zigzag(value: i64) -> u64 {
    ((value << 1) ^ (value >> 63)) as u64
}

fn put_tag(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_tag(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn put_double(out: &mut Vec<u8>, field: u32, value: f64) {
    put_tag(out, field, 1);
    out.extend_from_slice(&value.to_le_bytes());
}

#[cfg(test)]
mod tests;
