//! A wake-up for the poll: inotify on the directory that holds the manifests, so an edit is
//! looked at within milliseconds instead of at the next poll.
//!
//! The events also say how each entry was last written (see [`Writers`]): written or truncated
//! and not closed yet, or closed after writing or moved into place, so the scanner does not
//! read a file its writer is still writing.
//!
//! Otherwise only a hint. The poll still decides what changed (and still runs every poll interval):
//! inotify misses files behind symlinks that lead out of the directory, and its queue can
//! overflow. Watching the directory, not the files, sees all three ways files are replaced:
//! a write in place (`IN_MODIFY`/`IN_CLOSE_WRITE` of an entry), a rename over a file
//! (`IN_MOVED_TO`), and a ConfigMap volume's swap of `..data` (`IN_MOVED_TO` of `..data`).

use kp_core::report::ErrorChain as _;
use std::ffi::OsStr;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use tokio::io::unix::AsyncFd;
use tracing::debug;

use super::settle::Writers;

/// The directory entry changes that may change what a poll sees. Not `IN_ACCESS` or
/// `IN_OPEN`: the scanner's own reads would wake it.
const EVENTS: WatchFlags = WatchFlags::MODIFY
    .union(WatchFlags::CLOSE_WRITE)
    .union(WatchFlags::ATTRIB)
    .union(WatchFlags::CREATE)
    .union(WatchFlags::DELETE)
    .union(WatchFlags::MOVED_FROM)
    .union(WatchFlags::MOVED_TO)
    .union(WatchFlags::DELETE_SELF)
    .union(WatchFlags::MOVE_SELF);

/// An inotify instance watching one directory.
pub(super) struct Wakeup {
    fd: AsyncFd<OwnedFd>,
    /// The directory watched and its watch descriptor.
    watched: Option<(PathBuf, i32)>,
    /// How its entries were last written, from the events drained so far.
    writers: Mutex<Writers>,
}

impl Wakeup {
    /// An inotify instance, or `None` (logged) where there is none: polling alone then.
    pub(super) fn new() -> Option<Wakeup> {
        // `AsyncFd::new` is deprecated for types that might not keep their descriptor open;
        // an `OwnedFd` does, for as long as the `AsyncFd` owns it, which is what the
        // replacement (`register`) asks of its caller, and it is `unsafe`, which this
        // workspace forbids.
        #[allow(deprecated)]
        let created = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)
            .map_err(io::Error::from)
            .and_then(AsyncFd::new);
        match created {
            Ok(fd) => Some(Wakeup {
                fd,
                watched: None,
                writers: Mutex::default(),
            }),
            Err(error) => {
                debug!(error = %error.chain(), "no inotify; manifests changes are seen at the next poll");
                None
            }
        }
    }

    /// Watch the directory that holds `root` (itself when it is a directory, else the one it
    /// is in). Called before every poll: cheap when nothing moved, and it follows a path that
    /// appears late or a directory replaced by another.
    pub(super) fn watch(&mut self, root: &Path) {
        let dir = if root.is_dir() {
            root
        } else {
            match root.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => parent,
                _ => Path::new("."),
            }
        };
        match inotify::add_watch(self.fd.get_ref(), dir, EVENTS) {
            Ok(descriptor) => {
                if let Some((_, old)) = &self.watched
                    && *old != descriptor
                {
                    // The directory was replaced: stop watching the old one (it may be gone
                    // already, which removed its watch).
                    let _ = inotify::remove_watch(self.fd.get_ref(), *old);
                }
                if self
                    .watched
                    .as_ref()
                    .is_none_or(|(_, old)| *old != descriptor)
                {
                    // Events of another directory say nothing of this one's writers.
                    self.lock().forget();
                }
                self.watched = Some((dir.to_owned(), descriptor));
            }
            Err(error) => {
                if self.watched.take().is_some() {
                    debug!(dir = %dir.display(), error = %error.chain(), "cannot watch the manifests directory; polling only");
                }
            }
        }
    }

    /// Take the events queued so far into [`Wakeup::writers`]: the poll about to run sees
    /// what else they announced.
    pub(super) fn drain(&self) {
        let mut buffer = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(self.fd.get_ref(), &mut buffer);
        let mut writers = self.lock();
        while let Ok(event) = reader.next() {
            let flags = event.events();
            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                writers.forget();
                continue;
            }
            let Some(name) = event.file_name() else {
                continue;
            };
            let name = OsStr::from_bytes(name.to_bytes());
            if flags.intersects(ReadFlags::DELETE | ReadFlags::MOVED_FROM) {
                writers.gone(name);
            } else if flags.intersects(ReadFlags::CLOSE_WRITE | ReadFlags::MOVED_TO) {
                writers.done(name);
            } else if flags.contains(ReadFlags::MODIFY) {
                writers.modified(name);
            }
        }
    }

    /// How the watched directory's entries were last written, as of the last drain.
    pub(super) fn writers(&self) -> Writers {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Writers> {
        // A panic while holding it leaves a map that is still a map.
        self.writers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait until an event is queued (without consuming it; [`Wakeup::drain`] does).
    pub(super) async fn changed(&self) {
        loop {
            let Ok(mut guard) = self.fd.readable().await else {
                // The reactor is gone (the runtime is shutting down): never wake.
                return std::future::pending().await;
            };
            // Readiness is cached by tokio and outlives a drain: ask the kernel.
            if rustix::io::ioctl_fionread(self.fd.get_ref()).is_ok_and(|queued| queued > 0) {
                return;
            }
            guard.clear_ready();
        }
    }
}
