//! Wiring: source → proxier (tracker, runner, backend) → servers, with one shutdown signal.
//!
//! The admin servers (health, metrics, health-check node ports) run on their own
//! single-threaded runtime on a dedicated thread, so they keep answering while the main
//! runtime is busy with a large sync.

use kp_core::report::ErrorChain as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kp_config::{KubeProxyConfiguration, Options};
use kp_core::backend::Backend;
use kp_core::health::{ProxyHealth, ServiceHealthMap};
use kp_core::metrics::Metrics;
use kp_core::model::IpFamily;
use kp_core::proxier::{Proxier, ProxierConfig};
use kp_server::{HealthMetrics, MetricsInfo, ServiceHealthServers};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// How many source events may queue before a source waits for the proxier. Each event holds a
/// whole object, so a deep queue costs memory during the initial list (4096 queued objects were
/// a visible part of peak RSS at 10k services); the proxier drains events in batches anyway, so a
/// short queue only adds backpressure.
pub(crate) const EVENT_QUEUE: usize = 256;

/// Upstream retries a failed bind of the health or metrics port this often.
const BIND_RETRY: Duration = Duration::from_secs(5);

/// Everything `run` needs besides the backend.
#[derive(Debug)]
pub struct Settings {
    config: KubeProxyConfiguration,
    manifests: Option<PathBuf>,
    master: Option<String>,
    node: crate::node_ips::NodeAddressing,
    /// The Node's IPs at start-up, which later Node events are compared with.
    node_raw_ips: Vec<std::net::IpAddr>,
    /// This node's Node was found at start-up: the first sync waits for its labels.
    node_found: bool,
    debug_explain: bool,
    /// Userspace mode's affinity tables, for `/debug/explain` to name a client's pin.
    affinity: Option<kp_userspace::AffinityTables>,
    /// What the mode owns on nf_tables, watched for other programs' changes.
    #[cfg(target_os = "linux")]
    watch: Option<kp_dataplane::watch::Owned>,
    /// The mode's canaries are checked every `canaryPeriod` even while nf_tables is watched.
    canaries_while_watched: bool,
    /// The IP families the kernel has (what `/healthz` reports on).
    families: Vec<IpFamily>,
    /// The manifests source, started at start-up to read this node's Node from its first
    /// reading (so the files are decoded once); `None` with the API server as source.
    source: Option<StartedSource>,
}

/// A source already running: its events and how to stop it.
#[derive(Debug)]
pub struct StartedSource {
    events: mpsc::Receiver<kp_core::event::SourceEvent>,
    task: tokio::task::JoinHandle<()>,
    shutdown: CancellationToken,
}

/// The manifests source's removal guard (`PERCENT%,MIN` or `off`; default `50%,100`): a read
/// that would remove more of the known Services at once waits for a second read.
pub(crate) const REMOVAL_GUARD_ENV: &str = "KUBE_PROXY_RS_MANIFESTS_REMOVAL_GUARD";

/// The removal guard [`REMOVAL_GUARD_ENV`] asks for; unset is the default, anything else
/// that is not a guard is an error.
fn removal_guard_from_env() -> anyhow::Result<kp_sources::manifests::RemovalGuard> {
    match std::env::var(REMOVAL_GUARD_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(Default::default()),
        Err(error) => Err(anyhow::anyhow!("${REMOVAL_GUARD_ENV}: {error}")),
        Ok(value) => value
            .parse()
            .with_context(|| format!("${REMOVAL_GUARD_ENV}")),
    }
}

/// The longest delay between retries of a failed list or watch of the API server (a Go
/// duration; default 30s, client-go's reflector cap).
pub(crate) const API_RETRY_MAX_ENV: &str = "KUBE_PROXY_RS_API_RETRY_MAX";

/// The retry policy [`API_RETRY_MAX_ENV`] asks for; unset is the default, zero or anything
/// that is not a duration is an error.
fn api_retry_from_env() -> anyhow::Result<kp_sources::api::RetryPolicy> {
    api_retry(std::env::var(API_RETRY_MAX_ENV))
}

/// The retry policy for the value of [`API_RETRY_MAX_ENV`].
fn api_retry(
    value: Result<String, std::env::VarError>,
) -> anyhow::Result<kp_sources::api::RetryPolicy> {
    let value = match value {
        Err(std::env::VarError::NotPresent) => return Ok(Default::default()),
        Err(error) => return Err(anyhow::anyhow!("${API_RETRY_MAX_ENV}: {error}")),
        Ok(value) => value,
    };
    let max = kp_config::duration::parse(value.trim())
        .with_context(|| format!("${API_RETRY_MAX_ENV}"))?;
    anyhow::ensure!(
        !max.is_zero(),
        "${API_RETRY_MAX_ENV}: {value:?} would retry a failed watch in a tight loop"
    );
    Ok(kp_sources::api::RetryPolicy::capped(max))
}

/// Starts the manifests source at `path` for `node_name`, its metrics in `registry`, telling
/// `first_node` (when given) this node's Node once the first reading is done. Fails only for
/// an invalid [`REMOVAL_GUARD_ENV`].
pub(crate) fn start_manifests(
    path: &std::path::Path,
    node_name: &str,
    registry: &mut Registry,
    first_node: Option<tokio::sync::oneshot::Sender<Option<k8s_openapi::api::core::v1::Node>>>,
) -> anyhow::Result<StartedSource> {
    let guard = removal_guard_from_env()?;
    tracing::info!(path = %path.display(), removal_guard = %guard, "Reading Services, EndpointSlices and Nodes from manifests");
    let (tx, events) = mpsc::channel(EVENT_QUEUE);
    let shutdown = CancellationToken::new();
    let mut source = kp_sources::manifests::ManifestsSource::new(path.to_path_buf())
        .node_name(node_name.to_string())
        .removal_guard(guard)
        .register_metrics(registry);
    if let Some(first_node) = first_node {
        source = source.report_first_node(first_node);
    }
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            if let Err(error) = source.run(tx, shutdown).await {
                tracing::error!(error = %error.chain(), "manifests source stopped; keeping the last state");
            }
        }
    });
    Ok(StartedSource {
        events,
        task,
        shutdown,
    })
}

impl Settings {
    /// Settings from the parsed flags, the effective configuration, the node IPs detected
    /// at start-up with what they decide (the same answer the backend's rules use), the
    /// source started to detect them (if any) and the host's facts: its interface
    /// addresses and IP families.
    pub fn new(
        options: &Options,
        config: KubeProxyConfiguration,
        detected: &crate::node_ips::Detected,
        source: Option<StartedSource>,
        (local, families): (&[std::net::IpAddr], Vec<IpFamily>),
    ) -> Self {
        Self {
            node: crate::node_ips::NodeAddressing::new(&config, detected, local),
            node_raw_ips: detected.raw.clone(),
            node_found: detected.node_found,
            config,
            manifests: options.manifests.clone(),
            master: options.master.clone(),
            debug_explain: options.debug_explain,
            affinity: None,
            #[cfg(target_os = "linux")]
            watch: None,
            canaries_while_watched: false,
            families,
            source,
        }
    }

    /// Lets `/debug/explain` name which endpoint a client is pinned to (userspace mode).
    pub fn with_affinity(mut self, affinity: kp_userspace::AffinityTables) -> Self {
        self.affinity = Some(affinity);
        self
    }

    /// Watches nf_tables for other programs' changes to what `owned` describes (none: only
    /// the canary checks, every `canaryPeriod`, find them).
    #[cfg(target_os = "linux")]
    pub fn with_watch(mut self, owned: Option<kp_dataplane::watch::Owned>) -> Self {
        self.watch = owned;
        self
    }

    /// Checks the canaries every `canaryPeriod` even while nf_tables is watched (`yes`: the
    /// mode owns state nf_tables does not notify of).
    pub fn with_canaries_while_watched(mut self, yes: bool) -> Self {
        self.canaries_while_watched = yes;
        self
    }

    /// What the node's IPs decide.
    #[cfg_attr(
        not(target_os = "linux"),
        allow(dead_code, reason = "the Linux modes'")
    )]
    pub fn node(&self) -> &crate::node_ips::NodeAddressing {
        &self.node
    }

    /// The effective configuration.
    #[cfg_attr(
        not(target_os = "linux"),
        allow(dead_code, reason = "the Linux modes'")
    )]
    pub fn config(&self) -> &KubeProxyConfiguration {
        &self.config
    }
}

/// Runs the proxy until SIGTERM or SIGINT.
pub async fn run<B: Backend + 'static>(
    settings: Settings,
    backend: B,
    mut registry: Registry,
) -> anyhow::Result<()> {
    let config = settings.config;
    let node_name = node_name(&config);
    tracing::info!(node = %node_name, "Using node name");

    // Upstream 1.36 alpha (KEP-5808): the histograms also keep native buckets, which the
    // protobuf exposition of `/metrics` carries.
    let native = kp_core::metrics::native::NativeHistograms::default();
    let native_on = kp_config::gates::enabled(&config.feature_gates, "NativeHistograms");
    let metrics = Metrics::register_with(&mut registry, native_on.then_some(&native));
    let health_metrics = HealthMetrics::register(&mut registry);

    let StartedSource {
        events: source_rx,
        task: source,
        shutdown,
    } = match settings.source {
        Some(started) => started,
        None => {
            spawn_source(
                &settings.manifests,
                settings.master.as_deref(),
                &config,
                &node_name,
                &mut registry,
            )
            .await?
        }
    };
    tokio::spawn(stop_on_signal(shutdown.clone()));
    // As upstream's node manager: a Node whose IPs differ from the start-up ones (or its
    // deletion) ends the proxy with an error, so it restarts with the new ones.
    let (events_tx, events_rx) = mpsc::channel(EVENT_QUEUE);
    let watchdog = tokio::spawn(crate::node_ips::forward_watching(
        crate::node_ips::NodeIpsWatch::new(node_name.clone(), settings.node_raw_ips.clone()),
        source_rx,
        events_tx,
        shutdown.clone(),
    ));

    // Where nf_tables notifies, the canaries are checked when it does (and before periodic
    // syncs) until the watch is lost; elsewhere, and for what it cannot notify of (ipvs
    // mode's IPVS, kube-ipvs0 and ipsets), on a short period.
    #[cfg(target_os = "linux")]
    let watching = settings.watch.is_some();
    #[cfg(not(target_os = "linux"))]
    let watching = false;
    let mut proxier_config = ProxierConfig::new(node_name)
        .with_min_sync_period(config.min_sync_period())
        .with_sync_period(config.sync_period())
        .with_canary_period(config.canary_period)
        .with_canaries_paused_while_watched(watching && !settings.canaries_while_watched)
        .with_external_ips(kp_config::gates::enabled(
            &config.feature_gates,
            "AllowServiceExternalIPs",
        ));
    if settings.node_found {
        // Its labels decide topology hints: the first sync waits for the Node's watch,
        // bounded as the wait for its IPs at start-up.
        proxier_config = proxier_config.with_node_wait(kp_sources::node::DEFAULT_NODE_IPS_TIMEOUT);
    }
    let health = Arc::new(ProxyHealth::new(config.sync_period()));
    let mode = backend.mode();
    let proxier = Proxier::new(proxier_config, backend, health.clone(), metrics)
        .context("building the proxier")?;
    let admin = Admin {
        healthz: config.healthz_bind_address(),
        metrics: config.metrics_bind_address(),
        hard_fail: config.bind_address_hard_fail,
        health,
        health_metrics,
        registry: Arc::new(registry),
        info: MetricsInfo {
            proxy_mode: mode.to_string(),
            configz: serde_json::to_value(config.versioned()).context("encoding /configz")?,
            zpages: Some(crate::zpages::pages(
                &config,
                std::env::args_os(),
                std::time::SystemTime::now(),
            )),
            native,
        },
        service_health: proxier.service_health(),
        explainer: explainer(
            (settings.debug_explain, &settings.node, &settings.affinity),
            &config,
            &proxier,
        ),
        families: if mode == "fake" {
            vec![IpFamily::V4]
        } else {
            settings.families.clone()
        },
        node_port_ips: crate::node_ips::health_check_addresses(&settings.node.node_ports),
    };
    let admin_thread = admin.spawn(shutdown.clone())?;
    #[cfg(target_os = "linux")]
    let watcher = settings
        .watch
        .and_then(|owned| start_watch(owned, &proxier, mode));
    tracing::info!(mode, "Proxier starting");

    let result = proxier.run(events_rx, shutdown.clone()).await;
    shutdown.cancel();
    #[cfg(target_os = "linux")]
    if let Some((stop, thread)) = watcher {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if thread.join().is_err() {
            tracing::warn!("nf_tables watch thread panicked");
        }
    }
    if let Err(error) = source.await {
        tracing::warn!(error = %error.chain(), "source task ended abnormally");
    }
    let fatal = match admin_thread.join() {
        Ok(fatal) => fatal,
        Err(_) => {
            tracing::warn!("admin server thread panicked");
            None
        }
    };
    result.context("proxier")?;
    if let Some(fatal) = fatal {
        anyhow::bail!(fatal);
    }
    if let Ok(Some(restart)) = watchdog.await {
        return Err(restart.into());
    }
    tracing::info!("Shut down cleanly");
    Ok(())
}

/// The nf_tables watch thread and its stop flag; `None` when the kernel refuses the
/// subscription, which the proxier hears as a lost watch (its canary checks start).
#[cfg(target_os = "linux")]
fn start_watch<B: Backend>(
    owned: kp_dataplane::watch::Owned,
    proxier: &Proxier<B>,
    mode: &str,
) -> Option<(
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
)> {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    match kp_dataplane::watch::spawn(
        owned,
        proxier.activity(),
        proxier.foreign_events(),
        stop.clone(),
    ) {
        Ok(thread) => {
            tracing::info!(
                mode,
                "Watching nf_tables for changes other programs make to our rules"
            );
            Some((stop, thread))
        }
        Err(error) => {
            let lost = kp_core::foreign::ForeignEvent::WatchLost(format!(
                "cannot watch nf_tables: {}",
                error.chain()
            ));
            // The queue is empty before the proxier runs.
            let _ = proxier.foreign_events().try_send(lost);
            None
        }
    }
}

/// `--debug-explain`, the node's addressing and userspace mode's affinity tables.
type ExplainSettings<'a> = (
    bool,
    &'a crate::node_ips::NodeAddressing,
    &'a Option<kp_userspace::AffinityTables>,
);

/// `/debug/explain` for the state `proxier` keeps, with `--debug-explain`.
#[cfg(target_os = "linux")]
fn explainer<B: Backend + 'static>(
    (enabled, node, affinity): ExplainSettings<'_>,
    config: &KubeProxyConfiguration,
    proxier: &Proxier<B>,
) -> Option<Arc<dyn kp_server::Explainer>> {
    enabled.then(|| {
        Arc::new(
            crate::debug_explain::StateExplainer::new(
                config.clone(),
                node.clone(),
                proxier.state(),
            )
            .with_affinity(affinity.clone()),
        ) as Arc<dyn kp_server::Explainer>
    })
}

/// `/debug/explain` explains with the Linux modes' renderers: not on Windows.
#[cfg(not(target_os = "linux"))]
fn explainer<B: Backend + 'static>(
    (enabled, _, _): ExplainSettings<'_>,
    _config: &KubeProxyConfiguration,
    _proxier: &Proxier<B>,
) -> Option<Arc<dyn kp_server::Explainer>> {
    if enabled {
        tracing::warn!("--debug-explain is not available on Windows; /debug/explain is off");
    }
    None
}

/// The relay's settings from the configuration: upstream's `udpIdleTimeout` and `portRange`,
/// and our per-Service caps (validated to be at least 1). Both platforms' userspace modes run
/// the relay with them (winuserspace has no use for the port range: its portals listen on the
/// service ports).
pub fn relay_config(config: &KubeProxyConfiguration) -> kp_userspace::RelayConfig {
    let cap = |n: i32, default: usize| usize::try_from(n).unwrap_or(default);
    kp_userspace::RelayConfig::default()
        .with_udp_idle_timeout(config.udp_idle_timeout)
        .with_port_range(config.proxy_port_range())
        .with_max_connections(cap(
            config.userspace.max_connections_per_service,
            kp_userspace::config::DEFAULT_MAX_CONNECTIONS,
        ))
        .with_max_udp_sessions(cap(
            config.userspace.max_udp_sessions_per_service,
            kp_userspace::config::DEFAULT_MAX_UDP_SESSIONS,
        ))
}

/// Starts the manifests source (with `--manifests`) or the API source.
async fn spawn_source(
    manifests: &Option<PathBuf>,
    master: Option<&str>,
    config: &KubeProxyConfiguration,
    node_name: &str,
    registry: &mut Registry,
) -> anyhow::Result<StartedSource> {
    if let Some(path) = manifests {
        return start_manifests(path, node_name, registry, None);
    }
    let retry = api_retry_from_env()?;
    let (tx, events) = mpsc::channel(EVENT_QUEUE);
    let shutdown = CancellationToken::new();
    let client = api_client(master, config).await?;
    tracing::debug!(retry_max = ?retry.max, "API server retries back off up to this delay");
    let source = kp_sources::api::ApiSource::new(client, node_name.to_string())
        .service_proxy_name(config.service_proxy_name.clone())
        .retry(retry)
        .register_metrics(registry);
    let task = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            if let Err(error) = source.run(tx, shutdown).await {
                tracing::error!(error = %error.chain(), "API source stopped; keeping the last state");
            }
        }
    });
    Ok(StartedSource {
        events,
        task,
        shutdown,
    })
}

/// A client of the API server from `--master` and the configuration's kubeconfig, else the
/// in-cluster service account, as upstream.
pub(crate) async fn api_client(
    master: Option<&str>,
    config: &KubeProxyConfiguration,
) -> anyhow::Result<kube::Client> {
    let kubeconfig = Some(config.client_connection.kubeconfig.trim())
        .filter(|k| !k.is_empty())
        .map(PathBuf::from);
    let options = kp_sources::api::ClientOptions {
        kubeconfig,
        master: master.map(str::to_string),
        ..kp_sources::api::ClientOptions::default()
    };
    kp_sources::api::client(&options)
        .await
        .context("connecting to the API server")
}

/// The node name: `--hostname-override` / `hostnameOverride`, else the host name, lowercased
/// as upstream does.
pub(crate) fn node_name(config: &KubeProxyConfiguration) -> String {
    if let Some(name) = config.hostname_override() {
        return name.to_lowercase();
    }
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    name.trim().to_lowercase()
}

/// Cancels `shutdown` on SIGTERM (what the kubelet sends) or SIGINT.
#[cfg(unix)]
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop the proxy with SIGKILL");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        () = shutdown.cancelled() => {}
    }
    shutdown.cancel();
}

/// Cancels `shutdown` on the console's Ctrl-C or Ctrl-Break, or when the console closes or
/// the system shuts down (what stopping a Windows console program sends).
#[cfg(windows)]
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::windows::{ctrl_break, ctrl_c, ctrl_close, ctrl_shutdown};
    let (Ok(mut c), Ok(mut brk), Ok(mut close), Ok(mut down)) =
        (ctrl_c(), ctrl_break(), ctrl_close(), ctrl_shutdown())
    else {
        tracing::warn!("cannot install console control handlers; end the proxy with taskkill /f");
        return;
    };
    tokio::select! {
        _ = c.recv() => tracing::info!("Ctrl-C received, shutting down"),
        _ = brk.recv() => tracing::info!("Ctrl-Break received, shutting down"),
        _ = close.recv() => tracing::info!("console closing, shutting down"),
        _ = down.recv() => tracing::info!("system shutting down, shutting down"),
        () = shutdown.cancelled() => {}
    }
    shutdown.cancel();
}

/// The admin servers and what they serve.
struct Admin {
    healthz: Option<SocketAddr>,
    metrics: Option<SocketAddr>,
    /// `bindAddressHardFail`: a health or metrics port that cannot be bound stops the process
    /// instead of being retried.
    hard_fail: bool,
    health: Arc<ProxyHealth>,
    health_metrics: HealthMetrics,
    registry: Arc<Registry>,
    info: MetricsInfo,
    service_health: watch::Receiver<ServiceHealthMap>,
    /// `/debug/explain` on the metrics listener (`--debug-explain`).
    explainer: Option<Arc<dyn kp_server::Explainer>>,
    families: Vec<IpFamily>,
    /// Where health-check node ports listen; empty means every address.
    node_port_ips: Vec<std::net::IpAddr>,
}

impl Admin {
    /// Runs every admin server on its own thread and runtime until `shutdown`. The thread
    /// returns why it stopped the process, if it did (`bindAddressHardFail`).
    fn spawn(
        self,
        shutdown: CancellationToken,
    ) -> anyhow::Result<std::thread::JoinHandle<Option<String>>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the admin runtime")?;
        std::thread::Builder::new()
            .name("admin".into())
            .spawn(move || runtime.block_on(self.serve(shutdown)))
            .context("starting the admin thread")
    }

    async fn serve(self, shutdown: CancellationToken) -> Option<String> {
        let mut tasks = tokio::task::JoinSet::new();
        let hard_fail = self.hard_fail;
        if let Some(addr) = self.healthz {
            let (health, metrics, families, stop) = (
                self.health.clone(),
                self.health_metrics,
                self.families,
                shutdown.clone(),
            );
            tasks.spawn(async move {
                if let Some(listener) = bind_with_retry("healthz", addr, &stop, hard_fail).await?
                    && let Err(error) =
                        kp_server::serve_health(listener, health, families, metrics, stop).await
                {
                    tracing::error!(error = %error.chain(), "health server stopped");
                }
                Ok(())
            });
        }
        if let Some(addr) = self.metrics {
            let (registry, info, explainer, stop) =
                (self.registry, self.info, self.explainer, shutdown.clone());
            tasks.spawn(async move {
                if let Some(listener) = bind_with_retry("metrics", addr, &stop, hard_fail).await?
                    && let Err(error) = kp_server::serve_metrics_with_explain(
                        listener, registry, info, explainer, stop,
                    )
                    .await
                {
                    tracing::error!(error = %error.chain(), "metrics server stopped");
                }
                Ok(())
            });
        }
        // Health-check node ports answer on the addresses NodePorts do.
        let servers = ServiceHealthServers::new(self.node_port_ips, self.health);
        let (updates, stop) = (self.service_health, shutdown.clone());
        tasks.spawn(async move {
            servers.run(updates, stop).await;
            Ok(())
        });
        let mut fatal = None;
        while let Some(done) = tasks.join_next().await {
            if let Ok(Err(error)) = done {
                tracing::error!(%error, "stopping: bindAddressHardFail is set");
                shutdown.cancel();
                fatal = Some(error);
            }
        }
        fatal
    }
}

/// Binds `addr`, retrying every [`BIND_RETRY`] as upstream does, until shutdown (`Ok(None)`);
/// with `hard_fail` (`bindAddressHardFail`) the first failure is the error that stops the
/// process, as upstream.
async fn bind_with_retry(
    server: &str,
    addr: SocketAddr,
    shutdown: &CancellationToken,
    hard_fail: bool,
) -> Result<Option<tokio::net::TcpListener>, String> {
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                tracing::info!(server, address = %addr, "Serving");
                return Ok(Some(listener));
            }
            Err(error) if hard_fail => {
                return Err(format!(
                    "cannot bind the {server} server to {addr}: {error}"
                ));
            }
            Err(error) => {
                tracing::error!(server, address = %addr, error = %error.chain(), "cannot bind; retrying")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(BIND_RETRY) => {}
            () = shutdown.cancelled() => return Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::env::VarError;

    #[test]
    fn the_api_retry_cap_is_a_go_duration_above_zero() {
        let cap = |value: &str| api_retry(Ok(value.to_owned())).map(|p| p.max);
        assert_eq!(
            api_retry(Err(VarError::NotPresent)).ok(),
            Some(kp_sources::api::RetryPolicy::default())
        );
        assert_eq!(cap("1m").ok(), Some(Duration::from_secs(60)));
        assert_eq!(cap(" 500ms ").ok(), Some(Duration::from_millis(500)));
        for bad in ["0", "0s", "30", "soon", ""] {
            let error = cap(bad).expect_err(bad);
            assert!(
                format!("{error:#}").starts_with("$KUBE_PROXY_RS_API_RETRY_MAX"),
                "{bad}: {error:#}"
            );
        }
    }
}
