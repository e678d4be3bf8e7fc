//! kube-proxy-rs extension: which iptables backend to use (`iptablesBackend` in the file,
//! `--iptables-backend` on the command line). Upstream has no such setting: its image picks
//! the backend with a wrapper script before kube-proxy runs; kube-proxy-rs detects it
//! in-process the same way (`auto`), and this lets the operator override the detection.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// The operator's choice of iptables backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IptablesBackend {
    /// Use the backend the node's kubelet and rules already use (upstream image's rules).
    #[default]
    Auto,
    /// The legacy (xtables) backend: `iptables-legacy`, ...
    Legacy,
    /// The nf_tables backend: `iptables-nft`, ...
    Nft,
}

impl IptablesBackend {
    /// The spelling used in files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            IptablesBackend::Auto => "auto",
            IptablesBackend::Legacy => "legacy",
            IptablesBackend::Nft => "nft",
        }
    }

    /// Whether this is the default (then `--write-config-to` leaves the field out, so the
    /// file stays readable by upstream).
    pub fn is_auto(&self) -> bool {
        *self == IptablesBackend::Auto
    }
}

impl FromStr for IptablesBackend {
    type Err = String;

    /// `auto` (or empty), `legacy`, `nft` (also `nf_tables`), in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(IptablesBackend::Auto),
            "legacy" => Ok(IptablesBackend::Legacy),
            "nft" | "nf_tables" => Ok(IptablesBackend::Nft),
            _ => Err("must be auto, legacy or nft".to_owned()),
        }
    }
}

impl fmt::Display for IptablesBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KubeProxyConfiguration;

    #[test]
    fn spellings_parse() {
        assert_eq!("".parse(), Ok(IptablesBackend::Auto));
        assert_eq!(" Legacy".parse(), Ok(IptablesBackend::Legacy));
        assert_eq!("nf_tables".parse(), Ok(IptablesBackend::Nft));
        assert_eq!("NFT".parse(), Ok(IptablesBackend::Nft));
        assert!("xtables".parse::<IptablesBackend>().is_err());
    }

    #[test]
    fn the_file_field_is_read_checked_and_written_only_when_set() {
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let config = KubeProxyConfiguration::from_yaml(&format!("{head}iptablesBackend: legacy\n"))
            .expect("valid");
        assert_eq!(config.iptables_backend, IptablesBackend::Legacy);
        let written = serde_json::to_string(&config).expect("serializes");
        assert!(
            written.contains(r#""iptablesBackend":"legacy""#),
            "{written}"
        );
        let default = KubeProxyConfiguration::from_yaml(head).expect("valid");
        assert_eq!(default.iptables_backend, IptablesBackend::Auto);
        let written = serde_json::to_string(&default).expect("serializes");
        assert!(!written.contains("iptablesBackend"), "{written}");
        let err = KubeProxyConfiguration::from_yaml(&format!("{head}iptablesBackend: xt\n"))
            .expect_err("invalid");
        let message = err.to_string();
        assert!(
            message.contains("iptablesBackend") && message.contains("auto, legacy or nft"),
            "{message}"
        );
    }
}
