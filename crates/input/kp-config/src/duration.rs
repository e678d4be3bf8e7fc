//! Go `time.Duration` text (`30s`, `1m0s`, `1h30m`, `500ms`).
//!
//! KubeProxyConfiguration files and upstream's flags spell intervals the way Go's
//! `time.ParseDuration` reads them and `Duration.String()` writes them, so we accept and
//! produce exactly that syntax. Negative values are rejected: no kube-proxy interval has a
//! meaning below zero.

use std::fmt::Write as _;
use std::time::Duration;

/// Why a duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// The input was empty (Go rejects `""` as well).
    #[error("empty duration")]
    Empty,
    /// A leading minus sign with a non-zero amount.
    #[error("duration {0:?} is negative")]
    Negative(String),
    /// A number with no unit after it; only a bare `0` may omit the unit.
    #[error("missing unit in duration {0:?} (valid units are ns, us, ms, s, m, h)")]
    MissingUnit(String),
    /// A unit other than `ns`, `us`/`µs`, `ms`, `s`, `m`, `h`.
    #[error("unknown unit {unit:?} in duration {input:?} (valid units are ns, us, ms, s, m, h)")]
    UnknownUnit {
        /// The unit as written.
        unit: String,
        /// The whole input.
        input: String,
    },
    /// Not a sequence of `[-+]N[.F]unit` terms.
    #[error("invalid duration {0:?}")]
    Malformed(String),
    /// More than Go's limit of 2^63-1 nanoseconds (about 292 years).
    #[error("duration {0:?} is too large")]
    Overflow(String),
}

/// Go's `time.Duration` is an `int64` of nanoseconds; values beyond it do not exist upstream.
const MAX_NANOS: u128 = i64::MAX as u128;

/// Fraction digits beyond this are below a nanosecond even for hours, so they are dropped.
const MAX_FRACTION_DIGITS: usize = 18;

/// Parses a Go duration such as `30s`, `1m0s`, `1.5h` or `2h45m10.5s`.
///
/// Like Go, a bare `0` needs no unit, fractions truncate to whole nanoseconds and both
/// `us` and `µs` mean microseconds.
pub fn parse(input: &str) -> Result<Duration, DurationError> {
    if input.is_empty() {
        return Err(DurationError::Empty);
    }
    let (negative, mut rest) = match input.as_bytes()[0] {
        b'-' => (true, &input[1..]),
        b'+' => (false, &input[1..]),
        _ => (false, input),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(DurationError::Malformed(input.to_owned()));
    }
    let overflow = || DurationError::Overflow(input.to_owned());
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let int_len = digits_prefix(rest);
        let (int_digits, after_int) = rest.split_at(int_len);
        let (frac_digits, after_number) = match after_int.strip_prefix('.') {
            Some(after_dot) => after_dot.split_at(digits_prefix(after_dot)),
            None => ("", after_int),
        };
        if int_digits.is_empty() && frac_digits.is_empty() {
            return Err(DurationError::Malformed(input.to_owned()));
        }
        let unit_len = after_number
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(after_number.len());
        let (unit, next) = after_number.split_at(unit_len);
        let unit_nanos: u128 = match unit {
            "" => return Err(DurationError::MissingUnit(input.to_owned())),
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            other => {
                return Err(DurationError::UnknownUnit {
                    unit: other.to_owned(),
                    input: input.to_owned(),
                });
            }
        };
        let whole = decimal_value(int_digits)
            .and_then(|n| n.checked_mul(unit_nanos))
            .ok_or_else(overflow)?;
        let kept = &frac_digits[..frac_digits.len().min(MAX_FRACTION_DIGITS)];
        let fraction = match decimal_value(kept) {
            Some(f) if !kept.is_empty() => f * unit_nanos / 10u128.pow(kept.len() as u32),
            _ => 0,
        };
        total = total
            .checked_add(whole + fraction)
            .filter(|t| *t <= MAX_NANOS)
            .ok_or_else(overflow)?;
        rest = next;
    }
    if negative && total > 0 {
        return Err(DurationError::Negative(input.to_owned()));
    }
    let nanos = u64::try_from(total).map_err(|_| overflow())?;
    Ok(Duration::from_nanos(nanos))
}

/// Length of the leading run of ASCII digits.
fn digits_prefix(s: &str) -> usize {
    s.bytes().take_while(u8::is_ascii_digit).count()
}

/// Value of a run of ASCII digits, `None` on overflow; the empty run is 0.
fn decimal_value(digits: &str) -> Option<u128> {
    digits.bytes().try_fold(0u128, |acc, d| {
        acc.checked_mul(10)?.checked_add(u128::from(d - b'0'))
    })
}

/// Formats like Go's `Duration.String()`: `0s`, `500ms`, `1.5µs`, `1m0s`, `24h0m0s`.
pub fn format(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".to_owned();
    }
    if nanos < 1_000 {
        return format!("{nanos}ns");
    }
    if nanos < 1_000_000 {
        return format!("{}\u{b5}s", fixed_point(nanos, 3));
    }
    if nanos < 1_000_000_000 {
        return format!("{}ms", fixed_point(nanos, 6));
    }
    let secs = d.as_secs();
    let (hours, minutes, seconds) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    if hours > 0 {
        let _ = write!(out, "{hours}h");
    }
    if hours > 0 || minutes > 0 {
        let _ = write!(out, "{minutes}m");
    }
    let subsec = u128::from(seconds) * 1_000_000_000 + u128::from(d.subsec_nanos());
    let _ = write!(out, "{}s", fixed_point(subsec, 9));
    out
}

/// `value / 10^scale` written in decimal without trailing fractional zeros.
fn fixed_point(value: u128, scale: u32) -> String {
    let divisor = 10u128.pow(scale);
    let (int, frac) = (value / divisor, value % divisor);
    if frac == 0 {
        return int.to_string();
    }
    let width = scale as usize;
    let frac = format!("{frac:0width$}");
    format!("{int}.{}", frac.trim_end_matches('0'))
}

/// Serde adapter for `Duration` fields written as Go duration strings.
///
/// Use with `#[serde(with = "kp_config::duration::serde_go")]`.
pub mod serde_go {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the duration in Go's canonical form (`1m0s`).
    pub fn serialize<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&super::format(*d))
    }

    /// Reads a Go duration string; malformed or negative values are errors.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    #[test]
    fn parses_go_durations() {
        let cases: &[(&str, u64)] = &[
            ("0", 0),
            ("0s", 0),
            ("-0s", 0),
            ("+5s", 5 * S),
            ("30s", 30 * S),
            ("1m0s", 60 * S),
            ("24h0m0s", 24 * 3600 * S),
            ("500ms", 500 * MS),
            ("1h30m", 90 * 60 * S),
            ("1.5h", 90 * 60 * S),
            ("2h45m10.5s", (2 * 3600 + 45 * 60 + 10) * S + 500 * MS),
            (".5s", 500 * MS),
            ("1.s", S),
            ("100ns", 100),
            ("3us", 3_000),
            ("3\u{b5}s", 3_000),
            ("3\u{3bc}s", 3_000),
            ("1.0000000001s", S),
            ("1s1s", 2 * S),
            ("0.000000001s", 1),
            ("2562047h47m16.854775807s", i64::MAX as u64),
        ];
        for (input, nanos) in cases {
            assert_eq!(
                parse(input),
                Ok(Duration::from_nanos(*nanos)),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn rejects_bad_durations() {
        let cases: &[(&str, DurationError)] = &[
            ("", DurationError::Empty),
            ("-1s", DurationError::Negative("-1s".into())),
            ("30", DurationError::MissingUnit("30".into())),
            ("1h30", DurationError::MissingUnit("1h30".into())),
            (
                "5x",
                DurationError::UnknownUnit {
                    unit: "x".into(),
                    input: "5x".into(),
                },
            ),
            (
                "5 s",
                DurationError::UnknownUnit {
                    unit: " s".into(),
                    input: "5 s".into(),
                },
            ),
            ("s", DurationError::Malformed("s".into())),
            (".s", DurationError::Malformed(".s".into())),
            ("-", DurationError::Malformed("-".into())),
            ("1.2.3s", DurationError::MissingUnit("1.2.3s".into())),
            (
                "2562047h47m16.854775808s",
                DurationError::Overflow("2562047h47m16.854775808s".into()),
            ),
            (
                "99999999999999999999999999999999999999999h",
                DurationError::Overflow("99999999999999999999999999999999999999999h".into()),
            ),
        ];
        for (input, want) in cases {
            assert_eq!(parse(input).as_ref(), Err(want), "input {input:?}");
        }
    }

    #[test]
    fn formats_like_go() {
        let cases: &[(u64, &str)] = &[
            (0, "0s"),
            (1, "1ns"),
            (999, "999ns"),
            (1_500, "1.5\u{b5}s"),
            (500 * MS, "500ms"),
            (1_500_000, "1.5ms"),
            (S, "1s"),
            (S + 500 * MS, "1.5s"),
            (30 * S, "30s"),
            (60 * S, "1m0s"),
            (90 * 60 * S, "1h30m0s"),
            (3600 * S, "1h0m0s"),
            (24 * 3600 * S, "24h0m0s"),
            ((2 * 3600 + 45 * 60 + 10) * S + 500 * MS, "2h45m10.5s"),
            (61 * S + 1, "1m1.000000001s"),
        ];
        for (nanos, want) in cases {
            assert_eq!(format(Duration::from_nanos(*nanos)), *want);
        }
    }

    #[test]
    fn format_then_parse_is_identity() {
        for nanos in [1, 1_234, 1_234_567, 59 * S, 3_601 * S + 7, 100 * 3600 * S] {
            let d = Duration::from_nanos(nanos);
            assert_eq!(parse(&format(d)), Ok(d));
        }
    }

    #[test]
    fn serde_adapter_round_trips_through_json() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct Holder {
            #[serde(with = "serde_go")]
            period: Duration,
        }
        let json = serde_json::to_string(&Holder {
            period: Duration::from_secs(60),
        })
        .map_err(|e| e.to_string());
        assert_eq!(json.as_deref(), Ok(r#"{"period":"1m0s"}"#));
        let back: Result<Holder, _> = serde_json::from_str(r#"{"period":"1h30m"}"#);
        assert_eq!(
            back.map_err(|e| e.to_string()),
            Ok(Holder {
                period: Duration::from_secs(5400)
            })
        );
        let bad = serde_json::from_str::<Holder>(r#"{"period":"-3s"}"#);
        assert!(bad.is_err_and(|e| e.to_string().contains("negative")));
    }
}
