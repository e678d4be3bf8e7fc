//! Debian's kernel, unpacked once into a cache: an ELF `vmlinux` (booted directly through its
//! PVH entry point, which skips the in-guest decompression that is slow under emulation) and
//! the guest's module tree with its `modules.dep`.
//!
//! The package is fetched with `apt-get download` (no install: nothing lands in /boot), so
//! the only source is the machine's configured Debian archive.

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::VmError;
use crate::exec;
use crate::modules::ModuleDeps;

/// Debian's meta package; it depends on the current `linux-image-<abi>-amd64`.
pub const META_PACKAGE: &str = "linux-image-amd64";

/// Bumped whenever the cached layout or module selection changes, so old caches rebuild.
const CACHE_FORMAT: &str = "kp-vm-4";

/// Kernel directories copied into the guest whole: IPVS and the rest of netfilter (iptables,
/// nftables, conntrack, ipset) for both families, and SCTP.
pub const MODULE_DIRS: &[&str] = &[
    "kernel/net/netfilter/",
    "kernel/net/ipv4/netfilter/",
    "kernel/net/ipv6/netfilter/",
    "kernel/net/sctp/",
];

/// Single modules the guest needs besides [`MODULE_DIRS`]: devices for tests (the traffic
/// harness's LAN is a bridge), the virtio
/// console the program's output travels over, and crc32c (a soft dependency of libcrc32c,
/// which IPVS and SCTP need, that `modules.dep` does not list).
pub const MODULE_NAMES: &[&str] = &[
    "dummy",
    "veth",
    "bridge",
    "virtio_pci",
    "virtio_console",
    "crc32c_generic",
    "libcrc32c",
];

/// An unpacked kernel ready to boot.
#[derive(Clone, Debug)]
pub struct Kernel {
    /// The ELF kernel image.
    pub vmlinux: PathBuf,
    /// The guest's `/lib/modules/<release>` tree (selected modules and depmod's indexes).
    pub modules: PathBuf,
    /// The kernel release, for example `6.1.0-56-amd64`.
    pub release: String,
}

/// Returns the cached kernel for `package` (resolved from [`META_PACKAGE`] when `None`),
/// downloading and unpacking it on first use. Concurrent callers wait on a lock file.
pub fn prepare(cache: &Path, package: Option<&str>) -> Result<Kernel, VmError> {
    fs::create_dir_all(cache).map_err(VmError::io(cache))?;
    let lock_path = cache.join(".lock");
    let lock = fs::File::create(&lock_path).map_err(VmError::io(&lock_path))?;
    lock.lock().map_err(VmError::io(&lock_path))?;

    let package = match package {
        Some(p) => p.to_owned(),
        None => resolve_package()?,
    };
    let dir = cache.join(&package);
    let ready = dir.join("ready");
    if fs::read_to_string(&ready).ok().as_deref() != Some(CACHE_FORMAT) {
        let staging = cache.join(format!("{package}.staging"));
        if staging.exists() {
            fs::remove_dir_all(&staging).map_err(VmError::io(&staging))?;
        }
        unpack(&package, &staging)?;
        fs::write(staging.join("ready"), CACHE_FORMAT).map_err(VmError::io(&staging))?;
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(VmError::io(&dir))?;
        }
        fs::rename(&staging, &dir).map_err(VmError::io(&dir))?;
    }
    let release = fs::read_to_string(dir.join("release")).map_err(VmError::io(&dir))?;
    Ok(Kernel {
        vmlinux: dir.join("vmlinux"),
        modules: dir.join("modules"),
        release: release.trim().to_owned(),
    })
}

/// The concrete kernel package behind [`META_PACKAGE`], updating the package lists once if
/// they do not know it (a fresh container has none).
fn resolve_package() -> Result<String, VmError> {
    let resolve = || -> Result<Option<String>, VmError> {
        let out = exec::output("apt-cache", &["depends", META_PACKAGE], None)?;
        Ok(parse_depends(&String::from_utf8_lossy(&out.stdout)))
    };
    if let Some(p) = resolve()? {
        return Ok(p);
    }
    exec::run("apt-get", &["update", "-q"], None)?;
    resolve()?.ok_or_else(|| {
        VmError::Kernel(format!(
            "`apt-cache depends {META_PACKAGE}` names no kernel package (set KP_VM_KERNEL_PKG)"
        ))
    })
}

/// The first `Depends: linux-image-<digit>...` of `apt-cache depends` output.
fn parse_depends(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let pkg = line.trim().strip_prefix("Depends:")?.trim();
        let rest = pkg.strip_prefix("linux-image-")?;
        rest.starts_with(|c: char| c.is_ascii_digit())
            .then(|| pkg.to_owned())
    })
}

fn unpack(package: &str, staging: &Path) -> Result<(), VmError> {
    let download = staging.join("download");
    fs::create_dir_all(&download).map_err(VmError::io(&download))?;
    // apt drops privileges to `_apt` while downloading: the directory must be writable by it.
    let _ = exec::run("chmod", &["777", &download.to_string_lossy()], None);
    if exec::run("apt-get", &["download", "-q", package], Some(&download)).is_err() {
        // Stale lists point at a version the archive no longer has.
        exec::run("apt-get", &["update", "-q"], None)?;
        exec::run("apt-get", &["download", "-q", package], Some(&download))?;
    }
    let deb = fs::read_dir(&download)
        .map_err(VmError::io(&download))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .ok_or_else(|| VmError::Kernel(format!("apt-get download {package} left no .deb")))?;
    let root = staging.join("root");
    exec::run(
        "dpkg-deb",
        &["-x", &deb.to_string_lossy(), &root.to_string_lossy()],
        None,
    )?;
    fs::remove_dir_all(&download).map_err(VmError::io(&download))?;

    let boot = root.join("boot");
    let bzimage = fs::read_dir(&boot)
        .map_err(VmError::io(&boot))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .ok_or_else(|| VmError::Kernel(format!("{package} has no /boot/vmlinuz-*")))?;
    let release = bzimage
        .file_name()
        .map(|n| {
            n.to_string_lossy()
                .trim_start_matches("vmlinuz-")
                .to_owned()
        })
        .unwrap_or_default();
    extract_vmlinux(&bzimage, &staging.join("vmlinux"))?;

    let mut all_modules = root.join("lib/modules").join(&release);
    if !all_modules.exists() {
        all_modules = root.join("usr/lib/modules").join(&release);
    }
    select_modules(&all_modules, &staging.join("modules"), &release)?;
    fs::write(staging.join("release"), &release).map_err(VmError::io(staging))?;
    fs::remove_dir_all(&root).map_err(VmError::io(&root))?;
    Ok(())
}

/// A bzImage carries the kernel as an xz stream: decompress it to get the ELF image.
fn extract_vmlinux(bzimage: &Path, out: &Path) -> Result<(), VmError> {
    let data = fs::read(bzimage).map_err(VmError::io(bzimage))?;
    let magic = b"\xfd7zXZ\x00";
    let start = data
        .windows(magic.len())
        .position(|w| w == magic)
        .ok_or_else(|| VmError::Kernel(format!("{}: no xz payload", bzimage.display())))?;
    let file = fs::File::create(out).map_err(VmError::io(out))?;
    let mut child = Command::new("xz")
        .args(["-dc", "--single-stream"])
        .stdin(Stdio::piped())
        .stdout(file)
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| VmError::Command {
            command: "xz -dc".into(),
            message: e.to_string(),
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        // xz stops reading after the stream (the bzImage's tail follows it): a broken pipe
        // here is expected, and the ELF check below is what counts.
        let _ = stdin.write_all(&data[start..]);
    }
    let _ = child.wait();
    let head = fs::read(out).map_err(VmError::io(out))?;
    if !head.starts_with(b"\x7fELF") {
        return Err(VmError::Kernel(format!(
            "{}: the xz payload is not an ELF kernel",
            bzimage.display()
        )));
    }
    Ok(())
}

/// Copies the guest's modules ([`MODULE_DIRS`], [`MODULE_NAMES`] and their dependencies)
/// into `dest/lib/modules/<release>` and indexes them with depmod, so the guest's modprobe
/// and the kernel's on-demand loading (schedulers, nf_tables expressions) find them.
fn select_modules(all: &Path, dest: &Path, release: &str) -> Result<(), VmError> {
    exec::run(
        "depmod",
        &["-b", &all.join("../../..").to_string_lossy(), release],
        None,
    )?;
    let dep_path = all.join("modules.dep");
    let deps = ModuleDeps::parse(&fs::read_to_string(&dep_path).map_err(VmError::io(&dep_path))?);
    let chosen = deps
        .closure(MODULE_DIRS, MODULE_NAMES)
        .map_err(|missing| VmError::Kernel(format!("modules missing: {}", missing.join(", "))))?;
    let tree = dest.join("lib/modules").join(release);
    for path in &chosen {
        let to = tree.join(path);
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(VmError::io(parent))?;
        }
        fs::copy(all.join(path), &to).map_err(VmError::io(&to))?;
    }
    for extra in [
        "modules.order",
        "modules.builtin",
        "modules.builtin.modinfo",
    ] {
        let from = all.join(extra);
        if from.exists() {
            fs::copy(&from, tree.join(extra)).map_err(VmError::io(&from))?;
        }
    }
    exec::run("depmod", &["-b", &dest.to_string_lossy(), release], None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_abi_package_among_depends() {
        let text =
            "linux-image-amd64\n  Depends: linux-image-6.1.0-56-amd64\n  Recommends: firmware\n";
        assert_eq!(
            parse_depends(text),
            Some("linux-image-6.1.0-56-amd64".to_owned())
        );
        assert_eq!(
            parse_depends("linux-image-amd64\n  Depends: linux-base\n"),
            None
        );
        assert_eq!(parse_depends(""), None);
    }
}
