//! What the proxy tells the operator once at start-up about the mode it runs, as upstream
//! does: a log line and, with an API server, an Event on this node's Node
//! ([`kp_sources::events`]).
//!
//! - ipvs mode is deprecated (upstream 1.35, kubernetes#134539): an error-level log line and a
//!   `Warning` Event with reason `IPVSDeprecation`. Upstream 1.37 adds the `KubeProxyIPVS`
//!   gate (default true, planned false in 1.40) that refuses the mode at validation.
//! - No mode was chosen (upstream 1.37, kubernetes#139957): the Linux default is still
//!   iptables but is planned to become nftables (KEP-5343), so a warning and a `Warning`
//!   Event ask for the mode to be set.

use kp_config::{KubeProxyConfiguration, ProxyMode};
use kp_sources::events::{ACTION_START, EventType, NodeEvent, NodeEvents};

/// The reason of the Event about ipvs mode's deprecation (upstream's).
pub const IPVS_DEPRECATION: &str = "IPVSDeprecation";

/// The reason of the Event about a defaulted mode (this project's name for it).
pub const PROXY_MODE_DEFAULTED: &str = "ProxyModeDefaulted";

/// The notices for a proxy that runs `running` with `config`.
pub fn start_notices(config: &KubeProxyConfiguration, running: ProxyMode) -> Vec<NodeEvent> {
    let mut notices = Vec::new();
    if running == ProxyMode::Ipvs {
        notices.push(NodeEvent {
            kind: EventType::Warning,
            reason: IPVS_DEPRECATION,
            action: ACTION_START,
            note: "ipvs mode is deprecated: upstream plans to turn it off by default \
                   (KubeProxyIPVS=false) in 1.40 and to remove it later; move to nftables mode"
                .to_owned(),
        });
    }
    if config.mode_defaulted && running == ProxyMode::Iptables {
        notices.push(NodeEvent {
            kind: EventType::Warning,
            reason: PROXY_MODE_DEFAULTED,
            action: ACTION_START,
            note: "no proxy mode was set (--proxy-mode or mode:), so iptables mode runs; \
                   upstream's default on Linux is planned to become nftables (from 1.40): \
                   set the mode explicitly to keep iptables"
                .to_owned(),
        });
    }
    notices
}

/// Logs each notice and, when `events` is given (an API server source), posts it as an
/// Event in the background.
pub fn announce(notices: &[NodeEvent], events: Option<&NodeEvents>) {
    for notice in notices {
        match notice.reason {
            IPVS_DEPRECATION => tracing::error!(reason = notice.reason, "{}", notice.note),
            _ => tracing::warn!(reason = notice.reason, "{}", notice.note),
        }
        if let Some(events) = events {
            events.spawn(notice.clone());
        }
    }
}

/// The host name, for the events' reporting instance (upstream's `os.Hostname`).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> KubeProxyConfiguration {
        use clap::Parser as _;
        let options = kp_config::Options::try_parse_from(
            std::iter::once("kube-proxy").chain(args.iter().copied()),
        )
        .expect("flags");
        options.load().expect("config").config
    }

    fn reasons(config: &KubeProxyConfiguration, running: ProxyMode) -> Vec<&'static str> {
        start_notices(config, running)
            .iter()
            .map(|n| n.reason)
            .collect()
    }

    #[test]
    fn ipvs_mode_is_announced_as_deprecated() {
        let c = config(&["--proxy-mode=ipvs"]);
        assert_eq!(reasons(&c, ProxyMode::Ipvs), [IPVS_DEPRECATION]);
        let notice = &start_notices(&c, ProxyMode::Ipvs)[0];
        assert_eq!(notice.kind, EventType::Warning);
        assert_eq!(notice.action, "StartKubeProxy");
        assert!(notice.note.contains("nftables"), "{}", notice.note);
    }

    #[test]
    fn a_defaulted_mode_is_announced_and_a_chosen_one_is_not() {
        let defaulted = config(&[]);
        assert_eq!(
            reasons(&defaulted, ProxyMode::Iptables),
            [PROXY_MODE_DEFAULTED]
        );
        for chosen in ["iptables", "nftables"] {
            let c = config(&[&format!("--proxy-mode={chosen}")]);
            assert!(reasons(&c, c.mode).is_empty(), "{chosen}");
        }
        assert!(reasons(&config(&["--proxy-mode=nftables"]), ProxyMode::Nftables).is_empty());
    }
}
