//! Runs one host executable inside a throwaway QEMU VM booted with Debian's kernel, and
//! returns its output and exit status.
//!
//! The machine's own kernel may lack features kube-proxy needs (IPVS, SCTP sockets); Debian's
//! `linux-image-amd64` has them as modules. Tests that need them re-run their own test binary
//! inside the VM (see [`Vm::run_current_exe`]) with [`GUEST_ENV`] set, in one boot per suite.
//!
//! What the host needs (Debian packages): `qemu-system-x86`, `busybox-static`, `kmod`,
//! `xz-utils`, plus apt itself to download the kernel package once into a cache
//! (`$KP_VM_CACHE`, default `$XDG_CACHE_HOME/kube-proxy-rs/vm` or `~/.cache/kube-proxy-rs/vm`).
//! Anything missing is an error that names the packages: suites fail, they never skip.
//!
//! Environment knobs: `KP_VM_CACHE`, `KP_VM_KERNEL_PKG` (a specific `linux-image-*` package),
//! `KP_VM_TIMEOUT` (seconds, default [`DEFAULT_TIMEOUT`]), `KP_VM_ACCEL` (`tcg`, `kvm`,
//! default `auto`), `KP_VM_VERBOSE=1` (print the guest console), `KP_VM_MEMORY_MIB` (guest
//! RAM besides the initramfs), and for `kp-vm-run`: `KP_VM_PROGRAMS` and `KP_VM_DIRS`
//! (space-separated programs and directories to copy in).

mod cpio;
mod error;
mod exec;
mod image;
mod init;
mod kernel;
mod modules;

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub use error::VmError;
pub use image::Image;
pub use kernel::Kernel;

/// Set (to `1`) in the guest's environment: tests read it through [`in_guest`].
pub const GUEST_ENV: &str = "KP_VM_GUEST";

/// How long a VM may run before it is killed. Generous: one boot runs a whole suite under
/// software emulation on a shared 2-core machine; a hung guest still ends.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(900);

/// Guest RAM besides what the initramfs occupies (it is unpacked into RAM, roughly 3 times
/// over while booting). 512 MiB leaves room for the test's own allocations and netns.
const BASE_MEMORY_MIB: u64 = 512;

/// Modules loaded before the command runs; the rest load on demand through the guest's
/// modprobe (IPVS schedulers, nf_tables expressions, SCTP).
pub const DEFAULT_MODULES: &[&str] = &["ip_vs", "nf_conntrack", "dummy", "veth"];

/// The iptables programs kube-proxy execs (both families), all copied in by
/// [`Vm::iptables`].
pub const IPTABLES_PROGRAMS: &[&str] = &[
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
];

/// Where Debian keeps iptables' match and target plugins, which it loads at run time.
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// Environment variables passed into the guest besides the caller's own choice.
const PASSED_ENV: &[&str] = &[
    "RUST_BACKTRACE",
    "RUST_LOG",
    "RUST_TEST_THREADS",
    "RUST_TEST_NOCAPTURE",
    "CI",
    "INSTA_UPDATE",
];

/// Whether this process runs inside a kp-vm guest.
pub fn in_guest() -> bool {
    std::env::var_os(GUEST_ENV).is_some_and(|v| v == "1")
}

/// What the program did inside the VM.
#[derive(Clone, Debug)]
pub struct VmOutput {
    /// The program's stdout.
    pub stdout: Vec<u8>,
    /// The program's stderr.
    pub stderr: Vec<u8>,
    /// The program's exit status (128 + signal number when it was killed by a signal).
    pub status: i32,
    /// The guest's console: kernel and init messages.
    pub console: String,
    /// Wall time from starting QEMU to its exit.
    pub elapsed: Duration,
}

impl VmOutput {
    /// libtest's last `test result:` line in stdout as (passed, failed), if there is one.
    pub fn libtest_counts(&self) -> Option<(usize, usize)> {
        let text = String::from_utf8_lossy(&self.stdout);
        let line = text.lines().rev().find(|l| l.starts_with("test result:"))?;
        let count = |word: &str| -> Option<usize> {
            let before = line.split(word).next()?;
            before
                .rsplit(|c: char| !c.is_ascii_digit())
                .find(|s| !s.is_empty())?
                .parse()
                .ok()
        };
        Some((count(" passed")?, count(" failed")?))
    }

    /// Panics (with the guest's output) unless the program exited 0 after libtest ran at
    /// least `min_passed` tests and none failed: a suite that ran nothing is a failure too.
    pub fn assert_tests_passed(&self, min_passed: usize) {
        let stdout = String::from_utf8_lossy(&self.stdout);
        let stderr = String::from_utf8_lossy(&self.stderr);
        let report = format!("--- guest stdout ---\n{stdout}--- guest stderr ---\n{stderr}");
        println!("{report}");
        let counts = self.libtest_counts();
        assert!(
            self.status == 0 && counts.is_some_and(|(p, f)| p >= min_passed && f == 0),
            "the suite inside the VM failed (exit status {}, passed/failed {counts:?}, expected at least {min_passed} passed):\n{report}",
            self.status
        );
    }
}

/// A VM configuration; [`Vm::from_env`] reads the knobs described in the crate docs.
#[derive(Clone, Debug)]
pub struct Vm {
    cache: PathBuf,
    kernel_package: Option<String>,
    timeout: Duration,
    accel: String,
    verbose: bool,
    memory_mib: u64,
    modules: Vec<String>,
    programs: Vec<String>,
    directories: Vec<PathBuf>,
    trees: Vec<PathBuf>,
    env: Vec<(String, String)>,
}

impl Vm {
    /// The defaults, adjusted by the `KP_VM_*` environment variables.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let cache = var("KP_VM_CACHE").map(PathBuf::from).unwrap_or_else(|| {
            let base = var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
                PathBuf::from(var("HOME").unwrap_or_else(|| "/root".into())).join(".cache")
            });
            base.join("kube-proxy-rs").join("vm")
        });
        Self {
            cache,
            kernel_package: var("KP_VM_KERNEL_PKG"),
            timeout: var("KP_VM_TIMEOUT")
                .and_then(|s| s.parse().ok())
                .map_or(DEFAULT_TIMEOUT, Duration::from_secs),
            accel: var("KP_VM_ACCEL").unwrap_or_else(|| "auto".into()),
            verbose: var("KP_VM_VERBOSE").is_some_and(|v| v == "1"),
            memory_mib: var("KP_VM_MEMORY_MIB")
                .and_then(|s| s.parse().ok())
                .unwrap_or(BASE_MEMORY_MIB),
            modules: DEFAULT_MODULES.iter().map(|m| (*m).to_owned()).collect(),
            programs: std::iter::once("ip".to_owned())
                .chain(
                    var("KP_VM_PROGRAMS")
                        .iter()
                        .flat_map(|v| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>()),
                )
                .collect(),
            directories: var("KP_VM_DIRS")
                .iter()
                .flat_map(|v| v.split_whitespace().map(PathBuf::from).collect::<Vec<_>>())
                .collect(),
            trees: Vec::new(),
            env: Vec::new(),
        }
    }

    /// Also copy host program `name` (looked up on PATH, or an absolute path) into the guest,
    /// with its libraries. A program that is not installed makes [`Vm::run`] fail.
    pub fn program(mut self, name: &str) -> Self {
        self.programs.push(name.to_owned());
        self
    }

    /// Also copy the [`IPTABLES_PROGRAMS`] and their plugin directory: what the iptables,
    /// ipvs and userspace modes exec.
    pub fn iptables(mut self) -> Self {
        self = self.directory(XTABLES_DIR);
        for name in IPTABLES_PROGRAMS {
            self = self.program(name);
        }
        self
    }

    /// Also copy every file below host directory `path` (at the same place), with the
    /// libraries each needs: plugin directories such as iptables' `xtables`.
    pub fn directory(mut self, path: impl Into<PathBuf>) -> Self {
        self.directories.push(path.into());
        self
    }

    /// Also copy host directory `path` as it is (links kept, no libraries added), at the same
    /// place: a whole root file system to chroot into, such as the runtime image's. It is
    /// unpacked into guest RAM, which grows by its size.
    pub fn tree(mut self, path: impl Into<PathBuf>) -> Self {
        self.trees.push(path.into());
        self
    }

    /// Kill the VM after `timeout` instead of [`DEFAULT_TIMEOUT`] (`KP_VM_TIMEOUT` still
    /// wins when set): a suite's own bound.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        if std::env::var_os("KP_VM_TIMEOUT").is_none_or(|v| v.is_empty()) {
            self.timeout = timeout;
        }
        self
    }

    /// Guest RAM besides the initramfs, in MiB (`KP_VM_MEMORY_MIB` still wins when set): for
    /// programs that need more than the default 512.
    pub fn memory_mib(mut self, mib: u64) -> Self {
        if std::env::var_os("KP_VM_MEMORY_MIB").is_none_or(|v| v.is_empty()) {
            self.memory_mib = mib;
        }
        self
    }

    /// Also load kernel module `name` at boot.
    pub fn module(mut self, name: &str) -> Self {
        self.modules.push(name.to_owned());
        self
    }

    /// Set an environment variable for the program.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Runs this test executable again inside the VM with `args` (libtest's), marked with
    /// [`GUEST_ENV`].
    pub fn run_current_exe(&self, args: &[&str]) -> Result<VmOutput, VmError> {
        let exe = std::env::current_exe().map_err(VmError::io("current executable"))?;
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        self.run(&exe, &args)
    }

    /// Boots the VM, runs `exe args` inside it (at the same absolute path as on the host),
    /// and returns its output once the VM has powered off.
    pub fn run(&self, exe: &Path, args: &[OsString]) -> Result<VmOutput, VmError> {
        check_host_tools()?;
        let kernel = kernel::prepare(&self.cache, self.kernel_package.as_deref())?;
        let work = WorkDir::new()?;
        let initrd = work.path.join("initrd.cpio");
        self.build_image(&kernel, exe, args)?
            .write_cpio(std::io::BufWriter::new(
                fs::File::create(&initrd).map_err(VmError::io(&initrd))?,
            ))?;
        let size_mib = fs::metadata(&initrd).map_err(VmError::io(&initrd))?.len() >> 20;
        self.boot(
            &kernel,
            &initrd,
            self.memory_mib + 3 * (size_mib + 1),
            &work.path,
        )
    }

    fn build_image(
        &self,
        kernel: &Kernel,
        exe: &Path,
        args: &[OsString],
    ) -> Result<Image, VmError> {
        let mut image = Image::new();
        for dir in [
            "/proc", "/sys", "/dev", "/run", "/tmp", "/root", "/etc", "/vm", "/var/run",
        ] {
            image.dir(dir);
        }
        image.host_tree(
            &format!("/lib/modules/{}", kernel.release),
            &kernel.modules.join("lib/modules").join(&kernel.release),
        )?;
        let kmod = which("kmod")?;
        image.program(&kmod)?;
        let kmod = kmod.to_string_lossy().into_owned();
        for link in ["/sbin/modprobe", "/sbin/insmod", "/sbin/lsmod"] {
            image.symlink(link, &kmod);
        }
        for name in &self.programs {
            image.program(&which(name)?)?;
        }
        for dir in &self.directories {
            image.program_tree(dir)?;
        }
        for tree in &self.trees {
            image.copy_tree(&tree.to_string_lossy(), tree)?;
        }
        let exe = fs::canonicalize(exe).map_err(VmError::io(exe))?;
        image.program(&exe)?;
        // glibc loads these with dlopen (thread cancellation, NSS "files"), so ldd misses them.
        for lib in [
            "/lib/x86_64-linux-gnu/libgcc_s.so.1",
            "/lib/x86_64-linux-gnu/libnss_files.so.2",
        ] {
            if Path::new(lib).exists() && !image.contains(lib) {
                image.host_file(lib, Path::new(lib))?;
            }
        }
        image.bytes(
            "/etc/passwd",
            0o644,
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        );
        image.bytes("/etc/group", 0o644, "root:x:0:\nnogroup:x:65534:\n");
        image.bytes("/etc/hosts", 0o644, "127.0.0.1 localhost\n::1 localhost\n");
        image.bytes(
            "/etc/nsswitch.conf",
            0o644,
            "passwd: files\ngroup: files\nhosts: files\nprotocols: files\nservices: files\n",
        );
        for file in ["/etc/protocols", "/etc/services"] {
            if Path::new(file).exists() {
                image.host_file(file, Path::new(file))?;
            }
        }

        let mut env: Vec<(String, String)> = PASSED_ENV
            .iter()
            .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
            .collect();
        env.extend(self.env.iter().cloned());
        env.push((GUEST_ENV.to_owned(), "1".to_owned()));
        let mut argv = vec![exe.to_string_lossy().into_owned()];
        argv.extend(args.iter().map(|a| a.to_string_lossy().into_owned()));
        let cwd = std::env::current_dir()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "/".into());
        image.bytes(
            "/vm/command.sh",
            0o644,
            init::command_script(&argv, &env, &cwd),
        );
        image.bytes("/init", 0o755, init::init_script(&self.modules));

        // busybox last: its applets fill only the places no real program took.
        image.host_file("/bin/busybox", Path::new(BUSYBOX))?;
        let applets = exec::run(BUSYBOX, &["--list-full"], None)?;
        for applet in String::from_utf8_lossy(&applets).lines() {
            let path = format!("/{}", applet.trim_start_matches('/'));
            if !image.contains(&path) {
                image.symlink(&path, "/bin/busybox");
            }
        }
        Ok(image)
    }

    fn boot(
        &self,
        kernel: &Kernel,
        initrd: &Path,
        memory_mib: u64,
        work: &Path,
    ) -> Result<VmOutput, VmError> {
        let file = |name: &str| work.join(name);
        for name in ["console", "status", "stdout", "stderr"] {
            fs::write(file(name), b"").map_err(VmError::io(file(name)))?;
        }
        let chardev = |id: &str, name: &str| format!("file,id={id},path={}", file(name).display());
        let accel = match self.accel.as_str() {
            "kvm" => "kvm",
            "tcg" => "tcg",
            _ if hardware_kvm() => "kvm",
            _ => "tcg",
        };
        let mut qemu = Command::new(QEMU);
        qemu.args([
            "-M",
            "pc",
            "-accel",
            accel,
            "-cpu",
            if accel == "kvm" { "host" } else { "max" },
        ])
        .args(["-smp", "1", "-m", &memory_mib.to_string()])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(initrd)
        // cryptomgr.notests: the boot-time crypto self-tests cost ~0.5 s under emulation.
        .args([
            "-append",
            "console=ttyS0 quiet panic=-1 rdinit=/init cryptomgr.notests",
        ])
        .args([
            "-chardev",
            &chardev("con", "console"),
            "-serial",
            "chardev:con",
        ])
        .args([
            "-chardev",
            &chardev("st", "status"),
            "-serial",
            "chardev:st",
        ])
        .args(["-device", "virtio-serial-pci,id=vs"])
        .args(["-chardev", &chardev("out", "stdout")])
        .args([
            "-device",
            "virtserialport,bus=vs.0,nr=1,chardev=out,name=stdout",
        ])
        .args(["-chardev", &chardev("err", "stderr")])
        .args([
            "-device",
            "virtserialport,bus=vs.0,nr=2,chardev=err,name=stderr",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let started = Instant::now();
        let mut child = qemu.spawn().map_err(|e| VmError::Command {
            command: QEMU.into(),
            message: e.to_string(),
        })?;
        let mut timed_out = false;
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if started.elapsed() > self.timeout => {
                    let _ = child.kill();
                    timed_out = true;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(VmError::io("qemu")(e)),
            }
        }
        let qemu_out = child.wait_with_output().map_err(VmError::io("qemu"))?;
        let elapsed = started.elapsed();
        let read = |name: &str| fs::read(file(name)).map_err(VmError::io(file(name)));
        let console = String::from_utf8_lossy(&read("console")?).replace('\r', "");
        if self.verbose {
            eprintln!(
                "----- kp-vm console ({:.1} s) -----\n{console}-----",
                elapsed.as_secs_f64()
            );
        }
        if timed_out {
            return Err(VmError::Timeout {
                seconds: self.timeout.as_secs(),
                console,
            });
        }
        let status_text = String::from_utf8_lossy(&read("status")?).into_owned();
        let status = status_text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .and_then(|l| l.parse::<i32>().ok());
        match status {
            Some(status) if status != init::INIT_FAILED => Ok(VmOutput {
                stdout: read("stdout")?,
                stderr: read("stderr")?,
                status,
                console,
                elapsed,
            }),
            _ => Err(VmError::NoStatus {
                qemu: format!(
                    "{}: {}",
                    qemu_out.status,
                    String::from_utf8_lossy(&qemu_out.stderr).trim()
                ),
                console,
            }),
        }
    }
}

const QEMU: &str = "qemu-system-x86_64";
const BUSYBOX: &str = "/bin/busybox";

/// A hardware KVM (not a nested paravirtual one, which cannot boot a stock kernel).
fn hardware_kvm() -> bool {
    let module = |m: &str| Path::new("/sys/module").join(m).exists();
    Path::new("/dev/kvm").exists()
        && !module("kvm_pvm")
        && (module("kvm_intel") || module("kvm_amd"))
}

/// Fails with the Debian packages to install when a host tool is missing.
fn check_host_tools() -> Result<(), VmError> {
    let mut tools = Vec::new();
    let mut packages = Vec::new();
    let mut need = |ok: bool, tool: &str, package: &str| {
        if !ok {
            tools.push(tool.to_owned());
            packages.push(package.to_owned());
        }
    };
    need(which(QEMU).is_ok(), QEMU, "qemu-system-x86");
    // busybox must be static: the guest has no libraries for it when init starts.
    let static_busybox = Path::new(BUSYBOX).exists()
        && exec::output("ldd", &[BUSYBOX], None).is_ok_and(|o| !o.status.success());
    need(static_busybox, "a static /bin/busybox", "busybox-static");
    need(
        which("kmod").is_ok() && which("depmod").is_ok(),
        "kmod/depmod",
        "kmod",
    );
    need(which("xz").is_ok(), "xz", "xz-utils");
    need(
        which("apt-get").is_ok() && which("dpkg-deb").is_ok(),
        "apt-get/dpkg-deb",
        "apt",
    );
    if tools.is_empty() {
        Ok(())
    } else {
        Err(VmError::Missing {
            tools: tools.join(", "),
            packages: packages.join(" "),
        })
    }
}

/// `name` on PATH (plus the sbin directories, which a non-root PATH may lack).
fn which(name: &str) -> Result<PathBuf, VmError> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(missing_program(name))
        };
    }
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| missing_program(name))
}

fn missing_program(name: &str) -> VmError {
    VmError::Missing {
        tools: format!("`{name}`"),
        packages: format!("<the package providing {name}>"),
    }
}

/// A scratch directory removed on drop, even when the run fails.
struct WorkDir {
    path: PathBuf,
}

impl WorkDir {
    fn new() -> Result<Self, VmError> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "kp-vm-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&path).map_err(VmError::io(&path))?;
        Ok(Self { path })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}
