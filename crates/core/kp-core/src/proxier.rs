//! The proxier loop: source events in, backend syncs out.
//!
//! One task owns the change tracker, the sync runner, the proxy state and the backend:
//!
//! 1. Every event is recorded in the [`ChangeTracker`]. Once Services and EndpointSlices have
//!    both reported `Synced`, a change that needs programming marks the proxy health "update
//!    queued", sets the last-queued metric and requests a run; the `Synced` that completes
//!    the pair requests the first run. Where this node's Node is expected
//!    ([`ProxierConfig::with_node_wait`]), the first run also waits for it (bounded), so its
//!    labels decide topology hints from the first sync on. A ServiceCIDR change requests a
//!    run like any other change; backends whose rules depend on the ranges (nftables mode)
//!    rewrite those rules when the state's ranges differ from what they last wrote.
//! 2. When the [`Runner`] says so, the tracker is applied to the state and the backend syncs:
//!    fully at start, after a failure, after this node's labels changed and on the mode's
//!    periodic full syncs ([`PeriodicFullSync`]: iptables and nftables hourly, iptables not
//!    in a large cluster, ipvs every periodic run), otherwise only the changed services. The
//!    proxier alone decides which (`sync_kind`); the sync metrics count the kind
//!    the backend reports it ran (a backend may have to rewrite everything).
//! 3. After a successful sync the per-service health map and the state are published on
//!    `watch` channels.
//!
//! 4. A change another program made to the proxy's rules ([`ForeignEvent`], from a watcher,
//!    or found by the backend's [`Backend::verify`], which runs every canary period (or
//!    after 9 times as long as the last check took, when that is longer) and before every
//!    periodic sync) makes the next sync full, [`SETTLE`] later (respecting
//!    minSyncPeriod), logged and counted once; while another program keeps making such
//!    changes the restores back off ([`Backoff`]). Where a watcher notifies, the canary
//!    checks wait until it reports [`ForeignEvent::WatchLost`]; from then on they run.
//!
//! If the event channel closes, the last state is kept and re-synced periodically: a broken
//! source must never flush working rules.

use crate::report::ErrorChain as _;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backend::{Backend, BackendError, SyncKind, SyncReport, SyncRequest};
use crate::event::{ObjectEvent, SourceEvent};
use crate::foreign::{Activity, Backoff, Check, ForeignChange, ForeignEvent, SETTLE};
use crate::full_sync::PeriodicFullSync;
use crate::health::{ProxyHealth, ServiceHealthMap};
use crate::metrics::{ForeignLabels, KindLabel, Metrics, TrafficPolicyLabel};
use crate::model::ServiceName;
use crate::runner::{REST_PER_RUN, RunReason, Runner};
use crate::tracker::{ChangeTracker, ObjectKind, ProxyState, Recorded};

mod derived;
#[cfg(test)]
mod tests;

/// The message the proxier logs (info) once the rules are first in place. Tests, the demo
/// and the benchmarks wait for it to know the proxy is up, so they match this constant.
pub const FIRST_SYNC_LOG: &str = "first sync of proxy rules complete";

/// The message the proxier logs (debug) after every completed sync, with its kind, the
/// changed service count and the time it took.
pub const SYNCED_LOG: &str = "synced proxy rules";

/// Upstream's default `minSyncPeriod` (iptables and nftables): at most one sync per second
/// keeps bursts of endpoint changes from saturating the node.
pub const DEFAULT_MIN_SYNC_PERIOD: Duration = Duration::from_secs(1);

/// Upstream's default `syncPeriod`: the longest the proxy goes without re-programming the
/// state, which also repairs rules changed behind its back.
pub const DEFAULT_SYNC_PERIOD: Duration = Duration::from_secs(30);

/// At most this many already-queued events are recorded before the runner is looked at
/// again, so an event storm cannot postpone syncs indefinitely.
pub const MAX_EVENTS_PER_BATCH: usize = 1024;

/// How the line the proxier logs (warning) when a watcher is lost starts.
pub const WATCH_LOST_LOG: &str = "the watch for other programs' changes stopped";

/// The message the proxier logs (debug) after each canary check, with the time it took.
pub const VERIFIED_LOG: &str = "checked the rules in the kernel";

/// Foreign-change reports that may queue; a watcher drops more (one pending is enough).
const FOREIGN_QUEUE: usize = 64;

/// A wall clock, for metric timestamps and network-programming latency only (all timing
/// uses `tokio::time`).
pub type WallClock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// How the proxier runs. Built with [`ProxierConfig::new`] and the `with_*` methods.
#[derive(Clone)]
pub struct ProxierConfig {
    node_name: String,
    min_sync_period: Duration,
    sync_period: Duration,
    retry_interval: Option<Duration>,
    canary_period: Option<Duration>,
    canaries_paused: bool,
    node_wait: Option<Duration>,
    external_ips: bool,
    periodic_full: Option<PeriodicFullSync>,
    clock: WallClock,
}

impl fmt::Debug for ProxierConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxierConfig")
            .field("node_name", &self.node_name)
            .field("min_sync_period", &self.min_sync_period)
            .field("sync_period", &self.sync_period)
            .field("retry_interval", &self.retry_interval())
            .finish_non_exhaustive()
    }
}

impl ProxierConfig {
    /// Defaults for the proxy on `node_name`: [`DEFAULT_MIN_SYNC_PERIOD`],
    /// [`DEFAULT_SYNC_PERIOD`], retries after the sync period (upstream's
    /// `RetryAfter(syncPeriod)`), and the system clock.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            min_sync_period: DEFAULT_MIN_SYNC_PERIOD,
            sync_period: DEFAULT_SYNC_PERIOD,
            retry_interval: None,
            canary_period: None,
            canaries_paused: false,
            node_wait: None,
            external_ips: true,
            periodic_full: None,
            clock: Arc::new(SystemTime::now),
        }
    }

    /// Which periodic runs are full syncs (default: upstream's schedule for the backend's
    /// mode, [`PeriodicFullSync::for_mode`]).
    pub fn with_periodic_full_sync(mut self, schedule: PeriodicFullSync) -> Self {
        self.periodic_full = Some(schedule);
        self
    }

    /// Whether Services' `externalIPs` are programmed (upstream's `AllowServiceExternalIPs`
    /// gate, KEP-5707; default true): false programs every Service as if it had none.
    pub fn with_external_ips(mut self, allowed: bool) -> Self {
        self.external_ips = allowed;
        self
    }

    /// Minimum time between the end of one sync and the start of the next.
    pub fn with_min_sync_period(mut self, period: Duration) -> Self {
        self.min_sync_period = period;
        self
    }

    /// Maximum time between syncs (periodic re-sync); also the default retry interval.
    pub fn with_sync_period(mut self, period: Duration) -> Self {
        self.sync_period = period;
        self
    }

    /// Time after a failed sync before it is retried (default: the sync period).
    pub fn with_retry_interval(mut self, interval: Duration) -> Self {
        self.retry_interval = Some(interval);
        self
    }

    /// How often the backend's canaries are checked ([`Backend::verify`]); zero or unset:
    /// only before periodic syncs and when a watcher asks.
    pub fn with_canary_period(mut self, period: Duration) -> Self {
        self.canary_period = (!period.is_zero()).then_some(period);
        self
    }

    /// A watcher notifies of other programs' changes: the canary checks wait until it
    /// reports [`ForeignEvent::WatchLost`], then run every canary period.
    pub fn with_canaries_paused_while_watched(mut self, paused: bool) -> Self {
        self.canaries_paused = paused;
        self
    }

    /// This node's Node exists (it was read at start-up): the first sync waits for its
    /// labels, which decide topology hints, at most `bound` (as upstream reads the Node
    /// before programming). Unset: the first sync runs once Services and EndpointSlices are
    /// synced.
    pub fn with_node_wait(mut self, bound: Duration) -> Self {
        self.node_wait = Some(bound);
        self
    }

    /// The wall clock for metrics (default: [`SystemTime::now`]).
    pub fn with_clock(mut self, clock: WallClock) -> Self {
        self.clock = clock;
        self
    }

    /// The node name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The minimum sync period.
    pub fn min_sync_period(&self) -> Duration {
        self.min_sync_period
    }

    /// The sync period (the health timeout is twice this, as upstream).
    pub fn sync_period(&self) -> Duration {
        self.sync_period
    }

    /// The effective retry interval.
    pub fn retry_interval(&self) -> Duration {
        self.retry_interval.unwrap_or(self.sync_period)
    }

    fn check(&self) -> Result<(), ProxierError> {
        // Zero would make the runner spin.
        if self.sync_period.is_zero() {
            return Err(ProxierError::InvalidConfig {
                field: "syncPeriod",
                reason: "must be greater than zero".into(),
            });
        }
        if self.retry_interval().is_zero() {
            return Err(ProxierError::InvalidConfig {
                field: "retryInterval",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
    }
}

/// Why the proxier cannot start or run.
#[derive(Debug, thiserror::Error)]
pub enum ProxierError {
    /// A [`ProxierConfig`] value is unusable (for example a zero sync period).
    #[error("invalid proxier configuration: {field}: {reason}")]
    InvalidConfig {
        /// The configuration field, as KubeProxyConfiguration names it.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

/// The proxier: owns the tracker, runner, state and backend. See the
/// [module documentation](self).
pub struct Proxier<B: Backend> {
    clock: WallClock,
    backend: B,
    health: Arc<ProxyHealth>,
    metrics: Metrics,
    tracker: ChangeTracker,
    runner: Runner,
    state: Arc<ProxyState>,
    /// Services and EndpointSlices have both synced: changes now request runs.
    initialized: bool,
    /// How long the first sync may wait for this node's Node ([`ProxierConfig::with_node_wait`]);
    /// `None` once it came, or the wait ran out, or none is expected.
    node_wait: Option<Duration>,
    /// The first sync is held back for the Node until then.
    node_deadline: Option<Instant>,
    /// The next sync must be full (start, failure, node label change, foreign change). With
    /// `periodic_full`, the one place that decides (`sync_kind`): backends run what
    /// is asked (or full) and say which ran.
    force_full: bool,
    /// The mode's periodic full syncs.
    periodic_full: PeriodicFullSync,
    /// When the last full sync ended.
    last_full: Option<Instant>,
    /// A sync has succeeded.
    synced_once: bool,
    /// The proxy was reported unhealthy (stale syncs) and no sync has succeeded since.
    stale_reported: bool,
    /// Changes not yet programmed by a successful sync (they survive failed syncs).
    unsynced_changed: BTreeSet<ServiceName>,
    unsynced_conntrack: bool,
    unsynced_trigger_times: Vec<SystemTime>,
    /// The no-local-endpoints gauges and the health map, per service, of `state`.
    derived: derived::Derived,
    /// Trigger times before this are from before the proxy started (upstream ignores them).
    started_wall: SystemTime,
    service_health: watch::Sender<ServiceHealthMap>,
    published_state: watch::Sender<Arc<ProxyState>>,
    foreign: ForeignState,
}

/// The proxier's side of foreign changes: where watchers report, and the restore under way.
struct ForeignState {
    tx: mpsc::Sender<ForeignEvent>,
    rx: mpsc::Receiver<ForeignEvent>,
    activity: Activity,
    backoff: Backoff,
    canary_period: Option<Duration>,
    /// The canaries wait for the watcher to be lost.
    canaries_paused: bool,
    /// A restore is scheduled and has not succeeded yet: further changes join it.
    restore_pending: bool,
}

impl<B: Backend> fmt::Debug for Proxier<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxier")
            .field("mode", &self.backend.mode())
            .field("node", &self.tracker.node_name())
            .field("initialized", &self.initialized)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Proxier<B> {
    /// A proxier programming through `backend`, reporting to `health` and `metrics`.
    pub fn new(
        config: ProxierConfig,
        backend: B,
        health: Arc<ProxyHealth>,
        metrics: Metrics,
    ) -> Result<Self, ProxierError> {
        config.check()?;
        let runner = Runner::new(
            config.min_sync_period,
            config.sync_period,
            config.retry_interval(),
        );
        let started_wall = (config.clock)();
        let periodic_full = config
            .periodic_full
            .unwrap_or_else(|| PeriodicFullSync::for_mode(backend.mode()));
        let (tx, rx) = mpsc::channel(FOREIGN_QUEUE);
        let foreign = ForeignState {
            tx,
            rx,
            activity: Activity::default(),
            backoff: Backoff::default(),
            canary_period: config.canary_period,
            canaries_paused: config.canaries_paused,
            restore_pending: false,
        };
        Ok(Self {
            foreign,
            tracker: ChangeTracker::new(config.node_name).with_external_ips(config.external_ips),
            clock: config.clock,
            backend,
            health,
            metrics,
            runner,
            state: Arc::new(ProxyState::default()),
            initialized: false,
            node_wait: config.node_wait,
            node_deadline: None,
            force_full: true,
            periodic_full,
            last_full: None,
            synced_once: false,
            stale_reported: false,
            unsynced_changed: BTreeSet::new(),
            unsynced_conntrack: false,
            unsynced_trigger_times: Vec::new(),
            derived: derived::Derived::default(),
            started_wall,
            service_health: watch::Sender::new(ServiceHealthMap::new()),
            published_state: watch::Sender::new(Arc::new(ProxyState::default())),
        })
    }

    /// Per-service health (eTP Local health-check node ports), updated after each
    /// successful sync. Empty until the first one.
    pub fn service_health(&self) -> watch::Receiver<ServiceHealthMap> {
        self.service_health.subscribe()
    }

    /// The state as last programmed successfully (empty until the first sync).
    pub fn state(&self) -> watch::Receiver<Arc<ProxyState>> {
        self.published_state.subscribe()
    }

    /// Where watchers report changes other programs made to the rules.
    pub fn foreign_events(&self) -> mpsc::Sender<ForeignEvent> {
        self.foreign.tx.clone()
    }

    /// Whether the proxier is writing to the kernel now, for watchers to tell its own
    /// changes from others'.
    pub fn activity(&self) -> Activity {
        self.foreign.activity.clone()
    }

    /// The backend's mode name, for `/proxyMode`.
    pub fn mode(&self) -> &'static str {
        self.backend.mode()
    }

    /// Run until `shutdown` is cancelled (a sync in progress finishes first). Backend
    /// failures are logged, counted and retried, never fatal; a closed event channel keeps
    /// the last state programmed.
    pub async fn run(
        mut self,
        mut events: mpsc::Receiver<SourceEvent>,
        shutdown: CancellationToken,
    ) -> Result<(), ProxierError> {
        let started = Instant::now();
        let mut events_open = true;
        info!(
            mode = self.backend.mode(),
            node = self.tracker.node_name(),
            "starting proxier"
        );
        let mut canary = if self.foreign.canaries_paused {
            None
        } else {
            self.canary_interval()
        };
        loop {
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                reason = self.runner.wait() => {
                    if reason == RunReason::Periodic && self.synced_once {
                        // The periodic sync checks, rather than assumes, that the kernel
                        // still holds what was written; this very sync restores what is not.
                        self.verify(Check::Thorough).await;
                    }
                    let ok = self.sync(reason, started).await;
                    self.runner.finished(ok);
                    if !ok && self.foreign.restore_pending {
                        // The other program was likely still writing (a reload's next
                        // command deleted a chain the restore had just created): try again
                        // soon, with the back-off, not after the retry interval.
                        self.schedule_restore();
                    }
                }
                Some(event) = self.foreign.rx.recv() => {
                    if let ForeignEvent::WatchLost(reason) = event {
                        if let Some(started) = self.watch_lost(&reason) {
                            canary = Some(started);
                        }
                    } else {
                        self.on_foreign(event).await;
                    }
                }
                () = sleep_until_some(self.health.stale_at()), if !self.stale_reported => {
                    self.report_stale();
                }
                () = sleep_until_some(self.node_deadline) => {
                    warn!(
                        waited = ?self.node_wait,
                        "this node's Node did not come; programming without its labels (topology hints wait for it)"
                    );
                    self.node_wait = None;
                    self.queue_sync();
                }
                _ = tick(&mut canary), if self.synced_once && !self.foreign.restore_pending => {
                    let start = Instant::now();
                    if self.verify(Check::Canary).await {
                        self.schedule_restore();
                    }
                    // A check that takes long (a slow machine, many tool runs) rests 9 times
                    // as long before the next, as the sync runner does: at most a tenth of
                    // the proxier's time goes to canaries.
                    let rest = start.elapsed().saturating_mul(REST_PER_RUN);
                    if let (Some(interval), Some(period)) = (&mut canary, self.foreign.canary_period)
                        && rest > period
                    {
                        interval.reset_after(rest);
                    }
                }
                event = events.recv(), if events_open => match event {
                    Some(event) => {
                        self.handle(event);
                        for _ in 1..MAX_EVENTS_PER_BATCH {
                            match events.try_recv() {
                                Ok(event) => self.handle(event),
                                Err(_) => break,
                            }
                        }
                    }
                    None => {
                        events_open = false;
                        warn!("event sources stopped; keeping the last known state and re-syncing it periodically");
                    }
                },
            }
        }
        info!("proxier stopped");
        Ok(())
    }

    /// The canary checks' timer, without a canary period none.
    fn canary_interval(&self) -> Option<tokio::time::Interval> {
        self.foreign.canary_period.map(|period| {
            let mut interval = tokio::time::interval(period);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        })
    }

    /// The watcher stopped: counted, logged with what checks remain, and the paused canary
    /// checks started (their timer returned).
    fn watch_lost(&mut self, reason: &str) -> Option<tokio::time::Interval> {
        self.metrics.watch_losses.inc();
        let started = std::mem::take(&mut self.foreign.canaries_paused);
        match self.foreign.canary_period {
            Some(period) => warn!(
                reason,
                ?period,
                "{WATCH_LOST_LOG}; the canary checks take over (every canaryPeriod, and all rules before each periodic sync)"
            ),
            None => warn!(
                reason,
                "{WATCH_LOST_LOG}; canaryPeriod is 0, so only the check of all rules before each periodic sync remains"
            ),
        }
        if started {
            self.canary_interval()
        } else {
            None
        }
    }

    /// A watcher's report: a change to restore, or one to check.
    async fn on_foreign(&mut self, event: ForeignEvent) {
        match event {
            ForeignEvent::Changed(change) => {
                if self.record_foreign(change) {
                    self.schedule_restore();
                }
            }
            ForeignEvent::Suspect => {
                if self.verify(Check::Thorough).await {
                    self.schedule_restore();
                }
            }
            // Handled in `run`, which owns the canary timer.
            ForeignEvent::WatchLost(_) => {}
        }
    }

    /// Run the backend's canary check and record what it finds missing; returns whether a
    /// restore is now needed.
    async fn verify(&mut self, check: Check) -> bool {
        if !self.synced_once || self.foreign.restore_pending {
            return false;
        }
        let start = Instant::now();
        match self.backend.verify(check).await {
            Ok(changes) => {
                debug!(?check, took = ?start.elapsed(), found = changes.len(), "{VERIFIED_LOG}");
                // Every finding is looked at (the ones after the first are logged at debug).
                let mut found = false;
                for change in changes {
                    found |= self.record_foreign(change);
                }
                found
            }
            Err(error) => {
                warn!(error = %error.chain(), "cannot check the rules in the kernel");
                false
            }
        }
    }

    /// Log and count a foreign change once and make the next sync full; returns whether
    /// this is a new event (changes found while a restore is pending join it).
    fn record_foreign(&mut self, change: ForeignChange) -> bool {
        if !self.synced_once {
            // The first sync, full, has not happened yet: it writes everything anyway.
            return false;
        }
        if self.foreign.restore_pending {
            debug!(%change, "another foreign change; the pending restore covers it");
            return false;
        }
        let mode = self.backend.mode();
        info!(what = change.what, "{}", change.log_message());
        self.metrics
            .foreign_changes
            .get_or_create(&ForeignLabels {
                mode,
                what: change.what,
            })
            .inc();
        self.foreign.restore_pending = true;
        self.force_full = true;
        // The kernel no longer holds what was programmed: health waits for the restore as
        // for any update, so one the kernel keeps refusing turns the proxy unhealthy.
        self.health.queued_update();
        self.backend.kernel_changed_behind_our_back();
        true
    }

    /// Restore at once (after [`SETTLE`]), or later while another program keeps fighting.
    fn schedule_restore(&mut self) {
        let delay = self.foreign.backoff.next(Instant::now());
        if delay.started_backing_off {
            warn!(
                changes = delay.streak,
                "another program keeps changing the rules of kube-proxy-rs; backing off: restoring after up to {:?} from now on",
                crate::foreign::BACKOFF_MAX
            );
        }
        self.runner.recheck_after(SETTLE + delay.delay);
    }

    /// Record one event and queue a sync if it needs one.
    fn handle(&mut self, event: SourceEvent) {
        // A batch's events are recorded before the loop can look at the runner again.
        let event = match event {
            SourceEvent::Batch(events) => {
                for event in events {
                    self.handle(event);
                }
                return;
            }
            event => event,
        };
        let mut node_event = false;
        match &event {
            SourceEvent::Service(ObjectEvent::Applied(_) | ObjectEvent::Deleted(_)) => {
                self.metrics.service_changes.inc();
            }
            SourceEvent::EndpointSlice(ObjectEvent::Applied(_) | ObjectEvent::Deleted(_)) => {
                self.metrics.endpoint_changes.inc();
            }
            SourceEvent::Node(ObjectEvent::Applied(_) | ObjectEvent::Deleted(_)) => {
                node_event = true;
            }
            _ => {}
        }
        let recorded = self.tracker.record(event);
        // Another node's events leave the tracked node as it was, so this is idempotent.
        if node_event && self.tracker.node().known {
            self.health.set_node_eligible(self.tracker.node().eligible);
        }
        self.set_pending_gauges();
        match recorded {
            Recorded::Synced(kind @ (ObjectKind::Service | ObjectKind::EndpointSlice)) => {
                debug!(kind = kind.as_str(), "source synced");
                if self.tracker.ready() {
                    if !self.initialized {
                        info!("services and endpoint slices synced; programming rules");
                        self.initialized = true;
                    }
                    self.queue_sync();
                }
            }
            Recorded::Synced(ObjectKind::Node) if self.node_deadline.is_some() => {
                // Listed without this node's Node: nothing to wait for.
                self.queue_sync();
            }
            recorded if recorded.needs_sync() && self.initialized => self.queue_sync(),
            _ => {}
        }
    }

    /// The first sync is still to wait for this node's Node: one is expected and neither it
    /// nor the end of the Node list has come.
    fn waiting_for_node(&self) -> bool {
        self.node_wait.is_some()
            && !self.synced_once
            && !self.tracker.node().known
            && !self.tracker.is_synced(ObjectKind::Node)
    }

    /// Upstream's `Sync()`: mark an update queued and poke the runner (unless the first
    /// sync waits for this node's Node: then once it comes, or the wait runs out).
    fn queue_sync(&mut self) {
        self.health.queued_update();
        self.metrics
            .last_queued_timestamp
            .set(unix_seconds((self.clock)()));
        if self.waiting_for_node() {
            if self.node_deadline.is_none() {
                info!(bound = ?self.node_wait, "waiting for this node's Node before the first sync");
                let bound = self.node_wait.unwrap_or_default();
                self.node_deadline = Some(Instant::now() + bound);
            }
            return;
        }
        self.node_deadline = None;
        self.runner.request();
    }

    /// The oldest pending update has waited the health timeout: `/healthz` now answers 503
    /// (the health server reads the same state); say so once, with the reason, until a sync
    /// succeeds.
    fn report_stale(&mut self) {
        let snapshot = self.health.snapshot();
        if snapshot.healthy {
            return;
        }
        self.stale_reported = true;
        self.metrics.sync_stale.set(1);
        let reason = snapshot.reason().unwrap_or_default();
        error!(timeout = ?self.health.timeout(), "proxy unhealthy: {reason}");
    }

    fn set_pending_gauges(&self) {
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.metrics
            .service_changes_pending
            .set(gauge(self.tracker.service_changes_pending()));
        self.metrics
            .endpoint_changes_pending
            .set(gauge(self.tracker.endpoint_changes_pending()));
    }

    /// One run: apply recorded changes, sync the backend, report. Returns whether the sync
    /// succeeded.
    async fn sync(&mut self, reason: RunReason, started: Instant) -> bool {
        let begin = Instant::now();
        if self.tracker.has_pending() {
            self.apply_recorded();
        }
        self.set_pending_gauges();
        self.set_no_local_endpoints();
        let kind = self.sync_kind(reason);
        let applied = Instant::now();
        let result = self.sync_backend(kind).await;
        let times = SyncTimes {
            started,
            begin,
            applied,
            end: Instant::now(),
        };
        match result {
            Ok(report) => {
                if let Some(after) = self.backend.recheck_after() {
                    self.runner.recheck_after(after);
                }
                self.synced(reason, kind, report, &times);
                true
            }
            Err(error) => {
                error!(error = %error.chain(), ?kind, ?reason, "syncing proxy rules failed; the next sync is full");
                self.metrics.sync_failures.inc();
                self.health.sync_failed(&error.chain().to_string());
                self.force_full = true;
                false
            }
        }
    }

    /// Full or partial: the one place that decides. Full when something forced it (see
    /// `force_full`) or the mode's periodic full sync is due.
    fn sync_kind(&self, reason: RunReason) -> SyncKind {
        if self.force_full {
            return SyncKind::Full;
        }
        let due = self
            .periodic_full
            .due(reason, self.last_full, Instant::now(), &self.state);
        match due {
            Some(why) => {
                debug!(why, ?reason, "this sync is full");
                SyncKind::Full
            }
            None => SyncKind::Partial,
        }
    }

    /// Apply the recorded changes to the state, keeping what they ask of the backend until a
    /// sync succeeds (a failed sync must not lose them). Invalid objects are logged, counted
    /// and left out.
    fn apply_recorded(&mut self) {
        let node_before = self.state.node.clone();
        let update = self.tracker.apply(Arc::make_mut(&mut self.state));
        // What a service reports depends on the node (topology, locality) and on that
        // service's objects only.
        if self.state.node == node_before {
            self.derived.update(&self.state, &update.changed);
        } else {
            self.derived.rebuild(&self.state);
        }
        for error in &update.invalid {
            warn!(error = %error.chain(), "skipping invalid object");
            self.metrics
                .invalid_objects
                .get_or_create(&KindLabel { kind: error.kind })
                .inc();
        }
        self.unsynced_changed.extend(update.changed);
        self.unsynced_conntrack |= update.conntrack_cleanup_required;
        self.unsynced_trigger_times.extend(update.trigger_times);
        if update.node_labels_changed {
            info!("node labels changed; next sync is full");
            self.force_full = true;
        }
    }

    /// The backend's sync of `kind`, marked as the proxier's own writing so watchers do not
    /// take it for another program's.
    async fn sync_backend(&mut self, kind: SyncKind) -> Result<SyncReport, BackendError> {
        self.foreign.activity.begin();
        let result = self
            .backend
            .sync(&SyncRequest {
                state: &self.state,
                kind,
                changed: &self.unsynced_changed,
                conntrack_cleanup_required: self.unsynced_conntrack,
            })
            .await;
        self.foreign.activity.end();
        result
    }

    /// After a successful sync of the `asked` kind: health, metrics and logs, then what the
    /// next sync inherits (only the services the backend skipped), then publish.
    fn synced(
        &mut self,
        reason: RunReason,
        asked: SyncKind,
        report: SyncReport,
        times: &SyncTimes,
    ) {
        self.health.updated();
        if self.stale_reported {
            self.stale_reported = false;
            self.metrics.sync_stale.set(0);
            info!("proxy rules synced again; healthy");
        }
        if report.kind != asked {
            debug!(?asked, ran = ?report.kind, "the backend ran the sync as another kind");
        }
        let kind = report.kind;
        if kind == SyncKind::Full {
            self.last_full = Some(times.end);
        }
        self.observe_sync(kind, (times.end - times.begin).as_secs_f64());
        debug!(
            ?reason,
            ?kind,
            changed = self.unsynced_changed.len(),
            conntrack_cleanup = self.unsynced_conntrack,
            apply = ?(times.applied - times.begin),
            backend = ?(times.end - times.applied),
            rules = report.rules_written,
            "{SYNCED_LOG}"
        );
        if !self.synced_once {
            self.synced_once = true;
            self.log_first_sync(times);
        }
        self.force_full = false;
        self.foreign.restore_pending = false;
        self.unsynced_changed.clear();
        self.unsynced_conntrack = false;
        if !report.skipped.is_empty() {
            warn!(skipped = ?report.skipped, "some services could not be programmed; retrying them with the next sync");
            // Hand them to the next sync as changed, so a partial sync tries them again.
            self.unsynced_changed.extend(report.skipped);
        }
        self.publish();
    }

    /// The sync metrics for a successful sync of `kind` that took `elapsed` seconds, and the
    /// network-programming latency of every change it programmed (since the proxy started).
    fn observe_sync(&mut self, kind: SyncKind, elapsed: f64) {
        self.metrics.sync_duration.observe(elapsed);
        match kind {
            SyncKind::Full => self.metrics.sync_full_duration.observe(elapsed),
            SyncKind::Partial => self.metrics.sync_partial_duration.observe(elapsed),
        }
        let now = (self.clock)();
        self.metrics.last_sync_timestamp.set(unix_seconds(now));
        for triggered in self.unsynced_trigger_times.drain(..) {
            if triggered < self.started_wall {
                continue;
            }
            if let Ok(latency) = now.duration_since(triggered) {
                self.metrics
                    .network_programming_duration
                    .observe(latency.as_secs_f64());
            }
        }
    }

    /// The one info line saying the rules are in place ([`FIRST_SYNC_LOG`]).
    fn log_first_sync(&self, times: &SyncTimes) {
        let endpoints: usize = self.state.endpoints.values().map(Vec::len).sum();
        info!(
            services = self.state.service_count(),
            service_ports = self.state.services.len(),
            endpoints,
            took = ?(times.end - times.begin),
            since_start = ?(times.end - times.started),
            "{FIRST_SYNC_LOG}"
        );
    }

    /// Upstream's `kubeproxy_sync_proxy_rules_no_local_endpoints_total`: service ports whose
    /// Local policy leaves them without endpoints although endpoints exist elsewhere.
    fn set_no_local_endpoints(&self) {
        let no_local = self.derived.no_local();
        let (internal, external) = (no_local.internal, no_local.external);
        for (policy, count) in [("internal", internal), ("external", external)] {
            self.metrics
                .no_local_endpoints
                .get_or_create(&TrafficPolicyLabel {
                    traffic_policy: policy,
                })
                .set(count);
        }
    }

    /// Publish the per-service health map and the state (waking readers only on change). The
    /// state is shared, not copied; while a reader may still see it, the next sync copies it
    /// before changing it.
    fn publish(&self) {
        let health = self.derived.health();
        self.service_health.send_if_modified(|current| {
            let modified = current != health;
            if modified {
                current.clone_from(health);
            }
            modified
        });
        if self.published_state.receiver_count() == 0 {
            // Nobody reads the state, and nobody can subscribe any more (`state()` needs the
            // proxier, which `run` owns): do not keep a reference to it, so the next sync's
            // `Arc::make_mut` updates it in place instead of copying all of it.
            self.published_state.send_if_modified(|current| {
                if Arc::ptr_eq(current, &self.state) {
                    *current = Arc::default();
                }
                false
            });
            return;
        }
        let state = Arc::clone(&self.state);
        self.published_state.send_if_modified(|current| {
            let modified = !Arc::ptr_eq(current, &state);
            if modified {
                *current = state;
            }
            modified
        });
    }
}

/// When one sync's phases began and ended, for its metrics and logs.
struct SyncTimes {
    /// When the proxier started running.
    started: Instant,
    /// When this sync began (applying recorded changes).
    begin: Instant,
    /// When the changes were applied and the backend was called.
    applied: Instant,
    /// When the backend returned.
    end: Instant,
}

/// `deadline`, or never without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next canary tick, or never without a canary period.
async fn tick(canary: &mut Option<tokio::time::Interval>) {
    match canary {
        Some(interval) => {
            interval.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Seconds since the Unix epoch (negative before it, should a clock be that wrong).
fn unix_seconds(time: SystemTime) -> f64 {
    match time.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(since) => since.as_secs_f64(),
        Err(before) => -before.duration().as_secs_f64(),
    }
}
