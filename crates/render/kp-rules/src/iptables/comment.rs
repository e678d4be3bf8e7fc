//! Rule comments: the only place text from API objects (namespaces, names, port names) ends up.
//!
//! The API server validates those names, so upstream just wraps comments in double quotes. We
//! do not trust that: a Service named `a" -j ACCEPT` or one containing a newline must never
//! add a match, a target or a line to the restore input. Every comment is therefore
//! percent-encoded before it is quoted:
//!
//! - bytes `0x20..=0x7e` other than `"`, `'`, `\`, `` ` `` and `%` are kept as they are;
//! - every other byte (controls such as `\n` and `\r`, DEL, the quote characters, the
//!   backslash, the percent sign itself, and each byte of a non-ASCII character) becomes
//!   `%XX` with upper-case hex digits.
//!
//! The encoding is deterministic and injective (`%` is encoded too, so distinct names give
//! distinct comments), leaves every valid Kubernetes name unchanged, and produces only
//! characters that `iptables-restore` copies literally inside a quoted argument, whatever
//! its version does with backslash escapes. Comments longer than the kernel's limit are cut at
//! a character boundary (never inside a `%XX`).

/// `xt_comment` stores at most 256 bytes including the terminating NUL; `iptables` rejects
/// longer comments, so a longer one would fail the whole restore.
pub const MAX_COMMENT_BYTES: usize = 255;

/// Whether `byte` may appear literally in a quoted comment.
fn is_literal(byte: u8) -> bool {
    matches!(byte, 0x20..=0x7e) && !matches!(byte, b'"' | b'\'' | b'\\' | b'`' | b'%')
}

/// The comment text, percent-encoded as described in the module docs and cut to
/// [`MAX_COMMENT_BYTES`]. Does not add the surrounding quotes.
pub fn sanitize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut writer = Sanitizer::new(&mut out);
    let _ = std::fmt::Write::write_str(&mut writer, text);
    out
}

/// `-m comment --comment "<sanitized text>"`, ready to be placed in a rule.
pub fn comment_args(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 24);
    write_comment_args(&mut out, text);
    out
}

/// Appends `-m comment --comment "<sanitized text>"` to `out`, formatting `text` straight
/// into the encoder (no intermediate string).
pub(crate) fn write_comment_args(out: &mut String, text: impl std::fmt::Display) {
    out.push_str("-m comment --comment \"");
    // Writing into a String cannot fail.
    let _ = write_sanitized(out, text);
    out.push('"');
}

/// Writes `text` percent-encoded and cut to [`MAX_COMMENT_BYTES`] into `out`, formatting it
/// straight into the encoder (no intermediate string).
pub(crate) fn write_sanitized<W: std::fmt::Write + ?Sized>(
    out: &mut W,
    text: impl std::fmt::Display,
) -> std::fmt::Result {
    let mut writer = Sanitizer::new(out);
    std::fmt::Write::write_fmt(&mut writer, format_args!("{text}"))
}

/// A `fmt::Write` that percent-encodes into `out` and stops at [`MAX_COMMENT_BYTES`]
/// encoded bytes (the first piece that does not fit ends the comment).
pub(crate) struct Sanitizer<'a, W: ?Sized> {
    out: &'a mut W,
    len: usize,
    done: bool,
}

impl<'a, W: std::fmt::Write + ?Sized> Sanitizer<'a, W> {
    pub(crate) fn new(out: &'a mut W) -> Self {
        Self {
            out,
            len: 0,
            done: false,
        }
    }
}

impl<W: std::fmt::Write + ?Sized> std::fmt::Write for Sanitizer<'_, W> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        // Runs of literal bytes are written as one slice: the writer may be a formatter.
        let mut run = 0;
        for (at, byte) in text.bytes().enumerate() {
            let piece_len = if is_literal(byte) { 1 } else { 3 };
            if self.done || self.len + piece_len > MAX_COMMENT_BYTES {
                self.done = true;
                return write_run(self.out, text, run, at);
            }
            self.len += piece_len;
            if !is_literal(byte) {
                write_run(self.out, text, run, at)?;
                let escape = [
                    b'%',
                    HEX[usize::from(byte >> 4)],
                    HEX[usize::from(byte & 0x0f)],
                ];
                // Three ASCII bytes.
                self.out
                    .write_str(std::str::from_utf8(&escape).map_err(|_| std::fmt::Error)?)?;
                run = at + 1;
            }
        }
        write_run(self.out, text, run, text.len())
    }
}

/// Writes the literal bytes `text[run..at]`, if any. A non-empty run is ASCII and follows a
/// non-literal byte or the start, so both ends are char boundaries; an empty one may sit
/// inside a multi-byte character and is not sliced.
fn write_run<W: std::fmt::Write + ?Sized>(
    out: &mut W,
    text: &str,
    run: usize,
    at: usize,
) -> std::fmt::Result {
    match text.get(run..at) {
        Some(literal) if run < at => out.write_str(literal),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_kubernetes_names_are_unchanged() {
        assert_eq!(
            sanitize("ns1/svc1:p80 cluster IP"),
            "ns1/svc1:p80 cluster IP"
        );
        assert_eq!(
            sanitize("kube-system/kube-dns:dns-tcp -> 10.244.0.3:53"),
            "kube-system/kube-dns:dns-tcp -> 10.244.0.3:53"
        );
        assert_eq!(sanitize("ns/svc -> [fd00::1]:80"), "ns/svc -> [fd00::1]:80");
    }

    #[test]
    fn quote_injection_is_neutralised() {
        let hostile = "a\" -j ACCEPT";
        let out = comment_args(hostile);
        assert_eq!(out, "-m comment --comment \"a%22 -j ACCEPT\"");
        // Exactly the two delimiting quotes remain.
        assert_eq!(out.matches('"').count(), 2);
    }

    #[test]
    fn newlines_and_controls_cannot_start_a_new_line() {
        let out = sanitize("x\n-A KUBE-SERVICES -j ACCEPT\r\n\t\0\x7f");
        assert_eq!(out, "x%0A-A KUBE-SERVICES -j ACCEPT%0D%0A%09%00%7F");
        assert!(!out.contains(['\n', '\r', '\t', '\0']));
    }

    #[test]
    fn backslashes_single_quotes_backticks_and_percent_are_encoded() {
        assert_eq!(sanitize(r#"\" ' ` %"#), "%5C%22 %27 %60 %25");
    }

    #[test]
    fn encoding_is_injective_for_percent_lookalikes() {
        assert_ne!(sanitize("%22"), sanitize("\""));
        assert_eq!(sanitize("%22"), "%2522");
    }

    #[test]
    fn non_ascii_is_encoded_per_byte() {
        assert_eq!(sanitize("é"), "%C3%A9");
    }

    #[test]
    fn long_comments_are_cut_without_splitting_an_escape() {
        let long = "a".repeat(300);
        assert_eq!(sanitize(&long).len(), MAX_COMMENT_BYTES);

        // 254 literal bytes leave room for one more literal, not for a 3-byte escape.
        let edge = format!("{}\"\"", "b".repeat(253));
        let out = sanitize(&edge);
        assert_eq!(out, "b".repeat(253));
        assert!(out.len() <= MAX_COMMENT_BYTES);

        let all_escapes = "\n".repeat(200);
        let out = sanitize(&all_escapes);
        assert_eq!(out.len(), 85 * 3);
        assert!(out.len() <= MAX_COMMENT_BYTES);
    }
}
