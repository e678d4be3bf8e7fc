//! The manifests source on real files: initial load, every way files get replaced, broken
//! edits, deletion, a single-file path, a path that appears late, shutdown, files caught
//! while being written, and the removal guard.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_sources::manifests::{ManifestsError, ManifestsSource, RemovalGuard};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long to wait for something the source should do within a few polls.
const PATIENCE: Duration = Duration::from_secs(20);

/// Fast polling keeps the tests quick; the logic does not depend on the interval.
const POLL: Duration = Duration::from_millis(20);

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn copy_data(dir: &Path, names: &[&str]) {
    for name in names {
        std::fs::copy(data(name), dir.join(name)).expect("copy test data");
    }
}

/// `Applied Service default/web`, `Deleted Node node-1`, `Synced EndpointSlice`.
fn describe(event: &SourceEvent) -> String {
    fn one<K>(kind: &str, event: &ObjectEvent<K>, meta: impl Fn(&K) -> String) -> String {
        match event {
            ObjectEvent::Applied(object) => format!("Applied {kind} {}", meta(object)),
            ObjectEvent::Deleted(object) => format!("Deleted {kind} {}", meta(object)),
            ObjectEvent::Synced => format!("Synced {kind}"),
        }
    }
    fn name(metadata: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
        match &metadata.namespace {
            Some(namespace) => format!("{namespace}/{}", metadata.name.as_deref().unwrap_or("")),
            None => metadata.name.clone().unwrap_or_default(),
        }
    }
    match event {
        SourceEvent::Service(e) => one("Service", e, |o| name(&o.metadata)),
        SourceEvent::EndpointSlice(e) => one("EndpointSlice", e, |o| name(&o.metadata)),
        SourceEvent::Node(e) => one("Node", e, |o| name(&o.metadata)),
        SourceEvent::ServiceCidr(e) => one("ServiceCIDR", e, |o| name(&o.metadata)),
        SourceEvent::Batch(events) => {
            let inner: Vec<String> = events.iter().map(describe).collect();
            format!("Batch [{}]", inner.join(", "))
        }
    }
}

fn applied_service(event: &SourceEvent) -> Option<&Service> {
    match event {
        SourceEvent::Service(ObjectEvent::Applied(service)) => Some(service),
        _ => None,
    }
}

fn first_port(service: &Service) -> i32 {
    service
        .spec
        .as_ref()
        .and_then(|spec| spec.ports.as_ref())
        .and_then(|ports| ports.first())
        .map_or(0, |port| port.port)
}

fn service_yaml(name: &str, ip: &str, port: u16) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  clusterIP: {ip}\n  \
         ports:\n    - port: {port}\n"
    )
}

/// A running source and the receiving end of its events.
struct Running {
    rx: mpsc::Receiver<SourceEvent>,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), ManifestsError>>,
    errors: Counter,
    /// Documents decoded so far.
    decoded: Counter,
    /// Reads the removal guard held back.
    held: Counter,
    /// Every event received so far, for failure messages.
    seen: Vec<String>,
    /// The rest of a received batch, handed out one event at a time by [`Running::until`].
    pending: VecDeque<SourceEvent>,
}

impl Running {
    fn start(path: &Path) -> Running {
        Running::polling(path, POLL)
    }

    /// A source polling every `poll`.
    fn polling(path: &Path, poll: Duration) -> Running {
        Running::guarded(path, poll, RemovalGuard::default())
    }

    /// A source polling every `poll` with the removal guard `guard`.
    fn guarded(path: &Path, poll: Duration, guard: RemovalGuard) -> Running {
        let source = ManifestsSource::new(path)
            .node_name("node-1")
            .poll_interval(poll)
            .removal_guard(guard);
        let errors = source.errors_counter();
        let decoded = source.decoded_counter();
        let held = source.held_counter();
        let (tx, rx) = mpsc::channel(16);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(source.run(tx, shutdown.clone()));
        Running {
            rx,
            shutdown,
            task,
            errors,
            decoded,
            held,
            seen: Vec::new(),
            pending: VecDeque::new(),
        }
    }

    /// The next event as sent (a batch whole).
    async fn next_sent(&mut self, what: &str, deadline: tokio::time::Instant) -> SourceEvent {
        let event = match tokio::time::timeout_at(deadline, self.rx.recv()).await {
            Ok(Some(event)) => event,
            Ok(None) => panic!(
                "source stopped while waiting for {what}; seen {:?}",
                self.seen
            ),
            Err(_) => panic!("no {what} within {PATIENCE:?}; seen {:?}", self.seen),
        };
        self.seen.push(describe(&event));
        event
    }

    /// Receive events (a batch's one by one) until one matches; returns it and the events
    /// before it.
    async fn until(
        &mut self,
        what: &str,
        matches: impl Fn(&SourceEvent) -> bool,
    ) -> (SourceEvent, Vec<SourceEvent>) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        let mut before = Vec::new();
        loop {
            let event = match self.pending.pop_front() {
                Some(event) => event,
                None => match self.next_sent(what, deadline).await {
                    SourceEvent::Batch(events) => {
                        self.pending.extend(events);
                        continue;
                    }
                    event => event,
                },
            };
            if matches(&event) {
                return (event, before);
            }
            before.push(event);
        }
    }

    /// Receive events until one is described as `description`.
    async fn until_described(&mut self, description: &str) -> (SourceEvent, Vec<SourceEvent>) {
        self.until(description, |e| describe(e) == description)
            .await
    }

    /// The initial load: every event up to the third `Synced`, which must come last.
    async fn initial(&mut self) -> Vec<String> {
        let mut events = Vec::new();
        let mut synced = 0;
        while synced < 4 {
            let (event, before) = self
                .until("Synced", |e| describe(e).starts_with("Synced"))
                .await;
            assert!(
                synced == 0 || before.is_empty(),
                "objects between Synced events: {:?}",
                self.seen
            );
            events.extend(before.iter().map(describe));
            events.push(describe(&event));
            synced += 1;
        }
        events
    }

    /// Wait (bounded) until the error counter reaches `count`.
    async fn errors_reach(&self, count: u64) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.errors.get() < count {
            assert!(
                tokio::time::Instant::now() < deadline,
                "error counter stuck at {} (want {count}); seen {:?}",
                self.errors.get(),
                self.seen
            );
            tokio::time::sleep(POLL).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        let result = tokio::time::timeout(PATIENCE, self.task)
            .await
            .expect("source stops promptly after cancellation")
            .expect("source task does not panic");
        assert!(result.is_ok(), "{result:?}");
    }
}

/// Write `text` to `path` by writing a hidden temporary file and renaming it over `path`.
fn write_atomically(path: &Path, text: &str) {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .expect("file name");
    let temporary = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&temporary, text).expect("write temporary file");
    std::fs::rename(&temporary, path).expect("rename over the file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_load_reports_every_object_then_synced() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_data(dir.path(), &["web.yaml", "nodes.yaml", "dns.json"]);
    // Not manifests: wrong extension, hidden, a directory.
    std::fs::write(dir.path().join("notes.txt"), "not yaml: [").expect("write");
    std::fs::write(dir.path().join(".hidden.yaml"), "not yaml: [").expect("write");
    std::fs::create_dir(dir.path().join("sub.yaml")).expect("mkdir");

    let mut source = Running::start(dir.path());
    let mut events = source.initial().await;
    let synced = events.split_off(events.len() - 4);
    events.sort();
    assert_eq!(
        events,
        [
            "Applied EndpointSlice default/web-abc12",
            "Applied Node node-1",
            "Applied Service default/web",
            "Applied Service kube-system/kube-dns",
        ]
    );
    assert_eq!(
        synced,
        [
            "Synced Service",
            "Synced EndpointSlice",
            "Synced Node",
            "Synced ServiceCIDR"
        ]
    );
    assert_eq!(source.errors.get(), 0);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_node_is_reported_before_any_event() {
    // The proxy's start-up reads its node IPs from this, then consumes the same reading's
    // events: the Node must come while they wait in the (here one-deep) queue.
    let dir = tempfile::tempdir().expect("tempdir");
    copy_data(dir.path(), &["web.yaml", "nodes.yaml", "dns.json"]);
    let (first_node, reading) = tokio::sync::oneshot::channel();
    let source = ManifestsSource::new(dir.path())
        .node_name("node-1")
        .poll_interval(POLL)
        .report_first_node(first_node);
    let (tx, mut rx) = mpsc::channel(1);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(source.run(tx, shutdown.clone()));
    let node = tokio::time::timeout(PATIENCE, reading)
        .await
        .expect("the first reading ends")
        .expect("the source reports it");
    assert_eq!(
        node.and_then(|n| n.metadata.name),
        Some("node-1".to_owned())
    );
    let mut described = Vec::new();
    while described.last().map(String::as_str) != Some("Synced ServiceCIDR") {
        let event = tokio::time::timeout(PATIENCE, rx.recv())
            .await
            .expect("events follow")
            .expect("the source runs");
        described.push(describe(&event));
    }
    assert_eq!(described.len(), 8, "{described:?}");

    // Without this node's Node in the files: `None`, at once.
    let empty = tempfile::tempdir().expect("tempdir");
    let (first_node, reading) = tokio::sync::oneshot::channel();
    let source = ManifestsSource::new(empty.path())
        .node_name("node-1")
        .report_first_node(first_node);
    let (tx, _rx) = mpsc::channel(1);
    let other = tokio::spawn(source.run(tx, shutdown.clone()));
    let node = tokio::time::timeout(PATIENCE, reading)
        .await
        .expect("the first reading ends")
        .expect("the source reports it");
    assert!(node.is_none());
    shutdown.cancel();
    for task in [task, other] {
        task.await.expect("joins").expect("stops cleanly");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_service_arrives_defaulted() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_data(dir.path(), &["web.yaml"]);
    let mut source = Running::start(dir.path());
    let (event, _) = source.until_described("Applied Service default/web").await;
    let service = applied_service(&event).expect("a Service");
    let spec = service.spec.as_ref().expect("spec");
    assert_eq!(
        spec.cluster_ips.as_deref(),
        Some(&["10.96.0.10".to_owned()][..])
    );
    assert_eq!(spec.ip_families.as_deref(), Some(&["IPv4".to_owned()][..]));
    let ports = spec.ports.as_ref().expect("ports");
    assert_eq!(ports[1].protocol.as_deref(), Some("TCP"));
    assert_eq!(
        ports[1].target_port,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9090))
    );
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_edit_is_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("svc.yaml");
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 80)).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;

    // Same length, written in place (same inode) right after the first read: only the
    // modification time differs, possibly by less than a timestamp tick.
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 81)).expect("write in place");
    let (event, before) = source
        .until("port 81", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    assert!(before.is_empty(), "{:?}", source.seen);
    assert_eq!(describe(&event), "Applied Service default/a");
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_added_while_running_arrives_as_one_batch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut source = Running::start(dir.path());
    source.initial().await;

    // A Service and its EndpointSlice in one file: one message, so the proxier records both
    // before it can sync (it would otherwise program the Service without endpoints first).
    let text = std::fs::read_to_string(data("web.yaml")).expect("read test data");
    write_atomically(&dir.path().join("web.yaml"), &text);
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let event = source.next_sent("the new file", deadline).await;
    let SourceEvent::Batch(events) = &event else {
        panic!("expected one batch, got {}", describe(&event));
    };
    let kinds: Vec<String> = events.iter().map(describe).collect();
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert!(
        kinds[0].starts_with("Applied Service default/web"),
        "{kinds:?}"
    );
    assert!(
        kinds[1].starts_with("Applied EndpointSlice default/web"),
        "{kinds:?}"
    );
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_rename_is_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("svc.yaml");
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 80)).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;

    write_atomically(&file, &service_yaml("a", "10.0.0.1", 81));
    let (_, before) = source
        .until("port 81", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    // Nothing was deleted on the way: the name always pointed at a complete file.
    assert!(before.is_empty(), "{:?}", source.seen);
    source.stop().await;
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_symlink_swap_is_applied() {
    use std::os::unix::fs::symlink;

    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    // As the kubelet lays out a ConfigMap volume.
    std::fs::create_dir(root.join("..2026_11_22_a")).expect("mkdir");
    std::fs::write(
        root.join("..2026_11_22_a/x.yaml"),
        service_yaml("x", "10.0.0.1", 80),
    )
    .expect("write");
    symlink("..2026_11_22_a", root.join("..data")).expect("..data");
    symlink("..data/x.yaml", root.join("x.yaml")).expect("x.yaml");

    let mut source = Running::start(root);
    let initial = source.initial().await;
    assert_eq!(initial[0], "Applied Service default/x");

    // A new version: a new timestamped directory, and `..data` re-pointed by renaming a new
    // symlink over it. The same length, so only the inode and target path tell.
    std::fs::create_dir(root.join("..2026_11_22_b")).expect("mkdir");
    std::fs::write(
        root.join("..2026_11_22_b/x.yaml"),
        service_yaml("x", "10.0.0.1", 81),
    )
    .expect("write");
    symlink("..2026_11_22_b", root.join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap ..data");
    std::fs::remove_dir_all(root.join("..2026_11_22_a")).expect("remove old version");

    let (_, before) = source
        .until("port 81", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    assert!(before.is_empty(), "{:?}", source.seen);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_file_deletes_its_objects() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_data(dir.path(), &["web.yaml", "dns.json"]);
    let mut source = Running::start(dir.path());
    source.initial().await;

    std::fs::remove_file(dir.path().join("web.yaml")).expect("remove");
    let (_, before) = source
        .until_described("Deleted EndpointSlice default/web-abc12")
        .await;
    let described: Vec<_> = before.iter().map(describe).collect();
    assert_eq!(described, ["Deleted Service default/web"]);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_edit_keeps_the_previous_objects_until_fixed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("a.yaml");
    let marker = dir.path().join("marker.yaml");
    let a = service_yaml("a", "10.0.0.1", 80);
    let b = service_yaml("b", "10.0.0.2", 80);
    std::fs::write(&file, format!("{a}---\n{b}")).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;

    // A half-written save: `a` changed, `b` cut off mid-document.
    let a81 = service_yaml("a", "10.0.0.1", 81);
    std::fs::write(
        &file,
        format!("{a81}---\napiVersion: v1\nkind: Service\nmetadata: [b"),
    )
    .expect("write");
    source.errors_reach(1).await;
    // Then a change elsewhere: every event of the broken save comes before its event.
    std::fs::write(&marker, service_yaml("marker", "10.0.0.9", 80)).expect("write marker");
    let (_, before) = source
        .until_described("Applied Service default/marker")
        .await;
    let described: Vec<_> = before.iter().map(describe).collect();
    assert_eq!(described, ["Applied Service default/a"], "b must be kept");
    assert!(applied_service(&before[0]).is_some_and(|s| first_port(s) == 81));

    // Fixed, with `b` changed: applied.
    std::fs::write(
        &file,
        format!("{a81}---\n{}", service_yaml("b", "10.0.0.2", 82)),
    )
    .expect("write");
    let (event, before) = source.until_described("Applied Service default/b").await;
    assert!(before.is_empty(), "{:?}", source.seen);
    assert!(applied_service(&event).is_some_and(|s| first_port(s) == 82));

    // Clean without `b`: now `b` is really gone.
    std::fs::write(&file, &a81).expect("write");
    source.until_described("Deleted Service default/b").await;
    assert_eq!(source.errors.get(), 1);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_file_wins_a_duplicate() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("1.yaml"),
        service_yaml("dup", "10.0.0.1", 80),
    )
    .expect("write");
    std::fs::write(
        dir.path().join("2.yaml"),
        service_yaml("dup", "10.0.0.1", 82),
    )
    .expect("write");
    let mut source = Running::start(dir.path());
    let (event, _) = source.until_described("Applied Service default/dup").await;
    assert_eq!(applied_service(&event).map(first_port), Some(82));
    let events = source.initial().await;
    assert_eq!(events.len(), 4, "one Service only: {events:?}");
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_earlier_definition_comes_back_when_the_later_one_goes() {
    // The source keeps no object bodies between polls: the earlier file's definition, not
    // decoded in the poll that removes the later file, is read from its file again.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("1.yaml"),
        format!(
            "{}---\n{}",
            service_yaml("dup", "10.0.0.1", 80),
            service_yaml("other", "10.0.0.2", 81)
        ),
    )
    .expect("write");
    let later = dir.path().join("2.yaml");
    std::fs::write(&later, service_yaml("dup", "10.0.0.1", 82)).expect("write");
    let mut source = Running::start(dir.path());
    let events = source.initial().await;
    assert_eq!(events.len(), 6, "two Services: {events:?}");

    std::fs::remove_file(&later).expect("remove");
    let (event, before) = source.until_described("Applied Service default/dup").await;
    assert_eq!(applied_service(&event).map(first_port), Some(80));
    assert!(before.is_empty(), "{:?}", source.seen);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_file_path_is_watched() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Any name works for a file given explicitly.
    let file = dir.path().join("services");
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 80)).expect("write");
    std::fs::write(
        dir.path().join("other.yaml"),
        service_yaml("other", "10.0.0.2", 80),
    )
    .expect("write");
    let mut source = Running::start(&file);
    let events = source.initial().await;
    assert_eq!(
        events,
        [
            "Applied Service default/a",
            "Synced Service",
            "Synced EndpointSlice",
            "Synced Node",
            "Synced ServiceCIDR"
        ]
    );

    write_atomically(&file, &service_yaml("a", "10.0.0.1", 8080));
    let (_, before) = source
        .until("port 8080", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 8080)
        })
        .await;
    assert!(before.is_empty(), "{:?}", source.seen);

    std::fs::remove_file(&file).expect("remove");
    source.until_described("Deleted Service default/a").await;
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_path_is_watched_until_it_appears() {
    let dir = tempfile::tempdir().expect("tempdir");
    let later = dir.path().join("later");
    let mut source = Running::start(&later);

    std::fs::create_dir(&later).expect("mkdir");
    std::fs::write(later.join("a.yaml"), service_yaml("a", "10.0.0.1", 80)).expect("write");
    // Nothing, not even Synced, before the path exists: the first event is the object.
    let events = source.initial().await;
    assert_eq!(events[0], "Applied Service default/a", "{events:?}");
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_receiver_stops_the_source() {
    let dir = tempfile::tempdir().expect("tempdir");
    copy_data(dir.path(), &["web.yaml"]);
    let source = ManifestsSource::new(dir.path()).poll_interval(POLL);
    let (tx, rx) = mpsc::channel(1);
    let task = tokio::spawn(source.run(tx, CancellationToken::new()));
    drop(rx);
    let result = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("source stops once nobody listens")
        .expect("no panic");
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_in_the_registered_metric() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("bad.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: [oops\n",
    )
    .expect("write");
    let mut registry = prometheus_client::registry::Registry::default();
    let source = ManifestsSource::new(dir.path())
        .poll_interval(POLL)
        .register_metrics(&mut registry);
    let (tx, mut rx) = mpsc::channel(16);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(source.run(tx, shutdown.clone()));
    // The broken file is read before the first Synced is sent.
    let first = tokio::time::timeout(PATIENCE, rx.recv())
        .await
        .expect("Synced in time")
        .expect("an event");
    assert_eq!(describe(&first), "Synced Service");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    assert!(
        text.contains("kube_proxy_rs_manifest_errors_total 1"),
        "{text}"
    );
    shutdown.cancel();
    let result = tokio::time::timeout(PATIENCE, task)
        .await
        .expect("stops")
        .expect("no panic");
    assert!(result.is_ok(), "{result:?}");
}

/// Longer than any test waits: a source polling this rarely sees a change only when its
/// directory watch wakes it.
const NEVER: Duration = Duration::from_secs(3600);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_of_one_document_decodes_only_that_document() {
    const SERVICES: usize = 10_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("many.yaml");
    let ip = |i: usize| format!("10.1.{}.{}", i / 250, i % 250 + 1);
    let mut documents: Vec<String> = (0..SERVICES)
        .map(|i| service_yaml(&format!("s{i}"), &ip(i), 80))
        .collect();
    std::fs::write(&file, documents.join("---\n")).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;
    assert_eq!(
        source.decoded.get(),
        SERVICES as u64,
        "the first read decodes all"
    );

    documents[SERVICES / 2] = service_yaml("s5000", &ip(SERVICES / 2), 81);
    write_atomically(&file, &documents.join("---\n"));
    let (event, before) = source
        .until("port 81", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    assert!(
        before.is_empty(),
        "only the edited Service: {:?}",
        source.seen
    );
    assert_eq!(describe(&event), "Applied Service default/s5000");
    assert_eq!(
        source.decoded.get(),
        SERVICES as u64 + 1,
        "the edit decodes the one changed document"
    );

    // Documents that moved (one inserted before them) are not decoded again either.
    documents.insert(0, service_yaml("first", "10.2.0.1", 80));
    write_atomically(&file, &documents.join("---\n"));
    let (_, before) = source
        .until_described("Applied Service default/first")
        .await;
    assert!(before.is_empty(), "{:?}", source.seen);
    assert_eq!(source.decoded.get(), SERVICES as u64 + 2);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_document_is_decoded_again_and_reported_once_per_content() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("a.yaml");
    let a = service_yaml("a", "10.0.0.1", 80);
    let broken = "apiVersion: v1\nkind: Service\nmetadata: [b\n";
    std::fs::write(&file, format!("{a}---\n{broken}")).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;
    assert_eq!(source.errors.get(), 1);
    assert_eq!(source.decoded.get(), 2);

    // Another edit: the good document is reused, the broken one is decoded (and reported)
    // again, as the file's content changed.
    let c = service_yaml("c", "10.0.0.3", 80);
    write_atomically(&file, &format!("{a}---\n{broken}---\n{c}"));
    source.until_described("Applied Service default/c").await;
    source.errors_reach(2).await;
    assert_eq!(source.decoded.get(), 4, "the broken and the new document");
    source.stop().await;
}

/// The three ways files are replaced, each seen by a source that would not poll again
/// within the test: the directory watch wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_are_seen_without_waiting_for_the_poll() {
    use std::os::unix::fs::symlink;

    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let file = root.join("svc.yaml");
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 80)).expect("write");
    std::fs::create_dir(root.join("..v1")).expect("mkdir");
    std::fs::write(
        root.join("..v1/cm.yaml"),
        service_yaml("cm", "10.0.0.2", 80),
    )
    .expect("write");
    symlink("..v1", root.join("..data")).expect("..data");
    symlink("..data/cm.yaml", root.join("cm.yaml")).expect("cm.yaml");
    let mut source = Running::polling(root, NEVER);
    source.initial().await;

    write_atomically(&file, &service_yaml("a", "10.0.0.1", 81));
    source
        .until("port 81 by rename", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 82)).expect("write in place");
    source
        .until("port 82 in place", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 82)
        })
        .await;
    std::fs::create_dir(root.join("..v2")).expect("mkdir");
    std::fs::write(
        root.join("..v2/cm.yaml"),
        service_yaml("cm", "10.0.0.2", 83),
    )
    .expect("write");
    symlink("..v2", root.join("..data_tmp")).expect("..data_tmp");
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap ..data");
    source
        .until("port 83 by symlink swap", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 83)
        })
        .await;
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_file_is_seen_without_waiting_for_the_poll() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("services");
    std::fs::write(&file, service_yaml("a", "10.0.0.1", 80)).expect("write");
    let mut source = Running::polling(&file, NEVER);
    source.initial().await;
    write_atomically(&file, &service_yaml("a", "10.0.0.1", 81));
    source
        .until("port 81", |e| {
            applied_service(e).is_some_and(|s| first_port(s) == 81)
        })
        .await;
    source.stop().await;
}

/// Objects of every kind as an API server stores them (Go's zero time as `null`, malformed
/// values in fields the proxy never reads), in YAML and in a JSON `List`.
const ODD_OBJECTS: &str = r#"apiVersion: v1
kind: Service
metadata:
  name: odd
  creationTimestamp: null
  managedFields: [{manager: 7}]
spec:
  clusterIP: 10.96.0.20
  selector: 5
  ports:
    - port: 80
      targetPort: {not: a port}
status:
  conditions:
    - {type: StatusUpdate, status: "True", reason: E2E, message: x, lastTransitionTime: null}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: odd-1
  labels: {kubernetes.io/service-name: odd}
  creationTimestamp: not a time
addressType: IPv4
endpoints:
  - addresses: [10.244.1.5]
    targetRef: {kind: 7}
ports:
  - port: 8080
---
apiVersion: v1
kind: Node
metadata: {name: node-1}
status:
  addresses: [{type: InternalIP, address: 192.168.1.10}]
  conditions: [{type: Ready, status: "True", lastHeartbeatTime: null}]
  images: [{names: [x], sizeBytes: not a number}]
---
apiVersion: networking.k8s.io/v1
kind: ServiceCIDR
metadata: {name: kubernetes}
spec: {cidrs: [10.96.0.0/16]}
status:
  conditions: [{type: Ready, status: "True", lastTransitionTime: null, reason: "", message: ""}]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_objects_load_edit_and_delete_like_any_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("odd.yaml");
    let list = dir.path().join("list.json");
    std::fs::write(&file, ODD_OBJECTS).expect("write");
    let item = serde_json::json!({ "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": "in-list", "creationTimestamp": "yesterday" },
        "spec": { "clusterIP": "10.96.0.21", "ports": [{ "port": 53, "protocol": "UDP" }] },
        "status": { "conditions": [{ "lastTransitionTime": null }] } });
    let list_text = |items: serde_json::Value| {
        serde_json::json!({ "apiVersion": "v1", "kind": "List", "items": items }).to_string()
    };
    std::fs::write(&list, list_text(serde_json::json!([item]))).expect("write");
    let mut source = Running::start(dir.path());
    let mut events = source.initial().await;
    events.truncate(events.len() - 4);
    events.sort();
    assert_eq!(
        events,
        [
            "Applied EndpointSlice default/odd-1",
            "Applied Node node-1",
            "Applied Service default/in-list",
            "Applied Service default/odd",
            "Applied ServiceCIDR kubernetes",
        ]
    );
    assert_eq!(source.errors.get(), 0);

    // Edited with another odd value: applied.
    write_atomically(&file, &ODD_OBJECTS.replace("- port: 80\n", "- port: 81\n"));
    let (event, _) = source.until_described("Applied Service default/odd").await;
    assert_eq!(first_port(applied_service(&event).expect("a Service")), 81);

    // A value the proxy reads that does not decode: an error naming the line, no deletion.
    write_atomically(
        &file,
        &ODD_OBJECTS.replace("- port: 80\n", "- port: eighty\n"),
    );
    source.errors_reach(1).await;
    // Deleted (the document removed): the Service goes, whatever its last text held.
    let others = ODD_OBJECTS.split_once("---\n").expect("documents").1;
    write_atomically(&file, others);
    let (_, before) = source.until_described("Deleted Service default/odd").await;
    assert!(before.is_empty(), "{:?}", source.seen);
    source.stop().await;
}

/// `count` Services `s0`, `s1`, ... in one multi-document text, `s{bumped}` on port 81.
fn services(count: usize, bumped: Option<usize>) -> String {
    (0..count)
        .map(|i| {
            let port = if Some(i) == bumped { 81 } else { 80 };
            service_yaml(
                &format!("s{i}"),
                &format!("10.0.{}.{}", i / 200, i % 200 + 1),
                port,
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

/// Receive events until `s{index}` arrives on port 81; panics if anything was deleted first.
async fn until_bumped_without_deletion(source: &mut Running, index: usize) {
    let name = format!("default/s{index}");
    let (_, before) = source
        .until(&format!("{name} on port 81"), |e| {
            applied_service(e).is_some_and(|s| {
                s.metadata.name.as_deref() == Some(&name[8..]) && first_port(s) == 81
            })
        })
        .await;
    let deleted: Vec<String> = before
        .iter()
        .map(describe)
        .filter(|d| d.starts_with("Deleted"))
        .collect();
    assert!(
        deleted.is_empty(),
        "deleted before the edit arrived: {deleted:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_then_write_in_pauses_deletes_nothing() {
    use std::io::Write as _;

    for poll in [POLL, NEVER] {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("services.yaml");
        std::fs::write(&file, services(10, None)).expect("write");
        let mut source = Running::polling(dir.path(), poll);
        source.initial().await;

        // As `cat > file` from a slow producer: truncated, then written in pieces (the first
        // ending inside a line), each pause far longer than the settle time.
        let text = services(10, Some(7));
        let (head, tail) = text.split_at(text.len() / 2 + 3);
        let mut writer = std::fs::File::create(&file).expect("truncate");
        tokio::time::sleep(Duration::from_millis(300)).await;
        writer.write_all(head.as_bytes()).expect("write");
        tokio::time::sleep(Duration::from_millis(300)).await;
        writer.write_all(tail.as_bytes()).expect("write");
        drop(writer);
        until_bumped_without_deletion(&mut source, 7).await;
        assert_eq!(source.errors.get(), 0, "nothing partial was parsed");
        source.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_left_empty_or_a_directory_emptied_is_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("a.yaml");
    let other = dir.path().join("b.yaml");
    std::fs::write(&file, services(2, None)).expect("write");
    std::fs::write(&other, service_yaml("b", "10.0.9.1", 80)).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;

    std::fs::write(&file, "").expect("empty");
    let (_, before) = source.until_described("Deleted Service default/s1").await;
    let described: Vec<_> = before.iter().map(describe).collect();
    assert_eq!(described, ["Deleted Service default/s0"]);
    std::fs::remove_file(&file).expect("remove");
    std::fs::remove_file(&other).expect("remove");
    let (_, before) = source.until_described("Deleted Service default/b").await;
    assert!(before.is_empty(), "{:?}", source.seen);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_holds_a_mass_removal_until_a_second_read_agrees() {
    let (_dir, file, mut source) = one_file(150, RemovalGuard::default()).await;

    // 140 of 150 removed in one complete write: more than half, and at least 100.
    write_atomically(&file, &services(10, Some(3)));
    wait_for(&source.held, 1).await;
    assert!(
        source.rx.is_empty() && source.pending.is_empty(),
        "nothing is sent while held: {:?}",
        source.seen
    );
    // One batch: the deletions, then the edit.
    let (_, before) = source.until_described("Applied Service default/s3").await;
    let deleted = before
        .iter()
        .filter(|e| describe(e).starts_with("Deleted"))
        .count();
    assert_eq!((deleted, before.len()), (140, 140), "{:?}", source.seen);
    assert_eq!(source.held.get(), 1);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mass_removal_undone_before_the_second_read_is_never_applied() {
    let (_dir, file, mut source) = one_file(150, RemovalGuard::default()).await;

    write_atomically(&file, &services(10, None));
    wait_for(&source.held, 1).await;
    write_atomically(&file, &services(150, Some(120)));
    until_bumped_without_deletion(&mut source, 120).await;
    assert_eq!(source.held.get(), 1);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_can_be_turned_off() {
    let (_dir, file, mut source) = one_file(150, RemovalGuard::off()).await;
    write_atomically(&file, "");
    source.until_described("Deleted Service default/s149").await;
    assert_eq!(source.held.get(), 0);
    source.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_document_in_the_middle_never_deletes_what_follows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("services.yaml");
    std::fs::write(&file, services(6, None)).expect("write");
    let mut source = Running::start(dir.path());
    source.initial().await;

    // `s2` cut off mid-document (a bad merge, a botched edit), the documents after it intact
    // and `s5` changed.
    let whole = services(6, Some(5));
    let cut = whole
        .split("---\n")
        .enumerate()
        .map(|(i, document)| match i {
            2 => format!("{}\n", &document[..30]),
            _ => document.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("---\n");
    write_atomically(&file, &cut);
    until_bumped_without_deletion(&mut source, 5).await;
    source.errors_reach(1).await;
    // Mended: nothing to report but `s2` unchanged.
    std::fs::write(&file, services(6, Some(4))).expect("write");
    until_bumped_without_deletion(&mut source, 4).await;
    source.stop().await;
}

/// A directory holding `services.yaml` with `count` Services, and a source watching it
/// (with no poll: changes are seen through the watch) with `guard`, past its first load.
async fn one_file(count: usize, guard: RemovalGuard) -> (tempfile::TempDir, PathBuf, Running) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("services.yaml");
    std::fs::write(&file, services(count, None)).expect("write");
    let mut source = Running::guarded(dir.path(), NEVER, guard);
    source.initial().await;
    (dir, file, source)
}

/// Wait (bounded) until `counter` reaches `count`.
async fn wait_for(counter: &Counter, count: u64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while counter.get() < count {
        assert!(
            tokio::time::Instant::now() < deadline,
            "counter stuck at {}",
            counter.get()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
