//! When a changed manifests file may be read: the rules, kept free of I/O and clocks (the
//! scanner hands in what the wake-up saw of the file's writer and how long the file has
//! looked the same), so they are tested on their own.
//!
//! A change is read once its stamp (size, times, inode, symlink target) has looked the same
//! on two looks at least the settle time apart. Besides, a file must not be caught while it
//! is being written: one that is open for writing (written or truncated, no close since), that
//! shrank to nothing or vanished, or (with no completed write seen) whose text ends inside a
//! line, is read only once it has looked the same for the writer hold, which bounds a writer
//! that keeps a file open and delays a file really emptied or removed. A completed write (a
//! close after writing, or a rename into place) of content needs only the settle time.

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::time::Duration;

/// What the directory watch saw of a file's last writer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Writer {
    /// Nothing seen: no watch, its queue overflowed, or the file lies behind a symlink that
    /// leads out of the watched directory.
    Unknown,
    /// Written or truncated, and not closed since.
    Open,
    /// Closed after writing, or moved into place (a rename, a ConfigMap's `..data` swap).
    Done,
}

/// The writers of a directory's entries, by name, as the watch reports them.
#[derive(Clone, Debug, Default)]
pub(super) struct Writers(HashMap<OsString, Writer>);

impl Writers {
    /// A write or truncation of `name`.
    pub(super) fn modified(&mut self, name: &OsStr) {
        self.0.insert(name.to_owned(), Writer::Open);
    }

    /// `name` was closed after writing, or moved into place.
    pub(super) fn done(&mut self, name: &OsStr) {
        self.0.insert(name.to_owned(), Writer::Done);
    }

    /// `name` was removed or moved away: nothing is known of what comes next.
    pub(super) fn gone(&mut self, name: &OsStr) {
        self.0.remove(name);
    }

    /// Events were lost: nothing is known of any writer.
    pub(super) fn forget(&mut self) {
        self.0.clear();
    }

    /// The writer of the file at `path` (every file the scanner reads is an entry of the
    /// watched directory, so its name says which).
    pub(super) fn of(&self, path: &Path) -> Writer {
        path.file_name()
            .and_then(|name| self.0.get(name))
            .copied()
            .unwrap_or(Writer::Unknown)
    }
}

/// How long to wait, by the settle time and the writer hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Timing {
    /// How long a change must look the same before it is read.
    pub settle: Duration,
    /// How long a file being written, emptied or removed must look the same instead.
    pub hold: Duration,
}

/// One look at a changed file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Look {
    /// Its writer.
    pub writer: Writer,
    /// How long its stamp has looked as it does now; `None` on the first look at it.
    pub stable_for: Option<Duration>,
    /// It had content before and is now empty or gone.
    pub emptied: bool,
}

impl Timing {
    /// Whether the file of `look` may be read (or its removal applied) now.
    pub(super) fn may_read(&self, look: &Look) -> bool {
        let Some(stable_for) = look.stable_for else {
            return false;
        };
        // Emptied waits even after a completed write: `: > file` closes before the shell
        // appends the new content.
        let wait = if look.writer == Writer::Open || look.emptied {
            self.hold
        } else {
            self.settle
        };
        stable_for >= wait
    }

    /// Whether `text`, just read from the file of `look`, may be taken as its content: a text
    /// that stops inside a line is a writer caught between two writes unless the file was
    /// closed after writing, or has looked the same for the writer hold (a file written by
    /// hand without a final newline).
    pub(super) fn complete(&self, text: &[u8], look: &Look) -> bool {
        let ends_a_line = text.last().is_none_or(|&last| last == b'\n');
        ends_a_line
            || look.writer == Writer::Done
            || look.stable_for.is_some_and(|stable| stable >= self.hold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMING: Timing = Timing {
        settle: Duration::from_millis(50),
        hold: Duration::from_secs(1),
    };

    fn look(writer: Writer, stable_ms: Option<u64>, emptied: bool) -> Look {
        Look {
            writer,
            stable_for: stable_ms.map(Duration::from_millis),
            emptied,
        }
    }

    #[test]
    fn a_first_look_never_reads() {
        for writer in [Writer::Unknown, Writer::Open, Writer::Done] {
            assert!(!TIMING.may_read(&look(writer, None, false)), "{writer:?}");
        }
    }

    #[test]
    fn a_completed_or_unwatched_write_reads_after_the_settle_time() {
        for writer in [Writer::Unknown, Writer::Done] {
            assert!(
                !TIMING.may_read(&look(writer, Some(49), false)),
                "{writer:?}"
            );
            assert!(
                TIMING.may_read(&look(writer, Some(50), false)),
                "{writer:?}"
            );
        }
    }

    #[test]
    fn a_file_open_for_writing_waits_for_the_hold() {
        assert!(!TIMING.may_read(&look(Writer::Open, Some(50), false)));
        assert!(!TIMING.may_read(&look(Writer::Open, Some(999), false)));
        assert!(TIMING.may_read(&look(Writer::Open, Some(1000), false)));
    }

    #[test]
    fn an_emptied_file_waits_for_the_hold_even_after_a_close() {
        for writer in [Writer::Unknown, Writer::Open, Writer::Done] {
            assert!(
                !TIMING.may_read(&look(writer, Some(999), true)),
                "{writer:?}"
            );
            assert!(
                TIMING.may_read(&look(writer, Some(1000), true)),
                "{writer:?}"
            );
        }
    }

    #[test]
    fn a_text_ending_inside_a_line_is_complete_only_once_closed_or_held() {
        let cut = b"kind: Service\nmetadata:\n  na";
        assert!(!TIMING.complete(cut, &look(Writer::Unknown, Some(50), false)));
        assert!(!TIMING.complete(cut, &look(Writer::Open, Some(999), false)));
        assert!(TIMING.complete(cut, &look(Writer::Done, Some(50), false)));
        assert!(TIMING.complete(cut, &look(Writer::Unknown, Some(1000), false)));
        assert!(TIMING.complete(b"kind: Service\n", &look(Writer::Unknown, Some(50), false)));
        assert!(TIMING.complete(b"", &look(Writer::Unknown, Some(50), false)));
    }

    #[test]
    fn writers_follow_the_events_of_each_name() {
        let mut writers = Writers::default();
        let file = Path::new("/m/svc.yaml");
        assert_eq!(writers.of(file), Writer::Unknown);
        writers.modified(OsStr::new("svc.yaml"));
        assert_eq!(writers.of(file), Writer::Open);
        assert_eq!(writers.of(Path::new("/m/other.yaml")), Writer::Unknown);
        writers.done(OsStr::new("svc.yaml"));
        assert_eq!(writers.of(file), Writer::Done);
        writers.gone(OsStr::new("svc.yaml"));
        assert_eq!(writers.of(file), Writer::Unknown);
        writers.modified(OsStr::new("svc.yaml"));
        writers.forget();
        assert_eq!(writers.of(file), Writer::Unknown);
    }
}
