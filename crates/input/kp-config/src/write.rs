//! `--write-config-to`: the effective configuration as a file upstream's format.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::types::{API_VERSION, KIND, KubeProxyConfiguration};

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

/// The configuration with its type header, as it appears in a file.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Document<'a> {
    api_version: &'static str,
    kind: &'static str,
    #[serde(flatten)]
    config: &'a KubeProxyConfiguration,
}

impl KubeProxyConfiguration {
    /// The configuration as a YAML `KubeProxyConfiguration` document, durations in Go form.
    pub fn to_yaml(&self) -> Result<String, WriteError> {
        let document = Document {
            api_version: API_VERSION,
            kind: KIND,
            config: self,
        };
        Ok(serde_saphyr::to_string(&document)?)
    }
}

/// Writes `config` to `path` as YAML (what `--write-config-to` does before exiting).
pub fn write_config(path: &Path, config: &KubeProxyConfiguration) -> Result<(), WriteError> {
    let yaml = config.to_yaml()?;
    std::fs::write(path, yaml).map_err(|source| WriteError::Write {
        path: path.to_owned(),
        source,
    })
}
