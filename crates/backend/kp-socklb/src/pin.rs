//! Where the programs' links and maps are pinned in bpffs, so they outlive the proxy: a
//! restarted or killed proxy leaves translation running (the kernel holds the links while
//! their pins exist), and the next one adopts the maps and replaces the links without a
//! moment in which no program is attached. `--cleanup`, or a start without `--socket-lb`,
//! removes them ([`remove`]).
//!
//! The directory is `$KUBE_PROXY_RS_STATE_DIR/bpf` when that variable is set, else
//! [`DEFAULT_DIR`]; inside it [`LAYOUT`] names the maps' layout, so a proxy whose maps are
//! laid out otherwise never adopts them. Where the directory is not on a bpffs, [`prepare`]
//! mounts one there (whose pins then last as long as that mount).

use std::path::{Path, PathBuf};

/// The pins' directory without `$KUBE_PROXY_RS_STATE_DIR`.
pub const DEFAULT_DIR: &str = "/sys/fs/bpf/kube-proxy-rs";
/// The sub-directory of this maps layout (change it with `bpf/socklb.bpf.c`'s maps).
pub const LAYOUT: &str = "socklb-v1";
/// bpffs's magic number (`statfs`'s `f_type`).
const BPF_FS_MAGIC: u64 = 0xcafe_4a11;

/// Why the pins' directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// It could not be created.
    #[error("cannot create the BPF pin directory {}", path.display())]
    Create {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It is not on a bpffs and one could not be mounted there.
    #[error("cannot mount a bpffs at {}", path.display())]
    Mount {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A pin could not be removed.
    #[error("cannot remove BPF pin {}", path.display())]
    Remove {
        /// The pin.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// The pins' directory: `state_dir/bpf` (the proxy passes `$KUBE_PROXY_RS_STATE_DIR` when
/// set), else [`DEFAULT_DIR`]; with the layout's sub-directory.
pub fn pin_dir(state_dir: Option<&Path>) -> PathBuf {
    state_dir
        .map_or_else(|| PathBuf::from(DEFAULT_DIR), |dir| dir.join("bpf"))
        .join(LAYOUT)
}

/// Whether `path` is on a bpffs.
pub fn is_bpffs(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|stat| {
        // `f_type`'s integer type differs between targets.
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        let magic = stat.f_type as u64;
        magic == BPF_FS_MAGIC
    })
}

/// Makes `dir` (a [`pin_dir`]) exist on a bpffs, mounting one at its parent where there is
/// none; returns whether it mounted one.
pub fn prepare(dir: &Path) -> Result<bool, PinError> {
    let base = dir.parent().unwrap_or(dir);
    let mut mounted = false;
    if !is_bpffs(base) {
        std::fs::create_dir_all(base).map_err(|source| PinError::Create {
            path: base.to_owned(),
            source,
        })?;
        if !is_bpffs(base) {
            mount(base)?;
            mounted = true;
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| PinError::Create {
        path: dir.to_owned(),
        source,
    })?;
    Ok(mounted)
}

fn mount(path: &Path) -> Result<(), PinError> {
    rustix::mount::mount("bpf", path, "bpf", rustix::mount::MountFlags::empty(), None).map_err(
        |errno| PinError::Mount {
            path: path.to_owned(),
            source: errno.into(),
        },
    )
}

/// A program's link pin in `dir`.
pub fn link_pin(dir: &Path, program: &str) -> PathBuf {
    dir.join(format!("link_{program}"))
}

/// A map's pin in `dir`.
pub fn map_pin(dir: &Path, map: &str) -> PathBuf {
    dir.join(map)
}

/// Removes every pin in `dir` (links first: their programs detach when the last reference
/// goes; the maps go with the programs) and the directory; returns how many pins there
/// were. Absent: nothing to do.
pub fn remove(dir: &Path) -> Result<usize, PinError> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    let mut pins: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    // Links (`link_*`) before maps.
    pins.sort_by_key(|p| {
        !p.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("link_"))
    });
    for pin in &pins {
        std::fs::remove_file(pin).map_err(|source| PinError::Remove {
            path: pin.clone(),
            source,
        })?;
    }
    // Best effort: another layout's sibling may share the parent.
    let _ = std::fs::remove_dir(dir);
    Ok(pins.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_dir_chooses_the_pins_directory() {
        assert_eq!(
            pin_dir(None),
            Path::new("/sys/fs/bpf/kube-proxy-rs/socklb-v1")
        );
        assert_eq!(
            pin_dir(Some(Path::new("/run/kp"))),
            Path::new("/run/kp/bpf/socklb-v1")
        );
        let dir = Path::new("/x");
        assert_eq!(
            link_pin(dir, "kp_connect4"),
            Path::new("/x/link_kp_connect4")
        );
        assert_eq!(map_pin(dir, "kp_services"), Path::new("/x/kp_services"));
    }

    #[test]
    fn removing_an_absent_directory_is_nothing() {
        let dir = std::env::temp_dir().join("kp-socklb-no-such-pins");
        assert_eq!(remove(&dir).expect("absent"), 0);
    }
}
