//! Choosing kernel modules for the guest: a selection (whole directories of the kernel tree
//! plus single module names) closed over `modules.dep`, so every dependency comes along.

use std::collections::{BTreeMap, BTreeSet};

/// One parsed `modules.dep`: module path (relative to `/lib/modules/<kver>`) to the paths it
/// depends on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModuleDeps {
    deps: BTreeMap<String, Vec<String>>,
}

/// `kernel/net/sctp/sctp.ko.xz` -> `sctp`; `-` and `_` are the same in module names.
pub fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let stem = base.split(".ko").next().unwrap_or(base);
    stem.replace('-', "_")
}

impl ModuleDeps {
    /// Parses `modules.dep` text (`path: dep dep ...` per line). Malformed lines are ignored:
    /// depmod writes this file, and a missing module is reported later by name.
    pub fn parse(text: &str) -> Self {
        let deps = text
            .lines()
            .filter_map(|line| {
                let (module, rest) = line.split_once(':')?;
                let module = module.trim();
                (!module.is_empty()).then(|| {
                    (
                        module.to_owned(),
                        rest.split_whitespace().map(str::to_owned).collect(),
                    )
                })
            })
            .collect();
        Self { deps }
    }

    /// Every module under one of `dirs` (path prefixes such as `kernel/net/netfilter/`) or
    /// named in `names`, plus everything those depend on. Fails with the names not found.
    pub fn closure(&self, dirs: &[&str], names: &[&str]) -> Result<BTreeSet<String>, Vec<String>> {
        let wanted: BTreeSet<String> = names.iter().map(|n| n.replace('-', "_")).collect();
        let mut found = BTreeSet::new();
        let mut todo: Vec<&String> = Vec::new();
        for path in self.deps.keys() {
            let name = module_name(path);
            if dirs.iter().any(|d| path.starts_with(d)) || wanted.contains(&name) {
                found.insert(name);
                todo.push(path);
            }
        }
        let missing: Vec<String> = wanted.difference(&found).cloned().collect();
        if !missing.is_empty() {
            return Err(missing);
        }
        let mut out = BTreeSet::new();
        while let Some(path) = todo.pop() {
            if out.insert(path.clone())
                && let Some(deps) = self.deps.get(path)
            {
                todo.extend(deps.iter());
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str = "\
kernel/net/netfilter/ipvs/ip_vs_rr.ko: kernel/net/netfilter/ipvs/ip_vs.ko kernel/net/netfilter/nf_conntrack.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/ipvs/ip_vs.ko: kernel/net/netfilter/nf_conntrack.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nf_conntrack.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
kernel/drivers/net/dummy.ko.xz:
kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko
kernel/lib/crc16.ko:
";

    #[test]
    fn closes_over_dependencies() {
        let deps = ModuleDeps::parse(DEP);
        let got = deps
            .closure(&["kernel/net/netfilter/ipvs/"], &["dummy"])
            .expect("all found");
        let expected: BTreeSet<String> = [
            "kernel/net/netfilter/ipvs/ip_vs_rr.ko",
            "kernel/net/netfilter/ipvs/ip_vs.ko",
            "kernel/net/netfilter/nf_conntrack.ko",
            "kernel/lib/libcrc32c.ko",
            "kernel/drivers/net/dummy.ko.xz",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn names_missing_modules() {
        let deps = ModuleDeps::parse(DEP);
        assert_eq!(
            deps.closure(&[], &["dummy", "ip-vs-nope"]),
            Err(vec!["ip_vs_nope".to_owned()])
        );
    }

    #[test]
    fn module_names_ignore_dashes_and_compression() {
        assert_eq!(module_name("kernel/x/nf-conntrack.ko.zst"), "nf_conntrack");
        assert_eq!(module_name("sctp.ko"), "sctp");
    }
}
