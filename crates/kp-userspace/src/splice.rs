//! Linux: copying a relayed TCP connection with splice(2) through a pipe per direction, so
//! the payload moves between the two sockets inside the kernel and never through user-space
//! buffers. Half-closes are forwarded as with `tokio::io::copy_bidirectional`: when one side
//! ends its stream, the other side's write half is shut down; the first error ends both.

use std::io;

use rustix::pipe::{PipeFlags, SpliceFlags, fcntl_setpipe_size, pipe_with, splice};
use tokio::io::{AsyncWriteExt as _, Interest};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A pipe's default capacity (16 pages); asking for more needs a `fcntl`.
const DEFAULT_PIPE_BYTES: usize = 64 * 1024;

/// Copies both ways between `a` and `b` until both directions ended; returns the bytes
/// moved a→b and b→a. `chunk` is the pipe size asked for and the most one splice moves.
pub(crate) async fn copy_bidirectional(
    a: TcpStream,
    b: TcpStream,
    chunk: usize,
) -> io::Result<(u64, u64)> {
    let (ar, aw) = a.into_split();
    let (br, bw) = b.into_split();
    tokio::try_join!(one_way(ar, bw, chunk), one_way(br, aw, chunk))
}

/// Socket → pipe → socket until `from` reaches end of stream, then shuts `to` down.
async fn one_way(from: OwnedReadHalf, mut to: OwnedWriteHalf, chunk: usize) -> io::Result<u64> {
    let (pipe_out, pipe_in) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
    let chunk = chunk.max(1);
    if chunk > DEFAULT_PIPE_BYTES {
        // Best effort: without the privilege for a larger pipe, the default one still works.
        let _ = fcntl_setpipe_size(&pipe_in, chunk);
    }
    let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
    let mut total = 0u64;
    loop {
        // The pipe is empty here, so a would-block can only come from the socket.
        let read = loop {
            from.readable().await?;
            let source: &TcpStream = from.as_ref();
            match source.try_io(Interest::READABLE, || {
                splice(source, None, &pipe_in, None, chunk, flags).map_err(io::Error::from)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        };
        if read == 0 {
            to.shutdown().await?;
            return Ok(total);
        }
        let mut left = read;
        while left > 0 {
            to.writable().await?;
            let sink: &TcpStream = to.as_ref();
            match sink.try_io(Interest::WRITABLE, || {
                splice(&pipe_out, None, sink, None, left, flags).map_err(io::Error::from)
            }) {
                Ok(n) => left -= n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        total += read as u64;
    }
}
