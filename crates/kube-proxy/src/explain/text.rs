//! The human-readable tree `kube-proxy explain` prints by default.

use std::fmt::Write as _;

use kp_core::topology::TopologyMode;
use kp_rules::explain::verify::VerifyReport;
use kp_rules::explain::{
    EndpointExplanation, EndpointList, Explanation, MasqueradeDecision, ServiceMatch,
    TrafficPolicy, endpoint_address,
};

/// The whole answer as text, ending in a newline; `verified` is `--verify`'s report with the
/// save tool it read.
pub fn render(e: &Explanation, verified: Option<(&str, &VerifyReport)>) -> String {
    let mut out = String::new();
    let mut head = String::new();
    let _ = write!(head, "{} ({})", e.destination, e.family.api_name());
    match &e.source {
        Some(s) => {
            let mut what = Vec::new();
            match s.local_traffic {
                Some(true) => what.push("pod traffic"),
                Some(false) => what.push("not pod traffic"),
                None => {}
            }
            if s.node_address {
                what.push("this node");
            }
            let _ = write!(head, " from {}", s.ip);
            if !what.is_empty() {
                let _ = write!(head, " ({})", what.join(", "));
            }
        }
        None => head.push_str(", source not given"),
    }
    let _ = write!(head, ": {}", e.summary);
    line(&mut out, &head);
    for miss in &e.near_misses {
        line(
            &mut out,
            &format!(
                "  note: {} listens here as {} on {}/{}, not this port/protocol",
                miss.service_port,
                miss.how.describe(),
                miss.port,
                miss.protocol.api_name()
            ),
        );
    }
    for m in &e.matches {
        out.push('\n');
        service_match(&mut out, m);
    }
    for port in &e.localhost_node_ports {
        line(&mut out, &format!("  localhost: {}", port.describe()));
        if let kp_rules::explain::localhost::LocalhostVerdict::Listener { endpoints } =
            &port.verdict
        {
            for ep in endpoints {
                line(&mut out, &format!("    endpoint {ep}"));
            }
        }
    }
    if let Some((tool, report)) = verified {
        out.push('\n');
        let _ = writeln!(
            out,
            "verify against {tool}: {} chains compared, {} differences",
            report.checked.len(),
            report.differences.len()
        );
        for d in &report.differences {
            line(&mut out, &format!("  - {d}"));
        }
    }
    out
}

fn policy(p: TrafficPolicy) -> &'static str {
    match p {
        TrafficPolicy::Cluster => "Cluster",
        TrafficPolicy::Local => "Local",
    }
}

fn service_match(out: &mut String, m: &ServiceMatch) {
    let ip = match m.ip {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };
    line(
        out,
        &format!(
            "{}: {} {ip}:{}/{}",
            m.service_port,
            m.how.describe(),
            m.port,
            m.name.protocol.api_name()
        ),
    );
    let mut lines: Vec<(String, Vec<String>)> = Vec::new();
    lines.push((format!("verdict: {}", m.outcome_reason), Vec::new()));
    let mut policies = format!(
        "policy: internalTrafficPolicy {}",
        policy(m.internal_traffic_policy)
    );
    if let Some(etp) = m.external_traffic_policy {
        let _ = write!(policies, ", externalTrafficPolicy {}", policy(etp));
    }
    let list = match m.endpoint_list {
        EndpointList::Cluster => "Cluster",
        EndpointList::Local => "Local",
    };
    let topology = match m.topology_mode {
        TopologyMode::None => String::new(),
        other => format!(", topology {other:?}"),
    };
    lines.push((
        policies,
        vec![format!(
            "{list} endpoint list{topology}: {}",
            m.endpoint_list_reason
        )],
    ));
    let decision = match m.masquerade.decision {
        MasqueradeDecision::Yes => "yes",
        MasqueradeDecision::No => "no",
        MasqueradeDecision::Depends => "depends",
        MasqueradeDecision::NotApplicable => "n/a",
    };
    lines.push((
        format!(
            "masquerade: {decision} ({:?}): {}",
            m.masquerade.reason, m.masquerade.detail
        ),
        Vec::new(),
    ));
    lines.push((
        match m.session_affinity {
            Some(a) => format!("session affinity: ClientIP, {}s", a.timeout_seconds),
            None => "session affinity: none".to_owned(),
        },
        Vec::new(),
    ));
    if !m.load_balancer_source_ranges.is_empty() {
        let ranges: Vec<String> = m
            .load_balancer_source_ranges
            .iter()
            .map(ToString::to_string)
            .collect();
        lines.push((
            format!("loadBalancerSourceRanges: {}", ranges.join(", ")),
            Vec::new(),
        ));
    }
    if let Some(path) = &m.socket_lb {
        let endpoints = path.endpoints.iter().map(ToString::to_string);
        lines.push((
            format!(
                "socket load balancer: {}",
                if path.translated {
                    "translates the node's own sockets' connections"
                } else {
                    "not used (nftables mode's rules serve every connection)"
                }
            ),
            std::iter::once(path.reason.clone())
                .chain(endpoints)
                .collect(),
        ));
    }
    // Another mode's objects replace iptables mode's chains (and endpoint chain names).
    match &m.dataplane {
        Some(dataplane) => lines.push((
            format!("{} objects:", dataplane.mode),
            dataplane
                .objects
                .iter()
                .map(|o| format!("{} {}: {}", o.kind, o.name, o.detail))
                .collect(),
        )),
        None => lines.push((
            "chains:".to_owned(),
            m.hops
                .iter()
                .map(|h| format!("{} {}: {}", h.table, h.chain, h.action))
                .collect(),
        )),
    }
    let iptables = m.dataplane.is_none();
    lines.push((
        format!("endpoints ({}):", m.endpoints.len()),
        m.endpoints.iter().map(|e| endpoint(e, iptables)).collect(),
    ));
    for note in &m.notes {
        lines.push((format!("note: {note}"), Vec::new()));
    }
    tree(out, &lines);
}

fn endpoint(e: &EndpointExplanation, iptables: bool) -> String {
    let node = match &e.node_name {
        Some(n) if e.local => format!("{n} (local)"),
        Some(n) => n.clone(),
        None => "no node".to_owned(),
    };
    let mut line = format!(
        "{:<8} {:<22} {:<16} {}",
        if e.used { "[used]" } else { "[unused]" },
        endpoint_address(e),
        node,
        e.reason
    );
    if e.used
        && iptables
        && let Some(chain) = &e.chain
    {
        let _ = write!(line, " -> {chain}");
    }
    if e.hairpin {
        line.push_str(" (this is the source: hairpin, masqueraded if picked)");
    }
    line
}

/// Two-level tree with box-drawing branches.
fn tree(out: &mut String, items: &[(String, Vec<String>)]) {
    for (i, (head, children)) in items.iter().enumerate() {
        let last = i + 1 == items.len();
        line(out, &format!("{}{head}", if last { "└─ " } else { "├─ " }));
        for (j, child) in children.iter().enumerate() {
            let child_last = j + 1 == children.len();
            line(
                out,
                &format!(
                    "{}{}{child}",
                    if last { "   " } else { "│  " },
                    if child_last { "└─ " } else { "├─ " }
                ),
            );
        }
    }
}

/// One line of the answer. Names come from objects: a newline or carriage return in one
/// would forge lines of the answer, so control characters are shown escaped (`\n`).
fn line(out: &mut String, text: &str) {
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_never_start_a_line_of_their_own() {
        let mut out = String::new();
        line(
            &mut out,
            "ns\n-A KUBE-SERVICES -j ACCEPT/web: node-1\r\nCOMMIT",
        );
        assert_eq!(
            out,
            "ns\\n-A KUBE-SERVICES -j ACCEPT/web: node-1\\r\\nCOMMIT\n"
        );
    }
}
