//! Which cgroup each of this process's open BPF links is attached to, read from
//! `/proc/self/fdinfo` (aya's link info has no cgroup id).
//!
//! A cgroup link that someone detached (`BPF_LINK_DETACH`, as `bpftool link detach` does)
//! keeps its pin and its program: only its `cgroup_id`, 0 from then on, tells that the
//! program no longer runs. ([`crate::SocketPrograms::verify`] opens each pinned link, then
//! reads this.)

use std::collections::HashMap;

/// What `/proc/self/fd` shows a BPF link's descriptor as.
const LINK_TARGET: &str = "anon_inode:bpf-link";

/// Each open link's id and the id of the cgroup it is attached to (0: detached). Links
/// whose fdinfo cannot be read are missing: nothing is said of them.
pub(crate) fn attached_cgroups() -> HashMap<u32, u64> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return HashMap::new();
    };
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| target.as_os_str() == LINK_TARGET)
        })
        .filter_map(|fd| {
            let info = std::path::Path::new("/proc/self/fdinfo").join(fd.file_name());
            parse(&std::fs::read_to_string(info).ok()?)
        })
        .collect()
}

/// A cgroup link's `link_id` and `cgroup_id` from its fdinfo text; `None` for other links.
fn parse(fdinfo: &str) -> Option<(u32, u64)> {
    let field = |name: &str| {
        fdinfo.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim())
        })
    };
    Some((
        field("link_id")?.parse().ok()?,
        field("cgroup_id")?.parse().ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_links_fdinfo_gives_its_id_and_cgroup() {
        let attached = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t2071\nlink_type:\tcgroup\n\
                        link_id:\t12\nprog_tag:\t0123456789abcdef\nprog_id:\t34\n\
                        cgroup_id:\t5678\nattach_type:\t10\n";
        assert_eq!(parse(attached), Some((12, 5678)));
        let detached = attached.replace("cgroup_id:\t5678", "cgroup_id:\t0");
        assert_eq!(parse(&detached), Some((12, 0)));
        let iterator = "pos:\t0\nlink_type:\titer\nlink_id:\t9\nprog_id:\t3\ntarget_name:\ttcp\n";
        assert_eq!(parse(iterator), None);
    }
}
