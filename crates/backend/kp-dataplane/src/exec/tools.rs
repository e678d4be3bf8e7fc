//! Which iptables binaries run: the backend variant ([`IptablesVariant`]) and the paths of its
//! six tools ([`Tools`]), and which backend an `iptables --version` line reports.

use std::path::PathBuf;

use kp_core::model::IpFamily;

/// Which iptables binaries to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IptablesVariant {
    /// `iptables`, `iptables-save`, ...: whatever the system's alternatives point at (as
    /// upstream).
    #[default]
    System,
    /// `iptables-legacy`, ...: the xtables backend (much faster restores at scale here).
    Legacy,
    /// `iptables-nft`, ...: the nf_tables backend.
    Nft,
}

/// The paths (or `PATH`-relative names) of the six tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tools {
    /// The backend they belong to (for logs; the paths decide what runs).
    pub variant: IptablesVariant,
    /// `iptables`.
    pub iptables: PathBuf,
    /// `iptables-save`.
    pub iptables_save: PathBuf,
    /// `iptables-restore`.
    pub iptables_restore: PathBuf,
    /// `ip6tables`.
    pub ip6tables: PathBuf,
    /// `ip6tables-save`.
    pub ip6tables_save: PathBuf,
    /// `ip6tables-restore`.
    pub ip6tables_restore: PathBuf,
}

impl Tools {
    /// The tools of one variant, looked up on the `PATH`.
    pub fn new(variant: IptablesVariant) -> Self {
        let infix = match variant {
            IptablesVariant::System => "",
            IptablesVariant::Legacy => "-legacy",
            IptablesVariant::Nft => "-nft",
        };
        let name = |base: &str, suffix: &str| PathBuf::from(format!("{base}{infix}{suffix}"));
        Self {
            variant,
            iptables: name("iptables", ""),
            iptables_save: name("iptables", "-save"),
            iptables_restore: name("iptables", "-restore"),
            ip6tables: name("ip6tables", ""),
            ip6tables_save: name("ip6tables", "-save"),
            ip6tables_restore: name("ip6tables", "-restore"),
        }
    }

    /// `iptables` or `ip6tables`.
    pub fn iptables(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables,
            IpFamily::V6 => &self.ip6tables,
        }
    }

    /// `iptables-save` or `ip6tables-save`.
    pub fn save(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables_save,
            IpFamily::V6 => &self.ip6tables_save,
        }
    }

    /// `iptables-restore` or `ip6tables-restore`.
    pub fn restore(&self, family: IpFamily) -> &PathBuf {
        match family {
            IpFamily::V4 => &self.iptables_restore,
            IpFamily::V6 => &self.ip6tables_restore,
        }
    }
}

/// The system's tools ([`IptablesVariant::System`]): what the `PATH` names `iptables`.
impl Default for Tools {
    fn default() -> Self {
        Self::new(IptablesVariant::System)
    }
}

/// The kernel backend an `iptables --version` line reports: `nf_tables` and `legacy` are
/// printed in parentheses by iptables >= 1.8; older versions only have the legacy backend.
pub fn backend_of_version(version: &str) -> IptablesVariant {
    if version.contains("(nf_tables)") {
        IptablesVariant::Nft
    } else {
        IptablesVariant::Legacy
    }
}
