//! Which iptables backend this node uses (legacy xtables or nf_tables), decided in-process the
//! way upstream's kube-proxy image decides it with its `iptables-wrapper`
//! (kubernetes-sigs/iptables-wrappers).
//!
//! The two backends keep separate rule sets in the kernel. A rule written with one is invisible
//! to the other's tools, and "insert before the node's firewall" only holds within one: writing
//! nf_tables rules on a node whose kubelet, CNI plugin and firewall use legacy splits the
//! node's firewall in two. So the proxy uses the backend the node already uses, and every tool
//! it runs afterwards (iptables mode, userspace capture, ipvs mode's rules, cleanup,
//! `explain --verify`) is that backend's: the binary passes the chosen variant's
//! [`crate::exec::Tools`] to each of them.
//!
//! # The rules, in order
//!
//! 1. The operator's choice (the caller passes it to [`choose`]: a flag, the [`BACKEND_ENV`]
//!    variable or the configuration file, in that precedence; `auto` means "detect").
//! 2. kubelet (1.17 and later) creates `KUBE-IPTABLES-HINT` and `KUBE-KUBELET-CANARY` in the
//!    mangle table of the backend it uses. Look in nf_tables first (`iptables-nft-save -t
//!    mangle`, then `ip6tables-nft-save -t mangle`), then in legacy (`iptables-legacy-save`,
//!    then `ip6tables-legacy-save`, every table: asking the legacy kernel for one table by name
//!    creates it, which detection must not do). A save that fails counts as empty.
//! 3. Without kubelet's chains: the backend holding more rules (lines starting with `-` in
//!    both families' full saves); legacy only when it holds strictly more, otherwise nf_tables
//!    (also when both are empty).
//!
//! Steps 2 and 3 and their order are the wrapper's (its v2 shell script; the v3 Go rewrite,
//! `internal/iptables/detect.go`, keeps step 2 and its order but drops step 3, taking
//! nf_tables whenever no kubelet chain is found). We keep the count: a node without kubelet's
//! chains whose firewall or CNI plugin is in legacy would otherwise get a second, nf_tables
//! firewall. When only one backend's tools are installed (the wrapper refuses to install
//! then), that one is used; with neither (iptables before 1.8 has no `-legacy`/`-nft` tools,
//! and only the legacy backend), plain `iptables`.

use std::fmt;

use kp_core::model::IpFamily;
use kp_rules::iptables::Table;

use crate::exec::{ExecError, IptablesVariant, Tools, run_program};

/// The environment variable that overrides the backend (`auto`, `legacy` or `nft`); a
/// command-line flag wins over it, and it wins over the configuration file.
pub const BACKEND_ENV: &str = "KUBE_PROXY_RS_IPTABLES_BACKEND";

/// The chains kubelet creates in the mangle table of the backend it uses (upstream kubelet's
/// `KUBE-IPTABLES-HINT` exists for exactly this question; its canary since 1.17 too).
pub const KUBELET_HINT_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// Why a backend was chosen (logged once at start-up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The operator chose it; the value names where (`--iptables-backend`, the variable, the
    /// configuration field).
    Configured(String),
    /// kubelet's hint chains are in this backend: the save that showed them.
    KubeletChains(String),
    /// No kubelet chains; rule counts (lines starting with `-`, both families).
    MoreRules {
        /// Rules in the legacy backend.
        legacy: usize,
        /// Rules in the nf_tables backend.
        nft: usize,
    },
    /// Only this backend's tools are installed.
    OnlyInstalled,
    /// Neither `iptables-legacy-save` nor `iptables-nft-save` can run: plain `iptables`.
    NoVariantTools,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Configured(source) => write!(f, "set by {source}"),
            Reason::KubeletChains(save) => {
                write!(
                    f,
                    "kubelet's KUBE-IPTABLES-HINT/KUBE-KUBELET-CANARY chains are in `{save}`"
                )
            }
            Reason::MoreRules { legacy, nft } => write!(
                f,
                "no kubelet chains in either backend; legacy holds {legacy} rules, nf_tables {nft} \
                 (legacy only when it holds more)"
            ),
            Reason::OnlyInstalled => write!(f, "only this backend's tools are installed"),
            Reason::NoVariantTools => write!(
                f,
                "no iptables-legacy/iptables-nft tools; using `iptables` as installed"
            ),
        }
    }
}

/// The backend to use and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// Which tools to run.
    pub variant: IptablesVariant,
    /// Why.
    pub reason: Reason,
}

/// The short name of a variant for logs: `legacy`, `nf_tables`, or `system` (whatever
/// `iptables` is).
pub fn variant_name(variant: IptablesVariant) -> &'static str {
    match variant {
        IptablesVariant::Legacy => "legacy",
        IptablesVariant::Nft => "nf_tables",
        IptablesVariant::System => "system",
    }
}

/// Runs the save tools for detection; the real one execs them, tests fake it.
pub trait SaveProbe: Sync {
    /// `<variant>-save` of `family`, one table or (`None`) all of them.
    fn save(
        &self,
        variant: IptablesVariant,
        family: IpFamily,
        table: Option<Table>,
    ) -> impl Future<Output = Result<String, ExecError>> + Send;
}

/// Runs `iptables-legacy-save`, `ip6tables-nft-save`, ... from the `PATH`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExecProbe;

impl SaveProbe for ExecProbe {
    async fn save(
        &self,
        variant: IptablesVariant,
        family: IpFamily,
        table: Option<Table>,
    ) -> Result<String, ExecError> {
        let args: Vec<String> = match table {
            Some(table) => vec!["-t".to_owned(), table.as_str().to_owned()],
            None => Vec::new(),
        };
        run_program(Tools::new(variant).save(family), &args, None).await
    }
}

/// The operator's choice if any (where it was set, and the backend), else [`detect`].
pub async fn choose(
    configured: Option<(String, IptablesVariant)>,
    probe: &impl SaveProbe,
) -> Choice {
    match configured {
        Some((source, variant)) => Choice {
            variant,
            reason: Reason::Configured(source),
        },
        None => detect(probe).await,
    }
}

/// Detection: the rules in the module docs, steps 2 and 3.
pub async fn detect(probe: &impl SaveProbe) -> Choice {
    let families = [IpFamily::V4, IpFamily::V6];
    let save_name = |variant, family| Tools::new(variant).save(family).display().to_string();
    // Step 2, nf_tables: only the mangle table.
    let mut nft_installed = false;
    for family in families {
        let saved = probe
            .save(IptablesVariant::Nft, family, Some(Table::Mangle))
            .await;
        nft_installed |= installed(&saved);
        if has_kubelet_chains(&text(&saved)) {
            return Choice {
                variant: IptablesVariant::Nft,
                reason: Reason::KubeletChains(format!(
                    "{} -t mangle",
                    save_name(IptablesVariant::Nft, family)
                )),
            };
        }
    }
    // Step 2, legacy: every table (see the module docs); kept for the count.
    let mut legacy_rules = 0;
    let mut legacy_installed = false;
    for family in families {
        let saved = probe.save(IptablesVariant::Legacy, family, None).await;
        legacy_installed |= installed(&saved);
        let dump = text(&saved);
        if has_kubelet_chains(&dump) {
            return Choice {
                variant: IptablesVariant::Legacy,
                reason: Reason::KubeletChains(save_name(IptablesVariant::Legacy, family)),
            };
        }
        legacy_rules += count_rules(&dump);
    }
    match (legacy_installed, nft_installed) {
        (false, false) => {
            return Choice {
                variant: IptablesVariant::System,
                reason: Reason::NoVariantTools,
            };
        }
        (true, false) => {
            return Choice {
                variant: IptablesVariant::Legacy,
                reason: Reason::OnlyInstalled,
            };
        }
        (false, true) => {
            return Choice {
                variant: IptablesVariant::Nft,
                reason: Reason::OnlyInstalled,
            };
        }
        (true, true) => {}
    }
    // Step 3.
    let mut nft_rules = 0;
    for family in families {
        let saved = probe.save(IptablesVariant::Nft, family, None).await;
        nft_rules += count_rules(&text(&saved));
    }
    let reason = Reason::MoreRules {
        legacy: legacy_rules,
        nft: nft_rules,
    };
    let variant = if legacy_rules > nft_rules {
        IptablesVariant::Legacy
    } else {
        IptablesVariant::Nft
    };
    Choice { variant, reason }
}

/// Whether the tool could be started at all (a failing save still means it is installed).
fn installed(saved: &Result<String, ExecError>) -> bool {
    !matches!(saved, Err(ExecError::Spawn { .. }))
}

/// A save's output; a failed save counts as empty, as in the wrapper.
fn text(saved: &Result<String, ExecError>) -> String {
    saved.as_ref().map_or_else(|_| String::new(), Clone::clone)
}

/// Whether a save declares one of [`KUBELET_HINT_CHAINS`] (`:CHAIN POLICY [p:b]` lines).
pub fn has_kubelet_chains(dump: &str) -> bool {
    dump.lines().any(|line| {
        line.strip_prefix(':')
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|chain| KUBELET_HINT_CHAINS.contains(&chain))
    })
}

/// The rules of a save: its lines starting with `-`, as the wrapper counts them.
pub fn count_rules(dump: &str) -> usize {
    dump.lines().filter(|line| line.starts_with('-')).count()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use super::*;

    /// Save outputs by (variant, family, table); a missing variant is "not installed".
    #[derive(Default)]
    struct FakeProbe {
        saves: BTreeMap<(String, String, String), String>,
        installed: Vec<IptablesVariant>,
    }

    fn key(
        variant: IptablesVariant,
        family: IpFamily,
        table: Option<Table>,
    ) -> (String, String, String) {
        (
            format!("{variant:?}"),
            format!("{family:?}"),
            table.map_or("all", Table::as_str).to_owned(),
        )
    }

    impl FakeProbe {
        fn with(variants: &[IptablesVariant]) -> Self {
            Self {
                installed: variants.to_vec(),
                ..Self::default()
            }
        }

        fn set(
            mut self,
            variant: IptablesVariant,
            family: IpFamily,
            table: Option<Table>,
            dump: &str,
        ) -> Self {
            self.saves
                .insert(key(variant, family, table), dump.to_owned());
            self
        }
    }

    impl SaveProbe for FakeProbe {
        async fn save(
            &self,
            variant: IptablesVariant,
            family: IpFamily,
            table: Option<Table>,
        ) -> Result<String, ExecError> {
            if !self.installed.contains(&variant) {
                return Err(ExecError::Spawn {
                    program: "fake".to_owned(),
                    source: std::io::Error::from(std::io::ErrorKind::NotFound),
                });
            }
            Ok(self
                .saves
                .get(&key(variant, family, table))
                .cloned()
                .unwrap_or_default())
        }
    }

    /// The choice step 3 makes from these counts.
    fn by_count(variant: IptablesVariant, legacy: usize, nft: usize) -> Choice {
        Choice {
            variant,
            reason: Reason::MoreRules { legacy, nft },
        }
    }

    fn run(probe: &FakeProbe) -> Choice {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        runtime.block_on(detect(probe))
    }

    const BOTH: [IptablesVariant; 2] = [IptablesVariant::Legacy, IptablesVariant::Nft];
    const HINT: &str = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
    const CANARY: &str = "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
    const RULES: &str =
        "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\n-A INPUT -j DROP\nCOMMIT\n";
    const ONE_RULE: &str = "*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n";

    #[test]
    fn kubelet_chains_in_nf_tables_win_first() {
        // kubelet's chains in both: nf_tables is asked first, as the wrapper does.
        let probe = FakeProbe::with(&BOTH)
            .set(
                IptablesVariant::Nft,
                IpFamily::V4,
                Some(Table::Mangle),
                HINT,
            )
            .set(IptablesVariant::Legacy, IpFamily::V4, None, CANARY);
        let choice = run(&probe);
        assert_eq!(choice.variant, IptablesVariant::Nft);
        assert_eq!(
            choice.reason,
            Reason::KubeletChains("iptables-nft-save -t mangle".to_owned())
        );
        // Only IPv6 has them (an IPv6-only kubelet).
        let probe = FakeProbe::with(&BOTH)
            .set(
                IptablesVariant::Nft,
                IpFamily::V6,
                Some(Table::Mangle),
                CANARY,
            )
            .set(IptablesVariant::Legacy, IpFamily::V4, None, RULES);
        assert_eq!(run(&probe).variant, IptablesVariant::Nft);
    }

    #[test]
    fn kubelet_chains_in_legacy_beat_more_nf_tables_rules() {
        let probe = FakeProbe::with(&BOTH)
            .set(IptablesVariant::Nft, IpFamily::V4, None, RULES)
            .set(IptablesVariant::Legacy, IpFamily::V6, None, HINT);
        let choice = run(&probe);
        assert_eq!(choice.variant, IptablesVariant::Legacy);
        assert_eq!(
            choice.reason,
            Reason::KubeletChains("ip6tables-legacy-save".to_owned())
        );
    }

    #[test]
    fn only_nf_tables_mangle_is_asked_for_the_hint() {
        // A hint chain outside mangle in nf_tables is not seen by the mangle save; the full
        // save's count decides (1 rule in legacy against none).
        let probe = FakeProbe::with(&BOTH)
            .set(IptablesVariant::Nft, IpFamily::V4, None, HINT)
            .set(IptablesVariant::Legacy, IpFamily::V4, None, ONE_RULE);
        assert_eq!(run(&probe), by_count(IptablesVariant::Legacy, 1, 0));
    }

    #[test]
    fn without_kubelet_chains_more_rules_decide_and_ties_go_to_nf_tables() {
        let probe = FakeProbe::with(&BOTH)
            .set(IptablesVariant::Legacy, IpFamily::V4, None, RULES)
            .set(IptablesVariant::Nft, IpFamily::V6, None, ONE_RULE);
        assert_eq!(run(&probe), by_count(IptablesVariant::Legacy, 2, 1));
        // Both families count.
        let probe = FakeProbe::with(&BOTH)
            .set(IptablesVariant::Legacy, IpFamily::V4, None, RULES)
            .set(IptablesVariant::Nft, IpFamily::V4, None, ONE_RULE)
            .set(IptablesVariant::Nft, IpFamily::V6, None, ONE_RULE);
        assert_eq!(run(&probe).variant, IptablesVariant::Nft);
        // Nothing anywhere: nf_tables.
        assert_eq!(
            run(&FakeProbe::with(&BOTH)),
            by_count(IptablesVariant::Nft, 0, 0)
        );
    }

    #[test]
    fn missing_tools_decide_what_is_left() {
        let only_legacy = FakeProbe::with(&[IptablesVariant::Legacy]);
        assert_eq!(
            run(&only_legacy),
            Choice {
                variant: IptablesVariant::Legacy,
                reason: Reason::OnlyInstalled
            }
        );
        let only_nft = FakeProbe::with(&[IptablesVariant::Nft]);
        assert_eq!(run(&only_nft).variant, IptablesVariant::Nft);
        assert_eq!(
            run(&FakeProbe::default()),
            Choice {
                variant: IptablesVariant::System,
                reason: Reason::NoVariantTools
            }
        );
    }

    #[test]
    fn the_operator_wins_over_detection() {
        let probe = FakeProbe::with(&BOTH).set(
            IptablesVariant::Nft,
            IpFamily::V4,
            Some(Table::Mangle),
            HINT,
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let forced = runtime.block_on(choose(
            Some(("--iptables-backend".to_owned(), IptablesVariant::Legacy)),
            &probe,
        ));
        assert_eq!(forced.variant, IptablesVariant::Legacy);
        assert_eq!(forced.reason.to_string(), "set by --iptables-backend");
        let detected = runtime.block_on(choose(None, &probe));
        assert_eq!(detected.variant, IptablesVariant::Nft);
    }

    #[test]
    fn hint_chains_must_be_declared_exactly() {
        assert!(has_kubelet_chains(HINT));
        assert!(has_kubelet_chains(CANARY));
        assert!(!has_kubelet_chains(
            ":KUBE-IPTABLES-HINTS - [0:0]\n-A X -m comment --comment \":KUBE-IPTABLES-HINT\"\n"
        ));
        assert_eq!(count_rules(RULES), 2);
        // The real tools' names.
        assert_eq!(
            Tools::new(IptablesVariant::Legacy).save(IpFamily::V6),
            &PathBuf::from("ip6tables-legacy-save")
        );
    }
}
