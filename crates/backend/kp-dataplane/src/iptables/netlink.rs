//! iptables mode over nf_tables netlink: [`NetlinkRestore`] writes what one
//! `iptables-nft-restore --noflush` of the render would write, as one nf_tables transaction
//! sent by us (with [`kp_nftnl`]), rule by rule encoded as iptables-nft 1.8.9 encodes it
//! ([`kp_nftnl::xt`], the mapping from typed rules in `encode`). Two departures, both
//! invisible to `iptables-save`: partial syncs edit the top-level chains by rule handle
//! (`handles`), and a first sync too large to hold cheaply sends its service chains ahead
//! in steps ([`DEFAULT_MAX_STEP_MESSAGES`]), so its rule handles are numbered differently.
//!
//! Why: iptables-nft-restore's userspace grows quadratically with the number of chains
//! (it never finished a first sync of 10,000 services × 10 endpoints here), while the
//! kernel takes the same transaction in seconds. The result is the same kernel state:
//! `iptables-save`, `iptables -L`, kubelet and CNI plugins see the rules
//! `iptables-restore` would have made (the equivalence tests in
//! `tests/iptables_netlink_kernel.rs` compare both namespaces' `iptables-nft-save`, `nft
//! --debug=netlink list ruleset` and raw netlink dumps).
//!
//! Only where it is known to hold: the iptables backend is nf_tables and `iptables
//! --version` is one whose encoding we checked ([`VERIFIED_VERSIONS`]); [`NETLINK_ENV`]
//! turns it off. A render holding something `encode` does not know is applied with
//! `iptables-restore` instead (counted by the caller), and so is a transaction the kernel
//! refuses, so the restore path's error handling (isolating a broken service) still
//! applies.

pub(crate) mod encode;
pub(crate) mod handles;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use kp_core::backend::SyncKind;
use kp_core::model::IpFamily;
use kp_core::tracker::ProxyState;
use kp_nftnl::abi::{NFTA_CHAIN_NAME, NFTA_CHAIN_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_TABLE};
use kp_nftnl::codec::{Family, MsgKind};
use kp_nftnl::{ApplyError, SharedSocket};
use kp_rules::iptables::names::is_service_chain;
use kp_rules::iptables::{RenderConfig, RenderError, RenderOutput, SyncScope, render_into};

use crate::blocking::blocking;

pub use encode::{NetlinkSink, Plan, Prepared, Step, Unsupported};
pub use handles::Installed;

/// Turns the netlink path off (`off`) or leaves the choice to the proxy (`auto`, the
/// default): with `off`, iptables mode always runs `iptables-restore`.
pub const NETLINK_ENV: &str = "KUBE_PROXY_RS_IPTABLES_NETLINK";

/// The `iptables --version` lines whose encoding the equivalence tests checked byte for
/// byte. Other versions encode some rules differently (1.8.7 keeps ports in `-m tcp`,
/// later ones move comments into rule user data), so their nodes keep `iptables-restore`.
pub const VERIFIED_VERSIONS: [&str; 1] = ["iptables v1.8.9 (nf_tables)"];

/// A first sync into a kernel without service chains sends its service chains ahead in
/// transactions of at least this many messages each (cut at the end of a service;
/// [`NetlinkSink::splitting`]): about 7 MB of netlink messages, against ~190 MB for the
/// whole first sync of 10k services × 10 endpoints (~540k messages), which was otherwise held
/// at once (twice while joining its parts). Smaller steps hold less memory but cost more
/// commits, each cheap: nothing reaches the service chains before the last, so a step's
/// commit has little to validate (measured at 10k×10: 50k-message steps peaked at 163 MiB).
pub const DEFAULT_MAX_STEP_MESSAGES: usize = 20_000;

/// Why the netlink path did not apply a render.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The render holds a rule the encoder does not know; nothing was sent.
    #[error("not encodable over netlink")]
    Unsupported(#[from] Unsupported),
    /// Rendering failed (a configuration `validate` should have refused).
    #[error(transparent)]
    Render(#[from] RenderError),
    /// The kernel refused the transaction (nothing was applied), or the socket failed.
    #[error(transparent)]
    Apply(#[from] ApplyError),
}

/// Whether the netlink path may be used, from [`NETLINK_ENV`] and the `iptables --version`
/// line of the tools in use; `Err` says why not (logged once at start-up).
pub fn usable(env: Option<&str>, version: &str) -> Result<(), String> {
    match env.map(str::trim) {
        None | Some("") | Some("auto") => {}
        Some("off") => return Err(format!("{NETLINK_ENV}=off")),
        Some(other) => {
            return Err(format!(
                "{NETLINK_ENV}={other:?} is neither `auto` nor `off`; using iptables-restore"
            ));
        }
    }
    if VERIFIED_VERSIONS.contains(&version.trim()) {
        Ok(())
    } else {
        Err(format!(
            "`{}` is not a version whose nf_tables encoding was verified ({})",
            version.trim(),
            VERIFIED_VERSIONS.join(", ")
        ))
    }
}

/// The netlink path for this process's iptables `tools`, when [`usable`]: never for the
/// legacy backend; otherwise decided by [`NETLINK_ENV`] and `version`, the tools' `iptables
/// --version` line (probed once at start-up by the caller; empty when it could not be run).
/// Logs the decision once (start-up).
pub fn for_host(tools: &crate::exec::Tools, version: &str) -> Option<NetlinkRestore> {
    if tools.variant == crate::exec::IptablesVariant::Legacy {
        tracing::info!(
            reason = "the legacy backend",
            "iptables rules go through iptables-restore"
        );
        return None;
    }
    let version = version.trim();
    if crate::exec::backend_of_version(version) != crate::exec::IptablesVariant::Nft {
        return None;
    }
    let env = std::env::var(NETLINK_ENV).ok();
    match usable(env.as_deref(), version) {
        Ok(()) => {
            tracing::info!(%version, "iptables rules go over nf_tables netlink, encoded as iptables-nft does");
            Some(NetlinkRestore::new())
        }
        Err(reason) => {
            tracing::info!(%reason, "iptables rules go through iptables-restore");
            None
        }
    }
}

/// The nf_tables family of an IP family.
pub(crate) fn family(family: IpFamily) -> Family {
    match family {
        IpFamily::V4 => Family::Ipv4,
        IpFamily::V6 => Family::Ipv6,
    }
}

/// Writes renders over netlink. Clones share the socket, which is opened on first use in
/// the network namespace of the thread using it.
#[derive(Clone, Debug)]
pub struct NetlinkRestore {
    socket: SharedSocket,
    /// Per family, what the top-level chains hold after the last successful apply (for
    /// partial syncs by rule handle); absent after a failure or before the first apply.
    installed: Arc<Mutex<HashMap<IpFamily, Installed>>>,
    /// Messages per step of a split first sync ([`DEFAULT_MAX_STEP_MESSAGES`]).
    max_step_messages: usize,
}

impl Default for NetlinkRestore {
    fn default() -> Self {
        Self {
            socket: SharedSocket::default(),
            installed: Arc::default(),
            max_step_messages: DEFAULT_MAX_STEP_MESSAGES,
        }
    }
}

impl NetlinkRestore {
    /// A writer that opens its socket on first use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Split first syncs into steps of at least `messages` messages (tests use small ones).
    pub fn with_max_step_messages(mut self, messages: usize) -> Self {
        self.max_step_messages = messages.max(1);
        self
    }

    /// The per-service nat chains (`KUBE-SVC/SVL/EXT/FW/SEP-*`) of `family`'s nat table,
    /// listed with one chain dump instead of `iptables-save -t nat` (which formats every
    /// rule of the table).
    pub async fn service_chains(&self, ip: IpFamily) -> Result<BTreeSet<String>, NetlinkError> {
        let socket = self.socket.clone();
        let messages = blocking(move || {
            socket.with(|s| {
                s.dump(MsgKind::GetChain, family(ip), |w| {
                    w.put_str(NFTA_CHAIN_TABLE, "nat");
                })
            })
        })?;
        Ok(messages
            .iter()
            .filter_map(|message| chain_name(message))
            .filter(|name| is_service_chain(name))
            .collect())
    }

    /// Render `state` for `family` straight into one transaction and send it: on a full
    /// sync what `iptables-restore --noflush` of [`kp_rules::iptables::render`]'s text would
    /// do, message for message; on a partial sync the same, except that the top-level chains
    /// (`KUBE-SERVICES`, ...) are edited by rule handle (`handles`) when their handles are
    /// known. The returned bookkeeping has no `text`. On error nothing was applied, except
    /// that a first sync into a kernel without service chains goes out in steps
    /// ([`DEFAULT_MAX_STEP_MESSAGES`]), and those before the failed one stay applied: chains
    /// and rules of complete services, which the caller's `iptables-restore` then rewrites.
    pub async fn apply(
        &self,
        family: IpFamily,
        state: &ProxyState,
        config: &RenderConfig,
        scope: &SyncScope<'_>,
    ) -> Result<RenderOutput, NetlinkError> {
        // Taken out: after any failure the next sync writes the chains whole.
        let previous = self
            .installed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&family);
        let previous = previous.filter(|_| scope.kind == SyncKind::Partial);
        // Split only where no service chain is in place (a step flushes the chains it
        // declares, and nothing reaches them before the last transaction), and only syncs of
        // at least two steps: smaller ones stay one transaction, message for message the
        // restore's.
        let max_step = self.max_step_messages;
        let split = scope.kind == SyncKind::Full
            && previous.is_none()
            && estimated_messages(state, family) >= 2 * max_step
            && !scope.existing_chains.iter().any(|c| is_service_chain(c));
        let nf = self::family(family);
        let socket = self.socket.clone();
        // Rendering runs with the socket at hand, so split steps go out as they fill.
        // Socket errors go back to `with` (which then drops the socket); the others are
        // carried in `Ok`.
        let (output, installed) = blocking(|| {
            socket.with(|s| {
                let mut sink = NetlinkSink::new(family, previous);
                if split {
                    sink = sink.splitting(max_step, Box::new(|batch| s.apply_batch(batch)));
                }
                let output = match render_into(state, family, config, scope, &mut sink) {
                    Ok(output) => output,
                    Err(error) => return Ok(Err(NetlinkError::Render(error))),
                };
                // The socket numbers its own requests; the batch's are only echoed back.
                let Prepared { batch, plan } = match sink.finish(1) {
                    Ok(prepared) => prepared,
                    Err(NetlinkError::Apply(error)) => return Err(error),
                    Err(error) => return Ok(Err(error)),
                };
                let echoes = s.apply_batch_echoed(batch)?;
                let mut dumped = Vec::new();
                for (table, chain) in plan.learn() {
                    let rules = s.dump(MsgKind::GetRule, nf, |w| {
                        w.put_str(NFTA_RULE_TABLE, table.as_str());
                        w.put_str(NFTA_RULE_CHAIN, chain);
                    })?;
                    dumped.push(
                        rules
                            .iter()
                            .filter_map(|rule| kp_nftnl::xt::rule_handle(rule))
                            .collect::<Vec<u64>>(),
                    );
                }
                Ok(Ok((output, plan.complete(&echoes, &dumped))))
            })
        })??;
        match installed {
            Some(installed) => {
                self.installed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(family, installed);
            }
            None => tracing::warn!(
                ?family,
                "cannot tell the rule handles of the top-level chains; the next sync rewrites them"
            ),
        }
        Ok(output)
    }
}

/// Roughly how many messages a full sync of `state` for `family` sends: a few per endpoint
/// (its chain's creation and flush, a rule in it, one in its service's chain) and per
/// service port (its chains and dispatch rules).
fn estimated_messages(state: &ProxyState, family: IpFamily) -> usize {
    let endpoints: usize = state
        .endpoints
        .values()
        .map(|list| {
            list.iter()
                .filter(|ep| IpFamily::of(&ep.ip) == family)
                .count()
        })
        .sum();
    4 * (endpoints + state.services.len())
}

/// The name of the chain a `NFT_MSG_NEWCHAIN` dump message describes.
fn chain_name(message: &[u8]) -> Option<String> {
    let attrs = message.get(4..)?;
    kp_nftnl::codec::attributes(attrs)
        .find(|(ty, _)| *ty == NFTA_CHAIN_NAME)
        .and_then(|(_, value)| {
            let name = value.strip_suffix(&[0]).unwrap_or(value);
            String::from_utf8(name.to_vec()).ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_verified_versions_and_not_when_turned_off() {
        assert!(usable(None, "iptables v1.8.9 (nf_tables)\n").is_ok());
        assert!(usable(Some("auto"), "iptables v1.8.9 (nf_tables)").is_ok());
        assert!(usable(Some("off"), "iptables v1.8.9 (nf_tables)").is_err());
        assert!(usable(Some("yes"), "iptables v1.8.9 (nf_tables)").is_err());
        assert!(usable(None, "iptables v1.8.9 (legacy)").is_err());
        assert!(usable(None, "iptables v1.8.7 (nf_tables)").is_err());
    }

    #[test]
    fn chain_names_from_dump_messages() {
        let mut message = vec![2, 0, 0, 1];
        for (ty, value) in [(1u16, &b"nat\0"[..]), (3, b"KUBE-SEP-ABC\0")] {
            let len = 4 + value.len() as u16;
            message.extend_from_slice(&len.to_ne_bytes());
            message.extend_from_slice(&ty.to_ne_bytes());
            message.extend_from_slice(value);
            while message.len() % 4 != 0 {
                message.push(0);
            }
        }
        assert_eq!(chain_name(&message).as_deref(), Some("KUBE-SEP-ABC"));
        assert_eq!(chain_name(&message[..4]), None);
    }
}
