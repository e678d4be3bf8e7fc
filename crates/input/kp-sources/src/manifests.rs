//! The manifests source: Services, EndpointSlices, this node's Node and ServiceCIDRs from
//! local YAML/JSON files, for running without a cluster and for tests.
//!
//! The files hold what users write for `kubectl apply`: multi-document YAML, `kind: List`, or
//! JSON, with `v1` Service, `discovery.k8s.io/v1` EndpointSlice, `v1` Node and
//! `networking.k8s.io/v1` ServiceCIDR objects (other kinds are ignored). Namespaced objects without a namespace get `default`, and the API
//! server's defaults are applied ([`crate::defaults`]), so the proxy sees the same objects it
//! would get from a cluster.
//!
//! # Watching
//!
//! The path (a file, or a directory whose `.yaml`, `.yml` and `.json` files are read, not
//! recursively, skipping names starting with `.`) is polled: every file's size, times, inode
//! and resolved symlink target are compared with the last look. This sees every way tools
//! replace a file: writing in place, renaming a new file over it, and a ConfigMap volume's
//! symlink swap (`x.yaml -> ..data/x.yaml`, with `..data` atomically re-pointed), which
//! inotify-style watches on the file itself miss. An inotify watch on the directory (a single
//! file's own directory) only wakes the poll early, so an edit is looked at at once instead
//! of at the next poll; it misses symlink targets outside the directory, so the poll keeps
//! running. Only changed files are re-read, and of a re-read file only the documents whose
//! text changed are decoded (the others, found by a hash of their text, give the objects
//! they gave before): one edit in a file of 10,000 Services decodes one document. Then the
//! whole object set is compared with what was reported: new or changed objects are
//! `Applied`, vanished ones `Deleted`, all of one poll in one `SourceEvent::Batch`. An object
//! defined in two files comes from the later file name, with a warning. Between polls the
//! source keeps each object's key and a hash of its content, not the object: a `Deleted`
//! event carries the object's kind, namespace and name (what identifies it), and an object
//! whose other definition went away is decoded again from its file.
//!
//! A file being written is never read: a change is read once it has looked the same on two
//! looks [`SETTLE_TIME`] apart, with no change in the directory in between (when it is
//! watched). A file still open for writing (the watch saw a
//! write or truncation and no close since), emptied or removed, or (with no completed write
//! seen) ending inside a line, must look the same for [`WRITER_HOLD`] instead. So a file
//! caught between truncation and write, a writer pausing between chunks, or an editor's
//! move-away-and-write is not taken for the new content or for a deletion, while a completed
//! write (close after writing, rename into place, a ConfigMap's `..data` swap) is read
//! within [`SETTLE_TIME`].
//!
//! # The removal guard
//!
//! A read that would remove more of the known Services at once than [`RemovalGuard`] allows
//! (default: more than half, and at least 100) is held back, logged in one line and counted
//! in `kube_proxy_rs_manifest_removals_held_total`; the last good state stays. After
//! [`REMOVAL_CONFIRM`] every file is read again: if the files still say so, the read is
//! applied; if they changed, what they say now is judged instead.
//!
//! # Broken documents
//!
//! A document that is not valid YAML/JSON, has fields of the wrong type, or cannot be
//! defaulted is skipped with a warning naming its file, document and line, and counted in
//! `kube_proxy_rs_manifest_errors_total`; the file's other documents and other files still
//! apply. While a file has a broken document, objects it contributed before that are now
//! missing are **kept** (neither deleted nor changed) until the file parses cleanly again:
//! a half-written save must never drop traffic. Deleting the file does delete its objects.
//!
//! # Start
//!
//! The first look reports every object, then `Synced` for Services, EndpointSlices and
//! Nodes. A path that does not exist is not an error: it is reported (a warning) and watched,
//! and nothing is reported, not even `Synced`, until it appears, so the proxy does not
//! program an empty configuration for a typo'd path while looking healthy.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kp_core::event::{ObjectEvent, SourceEvent};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

mod guard;
mod parse;
mod scan;
mod settle;
#[cfg(test)]
mod tests;
#[cfg(target_os = "linux")]
mod wakeup;
#[cfg(not(target_os = "linux"))]
#[path = "manifests/wakeup_poll.rs"]
mod wakeup;

pub use guard::{RemovalGuard, RemovalGuardError};
pub use parse::{
    DEFAULT_NAMESPACE, Kind, ManifestError, Object, ObjectKey, Problem, parse_manifests,
    parse_manifests_each,
};

/// How often the files are looked at. A second is quick enough for a person editing files
/// and costs one `stat` per file per second, which is nothing for a directory of manifests.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How long a change must look the same before it is applied. Long enough for coarse file
/// timestamps (a few milliseconds) to move on; short enough that an edit reaches the rules
/// well within a second.
pub const SETTLE_TIME: Duration = Duration::from_millis(50);

/// How long a file open for writing (no close since its last write), emptied, removed, or
/// ending inside a line must look the same before it is taken as final: longer than a
/// writer's pauses between chunks, short enough that a real removal is not left waiting.
pub const WRITER_HOLD: Duration = Duration::from_secs(1);

/// How long after the removal guard holds a read back the files are read again to confirm
/// it.
pub const REMOVAL_CONFIRM: Duration = Duration::from_secs(1);

/// The name the error counter is registered under; the exposition adds `_total`.
const ERRORS_METRIC: &str = "kube_proxy_rs_manifest_errors";

/// The name the decoded-documents counter is registered under.
const DECODED_METRIC: &str = "kube_proxy_rs_manifest_documents_decoded";

/// The name the counter of reads held back by the removal guard is registered under.
const HELD_METRIC: &str = "kube_proxy_rs_manifest_removals_held";

/// Why the manifests source stopped.
#[derive(Debug, thiserror::Error)]
pub enum ManifestsError {
    /// The blocking file scan panicked or was cancelled by the runtime: a bug, or the runtime
    /// shutting down.
    #[error("manifests scan task failed")]
    Scan(#[from] tokio::task::JoinError),
}

/// A source of objects read from manifests files. Build with [`ManifestsSource::new`] and
/// the setters, then [`ManifestsSource::run`].
#[derive(Debug)]
pub struct ManifestsSource {
    path: PathBuf,
    node_name: Option<String>,
    poll_interval: Duration,
    removal_guard: RemovalGuard,
    counters: scan::Counters,
    /// Where to tell this node's Node (or that there is none) once the first reading is
    /// complete, before its events are sent.
    first_node: Option<oneshot::Sender<Option<Node>>>,
}

impl ManifestsSource {
    /// A source reading `path`, a manifests file or a directory of them.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        ManifestsSource {
            path: path.into(),
            node_name: None,
            poll_interval: DEFAULT_POLL_INTERVAL,
            removal_guard: RemovalGuard::default(),
            counters: scan::Counters::default(),
            first_node: None,
        }
    }

    /// Send this node's Node (see [`ManifestsSource::node_name`]), or `None` when the files
    /// have none, to `tx` as soon as the first complete reading of the path is done, before
    /// its events are sent: the proxy's start-up reads its node IPs from it instead of
    /// reading every manifest a second time. Nothing is sent while the path does not exist.
    pub fn report_first_node(mut self, tx: oneshot::Sender<Option<Node>>) -> Self {
        self.first_node = Some(tx);
        self
    }

    /// Report the Node with this name (this node's). Without it no Node is reported, as the
    /// proxy only ever uses its own.
    pub fn node_name(mut self, name: impl Into<String>) -> Self {
        self.node_name = Some(name.into());
        self
    }

    /// Look at the files this often (default [`DEFAULT_POLL_INTERVAL`]). Zero polls
    /// continuously, which only tests want.
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Hold back a read that removes this many of the known Services until a second read
    /// agrees (default [`RemovalGuard::default`]: more than half, and at least 100).
    pub fn removal_guard(mut self, guard: RemovalGuard) -> Self {
        self.removal_guard = guard;
        self
    }

    /// Register `kube_proxy_rs_manifest_errors_total` (broken documents and unreadable
    /// files, each counted once per content seen),
    /// `kube_proxy_rs_manifest_documents_decoded_total` and
    /// `kube_proxy_rs_manifest_removals_held_total` in `registry`.
    pub fn register_metrics(self, registry: &mut Registry) -> Self {
        registry.register(
            ERRORS_METRIC,
            "Manifest documents skipped because they are broken, and manifest files that could not be read",
            self.counters.errors.clone(),
        );
        registry.register(
            DECODED_METRIC,
            "Manifest documents decoded; a re-read file decodes only the documents whose text changed",
            self.counters.decoded.clone(),
        );
        registry.register(
            HELD_METRIC,
            "Manifest reads held back because they would remove more of the known Services at once than the removal guard allows; applied when a second read agrees",
            self.counters.held.clone(),
        );
        self
    }

    /// The error counter, for callers that register metrics themselves.
    pub fn errors_counter(&self) -> Counter {
        self.counters.errors.clone()
    }

    /// The counter of decoded documents (every document of the first read, then only the
    /// documents whose text changed), for callers that register metrics themselves.
    pub fn decoded_counter(&self) -> Counter {
        self.counters.decoded.clone()
    }

    /// The counter of reads the removal guard held back, for callers that register metrics
    /// themselves.
    pub fn held_counter(&self) -> Counter {
        self.counters.held.clone()
    }

    /// Watch the files and send events until `shutdown` is cancelled or `tx`'s receiver is
    /// dropped; both end with `Ok(())`.
    pub async fn run(
        mut self,
        tx: mpsc::Sender<SourceEvent>,
        shutdown: CancellationToken,
    ) -> Result<(), ManifestsError> {
        // Waits longer than the poll interval would slow down nothing but tests.
        let settle = SETTLE_TIME.min(self.poll_interval);
        let timing = settle::Timing {
            settle,
            hold: WRITER_HOLD,
        };
        let guard = guard::Guard::new(self.removal_guard, REMOVAL_CONFIRM);
        let mut scanner = scan::Scanner::new(
            self.path.clone(),
            self.node_name.clone(),
            self.counters.clone(),
            timing,
            guard,
        );
        let mut wakeup = wakeup::Wakeup::new();
        let mut synced = false;
        let mut delay = Duration::ZERO;
        // Whether the last poll left changes to confirm after the settle time.
        let mut settling = false;
        loop {
            if let Some(wakeup) = wakeup.as_mut() {
                wakeup.watch(&self.path);
            }
            let watching = wakeup.as_ref();
            let wait = async {
                if settling {
                    quiet(watching, settle, self.poll_interval).await;
                    return;
                }
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    // A change in the directory cuts the poll interval short; the look waits
                    // until the directory has been quiet for the settle time, so it does not
                    // land between a writer's truncation and its write.
                    () = changed(watching) => quiet(watching, settle, self.poll_interval).await,
                }
            };
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                () = tx.closed() => return Ok(()),
                () = wait => {}
            }
            let writers = wakeup
                .as_ref()
                .map_or_else(settle::Writers::default, |wakeup| {
                    wakeup.drain();
                    wakeup.writers()
                });
            let now = tokio::time::Instant::now().into_std();
            // `stat` and reads may block on a slow filesystem: keep them off the runtime. The
            // events are made and sent from the same blocking thread, so the objects they
            // hold (the first load's 20,000 at 10k services) come and go in that thread's
            // malloc arena instead of interleaving with what the proxier keeps in its own:
            // at 10k services that left ~30 MiB of freed memory glibc could not give back.
            let initial = !synced;
            let first_node = if initial {
                self.first_node.take()
            } else {
                None
            };
            let sender = Sender {
                runtime: tokio::runtime::Handle::current(),
                tx: tx.clone(),
                shutdown: shutdown.clone(),
            };
            let task = tokio::task::spawn_blocking(move || {
                let poll = scanner.poll(&writers, now);
                let (complete, settling, recheck) = (poll.complete, poll.settling, poll.recheck);
                let (first_node, delivered) = sender.deliver(poll, initial, first_node);
                (scanner, complete, settling, recheck, first_node, delivered)
            });
            let (complete, recheck, first_node, delivered);
            (scanner, complete, settling, recheck, first_node, delivered) = tokio::select! {
                biased;
                () = shutdown.cancelled() => return Ok(()),
                joined = task => joined?,
            };
            if !delivered {
                return Ok(());
            }
            self.first_node = first_node;
            synced |= complete;
            delay = recheck.map_or(self.poll_interval, |recheck| {
                recheck.min(self.poll_interval)
            });
        }
    }
}

/// Sends a poll's events from the scan's blocking thread.
struct Sender {
    runtime: tokio::runtime::Handle,
    tx: mpsc::Sender<SourceEvent>,
    shutdown: CancellationToken,
}

impl Sender {
    /// Sends what `poll` found (and, on the `initial` load once it is complete, `first_node`
    /// this node's Node first, and the `Synced` events last). Returns `first_node` unless it
    /// was used, and whether the events were delivered (`false`: shutdown, or the receiver
    /// is gone).
    fn deliver(
        &self,
        poll: scan::Poll,
        initial: bool,
        mut first_node: Option<oneshot::Sender<Option<Node>>>,
    ) -> (Option<oneshot::Sender<Option<Node>>>, bool) {
        let mut sync_events = Vec::new();
        if poll.complete && initial {
            if let Some(first_node) = first_node.take() {
                // The receiver may have stopped waiting: nothing to do then.
                let _ = first_node.send(poll.node());
            }
            sync_events.extend([
                SourceEvent::Service(ObjectEvent::Synced),
                SourceEvent::EndpointSlice(ObjectEvent::Synced),
                SourceEvent::Node(ObjectEvent::Synced),
                SourceEvent::ServiceCidr(ObjectEvent::Synced),
            ]);
        }
        // After the initial load, one poll's changes go as one batch, so the proxier never
        // syncs between a Service and the EndpointSlice written with it. The initial load
        // needs none (nothing is programmed before the `Synced` events that follow it) and
        // streams its events, each object decoded only as it is sent and freed then, so a
        // large directory is never held twice.
        let count = poll.events.len();
        let mut changes = poll.events.into_iter().map(scan::Change::event);
        let batch = if initial || count < 2 {
            None
        } else {
            Some(SourceEvent::Batch(changes.by_ref().collect()))
        };
        for event in batch.into_iter().chain(changes).chain(sync_events) {
            let sent = self.runtime.block_on(async {
                tokio::select! {
                    biased;
                    () = self.shutdown.cancelled() => false,
                    sent = self.tx.send(event) => sent.is_ok(),
                }
            });
            if !sent {
                return (first_node, false);
            }
        }
        (first_node, true)
    }
}

/// Resolves once the directory has had no change for `settle` (without a wake-up: after
/// `settle`), or after `limit` of continuous changes: a writer that never stops must not
/// stop the polling.
async fn quiet(wakeup: Option<&wakeup::Wakeup>, settle: Duration, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit.max(settle);
    loop {
        if let Some(wakeup) = wakeup {
            wakeup.drain();
        }
        tokio::select! {
            () = tokio::time::sleep(settle) => return,
            () = tokio::time::sleep_until(deadline) => return,
            () = changed(wakeup) => {}
        }
    }
}

/// Resolves when the directory changed; never without a wake-up.
async fn changed(wakeup: Option<&wakeup::Wakeup>) {
    match wakeup {
        Some(wakeup) => wakeup.changed().await,
        None => std::future::pending().await,
    }
}
