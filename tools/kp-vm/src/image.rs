//! The guest's root file system, assembled in memory and written as one `newc` cpio archive
//! for the kernel to unpack into its initramfs. Host programs keep their absolute paths and
//! bring the shared libraries `ldd` names for them.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use crate::cpio::CpioWriter;
use crate::error::VmError;
use crate::exec;

#[derive(Clone, Debug)]
enum Entry {
    Dir,
    Bytes(Vec<u8>, u32),
    Host(PathBuf, u32),
    Symlink(String),
}

/// The guest tree: absolute guest paths to their contents.
#[derive(Clone, Debug, Default)]
pub struct Image {
    entries: BTreeMap<String, Entry>,
}

impl Image {
    /// An empty tree (the root directory only).
    pub fn new() -> Self {
        let mut image = Self::default();
        image.entries.insert("/".into(), Entry::Dir);
        image
    }

    /// A directory and its parents.
    pub fn dir(&mut self, path: &str) {
        let mut at = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            at.push('/');
            at.push_str(part);
            self.entries.entry(at.clone()).or_insert(Entry::Dir);
        }
    }

    /// A file with the given contents.
    pub fn bytes(&mut self, path: &str, perm: u32, data: impl Into<Vec<u8>>) {
        self.parent(path);
        self.entries
            .insert(path.to_owned(), Entry::Bytes(data.into(), perm));
    }

    /// A symbolic link.
    pub fn symlink(&mut self, path: &str, target: &str) {
        self.parent(path);
        self.entries
            .insert(path.to_owned(), Entry::Symlink(target.to_owned()));
    }

    /// Whether `path` is already in the tree.
    pub fn contains(&self, path: &str) -> bool {
        self.entries.contains_key(path)
    }

    /// The host file `host` (symlinks followed) at guest path `path`, read when written.
    pub fn host_file(&mut self, path: &str, host: &Path) -> Result<(), VmError> {
        let meta = fs::metadata(host).map_err(VmError::io(host))?;
        self.parent(path);
        self.entries.insert(
            path.to_owned(),
            Entry::Host(host.to_owned(), meta.permissions().mode() & 0o7777),
        );
        Ok(())
    }

    /// Every file below host directory `host` at the same place under `path`.
    pub fn host_tree(&mut self, path: &str, host: &Path) -> Result<(), VmError> {
        self.dir(path);
        for (guest, entry, kind) in children(path, host)? {
            if kind.is_dir() {
                self.host_tree(&guest, &entry)?;
            } else {
                self.host_file(&guest, &entry)?;
            }
        }
        Ok(())
    }

    /// Every entry below host directory `host` at guest path `path`, as it is: symbolic links
    /// stay links (an absolute target then means the tree's own root once chrooted into it),
    /// directories and regular files keep their permissions. Device nodes, sockets and FIFOs
    /// are left out (a root file system gets its `/dev` mounted). For whole root file systems
    /// such as the runtime image's.
    pub fn copy_tree(&mut self, path: &str, host: &Path) -> Result<(), VmError> {
        self.dir(path);
        for (guest, entry, kind) in children(path, host)? {
            if kind.is_symlink() {
                let target = fs::read_link(&entry).map_err(VmError::io(&entry))?;
                self.symlink(&guest, &target.to_string_lossy());
            } else if kind.is_dir() {
                self.copy_tree(&guest, &entry)?;
            } else if kind.is_file() {
                self.host_file(&guest, &entry)?;
            }
        }
        Ok(())
    }

    /// A host program at its own absolute path, plus the libraries it loads.
    pub fn program(&mut self, host: &Path) -> Result<(), VmError> {
        let path = host.to_string_lossy().into_owned();
        if self.contains(&path) {
            return Ok(());
        }
        self.host_file(&path, host)?;
        for lib in libraries(host)? {
            if !self.contains(&lib) {
                self.host_file(&lib, Path::new(&lib))?;
            }
        }
        Ok(())
    }

    /// Every file below host directory `dir`, each as [`Image::program`].
    pub fn program_tree(&mut self, dir: &Path) -> Result<(), VmError> {
        for entry in fs::read_dir(dir).map_err(VmError::io(dir))? {
            let path = entry.map_err(VmError::io(dir))?.path();
            if path.is_dir() {
                self.program_tree(&path)?;
            } else if path.is_file() {
                self.program(&path)?;
            }
        }
        Ok(())
    }

    fn parent(&mut self, path: &str) {
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
    }

    /// Writes the tree as a cpio archive. Paths sort parents before children.
    pub fn write_cpio(&self, out: impl Write) -> Result<(), VmError> {
        let io = |e| VmError::Io {
            path: "initramfs".into(),
            source: e,
        };
        let mut w = CpioWriter::new(out);
        for (path, entry) in &self.entries {
            match entry {
                Entry::Dir => w.dir(path, if path == "/tmp" { 0o1777 } else { 0o755 }),
                Entry::Bytes(data, perm) => w.file(path, *perm, data),
                Entry::Symlink(target) => w.symlink(path, target),
                Entry::Host(host, perm) => {
                    let data = fs::read(host).map_err(VmError::io(host))?;
                    w.file(path, *perm, &data)
                }
            }
            .map_err(io)?;
        }
        w.finish().map_err(io)?;
        Ok(())
    }
}

/// The entries of host directory `host` as (guest path below `path`, host path, type; links
/// not followed).
fn children(path: &str, host: &Path) -> Result<Vec<(String, PathBuf, fs::FileType)>, VmError> {
    let mut out = Vec::new();
    for entry in fs::read_dir(host).map_err(VmError::io(host))? {
        let entry = entry.map_err(VmError::io(host))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let guest = format!("{}/{name}", path.trim_end_matches('/'));
        let kind = entry.file_type().map_err(VmError::io(entry.path()))?;
        out.push((guest, entry.path(), kind));
    }
    Ok(out)
}

/// The shared libraries `ldd` reports for an ELF program (nothing for a static one or a
/// script).
fn libraries(program: &Path) -> Result<Vec<String>, VmError> {
    let head = fs::read(program)
        .map(|d| d.get(..4).map(<[u8]>::to_vec).unwrap_or_default())
        .map_err(VmError::io(program))?;
    if head != b"\x7fELF" {
        return Ok(Vec::new());
    }
    let out = exec::output("ldd", &[&program.to_string_lossy()], None)?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Ok(Vec::new()); // "not a dynamic executable"
    }
    parse_ldd(&text).map_err(|ldd| VmError::Libraries {
        program: program.to_owned(),
        ldd,
    })
}

/// Absolute library paths from `ldd` output; the lines naming a missing library on error.
fn parse_ldd(text: &str) -> Result<Vec<String>, String> {
    let missing: Vec<&str> = text.lines().filter(|l| l.contains("not found")).collect();
    if !missing.is_empty() {
        return Err(missing.join("; "));
    }
    Ok(text
        .lines()
        .filter_map(|line| {
            let target = line.split_once("=>").map_or(line, |(_, t)| t);
            target
                .split_whitespace()
                .find(|w| w.starts_with('/'))
                .map(str::to_owned)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ldd_output() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            Ok(vec![
                "/lib/x86_64-linux-gnu/libc.so.6".to_owned(),
                "/lib64/ld-linux-x86-64.so.2".to_owned()
            ])
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }

    #[test]
    fn copied_trees_keep_links_and_leave_out_special_files() {
        let dir = std::env::temp_dir().join(format!("kp-vm-copy-tree-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("usr/bin")).unwrap_or_else(|e| panic!("{e}"));
        fs::write(dir.join("usr/bin/tool"), "x").unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink("usr/bin", dir.join("bin")).unwrap_or_else(|e| panic!("{e}"));
        std::os::unix::fs::symlink("/nowhere", dir.join("dangling"))
            .unwrap_or_else(|e| panic!("{e}"));
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        let mut image = Image::new();
        let copied = image.copy_tree("/r", &dir);
        let _ = fs::remove_dir_all(&dir);
        copied.unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(image.entries.get("/r/bin"), Some(Entry::Symlink(t)) if t == "usr/bin"));
        assert!(matches!(
            image.entries.get("/r/dangling"),
            Some(Entry::Symlink(_))
        ));
        assert!(matches!(
            image.entries.get("/r/usr/bin/tool"),
            Some(Entry::Host(..))
        ));
        if made.is_ok_and(|s| s.success()) {
            assert!(!image.contains("/r/fifo"));
        }
    }

    #[test]
    fn parents_come_before_children() {
        let mut image = Image::new();
        image.bytes("/a/b/c", 0o644, "x");
        image.bytes("/a-z", 0o644, "y");
        let paths: Vec<&String> = image.entries.keys().collect();
        assert_eq!(paths, ["/", "/a", "/a-z", "/a/b", "/a/b/c"]);
    }
}
