//! kube-proxy-rs extension: which table layout nftables mode writes (`nftablesLayout` in the
//! file, `--nftables-layout` on the command line). Upstream has one layout, a chain per
//! service and endpoint; kube-proxy-rs writes the verdict-free layout by default (per-service
//! state in sets and maps behind fixed chains, so a change is element updates the kernel
//! need not validate), and keeps upstream's shape selectable for comparison and rollback.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// The layout of the `kube-proxy` tables in nftables mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NftablesLayout {
    /// Fixed chains, per-service state in sets and maps (docs/nftables-layout.md).
    #[default]
    Maps,
    /// One chain per service port and endpoint, as upstream (docs/nftables-integration.md).
    Chains,
}

impl NftablesLayout {
    /// The spelling used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            NftablesLayout::Maps => "maps",
            NftablesLayout::Chains => "chains",
        }
    }

    /// Whether this is the default (then `--write-config-to` leaves the field out, so the
    /// file stays readable by upstream).
    pub fn is_default(&self) -> bool {
        *self == NftablesLayout::default()
    }
}

impl FromStr for NftablesLayout {
    type Err = String;

    /// `maps` (or empty) or `chains`, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "maps" => Ok(NftablesLayout::Maps),
            "chains" => Ok(NftablesLayout::Chains),
            _ => Err("must be maps or chains".to_owned()),
        }
    }
}

impl fmt::Display for NftablesLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KubeProxyConfiguration;

    const HEAD: &str =
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    #[test]
    fn spellings_parse() {
        assert_eq!("".parse(), Ok(NftablesLayout::Maps));
        assert_eq!(" Chains".parse(), Ok(NftablesLayout::Chains));
        assert_eq!("MAPS".parse(), Ok(NftablesLayout::Maps));
        assert!("verdicts".parse::<NftablesLayout>().is_err());
    }

    #[test]
    fn the_file_field_is_read_checked_and_written_only_when_not_the_default() {
        let config = KubeProxyConfiguration::from_yaml(&format!("{HEAD}nftablesLayout: chains\n"))
            .expect("valid");
        assert_eq!(config.nftables_layout, NftablesLayout::Chains);
        let written = serde_json::to_string(&config).expect("serializes");
        assert!(
            written.contains(r#""nftablesLayout":"chains""#),
            "{written}"
        );
        let default = KubeProxyConfiguration::from_yaml(HEAD).expect("valid");
        assert_eq!(default.nftables_layout, NftablesLayout::Maps);
        let written = serde_json::to_string(&default).expect("serializes");
        assert!(!written.contains("nftablesLayout"), "{written}");
        let err = KubeProxyConfiguration::from_yaml(&format!("{HEAD}nftablesLayout: tree\n"))
            .expect_err("invalid");
        let message = err.to_string();
        assert!(
            message.contains("nftablesLayout") && message.contains("maps or chains"),
            "{message}"
        );
    }
}
