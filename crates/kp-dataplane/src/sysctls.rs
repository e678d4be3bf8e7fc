//! Kernel settings kube-proxy owns: the conntrack table size and timeouts (all modes, at
//! start-up) and `route_localnet` (iptables mode with localhost NodePorts).
//!
//! The decisions are pure ([`conntrack_max`], [`conntrack_plan`], [`route_localnet_plan`]);
//! [`apply`] carries them out through a [`Sysctl`], which is either the real filesystem
//! ([`FsSysctl`], rooted at `/` or at a test directory) or [`FakeSysctl`].
//!
//! Only `nf_conntrack_max` and the hash size are global; the timeouts and `route_localnet`
//! are per network namespace. Writing `nf_conntrack_max` from a non-initial namespace fails
//! on current kernels, so tests never do it.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use kp_core::model::IpFamily;
use kp_rules::iptables::{NodePortAddresses, RenderConfig};
use tracing::{info, warn};

/// `nf_conntrack_max`, relative to the filesystem root.
pub const CONNTRACK_MAX: &str = "proc/sys/net/netfilter/nf_conntrack_max";
/// The conntrack hash table size (a module parameter, not a sysctl).
pub const CONNTRACK_HASHSIZE: &str = "sys/module/nf_conntrack/parameters/hashsize";
/// Idle timeout of established TCP entries, in seconds.
pub const TCP_TIMEOUT_ESTABLISHED: &str =
    "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established";
/// Timeout of TCP entries in CLOSE_WAIT, in seconds.
pub const TCP_TIMEOUT_CLOSE_WAIT: &str =
    "proc/sys/net/netfilter/nf_conntrack_tcp_timeout_close_wait";
/// Accept out-of-window TCP packets instead of marking them INVALID.
pub const TCP_BE_LIBERAL: &str = "proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal";
/// Timeout of one-way UDP entries, in seconds.
pub const UDP_TIMEOUT: &str = "proc/sys/net/netfilter/nf_conntrack_udp_timeout";
/// Timeout of UDP entries that saw traffic both ways, in seconds.
pub const UDP_TIMEOUT_STREAM: &str = "proc/sys/net/netfilter/nf_conntrack_udp_timeout_stream";
/// Let 127.0.0.0/8 be routed, so localhost NodePorts can be DNATed to pods.
pub const ROUTE_LOCALNET: &str = "proc/sys/net/ipv4/conf/all/route_localnet";
/// The online CPUs, as a list of ranges (`0-3,8`).
pub const ONLINE_CPUS: &str = "sys/devices/system/cpu/online";

/// Upstream's `conntrack.maxPerCore`: 32768 entries per CPU.
pub const DEFAULT_MAX_PER_CORE: u32 = 32_768;
/// Upstream's `conntrack.min`: small nodes still get 131072 entries.
pub const DEFAULT_MIN: u32 = 131_072;
/// Upstream's newest code caps the computed maximum at 2^20 entries: beyond that the table
/// costs more memory than a busy node's flows need.
pub const MAX_CONNTRACK_MAX: u64 = 1_048_576;
/// The kernel's default bucket ratio: one hash bucket per four entries.
pub const ENTRIES_PER_BUCKET: u64 = 4;
/// Upstream's `conntrack.tcpEstablishedTimeout`: 24 h (the kernel's default is 5 days).
pub const DEFAULT_TCP_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// Upstream's `conntrack.tcpCloseWaitTimeout`: 1 h.
pub const DEFAULT_TCP_CLOSE_WAIT_TIMEOUT: Duration = Duration::from_secs(3600);

/// Why reading or writing a kernel setting failed.
#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    /// The file could not be read.
    #[error("reading {key}: {source}")]
    Read {
        /// The setting, relative to the root.
        key: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The file could not be written.
    #[error("writing {key}: {source}")]
    Write {
        /// The setting, relative to the root.
        key: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The setting lives on a read-only filesystem (container runtimes often mount `/sys`
    /// read-only).
    #[error("{key} is on a read-only filesystem")]
    ReadOnly {
        /// The setting, relative to the root.
        key: String,
    },
    /// The current value is not a number.
    #[error("{key} holds {value:?}, not a number")]
    Parse {
        /// The setting, relative to the root.
        key: String,
        /// What it holds.
        value: String,
    },
}

/// Reads and writes kernel settings by path relative to the filesystem root.
pub trait Sysctl {
    /// The setting's current value, trimmed.
    fn read(&self, key: &str) -> Result<String, SysctlError>;
    /// Set the setting.
    fn write(&self, key: &str, value: &str) -> Result<(), SysctlError>;
}

/// Plain file reads and writes under a root directory: `/` on a node, a temporary directory
/// in tests.
#[derive(Clone, Debug)]
pub struct FsSysctl {
    root: PathBuf,
}

impl FsSysctl {
    /// Settings under `root` (which stands in for `/`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The node's own `/proc` and `/sys`.
    pub fn host() -> Self {
        Self::new("/")
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Sysctl for FsSysctl {
    fn read(&self, key: &str) -> Result<String, SysctlError> {
        std::fs::read_to_string(self.root.join(key))
            .map(|text| text.trim().to_owned())
            .map_err(|source| SysctlError::Read {
                key: key.to_owned(),
                source,
            })
    }

    fn write(&self, key: &str, value: &str) -> Result<(), SysctlError> {
        // /proc/sys files take the value in one write; no create, no truncate semantics needed.
        std::fs::write(self.root.join(key), format!("{value}\n")).map_err(|source| {
            if source.kind() == io::ErrorKind::ReadOnlyFilesystem {
                SysctlError::ReadOnly {
                    key: key.to_owned(),
                }
            } else {
                SysctlError::Write {
                    key: key.to_owned(),
                    source,
                }
            }
        })
    }
}

/// In-memory settings that record writes. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct FakeSysctl {
    state: Arc<Mutex<FakeState>>,
}

#[derive(Debug, Default)]
struct FakeState {
    values: BTreeMap<String, String>,
    read_only: Vec<String>,
    writes: Vec<(String, String)>,
}

impl FakeSysctl {
    /// No settings (reads fail as for a missing file).
    pub fn new() -> Self {
        Self::default()
    }

    /// Set a value without recording a write.
    pub fn set(&self, key: &str, value: &str) {
        self.lock().values.insert(key.to_owned(), value.to_owned());
    }

    /// Make writes of `key` fail with [`SysctlError::ReadOnly`].
    pub fn make_read_only(&self, key: &str) {
        self.lock().read_only.push(key.to_owned());
    }

    /// Every write so far, in order.
    pub fn writes(&self) -> Vec<(String, String)> {
        self.lock().writes.clone()
    }

    fn lock(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Sysctl for FakeSysctl {
    fn read(&self, key: &str) -> Result<String, SysctlError> {
        self.lock()
            .values
            .get(key)
            .cloned()
            .ok_or_else(|| SysctlError::Read {
                key: key.to_owned(),
                source: io::Error::from(io::ErrorKind::NotFound),
            })
    }

    fn write(&self, key: &str, value: &str) -> Result<(), SysctlError> {
        let mut state = self.lock();
        if state.read_only.iter().any(|k| k == key) {
            return Err(SysctlError::ReadOnly {
                key: key.to_owned(),
            });
        }
        state.values.insert(key.to_owned(), value.to_owned());
        state.writes.push((key.to_owned(), value.to_owned()));
        Ok(())
    }
}

/// The conntrack part of the proxy configuration (`conntrack.*`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConntrackSettings {
    /// Entries per CPU; 0 leaves `nf_conntrack_max` (and the hash size) alone.
    pub max_per_core: u32,
    /// Lower bound of the computed maximum.
    pub min: u32,
    /// Established-TCP timeout; zero leaves it alone.
    pub tcp_established_timeout: Duration,
    /// CLOSE_WAIT timeout; zero leaves it alone.
    pub tcp_close_wait_timeout: Duration,
    /// Set `nf_conntrack_tcp_be_liberal` to 1 (never reset to 0).
    pub tcp_be_liberal: bool,
    /// UDP timeout; zero leaves it alone.
    pub udp_timeout: Duration,
    /// UDP stream timeout; zero leaves it alone.
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackSettings {
    /// Upstream's defaults.
    fn default() -> Self {
        Self {
            max_per_core: DEFAULT_MAX_PER_CORE,
            min: DEFAULT_MIN,
            tcp_established_timeout: DEFAULT_TCP_ESTABLISHED_TIMEOUT,
            tcp_close_wait_timeout: DEFAULT_TCP_CLOSE_WAIT_TIMEOUT,
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// When a planned value is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteWhen {
    /// Only when the current value is lower (never shrink what an admin raised).
    Lower,
    /// Whenever the current value differs.
    Different,
}

/// One planned write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The file, relative to the root.
    pub key: &'static str,
    /// The desired value.
    pub value: u64,
    /// When to write it.
    pub when: WriteWhen,
    /// A read-only filesystem is reported as a warning instead of failing the start-up
    /// (upstream does this for the hash size under a read-only `/sys`).
    pub read_only_ok: bool,
}

/// The `nf_conntrack_max` to ensure: `max(max_per_core x cpus, min)`, capped at
/// [`MAX_CONNTRACK_MAX`]; `None` when `max_per_core` is 0.
pub fn conntrack_max(settings: &ConntrackSettings, cpus: usize) -> Option<u64> {
    if settings.max_per_core == 0 {
        return None;
    }
    let cpus = u64::try_from(cpus).unwrap_or(u64::MAX);
    let scaled = u64::from(settings.max_per_core).saturating_mul(cpus);
    Some(scaled.max(u64::from(settings.min)).min(MAX_CONNTRACK_MAX))
}

/// Every conntrack write upstream makes at start-up, in order.
pub fn conntrack_plan(settings: &ConntrackSettings, cpus: usize) -> Vec<Setting> {
    let mut plan = Vec::new();
    let setting = |key, value, when| Setting {
        key,
        value,
        when,
        read_only_ok: false,
    };
    if let Some(max) = conntrack_max(settings, cpus) {
        plan.push(setting(CONNTRACK_MAX, max, WriteWhen::Lower));
        plan.push(Setting {
            read_only_ok: true,
            ..setting(
                CONNTRACK_HASHSIZE,
                max / ENTRIES_PER_BUCKET,
                WriteWhen::Lower,
            )
        });
    }
    for (key, timeout) in [
        (TCP_TIMEOUT_ESTABLISHED, settings.tcp_established_timeout),
        (TCP_TIMEOUT_CLOSE_WAIT, settings.tcp_close_wait_timeout),
    ] {
        if !timeout.is_zero() {
            plan.push(setting(key, timeout.as_secs(), WriteWhen::Different));
        }
    }
    if settings.tcp_be_liberal {
        plan.push(setting(TCP_BE_LIBERAL, 1, WriteWhen::Different));
    }
    for (key, timeout) in [
        (UDP_TIMEOUT, settings.udp_timeout),
        (UDP_TIMEOUT_STREAM, settings.udp_stream_timeout),
    ] {
        if !timeout.is_zero() {
            plan.push(setting(key, timeout.as_secs(), WriteWhen::Different));
        }
    }
    plan
}

/// `route_localnet=1` when iptables mode accepts NodePorts on 127.0.0.0/8: localhost
/// NodePorts are on, IPv4 is programmed and nodePortAddresses includes IPv4 loopback (the
/// default, all addresses, does).
pub fn route_localnet_plan(config: &RenderConfig, families: &[IpFamily]) -> Vec<Setting> {
    let loopback = match &config.node_port_addresses {
        NodePortAddresses::All => true,
        NodePortAddresses::Ips(ips) => ips.iter().any(|ip| ip.is_ipv4() && ip.is_loopback()),
    };
    if config.localhost_node_ports && loopback && families.contains(&IpFamily::V4) {
        vec![Setting {
            key: ROUTE_LOCALNET,
            value: 1,
            when: WriteWhen::Different,
            read_only_ok: false,
        }]
    } else {
        Vec::new()
    }
}

/// Whether `nf_conntrack_tcp_be_liberal` is set; iptables mode then omits its INVALID-drop
/// rule ([`RenderConfig::drop_invalid`]), as upstream. Unreadable counts as unset.
pub fn tcp_be_liberal(sysctl: &impl Sysctl) -> bool {
    sysctl
        .read(TCP_BE_LIBERAL)
        .is_ok_and(|value| value.parse::<u64>().is_ok_and(|v| v != 0))
}

/// One write [`apply`] made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The file, relative to the root.
    pub key: &'static str,
    /// The value before.
    pub from: u64,
    /// The value written.
    pub to: u64,
}

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct ApplyReport {
    /// Values written.
    pub applied: Vec<Applied>,
    /// Writes skipped because their filesystem is read-only (only for
    /// [`Setting::read_only_ok`]).
    pub warnings: Vec<SysctlError>,
}

/// Carry out `plan`: read each value and write it when its [`WriteWhen`] says so. Stops at
/// the first error, except read-only filesystems where allowed.
pub fn apply(sysctl: &impl Sysctl, plan: &[Setting]) -> Result<ApplyReport, SysctlError> {
    let mut report = ApplyReport::default();
    for setting in plan {
        let text = sysctl.read(setting.key)?;
        let current: u64 = text.parse().map_err(|_| SysctlError::Parse {
            key: setting.key.to_owned(),
            value: text.clone(),
        })?;
        let write = match setting.when {
            WriteWhen::Lower => current < setting.value,
            WriteWhen::Different => current != setting.value,
        };
        if !write {
            continue;
        }
        match sysctl.write(setting.key, &setting.value.to_string()) {
            Ok(()) => {
                info!(
                    key = setting.key,
                    from = current,
                    to = setting.value,
                    "set kernel setting"
                );
                report.applied.push(Applied {
                    key: setting.key,
                    from: current,
                    to: setting.value,
                });
            }
            Err(err @ SysctlError::ReadOnly { .. }) if setting.read_only_ok => {
                warn!(error = %err, "cannot raise kernel setting");
                report.warnings.push(err);
            }
            Err(err) => return Err(err),
        }
    }
    Ok(report)
}

/// The number of online CPUs from `sys/devices/system/cpu/online` (ranges such as `0-3,8`):
/// the node's CPUs, not the container's CPU quota, as upstream counts them.
pub fn parse_cpu_list(text: &str) -> Option<usize> {
    let mut count = 0usize;
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
            None => {
                let n = part.parse::<usize>().ok()?;
                (n, n)
            }
        };
        count = count.checked_add(last.checked_sub(first)? + 1)?;
    }
    (count > 0).then_some(count)
}

/// The node's online CPUs, falling back to the threads this process may use.
pub fn online_cpus(sysctl: &impl Sysctl) -> usize {
    sysctl
        .read(ONLINE_CPUS)
        .ok()
        .and_then(|text| parse_cpu_list(&text))
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
}

/// Start-up conntrack settings: [`conntrack_plan`] for the node's online CPUs, applied.
pub fn apply_conntrack_sysctls(
    sysctl: &impl Sysctl,
    settings: &ConntrackSettings,
) -> Result<ApplyReport, SysctlError> {
    let cpus = online_cpus(sysctl);
    apply(sysctl, &conntrack_plan(settings, cpus))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(max_per_core: u32, min: u32) -> ConntrackSettings {
        ConntrackSettings {
            max_per_core,
            min,
            ..ConntrackSettings::default()
        }
    }

    #[test]
    fn conntrack_max_table() {
        // (max_per_core, min, cpus) -> expected
        let cases: [(u32, u32, usize, Option<u64>); 8] = [
            (32_768, 131_072, 2, Some(131_072)),    // min wins on small nodes
            (32_768, 131_072, 4, Some(131_072)),    // exactly min
            (32_768, 131_072, 8, Some(262_144)),    // scaled wins
            (32_768, 131_072, 64, Some(1_048_576)), // 2 Mi capped
            (32_768, 0, 1, Some(32_768)),           // no floor
            (0, 131_072, 8, None),                  // 0 leaves it alone
            (u32::MAX, 0, usize::MAX, Some(MAX_CONNTRACK_MAX)), // no overflow
            (1, 2_000_000, 1, Some(MAX_CONNTRACK_MAX)), // the cap applies to the floor too
        ];
        for (per_core, min, cpus, want) in cases {
            assert_eq!(
                conntrack_max(&settings(per_core, min), cpus),
                want,
                "per_core={per_core} min={min} cpus={cpus}"
            );
        }
    }

    #[test]
    fn default_plan_matches_upstream() {
        let plan = conntrack_plan(&ConntrackSettings::default(), 8);
        let summary: Vec<(&str, u64, WriteWhen)> =
            plan.iter().map(|s| (s.key, s.value, s.when)).collect();
        assert_eq!(
            summary,
            [
                (CONNTRACK_MAX, 262_144, WriteWhen::Lower),
                (CONNTRACK_HASHSIZE, 65_536, WriteWhen::Lower),
                (TCP_TIMEOUT_ESTABLISHED, 86_400, WriteWhen::Different),
                (TCP_TIMEOUT_CLOSE_WAIT, 3_600, WriteWhen::Different),
            ]
        );
        assert!(plan[1].read_only_ok && !plan[0].read_only_ok);
    }

    #[test]
    fn optional_settings_are_planned_only_when_set() {
        let all = ConntrackSettings {
            max_per_core: 0,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(30),
            udp_stream_timeout: Duration::from_secs(120),
            ..ConntrackSettings::default()
        };
        let keys: Vec<(&str, u64)> = conntrack_plan(&all, 2)
            .iter()
            .map(|s| (s.key, s.value))
            .collect();
        assert_eq!(
            keys,
            [
                (TCP_BE_LIBERAL, 1),
                (UDP_TIMEOUT, 30),
                (UDP_TIMEOUT_STREAM, 120)
            ]
        );
    }

    #[test]
    fn apply_writes_only_what_is_lower_or_different() {
        let fake = FakeSysctl::new();
        fake.set(CONNTRACK_MAX, "524288"); // raised by an admin: keep
        fake.set(CONNTRACK_HASHSIZE, "16384"); // smaller than 262144 / 4: raise
        fake.set(TCP_TIMEOUT_ESTABLISHED, "432000"); // kernel default: set
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "3600"); // already right: leave
        let report =
            apply(&fake, &conntrack_plan(&ConntrackSettings::default(), 8)).expect("all readable");
        assert_eq!(
            fake.writes(),
            [
                (CONNTRACK_HASHSIZE.to_owned(), "65536".to_owned()),
                (TCP_TIMEOUT_ESTABLISHED.to_owned(), "86400".to_owned()),
            ]
        );
        assert_eq!(report.applied.len(), 2);
        assert_eq!(report.applied[1].from, 432_000);
    }

    #[test]
    fn read_only_hashsize_is_a_warning_but_other_failures_are_errors() {
        let fake = FakeSysctl::new();
        fake.set(CONNTRACK_MAX, "65536");
        fake.set(CONNTRACK_HASHSIZE, "16384");
        fake.set(TCP_TIMEOUT_ESTABLISHED, "86400");
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "3600");
        fake.make_read_only(CONNTRACK_HASHSIZE);
        let report = apply(&fake, &conntrack_plan(&ConntrackSettings::default(), 2))
            .expect("read-only hashsize is tolerated");
        assert_eq!(report.applied.len(), 1); // nf_conntrack_max 65536 -> 131072
        assert!(matches!(
            report.warnings.as_slice(),
            [SysctlError::ReadOnly { .. }]
        ));

        fake.make_read_only(CONNTRACK_MAX);
        fake.set(CONNTRACK_MAX, "1");
        let err = apply(&fake, &conntrack_plan(&ConntrackSettings::default(), 2))
            .expect_err("nf_conntrack_max must be writable");
        assert!(matches!(err, SysctlError::ReadOnly { .. }));
    }

    #[test]
    fn garbage_values_are_parse_errors() {
        let fake = FakeSysctl::new();
        fake.set(CONNTRACK_MAX, "lots");
        let err = apply(&fake, &conntrack_plan(&ConntrackSettings::default(), 2))
            .expect_err("not a number");
        assert!(matches!(err, SysctlError::Parse { .. }), "{err}");
    }

    #[test]
    fn writer_against_a_directory_standing_in_for_root() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = |key: &str, value: &str| {
            let path = dir.path().join(key);
            std::fs::create_dir_all(path.parent().expect("has parent")).expect("mkdir");
            std::fs::write(path, value).expect("write");
        };
        file(CONNTRACK_MAX, "65536\n");
        file(CONNTRACK_HASHSIZE, "16384\n");
        file(TCP_TIMEOUT_ESTABLISHED, "432000\n");
        file(TCP_TIMEOUT_CLOSE_WAIT, "60\n");
        file(ONLINE_CPUS, "0-7\n");
        let sysctl = FsSysctl::new(dir.path());
        assert_eq!(online_cpus(&sysctl), 8);
        let report = apply_conntrack_sysctls(&sysctl, &ConntrackSettings::default())
            .expect("writable temp dir");
        assert_eq!(report.applied.len(), 4);
        let read = |key: &str| sysctl.read(key).expect("readable");
        assert_eq!(read(CONNTRACK_MAX), "262144");
        assert_eq!(read(CONNTRACK_HASHSIZE), "65536");
        assert_eq!(read(TCP_TIMEOUT_ESTABLISHED), "86400");
        assert_eq!(read(TCP_TIMEOUT_CLOSE_WAIT), "3600");

        // Second run: nothing to do.
        let again = apply_conntrack_sysctls(&sysctl, &ConntrackSettings::default())
            .expect("still writable");
        assert!(again.applied.is_empty());

        // A missing file is an error naming it.
        let err = apply(
            &FsSysctl::new(dir.path().join("nowhere")),
            &conntrack_plan(&ConntrackSettings::default(), 1),
        )
        .expect_err("missing");
        assert!(err.to_string().contains("nf_conntrack_max"));
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn route_localnet_only_for_ipv4_loopback_node_ports() {
        let config = RenderConfig::default();
        assert_eq!(
            route_localnet_plan(&config, &[IpFamily::V4, IpFamily::V6]).len(),
            1
        );
        assert!(route_localnet_plan(&config, &[IpFamily::V6]).is_empty());
        let off = RenderConfig {
            localhost_node_ports: false,
            ..RenderConfig::default()
        };
        assert!(route_localnet_plan(&off, &[IpFamily::V4]).is_empty());
        let no_loopback = RenderConfig {
            node_port_addresses: NodePortAddresses::Ips(vec!["192.168.0.2".parse().expect("ip")]),
            ..RenderConfig::default()
        };
        assert!(route_localnet_plan(&no_loopback, &[IpFamily::V4]).is_empty());
        let with_loopback = RenderConfig {
            node_port_addresses: NodePortAddresses::Ips(vec!["127.0.0.1".parse().expect("ip")]),
            ..RenderConfig::default()
        };
        assert_eq!(
            route_localnet_plan(&with_loopback, &[IpFamily::V4]).len(),
            1
        );
    }

    #[test]
    fn be_liberal_is_read_leniently() {
        let fake = FakeSysctl::new();
        assert!(!tcp_be_liberal(&fake));
        fake.set(TCP_BE_LIBERAL, "1");
        assert!(tcp_be_liberal(&fake));
        fake.set(TCP_BE_LIBERAL, "0");
        assert!(!tcp_be_liberal(&fake));
    }
}
