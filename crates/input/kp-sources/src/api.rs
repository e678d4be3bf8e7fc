//! The API server source: kube-rs watchers on Services, EndpointSlices, this node's Node and
//! ServiceCIDRs (when the API server serves them).
//!
//! Each watcher's `Init … InitDone` sequence is treated as a full resync: objects known before
//! a relist (for example after `410 Gone`) but missing from it are reported as deleted, so the
//! core converges without flushing anything. Watch failures and an unreachable API server never
//! produce deletions: the watcher retries with backoff and the last state stays programmed,
//! as with upstream's informers. The backoff is client-go's curve with shorter first retries,
//! and a `410` relists at once, so the watches resume soon after the API server answers again
//! without hammering it while it restarts (see `recovery`).
//!
//! Objects are decoded one by one by the fields the proxy reads ([`crate::decoded`]): an odd
//! value elsewhere never fails a list or a watch, and an object whose read fields do not
//! decode is skipped (logged once per problem, counted) while its last good state stays.

mod recovery;

use kp_core::report::ErrorChain as _;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Debug};
use std::marker::PhantomData;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kp_core::event::{ObjectEvent, SourceEvent};
use kube::config::{
    InClusterError, InferConfigError, KubeConfigOptions, Kubeconfig, KubeconfigError,
};
use kube::runtime::watcher;
use kube::{Api, Config, Resource};
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::decoded::{Decoded, Unusable, Watched, one_line};
use kp_core::metrics::KindLabel;
pub use recovery::{
    ApiMetrics, Backoff, DEFAULT_RETRY_INITIAL, DEFAULT_RETRY_MAX, DEFAULT_RETRY_RESET_AFTER,
    Failure, RetryPolicy, WatchFailureLabels, jitter_unit,
};
use recovery::{Contact, Observed, RESUME_SETTLE};

/// Label naming the proxy that should handle a Service (and its EndpointSlices); kube-proxy
/// ignores objects carrying it unless it names this proxy.
pub const SERVICE_PROXY_NAME_LABEL: &str = "service.kubernetes.io/service-proxy-name";

/// Label the EndpointSlice controller puts on slices of headless Services, which kube-proxy
/// never programs.
pub const HEADLESS_LABEL: &str = "service.kubernetes.io/headless";

/// Objects per list page when (re)listing: client-go's reflector default, which keeps a relist
/// of a large cluster from being one huge response.
pub const DEFAULT_LIST_PAGE_SIZE: u32 = 500;

/// Client QPS upstream uses by default (`clientConnection.qps`); accepted but not enforced.
pub const DEFAULT_CLIENT_QPS: f32 = 5.0;

/// Client burst upstream uses by default (`clientConnection.burst`); accepted but not enforced.
pub const DEFAULT_CLIENT_BURST: i32 = 10;

/// Content type upstream asks for by default (`clientConnection.contentType`); kube-rs only
/// speaks JSON, so it is accepted but not used.
pub const DEFAULT_CLIENT_CONTENT_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// Errors of the API server source.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The file given with `--kubeconfig` could not be read, or its current context is unusable.
    #[error("kubeconfig {path}")]
    Kubeconfig {
        /// The file that was tried.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: KubeconfigError,
    },
    /// The `--master` URL does not parse.
    #[error("invalid --master URL {url:?}")]
    InvalidMaster {
        /// The URL as given (after adding a default scheme).
        url: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Neither `--kubeconfig` nor `--master` was given, and neither the in-cluster service
    /// account nor the default kubeconfig (`$KUBECONFIG`, `~/.kube/config`) could be loaded.
    #[error(
        "no --kubeconfig or --master given; in-cluster service account config failed ({in_cluster}) and so did the default kubeconfig"
    )]
    NoConfig {
        /// Why the in-cluster config failed.
        in_cluster: InClusterError,
        /// Why `kube::Config::infer` failed.
        #[source]
        default: InferConfigError,
    },
    /// The configuration loaded but no client could be built from it (TLS material, auth).
    #[error("building a Kubernetes client from {from}")]
    Client {
        /// Where the configuration came from.
        from: String,
        /// Why it failed.
        #[source]
        source: kube::Error,
    },
    /// The node name is empty, so the Node watch would select every node.
    #[error("the node name is empty")]
    EmptyNodeName,
}

/// How to reach the API server (upstream's `--kubeconfig`, `--master` and `clientConnection`).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientOptions {
    /// A kubeconfig file; its current context is used.
    pub kubeconfig: Option<PathBuf>,
    /// The API server URL; overrides the kubeconfig's server when both are given.
    pub master: Option<String>,
    /// Accepted for compatibility; kube-rs has no client-side rate limiter.
    pub qps: f32,
    /// Accepted for compatibility; kube-rs has no client-side rate limiter.
    pub burst: i32,
    /// Accepted for compatibility; kube-rs only speaks JSON.
    pub content_type: String,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            kubeconfig: None,
            master: None,
            qps: DEFAULT_CLIENT_QPS,
            burst: DEFAULT_CLIENT_BURST,
            content_type: DEFAULT_CLIENT_CONTENT_TYPE.to_owned(),
        }
    }
}

/// Builds a Kubernetes client the way upstream's `clientcmd.BuildConfigFromFlags` does: the
/// kubeconfig file if given (with `--master` overriding its server), else `--master` alone,
/// else the in-cluster service account, else the default kubeconfig.
pub async fn client(opts: &ClientOptions) -> Result<kube::Client, ApiError> {
    tracing::debug!(
        qps = opts.qps,
        burst = opts.burst,
        content_type = %opts.content_type,
        "client QPS, burst and content type are not used by kube-rs"
    );
    let (config, from) = load_config(opts).await?;
    tracing::info!(server = %config.cluster_url, %from, "using Kubernetes API server");
    kube::Client::try_from(config).map_err(|source| ApiError::Client { from, source })
}

async fn load_config(opts: &ClientOptions) -> Result<(Config, String), ApiError> {
    if let Some(path) = &opts.kubeconfig {
        let kubeconfig_err = |source| ApiError::Kubeconfig {
            path: path.clone(),
            source,
        };
        let kubeconfig = Kubeconfig::read_from(path).map_err(kubeconfig_err)?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(kubeconfig_err)?;
        let mut from = format!("kubeconfig {}", path.display());
        if let Some(master) = &opts.master {
            // The kubeconfig normally carries TLS settings, so a bare host means https.
            config.cluster_url = parse_master(master, "https")?;
            from.push_str(" with --master");
        }
        return Ok((config, from));
    }
    if let Some(master) = &opts.master {
        // Without TLS settings client-go defaults a bare host to plain http.
        let url: http::Uri = parse_master(master, "http")?;
        let plain = url.scheme_str() == Some("http");
        let mut config = Config::new(url);
        if plain {
            // kube-rs builds its TLS settings even for plain http, and without a CA of its own
            // they need the system's trust store: on a host without CA certificates the client
            // would not build at all. An empty store of its own is never used over http.
            config.root_cert = Some(Vec::new());
        }
        return Ok((config, format!("--master {master}")));
    }
    match Config::incluster() {
        Ok(config) => Ok((config, "in-cluster service account".to_owned())),
        Err(in_cluster) => {
            tracing::info!(error = %in_cluster, "no in-cluster config; trying the default kubeconfig");
            match Config::infer().await {
                Ok(config) => Ok((config, "default kubeconfig".to_owned())),
                Err(default) => Err(ApiError::NoConfig {
                    in_cluster,
                    default,
                }),
            }
        }
    }
}

/// Parses a `--master` value, adding `default_scheme` when it is a bare `host:port`.
fn parse_master<U>(master: &str, default_scheme: &str) -> Result<U, ApiError>
where
    U: std::str::FromStr,
    U::Err: std::error::Error + Send + Sync + 'static,
{
    let url = if master.contains("://") {
        master.to_owned()
    } else {
        format!("{default_scheme}://{master}")
    };
    url.parse()
        .map_err(|source: U::Err| ApiError::InvalidMaster {
            url,
            source: Box::new(source),
        })
}

/// Watches the API server and reports Services, EndpointSlices and this Node as
/// [`SourceEvent`]s.
pub struct ApiSource {
    client: kube::Client,
    node_name: String,
    service_proxy_name: Option<String>,
    retry: RetryPolicy,
    page_size: u32,
    metrics: ApiMetrics,
}

impl ApiSource {
    /// A source for the node `node_name`, with upstream's defaults.
    pub fn new(client: kube::Client, node_name: impl Into<String>) -> Self {
        Self {
            client,
            node_name: node_name.into(),
            service_proxy_name: None,
            retry: RetryPolicy::default(),
            page_size: DEFAULT_LIST_PAGE_SIZE,
            metrics: ApiMetrics::default(),
        }
    }

    /// Also handle Services and EndpointSlices whose `service.kubernetes.io/service-proxy-name`
    /// label equals `name` (newest upstream config API). An empty name means none, as upstream.
    pub fn service_proxy_name(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        self.service_proxy_name = (!name.is_empty()).then_some(name);
        self
    }

    /// Retry a failed list or watch after a fixed `delay` instead of the default backoff
    /// ([`RetryPolicy::default`]). Meant for tests.
    pub fn retry_delay(self, delay: Duration) -> Self {
        self.retry(RetryPolicy::fixed(delay))
    }

    /// Retry failed lists and watches with `policy` (a `410 Gone` still relists at once).
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// Register the source's metrics (outages, failed and expired watches) in `registry`.
    pub fn register_metrics(self, registry: &mut Registry) -> Self {
        self.metrics.register(registry);
        self
    }

    /// The source's metrics, for callers that read or register them themselves.
    pub fn metrics(&self) -> ApiMetrics {
        self.metrics.clone()
    }

    /// Objects per list page (default [`DEFAULT_LIST_PAGE_SIZE`]; 0 means unpaged).
    pub fn list_page_size(mut self, size: u32) -> Self {
        self.page_size = size;
        self
    }

    /// Runs the three watchers until `shutdown` is cancelled or the receiver of `tx` is
    /// dropped, then returns `Ok`. Watch errors are logged and retried, never returned.
    pub async fn run(
        self,
        tx: mpsc::Sender<SourceEvent>,
        shutdown: CancellationToken,
    ) -> Result<(), ApiError> {
        if self.node_name.is_empty() {
            return Err(ApiError::EmptyNodeName);
        }
        let page_size = (self.page_size > 0).then_some(self.page_size);
        let base = watcher::Config {
            page_size,
            ..watcher::Config::default()
        };
        // Upstream watches Services and EndpointSlices with one selector: neither headless
        // objects nor objects of another service proxy. A label selector cannot say "absent or
        // equal to X", so with a proxy name that label is filtered here instead of by the server.
        let labels = match &self.service_proxy_name {
            None => format!("!{HEADLESS_LABEL},!{SERVICE_PROXY_NAME_LABEL}"),
            Some(_) => format!("!{HEADLESS_LABEL}"),
        };
        let service_config = base.clone().labels(&labels);
        let filter = ProxyNameFilter(self.service_proxy_name.clone());
        let contact = Contact::new(self.metrics.clone());
        // Each watcher's requests go through a client that reports answers to `contact`.
        let client = |kind| Observed::client(&self.client, &contact, kind);
        let ctx = Ctx {
            tx,
            shutdown,
            retry: self.retry,
            contact: contact.clone(),
        };
        tokio::join!(
            watch_kind(
                Watch {
                    kind: "Service",
                    api: Api::all(client("Service")),
                    config: service_config,
                    tracker: Tracker::<Service>::new(Some(filter.clone())),
                    wrap: SourceEvent::Service,
                },
                &ctx,
            ),
            watch_kind(
                Watch {
                    kind: "EndpointSlice",
                    api: Api::all(client("EndpointSlice")),
                    config: base.clone().labels(&labels),
                    tracker: Tracker::<EndpointSlice>::new(Some(filter)),
                    wrap: SourceEvent::EndpointSlice,
                },
                &ctx,
            ),
            watch_kind(
                Watch {
                    kind: "Node",
                    api: Api::all(client("Node")),
                    config: base
                        .clone()
                        .fields(&format!("metadata.name={}", self.node_name)),
                    tracker: Tracker::<Node>::new(None),
                    wrap: SourceEvent::Node,
                },
                &ctx,
            ),
            watch_kind(
                Watch {
                    kind: "ServiceCIDR",
                    api: Api::all(client("ServiceCIDR")),
                    config: base.clone(),
                    tracker: Tracker::<ServiceCIDR>::new(None),
                    wrap: SourceEvent::ServiceCidr,
                },
                &ctx,
            ),
        );
        Ok(())
    }
}

/// What every watcher shares.
struct Ctx {
    tx: mpsc::Sender<SourceEvent>,
    shutdown: CancellationToken,
    retry: RetryPolicy,
    contact: Contact,
}

/// One kind to watch.
struct Watch<K> {
    kind: &'static str,
    api: Api<Decoded<K>>,
    config: watcher::Config,
    tracker: Tracker<K>,
    wrap: fn(ObjectEvent<K>) -> SourceEvent,
}

/// Runs one watcher until shutdown or until nobody listens.
async fn watch_kind<K>(watch: Watch<K>, ctx: &Ctx)
where
    K: Watched + Clone + Default + Debug + Send + Sync + 'static,
{
    let Watch {
        kind,
        api,
        config,
        mut tracker,
        wrap,
    } = watch;
    let stream = watcher(api, config).boxed();
    drive(kind, stream, &mut tracker, wrap, ctx).await;
}

/// Forwards one watcher's events until shutdown or until nobody listens, waiting out the
/// [`Backoff`] after each failure.
async fn drive<K>(
    kind: &'static str,
    mut stream: BoxStream<'static, Result<watcher::Event<Decoded<K>>, watcher::Error>>,
    tracker: &mut Tracker<K>,
    wrap: fn(ObjectEvent<K>) -> SourceEvent,
    ctx: &Ctx,
) where
    K: Watched + Default,
{
    let mut backoff = Backoff::new(ctx.retry);
    // The first list is not a relist; every later completed one is.
    let mut listed = false;
    // When the current relist started, to log how long it took.
    let mut relist_started: Option<tokio::time::Instant> = None;
    loop {
        // After an outage, a watch resumed without events shows only by staying open: look
        // again every so often while an outage or the recovery from one goes on (`next()` is
        // cancel-safe: the watcher keeps its progress in the stream).
        let look_again = ctx.contact.is_down() || ctx.contact.resuming(kind);
        let item = tokio::select! {
            biased;
            () = ctx.shutdown.cancelled() => return,
            () = ctx.tx.closed() => return,
            item = stream.next() => item,
            () = tokio::time::sleep(RESUME_SETTLE), if look_again => {
                ctx.contact.check_settled(kind);
                continue;
            }
        };
        let event = match item {
            Some(Ok(event)) => {
                if !matches!(event, watcher::Event::Init | watcher::Event::InitApply(_)) {
                    // A relist finished or an event came: in step again (a list that keeps
                    // failing after its `Init`, an undecodable page, is not). The delay
                    // starts over only once no failure came for the healthy period.
                    backoff.succeeded();
                    ctx.contact.resumed(kind);
                }
                event
            }
            Some(Err(error)) if not_served(&error) && kind == "ServiceCIDR" => {
                // Clusters before the ServiceCIDR API (v1.33), or a role without it: nftables
                // mode then has no unallocated-ClusterIP drop, as upstream without the API.
                tracing::warn!(
                    kind,
                    error = %error.chain(),
                    "cannot list (API not served, or RBAC lacks list/watch on servicecidrs); \
                     not watched: nftables mode will not drop traffic to unallocated ClusterIPs"
                );
                ctx.contact.resumed(kind);
                return;
            }
            Some(Err(error)) => {
                let failure = Failure::of(&error);
                let delay = backoff.failed(failure, tokio::time::Instant::now(), jitter_unit());
                ctx.contact.count_failure(kind, failure);
                ctx.contact.failed(kind);
                // An error can quote a whole response body: log its first line, shortened.
                let error = Short(&error);
                match failure {
                    Failure::Expired => tracing::info!(
                        kind,
                        %error,
                        ?delay,
                        "watch history expired; relisting"
                    ),
                    // Logged once per outage by `Contact`; each retry only at debug level.
                    Failure::Unreachable => ctx.contact.unreachable(kind, &error, delay),
                    Failure::Refused => tracing::warn!(
                        kind,
                        %error,
                        ?delay,
                        "watch failed; retrying, last state kept"
                    ),
                }
                if !wait_to_retry(ctx, failure, delay).await {
                    return;
                }
                continue;
            }
            None => {
                // The watcher never ends by itself; if it ever does, keep the last state.
                tracing::error!(kind, "watch stream ended; no further updates");
                ctx.contact.resumed(kind);
                return;
            }
        };
        match event {
            watcher::Event::Init => relist_started = Some(tokio::time::Instant::now()),
            watcher::Event::InitDone if listed => {
                ctx.contact
                    .metrics()
                    .relists
                    .get_or_create(&KindLabel { kind })
                    .inc();
            }
            watcher::Event::InitDone => listed = true,
            _ => {}
        }
        let events = tracker.handle(event);
        report_skipped(kind, tracker, ctx);
        for out in events {
            if matches!(out, ObjectEvent::Synced) {
                let took = relist_started.take().map(|t| t.elapsed());
                tracing::info!(kind, objects = tracker.len(), ?took, "synced");
            }
            let sent = tokio::select! {
                biased;
                () = ctx.shutdown.cancelled() => false,
                sent = ctx.tx.send(wrap(out)) => sent.is_ok(),
            };
            if !sent {
                return;
            }
        }
    }
}

/// Waits `delay` before retrying after `failure`; after an unanswered request, only until
/// the API server answers another watcher's (the outage is over: a delay grown during it
/// would only hold this watch back). Returns `false` on shutdown or when nobody listens.
async fn wait_to_retry(ctx: &Ctx, failure: Failure, delay: Duration) -> bool {
    if delay.is_zero() {
        return true;
    }
    let answered = ctx.contact.answers_again();
    let outage = failure == Failure::Unreachable;
    if outage && !ctx.contact.is_down() {
        // Answered since this failure was reported.
        return true;
    }
    tokio::select! {
        biased;
        () = ctx.shutdown.cancelled() => false,
        () = ctx.tx.closed() => false,
        () = answered, if outage => true,
        () = tokio::time::sleep(delay) => true,
    }
}

/// Counts the versions `tracker` skipped, and logs each new problem once.
fn report_skipped<K>(kind: &'static str, tracker: &mut Tracker<K>, ctx: &Ctx) {
    for (key, problem) in tracker.skipped.drain(..) {
        ctx.contact
            .metrics()
            .skipped_objects
            .get_or_create(&KindLabel { kind })
            .inc();
        if let Some(problem) = problem {
            tracing::warn!(
                kind,
                object = %Shown(&key),
                %problem,
                "skipping an object the proxy cannot use; its last good state is kept"
            );
        }
    }
}

/// Whether the list of the watched kind is refused for good: not served (404) or not
/// allowed (403).
fn not_served(error: &watcher::Error) -> bool {
    matches!(
        error,
        watcher::Error::InitialListFailed(kube::Error::Api(status))
            if status.is_not_found() || status.code == 403
    )
}

/// Accepts objects without the service-proxy-name label, or with it equal to this proxy's name.
#[derive(Clone, Debug)]
struct ProxyNameFilter(Option<String>);

impl ProxyNameFilter {
    fn accepts(&self, meta: &ObjectMeta) -> bool {
        match meta
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
        {
            None => true,
            Some(value) => self.0.as_deref() == Some(value.as_str()),
        }
    }
}

/// Namespace and name.
type Key = (Option<String>, String);

/// What a deletion of the object under `key` carries: its identity alone.
fn identity<K: Resource + Default>((namespace, name): Key) -> K {
    crate::identity(namespace, name)
}

fn key_of(meta: &ObjectMeta) -> Key {
    (
        meta.namespace.clone(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// A key as `namespace/name` (or `name`), control characters escaped: one log line.
struct Shown<'a>(&'a Key);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (namespace, name) = self.0;
        match namespace {
            Some(namespace) => write!(f, "{}/{}", namespace.escape_debug(), name.escape_debug()),
            None => write!(f, "{}", name.escape_debug()),
        }
    }
}

/// An error's text on one line, shortened: kube-rs puts a whole undecodable response body
/// into its error, and a log line must not carry a list of objects.
struct Short<'a, E>(&'a E);

impl<E: fmt::Display> fmt::Display for Short<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&one_line(&self.0.to_string()))
    }
}

/// Turns watcher events into [`ObjectEvent`]s, remembering what was reported so a relist can
/// report the objects that vanished meanwhile (like an informer's store, but of keys only:
/// the core keeps what it needs of each object, and a deletion is known by its key).
struct Tracker<K> {
    /// Every object reported as applied and not yet deleted.
    known: BTreeSet<Key>,
    /// Objects whose last version could not be used, with the problem last logged.
    unusable: BTreeMap<Key, String>,
    /// Keys seen since the last `Init`, while a relist is in progress.
    relist: Option<BTreeSet<Key>>,
    filter: Option<ProxyNameFilter>,
    /// Versions skipped since the caller last drained this: the object, and its problem when
    /// it is new for that object (to log; a repeated one is only counted).
    skipped: Vec<(Key, Option<String>)>,
    kind: PhantomData<fn() -> K>,
}

impl<K: Watched + Default> Tracker<K> {
    fn new(filter: Option<ProxyNameFilter>) -> Self {
        Self {
            known: BTreeSet::new(),
            unusable: BTreeMap::new(),
            relist: None,
            filter,
            skipped: Vec::new(),
            kind: PhantomData,
        }
    }

    fn len(&self) -> usize {
        self.known.len()
    }

    fn accepts(&self, meta: &ObjectMeta) -> bool {
        self.filter.as_ref().is_none_or(|f| f.accepts(meta))
    }

    /// Applies `decoded` if the filter accepts it; if it no longer does, reports it deleted.
    fn apply(&mut self, decoded: Decoded<K>, out: &mut Vec<ObjectEvent<K>>) {
        let key = key_of(decoded.meta());
        if !self.accepts(decoded.meta()) {
            self.unusable.remove(&key);
            if self.known.remove(&key) {
                out.push(ObjectEvent::Deleted(identity(key)));
            }
            return;
        }
        if let Some(seen) = &mut self.relist {
            seen.insert(key.clone());
        }
        match decoded {
            Decoded::Usable(obj) => {
                self.unusable.remove(&key);
                self.known.insert(key);
                out.push(ObjectEvent::Applied(obj));
            }
            Decoded::Unusable(Unusable { problem, .. }) => {
                let new = self.unusable.get(&key) != Some(&problem);
                if new {
                    self.unusable.insert(key.clone(), problem.clone());
                }
                self.skipped.push((key, new.then_some(problem)));
            }
        }
    }

    /// A deletion applies whatever the deleted object's body holds: the object reported
    /// under its key is deleted.
    fn delete(&mut self, decoded: Decoded<K>, out: &mut Vec<ObjectEvent<K>>) {
        let key = key_of(decoded.meta());
        self.unusable.remove(&key);
        if self.known.remove(&key) {
            out.push(ObjectEvent::Deleted(identity(key)));
        } else if let Decoded::Usable(obj) = decoded
            && self.accepts(obj.meta())
        {
            out.push(ObjectEvent::Deleted(obj));
        }
    }

    fn handle(&mut self, event: watcher::Event<Decoded<K>>) -> Vec<ObjectEvent<K>> {
        let mut out = Vec::new();
        match event {
            watcher::Event::Init => self.relist = Some(BTreeSet::new()),
            watcher::Event::InitApply(obj) | watcher::Event::Apply(obj) => {
                self.apply(obj, &mut out);
            }
            watcher::Event::InitDone => {
                if let Some(seen) = self.relist.take() {
                    self.unusable.retain(|key, _| seen.contains(key));
                    let (kept, gone): (BTreeSet<Key>, BTreeSet<Key>) =
                        std::mem::take(&mut self.known)
                            .into_iter()
                            .partition(|key| seen.contains(key));
                    self.known = kept;
                    out.extend(
                        gone.into_iter()
                            .map(|key| ObjectEvent::Deleted(identity(key))),
                    );
                } else {
                    // Without a matching Init nothing is known about what vanished; deleting
                    // everything would flush the data plane, so keep it all.
                    tracing::warn!("relist ended without starting; not diffing");
                }
                out.push(ObjectEvent::Synced);
            }
            watcher::Event::Delete(obj) => self.delete(obj, &mut out),
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn svc(name: &str, proxy: Option<&str>) -> Service {
        Service {
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                labels: proxy.map(|p| [(SERVICE_PROXY_NAME_LABEL.to_owned(), p.to_owned())].into()),
                ..ObjectMeta::default()
            },
            ..Service::default()
        }
    }

    fn relist(tracker: &mut Tracker<Service>, objs: Vec<Service>) -> Vec<ObjectEvent<Service>> {
        let mut out = tracker.handle(watcher::Event::Init);
        for obj in objs {
            out.extend(tracker.handle(watcher::Event::InitApply(Decoded::Usable(obj))));
        }
        out.extend(tracker.handle(watcher::Event::InitDone));
        out
    }

    #[test]
    fn relist_deletes_only_vanished_objects() {
        let mut t = Tracker::new(None);
        relist(&mut t, vec![svc("a", None), svc("b", None)]);
        let out = relist(&mut t, vec![svc("a", None)]);
        assert_eq!(
            out,
            vec![
                ObjectEvent::Applied(svc("a", None)),
                ObjectEvent::Deleted(svc("b", None)),
                ObjectEvent::Synced
            ]
        );
    }

    #[test]
    fn init_done_without_init_deletes_nothing() {
        let mut t = Tracker::new(None);
        t.handle(watcher::Event::Apply(Decoded::Usable(svc("a", None))));
        assert_eq!(
            t.handle(watcher::Event::InitDone),
            vec![ObjectEvent::Synced]
        );
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn proxy_name_filter() {
        let mut t = Tracker::new(Some(ProxyNameFilter(Some("mine".into()))));
        let out = relist(
            &mut t,
            vec![
                svc("plain", None),
                svc("mine", Some("mine")),
                svc("other", Some("other")),
            ],
        );
        assert_eq!(
            out,
            vec![
                ObjectEvent::Applied(svc("plain", None)),
                ObjectEvent::Applied(svc("mine", Some("mine"))),
                ObjectEvent::Synced
            ]
        );
        // Relabelled to another proxy: gone for us, reported by its identity.
        let out = t.handle(watcher::Event::Apply(Decoded::Usable(svc(
            "plain",
            Some("other"),
        ))));
        assert_eq!(out, vec![ObjectEvent::Deleted(svc("plain", None))]);
        // Deleting an object we never reported says nothing.
        assert!(
            t.handle(watcher::Event::Delete(Decoded::Usable(svc(
                "other",
                Some("other")
            ))))
            .is_empty()
        );
        // A deletion carries the identity alone (no labels): all the core reads of it.
        let out = t.handle(watcher::Event::Delete(Decoded::Usable(svc(
            "mine",
            Some("mine"),
        ))));
        assert_eq!(out, vec![ObjectEvent::Deleted(svc("mine", None))]);
        assert_eq!(t.len(), 0);
    }

    fn odd(name: &str) -> Decoded<Service> {
        Decoded::Unusable(Unusable {
            meta: svc(name, None).metadata,
            problem: "spec.ports[0].port: invalid type: string \"x\", expected i32".into(),
        })
    }

    #[test]
    fn an_unusable_version_keeps_the_last_good_one_and_is_reported_once() {
        let mut t = Tracker::new(None);
        relist(&mut t, vec![svc("a", None), svc("b", None)]);
        let out = t.handle(watcher::Event::Apply(odd("a")));
        assert!(out.is_empty(), "{out:?}");
        let skipped: Vec<_> = t.skipped.drain(..).collect();
        assert_eq!(skipped.len(), 1);
        assert!(
            skipped[0]
                .1
                .as_deref()
                .is_some_and(|p| p.contains("spec.ports[0].port"))
        );
        // A relist that still holds the odd version neither deletes nor re-logs it.
        let mut out = t.handle(watcher::Event::Init);
        out.extend(t.handle(watcher::Event::InitApply(odd("a"))));
        out.extend(t.handle(watcher::Event::InitApply(Decoded::Usable(svc("b", None)))));
        out.extend(t.handle(watcher::Event::InitDone));
        assert_eq!(
            out,
            vec![ObjectEvent::Applied(svc("b", None)), ObjectEvent::Synced]
        );
        assert_eq!(
            t.skipped.drain(..).collect::<Vec<_>>(),
            vec![(key_of(&svc("a", None).metadata), None)]
        );
        assert_eq!(t.len(), 2);
        // Usable again: applied, and a later problem is news again.
        let out = t.handle(watcher::Event::Apply(Decoded::Usable(svc("a", None))));
        assert_eq!(out, vec![ObjectEvent::Applied(svc("a", None))]);
        t.handle(watcher::Event::Apply(odd("a")));
        assert!(t.skipped.drain(..).all(|(_, problem)| problem.is_some()));
    }

    #[test]
    fn deleting_an_unusable_object_deletes_its_last_good_state() {
        let mut t = Tracker::new(None);
        relist(&mut t, vec![svc("a", None)]);
        t.handle(watcher::Event::Apply(odd("a")));
        let out = t.handle(watcher::Event::Delete(odd("a")));
        assert_eq!(out, vec![ObjectEvent::Deleted(svc("a", None))]);
        assert_eq!(t.len(), 0);
        // One never reported: nothing to delete downstream.
        t.handle(watcher::Event::Apply(odd("new")));
        assert!(t.handle(watcher::Event::Delete(odd("new"))).is_empty());
        assert!(t.unusable.is_empty());
    }

    #[test]
    fn an_object_that_vanished_from_a_relist_while_unusable_is_deleted() {
        let mut t = Tracker::new(None);
        relist(&mut t, vec![svc("a", None)]);
        t.handle(watcher::Event::Apply(odd("a")));
        let out = relist(&mut t, vec![]);
        assert_eq!(
            out,
            vec![ObjectEvent::Deleted(svc("a", None)), ObjectEvent::Synced]
        );
        assert!(t.unusable.is_empty());
    }

    type Item = Result<watcher::Event<Decoded<Service>>, watcher::Error>;

    /// A connection refused: the API server is away.
    fn refused() -> Item {
        Err(watcher::Error::WatchStartFailed(kube::Error::Service(
            Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
        )))
    }

    /// A watcher's stream playing `script`, and when (ms after the start) each item was taken.
    fn scripted(
        script: Vec<Item>,
    ) -> (
        BoxStream<'static, Item>,
        std::sync::Arc<std::sync::Mutex<Vec<u128>>>,
    ) {
        let start = tokio::time::Instant::now();
        let taken = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = taken.clone();
        let stream = futures::stream::iter(script)
            .inspect(move |_| {
                let at = start.elapsed().as_millis();
                record.lock().expect("lock").push(at);
            })
            .boxed();
        (stream, taken)
    }

    /// A scripted watcher: an outage (five refused connections), then the restarted server's
    /// `410`, a relist, and one more refused connection. Returns when each item was taken.
    #[tokio::test(start_paused = true)]
    async fn drive_waits_the_backoff_but_relists_at_once_after_410() {
        use kube::core::Status;
        let gone = Err(watcher::Error::WatchError(
            Status::failure("too old resource version: 5 (90)", "Expired")
                .with_code(410)
                .boxed(),
        ));
        let mut script = vec![refused(), refused(), refused(), refused(), refused()];
        script.extend([
            gone,
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(Decoded::Usable(svc("a", None)))),
            Ok(watcher::Event::InitDone),
            refused(),
            Ok(watcher::Event::Apply(Decoded::Usable(svc("b", None)))),
        ]);
        let (stream, taken) = scripted(script);
        let (tx, mut rx) = mpsc::channel(16);
        let metrics = ApiMetrics::default();
        let ctx = Ctx {
            tx,
            shutdown: CancellationToken::new(),
            retry: RetryPolicy {
                initial: Duration::from_secs(1),
                max: Duration::from_secs(3),
                reset_after: Duration::from_secs(60),
                jitter: false,
            },
            contact: Contact::new(metrics.clone()),
        };
        let mut tracker = Tracker::new(None);
        drive("Service", stream, &mut tracker, SourceEvent::Service, &ctx).await;
        // 1, 2, 3 (capped), 3 s between the refusals; the 410 relists at once; the relist
        // succeeded, but a refusal right after it waits the grown 3 s (healthy for less than
        // `reset_after`).
        assert_eq!(
            *taken.lock().expect("lock"),
            [
                0, 1000, 3000, 6000, 9000, 12000, 12000, 12000, 12000, 12000, 15000
            ]
        );
        drop(ctx);
        // a applied, synced, b applied.
        let mut events = 0;
        while rx.recv().await.is_some() {
            events += 1;
        }
        assert_eq!(events, 3);
        let text = exposition(&metrics);
        assert!(
            text.contains(
                "kube_proxy_rs_watch_failures_total{kind=\"Service\",reason=\"unreachable\"} 6\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "kube_proxy_rs_watch_failures_total{kind=\"Service\",reason=\"expired\"} 1\n"
            ),
            "{text}"
        );
    }

    /// A watcher waiting out a long delay after an unanswered request retries as soon as
    /// another watcher's request is answered; one whose request was answered with an error
    /// (the server is up) waits its delay out.
    #[tokio::test(start_paused = true)]
    async fn an_answer_to_another_watcher_ends_the_wait() {
        let status = |code| {
            Err(watcher::Error::InitialListFailed(kube::Error::Api(
                kube::core::Status::failure("etcd", "InternalError")
                    .with_code(code)
                    .boxed(),
            )))
        };
        let (stream, taken) = scripted(vec![
            refused(),
            Ok(watcher::Event::Apply(Decoded::Usable(svc("a", None)))),
            status(500),
            Ok(watcher::Event::Apply(Decoded::Usable(svc("b", None)))),
        ]);
        let (tx, _rx) = mpsc::channel(16);
        let contact = Contact::new(ApiMetrics::default());
        let ctx = Ctx {
            tx,
            shutdown: CancellationToken::new(),
            retry: RetryPolicy::fixed(Duration::from_secs(600)),
            contact: contact.clone(),
        };
        let other = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            contact.answered("Node", false);
        });
        let mut tracker = Tracker::new(None);
        drive("Service", stream, &mut tracker, SourceEvent::Service, &ctx).await;
        other.await.expect("the other watcher");
        assert_eq!(*taken.lock().expect("lock"), [0, 5000, 5000, 605_000]);
    }

    fn exposition(metrics: &ApiMetrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        text
    }
}
