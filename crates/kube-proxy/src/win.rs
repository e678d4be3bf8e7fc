//! The proxy on Windows: `winuserspace` (also `userspace`, upstream's name for it there, and
//! `kernelspace` or an empty mode, which upstream fell back from to userspace when HNS could
//! not be used: this build has no HNS mode). The Linux kernel modes are refused. Service
//! addresses go on the interface named by `INTERFACE_TO_ADD_SERVICE_IP` (upstream's variable;
//! default `vEthernet (HNS Internal NIC)`), through the IP Helper API; the ones added are
//! recorded so `--cleanup` can remove what a proxy that did not stop cleanly left.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context as _;
use kp_config::{KubeProxyConfiguration, Options, ProxyMode};
use kp_core::model::IpFamily;
use kp_userspace::{RecordingHost, RelayMetrics, ServiceAddresses, WinBackend};
use kp_winaddr::IpHelper;

/// Upstream's variable naming the interface service addresses are added to.
const INTERFACE_ENV: &str = "INTERFACE_TO_ADD_SERVICE_IP";
/// Upstream's default interface.
const DEFAULT_INTERFACE: &str = "vEthernet (HNS Internal NIC)";
/// Where the record of added addresses lives: `$KUBE_PROXY_RS_STATE_DIR`, else
/// `%ProgramData%\kube-proxy-rs`.
const STATE_DIR_ENV: &str = "KUBE_PROXY_RS_STATE_DIR";
/// The record's file name.
const RECORD_FILE: &str = "service-addresses";

/// The mode this build runs for `mode` on Windows, or why not.
fn windows_mode(mode: ProxyMode) -> anyhow::Result<()> {
    match mode {
        ProxyMode::Winuserspace | ProxyMode::Userspace => Ok(()),
        ProxyMode::Kernelspace => {
            tracing::warn!(
                "kernelspace (HNS) mode is not implemented; using winuserspace, as upstream fell back to its userspace proxier"
            );
            Ok(())
        }
        other => anyhow::bail!(
            "proxy mode {:?} programs the Linux kernel and cannot run on Windows; use --proxy-mode=winuserspace (or userspace)",
            other.as_str()
        ),
    }
}

/// The record of added addresses.
fn record_path() -> PathBuf {
    let dir = std::env::var_os(STATE_DIR_ENV)
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("ProgramData").map(|d| PathBuf::from(d).join("kube-proxy-rs")))
        .unwrap_or_else(|| PathBuf::from("kube-proxy-rs"));
    dir.join(RECORD_FILE)
}

/// The interface service addresses are added to.
fn interface() -> String {
    std::env::var(INTERFACE_ENV)
        .ok()
        .filter(|i| !i.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_INTERFACE.to_owned())
}

/// The address host: the IP Helper API on the interface, with the record.
fn host() -> RecordingHost<IpHelper> {
    RecordingHost::new(IpHelper::new(&interface()), record_path())
}

/// The families this host has: IPv4, and IPv6 when a socket can be bound to `::1`.
fn families() -> Vec<IpFamily> {
    let v6 = std::net::UdpSocket::bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), 0));
    let mut families = vec![IpFamily::V4];
    if v6.is_ok() {
        families.push(IpFamily::V6);
    }
    families
}

/// Runs the proxy, `--cleanup` or `--init-only` on Windows.
pub fn run(options: &Options, config: KubeProxyConfiguration) -> anyhow::Result<()> {
    if options.cleanup {
        return cleanup();
    }
    if options.init_only {
        tracing::info!("nothing to initialize on Windows; --init-only done");
        return Ok(());
    }
    windows_mode(config.mode())?;
    let runtime = crate::runtime()?;
    let (detected, started, mut registry) = crate::read_node_ips(&runtime, options, &config)?;
    let families = families();
    let relay = crate::app::relay_config(&config);
    tracing::info!(
        interface = %interface(),
        record = %record_path().display(),
        udp_idle_timeout = ?relay.udp_idle_timeout,
        ?families,
        "Using winuserspace Proxier"
    );
    let metrics = RelayMetrics::register(&mut registry);
    let settings =
        crate::app::Settings::new(options, config, &detected, started, (&[], families.clone()));
    let _guard = runtime.enter();
    let backend = WinBackend::new(relay, metrics, ServiceAddresses::new(host()), families);
    let settings = settings.with_affinity(backend.relay().affinity().clone());
    runtime.block_on(crate::app::run(settings, backend, registry))
}

/// `--cleanup`: removes the service addresses a previous run added and did not remove.
fn cleanup() -> anyhow::Result<()> {
    let mut host = host();
    let errors = host.remove_recorded();
    if let Some(first) = errors.into_iter().next() {
        return Err(first).context("removing the service addresses this proxy added");
    }
    tracing::info!(record = %record_path().display(), "Removed the service addresses this proxy added");
    Ok(())
}
