//! Kernel settings kube-proxy owns: the conntrack table size and timeouts (all modes, at
//! start-up) and `route_localnet` (iptables mode with localhost NodePorts).
//!
//! The decisions are pure ([`conntrack_max`], [`conntrack_plan`], [`route_localnet_plan`]);
//! [`apply`] carries them out through a [`Sysctl`], which is either the real filesystem
//! ([`FsSysctl`], rooted at `/` or at a test directory) or `FakeSysctl` (`test-util`).
//!
//! A [`SysctlRecord`] keeps the value each setting had before this proxy first changed it,
//! in a file that outlives restarts, so `--cleanup` can put it back ([`SysctlRecord::restore`]).
//!
//! Only `nf_conntrack_max` and the hash size are global; the timeouts and `route_localnet`
//! are per network namespace. Writing `nf_conntrack_max` from a non-initial namespace fails
//! on current kernels, so tests never do it.

use kp_core::report::ErrorChain as _;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
#[cfg(any(test, feature = "test-util"))]
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
/// Upstream caps the per-core maximum at 2^20 entries since 1.36 (kubernetes#137002): beyond
/// that the table costs more memory than a busy node's flows need.
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
    #[error("reading {key}")]
    Read {
        /// The setting, relative to the root.
        key: String,
        /// The I/O error.
        source: io::Error,
    },
    /// The file could not be written.
    #[error("writing {key}")]
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
    /// The record of original values could not be read or written.
    #[error("sysctl record {}", path.display())]
    Record {
        /// The record file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// A line of the record is not `KEY ORIGINAL WRITTEN`.
    #[error("sysctl record {} line {line}: {text:?} is not `KEY ORIGINAL WRITTEN`", path.display())]
    RecordFormat {
        /// The record file.
        path: PathBuf,
        /// The 1-based line number.
        line: usize,
        /// The line.
        text: String,
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

#[cfg(any(test, feature = "test-util"))]
/// In-memory settings that record writes. Clones share the state.
#[derive(Clone, Debug, Default)]
pub struct FakeSysctl {
    state: Arc<Mutex<FakeState>>,
}

#[cfg(any(test, feature = "test-util"))]
#[derive(Debug, Default)]
struct FakeState {
    values: BTreeMap<String, String>,
    read_only: Vec<String>,
    writes: Vec<(String, String)>,
}

#[cfg(any(test, feature = "test-util"))]
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

#[cfg(any(test, feature = "test-util"))]
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

/// The `nf_conntrack_max` to ensure: `max_per_core x cpus` capped at [`MAX_CONNTRACK_MAX`],
/// but never below `min`; `None` when `max_per_core` is 0. It is only ever raised
/// ([`WriteWhen::Lower`]), as upstream since kubernetes#142035.
///
/// Upstream returns the cap as soon as the scaled value exceeds it, ignoring a larger `min`
/// (so `min: 2000000` holds on a 2-core node and not on a 64-core one); an explicit `min` is
/// honoured here on every node.
pub fn conntrack_max(settings: &ConntrackSettings, cpus: usize) -> Option<u64> {
    if settings.max_per_core == 0 {
        return None;
    }
    let cpus = u64::try_from(cpus).unwrap_or(u64::MAX);
    let scaled = u64::from(settings.max_per_core).saturating_mul(cpus);
    Some(scaled.min(MAX_CONNTRACK_MAX).max(u64::from(settings.min)))
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
    let loopback = match config.node_port_addresses.for_family(IpFamily::V4) {
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
                warn!(error = %err.chain(), "cannot raise kernel setting");
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

/// Where the record of original values lives by default. `/run` is a tmpfs on every
/// systemd host, so the record shares the settings' lifetime: a reboot resets both. In a
/// DaemonSet the directory must be a hostPath so the record survives a new container.
pub const DEFAULT_STATE_DIR: &str = "/run/kube-proxy-rs";
/// Overrides [`DEFAULT_STATE_DIR`] (tests, benchmarks, or several proxies on one host, each in
/// its own network namespace: the per-namespace settings need one record each).
pub const STATE_DIR_ENV: &str = "KUBE_PROXY_RS_STATE_DIR";
/// `$KUBE_PROXY_RS_STATE_DIR`, else [`DEFAULT_STATE_DIR`].
pub fn state_dir() -> PathBuf {
    std::env::var_os(STATE_DIR_ENV)
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_STATE_DIR), PathBuf::from)
}

/// The record's file name inside the state directory.
pub const RECORD_FILE: &str = "sysctls";

/// Whether `--cleanup` puts `key` back. `nf_conntrack_max` and the hash size stay raised:
/// lowering them on a node that carries traffic makes the kernel drop new flows once the
/// table holds more entries than the old limit, and whichever proxy runs next (upstream's
/// included, in every mode) raises them again at start. The timeouts, `tcp_be_liberal` and
/// `route_localnet` (which exposes 127.0.0.0/8 services to the network, CVE-2020-8558) go
/// back.
pub fn restored_on_cleanup(key: &str) -> bool {
    key != CONNTRACK_MAX && key != CONNTRACK_HASHSIZE
}

/// One recorded setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded {
    /// The value before this proxy changed it.
    pub original: u64,
    /// The value this proxy last wrote; restoring only happens while the setting still holds
    /// it (a value changed since by someone else is theirs and stays).
    pub written: u64,
}

/// What [`SysctlRecord::restore`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RestoreReport {
    /// Settings put back: key, the value found, the value restored.
    pub restored: Vec<(String, u64, u64)>,
    /// Settings left alone because they no longer hold the value this proxy wrote, or no
    /// longer exist: key and what was found.
    pub left: Vec<(String, String)>,
}

/// The original value of every setting this proxy changed (only those
/// [`restored_on_cleanup`] accepts), kept in a small text file: one `KEY ORIGINAL WRITTEN`
/// line per setting.
#[derive(Clone, Debug)]
pub struct SysctlRecord {
    path: PathBuf,
}

impl SysctlRecord {
    /// The record at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into() }
    }

    /// The record in [`state_dir`].
    pub fn from_env() -> Self {
        Self::new(state_dir().join(RECORD_FILE))
    }

    /// The record file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every recorded setting; none when the file does not exist.
    pub fn load(&self) -> Result<BTreeMap<String, Recorded>, SysctlError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(source) => return Err(self.io_error(source)),
        };
        let mut out = BTreeMap::new();
        for (index, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = || SysctlError::RecordFormat {
                path: self.path.clone(),
                line: index + 1,
                text: line.to_owned(),
            };
            let words: Vec<&str> = line.split_whitespace().collect();
            let [key, original, written] = words.as_slice() else {
                return Err(bad());
            };
            let number = |word: &str| word.parse::<u64>().map_err(|_| bad());
            out.insert(
                (*key).to_owned(),
                Recorded {
                    original: number(original)?,
                    written: number(written)?,
                },
            );
        }
        Ok(out)
    }

    /// Record the writes in `applied`. A setting already recorded keeps its original while
    /// it still held the value this proxy wrote; otherwise the value just overwritten
    /// becomes the original (someone else had changed it in between).
    pub fn note(&self, applied: &[Applied]) -> Result<(), SysctlError> {
        let applied: Vec<&Applied> = applied
            .iter()
            .filter(|a| restored_on_cleanup(a.key))
            .collect();
        if applied.is_empty() {
            return Ok(());
        }
        let mut record = self.load()?;
        for write in applied {
            let original = match record.get(write.key) {
                Some(previous) if previous.written == write.from => previous.original,
                _ => write.from,
            };
            record.insert(
                write.key.to_owned(),
                Recorded {
                    original,
                    written: write.to,
                },
            );
        }
        self.store(&record)
    }

    /// Put every recorded setting back to its original value, if it still holds the value
    /// this proxy wrote, and forget the record. A setting that no longer exists is left;
    /// one that cannot be read or written otherwise is an error, and stays recorded.
    pub fn restore(&self, sysctl: &impl Sysctl) -> Result<RestoreReport, SysctlError> {
        let mut record = self.load()?;
        let mut report = RestoreReport::default();
        let mut first_error = None;
        for (key, recorded) in record.clone() {
            let current = match sysctl.read(&key) {
                Ok(text) => text,
                Err(SysctlError::Read { source, .. })
                    if source.kind() == io::ErrorKind::NotFound =>
                {
                    report.left.push((key.clone(), "missing".to_owned()));
                    record.remove(&key);
                    continue;
                }
                Err(err) => {
                    first_error.get_or_insert(err);
                    continue;
                }
            };
            if current.parse::<u64>().ok() != Some(recorded.written) {
                info!(key, found = %current, "kernel setting changed since kube-proxy set it; left as is");
                report.left.push((key.clone(), current));
                record.remove(&key);
                continue;
            }
            match sysctl.write(&key, &recorded.original.to_string()) {
                Ok(()) => {
                    info!(
                        key,
                        from = recorded.written,
                        to = recorded.original,
                        "restored kernel setting"
                    );
                    report
                        .restored
                        .push((key.clone(), recorded.written, recorded.original));
                    record.remove(&key);
                }
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
        self.store(&record)?;
        match first_error {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }

    /// Write `record` atomically (a temporary file renamed over), or remove the file when
    /// it is empty.
    fn store(&self, record: &BTreeMap<String, Recorded>) -> Result<(), SysctlError> {
        if record.is_empty() {
            return match std::fs::remove_file(&self.path) {
                Err(err) if err.kind() != io::ErrorKind::NotFound => Err(self.io_error(err)),
                _ => Ok(()),
            };
        }
        let mut text = String::from(
            "# kube-proxy-rs: settings it changed, as KEY ORIGINAL WRITTEN; \
             `kube-proxy --cleanup` puts ORIGINAL back\n",
        );
        for (key, recorded) in record {
            let _ = writeln!(text, "{key} {} {}", recorded.original, recorded.written);
        }
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|err| self.io_error(err))?;
        }
        let mut tmp = self.path.clone().into_os_string();
        tmp.push(".tmp");
        std::fs::write(&tmp, text).map_err(|err| self.io_error(err))?;
        std::fs::rename(&tmp, &self.path).map_err(|err| self.io_error(err))
    }

    fn io_error(&self, source: io::Error) -> SysctlError {
        SysctlError::Record {
            path: self.path.clone(),
            source,
        }
    }
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
        let cases: [(u32, u32, usize, Option<u64>); 9] = [
            (32_768, 131_072, 2, Some(131_072)),    // min wins on small nodes
            (32_768, 131_072, 4, Some(131_072)),    // exactly min
            (32_768, 131_072, 8, Some(262_144)),    // scaled wins
            (32_768, 131_072, 64, Some(1_048_576)), // 2 Mi capped
            (32_768, 0, 1, Some(32_768)),           // no floor
            (0, 131_072, 8, None),                  // 0 leaves it alone
            (u32::MAX, 0, usize::MAX, Some(MAX_CONNTRACK_MAX)), // no overflow
            (1, 2_000_000, 1, Some(2_000_000)),     // an explicit floor above the cap holds
            (32_768, 2_000_000, 96, Some(2_000_000)), // on every node (upstream: the cap)
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

    /// kubernetes#141943 / #142035: in a container that may not write the sysctl (LXC), a host
    /// value above the one wanted is left alone, so the start-up does not fail on it.
    #[test]
    fn a_higher_value_is_never_written_even_where_writing_would_fail() {
        let fake = FakeSysctl::new();
        fake.set(CONNTRACK_MAX, "2097152");
        fake.set(CONNTRACK_HASHSIZE, "524288");
        fake.set(TCP_TIMEOUT_ESTABLISHED, "86400");
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "3600");
        fake.make_read_only(CONNTRACK_MAX);
        fake.make_read_only(CONNTRACK_HASHSIZE);
        // 64 cores: 2 Mi scaled, capped at 1 Mi, below the host's 2 Mi.
        let report = apply(&fake, &conntrack_plan(&ConntrackSettings::default(), 64))
            .expect("nothing to write");
        assert!(fake.writes().is_empty(), "{:?}", fake.writes());
        assert!(report.applied.is_empty() && report.warnings.is_empty());
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

    fn record_in(dir: &tempfile::TempDir) -> SysctlRecord {
        SysctlRecord::new(dir.path().join("state").join(RECORD_FILE))
    }

    #[test]
    fn cleanup_restores_what_start_up_changed_even_after_a_restart() {
        let dir = tempfile::tempdir().expect("temp dir");
        let fake = FakeSysctl::new();
        fake.set(ROUTE_LOCALNET, "0");
        fake.set(CONNTRACK_MAX, "65536");
        fake.set(CONNTRACK_HASHSIZE, "16384");
        fake.set(TCP_TIMEOUT_ESTABLISHED, "432000");
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "3600");
        let mut plan = conntrack_plan(&ConntrackSettings::default(), 2);
        plan.extend(route_localnet_plan(
            &RenderConfig::default(),
            &[IpFamily::V4],
        ));

        // First start: four writes, two of them recorded.
        let report = apply(&fake, &plan).expect("applies");
        assert_eq!(report.applied.len(), 4);
        record_in(&dir).note(&report.applied).expect("recorded");
        let expected = BTreeMap::from([
            (
                ROUTE_LOCALNET.to_owned(),
                Recorded {
                    original: 0,
                    written: 1,
                },
            ),
            (
                TCP_TIMEOUT_ESTABLISHED.to_owned(),
                Recorded {
                    original: 432_000,
                    written: 86_400,
                },
            ),
        ]);
        assert_eq!(record_in(&dir).load().expect("readable"), expected);

        // A restart (a new process, a new record handle): nothing to write, the record stays.
        let again = apply(&fake, &plan).expect("applies");
        assert!(again.applied.is_empty());
        record_in(&dir)
            .note(&again.applied)
            .expect("nothing to note");
        assert_eq!(record_in(&dir).load().expect("readable"), expected);

        // --cleanup: both back, table size left raised, the record gone.
        let before = fake.writes().len();
        let restored = record_in(&dir).restore(&fake).expect("restores");
        assert_eq!(
            restored.restored,
            [
                (ROUTE_LOCALNET.to_owned(), 1, 0),
                (TCP_TIMEOUT_ESTABLISHED.to_owned(), 86_400, 432_000),
            ]
        );
        assert_eq!(fake.writes().len(), before + 2);
        assert_eq!(fake.read(ROUTE_LOCALNET).expect("set"), "0");
        assert_eq!(fake.read(CONNTRACK_MAX).expect("set"), "131072");
        assert!(!record_in(&dir).path().exists());
        // A second cleanup has nothing to do.
        assert_eq!(
            record_in(&dir).restore(&fake).expect("no record"),
            RestoreReport::default()
        );
    }

    #[test]
    fn a_value_changed_by_someone_else_is_theirs() {
        let dir = tempfile::tempdir().expect("temp dir");
        let record = record_in(&dir);
        let fake = FakeSysctl::new();
        fake.set(TCP_TIMEOUT_ESTABLISHED, "432000");
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "60");
        let plan = conntrack_plan(&ConntrackSettings::default(), 2)
            .into_iter()
            .filter(|s| restored_on_cleanup(s.key))
            .collect::<Vec<_>>();
        record
            .note(&apply(&fake, &plan).expect("applies").applied)
            .expect("recorded");
        // An admin sets the established timeout after the proxy did; the proxy restarts
        // and sets it again over the admin's value: that value is now the one to restore.
        fake.set(TCP_TIMEOUT_ESTABLISHED, "7200");
        record
            .note(&apply(&fake, &plan).expect("applies").applied)
            .expect("recorded");
        assert_eq!(
            record.load().expect("readable")[TCP_TIMEOUT_ESTABLISHED],
            Recorded {
                original: 7_200,
                written: 86_400
            }
        );
        // And after the last start an admin changes close-wait: cleanup leaves it.
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "120");
        let report = record.restore(&fake).expect("restores");
        assert_eq!(fake.read(TCP_TIMEOUT_ESTABLISHED).expect("set"), "7200");
        assert_eq!(fake.read(TCP_TIMEOUT_CLOSE_WAIT).expect("set"), "120");
        assert_eq!(
            report.left,
            [(TCP_TIMEOUT_CLOSE_WAIT.to_owned(), "120".to_owned())]
        );
    }

    #[test]
    fn a_failed_restore_is_an_error_and_stays_recorded() {
        let dir = tempfile::tempdir().expect("temp dir");
        let record = record_in(&dir);
        let fake = FakeSysctl::new();
        fake.set(ROUTE_LOCALNET, "0");
        fake.set(TCP_TIMEOUT_CLOSE_WAIT, "60");
        let mut plan = route_localnet_plan(&RenderConfig::default(), &[IpFamily::V4]);
        plan.extend(
            conntrack_plan(&ConntrackSettings::default(), 2)
                .into_iter()
                .filter(|s| s.key == TCP_TIMEOUT_CLOSE_WAIT),
        );
        record
            .note(&apply(&fake, &plan).expect("applies").applied)
            .expect("recorded");
        fake.make_read_only(ROUTE_LOCALNET);
        let err = record.restore(&fake).expect_err("cannot write");
        assert!(matches!(err, SysctlError::ReadOnly { .. }), "{err}");
        // The other setting was restored and forgotten; the failed one is kept for a retry.
        assert_eq!(fake.read(TCP_TIMEOUT_CLOSE_WAIT).expect("set"), "60");
        let left = record.load().expect("readable");
        assert_eq!(left.keys().collect::<Vec<_>>(), [ROUTE_LOCALNET]);
    }

    #[test]
    fn a_malformed_record_names_its_line() {
        let dir = tempfile::tempdir().expect("temp dir");
        let record = record_in(&dir);
        std::fs::create_dir_all(dir.path().join("state")).expect("mkdir");
        std::fs::write(
            record.path(),
            format!("# comment\n{ROUTE_LOCALNET} 0 1\n{TCP_BE_LIBERAL} zero 1\n"),
        )
        .expect("write");
        let err = record.load().expect_err("malformed");
        assert!(
            matches!(err, SysctlError::RecordFormat { line: 3, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("line 3"), "{err}");
        assert!(record.restore(&FakeSysctl::new()).is_err());
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
