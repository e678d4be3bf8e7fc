//! What the modes need to know about this node, probed once at start-up into a [`Host`] that
//! every mode's builder, `--init-only`, `--cleanup` and `explain` read: which IP families the
//! kernel has, the interfaces' addresses (over rtnetlink), the iptables backend (legacy or
//! nf_tables, chosen before any iptables tool runs; its tools are [`Host::iptables`], the only
//! record of the choice), `iptables --version` for iptables mode's
//! netlink path, `nft --version` for nftables mode, and
//! whether IPVS works (ipvs mode, and `--cleanup` to know whether there is IPVS state to
//! remove). Only what the task needs is probed ([`Wants`]): the IPVS probe may load a kernel
//! module, so iptables mode never runs it.
//!
//! The probes themselves sit behind [`Probe`]: [`SystemProbe`] runs them on the node, tests
//! hand in a fake.

use std::net::IpAddr;

use anyhow::Context as _;
use kp_config::{IptablesBackend, KubeProxyConfiguration, ProxyMode};
use kp_core::model::IpFamily;
use kp_core::report::ErrorChain as _;
use kp_dataplane::exec::Tools;
pub use kp_dataplane::interfaces::InterfaceAddress;
use kp_dataplane::interfaces::InterfaceError;
use kp_dataplane::xtables::Choice;
use kp_ipvs::{Ipvs as _, NetlinkIpvs, Protocol, Scheduler, ServiceKey, VirtualServer};
use kp_rules::ipvs::DUMMY_DEVICE;

/// Why ipvs mode cannot run on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

/// Why a probe could not tell.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A tool could not be started.
    #[error("cannot run `{command}`")]
    Spawn {
        /// The command line.
        command: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A tool ran and failed.
    #[error("`{command}` failed: {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Its standard error, trimmed.
        stderr: String,
    },
    /// nftables mode's `nft` could not be started.
    #[error("nftables mode needs `nft` (package nftables)")]
    NoNft(#[source] std::io::Error),
    /// The interface addresses could not be read.
    #[error(transparent)]
    Addresses(#[from] InterfaceError),
}

/// What the process is started for; it decides what is probed ([`Wants::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    /// Run the proxy.
    Run,
    /// `--init-only`: the privileged set-up, then exit.
    InitOnly,
    /// `--cleanup`: remove every mode's state, then exit.
    Cleanup,
}

/// Which probes a start-up needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Wants {
    /// Choose the iptables backend: any iptables tool may run (every mode but fake and
    /// winuserspace, which program nothing here).
    pub iptables_backend: bool,
    /// List the interfaces' addresses (nodePortAddresses, IPVS NodePorts).
    pub addresses: bool,
    /// Ask the chosen `iptables` its version (iptables mode, and ipvs mode, which may fall
    /// back to it: the netlink path runs only for versions whose encoding was verified).
    pub iptables_version: bool,
    /// Ask `nft` its version (nftables mode).
    pub nft_version: bool,
    /// Probe IPVS with this scheduler (ipvs mode; `--cleanup` in any mode).
    pub ipvs: Option<Scheduler>,
}

impl Wants {
    /// What `task` needs in the configured mode. An invalid `ipvs.scheduler` is an error
    /// only where IPVS is probed.
    pub fn new(config: &KubeProxyConfiguration, task: Task) -> anyhow::Result<Self> {
        let mode = config.mode();
        let kernel = programs_the_kernel(mode);
        let probe_ipvs = match task {
            Task::Cleanup => kernel,
            Task::Run | Task::InitOnly => mode == ProxyMode::Ipvs,
        };
        let ipvs = if probe_ipvs {
            Some(
                config
                    .ipvs
                    .scheduler
                    .parse::<Scheduler>()
                    .context("invalid ipvs.scheduler")?,
            )
        } else {
            None
        };
        Ok(Self {
            iptables_backend: kernel,
            addresses: task != Task::Cleanup,
            iptables_version: task == Task::Run
                && matches!(mode, ProxyMode::Iptables | ProxyMode::Ipvs),
            nft_version: task == Task::Run && mode == ProxyMode::Nftables,
            ipvs,
        })
    }
}

/// Whether `mode` may program this node's kernel (and so run iptables tools): every mode but
/// fake and winuserspace. `--cleanup` cleans in all of them, as upstream.
pub fn programs_the_kernel(mode: ProxyMode) -> bool {
    !matches!(mode, ProxyMode::Fake | ProxyMode::Winuserspace)
}

/// The probes, one method each; [`SystemProbe`] runs them on the node.
pub trait Probe {
    /// Chooses the iptables backend for the whole process (kept in [`Host::iptables`], so
    /// every iptables tool run afterwards is that backend's).
    fn iptables_backend(&self) -> impl Future<Output = anyhow::Result<Choice>>;
    /// The IP families the kernel has.
    fn families(&self) -> Vec<IpFamily>;
    /// Every interface address, or why they could not be read.
    fn addresses(&self) -> impl Future<Output = Result<Vec<InterfaceAddress>, ProbeError>>;
    /// `tools`' (the chosen backend's) `iptables --version` output, or why it could not be
    /// run.
    fn iptables_version(&self, tools: &Tools) -> Result<String, ProbeError>;
    /// `nft --version`'s output, or why it could not be run.
    fn nft_version(&self) -> Result<String, ProbeError>;
    /// Whether IPVS works here with `scheduler`.
    fn ipvs(&self, scheduler: Scheduler) -> Result<(), Unavailable>;
}

/// This node as the modes see it, probed once ([`Host::probe`]).
#[derive(Debug, Default)]
pub struct Host {
    /// The IP families the kernel has.
    pub families: Vec<IpFamily>,
    /// The chosen iptables backend's tools, which every mode runs (the system's,
    /// [`kp_dataplane::exec::IptablesVariant::System`], when no backend was chosen).
    pub iptables: Tools,
    /// Every interface address (empty when they could not be listed: NodePorts then answer
    /// nowhere rather than everywhere).
    pub addresses: Vec<InterfaceAddress>,
    /// The chosen `iptables --version`'s output (trimmed) or why it failed, when iptables
    /// mode may run.
    pub iptables_version: Option<Result<String, ProbeError>>,
    /// `nft --version`'s output or why it failed, when nftables mode asked.
    pub nft_version: Option<Result<String, ProbeError>>,
    /// Whether IPVS works, when it was probed.
    pub ipvs: Option<Result<(), Unavailable>>,
}

impl Host {
    /// Runs the probes `wants` names, the iptables backend's first (before any other tool
    /// runs). Only the backend choice can fail; a missing fact is recorded as such.
    pub async fn probe(probe: &impl Probe, wants: &Wants) -> anyhow::Result<Self> {
        let iptables = if wants.iptables_backend {
            Tools::new(probe.iptables_backend().await?.variant)
        } else {
            Tools::default()
        };
        let addresses = if wants.addresses {
            match probe.addresses().await {
                Ok(addresses) => addresses,
                Err(why) => {
                    tracing::warn!(error = %why, "cannot list this node's addresses; NodePorts answer nowhere");
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        Ok(Self {
            families: probe.families(),
            iptables_version: wants
                .iptables_version
                .then(|| probe.iptables_version(&iptables)),
            iptables,
            addresses,
            nft_version: wants.nft_version.then(|| probe.nft_version()),
            ipvs: wants.ipvs.map(|scheduler| probe.ipvs(scheduler)),
        })
    }

    /// Every interface address (what nodePortAddresses selects from).
    pub fn local_addresses(&self) -> Vec<IpAddr> {
        self.addresses.iter().map(|a| a.ip).collect()
    }

    /// The addresses IPVS NodePorts go on when nodePortAddresses is unset, as upstream:
    /// every address except loopback, IPv6 link-local, and kube-ipvs0's own.
    pub fn node_addresses(&self) -> Vec<IpAddr> {
        self.addresses
            .iter()
            .filter(|a| a.device != DUMMY_DEVICE)
            .map(|a| a.ip)
            .filter(|ip| {
                let link_local =
                    matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80);
                !ip.is_loopback() && !link_local
            })
            .collect()
    }

    /// The mode that runs when `mode` is configured: ipvs mode falls back to iptables mode
    /// where IPVS does not work, as upstream's older releases did (logging upstream's lines).
    pub fn mode_to_run(&self, mode: ProxyMode) -> ProxyMode {
        match (&self.ipvs, mode) {
            (Some(Err(why)), ProxyMode::Ipvs) => {
                tracing::error!(error = %why, "Can't use the IPVS proxier");
                tracing::info!("Falling back to the iptables proxier");
                ProxyMode::Iptables
            }
            _ => mode,
        }
    }

    /// Whether IPVS works here (`false` when it was not probed).
    pub fn has_ipvs(&self) -> bool {
        matches!(self.ipvs, Some(Ok(())))
    }
}

/// The probes as they run on the node.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemProbe {
    /// `--iptables-backend`, when given.
    pub iptables_backend_flag: Option<IptablesBackend>,
    /// `iptablesBackend` of the configuration.
    pub iptables_backend_file: IptablesBackend,
}

impl SystemProbe {
    /// With the operator's iptables backend settings.
    pub fn new(flag: Option<IptablesBackend>, config: &KubeProxyConfiguration) -> Self {
        Self {
            iptables_backend_flag: flag,
            iptables_backend_file: config.iptables_backend,
        }
    }
}

/// The standard output of `command`, which ran: if it succeeded.
fn succeeded(command: String, output: &std::process::Output) -> Result<String, ProbeError> {
    if !output.status.success() {
        return Err(ProbeError::Failed {
            command,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Upstream's scheduler probe: a throwaway virtual server in TEST-NET-2, deleted at once.
const IPVS_PROBE_ADDRESS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 51, 100, 0);
/// The probe's port.
const IPVS_PROBE_PORT: u16 = 20000;

impl Probe for SystemProbe {
    async fn iptables_backend(&self) -> anyhow::Result<Choice> {
        crate::iptables_backend::select(self.iptables_backend_flag, self.iptables_backend_file)
            .await
    }

    fn families(&self) -> Vec<IpFamily> {
        kp_dataplane::iptables::detect_families()
    }

    async fn addresses(&self) -> Result<Vec<InterfaceAddress>, ProbeError> {
        Ok(kp_dataplane::interfaces::interface_addresses().await?)
    }

    fn iptables_version(&self, tools: &Tools) -> Result<String, ProbeError> {
        let iptables = &tools.iptables;
        let command = format!("{} --version", iptables.display());
        let output = std::process::Command::new(iptables)
            .arg("--version")
            .output()
            .map_err(|source| ProbeError::Spawn {
                command: command.clone(),
                source,
            })?;
        succeeded(command, &output).map(|out| out.trim().to_owned())
    }

    fn nft_version(&self) -> Result<String, ProbeError> {
        let nft = kp_dataplane::nftables::DEFAULT_NFT_BINARY;
        let output = std::process::Command::new(nft)
            .arg("--version")
            .output()
            .map_err(ProbeError::NoNft)?;
        succeeded(format!("{nft} --version"), &output)
    }

    /// Opens IPVS (loading `ip_vs` if it is not yet, best effort) and proves the scheduler
    /// works with a throwaway virtual server, as upstream does before choosing the mode; then
    /// checks for the `ipset` tool.
    fn ipvs(&self, scheduler: Scheduler) -> Result<(), Unavailable> {
        let mut ipvs = match NetlinkIpvs::open() {
            Ok(ipvs) => ipvs,
            Err(first) => {
                let _ = std::process::Command::new("modprobe")
                    .args(["-q", "ip_vs"])
                    .status();
                NetlinkIpvs::open().map_err(|_| Unavailable(first.to_string()))?
            }
        };
        let key = ServiceKey {
            address: IpAddr::V4(IPVS_PROBE_ADDRESS),
            protocol: Protocol::Tcp,
            port: IPVS_PROBE_PORT,
        };
        let _ = ipvs.delete_service(&key);
        ipvs.add_service(&VirtualServer::new(key, scheduler, None))
            .map_err(|e| {
                Unavailable(format!(
                    "the IPVS scheduler {scheduler} does not work here: {}",
                    e.chain()
                ))
            })?;
        ipvs.delete_service(&key)
            .map_err(|e| Unavailable(format!("cannot remove the IPVS probe: {}", e.chain())))?;
        match std::process::Command::new("ipset")
            .arg("--version")
            .output()
        {
            Ok(out) if out.status.success() => Ok(()),
            _ => Err(Unavailable(
                "the ipset tool is missing (Debian: apt-get install ipset)".into(),
            )),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::RefCell;

    use kp_dataplane::exec::IptablesVariant;
    use kp_dataplane::xtables::Reason;

    use super::*;

    /// Answers from fixed facts (a version's `Err` is the tool's stderr) and records which
    /// probes ran.
    pub(crate) struct FakeProbe {
        /// An `Err` is why the rtnetlink socket could not be opened.
        pub addresses: Result<Vec<InterfaceAddress>, std::io::ErrorKind>,
        pub iptables_version: Result<String, &'static str>,
        pub nft_version: Result<String, &'static str>,
        pub ipvs: Result<(), Unavailable>,
        pub families: Vec<IpFamily>,
        pub calls: RefCell<Vec<&'static str>>,
    }

    impl Default for FakeProbe {
        fn default() -> Self {
            Self {
                addresses: Ok(node_addresses()),
                iptables_version: Ok("iptables v1.8.9 (nf_tables)".to_owned()),
                nft_version: Ok("nftables v1.0.6 (Lester Gooch #5)\n".to_owned()),
                ipvs: Err(Unavailable("IPVS is not available in this kernel".into())),
                families: vec![IpFamily::V4, IpFamily::V6],
                calls: RefCell::new(Vec::new()),
            }
        }
    }

    impl Probe for FakeProbe {
        async fn iptables_backend(&self) -> anyhow::Result<Choice> {
            self.calls.borrow_mut().push("iptables_backend");
            Ok(Choice {
                variant: IptablesVariant::Legacy,
                reason: Reason::Configured("the test".into()),
            })
        }

        fn families(&self) -> Vec<IpFamily> {
            self.families.clone()
        }

        async fn addresses(&self) -> Result<Vec<InterfaceAddress>, ProbeError> {
            self.calls.borrow_mut().push("addresses");
            self.addresses
                .clone()
                .map_err(|kind| InterfaceError::Socket(kind.into()).into())
        }

        fn iptables_version(&self, _tools: &Tools) -> Result<String, ProbeError> {
            self.calls.borrow_mut().push("iptables_version");
            self.iptables_version
                .clone()
                .map_err(|stderr| failed("iptables --version", stderr))
        }

        fn nft_version(&self) -> Result<String, ProbeError> {
            self.calls.borrow_mut().push("nft_version");
            self.nft_version
                .clone()
                .map_err(|stderr| failed("nft --version", stderr))
        }

        fn ipvs(&self, _scheduler: Scheduler) -> Result<(), Unavailable> {
            self.calls.borrow_mut().push("ipvs");
            self.ipvs.clone()
        }
    }

    fn failed(command: &str, stderr: &str) -> ProbeError {
        ProbeError::Failed {
            command: command.to_owned(),
            stderr: stderr.to_owned(),
        }
    }

    /// A node's addresses: loopback, a NIC with IPv4, global and link-local IPv6, and
    /// kube-ipvs0 holding a ClusterIP.
    pub(crate) fn node_addresses() -> Vec<InterfaceAddress> {
        [
            ("lo", "127.0.0.1"),
            ("eth0", "192.168.49.2"),
            ("eth0", "fe80::1"),
            ("eth0", "2001:db8::2"),
            ("kube-ipvs0", "10.96.0.1"),
        ]
        .into_iter()
        .map(|(device, ip)| InterfaceAddress {
            device: device.to_owned(),
            ip: ip.parse().expect("an IP"),
        })
        .collect()
    }

    fn config(mode: ProxyMode) -> KubeProxyConfiguration {
        KubeProxyConfiguration {
            mode,
            ..KubeProxyConfiguration::default()
        }
    }

    /// Probes the fake for `task` in `mode`; returns the host and the probes that ran.
    pub(crate) fn probed(
        probe: &FakeProbe,
        mode: ProxyMode,
        task: Task,
    ) -> (Host, Vec<&'static str>) {
        let wants = Wants::new(&config(mode), task).expect("valid configuration");
        probe.calls.borrow_mut().clear();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let host = runtime
            .block_on(Host::probe(probe, &wants))
            .expect("the fake's backend choice succeeds");
        let calls = probe.calls.borrow().clone();
        (host, calls)
    }

    #[test]
    fn each_task_probes_only_what_it_needs() {
        let probe = FakeProbe::default();
        let calls = |mode, task| probed(&probe, mode, task).1;
        use ProxyMode::*;
        use Task::*;
        assert_eq!(
            calls(Iptables, Run),
            ["iptables_backend", "addresses", "iptables_version"]
        );
        assert_eq!(calls(Userspace, Run), ["iptables_backend", "addresses"]);
        assert_eq!(
            calls(Nftables, Run),
            ["iptables_backend", "addresses", "nft_version"]
        );
        assert_eq!(
            calls(Ipvs, Run),
            ["iptables_backend", "addresses", "iptables_version", "ipvs"]
        );
        // Fake mode programs nothing: no iptables tool, no backend choice.
        assert_eq!(calls(Fake, Run), ["addresses"]);
        // --init-only loads ip_vs (through the probe) only in ipvs mode.
        assert_eq!(calls(Iptables, InitOnly), ["iptables_backend", "addresses"]);
        assert_eq!(
            calls(Ipvs, InitOnly),
            ["iptables_backend", "addresses", "ipvs"]
        );
        // --cleanup removes IPVS state whatever the mode, where there is IPVS.
        for mode in [Iptables, Nftables, Userspace, Ipvs, Kernelspace] {
            assert_eq!(
                calls(mode, Cleanup),
                ["iptables_backend", "ipvs"],
                "{mode:?}"
            );
        }
        assert!(calls(Fake, Cleanup).is_empty());
    }

    #[test]
    fn the_chosen_backend_is_the_hosts_tools() {
        let probe = FakeProbe::default();
        let (host, _) = probed(&probe, ProxyMode::Iptables, Task::Run);
        assert_eq!(host.iptables, Tools::new(IptablesVariant::Legacy));
        assert_eq!(
            host.iptables.iptables,
            std::path::Path::new("iptables-legacy")
        );
        // Fake mode chooses none: the system's tools, which it never runs.
        let (host, _) = probed(&probe, ProxyMode::Fake, Task::Run);
        assert_eq!(host.iptables.variant, IptablesVariant::System);
    }

    #[test]
    fn an_invalid_scheduler_matters_only_where_ipvs_is_probed() {
        let mut config = config(ProxyMode::Iptables);
        config.ipvs.scheduler = "nonsense".into();
        assert!(Wants::new(&config, Task::Run).is_ok());
        let err = Wants::new(&config, Task::Cleanup).expect_err("probes IPVS");
        assert!(format!("{err:#}").contains("ipvs.scheduler"), "{err:#}");
        config.mode = ProxyMode::Ipvs;
        assert!(Wants::new(&config, Task::InitOnly).is_err());
    }

    #[test]
    fn addresses_are_read_once_for_nodeports_and_ipvs() {
        let (host, _) = probed(&FakeProbe::default(), ProxyMode::Ipvs, Task::Run);
        let all: Vec<String> = host
            .local_addresses()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            all,
            [
                "127.0.0.1",
                "192.168.49.2",
                "fe80::1",
                "2001:db8::2",
                "10.96.0.1"
            ]
        );
        let node: Vec<String> = host
            .node_addresses()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(node, ["192.168.49.2", "2001:db8::2"]);
        assert_eq!(host.families, [IpFamily::V4, IpFamily::V6]);
    }

    #[test]
    fn unreadable_addresses_leave_none_and_are_not_fatal() {
        let probe = FakeProbe {
            addresses: Err(std::io::ErrorKind::PermissionDenied),
            ..FakeProbe::default()
        };
        let (host, _) = probed(&probe, ProxyMode::Iptables, Task::Run);
        assert!(host.local_addresses().is_empty());
        assert!(host.node_addresses().is_empty());
    }

    #[test]
    fn ipvs_mode_falls_back_to_iptables_where_ipvs_does_not_work() {
        let (host, _) = probed(&FakeProbe::default(), ProxyMode::Ipvs, Task::Run);
        assert!(!host.has_ipvs());
        assert_eq!(host.mode_to_run(ProxyMode::Ipvs), ProxyMode::Iptables);
        assert_eq!(host.mode_to_run(ProxyMode::Nftables), ProxyMode::Nftables);
        let probe = FakeProbe {
            ipvs: Ok(()),
            ..FakeProbe::default()
        };
        let (host, _) = probed(&probe, ProxyMode::Ipvs, Task::Run);
        assert!(host.has_ipvs());
        assert_eq!(host.mode_to_run(ProxyMode::Ipvs), ProxyMode::Ipvs);
    }
}
