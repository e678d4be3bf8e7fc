//! Noticing other programs changing the proxy's rules on nf_tables (nftables mode, and
//! iptables mode on the nf_tables backend): [`Classifier`] (sans I/O) reads the notifications
//! of one transaction and decides, when its `NEWGEN` arrives, whether it changed what the
//! proxy owns and whose it was; [`spawn`] runs it on a thread over a [`Monitor`]. A read
//! error ends the thread with [`ForeignEvent::WatchLost`], on which the proxier starts its
//! canary checks.
//!
//! A transaction is the proxy's own when it came over one of the proxy's netlink sockets
//! (its port id), when its committing thread is one of this process's, or its process a
//! child of this one (`iptables` run for the setup). While the proxier is
//! writing (or just stopped) a change of unknown origin is only [`ForeignEvent::Suspect`]:
//! the proxier then runs the backend's canary check, between syncs, which cannot mistake its
//! own writes. Deleted rules of built-in chains (where our jumps live, among others') are
//! suspects too: the check looks for our jumps.
//!
//! The nftables verdict-free layout takes the monitor out of its group while it loads a large
//! table itself (`kp_nftnl::monitor::quiet`) and finds others' commits in that time from the
//! nf_tables generation instead (`crate::nftables::layout`).

use kp_core::report::ErrorChain as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kp_core::foreign::{Activity, ForeignChange, ForeignEvent};
use kp_nftnl::monitor::{Message, Monitor, Object, Received};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::iptables::{KUBE_MARK_MASQ, is_own_chain};

/// A change read this long after the proxier's last write may still be that write's.
/// (Transactions over the proxy's own netlink sockets are known by their port id; this only
/// covers the tools it runs, whose process may be gone by the time the change is read.)
pub const OWN_WRITE_GRACE: Duration = Duration::from_millis(200);
/// How long one read waits, so the thread notices it should stop.
const POLL: Duration = Duration::from_millis(200);

/// What the proxy owns on nf_tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owned {
    /// nftables mode: the `kube-proxy` tables of `ip` and `ip6`.
    NftablesTable,
    /// iptables-nft: the `KUBE-` chains (but kubelet's) of `nat`, `filter` and `mangle`,
    /// and our jumps in their built-in chains.
    IptablesChains,
}

/// Who committed a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// This process or a child of it.
    Ours,
    /// Unknown, while the proxier was writing.
    Unsure,
    /// Another program.
    Foreign,
}

/// The notifications of the transaction being read.
#[derive(Debug)]
pub struct Classifier {
    owned: Owned,
    first: Option<ForeignChange>,
    more: usize,
    builtin: bool,
}

impl Classifier {
    /// A classifier for what `owned` describes.
    pub fn new(owned: Owned) -> Self {
        Self {
            owned,
            first: None,
            more: 0,
            builtin: false,
        }
    }

    /// Reads one notification; at the end of a transaction, `origin` says whose it was and
    /// the result says what the proxier must hear of it.
    pub fn observe(
        &mut self,
        message: &Message,
        origin: impl FnOnce(Option<u32>) -> Origin,
    ) -> Option<ForeignEvent> {
        match message {
            Message::Object {
                object,
                deleted,
                family,
                table,
                name,
            } => {
                self.object(*object, *deleted, *family, table, name.as_deref());
                None
            }
            Message::Generation { portid, pid, .. } => {
                let origin = if kp_nftnl::socket::is_own_portid(*portid) {
                    Origin::Ours
                } else {
                    origin(*pid)
                };
                self.end(origin)
            }
        }
    }

    fn object(
        &mut self,
        object: Object,
        deleted: bool,
        family: u8,
        table: &str,
        name: Option<&str>,
    ) {
        let Some(family) = family_name(family) else {
            return;
        };
        let owned = match self.owned {
            Owned::NftablesTable => table == kp_rules::nftables::TABLE,
            Owned::IptablesChains => {
                if !matches!(table, "nat" | "filter" | "mangle") {
                    return;
                }
                match (object, name) {
                    (Object::Table, _) => deleted,
                    (Object::Chain | Object::Rule, Some(chain)) if is_ours(chain) => {
                        deleted || object == Object::Rule
                    }
                    (Object::Rule, Some(chain)) if is_builtin(chain) && deleted => {
                        self.builtin = true;
                        false
                    }
                    _ => false,
                }
            }
        };
        if !owned {
            return;
        }
        if self.first.is_some() {
            self.more += 1;
            return;
        }
        let verb = if deleted { "deleted" } else { "added" };
        let detail = match name {
            Some(name) if object == Object::Rule => {
                format!("rule {verb} in chain {name} of table {family} {table}")
            }
            Some(name) if object == Object::Element => {
                format!("element {verb} in {name} of table {family} {table}")
            }
            Some(name) => format!(
                "{} {name} {verb} in table {family} {table}",
                object.as_str()
            ),
            None => format!("table {family} {table} {verb}"),
        };
        self.first = Some(if deleted {
            ForeignChange::removed(object.as_str(), detail)
        } else {
            ForeignChange::changed(object.as_str(), detail)
        });
    }

    fn end(&mut self, origin: Origin) -> Option<ForeignEvent> {
        let first = self.first.take();
        let more = std::mem::take(&mut self.more);
        let builtin = std::mem::take(&mut self.builtin);
        if first.is_none() && !builtin {
            return None;
        }
        match (origin, first) {
            (Origin::Ours, _) => None,
            (Origin::Foreign, Some(mut change)) => {
                if more > 0 {
                    change
                        .detail
                        .push_str(&format!(" (and {more} more changes)"));
                }
                Some(ForeignEvent::Changed(change))
            }
            (Origin::Unsure, _) | (Origin::Foreign, None) => Some(ForeignEvent::Suspect),
        }
    }
}

fn family_name(family: u8) -> Option<&'static str> {
    match family {
        2 => Some("ip"),
        10 => Some("ip6"),
        _ => None,
    }
}

/// The chains cleanup would call ours, and `KUBE-MARK-MASQ`, which iptables mode writes too:
/// another component's `KUBE-` chains (the kubelet's, kube-router's) are not watched.
fn is_ours(chain: &str) -> bool {
    chain == KUBE_MARK_MASQ || is_own_chain(chain)
}

fn is_builtin(chain: &str) -> bool {
    matches!(
        chain,
        "PREROUTING" | "INPUT" | "FORWARD" | "OUTPUT" | "POSTROUTING"
    )
}

/// Whose a transaction committed by thread `pid` was, `activity` saying whether the proxier
/// was writing. Reads `/proc`.
pub fn origin(pid: Option<u32>, activity: &Activity) -> Origin {
    if let Some(pid) = pid
        && (std::path::Path::new(&format!("/proc/self/task/{pid}")).exists()
            || parent_of(pid) == Some(std::process::id()))
    {
        return Origin::Ours;
    }
    if activity.writing_within(OWN_WRITE_GRACE) {
        Origin::Unsure
    } else {
        Origin::Foreign
    }
}

/// The parent of process `pid` (`/proc/PID/stat`'s fourth field), if it still runs.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: parse after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Watches nf_tables for changes to what `owned` describes on a thread of its own until
/// `stop` is set, reporting to the proxier through `events`.
pub fn spawn(
    owned: Owned,
    activity: Activity,
    events: mpsc::Sender<ForeignEvent>,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let mut monitor = Monitor::open(POLL)?;
    #[cfg(feature = "test-util")]
    let fails_at = fault::fails_at();
    std::thread::Builder::new()
        .name("kp-nft-watch".into())
        .spawn(move || {
            let mut classifier = Classifier::new(owned);
            while !stop.load(Ordering::Relaxed) {
                let received = monitor.recv();
                #[cfg(feature = "test-util")]
                let received = fault::inject(received, fails_at);
                let messages = match received {
                    Ok(Received::Messages(messages)) => messages,
                    Ok(Received::Timeout) => continue,
                    Ok(Received::Overrun) => {
                        debug!("nf_tables notifications were dropped; checking the rules");
                        classifier = Classifier::new(owned);
                        let _ = events.try_send(ForeignEvent::Suspect);
                        continue;
                    }
                    Err(error) => {
                        warn!(error = %error.chain(), "reading nf_tables notifications failed; the watch stops");
                        let reason = format!("reading nf_tables notifications: {}", error.chain());
                        // The proxier must hear it even behind other reports.
                        let _ = events.blocking_send(ForeignEvent::WatchLost(reason));
                        return;
                    }
                };
                for message in &messages {
                    if let Some(event) = classifier.observe(message, |pid| origin(pid, &activity)) {
                        // A full queue already holds a report; one is enough.
                        let _ = events.try_send(event);
                    }
                }
            }
        })
}

/// The test build's fault hook: with the `test-util` feature (the test suites'), setting
/// [`fault::FAIL_AFTER_ENV`] to a number of milliseconds makes the watch fail as on a read
/// error that long after it started. The product binary is built without the feature.
#[cfg(feature = "test-util")]
pub mod fault {
    use std::time::{Duration, Instant};

    use kp_nftnl::monitor::Received;

    /// Milliseconds after which the watch fails.
    pub const FAIL_AFTER_ENV: &str = "KP_TEST_WATCH_FAILS_AFTER_MS";

    /// When the watch is to fail, if the variable asks.
    pub(super) fn fails_at() -> Option<Instant> {
        let millis: u64 = std::env::var(FAIL_AFTER_ENV).ok()?.parse().ok()?;
        Some(Instant::now() + Duration::from_millis(millis))
    }

    /// `received`, or an injected read error once `fails_at` has passed.
    pub(super) fn inject(
        received: std::io::Result<Received>,
        fails_at: Option<Instant>,
    ) -> std::io::Result<Received> {
        match fails_at {
            Some(at) if Instant::now() >= at => Err(std::io::Error::other(format!(
                "injected by {FAIL_AFTER_ENV}"
            ))),
            _ => received,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(object: Object, deleted: bool, table: &str, name: Option<&str>) -> Message {
        Message::Object {
            object,
            deleted,
            family: 2,
            table: table.into(),
            name: name.map(Into::into),
        }
    }

    const GEN: Message = Message::Generation {
        portid: 0,
        pid: Some(1),
        process: None,
    };

    fn run(owned: Owned, messages: &[Message], origin: Origin) -> Vec<ForeignEvent> {
        let mut classifier = Classifier::new(owned);
        messages
            .iter()
            .filter_map(|m| classifier.observe(m, |_| origin))
            .collect()
    }

    #[test]
    fn a_foreign_flush_of_our_chain_is_one_change_naming_the_first_rule() {
        let flush = [
            object(Object::Rule, true, "nat", Some("KUBE-SERVICES")),
            object(Object::Rule, true, "nat", Some("KUBE-SERVICES")),
            object(Object::Rule, true, "nat", Some("PREROUTING")),
            GEN,
        ];
        let events = run(Owned::IptablesChains, &flush, Origin::Foreign);
        let expected = ForeignChange::removed(
            "rule",
            "rule deleted in chain KUBE-SERVICES of table ip nat (and 1 more changes)",
        );
        assert_eq!(events, vec![ForeignEvent::Changed(expected)]);
        assert_eq!(run(Owned::IptablesChains, &flush, Origin::Ours), vec![]);
        assert_eq!(
            run(Owned::IptablesChains, &flush, Origin::Unsure),
            vec![ForeignEvent::Suspect]
        );
    }

    #[test]
    fn kubelet_and_other_programs_chains_are_not_ours() {
        let theirs = [
            object(Object::Chain, true, "filter", Some("KUBE-FIREWALL")),
            object(Object::Rule, true, "filter", Some("KUBE-KUBELET-CANARY")),
            object(Object::Chain, true, "filter", Some("CNI-FORWARD")),
            object(Object::Rule, true, "raw", Some("KUBE-SERVICES")),
            object(Object::Chain, false, "nat", Some("KUBE-SVC-NEW")),
            GEN,
        ];
        assert_eq!(run(Owned::IptablesChains, &theirs, Origin::Foreign), vec![]);
    }

    #[test]
    fn a_deleted_rule_of_a_built_in_chain_is_checked_not_assumed() {
        let jump = [object(Object::Rule, true, "nat", Some("PREROUTING")), GEN];
        assert_eq!(
            run(Owned::IptablesChains, &jump, Origin::Foreign),
            vec![ForeignEvent::Suspect]
        );
        let added = [object(Object::Rule, false, "nat", Some("PREROUTING")), GEN];
        assert_eq!(run(Owned::IptablesChains, &added, Origin::Foreign), vec![]);
    }

    #[test]
    fn anything_in_the_kube_proxy_table_is_ours_in_nftables_mode() {
        let flush = [
            object(Object::Table, true, "kube-proxy", None),
            object(Object::Table, true, "firewalld", None),
            GEN,
        ];
        let events = run(Owned::NftablesTable, &flush, Origin::Foreign);
        let change = ForeignChange::removed("table", "table ip kube-proxy deleted");
        assert_eq!(events, vec![ForeignEvent::Changed(change)]);
        let element = [
            object(Object::Element, true, "kube-proxy", Some("service-ips")),
            GEN,
        ];
        let events = run(Owned::NftablesTable, &element, Origin::Foreign);
        let change = ForeignChange::removed(
            "element",
            "element deleted in service-ips of table ip kube-proxy",
        );
        assert_eq!(events, vec![ForeignEvent::Changed(change)]);
        let added = [
            object(Object::Rule, false, "kube-proxy", Some("services")),
            GEN,
        ];
        let events = run(Owned::NftablesTable, &added, Origin::Foreign);
        let change = ForeignChange::changed(
            "rule",
            "rule added in chain services of table ip kube-proxy",
        );
        assert_eq!(events, vec![ForeignEvent::Changed(change)]);
        let other = [object(Object::Table, true, "filter", None), GEN];
        assert_eq!(run(Owned::NftablesTable, &other, Origin::Foreign), vec![]);
    }

    #[test]
    fn this_thread_is_ours_and_a_stranger_is_foreign_unless_the_proxier_writes() {
        let activity = Activity::default();
        let me = rustix::thread::gettid()
            .as_raw_nonzero()
            .get()
            .unsigned_abs();
        assert_eq!(origin(Some(me), &activity), Origin::Ours);
        // pid 1 is nobody's child here and no thread of ours.
        std::thread::sleep(OWN_WRITE_GRACE);
        assert_eq!(origin(Some(1), &activity), Origin::Foreign);
        activity.begin();
        assert_eq!(origin(Some(1), &activity), Origin::Unsure);
    }
}
