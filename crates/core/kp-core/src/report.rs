//! Printing an error with its causes. Every error type of the workspace follows one rule: its
//! message says what failed without the cause, and the cause is its `source()`. So the one
//! place that prints the whole story is [`Chain`], used by the binary's exit (`main`,
//! `--cleanup`) and by every log line that carries an error: each cause appears once.
//! Crates outside the workspace (kube-rs among them) often put the cause in their message
//! too: a cause the text already ends with is not printed again.

use std::error::Error;
use std::fmt;

/// An error and its causes, outermost first, joined by `": "`.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(error) = cause {
            let next = error.to_string();
            if !text.ends_with(&next) {
                text.push_str(": ");
                text.push_str(&next);
            }
            cause = error.source();
        }
        f.write_str(&text)
    }
}

/// `error.chain()` for any error: the [`Chain`] to print.
pub trait ErrorChain {
    /// The error and its causes, for `Display`.
    fn chain(&self) -> Chain<'_>;
}

impl<E: Error + 'static> ErrorChain for E {
    fn chain(&self) -> Chain<'_> {
        Chain(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("reading {path}")]
        Read {
            path: &'static str,
            #[source]
            source: std::io::Error,
        },
    }

    /// As kube-rs' errors: the cause in the message and in `source()`.
    #[derive(Debug, thiserror::Error)]
    #[error("HyperError: {0}")]
    struct Quoting(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("building a client")]
    struct Wrapping(#[source] Quoting);

    #[test]
    fn a_cause_a_foreign_message_already_quotes_is_not_repeated() {
        let error = Wrapping(Quoting(std::io::Error::other("connection refused")));
        assert_eq!(
            error.chain().to_string(),
            "building a client: HyperError: connection refused"
        );
    }

    #[test]
    fn each_cause_is_printed_once_outermost_first() {
        let error = Outer::Read {
            path: "/etc/kube-proxy.yaml",
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        };
        assert_eq!(
            error.chain().to_string(),
            "reading /etc/kube-proxy.yaml: no such file"
        );
    }
}
