//! The blocking half of the manifests source: look at the files, re-read what changed, and
//! diff the whole object set against what was reported.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kp_core::event::SourceEvent;
use prometheus_client::metrics::counter::Counter;
use tracing::{debug, info, warn};

use super::guard::{Decision, Guard};
use super::parse::{
    Kind, ManifestError, Object, ObjectKey, Problem, decode_document, split_documents,
};
use super::settle::{Look, Timing, Writers};

/// File name extensions read from a directory, as `kubectl apply -f DIR` does.
const EXTENSIONS: [&str; 3] = ["yaml", "yml", "json"];

/// Everything that changes when a file's content may have: size, modification and change
/// times, and which inode it is (an atomic rename or a ConfigMap symlink swap makes the name
/// point at another file, even with the same size and times), and where its symlinks lead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    inode: (u64, u64),
    target: Option<PathBuf>,
    /// A `stat` error other than "not found": the read will fail and report it.
    error: Option<io::ErrorKind>,
}

/// Modification time as (seconds, nanoseconds) since the epoch.
#[cfg(unix)]
fn mtime(metadata: &std::fs::Metadata) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    (metadata.mtime(), metadata.mtime_nsec())
}

/// Change time as (seconds, nanoseconds) since the epoch.
#[cfg(unix)]
fn ctime(metadata: &std::fs::Metadata) -> (i64, i64) {
    use std::os::unix::fs::MetadataExt;
    (metadata.ctime(), metadata.ctime_nsec())
}

/// Device and inode.
#[cfg(unix)]
fn inode(metadata: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (metadata.dev(), metadata.ino())
}

/// Modification time as (seconds, nanoseconds) since the epoch (0 before it).
#[cfg(not(unix))]
fn mtime(metadata: &std::fs::Metadata) -> (i64, i64) {
    let since = metadata
        .modified()
        .ok()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .unwrap_or_default();
    (
        i64::try_from(since.as_secs()).unwrap_or(i64::MAX),
        i64::from(since.subsec_nanos()),
    )
}

/// Stable std has no change time off Unix: the modification time stands in.
#[cfg(not(unix))]
fn ctime(metadata: &std::fs::Metadata) -> (i64, i64) {
    mtime(metadata)
}

/// Stable std has no file identity off Unix: a rename over a file of the same size and
/// modification time goes unseen there.
#[cfg(not(unix))]
fn inode(_metadata: &std::fs::Metadata) -> (u64, u64) {
    (0, 0)
}

impl Stamp {
    fn of(path: &Path) -> Result<Option<Stamp>, io::Error> {
        let metadata = match std::fs::metadata(path) {
            Ok(metadata) => metadata,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error),
        };
        if metadata.is_dir() {
            return Ok(None);
        }
        Ok(Some(Stamp {
            len: metadata.len(),
            mtime: mtime(&metadata),
            ctime: ctime(&metadata),
            inode: inode(&metadata),
            target: std::fs::canonicalize(path).ok(),
            error: None,
        }))
    }

    fn unreadable(kind: io::ErrorKind) -> Stamp {
        Stamp {
            len: 0,
            mtime: (0, 0),
            ctime: (0, 0),
            inode: (0, 0),
            target: None,
            error: Some(kind),
        }
    }

    /// Whether the file was modified so recently that another write within the same
    /// timestamp tick could go unnoticed (same size, same times).
    fn is_recent(&self, now: SystemTime, window: Duration) -> bool {
        let Ok(secs) = u64::try_from(self.mtime.0) else {
            return false;
        };
        let nanos = u32::try_from(self.mtime.1).unwrap_or(0);
        let mtime = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos);
        now.duration_since(mtime).is_ok_and(|age| age < window)
    }
}

/// What one file contributes.
#[derive(Debug, Default)]
struct FileState {
    /// The stamp the objects were read at; `None` forces a re-read (see `Stamp::is_recent`).
    stamp: Option<Stamp>,
    /// Hash of the content last parsed, so an unchanged re-read is not parsed (nor its
    /// errors reported) again.
    content: Option<TextHash>,
    /// The objects this file contributes: the last parse, plus, while the file has broken
    /// documents, objects it contributed before that are now missing. Keys and content
    /// hashes only, once the poll that read them has made its events.
    objects: Vec<Stored>,
    /// The documents of the last parse, in file order: the hash of each one's text and how
    /// many of `objects` (in order, from the first) it contributed; the objects after them
    /// are the kept ones. A document whose text hash is here is not decoded again: its
    /// objects are reused. `None` for a document with errors, which is always decoded (and
    /// its errors reported) again.
    documents: Documents,
}

/// A file's documents as [`FileState::documents`] lays them out.
type Documents = Vec<(Option<TextHash>, usize)>;

/// A 128-bit hash of a text: two SipHashes under keys drawn at random for this process, so
/// no input can be crafted to collide, and an accidental collision (a changed document
/// taken for unchanged) is as unlikely as it gets without keeping the text itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct TextHash(u64, u64);

/// Builds [`TextHash`]es; the same keys for the scanner's lifetime.
#[derive(Debug, Default)]
struct TextHasher([RandomState; 2]);

impl TextHasher {
    fn of(&self, text: &str) -> TextHash {
        self.of_bytes(text.as_bytes())
    }

    fn of_bytes(&self, bytes: &[u8]) -> TextHash {
        let one = |state: &RandomState| {
            let mut hasher = state.build_hasher();
            bytes.len().hash(&mut hasher);
            bytes.hash(&mut hasher);
            hasher.finish()
        };
        TextHash(one(&self.0[0]), one(&self.0[1]))
    }
}

/// An object as the scanner keeps it: its key and a hash of its JSON serialization, which
/// decides whether it changed. The object itself ([`Body`]) is kept only from its decoding
/// until its event is sent: after each poll the files' and the reported sets keep the key and
/// hash alone (at 10k services the bodies were 9 MB of the proxy's peak heap). An object that
/// must be reported later without having been decoded in that poll (another file's
/// definition of it went away) is decoded again from its file ([`Scanner::recover`]).
#[derive(Clone, Debug)]
pub(super) struct Stored {
    key: ObjectKey,
    hash: TextHash,
    body: Option<Body>,
}

/// The object, until its event is sent: its JSON serialization LZ4-compressed (EndpointSlices
/// repeat the same field names for every endpoint: about a third of the size, which matters
/// while a first load's objects wait to be sent), or, for an object whose serialization does
/// not give back an equal object (it cannot happen with the API's types, but nothing is taken
/// on trust), the object as it is.
#[derive(Clone, Debug)]
pub(super) enum Body {
    /// The JSON serialization, LZ4-compressed with its length prepended.
    Json(Arc<[u8]>),
    Object(Arc<Object>),
}

impl Body {
    /// The object of `key`.
    fn object(&self, key: &ObjectKey) -> Object {
        match self {
            Body::Object(object) => Object::clone(object),
            // Checked to decode when stored.
            Body::Json(packed) => lz4_flex::decompress_size_prepended(packed)
                .ok()
                .and_then(|json| decode(key.kind, &json))
                .unwrap_or_else(|| unreachable!("{key} stored as JSON that decodes")),
        }
    }
}

impl Stored {
    fn new(object: Object, hasher: &TextHasher) -> Stored {
        let key = object.key();
        let json = match &object {
            Object::Service(o) => serde_json::to_vec(o),
            Object::EndpointSlice(o) => serde_json::to_vec(o),
            Object::Node(o) => serde_json::to_vec(o),
            Object::ServiceCidr(o) => serde_json::to_vec(o),
        };
        let (hash, body) = match json {
            Ok(json) if decode(key.kind, &json).as_ref() == Some(&object) => (
                hasher.of_bytes(&json),
                Body::Json(lz4_flex::compress_prepend_size(&json).into()),
            ),
            _ => (
                hasher.of(&format!("{object:?}")),
                Body::Object(Arc::new(object)),
            ),
        };
        Stored {
            key,
            hash,
            body: Some(body),
        }
    }

    fn key(&self) -> ObjectKey {
        self.key.clone()
    }
}

/// An object of `kind` from its JSON serialization.
fn decode(kind: Kind, json: &[u8]) -> Option<Object> {
    match kind {
        Kind::Service => serde_json::from_slice(json).map(Object::Service).ok(),
        Kind::EndpointSlice => serde_json::from_slice(json).map(Object::EndpointSlice).ok(),
        Kind::Node => serde_json::from_slice(json).map(Object::Node).ok(),
        Kind::ServiceCidr => serde_json::from_slice(json).map(Object::ServiceCidr).ok(),
    }
}

/// One change to report. The object is decoded from its compact form only when its event is
/// made, and freed once sent, so a first load of many objects never holds them all at once.
#[derive(Debug)]
pub(super) enum Change {
    /// Created or updated.
    Applied(ObjectKey, Body),
    /// Deleted. The scanner keeps no deleted object, so the event carries its kind,
    /// namespace and name: what identifies it, and all its consumers look at.
    Deleted(ObjectKey),
}

impl Change {
    /// The event to send.
    pub(super) fn event(self) -> SourceEvent {
        match self {
            Change::Applied(key, body) => body.object(&key).applied(),
            Change::Deleted(key) => identity(&key).deleted(),
        }
    }
}

/// An object with only the metadata that identifies it.
fn identity(key: &ObjectKey) -> Object {
    let namespace = (!key.namespace.is_empty()).then(|| key.namespace.clone());
    let name = key.name.clone();
    match key.kind {
        Kind::Service => Object::Service(crate::identity(namespace, name)),
        Kind::EndpointSlice => Object::EndpointSlice(crate::identity(namespace, name)),
        Kind::Node => Object::Node(crate::identity(namespace, name)),
        Kind::ServiceCidr => Object::ServiceCidr(crate::identity(namespace, name)),
    }
}

/// The outcome of one poll.
#[derive(Debug, Default)]
pub(super) struct Poll {
    /// What changed since the last poll.
    pub events: Vec<Change>,
    /// The path could be listed, and every file seen has been read.
    pub complete: bool,
    /// Changes were seen and wait for a confirming look after a short settle time.
    pub settling: bool,
    /// A read is held back by the removal guard: look again after this long at the latest.
    pub recheck: Option<Duration>,
}

impl Poll {
    /// The Node among the changes (the scanner reports only this node's).
    pub(super) fn node(&self) -> Option<Node> {
        self.events.iter().find_map(|change| match change {
            Change::Applied(key, body) if key.kind == Kind::Node => match body.object(key) {
                Object::Node(node) => Some(node),
                _ => None,
            },
            _ => None,
        })
    }
}

/// The state of the files and what has been reported.
pub(super) struct Scanner {
    root: PathBuf,
    node_name: Option<String>,
    errors: Counter,
    /// Documents decoded (not reused from an unchanged text).
    decoded: Counter,
    hasher: TextHasher,
    /// How long a change must stay the same before it is applied.
    timing: Timing,
    /// Holds back reads that would remove many Services.
    guard: Guard,
    /// Reads the guard held back.
    held: Counter,
    files: BTreeMap<PathBuf, FileState>,
    /// Changes seen and not read yet: the new stamp (`None`: the file vanished) and when it
    /// was first seen.
    pending: BTreeMap<PathBuf, (Option<Stamp>, Instant)>,
    /// The objects reported: each one's content hash, by key.
    reported: BTreeMap<ObjectKey, TextHash>,
    /// The problem last reported for the path itself, to report each once.
    root_problem: Option<String>,
    /// Whether the files have been read once; the first load needs no confirmation.
    loaded: bool,
}

/// The scanner's counters.
#[derive(Clone, Debug, Default)]
pub(super) struct Counters {
    /// Broken documents and unreadable files.
    pub errors: Counter,
    /// Documents decoded.
    pub decoded: Counter,
    /// Reads held back by the removal guard.
    pub held: Counter,
}

impl Scanner {
    pub(super) fn new(
        root: PathBuf,
        node_name: Option<String>,
        counters: Counters,
        timing: Timing,
        guard: Guard,
    ) -> Scanner {
        Scanner {
            root,
            node_name,
            errors: counters.errors,
            decoded: counters.decoded,
            held: counters.held,
            hasher: TextHasher::default(),
            timing,
            guard,
            files: BTreeMap::new(),
            pending: BTreeMap::new(),
            reported: BTreeMap::new(),
            root_problem: None,
            loaded: false,
        }
    }

    /// Look at the files once (at `now`, with what the watch saw of their `writers`); read
    /// the ones whose change has settled (or all, the first time), and return the events for
    /// the resulting object set.
    pub(super) fn poll(&mut self, writers: &Writers, now: Instant) -> Poll {
        let Some((seen, exists)) = self.list() else {
            return Poll::default();
        };
        if self.guard.reread_due(now) {
            // A held read is confirmed by reading every file again, each as a change.
            for state in self.files.values_mut() {
                state.stamp = None;
            }
        }
        let paths: Vec<PathBuf> = self.files.keys().chain(seen.keys()).cloned().collect();
        let mut changed = false;
        let mut settling = false;
        for path in paths {
            let current = seen.get(&path).cloned();
            let known = self.files.get(&path).map(|state| state.stamp.clone());
            if known.is_none() && current.is_none()
                || known.as_ref() == Some(&current) && current.is_some()
            {
                self.pending.remove(&path);
                continue;
            }
            let look = self.look(&path, &current, known.flatten().as_ref(), writers, now);
            // The first load applies everything at once; later changes once they have
            // settled (see `settle`): a writer may be between truncating and writing, or an
            // editor between moving the old file away and writing the new one.
            if self.loaded && !self.timing.may_read(&look) {
                settling = true;
                continue;
            }
            let done = match current {
                Some(stamp) => self.read(&path, stamp, &look),
                None => {
                    info!(file = %path.display(), "manifests file removed; its objects are deleted");
                    self.files.remove(&path);
                    Some(false)
                }
            };
            match done {
                Some(recent) => {
                    self.pending.remove(&path);
                    changed = true;
                    settling |= recent;
                }
                None => settling = true,
            }
        }
        self.loaded = true;
        let events = if changed || self.guard.holding() {
            self.diff(now)
        } else {
            Vec::new()
        };
        Poll {
            events,
            complete: exists && self.pending.is_empty() && !self.guard.holding(),
            settling,
            recheck: self.guard.wake_in(now),
        }
    }

    /// A look at `path`'s change to `current` from `known` (`None`: new, or forced to be
    /// read again), remembering when it was first seen as it is now.
    fn look(
        &mut self,
        path: &Path,
        current: &Option<Stamp>,
        known: Option<&Stamp>,
        writers: &Writers,
        now: Instant,
    ) -> Look {
        let stable_for = match self.pending.get(path) {
            Some((stamp, since)) if stamp == current => Some(now.duration_since(*since)),
            _ => {
                self.pending.insert(path.to_owned(), (current.clone(), now));
                None
            }
        };
        let had_content = known.is_some_and(|stamp| stamp.len > 0)
            || self
                .files
                .get(path)
                .is_some_and(|state| !state.objects.is_empty());
        Look {
            writer: writers.of(path),
            stable_for,
            emptied: had_content && current.as_ref().is_none_or(|stamp| stamp.len == 0),
        }
    }

    /// The files to read, with their stamps, and whether the path exists; `None` when the
    /// path cannot be listed. Problems are reported once each. A missing path lists as no
    /// files.
    fn list(&mut self) -> Option<(BTreeMap<PathBuf, Stamp>, bool)> {
        let listing = self.try_list();
        let problem = match &listing {
            Ok((_, problem)) => problem.clone(),
            Err(error) => Some(format!(
                "cannot list manifests path {}: {error}",
                self.root.display()
            )),
        };
        if problem != self.root_problem {
            match &problem {
                Some(problem) => warn!("{problem}"),
                None => info!(path = %self.root.display(), "manifests path is readable again"),
            }
            self.root_problem = problem;
        }
        listing
            .ok()
            .map(|(files, problem)| (files, problem.is_none()))
    }

    fn try_list(&self) -> io::Result<(BTreeMap<PathBuf, Stamp>, Option<String>)> {
        let mut files = BTreeMap::new();
        let metadata = match std::fs::metadata(&self.root) {
            Ok(metadata) => metadata,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let problem = format!(
                    "manifests path {} does not exist; watching for it to appear",
                    self.root.display()
                );
                return Ok((files, Some(problem)));
            }
            Err(error) => return Err(error),
        };
        if !metadata.is_dir() {
            // A single file, whatever its name.
            files.insert(self.root.clone(), stamp_or_error(&self.root));
            return Ok((files, None));
        }
        for entry in std::fs::read_dir(&self.root)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                debug!(path = %entry.path().display(), "skipping a file name that is not UTF-8");
                continue;
            };
            // Hidden files, and a ConfigMap volume's `..data` and `..2026_...` entries: the
            // visible names are symlinks into them.
            if name.starts_with('.') {
                continue;
            }
            let Some((_, extension)) = name.rsplit_once('.') else {
                continue;
            };
            if !EXTENSIONS.contains(&extension) {
                continue;
            }
            let path = entry.path();
            match Stamp::of(&path) {
                Ok(Some(stamp)) => {
                    files.insert(path, stamp);
                }
                // Gone since listed, a dangling symlink, or a directory.
                Ok(None) => {}
                Err(error) => {
                    files.insert(path, Stamp::unreadable(error.kind()));
                }
            }
        }
        Ok((files, None))
    }

    /// Read and parse one file; returns whether it must be looked at again soon, or `None`
    /// when what was read is not complete yet (see [`Timing::complete`]): nothing changes
    /// then.
    fn read(&mut self, path: &Path, stamp: Stamp, look: &Look) -> Option<bool> {
        let bytes = std::fs::read(path);
        if let Ok(bytes) = &bytes
            && !self.timing.complete(bytes, look)
        {
            debug!(file = %path.display(), "manifests file ends inside a line; reading it again once written");
            return None;
        }
        let recent = stamp.is_recent(SystemTime::now(), self.timing.settle);
        let state = self.files.entry(path.to_owned()).or_default();
        // Recently modified: force a re-read next time, in case a write lands within the same
        // timestamp tick (an unchanged content hash then makes it cheap and silent).
        state.stamp = if recent { None } else { Some(stamp) };
        let text = bytes
            .map_err(|error| error.to_string())
            .and_then(|bytes| String::from_utf8(bytes).map_err(|_| "not UTF-8 text".to_owned()));
        Some(self.take(path, text, recent))
    }

    /// Take `text` (or the error reading it) as `path`'s content; returns `recent`.
    fn take(&mut self, path: &Path, text: Result<String, String>, recent: bool) -> bool {
        let text = match text {
            Ok(text) => text,
            Err(message) => {
                let error = ManifestError {
                    file: path.to_owned(),
                    document: None,
                    line: None,
                    column: None,
                    item: None,
                    problem: Problem::Read(message),
                };
                self.report(&error);
                keep_notice(path, &self.files);
                return recent;
            }
        };
        let content = self.hasher.of(&text);
        let Some(state) = self.files.get_mut(path) else {
            return recent;
        };
        if state.content == Some(content) {
            return recent;
        }
        state.content = Some(content);
        let previous = std::mem::take(&mut state.objects);
        let previous_documents = std::mem::take(&mut state.documents);
        let (objects, documents, errors) = self.parse(&text, path, &previous, &previous_documents);
        // The text is not needed any more: free it before the objects are compared.
        drop(text);
        let Some(state) = self.files.get_mut(path) else {
            return recent;
        };
        state.documents = documents;
        if errors.is_empty() {
            state.objects = objects;
            return recent;
        }
        // Broken documents: keep what the file contributed before and is now missing, so a
        // half-written save never drops traffic; the file's next clean parse decides.
        let mut kept = previous;
        let fresh: BTreeSet<ObjectKey> = objects.iter().map(Stored::key).collect();
        kept.retain(|object| !fresh.contains(&object.key()));
        let kept_count = kept.len();
        state.objects = objects;
        state.objects.extend(kept);
        for error in &errors {
            self.report(error);
        }
        if kept_count > 0 {
            info!(
                file = %path.display(),
                "keeping {kept_count} object(s) from {} until it parses cleanly",
                path.display()
            );
        }
        recent
    }

    /// Parse a file's text, decoding only the documents whose text the previous parse
    /// (`previous` objects laid out by `previous_documents`) did not see: each object is
    /// turned into its compact stored form as soon as it is decoded, and a document seen
    /// before contributes the objects it did then. Returns the objects, their layout by
    /// document, and the errors.
    fn parse(
        &self,
        text: &str,
        path: &Path,
        previous: &[Stored],
        previous_documents: &[(Option<TextHash>, usize)],
    ) -> (Vec<Stored>, Documents, Vec<ManifestError>) {
        let started = Instant::now();
        let mut known: HashMap<TextHash, &[Stored]> = HashMap::new();
        let mut offset = 0;
        for &(hash, count) in previous_documents {
            let end = offset + count;
            if let (Some(hash), Some(objects)) = (hash, previous.get(offset..end)) {
                known.insert(hash, objects);
            }
            offset = end;
        }
        let (documents, mut errors) = split_documents(text, path);
        let mut objects = Vec::new();
        let mut layout = Vec::with_capacity(documents.len());
        let mut decoded = 0_u64;
        for document in &documents {
            let hash = self.hasher.of(document.content());
            if let Some(seen) = known.get(&hash) {
                objects.extend(seen.iter().cloned());
                layout.push((Some(hash), seen.len()));
                continue;
            }
            decoded += 1;
            let before = objects.len();
            let document_errors = decode_document(document, path, |object| {
                objects.push(Stored::new(object, &self.hasher));
            });
            let clean = document_errors.is_empty();
            errors.extend(document_errors);
            layout.push((clean.then_some(hash), objects.len() - before));
        }
        self.decoded.inc_by(decoded);
        // Kept until the file changes: no room for more.
        objects.shrink_to_fit();
        debug!(
            file = %path.display(),
            documents = documents.len(),
            decoded,
            took = ?started.elapsed(),
            "parsed manifests file"
        );
        (objects, layout, errors)
    }

    fn report(&self, error: &ManifestError) {
        self.errors.inc();
        warn!(
            file = %error.file.display(),
            document = error.document,
            line = error.line,
            "skipping broken manifest: {error}"
        );
    }

    /// The object set from all files (later file names win), against what was reported;
    /// nothing while the removal guard holds the read back.
    fn diff(&mut self, now: Instant) -> Vec<Change> {
        let mut wanted: BTreeMap<ObjectKey, (&Stored, &Path)> = BTreeMap::new();
        for (path, state) in &self.files {
            for object in &state.objects {
                let key = object.key();
                if key.kind == Kind::Node && self.node_name.as_deref() != Some(key.name.as_str()) {
                    debug!(file = %path.display(), "ignoring {key}: not this node");
                    continue;
                }
                match wanted.entry(key) {
                    Entry::Vacant(entry) => {
                        entry.insert((object, path));
                    }
                    Entry::Occupied(mut entry) => {
                        let (_, earlier) = entry.get();
                        if *earlier == path.as_path() {
                            warn!(
                                file = %path.display(),
                                "{} is defined twice in {}; the later definition wins",
                                entry.key(),
                                path.display()
                            );
                        } else {
                            warn!(
                                file = %path.display(),
                                "{} is defined in both {} and {}; the one in {} wins",
                                entry.key(),
                                earlier.display(),
                                path.display(),
                                path.display()
                            );
                        }
                        entry.insert((object, path));
                    }
                }
            }
        }
        let mut events = Vec::new();
        for key in self.reported.keys() {
            if !wanted.contains_key(key) {
                events.push(Change::Deleted(key.clone()));
            }
        }
        let removed: Vec<&ObjectKey> = events
            .iter()
            .filter_map(|change| match change {
                Change::Deleted(key) if key.kind == Kind::Service => Some(key),
                _ => None,
            })
            .collect();
        let known = self
            .reported
            .keys()
            .filter(|key| key.kind == Kind::Service)
            .count();
        let removal = self.hasher.of(&format!("{removed:?}")).0;
        let settled = self.pending.is_empty();
        match self
            .guard
            .decide(removal, removed.len(), known, settled, now)
        {
            Decision::Apply => {}
            Decision::Hold { first } => {
                if first {
                    self.held.inc();
                    held_notice(&removed, known, &self.guard);
                }
                return Vec::new();
            }
        }
        let mut reported = BTreeMap::new();
        for (key, (object, path)) in wanted {
            let old = self.reported.get(&key).copied();
            if old == Some(object.hash) {
                reported.insert(key, object.hash);
                continue;
            }
            let body = match &object.body {
                Some(body) => Some(body.clone()),
                None => self.recover(path, object),
            };
            match body {
                Some(body) => {
                    events.push(Change::Applied(key.clone(), body));
                    reported.insert(key, object.hash);
                }
                None => {
                    // Its file changed since, and the document no longer holds it: that
                    // file's own next read reports what it holds now. Until then the last
                    // reported version stays.
                    warn!(file = %path.display(), "cannot read {key} again from {}; keeping the version reported before", path.display());
                    if let Some(old) = old {
                        reported.insert(key, old);
                    }
                }
            }
        }
        self.reported = reported;
        // The events hold the only copies of the objects now: each is freed once sent.
        for state in self.files.values_mut() {
            for object in &mut state.objects {
                object.body = None;
            }
        }
        events
    }

    /// The object `stored` stands for, decoded again from `path`: it was not decoded in this
    /// poll (its document did not change) but must be reported now, as another file's
    /// definition of it went away. `None` when the file no longer has it.
    fn recover(&self, path: &Path, stored: &Stored) -> Option<Body> {
        let text = std::fs::read_to_string(path).ok()?;
        let (documents, _) = split_documents(&text, path);
        let mut found = None;
        for document in &documents {
            self.decoded.inc();
            decode_document(document, path, |object| {
                if found.is_none() && object.key() == stored.key {
                    let again = Stored::new(object, &self.hasher);
                    if again.hash == stored.hash {
                        found = again.body;
                    }
                }
            });
            if found.is_some() {
                break;
            }
        }
        found
    }
}

/// The one line that says a read is held back, and why.
fn held_notice(removed: &[&ObjectKey], known: usize, guard: &Guard) {
    let config = guard.config();
    let some: Vec<String> = removed.iter().take(3).map(ToString::to_string).collect();
    warn!(
        removed = removed.len(),
        known,
        "holding back a manifests read that would remove {} of {known} Services ({}, ...): more than {}% and at least {} at once; it is applied if the files still say so when read again",
        removed.len(),
        some.join(", "),
        config.percent,
        config.min,
    );
}

fn stamp_or_error(path: &Path) -> Stamp {
    match Stamp::of(path) {
        Ok(Some(stamp)) => stamp,
        Ok(None) => Stamp::unreadable(io::ErrorKind::NotFound),
        Err(error) => Stamp::unreadable(error.kind()),
    }
}

fn keep_notice(path: &Path, files: &BTreeMap<PathBuf, FileState>) {
    let count = files.get(path).map_or(0, |state| state.objects.len());
    if count > 0 {
        info!(
            file = %path.display(),
            "keeping {count} object(s) from {} until it can be read",
            path.display()
        );
    }
}
