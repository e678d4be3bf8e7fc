//! A fake Kubernetes API server speaking list/watch for the kinds kube-proxy watches
//! (Services, EndpointSlices, Nodes, ServiceCIDRs), with a real one's failure shapes.
//!
//! [`FakeApiServer`] is the state and the HTTP routes: paged lists with a resourceVersion,
//! watches as chunked newline-delimited JSON events, label and field selectors, and `410 Gone`
//! (`too old resource version`, reason `Expired`) for a watch from a resourceVersion older than
//! the server's history, which starts at the version it was created with. In-process tests
//! drive it directly.
//!
//! Fault tests need it as a process that can be stopped (`SIGSTOP`: connections hang) and
//! killed (connections are refused): `kp-echo apiserver` serves one (see [`serve_commands`]),
//! taking objects as JSON lines on standard input, and [`FakeApiProcess`] runs it inside a
//! namespace and keeps its objects as etcd would, so a restarted server has them again, at a
//! fresh resourceVersion.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::command::{describe, in_namespace, kill_child};
use crate::error::{Result, TestbedError};
use crate::lines::{Lines, Next};

/// The Services resource.
pub const SERVICES: &str = "services";
/// The EndpointSlices resource.
pub const SLICES: &str = "endpointslices";
/// The Nodes resource.
pub const NODES: &str = "nodes";
/// The ServiceCIDRs resource.
pub const SERVICE_CIDRS: &str = "servicecidrs";

/// Every served resource: name, URL path, apiVersion, kind.
const RESOURCES: [(&str, &str, &str, &str); 4] = [
    (SERVICES, "/api/v1/services", "v1", "Service"),
    (
        SLICES,
        "/apis/discovery.k8s.io/v1/endpointslices",
        "discovery.k8s.io/v1",
        "EndpointSlice",
    ),
    (NODES, "/api/v1/nodes", "v1", "Node"),
    (
        SERVICE_CIDRS,
        "/apis/networking.k8s.io/v1/servicecidrs",
        "networking.k8s.io/v1",
        "ServiceCIDR",
    ),
];

/// How long [`FakeApiProcess`] waits for the server to say it listens.
const START_WAIT: Duration = Duration::from_secs(20);

/// How far apart the resourceVersions of successive [`FakeApiProcess`] servers start, so a
/// restarted server's history begins after everything the previous one handed out.
const GENERATION_STRIDE: u64 = 1_000_000;

/// One request the fake server saw.
#[derive(Clone, Debug)]
pub struct Request {
    /// Whether it was a watch (else a list).
    pub watch: bool,
    /// Its query parameters.
    pub query: HashMap<String, String>,
}

impl Request {
    /// A query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.get(name).map(String::as_str)
    }
}

/// An open watch and what it selects.
struct Watch {
    lines: mpsc::UnboundedSender<String>,
    labels: String,
    fields: String,
}

struct Resource {
    api_version: &'static str,
    kind: &'static str,
    /// Current objects by `namespace/name` (or `name`).
    items: BTreeMap<String, Value>,
    watches: Vec<Watch>,
    requests: Vec<mpsc::UnboundedSender<Request>>,
    /// The last list's matching keys, so its later pages need not select them again.
    paging: Option<Paging>,
}

/// The objects one paged list goes through: its selectors, the resourceVersion it was taken
/// at (any change makes the next page select afresh, as without it) and the matching keys.
struct Paging {
    labels: String,
    fields: String,
    rv: u64,
    keys: Vec<String>,
}

struct Inner {
    /// Events posted (`events.k8s.io/v1`), in order.
    events: Vec<Value>,
    /// How many of the next event posts are answered `403` (RBAC without `create` on events).
    failing_events: usize,
    rv: u64,
    /// The oldest resourceVersion a watch may start from.
    oldest: u64,
    resources: HashMap<&'static str, Resource>,
}

/// The fake API server's state and routes; clones share the state.
#[derive(Clone)]
pub struct FakeApiServer(Arc<Mutex<Inner>>);

/// `namespace/name`, or `name` for cluster-scoped objects.
pub fn object_key(obj: &Value) -> String {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    match obj["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// Minimal label selector: comma-separated `!k`, `k=v`, `k!=v`, `k`.
fn labels_match(obj: &Value, selector: &str) -> bool {
    let labels = &obj["metadata"]["labels"];
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        if let Some(k) = term.strip_prefix('!') {
            labels.get(k).is_none()
        } else if let Some((k, v)) = term.split_once("!=") {
            labels.get(k).and_then(Value::as_str) != Some(v)
        } else if let Some((k, v)) = term.split_once('=') {
            labels.get(k).and_then(Value::as_str) == Some(v)
        } else {
            labels.get(term).is_some()
        }
    })
}

/// Minimal field selector: `metadata.name=x` and `metadata.namespace=x`; any other field
/// selects nothing.
fn fields_match(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let Some((field, value)) = term.split_once('=') else {
            return false;
        };
        let actual = match field {
            "metadata.name" => obj["metadata"]["name"].as_str(),
            "metadata.namespace" => obj["metadata"]["namespace"].as_str(),
            _ => None,
        };
        actual == Some(value)
    })
}

/// The resource holding objects of `kind`.
fn resource_of_kind(kind: &str) -> Option<&'static str> {
    RESOURCES
        .iter()
        .find(|(_, _, _, k)| *k == kind)
        .map(|(name, ..)| *name)
}

fn json_response(status: StatusCode, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

impl FakeApiServer {
    /// An empty server whose history starts at resourceVersion `first_rv`.
    pub fn new(first_rv: u64) -> Self {
        let resources = RESOURCES
            .iter()
            .map(|(name, _, api_version, kind)| {
                let resource = Resource {
                    api_version,
                    kind,
                    items: BTreeMap::new(),
                    watches: Vec::new(),
                    requests: Vec::new(),
                    paging: None,
                };
                (*name, resource)
            })
            .collect();
        Self(Arc::new(Mutex::new(Inner {
            events: Vec::new(),
            failing_events: 0,
            rv: first_rv,
            oldest: first_rv,
            resources,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with<T>(&self, resource: &str, f: impl FnOnce(&mut Resource, u64) -> T) -> T {
        let mut inner = self.lock();
        let rv = inner.rv;
        let r = inner
            .resources
            .get_mut(resource)
            .unwrap_or_else(|| panic!("unknown resource {resource}"));
        f(r, rv)
    }

    /// Every request for `resource` from now on, as it arrives.
    pub fn requests(&self, resource: &str) -> mpsc::UnboundedReceiver<Request> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.with(resource, |r, _| r.requests.push(tx));
        rx
    }

    /// The routes of every resource; ServiceCIDRs only with `service_cidrs` (clusters before
    /// v1.33 do not serve them: a 404).
    pub fn router(&self, service_cidrs: bool) -> Router {
        let mut router = Router::new();
        for (name, path, ..) in RESOURCES {
            if name == SERVICE_CIDRS && !service_cidrs {
                continue;
            }
            router = router.route(
                path,
                get(
                    move |State(f): State<FakeApiServer>, Query(q)| async move { f.serve(name, q) },
                ),
            );
        }
        // One Node by name: the proxy reads its own at start-up (`GET /api/v1/nodes/NAME`).
        router = router.route(
            "/api/v1/nodes/{name}",
            get(
                |State(f): State<FakeApiServer>, Path(name): Path<String>| async move {
                    f.get_one(NODES, &name)
                },
            ),
        );
        // Events the proxy posts about its Node (`events.k8s.io/v1`, namespaced).
        router =
            router.route(
                "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
                post(
                    |State(f): State<FakeApiServer>,
                     Path(namespace): Path<String>,
                     body: String| async move { f.post_event(&namespace, &body) },
                ),
            );
        // What a real server answers for an API it does not serve: a `Status`, not a bare 404.
        router
            .fallback(|| async { not_found("the server could not find the requested resource") })
            .with_state(self.clone())
    }

    /// Every event posted so far, in order.
    pub fn events(&self) -> Vec<Value> {
        self.lock().events.clone()
    }

    /// Answers the next `n` event posts with `403 Forbidden`, as a server whose RBAC does not
    /// let the proxy create events.
    pub fn refuse_events(&self, n: usize) {
        self.lock().failing_events = n;
    }

    /// Stores a posted event (`201 Created`), or refuses it as a real server would: `400`
    /// for a body that is not an Event, `422` for one whose namespace is not the URL's.
    fn post_event(&self, namespace: &str, body: &str) -> Response {
        let mut inner = self.lock();
        if inner.failing_events > 0 {
            inner.failing_events -= 1;
            return status_response(StatusCode::FORBIDDEN, "Forbidden", "events is forbidden");
        }
        let Ok(mut event) = serde_json::from_str::<Value>(body) else {
            return status_response(StatusCode::BAD_REQUEST, "BadRequest", "not JSON");
        };
        if event["kind"] != "Event" || event["metadata"]["namespace"] != namespace {
            return status_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "not an Event of this namespace",
            );
        }
        inner.rv += 1;
        event["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
        inner.events.push(event.clone());
        json_response(StatusCode::CREATED, Body::from(event.to_string()))
    }

    /// One object of `resource` by its key, or the `Status` a real server sends when it has none.
    fn get_one(&self, resource: &str, key: &str) -> Response {
        self.with(resource, |r, _| match r.items.get(key) {
            Some(obj) => json_response(StatusCode::OK, Body::from(obj.to_string())),
            None => not_found(&format!("{} \"{key}\" not found", r.kind.to_lowercase())),
        })
    }

    fn serve(&self, resource: &str, query: HashMap<String, String>) -> Response {
        let watch = query.get("watch").is_some_and(|v| v == "true" || v == "1");
        let oldest = self.lock().oldest;
        self.with(resource, |r, rv| {
            let request = Request {
                watch,
                query: query.clone(),
            };
            let labels = query.get("labelSelector").cloned().unwrap_or_default();
            let fields = query.get("fieldSelector").cloned().unwrap_or_default();
            let response = if watch {
                let (tx, mut rx) = mpsc::unbounded_channel::<String>();
                let from = query
                    .get("resourceVersion")
                    .and_then(|v| v.parse::<u64>().ok())
                    .filter(|v| *v != 0);
                if let Some(from) = from.filter(|from| *from < oldest) {
                    // What a real server's watch cache answers after a restart: 200, then
                    // one ERROR event, then the end of the stream.
                    let status = json!({ "type": "ERROR", "object": {
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": format!("too old resource version: {from} ({oldest})"),
                        "reason": "Expired", "code": 410 } });
                    let _ = tx.send(format!("{status}\n"));
                } else {
                    r.watches.push(Watch {
                        lines: tx,
                        labels,
                        fields,
                    });
                }
                let body = futures::stream::poll_fn(move |cx| {
                    rx.poll_recv(cx).map(|line| line.map(Ok::<_, Infallible>))
                });
                json_response(StatusCode::OK, Body::from_stream(body))
            } else {
                list(r, rv, &query, &labels, &fields)
            };
            r.requests.retain(|tx| tx.send(request.clone()).is_ok());
            response
        })
    }

    /// Stores `obj` without telling watchers; returns it with its new resourceVersion.
    pub fn put(&self, resource: &str, mut obj: Value) -> Value {
        let mut inner = self.lock();
        inner.rv += 1;
        let rv = inner.rv;
        let r = inner
            .resources
            .get_mut(resource)
            .unwrap_or_else(|| panic!("unknown resource {resource}"));
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        obj["apiVersion"] = json!(r.api_version);
        obj["kind"] = json!(r.kind);
        r.items.insert(object_key(&obj), obj.clone());
        obj
    }

    /// Removes an object without telling watchers; returns it with the deletion's
    /// resourceVersion, if it existed.
    pub fn remove(&self, resource: &str, key: &str) -> Option<Value> {
        let mut inner = self.lock();
        inner.rv += 1;
        let rv = inner.rv;
        let r = inner.resources.get_mut(resource)?;
        let mut obj = r.items.remove(key)?;
        obj["metadata"]["resourceVersion"] = json!(rv.to_string());
        Some(obj)
    }

    /// Sends `event` to the open watches of `resource` that select `obj` (all of them
    /// without `obj`); returns how many got it.
    fn notify(&self, resource: &str, event: &Value, obj: Option<&Value>) -> usize {
        let line = format!("{event}\n");
        self.with(resource, |r, _| {
            r.watches.retain(|w| !w.lines.is_closed());
            r.watches
                .iter()
                .filter(|w| {
                    obj.is_none_or(|o| labels_match(o, &w.labels) && fields_match(o, &w.fields))
                })
                .filter(|w| w.lines.send(line.clone()).is_ok())
                .count()
        })
    }

    /// Stores the object and sends `event_type` (`ADDED`/`MODIFIED`) on the open watches;
    /// returns its resourceVersion.
    pub fn apply(&self, resource: &str, event_type: &str, obj: Value) -> String {
        let obj = self.put(resource, obj);
        self.notify(
            resource,
            &json!({ "type": event_type, "object": obj }),
            Some(&obj),
        );
        obj["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// Deletes the object and sends `DELETED` on the open watches; false if there was none.
    pub fn delete(&self, resource: &str, key: &str) -> bool {
        let Some(obj) = self.remove(resource, key) else {
            return false;
        };
        self.notify(
            resource,
            &json!({ "type": "DELETED", "object": obj }),
            Some(&obj),
        );
        true
    }

    /// Sends `410 Gone` on the open watches, as a server does when the resourceVersion
    /// expired; returns how many got it.
    pub fn expire(&self, resource: &str) -> usize {
        self.notify(
            resource,
            &json!({ "type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410 } }),
            None,
        )
    }

    /// Sends a bookmark at `rv` on the open watches.
    pub fn bookmark(&self, resource: &str, rv: &str) -> usize {
        let kind = self.with(resource, |r, _| r.kind);
        self.notify(
            resource,
            &json!({ "type": "BOOKMARK", "object": { "kind": kind, "apiVersion": "v1",
                    "metadata": { "resourceVersion": rv } } }),
            None,
        )
    }

    /// Ends the open watch responses cleanly, as a server does at `timeoutSeconds`.
    pub fn close_watches(&self, resource: &str) {
        self.with(resource, |r, _| r.watches.clear());
    }

    /// The current resourceVersion.
    pub fn rv(&self) -> String {
        self.lock().rv.to_string()
    }

    /// Applies one command line of [`serve_commands`]' protocol.
    fn command(&self, line: &str) -> std::result::Result<(), String> {
        let cmd: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        if let Some(obj) = cmd.get("apply") {
            let kind = obj["kind"].as_str().unwrap_or_default();
            let resource = resource_of_kind(kind).ok_or(format!("unknown kind {kind:?}"))?;
            let event = if self.with(resource, |r, _| r.items.contains_key(&object_key(obj))) {
                "MODIFIED"
            } else {
                "ADDED"
            };
            self.apply(resource, event, obj.clone());
        } else if let Some(del) = cmd.get("delete") {
            let kind = del["kind"].as_str().unwrap_or_default();
            let resource = resource_of_kind(kind).ok_or(format!("unknown kind {kind:?}"))?;
            self.delete(resource, &object_key(del));
        } else if let Some(token) = cmd.get("sync") {
            // Every earlier line is applied: say so, so the sender knows lists show it.
            let mut out = std::io::stdout().lock();
            writeln!(out, "synced {token}").map_err(|e| format!("stdout: {e}"))?;
            out.flush().map_err(|e| format!("stdout: {e}"))?;
        } else {
            return Err(
                "expected {\"apply\": OBJECT}, {\"delete\": OBJECT} or {\"sync\": N}".to_owned(),
            );
        }
        Ok(())
    }
}

/// A 404 `Status` with `message`, as a real server sends it.
fn not_found(message: &str) -> Response {
    status_response(StatusCode::NOT_FOUND, "NotFound", message)
}

/// A failure `Status` as a real server sends it.
fn status_response(code: StatusCode, reason: &str, message: &str) -> Response {
    let status = json!({ "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "details": {},
        "code": code.as_u16() });
    json_response(code, Body::from(status.to_string()))
}

/// A (paged) list response of `r` at `rv`. The matching keys are selected once per list (and
/// again whenever the store changed between its pages) and each page copies only its own
/// objects: listing a large store page by page costs about one pass over it, not one per page.
fn list(
    r: &mut Resource,
    rv: u64,
    query: &HashMap<String, String>,
    labels: &str,
    fields: &str,
) -> Response {
    let start: usize = query
        .get("continue")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let limit: usize = query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let current = r
        .paging
        .as_ref()
        .is_some_and(|p| start > 0 && p.rv == rv && p.labels == labels && p.fields == fields);
    if !current {
        let keys = r
            .items
            .iter()
            .filter(|(_, o)| labels_match(o, labels) && fields_match(o, fields))
            .map(|(key, _)| key.clone())
            .collect();
        r.paging = Some(Paging {
            labels: labels.to_owned(),
            fields: fields.to_owned(),
            rv,
            keys,
        });
    }
    let keys = r.paging.as_ref().map_or(&[][..], |p| &p.keys[..]);
    let end = start.saturating_add(limit).min(keys.len());
    let page: Vec<Value> = keys[start.min(end)..end]
        .iter()
        .filter_map(|key| r.items.get(key))
        .map(|o| {
            // Like a real server, list items carry no apiVersion/kind.
            let mut o = o.clone();
            if let Some(map) = o.as_object_mut() {
                map.remove("apiVersion");
                map.remove("kind");
            }
            o
        })
        .collect();
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if end < keys.len() {
        metadata["continue"] = json!(end.to_string());
    }
    let list = json!({
        "apiVersion": r.api_version,
        "kind": format!("{}List", r.kind),
        "metadata": metadata,
        "items": page,
    });
    json_response(StatusCode::OK, Body::from(list.to_string()))
}

/// `kp-echo apiserver`: serves a [`FakeApiServer`] (ServiceCIDRs included) on `listen`,
/// with history from `first_rv`. Prints `listening ADDR` once it accepts connections, then
/// applies each line of standard input, `{"apply": OBJECT}` (added or modified, by `kind`),
/// `{"delete": {"kind": K, "metadata": {"namespace": N, "name": X}}}` or `{"sync": N}`
/// (answered with `synced N` on standard output once every earlier line is applied), and
/// exits when standard input closes.
pub fn serve_commands(listen: SocketAddr, first_rv: u64) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let fake = FakeApiServer::new(first_rv);
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let app = fake.router(true);
        println!("listening {}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        // Standard input is read on a thread of its own; its end ends the server.
        let (tx, mut lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lines().map_while(std::io::Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        while let Some(line) = lines.recv().await {
            if let Err(error) = fake.command(&line) {
                eprintln!("kp-echo apiserver: {error}: {line}");
            }
        }
        server.abort();
        Ok(())
    })
}

/// Parses manifests (YAML documents separated by `---`) into the objects they hold.
pub fn yaml_objects(text: &str) -> std::result::Result<Vec<Value>, String> {
    text.split("\n---")
        .filter(|doc| !doc.trim().is_empty())
        .map(|doc| serde_saphyr::from_str::<Value>(doc).map_err(|e| e.to_string()))
        .collect()
}

/// A [`FakeApiServer`] running as its own process (`kp-echo apiserver`) inside a namespace,
/// so it can really be stopped and killed. Keeps every object like etcd: a restarted server
/// gets them all again, and starts its history at a fresh resourceVersion, so watches from
/// before get `410 Gone`. Killed on drop. Shared by reference: every method takes `&self`.
#[derive(Debug)]
pub struct FakeApiProcess {
    echo: std::path::PathBuf,
    ns: String,
    listen: SocketAddr,
    state: Mutex<ProcessState>,
}

#[derive(Debug, Default)]
struct ProcessState {
    /// The objects, by kind and key.
    objects: BTreeMap<(String, String), Value>,
    generation: u64,
    child: Option<(Child, ChildStdin)>,
    /// The running server's standard output, after its `listening` line.
    lines: Option<Lines>,
    /// The last `sync` token sent.
    syncs: u64,
}

impl ProcessState {
    fn send(&mut self, op: &str, obj: &Value) -> Result<()> {
        let Some((_, stdin)) = self.child.as_mut() else {
            return Err(TestbedError::ApiServer {
                detail: "not running (killed)".to_owned(),
            });
        };
        let line = json!({ op: obj }).to_string();
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    fn kill(&mut self) {
        if let Some((mut child, _)) = self.child.take() {
            kill_child(&mut child);
        }
        self.lines = None;
    }
}

impl FakeApiProcess {
    /// Starts a server listening on `listen` inside namespace `ns`, run by the `kp-echo`
    /// binary `echo` (e.g. [`crate::Cluster::echo_binary_path`]).
    pub fn start(echo: &std::path::Path, ns: &str, listen: SocketAddr) -> Result<Self> {
        let process = Self {
            echo: echo.to_owned(),
            ns: ns.to_owned(),
            listen,
            state: Mutex::default(),
        };
        process.spawn(&mut process.lock())?;
        Ok(process)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ProcessState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The running server's process id (none once killed), e.g. to read its CPU time.
    pub fn pid(&self) -> Option<u32> {
        self.lock().child.as_ref().map(|(child, _)| child.id())
    }

    /// The URL to give the proxy (`--master`).
    pub fn url(&self) -> String {
        format!("http://{}", self.listen)
    }

    fn spawn(&self, state: &mut ProcessState) -> Result<()> {
        state.generation += 1;
        let mut command = in_namespace(&self.ns, &self.echo);
        command
            .args(["apiserver", "--listen"])
            .arg(self.listen.to_string())
            .arg("--first-resource-version")
            .arg((state.generation * GENERATION_STRIDE).to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().map_err(|source| TestbedError::Spawn {
            command: describe(&command),
            source,
        })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            kill_child(&mut child);
            return Err(TestbedError::ApiServer {
                detail: "started without pipes".to_owned(),
            });
        };
        let lines = Lines::spawn(stdout);
        match lines.next(START_WAIT) {
            Next::Line(line) if line.starts_with("listening ") => {}
            other => {
                kill_child(&mut child);
                return Err(TestbedError::ApiServer {
                    detail: format!("did not report listening: {other:?}"),
                });
            }
        }
        state.child = Some((child, stdin));
        state.lines = Some(lines);
        let objects: Vec<Value> = state.objects.values().cloned().collect();
        objects.iter().try_for_each(|obj| state.send("apply", obj))
    }

    /// Creates or replaces every object in `yaml` (multi-document manifests).
    pub fn apply_yaml(&self, yaml: &str) -> Result<()> {
        let objects = yaml_objects(yaml).map_err(|detail| TestbedError::ApiServer { detail })?;
        objects.into_iter().try_for_each(|obj| self.apply(obj))
    }

    /// Creates or replaces `obj` (with its `kind`).
    pub fn apply(&self, obj: Value) -> Result<()> {
        let mut state = self.lock();
        let kind = obj["kind"].as_str().unwrap_or_default().to_owned();
        state.send("apply", &obj)?;
        state.objects.insert((kind, object_key(&obj)), obj);
        Ok(())
    }

    /// Waits until the server has applied every object sent so far (at most `wait`), so a
    /// list from now on holds them all: sending many objects only queues them.
    pub fn sync(&self, wait: Duration) -> Result<()> {
        let mut state = self.lock();
        state.syncs += 1;
        let token = state.syncs;
        state.send("sync", &json!(token))?;
        let expected = format!("synced {token}");
        let deadline = std::time::Instant::now() + wait;
        let Some(lines) = state.lines.as_ref() else {
            return Err(TestbedError::ApiServer {
                detail: "not running (killed)".to_owned(),
            });
        };
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match lines.next(left) {
                Next::Line(line) if line == expected => return Ok(()),
                Next::Line(_) => {}
                other => {
                    return Err(TestbedError::ApiServer {
                        detail: format!("no {expected:?} within {wait:?}: {other:?}"),
                    });
                }
            }
        }
    }

    /// Deletes the object of `kind` named `key` (`namespace/name` or `name`).
    pub fn delete(&self, kind: &str, key: &str) -> Result<()> {
        let mut state = self.lock();
        let Some(obj) = state.objects.remove(&(kind.to_owned(), key.to_owned())) else {
            return Err(TestbedError::ApiServer {
                detail: format!("no {kind} {key} to delete"),
            });
        };
        state.send("delete", &obj)
    }

    fn signal(&self, signal: &str) -> Result<()> {
        let state = self.lock();
        let Some((child, _)) = state.child.as_ref() else {
            return Err(TestbedError::ApiServer {
                detail: "not running (killed)".to_owned(),
            });
        };
        let mut command = Command::new("kill");
        command.args([signal, &child.id().to_string()]);
        crate::command::run_checked(&mut command, None, START_WAIT).map(drop)
    }

    /// `SIGSTOP`: open connections hang and new ones are accepted by the kernel but never
    /// answered, as with a frozen API server.
    pub fn pause(&self) -> Result<()> {
        self.signal("-STOP")
    }

    /// `SIGCONT` after [`FakeApiProcess::pause`].
    pub fn resume(&self) -> Result<()> {
        self.signal("-CONT")
    }

    /// `SIGKILL`: connections are reset and then refused until [`FakeApiProcess::restart`].
    pub fn kill(&self) {
        self.lock().kill();
    }

    /// Starts a new server (killing a running one first) holding every object, at a fresh
    /// resourceVersion.
    pub fn restart(&self) -> Result<()> {
        let mut state = self.lock();
        state.kill();
        self.spawn(&mut state)
    }
}

impl Drop for FakeApiProcess {
    fn drop(&mut self) {
        // A stopped process must not outlive the test frozen: SIGKILL ends it anyway.
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One list page of Services: the names on it and the continue token.
    fn page(fake: &FakeApiServer, query: &[(&str, &str)]) -> (Vec<String>, Option<String>) {
        let query = query
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let response = fake.serve(SERVICES, query);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let body = runtime
            .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
            .expect("body");
        let list: Value = serde_json::from_slice(&body).expect("a JSON list");
        let names = list["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|o| {
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        let token = list["metadata"]["continue"].as_str().map(str::to_owned);
        (names, token)
    }

    fn svc(name: &str, labels: Value) -> Value {
        json!({ "metadata": { "namespace": "ns", "name": name, "labels": labels } })
    }

    #[test]
    fn paged_lists_go_through_the_selection_and_follow_changes() {
        let fake = FakeApiServer::new(1);
        for name in ["a", "b", "c", "d", "e"] {
            fake.put(SERVICES, svc(name, json!({})));
        }
        fake.put(SERVICES, svc("skip", json!({ "headless": "" })));
        let selected = |token: Option<&str>| {
            let mut query = vec![("limit", "2"), ("labelSelector", "!headless")];
            query.extend(token.map(|t| ("continue", t)));
            page(&fake, &query)
        };
        let (first, token) = selected(None);
        assert_eq!(first, ["a", "b"]);
        let (second, token) = selected(token.as_deref());
        assert_eq!(second, ["c", "d"]);
        // A change between pages: the next page selects afresh, by offset, as a store without
        // a kept selection would.
        fake.put(SERVICES, svc("b2", json!({})));
        let (third, token) = selected(token.as_deref());
        assert_eq!(third, ["d", "e"]);
        assert_eq!(token, None, "the last page has no continue token");
        // Unpaged: everything selected, in one response.
        let (all, token) = page(&fake, &[("labelSelector", "!headless")]);
        assert_eq!(all, ["a", "b", "b2", "c", "d", "e"]);
        assert_eq!(token, None);
    }
}
