//! The data-path benchmark (`kp-connect`): manifests with one real service among many, and
//! the latency statistics of its probe.
//!
//! The installed services are the [`crate::generate`] shape for `N - 1` services (ClusterIPs
//! from 10.96.0.16, endpoints in 10.128.0.0/9 that exist nowhere) plus one target service,
//! [`TARGET_NAMESPACE`]/[`TARGET_NAME`] at [`TARGET_IP`]:[`TARGET_PORT`], whose only endpoint is
//! the echo server. Its namespace sorts after `bench-*`, so if a mode orders services by name
//! the target comes last.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Duration;

use crate::generate::{self, Manifests, Scale};

/// The target service's ClusterIP (outside the generated range up to ~65k services).
pub const TARGET_IP: Ipv4Addr = Ipv4Addr::new(10, 97, 255, 250);
/// Its port.
pub const TARGET_PORT: u16 = 80;
/// The echo server's port (the target's `targetPort`).
pub const ECHO_PORT: u16 = 8080;
/// Its namespace.
pub const TARGET_NAMESPACE: &str = "zz-kp-connect";
/// Its name.
pub const TARGET_NAME: &str = "target";

/// `services` services in total (the target included) with `endpoints` dummy endpoints each,
/// the target's single endpoint being `server`.
pub fn manifests(services: usize, endpoints: usize, server: Ipv4Addr) -> Manifests {
    let mut manifests = generate::generate(Scale::new(services.saturating_sub(1), endpoints));
    manifests
        .files
        .push(("target.yaml".to_owned(), target_yaml(server)));
    manifests
}

/// The target service and its EndpointSlice.
pub fn target_yaml(server: Ipv4Addr) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {TARGET_NAME}\n  \
         namespace: {TARGET_NAMESPACE}\nspec:\n  clusterIP: {TARGET_IP}\n  selector:\n    \
         app: {TARGET_NAME}\n  ports:\n    - name: echo\n      protocol: TCP\n      \
         port: {TARGET_PORT}\n      targetPort: {ECHO_PORT}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
         name: {TARGET_NAME}-abcde\n  namespace: {TARGET_NAMESPACE}\n  labels:\n    \
         kubernetes.io/service-name: {TARGET_NAME}\n    \
         endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n\
         addressType: IPv4\nports:\n  - name: echo\n    protocol: TCP\n    port: {ECHO_PORT}\n\
         endpoints:\n  - addresses: [{server}]\n    conditions:\n      ready: true\n    \
         nodeName: node-01\n    zone: zone-b\n"
    );
    out
}

/// Summary of a latency sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stats {
    /// Samples.
    pub count: usize,
    /// Median.
    pub p50: Duration,
    /// 99th percentile (nearest rank).
    pub p99: Duration,
    /// Smallest.
    pub min: Duration,
    /// Largest.
    pub max: Duration,
    /// Mean.
    pub mean: Duration,
}

impl Stats {
    /// Nearest-rank percentiles of `samples` (sorted here); `None` if empty.
    pub fn of(samples: &mut [Duration]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let rank = |p: f64| {
            let r = (p / 100.0 * samples.len() as f64).ceil() as usize;
            samples[r.clamp(1, samples.len()) - 1]
        };
        let total: Duration = samples.iter().sum();
        Some(Self {
            count: samples.len(),
            p50: rank(50.0),
            p99: rank(99.0),
            min: samples[0],
            max: samples[samples.len() - 1],
            mean: total / u32::try_from(samples.len()).unwrap_or(u32::MAX),
        })
    }

    /// One line: `count p50 p99 min max mean` in nanoseconds (what the probe prints).
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {} {}",
            self.count,
            self.p50.as_nanos(),
            self.p99.as_nanos(),
            self.min.as_nanos(),
            self.max.as_nanos(),
            self.mean.as_nanos()
        )
    }

    /// Parse [`Stats::to_line`].
    pub fn from_line(line: &str) -> Option<Self> {
        let v: Vec<u64> = line
            .split_whitespace()
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let [count, p50, p99, min, max, mean] = v.as_slice() else {
            return None;
        };
        Some(Self {
            count: usize::try_from(*count).ok()?,
            p50: Duration::from_nanos(*p50),
            p99: Duration::from_nanos(*p99),
            min: Duration::from_nanos(*min),
            max: Duration::from_nanos(*max),
            mean: Duration::from_nanos(*mean),
        })
    }
}
