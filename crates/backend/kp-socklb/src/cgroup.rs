//! Which cgroup v2 directory the programs attach to: the one the operator chose, else the
//! root of the node's cgroup v2 hierarchy (found in `/proc/self/mountinfo`, so hybrid nodes
//! with cgroup2 at `/sys/fs/cgroup/unified` are served), else, on a node with only cgroup v1
//! mounted, a private cgroup2 mount this process makes. Every process of the node is in
//! the root of the v2 hierarchy or below it even while the controllers are bound to v1, so
//! attaching there reaches every socket.

use std::path::{Path, PathBuf};

use crate::error::Unavailable;
use crate::program::check_cgroup2;

/// Where the programs attach, and how that directory was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupTarget {
    /// The directory the operator chose.
    Chosen(PathBuf),
    /// The root of the node's cgroup v2 mount.
    Root(PathBuf),
    /// No cgroup2 was mounted: this process mounted one here (the v2 hierarchy's root).
    PrivateMount(PathBuf),
}

impl CgroupTarget {
    /// The directory.
    pub fn path(&self) -> &Path {
        match self {
            CgroupTarget::Chosen(path)
            | CgroupTarget::Root(path)
            | CgroupTarget::PrivateMount(path) => path,
        }
    }
}

/// Why no cgroup v2 directory could be found or made.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The chosen directory is not cgroup v2.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// No cgroup2 mount exists and mounting one failed.
    #[error("no cgroup v2 is mounted on this node and mounting one at {} failed", path.display())]
    Mount {
        /// Where.
        path: PathBuf,
        /// The kernel's answer (EPERM without CAP_SYS_ADMIN).
        #[source]
        source: std::io::Error,
    },
}

/// The directory to attach to: `chosen` if given (it must be cgroup v2), else the cgroup v2
/// root, else a cgroup2 mounted at `private` (created if needed; reused when a previous
/// run of the proxy mounted it already).
pub fn resolve(chosen: Option<&Path>, private: &Path) -> Result<CgroupTarget, CgroupError> {
    if let Some(path) = chosen {
        check_cgroup2(path)?;
        return Ok(CgroupTarget::Chosen(path.to_owned()));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(root) = cgroup2_root(&mountinfo) {
        return Ok(CgroupTarget::Root(root));
    }
    if check_cgroup2(private).is_err() {
        mount_cgroup2(private).map_err(|source| CgroupError::Mount {
            path: private.to_owned(),
            source,
        })?;
    }
    Ok(CgroupTarget::PrivateMount(private.to_owned()))
}

fn mount_cgroup2(at: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(at)?;
    rustix::mount::mount(
        "cgroup2",
        at,
        "cgroup2",
        rustix::mount::MountFlags::empty(),
        None::<&std::ffi::CStr>,
    )?;
    Ok(())
}

/// The mount point of the cgroup v2 hierarchy's root in `mountinfo` (`/proc/self/mountinfo`'s
/// text): `/sys/fs/cgroup` when it is cgroup2, else the first cgroup2 mount of the root.
pub fn cgroup2_root(mountinfo: &str) -> Option<PathBuf> {
    let roots: Vec<&str> = mountinfo.lines().filter_map(cgroup2_root_mount).collect();
    let pick = roots
        .iter()
        .find(|p| **p == "/sys/fs/cgroup")
        .or(roots.first())?;
    Some(PathBuf::from(pick))
}

/// A mountinfo line's mount point if it mounts the root of a cgroup2 hierarchy:
/// `ID PARENT MAJ:MIN ROOT POINT OPTIONS [TAGS...] - FSTYPE SOURCE SUPER`.
fn cgroup2_root_mount(line: &str) -> Option<&str> {
    let (left, right) = line.split_once(" - ")?;
    if right.split_whitespace().next()? != "cgroup2" {
        return None;
    }
    let mut fields = left.split_whitespace().skip(3);
    let root = fields.next()?;
    let point = fields.next()?;
    (root == "/").then_some(point)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 30 0:22 / /sys rw,nosuid shared:7 - sysfs sysfs rw
26 25 0:23 / /sys/fs/cgroup ro shared:8 - tmpfs tmpfs ro,mode=755
27 26 0:24 / /sys/fs/cgroup/unified rw shared:9 - cgroup2 cgroup2 rw,nsdelegate
28 26 0:25 / /sys/fs/cgroup/systemd rw shared:10 - cgroup cgroup rw,name=systemd
";

    #[test]
    fn the_v2_root_is_found_on_hybrid_and_unified_nodes() {
        assert_eq!(
            cgroup2_root(HYBRID),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "\
40 30 0:30 /kubepods /mnt/pods rw - cgroup2 cgroup2 rw
26 25 0:23 / /sys/fs/cgroup rw shared:8 - cgroup2 cgroup2 rw,nsdelegate
";
        assert_eq!(cgroup2_root(unified), Some(PathBuf::from("/sys/fs/cgroup")));
        // A bind mount of a sub-directory is not the root.
        let sub = "40 30 0:30 /kubepods /mnt/pods rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_root(sub), None);
        let v1_only = "28 26 0:25 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        assert_eq!(cgroup2_root(v1_only), None);
    }

    #[test]
    fn a_chosen_directory_must_be_cgroup_v2() {
        let error = resolve(Some(Path::new("/proc")), Path::new("/nonexistent"))
            .expect_err("/proc is not cgroup v2");
        assert!(
            error
                .to_string()
                .contains("/proc is not a cgroup v2 directory"),
            "{error}"
        );
    }
}
