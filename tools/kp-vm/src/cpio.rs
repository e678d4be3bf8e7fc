//! A minimal writer for the `newc` cpio format, the only format the kernel's initramfs
//! unpacker reads. Entries are written in the order given; the caller lists parent
//! directories before their children (the unpacker does not create missing parents).

use std::io::{self, Write};

/// `S_IFDIR`, `S_IFREG`, `S_IFLNK` from `<sys/stat.h>`.
const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;

/// Streams `newc` entries into `out`, numbering inodes itself.
#[derive(Debug)]
pub struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

impl<W: Write> CpioWriter<W> {
    /// A writer that appends to `out`.
    pub fn new(out: W) -> Self {
        Self {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    /// A directory with permission bits `perm` (for example `0o755`).
    pub fn dir(&mut self, name: &str, perm: u32) -> io::Result<()> {
        self.entry(name, S_IFDIR | (perm & 0o7777), 2, &[])
    }

    /// A regular file.
    pub fn file(&mut self, name: &str, perm: u32, data: &[u8]) -> io::Result<()> {
        self.entry(name, S_IFREG | (perm & 0o7777), 1, data)
    }

    /// A symbolic link to `target`.
    pub fn symlink(&mut self, name: &str, target: &str) -> io::Result<()> {
        self.entry(name, S_IFLNK | 0o777, 1, target.as_bytes())
    }

    /// Writes the trailer and returns the inner writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry("TRAILER!!!", 0, 1, &[])?;
        Ok(self.out)
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, data: &[u8]) -> io::Result<()> {
        let name = name.trim_start_matches('/');
        let name = if name.is_empty() { "." } else { name };
        let size = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "file over 4 GiB"))?;
        let namesize = u32::try_from(name.len() + 1)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name too long"))?;
        let ino = if name == "TRAILER!!!" {
            0
        } else {
            self.next_ino
        };
        self.next_ino += 1;
        // magic, ino, mode, uid, gid, nlink, mtime, filesize, devmajor, devminor, rdevmajor,
        // rdevminor, namesize, check: all but the magic are 8 hex digits.
        let header = format!(
            "070701{ino:08x}{mode:08x}{:08x}{:08x}{nlink:08x}{:08x}{size:08x}{:08x}{:08x}{:08x}{:08x}{namesize:08x}{:08x}",
            0, 0, 0, 0, 0, 0, 0, 0
        );
        self.put(header.as_bytes())?;
        self.put(name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    /// Header plus name, and file data, are each padded to a multiple of four bytes.
    fn pad(&mut self) -> io::Result<()> {
        let rem = (self.written % 4) as usize;
        if rem != 0 {
            self.put(&[0; 3][..4 - rem])?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A newc header from its 13 fields as listed in the format: ino, mode, uid, gid, nlink,
    /// mtime, filesize, devmajor, devminor, rdevmajor, rdevminor, namesize, check.
    fn header(ino: u32, mode: u32, nlink: u32, size: u32, namesize: u32) -> String {
        let fields = [ino, mode, 0, 0, nlink, 0, size, 0, 0, 0, 0, namesize, 0];
        let hex: String = fields.iter().map(|f| format!("{f:08X}")).collect();
        format!("070701{hex}").to_lowercase()
    }

    #[test]
    fn writes_newc_entries_byte_for_byte() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("/bin", 0o755).expect("dir");
        w.file("/bin/x", 0o755, b"hi").expect("file");
        w.symlink("/sh", "bin/x").expect("link");
        let out = w.finish().expect("finish");
        assert_eq!(header(1, 0o040755, 2, 0, 4).len(), 110);
        let expected = [
            // 110-byte header + "bin\0" = 114, padded to 116
            header(1, 0o040755, 2, 0, 4),
            "bin\0\0\0".into(),
            // header + "bin/x\0" = 116; data "hi" padded to 4
            header(2, 0o100755, 1, 2, 6),
            "bin/x\0hi\0\0".into(),
            // header + "sh\0" = 113, padded to 116; target "bin/x" padded to 8
            header(3, 0o120777, 1, 5, 3),
            "sh\0\0\0\0bin/x\0\0\0".into(),
            header(0, 0, 1, 0, 11),
            "TRAILER!!!\0\0\0\0".into(),
        ]
        .concat();
        assert_eq!(String::from_utf8(out.clone()).expect("ascii"), expected);
        assert_eq!(out.len() % 4, 0);
    }
}
