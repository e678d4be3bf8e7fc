//! The few iptables rules ipvs mode needs besides IPVS itself: masquerading (marked by
//! ipset matches), NodePort and load-balancer handling, source-range firewalling, and the
//! filter that blocks arbitrary ports on kube-ipvs0's addresses (upstream's layout). They do
//! not depend on the services (the ipsets carry those), so they change only with the
//! configuration.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use kp_core::model::IpFamily;
use kp_ipvs::{Protocol, ServiceKey};

use super::IpvsConfig;
use super::ipset::SetKind;
use crate::iptables::comment::comment_args;
use crate::iptables::{Detector, JumpRule, RenderError, Setup, Table};

/// nat: service dispatch (marks for masquerade, accepts service traffic).
pub const KUBE_SERVICES: &str = "KUBE-SERVICES";
/// nat: masquerade marked traffic and hairpin connections.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";
/// nat: NodePorts; filter: health-check node ports.
pub const KUBE_NODE_PORT: &str = "KUBE-NODE-PORT";
/// nat: load-balancer IPs (masquerade unless externalTrafficPolicy Local).
pub const KUBE_LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
/// nat: sets the masquerade mark.
pub const KUBE_MARK_MASQ: &str = "KUBE-MARK-MASQ";
/// filter: accepts forwarded service traffic.
pub const KUBE_FORWARD: &str = "KUBE-FORWARD";
/// filter: sends load-balancer traffic with source ranges to the range check.
pub const KUBE_PROXY_FIREWALL: &str = "KUBE-PROXY-FIREWALL";
/// filter: allows listed source ranges, drops the rest.
pub const KUBE_SOURCE_RANGES_FIREWALL: &str = "KUBE-SOURCE-RANGES-FIREWALL";
/// filter: rejects new connections to kube-ipvs0 addresses on ports no service uses.
pub const KUBE_IPVS_FILTER: &str = "KUBE-IPVS-FILTER";
/// filter: applies source ranges to the node's own connections to load balancers.
pub const KUBE_IPVS_OUT_FILTER: &str = "KUBE-IPVS-OUT-FILTER";

const NAT_CHAINS: [&str; 5] = [
    KUBE_SERVICES,
    KUBE_POSTROUTING,
    KUBE_NODE_PORT,
    KUBE_LOAD_BALANCER,
    KUBE_MARK_MASQ,
];
const FILTER_CHAINS: [&str; 6] = [
    KUBE_FORWARD,
    KUBE_NODE_PORT,
    KUBE_PROXY_FIREWALL,
    KUBE_SOURCE_RANGES_FIREWALL,
    KUBE_IPVS_FILTER,
    KUBE_IPVS_OUT_FILTER,
];

struct Text<'a> {
    out: String,
    family: IpFamily,
    config: &'a IpvsConfig,
}

impl Text<'_> {
    /// `-A CHAIN [comment] ARGS`, with `{SET}` placeholders resolved by [`Text::set`].
    fn rule(&mut self, chain: &str, comment: Option<&str>, args: &str) {
        let _ = write!(self.out, "-A {chain} ");
        if let Some(c) = comment {
            self.out.push_str(&comment_args(c));
            self.out.push(' ');
        }
        self.out.push_str(args);
        self.out.push('\n');
    }

    /// `-m set --match-set NAME FLAGS` for this family.
    fn set(&self, kind: SetKind, flags: &str) -> String {
        format!("-m set --match-set {} {flags}", kind.name(self.family))
    }
}

/// The `iptables-restore --noflush` input for `family` (tables filter and nat). Declaring
/// each chain flushes it, so applying the text replaces kube-proxy's chains whole.
/// `no_node_access`: load-balancer virtual servers whose source ranges do not admit the node
/// ([`super::Desired::lb_no_node_access`]).
pub fn render(
    family: IpFamily,
    config: &IpvsConfig,
    no_node_access: &BTreeSet<ServiceKey>,
) -> Result<String, RenderError> {
    let mark = 1u32
        .checked_shl(u32::from(config.masquerade_bit))
        .filter(|_| config.masquerade_bit <= crate::iptables::MAX_MASQUERADE_BIT)
        .ok_or(RenderError::MasqueradeBit(config.masquerade_bit))?;
    let detector = Detector::new(&config.local_detector, family)?;
    let mut t = Text {
        out: String::new(),
        family,
        config,
    };

    t.out.push_str("*filter\n");
    for chain in FILTER_CHAINS {
        let _ = writeln!(t.out, ":{chain} - [0:0]");
    }
    t.forward(mark);
    t.firewall(no_node_access);
    t.ipvs_filter();
    t.out.push_str("COMMIT\n*nat\n");
    for chain in NAT_CHAINS {
        let _ = writeln!(t.out, ":{chain} - [0:0]");
    }
    t.masquerading(mark);
    t.services(detector.as_ref());
    t.node_ports();
    let cluster = t.set(SetKind::ClusterIp, "dst,dst");
    t.rule(KUBE_SERVICES, None, &format!("{cluster} -j ACCEPT"));
    let lb = t.set(SetKind::LoadBalancer, "dst,dst");
    t.rule(KUBE_SERVICES, None, &format!("{lb} -j ACCEPT"));
    t.out.push_str("COMMIT\n");
    Ok(t.out)
}

impl Text<'_> {
    /// filter `KUBE-FORWARD` (marked and established service traffic is accepted) and
    /// `KUBE-NODE-PORT` (health-check node ports are).
    fn forward(&mut self, mark: u32) {
        if self.config.drop_invalid {
            self.rule(KUBE_FORWARD, None, "-m conntrack --ctstate INVALID -j DROP");
        }
        self.rule(
            KUBE_FORWARD,
            Some("kubernetes forwarding rules"),
            &format!("-m mark --mark {mark:#x}/{mark:#x} -j ACCEPT"),
        );
        self.rule(
            KUBE_FORWARD,
            Some("kubernetes forwarding conntrack rule"),
            "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        );
        let hc = self.set(SetKind::HealthCheckNodePort, "dst");
        self.rule(
            KUBE_NODE_PORT,
            Some("Kubernetes health check node port"),
            &format!("{hc} -j ACCEPT"),
        );
    }

    /// The source-range firewall: load balancers with ranges go through
    /// `KUBE-SOURCE-RANGES-FIREWALL`, and the node's own connections to those that do not
    /// admit it are dropped in `KUBE-IPVS-OUT-FILTER`.
    fn firewall(&mut self, no_node_access: &BTreeSet<ServiceKey>) {
        let fw = self.set(SetKind::LoadBalancerFw, "dst,dst");
        self.rule(
            KUBE_PROXY_FIREWALL,
            Some("Kubernetes service load balancer ip + port for load balancer with sourceRange"),
            &format!("{fw} -j {KUBE_SOURCE_RANGES_FIREWALL}"),
        );
        // The node's own connections to a local LB IP leave with the LB IP as source and are
        // already rewritten by IPVS (its LOCAL_OUT hook runs before the filter table), so only
        // the ipvs match still sees the virtual server they went to.
        let family = self.family;
        for key in no_node_access
            .iter()
            .filter(|k| IpFamily::of(&k.address) == family)
        {
            let proto = match key.protocol {
                Protocol::Tcp => "tcp",
                Protocol::Udp => "udp",
                Protocol::Sctp => "sctp",
            };
            let (ip, port) = (key.address, key.port);
            self.rule(
                KUBE_IPVS_OUT_FILTER,
                None,
                &format!("-s {ip} -m ipvs --vaddr {ip} --vproto {proto} --vport {port} -j DROP"),
            );
        }
        for kind in [
            SetKind::LoadBalancerSourceCidr,
            SetKind::LoadBalancerSourceIp,
        ] {
            let allowed = self.set(kind, "dst,dst,src");
            self.rule(
                KUBE_SOURCE_RANGES_FIREWALL,
                None,
                &format!("{allowed} -j RETURN"),
            );
        }
        self.rule(KUBE_SOURCE_RANGES_FIREWALL, None, "-j DROP");
    }

    /// `KUBE-IPVS-FILTER`: new connections to kube-ipvs0's addresses on ports no service
    /// uses are rejected.
    fn ipvs_filter(&mut self) {
        for (kind, flags) in [
            (SetKind::LoadBalancer, "dst,dst"),
            (SetKind::ClusterIp, "dst,dst"),
            (SetKind::ExternalIp, "dst,dst"),
            (SetKind::ExternalIpLocal, "dst,dst"),
            (SetKind::HealthCheckNodePort, "dst"),
        ] {
            let m = self.set(kind, flags);
            self.rule(KUBE_IPVS_FILTER, None, &format!("{m} -j RETURN"));
        }
        let ips = self.set(SetKind::IpvsIps, "dst");
        self.rule(
            KUBE_IPVS_FILTER,
            Some("kubernetes: no service uses this port of a service address"),
            &format!("-m conntrack --ctstate NEW {ips} -j REJECT"),
        );
    }

    /// nat `KUBE-POSTROUTING` (hairpin connections and marked packets are masqueraded) and
    /// `KUBE-MARK-MASQ`.
    fn masquerading(&mut self, mark: u32) {
        let loopback = self.set(SetKind::LoopBack, "dst,dst,src");
        self.rule(
            KUBE_POSTROUTING,
            Some("Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose"),
            &format!("{loopback} -j MASQUERADE"),
        );
        self.rule(
            KUBE_POSTROUTING,
            None,
            &format!("-m mark ! --mark {mark:#x}/{mark:#x} -j RETURN"),
        );
        self.rule(
            KUBE_POSTROUTING,
            None,
            &format!("-j MARK --xor-mark {mark:#x}"),
        );
        let random = if self.config.random_fully {
            " --random-fully"
        } else {
            ""
        };
        self.rule(
            KUBE_POSTROUTING,
            Some("kubernetes service traffic requiring SNAT"),
            &format!("-j MASQUERADE{random}"),
        );
        self.rule(
            KUBE_MARK_MASQ,
            None,
            &format!("-j MARK --or-mark {mark:#x}"),
        );
    }

    /// nat `KUBE-SERVICES`' marking rules (ClusterIPs by the masquerade settings, external
    /// IPs unless their policy is Local, load balancers through `KUBE-LOAD-BALANCER`) and
    /// its jump to the NodePorts.
    fn services(&mut self, detector: Option<&Detector>) {
        let cluster = self.set(SetKind::ClusterIp, "dst,dst");
        let masq_comment = Some("Kubernetes service cluster ip + port for masquerade purpose");
        if self.config.masquerade_all {
            self.rule(
                KUBE_SERVICES,
                masq_comment,
                &format!("{cluster} -j {KUBE_MARK_MASQ}"),
            );
        } else if let Some(detector) = detector {
            let not_local = detector.if_not_local().to_owned();
            self.rule(
                KUBE_SERVICES,
                masq_comment,
                &format!("{cluster} {not_local} -j {KUBE_MARK_MASQ}"),
            );
        }
        for (kind, comment, target) in [
            (
                SetKind::ExternalIpLocal,
                "Kubernetes service external ip + port with externalTrafficPolicy=local",
                "RETURN",
            ),
            (
                SetKind::ExternalIp,
                "Kubernetes service external ip + port for masquerade and filter purpose",
                KUBE_MARK_MASQ,
            ),
            (
                SetKind::LoadBalancer,
                "Kubernetes service lb portal",
                KUBE_LOAD_BALANCER,
            ),
        ] {
            let m = self.set(kind, "dst,dst");
            self.rule(KUBE_SERVICES, Some(comment), &format!("{m} -j {target}"));
        }
        let lb_local = self.set(SetKind::LoadBalancerLocal, "dst,dst");
        self.rule(KUBE_LOAD_BALANCER, None, &format!("{lb_local} -j RETURN"));
        self.rule(KUBE_LOAD_BALANCER, None, &format!("-j {KUBE_MARK_MASQ}"));
        self.rule(
            KUBE_SERVICES,
            None,
            &format!("-m addrtype --dst-type LOCAL -j {KUBE_NODE_PORT}"),
        );
    }

    /// nat `KUBE-NODE-PORT`: NodePorts are marked for masquerade unless their policy is
    /// Local.
    fn node_ports(&mut self) {
        for (proto, local, all, flags) in [
            (
                "tcp",
                SetKind::NodePortLocalTcp,
                SetKind::NodePortTcp,
                "dst",
            ),
            (
                "udp",
                SetKind::NodePortLocalUdp,
                SetKind::NodePortUdp,
                "dst",
            ),
            (
                "sctp",
                SetKind::NodePortLocalSctp,
                SetKind::NodePortSctp,
                "dst,dst",
            ),
        ] {
            let local = self.set(local, flags);
            let all = self.set(all, flags);
            self.rule(
                KUBE_NODE_PORT,
                None,
                &format!("-p {proto} {local} -j RETURN"),
            );
            self.rule(
                KUBE_NODE_PORT,
                None,
                &format!("-p {proto} {all} -j {KUBE_MARK_MASQ}"),
            );
        }
    }
}

/// `text` (from [`render`]) with `-I <from> 1 <spec>` for each of `jumps` at the end of its
/// table's section, so that one restore creates the chains, fills them and links them in
/// (one tool run instead of one per chain and jump). Inserted in the given order, each at the
/// top of its built-in chain, they end up where inserting them one by one puts them.
pub fn with_jumps(text: &str, jumps: &[&JumpRule]) -> String {
    if jumps.is_empty() {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len() + jumps.len() * 96);
    let mut table = None;
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('*') {
            table = Some(name);
        } else if line == "COMMIT" {
            for jump in jumps.iter().filter(|j| Some(j.table.as_str()) == table) {
                let _ = writeln!(out, "-I {} 1 {}", jump.from, jump.spec);
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// A rule of [`render`]'s text (after `-A CHAIN `) as `iptables-save` prints it back, so a full
/// sync can tell from one save whether its chains still hold exactly what it would write:
/// address, interface and protocol matches come first, `-j REJECT` gains its default
/// `--reject-with`, `--or-mark M` and `--xor-mark M` read back as `--set-xmark M/M` and
/// `--set-xmark M/0x0`. (A rule this misses only costs a restore.)
pub fn saved_form(family: IpFamily, rule: &str) -> String {
    let rule = core_matches_first(rule);
    if let Some(start) = rule.strip_suffix("-j REJECT") {
        let icmp = match family {
            IpFamily::V4 => "icmp-port-unreachable",
            IpFamily::V6 => "icmp6-port-unreachable",
        };
        return format!("{start}-j REJECT --reject-with {icmp}");
    }
    for (flag, mask) in [("--or-mark ", None), ("--xor-mark ", Some("0x0"))] {
        if let Some((start, mark)) = rule.split_once(flag)
            && !mark.contains(' ')
        {
            let mask = mask.unwrap_or(mark);
            return format!("{start}--set-xmark {mark}/{mask}");
        }
    }
    rule
}

/// `rule` with its `[!] -s/-d/-i/-o/-p VALUE` matches moved to the front, in that order, as
/// iptables prints them.
fn core_matches_first(rule: &str) -> String {
    const CORE: [&str; 5] = ["-s", "-d", "-i", "-o", "-p"];
    let words: Vec<&str> = rule.split(' ').collect();
    let mut core: Vec<(usize, String)> = Vec::new();
    let mut rest: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let negated = words[i] == "!";
        let flag = if negated {
            words.get(i + 1)
        } else {
            words.get(i)
        };
        let rank = flag.and_then(|f| CORE.iter().position(|c| c == f));
        let width = usize::from(negated) + 2;
        match (rank, words.get(i + width - 1)) {
            (Some(rank), Some(_)) => {
                core.push((rank, words[i..i + width].join(" ")));
                i += width;
            }
            _ => {
                rest.push(words[i]);
                i += 1;
            }
        }
    }
    core.sort_by_key(|(rank, _)| *rank);
    core.into_iter()
        .map(|(_, m)| m)
        .chain(rest.into_iter().map(str::to_owned))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The chains and the jumps into them from the built-in chains, ensured once per full sync.
pub fn setup() -> Setup {
    let jump = |table: Table, from: &'static str, to: &'static str, comment: &str| JumpRule {
        table,
        from,
        to,
        spec: format!("{} -j {to}", comment_args(comment)),
        rule: None,
    };
    let jumps = vec![
        jump(
            Table::Nat,
            "OUTPUT",
            KUBE_SERVICES,
            "kubernetes service portals",
        ),
        jump(
            Table::Nat,
            "PREROUTING",
            KUBE_SERVICES,
            "kubernetes service portals",
        ),
        jump(
            Table::Nat,
            "POSTROUTING",
            KUBE_POSTROUTING,
            "kubernetes postrouting rules",
        ),
        jump(
            Table::Filter,
            "FORWARD",
            KUBE_FORWARD,
            "kubernetes forwarding rules",
        ),
        jump(
            Table::Filter,
            "INPUT",
            KUBE_NODE_PORT,
            "kubernetes health check rules",
        ),
        jump(
            Table::Filter,
            "INPUT",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        jump(
            Table::Filter,
            "FORWARD",
            KUBE_PROXY_FIREWALL,
            "kube-proxy firewall rules",
        ),
        jump(
            Table::Filter,
            "INPUT",
            KUBE_IPVS_FILTER,
            "kubernetes ipvs access filter",
        ),
        jump(
            Table::Filter,
            "OUTPUT",
            KUBE_IPVS_OUT_FILTER,
            "kubernetes ipvs access filter",
        ),
    ];
    let mut chains: Vec<(Table, &'static str)> = Vec::new();
    for table in [Table::Nat, Table::Filter] {
        let names: &[&'static str] = if table == Table::Nat {
            &NAT_CHAINS
        } else {
            &FILTER_CHAINS
        };
        chains.extend(names.iter().map(|c| (table, *c)));
    }
    Setup {
        chains,
        jumps,
        shared: Vec::new(),
    }
}
