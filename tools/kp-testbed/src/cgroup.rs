//! A cgroup v2 directory of a test's own, for programs attached to a cgroup (the socket load
//! balancer's): [`TestCgroup`] creates `<root>/<prefix><pid>-<n>`, can move the test process
//! into it and back, and removes it on drop, so a failed or panicking test leaves nothing
//! behind. Directories of runs that were killed (named for a process that is gone) are
//! removed by the next [`TestCgroup::create`] with the same prefix.
//!
//! A socket belongs to the cgroup its creator was in when it was created: sockets a test
//! makes before [`TestCgroup::enter`] are outside (a control), those made after are inside.
//!
//! [`detach_link`] detaches a pinned program link from its cgroup and leaves the pin, as
//! another program (`bpftool link detach`) would.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, TestbedError};

/// Where cgroup v2 is mounted on these machines beside the v1 controllers.
pub const UNIFIED: &str = "/sys/fs/cgroup/unified";

static NEXT: AtomicU64 = AtomicU64::new(0);

/// The cgroup v2 mount point: [`UNIFIED`] or, on a v2-only host, `/sys/fs/cgroup` (from
/// `/proc/self/mounts`); `None` where there is none.
pub fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let points: Vec<&str> = mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace().skip(1);
            let point = fields.next()?;
            (fields.next()? == "cgroup2").then_some(point)
        })
        .collect();
    let pick = points.iter().find(|p| **p == UNIFIED).or(points.first())?;
    Some(PathBuf::from(pick))
}

/// One cgroup v2 directory; see the module docs.
#[derive(Debug)]
pub struct TestCgroup {
    path: PathBuf,
    /// The cgroup this process came from, while it is inside.
    home: Option<PathBuf>,
}

impl TestCgroup {
    /// Creates `<cgroup2 root>/<prefix><pid>-<n>` (after removing stale ones of `prefix`).
    pub fn create(prefix: &str) -> Result<Self> {
        let root = cgroup2_root().ok_or_else(|| TestbedError::Cgroup {
            action: "find the mount of",
            path: PathBuf::from("/proc/self/mounts"),
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        sweep_stale(&root, prefix);
        let run = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = root.join(format!("{prefix}{}-{run}", std::process::id()));
        std::fs::create_dir(&path).map_err(cgroup_error("create", &path))?;
        Ok(Self { path, home: None })
    }

    /// The directory (to attach programs to).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves this whole process (every thread) into the cgroup.
    pub fn enter(&mut self) -> Result<()> {
        if self.home.is_some() {
            return Ok(());
        }
        let home = own_cgroup()?;
        move_self(&self.path)?;
        self.home = Some(home);
        Ok(())
    }

    /// Moves this process back where it was before [`Self::enter`].
    pub fn leave(&mut self) -> Result<()> {
        if let Some(home) = self.home.take() {
            move_self(&home)?;
        }
        Ok(())
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let left = self.leave();
        let removed = std::fs::remove_dir(&self.path);
        if left.is_err() || removed.is_err() {
            eprintln!(
                "kp-testbed: cgroup {} not cleaned up: {left:?} {removed:?}",
                self.path.display()
            );
        }
    }
}

fn cgroup_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TestbedError {
    let path = path.to_owned();
    move |source| TestbedError::Cgroup {
        action,
        path,
        source,
    }
}

/// This process's cgroup v2 directory (`0::<path>` in `/proc/self/cgroup`).
fn own_cgroup() -> Result<PathBuf> {
    let file = Path::new("/proc/self/cgroup");
    let text = std::fs::read_to_string(file).map_err(cgroup_error("read", file))?;
    let relative = text
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .ok_or_else(|| {
            cgroup_error("find the v2 line in", file)(std::io::ErrorKind::NotFound.into())
        })?;
    let root = cgroup2_root().unwrap_or_else(|| PathBuf::from(UNIFIED));
    Ok(root.join(relative.trim_start_matches('/')))
}

fn move_self(cgroup: &Path) -> Result<()> {
    let procs = cgroup.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string()).map_err(cgroup_error("enter", &procs))
}

/// Removes `<root>/<prefix><pid>-<n>` directories whose process is gone (an empty cgroup
/// is removed with rmdir; one still holding processes stays).
fn sweep_stale(root: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// `bpf(BPF_OBJ_GET)` on the pin, then `bpf(BPF_LINK_DETACH)` on the link: what
/// `bpftool link detach` does, through perl's `syscall` (the workspace forbids `unsafe`,
/// aya has no such call, and bpftool is not packaged everywhere). Arguments: the bpf
/// syscall's number, the pin.
const DETACH_LINK: &str = r#"
my ($nr, $path) = @ARGV;
my $get = pack("Q L L l", unpack("Q", pack("p", $path)), 0, 0, 0);
my $fd = syscall($nr, 7, $get, length($get));
die "BPF_OBJ_GET $path: $!\n" if $fd < 0;
my $detach = pack("L", $fd);
syscall($nr, 34, $detach, length($detach)) == 0 or die "BPF_LINK_DETACH $path: $!\n";
"#;

/// The bpf syscall's number on this architecture (for perl's `syscall`).
pub fn bpf_syscall() -> Option<&'static str> {
    match std::env::consts::ARCH {
        "x86_64" => Some("321"),
        "aarch64" => Some("280"),
        _ => None,
    }
}

/// Detaches the BPF link pinned at `pin` from its cgroup (or whatever it is attached to),
/// leaving the pin and the link object: the program stops running, and only the link's
/// fdinfo (`cgroup_id: 0`) tells.
pub fn detach_link(pin: &Path) -> Result<()> {
    let nr = bpf_syscall().ok_or_else(|| TestbedError::Cgroup {
        action: "detach a link (no bpf syscall number for this architecture) at",
        path: pin.to_owned(),
        source: std::io::Error::from(std::io::ErrorKind::Unsupported),
    })?;
    let mut command = std::process::Command::new("perl");
    command.args(["-e", DETACH_LINK, nr]).arg(pin);
    crate::command::run_checked(&mut command, None, std::time::Duration::from_secs(10))?;
    Ok(())
}
