//! Where there is no inotify (Windows): no wake-up, so the poll alone sees every change, one
//! poll interval late at most. [`Wakeup::new`] always says so.

use std::path::Path;

/// No wake-up exists here: this type has no values.
pub(super) enum Wakeup {}

impl Wakeup {
    /// Always `None`: polling alone.
    pub(super) fn new() -> Option<Wakeup> {
        tracing::debug!("no inotify on this platform; manifests changes are seen at the next poll");
        None
    }

    /// Never called (there is no value to call it on).
    pub(super) fn watch(&mut self, _root: &Path) {
        match *self {}
    }

    /// Never called.
    pub(super) fn drain(&self) {
        match *self {}
    }

    /// Never called.
    pub(super) fn writers(&self) -> super::settle::Writers {
        match *self {}
    }

    /// Never called.
    pub(super) async fn changed(&self) {
        match *self {}
    }
}
