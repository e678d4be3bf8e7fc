//! How the API source rides out API server outages: the delay before retrying a failed list or
//! watch, and the bookkeeping that logs an outage and its end once each and counts them.
//!
//! The delay follows client-go's reflector (800 ms doubling to a 30 s cap, back to 800 ms once
//! the watcher has gone 2 minutes without a failure), so a cluster's nodes do not hammer an API
//! server that is restarting, with two differences that keep the first retries fast: each
//! delay is drawn from `[d/2, d]` (client-go's from `[d, 2d)`, 30 to 60 s at its cap, with
//! the first retry after at least 800 ms), and a `410 Gone` relists at once. A restarted API
//! server's first answer to an old watch is a `410` (its watch cache starts at the current
//! resourceVersion); client-go and kube-rs' default retry wait out their grown delay before
//! that relist too. The binary reads the cap from `KUBE_PROXY_RS_API_RETRY_MAX`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use kp_core::metrics::KindLabel;
use kube::client::Body;
use kube::runtime::watcher;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;
use tokio::time::Instant;

/// First retry delay after a failed list or watch: client-go's reflector starts there too.
pub const DEFAULT_RETRY_INITIAL: Duration = Duration::from_millis(800);

/// Longest retry delay: client-go's reflector cap. At 1,000 watchers a cap of a few seconds
/// sent a restarting API server hundreds of requests a second (bench/notes/2026-12-02-api-backoff.md).
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);

/// How long a watcher must go without a failure before its delay starts from
/// [`DEFAULT_RETRY_INITIAL`] again: client-go's reflector waits as long. A server that answers
/// a moment between failures (a crash loop) does not reset the curve.
pub const DEFAULT_RETRY_RESET_AFTER: Duration = Duration::from_secs(120);

/// Buckets of the outage- and recovery-duration histograms, in seconds: a blip to ten minutes.
const OUTAGE_BUCKETS: [f64; 10] = [0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];

/// How the watchers retry a failed list or watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The delay after the first failure; it doubles with every further one.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// After this long without a failure the delay starts from `initial` again.
    pub reset_after: Duration,
    /// Whether each delay is drawn from `[d/2, d]` (so many nodes do not retry in step)
    /// instead of being `d` exactly.
    pub jitter: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: DEFAULT_RETRY_INITIAL,
            max: DEFAULT_RETRY_MAX,
            reset_after: DEFAULT_RETRY_RESET_AFTER,
            jitter: true,
        }
    }
}

impl RetryPolicy {
    /// Always `delay`, without jitter (for tests).
    pub fn fixed(delay: Duration) -> Self {
        Self {
            initial: delay,
            max: delay,
            reset_after: DEFAULT_RETRY_RESET_AFTER,
            jitter: false,
        }
    }

    /// The default policy with the longest delay `max` (the first delay is never above it).
    pub fn capped(max: Duration) -> Self {
        Self {
            max,
            ..Self::default()
        }
    }
}

/// What a failed list or watch says about the API server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The resourceVersion is too old (`410 Gone`, reason `Expired`): the server answered and
    /// the watcher already starts over with a list.
    Expired,
    /// No answer: connection refused or reset, timeout, a broken stream.
    Unreachable,
    /// The server answered with an error (5xx, 429, 403, an undecodable body).
    Refused,
}

impl Failure {
    /// Sorts a watcher error.
    pub(crate) fn of(error: &watcher::Error) -> Self {
        match error {
            watcher::Error::WatchError(status) if status.code == 410 => Self::Expired,
            watcher::Error::WatchError(_) | watcher::Error::NoResourceVersion => Self::Refused,
            watcher::Error::InitialListFailed(error)
            | watcher::Error::WatchStartFailed(error)
            | watcher::Error::WatchFailed(error) => match error {
                kube::Error::Api(status) if status.code == 410 => Self::Expired,
                kube::Error::Api(_) | kube::Error::SerdeError(_) => Self::Refused,
                _ => Self::Unreachable,
            },
        }
    }

    /// The metric label.
    fn label(self) -> &'static str {
        match self {
            Self::Expired => "expired",
            Self::Unreachable => "unreachable",
            Self::Refused => "error",
        }
    }
}

/// The retry delay of one watcher: exponential and capped, back to the initial delay once the
/// watcher went [`RetryPolicy::reset_after`] without a failure. The first `410` after anything
/// but another `410` relists without delay (the server answered, and a relist is what it asks
/// for); a second one in a row waits like any failure. Time and randomness come from the
/// caller, so the schedule is a pure function of its inputs (tests, `kp-backoff`).
#[derive(Debug)]
pub struct Backoff {
    policy: RetryPolicy,
    /// The delay the next ordinary failure waits (before jitter).
    next: Duration,
    /// Whether the last failure was a `410` with no success since.
    expired: bool,
    /// When the retry after the last failure was due: the healthy period counts from there.
    retried_at: Option<Instant>,
}

impl Backoff {
    /// A watcher that has not failed yet.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            next: policy.initial.min(policy.max),
            expired: false,
            retried_at: None,
            policy,
        }
    }

    /// The delay before retrying after `failure` at `now`. `unit` in `[0, 1)` picks the
    /// jitter ([`jitter_unit`] in the source).
    pub fn failed(&mut self, failure: Failure, now: Instant, unit: f64) -> Duration {
        let healthy = self
            .retried_at
            .is_some_and(|at| now.saturating_duration_since(at) >= self.policy.reset_after);
        if healthy {
            self.next = self.policy.initial.min(self.policy.max);
        }
        if failure == Failure::Expired && !self.expired {
            self.expired = true;
            self.retried_at = Some(now);
            return Duration::ZERO;
        }
        self.expired = failure == Failure::Expired;
        let base = self.next;
        self.next = base.saturating_mul(2).min(self.policy.max);
        let delay = if self.policy.jitter {
            base.mul_f64(0.5 + 0.5 * unit.clamp(0.0, 1.0))
        } else {
            base
        };
        self.retried_at = Some(now + delay);
        delay
    }

    /// A watch event arrived or a relist finished: a later `410` relists at once again.
    pub fn succeeded(&mut self) {
        self.expired = false;
    }
}

/// A number in `[0, 1)` that differs between processes and calls (jitter needs no more).
pub fn jitter_unit() -> f64 {
    let bits = RandomState::new().hash_one(Instant::now());
    // 53 bits fill an f64's mantissa exactly.
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// The labels of `kube_proxy_rs_watch_failures_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WatchFailureLabels {
    /// `Service`, `EndpointSlice`, `Node` or `ServiceCIDR`.
    pub kind: &'static str,
    /// `unreachable`, `expired` (410: relisted) or `error` (the server answered with one).
    pub reason: &'static str,
}

/// The API source's metrics. Clones share the same series.
#[derive(Clone, Debug)]
pub struct ApiMetrics {
    /// `kube_proxy_rs_watch_failures_total{kind,reason}`: failed lists and watches.
    pub watch_failures: Family<WatchFailureLabels, Counter>,
    /// `kube_proxy_rs_watch_relists_total{kind}`: full relists after the first one.
    pub relists: Family<KindLabel, Counter>,
    /// `kube_proxy_rs_watch_skipped_objects_total{kind}`: object versions skipped because a
    /// field the proxy reads does not decode.
    pub skipped_objects: Family<KindLabel, Counter>,
    /// `kube_proxy_rs_api_server_unreachable`: 1 during an outage.
    pub unreachable: Gauge,
    /// `kube_proxy_rs_api_server_outages_total`: outages that ended.
    pub outages: Counter,
    /// `kube_proxy_rs_api_server_outage_duration_seconds`: from the first failed attempt to
    /// the first answer.
    pub outage_duration: Histogram,
    /// `kube_proxy_rs_api_server_recovery_duration_seconds`: from the first answer after an
    /// outage until every broken watch is back in step (relisted or resumed).
    pub recovery_duration: Histogram,
}

impl Default for ApiMetrics {
    fn default() -> Self {
        Self {
            watch_failures: Family::default(),
            relists: Family::default(),
            skipped_objects: Family::default(),
            unreachable: Gauge::default(),
            outages: Counter::default(),
            outage_duration: Histogram::new(OUTAGE_BUCKETS),
            recovery_duration: Histogram::new(OUTAGE_BUCKETS),
        }
    }
}

impl ApiMetrics {
    /// Registers every series in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        // prometheus-client appends `_total` to counters itself.
        registry.register(
            "kube_proxy_rs_watch_failures",
            "Failed lists and watches of the API server, by kind and reason; each is retried",
            self.watch_failures.clone(),
        );
        registry.register(
            "kube_proxy_rs_watch_relists",
            "Relists after the initial list (410 Gone: the watch's resourceVersion expired)",
            self.relists.clone(),
        );
        registry.register(
            "kube_proxy_rs_watch_skipped_objects",
            "Object versions from the API server skipped because a field the proxy reads does not decode; the last good version stays programmed",
            self.skipped_objects.clone(),
        );
        registry.register(
            "kube_proxy_rs_api_server_unreachable",
            "1 while the API server does not answer (the last state stays programmed)",
            self.unreachable.clone(),
        );
        registry.register(
            "kube_proxy_rs_api_server_outages",
            "Periods without an answer from the API server that ended",
            self.outages.clone(),
        );
        registry.register(
            "kube_proxy_rs_api_server_outage_duration_seconds",
            "Seconds from the first unanswered request of an outage to the API server's next answer",
            self.outage_duration.clone(),
        );
        registry.register(
            "kube_proxy_rs_api_server_recovery_duration_seconds",
            "Seconds from the API server's first answer after an outage until every broken watch is back in step",
            self.recovery_duration.clone(),
        );
    }
}

/// Whether the API server answers: shared by the watchers, so an outage is logged once when
/// the first request goes unanswered, once when the first answer comes back (with the
/// outage's duration), and once when every watch that broke is back in step (with the time
/// that took: relists after `410 Gone` included). The first answer also wakes the watchers
/// waiting to retry, so one watcher's luck ends the others' grown delays.
#[derive(Clone, Debug, Default)]
pub(crate) struct Contact {
    state: Arc<Mutex<ContactState>>,
    metrics: ApiMetrics,
    back: Arc<Notify>,
}

#[derive(Debug, Default)]
struct ContactState {
    /// When the outage going on started.
    down_since: Option<Instant>,
    /// The watchers whose requests failed during it.
    affected: BTreeSet<&'static str>,
    /// After the outage's end: the watchers not back in step yet.
    recovering: Option<Recovering>,
    /// Per watcher: when its current watch was answered (a resumed watch delivers no event,
    /// so it counts as back in step once it stayed open for [`RESUME_SETTLE`]).
    watch_open_since: BTreeMap<&'static str, Instant>,
}

#[derive(Debug)]
struct Recovering {
    answered: Instant,
    outage: Duration,
    pending: BTreeSet<&'static str>,
}

/// How long a watch answered after an outage must stay open without an error (such as the
/// `410 Gone` a restarted server streams right after answering) to count as resumed.
pub(crate) const RESUME_SETTLE: Duration = Duration::from_millis(500);

impl Contact {
    pub(crate) fn new(metrics: ApiMetrics) -> Self {
        Self {
            state: Arc::default(),
            metrics,
            back: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ContactState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn metrics(&self) -> &ApiMetrics {
        &self.metrics
    }

    /// A request of `kind`'s watcher got no answer; starts an outage unless one is going on.
    pub(crate) fn unreachable(&self, kind: &'static str, error: &dyn Display, retry: Duration) {
        let mut state = self.lock();
        state.watch_open_since.remove(kind);
        if state.down_since.is_none() {
            state.down_since = Some(Instant::now());
            // Watchers still resuming from the last outage are part of this one.
            if let Some(recovering) = state.recovering.take() {
                state.affected.extend(recovering.pending);
            }
            self.metrics.unreachable.set(1);
            tracing::warn!(
                kind,
                %error,
                ?retry,
                "API server unreachable; keeping the last state programmed and retrying with back-off"
            );
        } else {
            tracing::debug!(kind, %error, ?retry, "API server still unreachable");
        }
        state.affected.insert(kind);
    }

    /// `kind`'s list or watch failed some other way: its watch is not open.
    pub(crate) fn failed(&self, kind: &'static str) {
        self.lock().watch_open_since.remove(kind);
    }

    /// The API server answered a request of `kind`'s watcher (whatever the status; `watch`
    /// when it opened a watch): ends an outage.
    pub(crate) fn answered(&self, kind: &'static str, watch: bool) {
        let mut state = self.lock();
        if watch {
            state.watch_open_since.insert(kind, Instant::now());
        }
        if let Some(since) = state.down_since.take() {
            self.back.notify_waiters();
            let outage = since.elapsed();
            self.metrics.unreachable.set(0);
            self.metrics.outages.inc();
            self.metrics.outage_duration.observe(outage.as_secs_f64());
            tracing::info!(
                outage = ?outage,
                "API server answers again; watches resume (relisting where its history expired)"
            );
            state.recovering = Some(Recovering {
                answered: Instant::now(),
                outage,
                pending: std::mem::take(&mut state.affected),
            });
        }
    }

    /// Whether `kind`'s watcher is still to resume after an outage.
    pub(crate) fn resuming(&self, kind: &'static str) -> bool {
        self.lock()
            .recovering
            .as_ref()
            .is_some_and(|r| r.pending.contains(kind))
    }

    /// `kind`'s watch is open again if it has been for [`RESUME_SETTLE`] without an error.
    pub(crate) fn check_settled(&self, kind: &'static str) {
        let open = self.lock().watch_open_since.get(kind).copied();
        if open.is_some_and(|since| since.elapsed() >= RESUME_SETTLE) {
            self.resumed(kind);
        }
    }

    /// `kind`'s watcher is back in step (a relist finished, an event arrived, its watch
    /// stays open, or it stopped watching); the last one logs the recovery.
    pub(crate) fn resumed(&self, kind: &'static str) {
        let mut state = self.lock();
        let Some(recovering) = state.recovering.as_mut() else {
            return;
        };
        recovering.pending.remove(kind);
        if recovering.pending.is_empty() {
            let took = recovering.answered.elapsed();
            let outage = recovering.outage;
            state.recovering = None;
            self.metrics.recovery_duration.observe(took.as_secs_f64());
            tracing::info!(
                took = ?took,
                outage = ?outage,
                "watches recovered from the API server outage"
            );
        }
    }

    /// Completes when the API server answers again; wakes only futures made before that
    /// (check [`Contact::is_down`] after making one).
    pub(crate) fn answers_again(&self) -> Notified<'_> {
        self.back.notified()
    }

    /// Whether an outage is going on.
    pub(crate) fn is_down(&self) -> bool {
        self.lock().down_since.is_some()
    }

    /// Counts a failed list or watch of `kind`.
    pub(crate) fn count_failure(&self, kind: &'static str, failure: Failure) {
        self.metrics
            .watch_failures
            .get_or_create(&WatchFailureLabels {
                kind,
                reason: failure.label(),
            })
            .inc();
    }
}

/// A `kube::Client` that tells [`Contact`] about every answer to one watcher's requests:
/// the watcher itself reports a watch resumed without events to nobody, so only the
/// transport sees the end of an outage.
#[derive(Clone)]
pub(crate) struct Observed {
    inner: kube::Client,
    contact: Contact,
    kind: &'static str,
}

impl Observed {
    /// A client sending through `inner` (its authentication and TLS included).
    pub(crate) fn client(
        inner: &kube::Client,
        contact: &Contact,
        kind: &'static str,
    ) -> kube::Client {
        let namespace = inner.default_namespace().to_owned();
        let service = Self {
            inner: inner.clone(),
            contact: contact.clone(),
            kind,
        };
        kube::Client::new(service, namespace)
    }
}

impl tower_service::Service<http::Request<Body>> for Observed {
    type Response = http::Response<Body>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // `kube::Client::send` waits for readiness itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        let watch = request
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
        Box::pin(async move {
            let result = this.inner.send(request).await;
            if let Ok(response) = &result {
                let opened = watch && response.status().is_success();
                this.contact.answered(this.kind, opened);
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            initial: S(1),
            max: S(8),
            reset_after: S(60),
            jitter: false,
        }
    }

    /// The delays of `failures`, each failure coming the moment the retry before it is made.
    fn delays(backoff: &mut Backoff, clock: &mut Instant, failures: &[Failure]) -> Vec<Duration> {
        failures
            .iter()
            .map(|f| {
                let delay = backoff.failed(*f, *clock, 0.0);
                *clock += delay;
                delay
            })
            .collect()
    }

    #[test]
    fn doubles_up_to_the_cap_and_resets_only_after_a_healthy_period() {
        let mut b = Backoff::new(policy());
        let mut now = Instant::now();
        let u = Failure::Unreachable;
        assert_eq!(
            delays(&mut b, &mut now, &[u, u, u, u, u, u]),
            [S(1), S(2), S(4), S(8), S(8), S(8)]
        );
        // Answered, then failing again within the healthy period: the curve goes on.
        b.succeeded();
        now += S(59);
        assert_eq!(
            delays(&mut b, &mut now, &[u, Failure::Refused]),
            [S(8), S(8)]
        );
        // A whole healthy period after the last retry: from the start again.
        b.succeeded();
        now += S(60);
        assert_eq!(delays(&mut b, &mut now, &[u, u, u]), [S(1), S(2), S(4)]);
    }

    #[test]
    fn expired_after_an_outage_relists_at_once_and_keeps_the_curve() {
        let mut b = Backoff::new(policy());
        let mut now = Instant::now();
        let u = Failure::Unreachable;
        delays(&mut b, &mut now, &[u, u, u, u, u]);
        // The restarted server answers `410`: relist now, not after the grown 8 s.
        assert_eq!(b.failed(Failure::Expired, now, 0.9), Duration::ZERO);
        // The relist itself fails: a server that answers between failures is not healthy yet.
        assert_eq!(delays(&mut b, &mut now, &[u, u]), [S(8), S(8)]);
    }

    #[test]
    fn expired_twice_in_a_row_waits() {
        let mut b = Backoff::new(policy());
        let mut now = Instant::now();
        let e = Failure::Expired;
        assert_eq!(delays(&mut b, &mut now, &[e, e, e]), [S(0), S(1), S(2)]);
        b.succeeded();
        assert_eq!(b.failed(e, now, 0.0), S(0));
    }

    #[test]
    fn jitter_stays_within_half_and_the_whole_delay() {
        let jittered = RetryPolicy {
            jitter: true,
            ..policy()
        };
        let now = Instant::now();
        let mut low = Backoff::new(jittered);
        let mut high = Backoff::new(jittered);
        for step in [1, 2, 4, 8, 8] {
            assert_eq!(low.failed(Failure::Unreachable, now, 0.0), S(step) / 2);
            let d = high.failed(Failure::Unreachable, now, 0.999_999);
            assert!(d <= S(step) && d > S(step) * 99 / 100, "{d:?}");
        }
        for _ in 0..100 {
            let unit = jitter_unit();
            assert!((0.0..1.0).contains(&unit), "{unit}");
        }
    }

    /// client-go's reflector curve (800 ms doubling to 30 s), with our `[d/2, d]` jitter.
    #[test]
    fn the_default_policy_is_client_gos_curve() {
        let curve = |unit: f64| {
            let mut b = Backoff::new(RetryPolicy::default());
            let mut now = Instant::now();
            (0..9)
                .map(|_| {
                    let d = b.failed(Failure::Unreachable, now, unit);
                    now += d;
                    d.as_millis()
                })
                .collect::<Vec<_>>()
        };
        // The longest delays (a unit of 1 is clamped to the whole delay) and the shortest.
        assert_eq!(
            curve(1.0),
            [800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000]
        );
        assert_eq!(
            curve(0.0),
            [400, 800, 1600, 3200, 6400, 12800, 15000, 15000, 15000]
        );
        assert_eq!(RetryPolicy::default().reset_after, S(120));
    }

    #[test]
    fn a_cap_below_the_initial_delay_bounds_every_delay() {
        let mut b = Backoff::new(RetryPolicy::capped(Duration::from_millis(300)));
        let now = Instant::now();
        for _ in 0..4 {
            assert!(b.failed(Failure::Unreachable, now, 0.999_999) <= Duration::from_millis(300));
        }
    }

    #[test]
    fn failures_are_sorted_by_what_the_server_said() {
        let gone = || Status::failure("too old resource version: 5 (90)", "Expired").with_code(410);
        let refused = || {
            kube::Error::Service(Box::new(std::io::Error::from(
                std::io::ErrorKind::ConnectionRefused,
            )))
        };
        let cases = [
            (watcher::Error::WatchError(gone().boxed()), Failure::Expired),
            (
                watcher::Error::WatchStartFailed(kube::Error::Api(gone().boxed())),
                Failure::Expired,
            ),
            (
                watcher::Error::InitialListFailed(kube::Error::Api(
                    Status::failure("etcd", "InternalError")
                        .with_code(500)
                        .boxed(),
                )),
                Failure::Refused,
            ),
            (
                watcher::Error::WatchStartFailed(refused()),
                Failure::Unreachable,
            ),
            (
                watcher::Error::InitialListFailed(refused()),
                Failure::Unreachable,
            ),
            (
                watcher::Error::WatchFailed(kube::Error::ReadEvents(std::io::Error::from(
                    std::io::ErrorKind::ConnectionReset,
                ))),
                Failure::Unreachable,
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(Failure::of(&error), expected, "{error}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_counted_once_with_its_duration() {
        let metrics = ApiMetrics::default();
        let contact = Contact::new(metrics.clone());
        contact.answered("Service", true);
        assert_eq!(metrics.outages.get(), 0);
        contact.unreachable("Service", &"connection refused", S(1));
        tokio::time::advance(S(30)).await;
        contact.unreachable("Node", &"connection refused", S(1));
        assert!(contact.is_down());
        assert_eq!(metrics.unreachable.get(), 1);
        tokio::time::advance(S(2)).await;
        // The restarted server answers the Service watch, then streams `410 Gone`.
        contact.answered("Service", true);
        contact.failed("Service");
        contact.answered("Node", true);
        assert!(!contact.is_down());
        assert_eq!(metrics.unreachable.get(), 0);
        assert_eq!(metrics.outages.get(), 1);
        assert!(contact.resuming("Service") && contact.resuming("Node"));
        tokio::time::advance(RESUME_SETTLE).await;
        // The Node watch stayed open: resumed. The Service watch failed: not until its
        // relist ends, 3 s later.
        contact.check_settled("Node");
        contact.check_settled("Service");
        assert!(!contact.resuming("Node"));
        assert!(contact.resuming("Service"));
        tokio::time::advance(S(3) - RESUME_SETTLE).await;
        contact.resumed("Service");
        contact.resumed("Service");
        assert!(!contact.resuming("Service"));
        let mut text = String::new();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        assert!(
            text.contains("kube_proxy_rs_api_server_outage_duration_seconds_sum 32.0\n"),
            "{text}"
        );
        assert!(
            text.contains("kube_proxy_rs_api_server_recovery_duration_seconds_sum 3.0\n"),
            "{text}"
        );
        assert!(
            text.contains("kube_proxy_rs_api_server_recovery_duration_seconds_count 1\n"),
            "{text}"
        );
        assert!(
            text.contains("kube_proxy_rs_api_server_outages_total 1\n"),
            "{text}"
        );
    }
}
