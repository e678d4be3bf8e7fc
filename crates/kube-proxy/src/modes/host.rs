//! What the modes need to know about this node, probed once at start-up into a [`Host`] that
//! every mode's builder, `--init-only`, `--cleanup` and `explain` read: which IP families the
//! kernel has, the interfaces' addresses (`ip -o addr show`), the iptables backend (legacy or
//! nf_tables, chosen before any iptables tool runs), `iptables --version` for iptables mode's
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
use kp_dataplane::xtables::Choice;
use kp_ipvs::{Ipvs as _, NetlinkIpvs, Protocol, Scheduler, ServiceKey, VirtualServer};
use kp_rules::ipvs::DUMMY_DEVICE;

/// Why ipvs mode cannot run on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

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
    /// Chooses the iptables backend for the whole process (and records it in the exec
    /// layer, so every iptables tool run afterwards is that backend's).
    fn iptables_backend(&self) -> impl Future<Output = anyhow::Result<Choice>>;
    /// The IP families the kernel has.
    fn families(&self) -> Vec<IpFamily>;
    /// `ip -o addr show`'s output, or why it could not be read.
    fn addresses(&self) -> Result<String, String>;
    /// The chosen `iptables --version`'s output, or why it could not be run (called after
    /// [`Probe::iptables_backend`]).
    fn iptables_version(&self) -> Result<String, String>;
    /// `nft --version`'s output, or why it could not be run.
    fn nft_version(&self) -> Result<String, String>;
    /// Whether IPVS works here with `scheduler`.
    fn ipvs(&self, scheduler: Scheduler) -> Result<(), Unavailable>;
}

/// One address of one interface, from `ip -o addr show`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceAddress {
    /// The interface's name.
    pub device: String,
    /// The address.
    pub ip: IpAddr,
}

/// This node as the modes see it, probed once ([`Host::probe`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Host {
    /// The iptables backend chosen, when any iptables tool may run.
    pub iptables_backend: Option<Choice>,
    /// The IP families the kernel has.
    pub families: Vec<IpFamily>,
    /// Every interface address (empty when they could not be listed: NodePorts then answer
    /// nowhere rather than everywhere).
    pub addresses: Vec<InterfaceAddress>,
    /// The chosen `iptables --version`'s output (trimmed) or why it failed, when iptables
    /// mode may run.
    pub iptables_version: Option<Result<String, String>>,
    /// `nft --version`'s output or why it failed, when nftables mode asked.
    pub nft_version: Option<Result<String, String>>,
    /// Whether IPVS works, when it was probed.
    pub ipvs: Option<Result<(), Unavailable>>,
}

impl Host {
    /// Runs the probes `wants` names, the iptables backend's first (before any other tool
    /// runs). Only the backend choice can fail; a missing fact is recorded as such.
    pub async fn probe(probe: &impl Probe, wants: &Wants) -> anyhow::Result<Self> {
        let iptables_backend = if wants.iptables_backend {
            Some(probe.iptables_backend().await?)
        } else {
            None
        };
        let addresses = if wants.addresses {
            match probe.addresses() {
                Ok(text) => parse_addresses(&text),
                Err(why) => {
                    tracing::warn!(error = %why, "cannot list this node's addresses; NodePorts answer nowhere");
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        Ok(Self {
            iptables_backend,
            families: probe.families(),
            addresses,
            iptables_version: wants.iptables_version.then(|| probe.iptables_version()),
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

/// `2: eth0    inet 192.168.1.2/24 brd ... scope global eth0` lines, one address each.
fn parse_addresses(text: &str) -> Vec<InterfaceAddress> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let device = words.nth(1)?.to_owned();
            words.find(|w| *w == "inet" || *w == "inet6")?;
            let ip = words.next()?.split('/').next()?.parse().ok()?;
            Some(InterfaceAddress { device, ip })
        })
        .collect()
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

    fn addresses(&self) -> Result<String, String> {
        match std::process::Command::new("ip")
            .args(["-o", "addr", "show"])
            .output()
        {
            Ok(out) if out.status.success() => Ok(String::from_utf8_lossy(&out.stdout).into()),
            Ok(out) => Err(format!(
                "`ip -o addr show` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(error) => Err(format!("cannot run `ip -o addr show`: {error}")),
        }
    }

    fn iptables_version(&self) -> Result<String, String> {
        let iptables = kp_dataplane::exec::Tools::host().iptables;
        let output = std::process::Command::new(&iptables)
            .arg("--version")
            .output()
            .map_err(|e| format!("cannot run `{} --version`: {e}", iptables.display()))?;
        if !output.status.success() {
            return Err(format!(
                "`{} --version` failed: {}",
                iptables.display(),
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    fn nft_version(&self) -> Result<String, String> {
        let output = std::process::Command::new(kp_dataplane::nftables::DEFAULT_NFT_BINARY)
            .arg("--version")
            .output()
            .map_err(|e| format!("nftables mode needs `nft` (package nftables): {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "`nft --version` failed: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
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
                    "the IPVS scheduler {scheduler} does not work here: {e}"
                ))
            })?;
        ipvs.delete_service(&key)
            .map_err(|e| Unavailable(format!("cannot remove the IPVS probe: {e}")))?;
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

    /// Answers from fixed facts and records which probes ran.
    pub(crate) struct FakeProbe {
        pub addresses: Result<String, String>,
        pub iptables_version: Result<String, String>,
        pub nft_version: Result<String, String>,
        pub ipvs: Result<(), Unavailable>,
        pub families: Vec<IpFamily>,
        pub calls: RefCell<Vec<&'static str>>,
    }

    impl Default for FakeProbe {
        fn default() -> Self {
            Self {
                addresses: Ok(ADDR_SHOW.to_owned()),
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

        fn addresses(&self) -> Result<String, String> {
            self.calls.borrow_mut().push("addresses");
            self.addresses.clone()
        }

        fn iptables_version(&self) -> Result<String, String> {
            self.calls.borrow_mut().push("iptables_version");
            self.iptables_version.clone()
        }

        fn nft_version(&self) -> Result<String, String> {
            self.calls.borrow_mut().push("nft_version");
            self.nft_version.clone()
        }

        fn ipvs(&self, _scheduler: Scheduler) -> Result<(), Unavailable> {
            self.calls.borrow_mut().push("ipvs");
            self.ipvs.clone()
        }
    }

    /// A node's `ip -o addr show`: loopback, a NIC with IPv4, global and link-local IPv6,
    /// and kube-ipvs0 holding a ClusterIP.
    pub(crate) const ADDR_SHOW: &str = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n\
        2: eth0    inet 192.168.49.2/24 brd 192.168.49.255 scope global eth0\n\
        2: eth0    inet6 fe80::1/64 scope link \\       valid_lft forever\n\
        2: eth0    inet6 2001:db8::2/64 scope global\n\
        5: kube-ipvs0    inet 10.96.0.1/32 scope global kube-ipvs0\n";

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
            addresses: Err("cannot run `ip -o addr show`".into()),
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
