//! Manifest text to objects: pure, so every case is testable without files.

use std::fmt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kp_core::event::{ObjectEvent, SourceEvent};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_saphyr::MessageFormatter as _;
use tracing::debug;

use crate::decoded::{Decoded, Watched};
use crate::defaults::{DefaultsError, default_endpoint_slice, default_service, shown};
use crate::strict::{StrictError, check_endpoint_slice, check_node, check_service};

/// The namespace of a namespaced object that names none, as `kubectl apply` without `-n`
/// would use with a default kubeconfig context.
pub const DEFAULT_NAMESPACE: &str = "default";

/// A Kubernetes object the proxy uses, with the API server's defaults applied.
// Objects become `SourceEvent`s, which carry them unboxed for the same reason.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A `v1` Service.
    Service(Service),
    /// A `discovery.k8s.io/v1` EndpointSlice.
    EndpointSlice(EndpointSlice),
    /// A `v1` Node.
    Node(Node),
    /// A `networking.k8s.io/v1` ServiceCIDR.
    ServiceCidr(ServiceCIDR),
}

/// The kinds of [`Object`], in the order their events are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `v1` Service.
    Service,
    /// `discovery.k8s.io/v1` EndpointSlice.
    EndpointSlice,
    /// `v1` Node.
    Node,
    /// `networking.k8s.io/v1` ServiceCIDR.
    ServiceCidr,
}

impl Kind {
    /// The API's kind name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        }
    }
}

/// What identifies an object: two definitions with the same key are the same object.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey {
    /// The kind.
    pub kind: Kind,
    /// The namespace; empty for Nodes, which have none.
    pub namespace: String,
    /// The name.
    pub name: String,
}

impl fmt::Display for ObjectKey {
    /// `Kind namespace/name`, control characters in names escaped (one line whatever the
    /// names hold).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = shown(&self.name);
        if self.namespace.is_empty() {
            write!(f, "{} {name}", self.kind.as_str())
        } else {
            write!(
                f,
                "{} {}/{name}",
                self.kind.as_str(),
                shown(&self.namespace)
            )
        }
    }
}

impl Object {
    fn metadata(&self) -> &ObjectMeta {
        match self {
            Object::Service(o) => &o.metadata,
            Object::EndpointSlice(o) => &o.metadata,
            Object::Node(o) => &o.metadata,
            Object::ServiceCidr(o) => &o.metadata,
        }
    }

    /// The object's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Object::Service(_) => Kind::Service,
            Object::EndpointSlice(_) => Kind::EndpointSlice,
            Object::Node(_) => Kind::Node,
            Object::ServiceCidr(_) => Kind::ServiceCidr,
        }
    }

    /// The object's identity.
    pub fn key(&self) -> ObjectKey {
        let metadata = self.metadata();
        ObjectKey {
            kind: self.kind(),
            namespace: metadata.namespace.clone().unwrap_or_default(),
            name: metadata.name.clone().unwrap_or_default(),
        }
    }

    /// The event saying this object was created or updated.
    pub fn applied(self) -> SourceEvent {
        match self {
            Object::Service(o) => SourceEvent::Service(ObjectEvent::Applied(o)),
            Object::EndpointSlice(o) => SourceEvent::EndpointSlice(ObjectEvent::Applied(o)),
            Object::Node(o) => SourceEvent::Node(ObjectEvent::Applied(o)),
            Object::ServiceCidr(o) => SourceEvent::ServiceCidr(ObjectEvent::Applied(o)),
        }
    }

    /// The event saying this object was deleted.
    pub fn deleted(self) -> SourceEvent {
        match self {
            Object::Service(o) => SourceEvent::Service(ObjectEvent::Deleted(o)),
            Object::EndpointSlice(o) => SourceEvent::EndpointSlice(ObjectEvent::Deleted(o)),
            Object::Node(o) => SourceEvent::Node(ObjectEvent::Deleted(o)),
            Object::ServiceCidr(o) => SourceEvent::ServiceCidr(ObjectEvent::Deleted(o)),
        }
    }
}

/// A broken document (or an unreadable file), with where it is.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub struct ManifestError {
    /// The file.
    pub file: PathBuf,
    /// The document's 1-based index in the file (YAML documents, or JSON values in a stream);
    /// `None` when the whole file is affected.
    pub document: Option<usize>,
    /// 1-based line of the problem, or of the document's start when nothing more precise is
    /// known.
    pub line: Option<usize>,
    /// 1-based column, when known.
    pub column: Option<usize>,
    /// The 0-based index in a `kind: List`'s `items`, for a broken list item.
    pub item: Option<usize>,
    /// What is wrong.
    pub problem: Problem,
}

impl fmt::Display for ManifestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        if let Some(document) = self.document {
            write!(f, ": document {document}")?;
        }
        if let Some(item) = self.item {
            write!(f, ", items[{item}]")?;
        }
        write!(f, ": {}", self.problem)
    }
}

/// Why a document was skipped.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Problem {
    /// The file could not be read (permissions, not UTF-8, ...).
    #[error("cannot read the file: {0}")]
    Read(String),
    /// Not valid YAML or JSON, or a field has the wrong type.
    #[error("{0}")]
    Decode(String),
    /// `apiVersion` or `kind` is missing, so the object cannot be recognised.
    #[error("apiVersion and kind are required")]
    MissingKind,
    /// `metadata.name` is missing or empty; `generateName` needs an API server.
    #[error("{0} has no metadata.name")]
    MissingName(&'static str),
    /// The API server's defaults cannot be applied.
    #[error(transparent)]
    Defaults(#[from] DefaultsError),
    /// An address value the API server refuses in a new object (see [`crate::strict`]).
    #[error(transparent)]
    Strict(#[from] StrictError),
}

/// Parse one manifests file's text into objects (defaults applied, namespace defaulted) and
/// the errors of the documents that were skipped.
///
/// `file` names the file in errors, and picks the format: `.json` is a stream of JSON values,
/// anything else multi-document YAML. A `v1` `List` contributes its items. Objects of other
/// kinds are ignored (debug log): a directory may hold manifests for other components.
pub fn parse_manifests(text: &str, file: &Path) -> (Vec<Object>, Vec<ManifestError>) {
    let mut objects = Vec::new();
    let errors = parse_manifests_each(text, file, |object| objects.push(object));
    (objects, errors)
}

/// [`parse_manifests`], handing each object to `each` as soon as it is decoded instead of
/// collecting them: a caller that keeps a compact form of each object never holds a whole
/// file's typed objects (about ten times the size of their YAML) at once. Objects arrive in
/// file order; the errors are returned at the end.
pub fn parse_manifests_each(
    text: &str,
    file: &Path,
    mut each: impl FnMut(Object),
) -> Vec<ManifestError> {
    let (documents, mut errors) = split_documents(text, file);
    for document in &documents {
        errors.extend(decode_document(document, file, &mut each));
    }
    errors
}

/// Split a file's text into its documents without decoding any, and the error that ended a
/// JSON stream early (JSON has no boundary to resume at), if any. Each document decodes on
/// its own ([`decode_document`]) to the same objects wherever it is in the file, so a caller
/// can skip documents whose text it has decoded before.
pub(super) fn split_documents<'a>(
    text: &'a str,
    file: &Path,
) -> (Vec<Document<'a>>, Vec<ManifestError>) {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut parser = Parser {
        file,
        each: &mut |_| {},
        errors: Vec::new(),
    };
    let json = file.extension().is_some_and(|ext| ext == "json");
    let documents = if json {
        json_documents(text, &mut parser)
    } else {
        yaml_documents(text)
    };
    (documents, parser.errors)
}

/// Decode one document of `file` (from [`split_documents`]), handing each object to `each`;
/// the document's errors.
pub(super) fn decode_document(
    document: &Document<'_>,
    file: &Path,
    mut each: impl FnMut(Object),
) -> Vec<ManifestError> {
    let mut parser = Parser {
        file,
        each: &mut each,
        errors: Vec::new(),
    };
    parser.document(document);
    parser.errors
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Yaml,
    Json,
}

/// One document of a file: its text, where it starts, how to decode it.
#[derive(Debug)]
pub(super) struct Document<'a> {
    index: usize,
    /// 1-based line of the document's first line in the file.
    start_line: usize,
    text: &'a str,
    format: Format,
}

impl Document<'_> {
    /// The text the document's objects depend on: its text without a bare `---` line it
    /// starts with (which only separates it from the previous one), so the first document
    /// of a file, which needs none, is the same document after another is put before it.
    pub(super) fn content(&self) -> &str {
        let text = self.text;
        text.strip_prefix("---\n")
            .or_else(|| text.strip_prefix("---\r\n"))
            .unwrap_or(text)
    }
}

/// A decoding failure inside a document: message and position in the file.
struct Failure {
    message: String,
    line: Option<usize>,
    column: Option<usize>,
}

/// Whether `line` is the YAML marker `marker` (`---` or `...`) at column 0, alone or followed
/// by whitespace (`--- |`, `--- # comment`).
fn is_marker(line: &str, marker: &str) -> bool {
    line.strip_prefix(marker)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r', '\n']))
}

/// Split YAML text into documents at `---` and after `...` lines, so a broken document cannot
/// hide the others: YAML forbids these markers at column 0 inside a document, so the split
/// is exact. Leading empty text (before a first `---`) is not a document.
fn yaml_documents(text: &str) -> Vec<Document<'_>> {
    // (start byte, start line) of each chunk.
    let mut starts = vec![(0usize, 1usize)];
    let mut offset = 0;
    for (number, line) in text.split_inclusive('\n').enumerate() {
        let line_number = number + 1;
        if is_marker(line, "---") {
            starts.push((offset, line_number));
        } else if is_marker(line, "...") {
            starts.push((offset + line.len(), line_number + 1));
        }
        offset += line.len();
    }
    let mut documents = Vec::new();
    for (position, &(start, start_line)) in starts.iter().enumerate() {
        let end = starts.get(position + 1).map_or(text.len(), |&(end, _)| end);
        let chunk = &text[start..end];
        let opens_document = is_marker(chunk, "---");
        if !opens_document && is_blank(chunk) {
            continue;
        }
        documents.push(Document {
            index: documents.len() + 1,
            start_line,
            text: chunk,
            format: Format::Yaml,
        });
    }
    documents
}

/// Only whitespace, comments and document-end markers.
fn is_blank(chunk: &str) -> bool {
    chunk.lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || is_marker(line, "...")
    })
}

/// Split a stream of JSON values into one document per value. A syntax error ends the
/// stream (JSON has no boundary to resume at) and is reported.
fn json_documents<'a>(text: &'a str, parser: &mut Parser<'_>) -> Vec<Document<'a>> {
    let mut documents = Vec::new();
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<serde::de::IgnoredAny>();
    loop {
        let start = stream.byte_offset();
        match stream.next() {
            None => break,
            Some(Ok(_)) => {
                let end = stream.byte_offset();
                // The value starts after the whitespace separating it from the previous one.
                let skipped = text[start..end].len() - text[start..end].trim_start().len();
                let start = start + skipped;
                documents.push(Document {
                    index: documents.len() + 1,
                    start_line: line_of(text, start),
                    text: &text[start..end],
                    format: Format::Json,
                });
            }
            Some(Err(error)) => {
                let failure = json_failure(&error, 1);
                parser.error(
                    Some(documents.len() + 1),
                    failure.line,
                    failure.column,
                    None,
                    Problem::Decode(failure.message),
                );
                break;
            }
        }
    }
    documents
}

/// 1-based line number of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    let offset = offset.min(text.len());
    1 + text.as_bytes()[..offset]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

fn json_failure(error: &serde_json::Error, start_line: usize) -> Failure {
    let text = error.to_string();
    // serde_json appends " at line L column C"; the position is reported separately.
    let suffix = format!(" at line {} column {}", error.line(), error.column());
    let message = text.strip_suffix(&suffix).unwrap_or(&text).to_owned();
    let known = error.line() > 0;
    Failure {
        message,
        line: known.then(|| start_line + error.line() - 1),
        column: known.then_some(error.column()),
    }
}

fn decode<T: DeserializeOwned>(document: &Document<'_>) -> Result<T, Failure> {
    match document.format {
        Format::Yaml => serde_saphyr::from_str(document.text).map_err(|error| {
            let location = error.location().filter(|l| l.line() > 0);
            let message =
                serde_saphyr::UserMessageFormatter.format_message(error.without_snippet());
            Failure {
                // Messages can quote the input: keep a log line one line.
                message: message
                    .chars()
                    .map(|c| if c.is_control() { ' ' } else { c })
                    .collect(),
                line: location.and_then(|l| {
                    usize::try_from(l.line())
                        .ok()
                        .map(|line| document.start_line + line - 1)
                }),
                column: location.and_then(|l| usize::try_from(l.column()).ok()),
            }
        }),
        Format::Json => serde_json::from_str(document.text)
            .map_err(|error| json_failure(&error, document.start_line)),
    }
}

/// Just enough of an object to know what it is; every other field is ignored.
#[derive(Deserialize)]
struct Header {
    #[serde(rename = "apiVersion")]
    api_version: Option<String>,
    kind: Option<String>,
}

/// A `v1` `List`; items are typed one by one so a broken item only loses itself.
#[derive(Deserialize)]
struct List {
    #[serde(default)]
    items: Vec<serde_saphyr::Spanned<serde_json::Value>>,
}

/// The kinds the proxy reads, by `apiVersion` and `kind`.
fn known_kind(api_version: &str, kind: &str) -> Option<Kind> {
    match (api_version, kind) {
        ("v1", "Service") => Some(Kind::Service),
        ("discovery.k8s.io/v1", "EndpointSlice") => Some(Kind::EndpointSlice),
        ("v1", "Node") => Some(Kind::Node),
        ("networking.k8s.io/v1", "ServiceCIDR") => Some(Kind::ServiceCidr),
        _ => None,
    }
}

struct Parser<'f> {
    file: &'f Path,
    /// Where decoded objects go.
    each: &'f mut dyn FnMut(Object),
    errors: Vec<ManifestError>,
}

impl Parser<'_> {
    fn error(
        &mut self,
        document: Option<usize>,
        line: Option<usize>,
        column: Option<usize>,
        item: Option<usize>,
        problem: Problem,
    ) {
        self.errors.push(ManifestError {
            file: self.file.to_owned(),
            document,
            line,
            column,
            item,
            problem,
        });
    }

    fn failure(&mut self, document: &Document<'_>, failure: Failure) {
        self.error(
            Some(document.index),
            failure.line.or(Some(document.start_line)),
            failure.column,
            None,
            Problem::Decode(failure.message),
        );
    }

    fn document(&mut self, document: &Document<'_>) {
        let header = match decode::<Option<Header>>(document) {
            Ok(Some(header)) => header,
            // An empty or null document, as between `---` lines.
            Ok(None) => return,
            Err(failure) => return self.failure(document, failure),
        };
        let at_start = Some(document.start_line);
        let (Some(api_version), Some(kind)) = (header.api_version, header.kind) else {
            return self.error(
                Some(document.index),
                at_start,
                None,
                None,
                Problem::MissingKind,
            );
        };
        if api_version == "v1" && kind == "List" {
            return self.list(document);
        }
        let Some(kind) = known_kind(&api_version, &kind) else {
            debug!(
                file = %self.file.display(),
                document = document.index,
                "ignoring {api_version} {kind}: not an object the proxy uses"
            );
            return;
        };
        let read = || decode::<serde_json::Value>(document).ok();
        let object = match kind {
            Kind::Service => typed_or_read(decode(document), read).map(Object::Service),
            Kind::EndpointSlice => typed_or_read(decode(document), read).map(Object::EndpointSlice),
            Kind::Node => typed_or_read(decode(document), read).map(Object::Node),
            Kind::ServiceCidr => typed_or_read(decode(document), read).map(Object::ServiceCidr),
        };
        match object.map(finish) {
            Ok(Ok(object)) => (self.each)(object),
            Ok(Err(problem)) => self.error(Some(document.index), at_start, None, None, problem),
            Err(failure) => self.failure(document, failure),
        }
    }

    fn list(&mut self, document: &Document<'_>) {
        let list = match decode::<List>(document) {
            Ok(list) => list,
            Err(failure) => return self.failure(document, failure),
        };
        for (index, item) in list.items.into_iter().enumerate() {
            // YAML items know their line; JSON ones only their document's.
            let line = usize::try_from(item.referenced.line())
                .ok()
                .filter(|&line| line > 0)
                .map_or(document.start_line, |line| document.start_line + line - 1);
            let problem = match item_object(item.value) {
                Ok(Some(object)) => {
                    (self.each)(object);
                    continue;
                }
                Ok(None) => continue,
                Err(problem) => problem,
            };
            self.error(Some(document.index), Some(line), None, Some(index), problem);
        }
    }
}

/// One `List` item: typed by its own `apiVersion` and `kind`.
fn item_object(value: serde_json::Value) -> Result<Option<Object>, Problem> {
    let field = |name: &str| value.get(name).and_then(|v| v.as_str()).map(str::to_owned);
    let (Some(api_version), Some(kind)) = (field("apiVersion"), field("kind")) else {
        return Err(Problem::MissingKind);
    };
    let Some(known) = known_kind(&api_version, &kind) else {
        debug!("ignoring List item {api_version} {kind}: not an object the proxy uses");
        return Ok(None);
    };
    let object = match known {
        Kind::Service => item_typed(value).map(Object::Service),
        Kind::EndpointSlice => item_typed(value).map(Object::EndpointSlice),
        Kind::Node => item_typed(value).map(Object::Node),
        Kind::ServiceCidr => item_typed(value).map(Object::ServiceCidr),
    }?;
    finish(object).map(Some)
}

/// One `List` item typed by [`typed_or_read`].
fn item_typed<K: Watched>(value: serde_json::Value) -> Result<K, Problem> {
    let strict =
        serde_json::from_value(value.clone()).map_err(|error| Problem::Decode(error.to_string()));
    typed_or_read(strict, || Some(value))
}

/// The object as its strict type decoded it, or, when that failed, decoded by the fields the
/// proxy reads ([`crate::decoded`]): a value the API server would store in a field the proxy
/// never reads (a `null` timestamp) loses nothing, as from the API server. When the read
/// fields fail too, the strict error stands (it knows the line and column).
fn typed_or_read<K: Watched, E>(
    strict: Result<K, E>,
    read: impl FnOnce() -> Option<serde_json::Value>,
) -> Result<K, E> {
    let error = match strict {
        Ok(object) => return Ok(object),
        Err(error) => error,
    };
    match read().map(Decoded::<K>::from_value) {
        Some(Decoded::Usable(object)) => {
            debug!("decoded by the fields the proxy reads; another field did not decode");
            Ok(object)
        }
        _ => Err(error),
    }
}

/// What `kubectl apply` and the API server add: the default namespace (none for Nodes and
/// ServiceCIDRs, which are cluster-scoped), the API's create-time address validation
/// ([`crate::strict`]) and its defaults. The name is required.
fn finish(mut object: Object) -> Result<Object, Problem> {
    let kind = object.kind();
    let metadata = match &mut object {
        Object::Service(o) => &mut o.metadata,
        Object::EndpointSlice(o) => &mut o.metadata,
        Object::Node(o) => &mut o.metadata,
        Object::ServiceCidr(o) => &mut o.metadata,
    };
    if metadata.name.as_deref().is_none_or(str::is_empty) {
        return Err(Problem::MissingName(kind.as_str()));
    }
    if matches!(kind, Kind::Node | Kind::ServiceCidr) {
        metadata.namespace = None;
    } else if metadata.namespace.as_deref().is_none_or(str::is_empty) {
        metadata.namespace = Some(DEFAULT_NAMESPACE.to_owned());
    }
    // Validated as written, before defaults copy values around (clusterIP to clusterIPs).
    // ServiceCIDRs are validated strictly by the model itself, whatever their source.
    match &object {
        Object::Service(service) => check_service(service)?,
        Object::EndpointSlice(slice) => check_endpoint_slice(slice)?,
        Object::Node(node) => check_node(node)?,
        Object::ServiceCidr(_) => {}
    }
    match &mut object {
        Object::Service(service) => default_service(service)?,
        Object::EndpointSlice(slice) => default_endpoint_slice(slice),
        Object::Node(_) | Object::ServiceCidr(_) => {}
    }
    Ok(object)
}
