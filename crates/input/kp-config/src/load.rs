//! Producing the effective configuration from the command line and the optional file.
//!
//! Precedence is upstream's: with `--config` the file is the configuration and only
//! `--hostname-override`, the logging flags and our `--iptables-backend` (it describes the
//! node, like the host name) still apply on top of it; any other configuration flag that was
//! given is ignored and reported as a warning. Without `--config`, flags override the
//! defaults.

use std::path::PathBuf;

use crate::flags::{self, Options};
use crate::types::{
    API_VERSION, DEFAULT_IPTABLES_MIN_SYNC_PERIOD, KIND, KubeProxyConfiguration, ProxyMode,
};
use crate::validate::{self, ConfigErrors};
use crate::wire;

/// Why no configuration could be produced.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The `--config` file could not be read.
    #[error("cannot read config file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON for the schema: syntax or a value of the wrong type.
    /// (Unknown and duplicate fields are warnings, as upstream's lenient decoding makes them.)
    #[error("{}", decode_message(origin, *line, *column, message))]
    Decode {
        /// The file (or `<input>` for in-memory text).
        origin: String,
        /// 1-based line of the problem; 0 if unknown.
        line: u64,
        /// 1-based column of the problem; 0 if unknown.
        column: u64,
        /// What is wrong, e.g. ``unknown field `masqueradeBitt` ``.
        message: String,
    },
    /// The file is not a `kubeproxy.config.k8s.io/v1alpha1` `KubeProxyConfiguration`.
    #[error(
        "{origin}: expected apiVersion {API_VERSION:?} and kind {KIND:?}, \
         found apiVersion {api_version:?} and kind {kind:?}"
    )]
    WrongKind {
        /// The file.
        origin: String,
        /// The `apiVersion` found (empty if missing).
        api_version: String,
        /// The `kind` found (empty if missing).
        kind: String,
    },
    /// One or more values are invalid; all of them are listed. (Not a `source`: the list is
    /// already in the message, and error reporters that print the source chain would print
    /// every error twice.)
    #[error("invalid kube-proxy configuration:\n{0}")]
    Invalid(ConfigErrors),
}

impl From<ConfigErrors> for LoadError {
    fn from(errors: ConfigErrors) -> Self {
        LoadError::Invalid(errors)
    }
}

fn decode_message(origin: &str, line: u64, column: u64, message: &str) -> String {
    match (line, column) {
        (0, _) => format!("{origin}: {message}"),
        (line, 0) => format!("{origin}: line {line}: {message}"),
        (line, column) => format!("{origin}: line {line}, column {column}: {message}"),
    }
}

/// The outcome of [`Options::load`].
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The effective configuration: defaults applied, validated.
    pub config: KubeProxyConfiguration,
    /// One line per problem that does not stop kube-proxy, for the caller to log as
    /// warnings: flags ignored because `--config` was also given, unknown or duplicate fields
    /// of the file (decoded leniently, as upstream), and settings that have no effect in
    /// kube-proxy-rs ([`KubeProxyConfiguration::ignored_settings`]).
    pub warnings: Vec<String>,
}

impl Options {
    /// Builds the effective configuration from these flags and the `--config` file.
    ///
    /// Reads the file if one was given (the only I/O this crate does). Every invalid value is
    /// reported in one [`LoadError::Invalid`], naming the flag for values that came from one.
    pub fn load(&self) -> Result<Loaded, LoadError> {
        let mut warnings = Vec::new();
        let (mut config, mut errors, mut from_flags) = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
                    path: path.clone(),
                    source,
                })?;
                let decoded = wire::decode(&text, &path.display().to_string())?;
                warnings.extend(decoded.warnings);
                let (config, errors) = (decoded.config, decoded.errors);
                // Apply to a scratch copy only to learn which flags were given.
                let mut scratch = KubeProxyConfiguration::default();
                for (flag, fields) in self.apply_config_flags(&mut scratch) {
                    warnings.push(format!(
                        "flag {flag} is ignored because a config file is specified (--config); \
                         set {} in the file instead",
                        fields.join(" / ")
                    ));
                }
                (config, errors, Vec::new())
            }
            None => {
                let mut config = KubeProxyConfiguration::default();
                let set = self.apply_config_flags(&mut config);
                self.flags_only_ipvs_min_sync_period(&mut config);
                (config, Vec::new(), set)
            }
        };
        from_flags.extend(self.apply_overriding_flags(&mut config));
        if self.config.is_none() {
            warnings.extend(self.flags_of_other_modes(config.mode));
        }
        config.complete_defaults();
        let mut invalid = validate::validate(&config);
        flags::attribute_to_flags(&mut invalid, &from_flags);
        errors.extend(invalid);
        if errors.is_empty() {
            warnings.extend(config.ignored_settings());
            Ok(Loaded { config, warnings })
        } else {
            Err(ConfigErrors { errors }.into())
        }
    }
}

impl Options {
    /// Without a file, upstream (since 1.31) starts from one `minSyncPeriod` defaulted as
    /// iptables' (1s), which `--ipvs-min-sync-period` shows as its default: ipvs mode run from
    /// flags alone rests 1s, while a file's absent `ipvs.minSyncPeriod` is 0s
    /// (`newKubeProxyConfiguration` and `processV1Alpha1Flags` in `cmd/kube-proxy/app/options.go`).
    fn flags_only_ipvs_min_sync_period(&self, config: &mut KubeProxyConfiguration) {
        if config.mode == ProxyMode::Ipvs && self.ipvs_min_sync_period.is_none() {
            config.ipvs.min_sync_period = DEFAULT_IPTABLES_MIN_SYNC_PERIOD;
        }
    }
}

impl KubeProxyConfiguration {
    /// Decodes a configuration file's text (YAML or JSON), applies defaults and validates.
    /// Warnings (unknown fields and the like) are dropped; see [`Self::from_yaml_with_warnings`].
    pub fn from_yaml(text: &str) -> Result<Self, LoadError> {
        Self::from_yaml_with_warnings(text).map(|(config, _)| config)
    }

    /// As [`Self::from_yaml`], also returning the warnings [`Loaded::warnings`] would hold.
    pub fn from_yaml_with_warnings(text: &str) -> Result<(Self, Vec<String>), LoadError> {
        let decoded = wire::decode(text, "<input>")?;
        let (mut config, mut errors, mut warnings) =
            (decoded.config, decoded.errors, decoded.warnings);
        config.complete_defaults();
        errors.extend(validate::validate(&config));
        if errors.is_empty() {
            warnings.extend(config.ignored_settings());
            Ok((config, warnings))
        } else {
            Err(ConfigErrors { errors }.into())
        }
    }
}
