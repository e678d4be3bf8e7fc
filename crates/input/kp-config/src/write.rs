//! `--write-config-to` and `/configz`: the effective configuration as upstream writes it.
//!
//! Upstream (since 1.31) keeps one `syncPeriod`, one `minSyncPeriod` and one `masqueradeAll`
//! internally, read from the running mode's block (`ipvs` in ipvs mode, `nftables` in
//! nftables mode, `iptables` otherwise), and its conversion back to v1alpha1
//! (`Convert_config_KubeProxyConfiguration_To_v1alpha1_KubeProxyConfiguration` in
//! `pkg/proxy/apis/config/v1alpha1/conversion.go`, unchanged from 1.31 to 1.36) writes them
//! into that block only: the other blocks' periods are `0s` and their `masqueradeAll` is
//! false. Up to 1.30 every block kept its own defaulted values. The written file follows the
//! newest behaviour; the configuration this crate loads keeps every block as read.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::types::{API_VERSION, KIND, KubeProxyConfiguration, ProxyMode};

/// Why the configuration could not be written.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Serialization failed (not expected for this type; reported rather than hidden).
    #[error("cannot encode configuration as YAML")]
    Encode(#[from] serde_saphyr::SerializeError),
    /// The file could not be written.
    #[error("cannot write config file {}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// The configuration with its type header, as upstream writes it: what `--write-config-to`
/// writes and `/configz` serves. Since upstream 1.31 `syncPeriod`, `minSyncPeriod` and
/// `masqueradeAll` are written into the running mode's block only (the others' periods `0s`,
/// their `masqueradeAll` false).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct VersionedConfiguration {
    api_version: &'static str,
    kind: &'static str,
    #[serde(flatten)]
    config: KubeProxyConfiguration,
}

impl KubeProxyConfiguration {
    /// The configuration as upstream's writer shapes it, with `apiVersion` and `kind`.
    pub fn versioned(&self) -> VersionedConfiguration {
        VersionedConfiguration {
            api_version: API_VERSION,
            kind: KIND,
            config: only_running_modes_block(self.clone()),
        }
    }

    /// The configuration as a YAML `KubeProxyConfiguration` document, durations in Go form.
    pub fn to_yaml(&self) -> Result<String, WriteError> {
        Ok(serde_saphyr::to_string(&self.versioned())?)
    }
}

/// `config` with the sync periods and `masqueradeAll` left in the running mode's block only.
fn only_running_modes_block(mut config: KubeProxyConfiguration) -> KubeProxyConfiguration {
    let (sync, min_sync) = (config.sync_period(), config.min_sync_period());
    let (_, masquerade_all) = config.masquerade();
    let zero = Duration::ZERO;
    (config.iptables.sync_period, config.iptables.min_sync_period) = (zero, zero);
    (config.ipvs.sync_period, config.ipvs.min_sync_period) = (zero, zero);
    (config.nftables.sync_period, config.nftables.min_sync_period) = (zero, zero);
    config.iptables.masquerade_all = false;
    config.nftables.masquerade_all = false;
    match config.mode {
        ProxyMode::Ipvs => {
            (config.ipvs.sync_period, config.ipvs.min_sync_period) = (sync, min_sync)
        }
        ProxyMode::Nftables => {
            (config.nftables.sync_period, config.nftables.min_sync_period) = (sync, min_sync);
        }
        _ => (config.iptables.sync_period, config.iptables.min_sync_period) = (sync, min_sync),
    }
    match config.mode {
        ProxyMode::Nftables => config.nftables.masquerade_all = masquerade_all,
        _ => config.iptables.masquerade_all = masquerade_all,
    }
    config
}

/// Writes `config` to `path` as YAML (what `--write-config-to` does before exiting).
pub fn write_config(path: &Path, config: &KubeProxyConfiguration) -> Result<(), WriteError> {
    let yaml = config.to_yaml()?;
    std::fs::write(path, yaml).map_err(|source| WriteError::Write {
        path: path.to_owned(),
        source,
    })
}
