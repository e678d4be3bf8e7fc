//! [`Comment`]: a rule's comment, built from the service's name and fixed text, sanitized
//! and quoted as kube-proxy writes it.

use std::borrow::Cow;
use std::fmt;
use std::net::SocketAddr;

use crate::iptables::comment::Sanitizer;

/// A rule comment, formatted only when the rule is written.
///
/// `Display` gives the raw text (names from API objects included as they are); a rule prints
/// it percent-encoded and quoted (see [`crate::iptables::comment`]), and [`Comment::sanitized`] is the
/// text the kernel stores (xt_comment, or the rule userdata under iptables-nft).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Comment<'a> {
    /// Fixed or preformatted text.
    Text(Cow<'a, str>),
    /// `{before}{service}{after}`: a service port's display name (`ns/name:port`) in text.
    Service {
        /// Text before the name.
        before: &'a str,
        /// The service port's display name.
        service: &'a str,
        /// Text after the name.
        after: &'a str,
    },
    /// `{service} -> {endpoint}`: a load-balancing rule's comment.
    Endpoint {
        /// The service port's display name.
        service: &'a str,
        /// The endpoint.
        endpoint: SocketAddr,
    },
}

impl Comment<'_> {
    /// The text as iptables passes it to the kernel: percent-encoded, cut to
    /// [`crate::iptables::comment::MAX_COMMENT_BYTES`].
    pub fn sanitized(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = self.write_sanitized(&mut out);
        out
    }

    /// The raw text into `out`.
    fn write<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        match self {
            Comment::Text(text) => out.write_str(text),
            Comment::Service {
                before,
                service,
                after,
            } => {
                out.write_str(before)?;
                out.write_str(service)?;
                out.write_str(after)
            }
            Comment::Endpoint { service, endpoint } => {
                out.write_str(service)?;
                out.write_str(" -> ")?;
                write!(out, "{endpoint}")
            }
        }
    }

    /// The sanitized text into `out`.
    pub(super) fn write_sanitized<W: fmt::Write + ?Sized>(&self, out: &mut W) -> fmt::Result {
        self.write(&mut Sanitizer::new(out))
    }

    /// The same comment owning its text.
    pub fn into_owned(self) -> Comment<'static> {
        match self {
            Comment::Text(text) => Comment::Text(Cow::Owned(text.into_owned())),
            other => Comment::Text(Cow::Owned(other.to_string())),
        }
    }
}

impl fmt::Display for Comment<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f)
    }
}

impl<'a> From<&'a str> for Comment<'a> {
    fn from(text: &'a str) -> Self {
        Comment::Text(Cow::Borrowed(text))
    }
}
