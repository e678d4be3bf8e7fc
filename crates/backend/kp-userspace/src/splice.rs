//! Linux: copying a relayed TCP connection with splice(2) through a pipe per direction, so
//! the payload moves between the two sockets inside the kernel and never through user-space
//! buffers. Half-closes are forwarded as with `tokio::io::copy_bidirectional`: when one side
//! ends its stream, the other side's write half is shut down; the first error ends both.
//!
//! Each direction keeps its pipe busy from both ends: it splices in while the pipe has room
//! and out while it holds data, and waits only when neither moves. Every splice is tried
//! before asking the reactor: a socket that just became readable or writable is used at once,
//! not one reactor turn later.

use std::io;

use rustix::pipe::{
    PipeFlags, SpliceFlags, fcntl_getpipe_size, fcntl_setpipe_size, pipe_with, splice,
};
use tokio::io::{AsyncWriteExt as _, Interest};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

/// A pipe's default capacity (16 pages); asking for more needs a `fcntl`.
const DEFAULT_PIPE_BYTES: usize = 64 * 1024;

/// Copies both ways between `a` and `b` until both directions ended; returns the bytes
/// moved a→b and b→a. `pipe_bytes` is the pipe size asked for per direction and the most
/// that is in flight in it.
pub(crate) async fn copy_bidirectional(
    a: TcpStream,
    b: TcpStream,
    pipe_bytes: usize,
) -> io::Result<(u64, u64)> {
    let (ar, aw) = a.into_split();
    let (br, bw) = b.into_split();
    tokio::try_join!(one_way(ar, bw, pipe_bytes), one_way(br, aw, pipe_bytes))
}

/// One splice on `socket` in the direction of `interest`. Through tokio's `try_io` while
/// the reactor has the socket ready (an EAGAIN then clears that readiness, with no wake-up
/// lost); when it has not, tried anyway, as data may have come before the reactor's next
/// turn. Either way one syscall, and after a WouldBlock the caller may wait for readiness.
fn attempt(
    socket: &TcpStream,
    interest: Interest,
    op: impl Fn() -> rustix::io::Result<usize>,
) -> io::Result<usize> {
    let called = std::cell::Cell::new(false);
    match socket.try_io(interest, || {
        called.set(true);
        op().map_err(io::Error::from)
    }) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock && !called.get() => {
            op().map_err(io::Error::from)
        }
        result => result,
    }
}

/// Socket → pipe → socket until `from` reaches end of stream and the pipe is empty, then
/// shuts `to` down.
async fn one_way(
    from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    pipe_bytes: usize,
) -> io::Result<u64> {
    let (pipe_out, pipe_in) = pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
    if pipe_bytes > DEFAULT_PIPE_BYTES {
        // Best effort: without the privilege for a larger pipe, the default one still works.
        let _ = fcntl_setpipe_size(&pipe_in, pipe_bytes);
    }
    // What the pipe holds, but no more than asked for: a smaller size bounds each splice.
    let capacity = fcntl_getpipe_size(&pipe_in)
        .unwrap_or(DEFAULT_PIPE_BYTES)
        .min(pipe_bytes.max(1));
    let flags = SpliceFlags::NONBLOCK | SpliceFlags::MOVE;
    let source: &TcpStream = from.as_ref();
    let mut in_pipe = 0usize;
    let mut eof = false;
    let mut total = 0u64;
    loop {
        let mut moved = false;
        let mut read_blocked = false;
        let mut write_blocked = false;
        if !eof && in_pipe < capacity {
            // EAGAIN here is an empty socket or a pipe without free slots (small segments
            // can use them up before `capacity` bytes); either way, draining comes next.
            match attempt(source, Interest::READABLE, || {
                splice(source, None, &pipe_in, None, capacity - in_pipe, flags)
            }) {
                Ok(0) => eof = true,
                Ok(n) => in_pipe += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => read_blocked = true,
                Err(e) => return Err(e),
            }
            moved |= !read_blocked;
        }
        if in_pipe > 0 {
            let sink: &TcpStream = to.as_ref();
            match attempt(sink, Interest::WRITABLE, || {
                splice(&pipe_out, None, sink, None, in_pipe, flags)
            }) {
                Ok(n) => {
                    in_pipe -= n;
                    total += n as u64;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => write_blocked = true,
                Err(e) => return Err(e),
            }
        }
        if eof && in_pipe == 0 {
            to.shutdown().await?;
            return Ok(total);
        }
        if moved {
            // Direct syscalls never hand control back to the runtime: yield when this
            // task's budget is used up, as tokio's own I/O does.
            tokio::task::coop::consume_budget().await;
            continue;
        }
        // Nothing moved, so at least one end was tried and blocked: wait until it may move.
        tokio::select! {
            ready = from.readable(), if read_blocked => ready?,
            ready = to.writable(), if write_blocked => ready?,
        }
    }
}
