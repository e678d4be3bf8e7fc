//! Netlink framing, sans I/O, written once for every crate that builds or reads netlink
//! messages by hand: nf_tables (`kp-nftnl`: batches, dumps, notifications) and ipset's and
//! ctnetlink's datagrams (`kp-dataplane`). It knows the frame only: the message header
//! (`struct nlmsghdr`, and nfnetlink's `struct nfgenmsg` after it), attributes (type-length-
//! value, 4-byte aligned, nested), and a received datagram split into messages with the
//! kernel's error acknowledgements read. What a message means (its type, its attributes'
//! numbers) stays with its protocol. `kp-ipvs` and ctnetlink's messages themselves use the
//! rust-netlink crates' `Emitable`/`Parseable` types.
//!
//! - [`Writer`]: messages and their attributes appended to one buffer, lengths filled in
//!   when a message or nest ends (one pass, so a large batch is never copied);
//! - [`attributes`] / [`try_attributes`]: the attributes of a message body or a nest;
//! - [`messages`]: the messages of one datagram ([`Message`], [`Message::error_code`]).

/// `NLMSG_ERROR`: an error (or, with code 0, an acknowledgement) for one request.
pub const NLMSG_ERROR: u16 = 2;
/// `NLMSG_DONE`: the end of a multipart reply (a dump).
pub const NLMSG_DONE: u16 = 3;
/// `NLM_F_REQUEST`: every request carries it.
pub const NLM_F_REQUEST: u16 = 0x1;
/// `NLM_F_ACK`: acknowledge the request (an `NLMSG_ERROR` with code 0).
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_ECHO`: send the created object back.
pub const NLM_F_ECHO: u16 = 0x8;
/// `NLM_F_DUMP` (`NLM_F_ROOT | NLM_F_MATCH`): list everything.
pub const NLM_F_DUMP: u16 = 0x300;
/// `NLM_F_CREATE`: create the object if it does not exist.
pub const NLM_F_CREATE: u16 = 0x400;
/// `NLM_F_APPEND`: add at the end (rules).
pub const NLM_F_APPEND: u16 = 0x800;
/// `NLA_F_NESTED`: the attribute holds attributes.
pub const NLA_F_NESTED: u16 = 0x8000;
/// `NLA_F_NET_BYTEORDER`: the value is big-endian (ipset sets it on its integers).
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
/// What is left of an attribute's type without its flags (the kernel's `NLA_TYPE_MASK`).
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
/// `struct nlmsghdr`: length, type, flags, sequence number, port id.
pub const NLMSG_HDRLEN: usize = 16;
/// `struct nfgenmsg`: family, version, resource id.
pub const NFGENMSG_LEN: usize = 4;

/// Why bytes received are not netlink.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// A message header names more bytes than are left, or fewer than a header.
    #[error("netlink message of {len} bytes in {left} received")]
    Message {
        /// The length the header names.
        len: usize,
        /// The bytes left in the datagram.
        left: usize,
    },
    /// An attribute header names more bytes than are left, or fewer than a header.
    #[error("attribute of {len} bytes in {left}")]
    Attribute {
        /// The length the header names.
        len: usize,
        /// The bytes left in the enclosing body.
        left: usize,
    },
}

/// Messages and their attributes, appended to one buffer.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty buffer.
    pub fn new() -> Self {
        Self::default()
    }

    fn align(&mut self) {
        self.buf.resize(self.buf.len().next_multiple_of(4), 0);
    }

    /// Starts a message (its header, length 0 until [`Writer::end`]); returns its offset.
    pub fn begin(&mut self, kind: u16, flags: u16, seq: u32) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&seq.to_ne_bytes());
        // The port id: 0, the kernel fills in the sender's.
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        start
    }

    /// Starts an nfnetlink message: the header, then `struct nfgenmsg` (`family`,
    /// `NFNETLINK_V0`, the resource id big-endian).
    pub fn begin_nfnl(
        &mut self,
        kind: u16,
        flags: u16,
        seq: u32,
        family: u8,
        res_id: u16,
    ) -> usize {
        let start = self.begin(kind, flags, seq);
        self.buf.push(family);
        self.buf.push(0);
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        start
    }

    /// Ends the message started at `start`: its length is what was written since.
    pub fn end(&mut self, start: usize) {
        let len = u32::try_from(self.buf.len() - start).unwrap_or(u32::MAX);
        self.buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// One attribute holding `value`.
    pub fn put(&mut self, kind: u16, value: &[u8]) {
        let len = u16::try_from(4 + value.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.align();
    }

    /// A NUL-terminated string attribute.
    pub fn put_str(&mut self, kind: u16, value: &str) {
        let len = u16::try_from(4 + value.len() + 1).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value.as_bytes());
        self.buf.push(0);
        self.align();
    }

    /// A big-endian `u32` attribute.
    pub fn put_u32(&mut self, kind: u16, value: u32) {
        self.put(kind, &value.to_be_bytes());
    }

    /// A big-endian `u64` attribute.
    pub fn put_u64(&mut self, kind: u16, value: u64) {
        self.put(kind, &value.to_be_bytes());
    }

    /// Starts a nested attribute; returns its offset for [`Writer::nest_end`].
    pub fn nest(&mut self, kind: u16) -> usize {
        let start = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        start
    }

    /// Ends the nested attribute started at `start`.
    pub fn nest_end(&mut self, start: usize) {
        let len = u16::try_from(self.buf.len() - start).unwrap_or(u16::MAX);
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    }

    /// The bytes written so far.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The buffer itself, for callers that move whole messages (renumbering a batch).
    pub fn buffer_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// The bytes, taken.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }
}

/// The attributes in `data` (a message body after its fixed header, or a nest's value):
/// each type without its flags, and value. A broken attribute ends them, with an error.
pub fn try_attributes(mut data: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), FrameError>> {
    std::iter::from_fn(move || {
        if data.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([data[0], data[1]]));
        let kind = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            let left = data.len();
            data = &[];
            return Some(Err(FrameError::Attribute { len, left }));
        }
        let value = &data[4..len];
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(Ok((kind, value)))
    })
}

/// [`try_attributes`] for readers that take what parses: the attributes up to a broken one.
pub fn attributes(data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    try_attributes(data).map_while(Result::ok)
}

/// One netlink message of a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`: the request it answers.
    pub seq: u32,
    /// `nlmsg_pid`: the sender's port id (a notification's: the committing socket's).
    pub port: u32,
    /// Everything after the header (`struct nfgenmsg` first for nfnetlink).
    pub payload: &'a [u8],
    /// The whole message, header included, for decoders that read the header themselves
    /// (rust-netlink's `NetlinkMessage::deserialize`).
    pub bytes: &'a [u8],
}

impl Message<'_> {
    /// For `NLMSG_ERROR`: the kernel's code, a negative errno or 0 for an acknowledgement.
    pub fn error_code(&self) -> Option<i32> {
        let code = self.payload.get(..4)?;
        (self.kind == NLMSG_ERROR).then(|| i32::from_ne_bytes([code[0], code[1], code[2], code[3]]))
    }
}

/// The messages in one received datagram, in order. A broken header ends them, with an
/// error: nothing after it can be trusted.
pub fn messages(mut data: &[u8]) -> impl Iterator<Item = Result<Message<'_>, FrameError>> {
    std::iter::from_fn(move || {
        if data.len() < NLMSG_HDRLEN {
            return None;
        }
        let field = |at: usize| [data[at], data[at + 1], data[at + 2], data[at + 3]];
        let len = u32::from_ne_bytes(field(0)) as usize;
        if len < NLMSG_HDRLEN || len > data.len() {
            let left = data.len();
            data = &[];
            return Some(Err(FrameError::Message { len, left }));
        }
        let message = Message {
            kind: u16::from_ne_bytes([data[4], data[5]]),
            flags: u16::from_ne_bytes([data[6], data[7]]),
            seq: u32::from_ne_bytes(field(8)),
            port: u32::from_ne_bytes(field(12)),
            payload: &data[NLMSG_HDRLEN..len],
            bytes: &data[..len],
        };
        // Messages are 4-byte aligned within a datagram.
        data = &data[len.next_multiple_of(4).min(data.len())..];
        Some(Ok(message))
    })
}

#[cfg(test)]
mod tests;
