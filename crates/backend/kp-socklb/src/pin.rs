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
//!
//! One proxy at a time uses a pins' directory: [`lock`] takes an exclusive `flock(2)` on its
//! parent (bpffs holds no regular files, so the lock is on the directory itself), held for
//! the process's lifetime, and a second proxy is told which process holds it.

use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
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
    /// Another process holds the pins' lock: a second proxy on the same pins would fight the
    /// first over the cgroup's links and the maps.
    #[error(
        "the socket load balancer's pins in {} are in use by {holder}: one proxy per pin \
         directory (stop that one, or give this one another $KUBE_PROXY_RS_STATE_DIR)",
        path.display()
    )]
    Held {
        /// The locked directory.
        path: PathBuf,
        /// Who holds it: `pid N (its command line)`, or why that cannot be told.
        holder: String,
    },
    /// The lock could not be taken for another reason.
    #[error("cannot lock the BPF pin directory {}", path.display())]
    Lock {
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

/// The exclusive lock on a pins' directory, held until dropped (or the process exits).
#[derive(Debug)]
pub struct PinLock {
    _dir: File,
}

/// Locks `dir`'s parent (the pins' base directory, which [`prepare`] made) for this process;
/// [`PinError::Held`], naming the holder, where another process has it.
pub fn lock(dir: &Path) -> Result<PinLock, PinError> {
    let base = dir.parent().unwrap_or(dir);
    let failed = |source| PinError::Lock {
        path: base.to_owned(),
        source,
    };
    let file = File::open(base).map_err(failed)?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(PinLock { _dir: file }),
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let meta = file.metadata().map_err(failed)?;
            let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
            let holder = lock_holder(&locks, meta.dev(), meta.ino()).map_or_else(
                || "another process (not visible in this PID namespace)".to_owned(),
                describe_process,
            );
            Err(PinError::Held {
                path: base.to_owned(),
                holder,
            })
        }
        Err(errno) => Err(failed(errno.into())),
    }
}

/// The pid holding a `flock` on the file `dev`/`ino`, from `/proc/locks` (lines such as
/// `1: FLOCK  ADVISORY  WRITE 4242 00:1e:1234 0 EOF`; device numbers in hex).
fn lock_holder(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let file = format!(
        "{:02x}:{:02x}:{ino}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    );
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // A waiter's line starts with `->` after the number: never ours (non-blocking).
        (fields.get(1) == Some(&"FLOCK") && fields.get(5) == Some(&file.as_str()))
            .then(|| fields.get(4)?.parse().ok())
            .flatten()
    })
}

/// `pid N (command line)`, the command line cut short.
fn describe_process(pid: u32) -> String {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let mut line = String::from_utf8_lossy(&cmdline)
        .replace('\0', " ")
        .trim()
        .to_owned();
    if line.len() > 160 {
        let cut = (0..=160)
            .rev()
            .find(|&i| line.is_char_boundary(i))
            .unwrap_or(0);
        line.truncate(cut);
        line.push_str("...");
    }
    format!("pid {pid} ({line})")
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
    fn a_second_lock_is_refused_and_names_the_holder() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join(LAYOUT);
        let first = lock(&dir).expect("first");
        let error = lock(&dir).expect_err("held");
        let message = error.to_string();
        let me = format!("pid {} (", std::process::id());
        assert!(matches!(error, PinError::Held { .. }), "{error:?}");
        assert!(message.contains(&me), "{message}");
        drop(first);
        lock(&dir).expect("free again");
    }

    #[test]
    fn the_holder_is_read_from_proc_locks() {
        let locks = "1: POSIX  ADVISORY  WRITE 77 00:1e:99 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 4242 00:1e:1234 0 EOF\n\
                     3: FLOCK  ADVISORY  WRITE 5151 fd:01:1234 0 EOF\n";
        let dev = rustix::fs::makedev(0, 0x1e);
        assert_eq!(lock_holder(locks, dev, 1234), Some(4242));
        assert_eq!(
            lock_holder(locks, dev, 99),
            None,
            "a POSIX lock is not ours"
        );
        assert_eq!(
            lock_holder(locks, rustix::fs::makedev(0xfd, 1), 1234),
            Some(5151)
        );
    }

    #[test]
    fn removing_an_absent_directory_is_nothing() {
        let dir = std::env::temp_dir().join("kp-socklb-no-such-pins");
        assert_eq!(remove(&dir).expect("absent"), 0);
    }
}
