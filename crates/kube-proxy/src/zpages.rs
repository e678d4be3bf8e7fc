//! What `/statusz` and `/flagz` report for this process ([`kp_server::zpages`]).

use std::collections::BTreeMap;
use std::time::SystemTime;

use clap::CommandFactory as _;
use kp_config::{KubeProxyConfiguration, Options};
use kp_server::zpages::ZpageInfo;

/// The upstream release whose behaviour this binary follows (`emulationVersion`).
pub const EMULATION_VERSION: &str = "1.36";

/// The pages for a proxy started at `started` with `config` and the command line `args`.
pub fn pages(
    config: &KubeProxyConfiguration,
    args: impl IntoIterator<Item = std::ffi::OsString>,
    started: SystemTime,
) -> ZpageInfo {
    let gate = |name| kp_config::gates::enabled(&config.feature_gates, name);
    ZpageInfo {
        component: "kube-proxy".to_owned(),
        started,
        binary_version: kp_config::VERSION.to_owned(),
        emulation_version: EMULATION_VERSION.to_owned(),
        paths: Vec::new(),
        flags: flag_values(args),
        statusz: gate("ComponentStatusz"),
        flagz: gate("ComponentFlagz"),
    }
}

/// Every long flag the command line knows, with the value given on `args` (values of a
/// repeated flag joined by commas; `true` for a bare switch), empty when not given.
pub fn flag_values(args: impl IntoIterator<Item = std::ffi::OsString>) -> BTreeMap<String, String> {
    let command = Options::command();
    let matches = command.clone().try_get_matches_from(args).ok();
    command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            let given = matches.as_ref().filter(|m| {
                m.value_source(arg.get_id().as_str())
                    == Some(clap::parser::ValueSource::CommandLine)
            });
            let value = given
                .and_then(|m| m.get_raw(arg.get_id().as_str()))
                .map(|values| {
                    let values: Vec<String> =
                        values.map(|v| v.to_string_lossy().into_owned()).collect();
                    if values.is_empty() {
                        "true".to_owned()
                    } else {
                        values.join(",")
                    }
                })
                .unwrap_or_default();
            Some((long.to_owned(), value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readme_status_names_the_release_followed() {
        // One fact, one place: README's status line says what `emulationVersion` reports.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
        let readme = std::fs::read_to_string(path).unwrap_or_default();
        let status = readme.split("## Status").nth(1).unwrap_or_default();
        let line = status
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or_default();
        let named = format!("upstream kube-proxy **{EMULATION_VERSION}**");
        assert!(line.contains(&named), "{line:?} should name {named}");
    }

    fn args(list: &[&str]) -> Vec<std::ffi::OsString> {
        std::iter::once("kube-proxy")
            .chain(list.iter().copied())
            .map(Into::into)
            .collect()
    }

    #[test]
    fn flags_show_what_was_given_and_every_other_flag_empty() {
        let flags = flag_values(args(&[
            "--proxy-mode=nftables",
            "--cluster-cidr",
            "10.0.0.0/8",
            "--masquerade-all",
        ]));
        assert_eq!(flags["proxy-mode"], "nftables");
        assert_eq!(flags["cluster-cidr"], "10.0.0.0/8");
        assert_eq!(flags["masquerade-all"], "true");
        assert_eq!(flags["iptables-sync-period"], "");
        assert!(flags.contains_key("feature-gates"));
    }

    #[test]
    fn the_gates_turn_each_page_off() {
        let config = |gates: &[(&str, bool)]| KubeProxyConfiguration {
            feature_gates: gates.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            ..KubeProxyConfiguration::default()
        };
        let on = pages(&config(&[]), args(&[]), SystemTime::now());
        assert!(on.statusz && on.flagz);
        assert_eq!(on.emulation_version, "1.36");
        let off = pages(
            &config(&[("ComponentFlagz", false)]),
            args(&[]),
            SystemTime::now(),
        );
        assert!(off.statusz && !off.flagz);
    }
}
