//! Logs in klog's shape, so operators' log tooling keeps working:
//!
//! ```text
//! I1122 08:09:44.313052       1 proxier.rs:185] "Using iptables Proxier" mode="iptables"
//! ```
//!
//! Severity letter, month and day, wall time with microseconds (UTC), the process id padded to
//! seven columns, source file and line, then the message and `key="value"` pairs. Verbosity
//! follows klog's `-v`: 0 and 1 show info and above, 2 and 3 add debug, 4 and more add trace.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// Formats tracing events as klog lines.
#[derive(Debug, Default)]
pub struct KlogFormat;

/// The tracing level that klog's `-v=N` enables.
pub fn level_for_verbosity(v: i32) -> Level {
    match v {
        i32::MIN..=1 => Level::INFO,
        2..=3 => Level::DEBUG,
        _ => Level::TRACE,
    }
}

/// Install the klog formatter on stderr at the level `-v` asks for.
pub fn init(verbosity: i32) {
    let level = level_for_verbosity(verbosity);
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .event_format(KlogFormat)
        .finish();
    // A second init (tests) keeps the first subscriber.
    let _ = tracing::subscriber::set_global_default(subscriber);
}

fn severity(level: &Level) -> char {
    match *level {
        Level::ERROR => 'E',
        Level::WARN => 'W',
        _ => 'I',
    }
}

/// Writes the klog header for `level` at `now` from `file:line`.
fn header(out: &mut String, level: &Level, now: jiff::Timestamp, file: &str, line: u32) {
    let dt = now.to_zoned(jiff::tz::TimeZone::UTC).datetime();
    let file = file.rsplit('/').next().unwrap_or(file);
    let _ = write!(
        out,
        "{}{:02}{:02} {:02}:{:02}:{:02}.{:06} {:>7} {}:{}] ",
        severity(level),
        dt.month(),
        dt.day(),
        dt.hour(),
        dt.minute(),
        dt.second(),
        dt.subsec_nanosecond() / 1000,
        std::process::id(),
        file,
        line
    );
}

/// Collects the message and the structured fields of an event.
#[derive(Default)]
struct Fields {
    message: String,
    pairs: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.pairs, " {}={:?}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            // klog quotes every value; Debug of a Display-wrapped value would not be quoted.
            let rendered = format!("{value:?}");
            if rendered.starts_with('"') {
                let _ = write!(self.pairs, " {}={}", field.name(), rendered);
            } else {
                let _ = write!(self.pairs, " {}={:?}", field.name(), rendered);
            }
        }
    }
}

impl<S, N> FormatEvent<S, N> for KlogFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = String::with_capacity(160);
        header(
            &mut line,
            meta.level(),
            jiff::Timestamp::now(),
            meta.file().unwrap_or("?"),
            meta.line().unwrap_or(0),
        );
        let mut fields = Fields::default();
        event.record(&mut fields);
        // Messages may interpolate object names; a newline there would forge a log line of
        // its own. Field values are already quoted (escaped) above.
        for c in fields.message.chars() {
            if c.is_control() {
                line.extend(c.escape_default());
            } else {
                line.push(c);
            }
        }
        line.push_str(&fields.pairs);
        writeln!(writer, "{line}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_has_klog_shape() {
        let ts: jiff::Timestamp = "2026-11-22T08:09:44.313052Z"
            .parse()
            .expect("valid timestamp");
        let mut out = String::new();
        header(
            &mut out,
            &Level::INFO,
            ts,
            "crates/core/kp-core/src/proxier.rs",
            185,
        );
        let expected = format!(
            "I1122 08:09:44.313052 {:>7} proxier.rs:185] ",
            std::process::id()
        );
        assert_eq!(out, expected);
        let mut out = String::new();
        header(&mut out, &Level::WARN, ts, "x.rs", 1);
        assert!(out.starts_with("W1122 "));
        let mut out = String::new();
        header(&mut out, &Level::ERROR, ts, "x.rs", 1);
        assert!(out.starts_with("E1122 "));
    }

    #[test]
    fn verbosity_maps_to_levels() {
        assert_eq!(level_for_verbosity(0), Level::INFO);
        assert_eq!(level_for_verbosity(1), Level::INFO);
        assert_eq!(level_for_verbosity(2), Level::DEBUG);
        assert_eq!(level_for_verbosity(4), Level::TRACE);
    }

    #[test]
    fn fields_are_quoted_pairs() {
        let text = capture(|| {
            tracing::info!(mode = "iptables", services = 3, "Using proxier");
        });
        assert!(text.starts_with('I'), "{text}");
        assert!(text.contains("log.rs:"), "{text}");
        assert!(
            text.trim_end()
                .ends_with(r#"] Using proxier mode="iptables" services="3""#),
            "{text}"
        );
    }

    #[test]
    fn every_event_is_one_line_whatever_it_interpolates() {
        let name = "web\nI1122 08:09:44.313052 1 forged.rs:1] all good\r";
        let text = capture(|| {
            tracing::warn!(service = name, "skipping {name}");
            tracing::warn!(error = %name, "skipping");
        });
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(text.contains(r"skipping web\nI1122"), "{text}");
    }

    /// What `events` log through [`KlogFormat`].
    fn capture(events: impl FnOnce()) -> String {
        use tracing_subscriber::layer::SubscriberExt as _;
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .event_format(KlogFormat)
                .with_writer(move || SinkWriter(sink.clone())),
        );
        tracing::subscriber::with_default(subscriber, events);
        String::from_utf8(buf.lock().map(|b| b.clone()).unwrap_or_default()).unwrap_or_default()
    }

    struct SinkWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for SinkWriter {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            if let Ok(mut b) = self.0.lock() {
                b.extend_from_slice(data);
            }
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
