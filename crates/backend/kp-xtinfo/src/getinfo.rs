//! `IPT_SO_GET_INFO` / `IP6T_SO_GET_INFO` on a raw socket.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

/// `XT_TABLE_MAXNAMELEN`: a table name and its NUL.
const NAME_LEN: usize = 32;
/// `NF_INET_NUMHOOKS`.
const HOOKS: usize = 5;
/// `IPT_SO_GET_INFO` and `IP6T_SO_GET_INFO` (both `*_BASE_CTL`).
const SO_GET_INFO: libc::c_int = 64;

/// Which table family to ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `iptables` (`AF_INET`).
    V4,
    /// `ip6tables` (`AF_INET6`).
    V6,
}

/// What the kernel says of a table, without its rules. Two reads are equal when nothing was
/// added, removed or replaced in between (a rule's counters do not count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableInfo {
    /// Rules, counting each chain's head and policy and the table's end.
    pub entries: u32,
    /// Bytes of the rules.
    pub size: u32,
    /// Where each built-in chain starts (by hook).
    pub hook_entry: [u32; HOOKS],
}

/// `struct ipt_getinfo` (the same as `struct ip6t_getinfo`).
#[repr(C)]
struct GetInfo {
    name: [u8; NAME_LEN],
    valid_hooks: u32,
    hook_entry: [u32; HOOKS],
    underflow: [u32; HOOKS],
    num_entries: u32,
    size: u32,
}

/// The size of legacy table `table` (`nat`, `filter`, ...) of `family` in this network
/// namespace. Needs `CAP_NET_RAW` and `CAP_NET_ADMIN`; a table the kernel does not have is
/// `ENOENT`.
pub fn table_info(family: Family, table: &str) -> io::Result<TableInfo> {
    let mut info = GetInfo {
        name: table_name(table)?,
        valid_hooks: 0,
        hook_entry: [0; HOOKS],
        underflow: [0; HOOKS],
        num_entries: 0,
        size: 0,
    };
    let (domain, level) = match family {
        Family::V4 => (Domain::IPV4, libc::IPPROTO_IP),
        Family::V6 => (Domain::IPV6, libc::IPPROTO_IPV6),
    };
    let socket = Socket::new(
        domain,
        Type::from(libc::SOCK_RAW),
        Some(Protocol::from(libc::IPPROTO_RAW)),
    )?;
    let expected = std::mem::size_of::<GetInfo>();
    let mut len = libc::socklen_t::try_from(expected).map_err(io::Error::other)?;
    // SAFETY: `info` is a `repr(C)` copy of the kernel's struct and `len` its size; the
    // kernel writes at most `len` bytes into it, and the socket lives until the call returns.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            level,
            SO_GET_INFO,
            (&raw mut info).cast::<libc::c_void>(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if usize::try_from(len).ok() != Some(expected) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the kernel answered {len} bytes, not {expected}"),
        ));
    }
    Ok(TableInfo {
        entries: info.num_entries,
        size: info.size,
        hook_entry: info.hook_entry,
    })
}

/// `table` as the kernel's NUL-terminated name field.
fn table_name(table: &str) -> io::Result<[u8; NAME_LEN]> {
    let bytes = table.as_bytes();
    if bytes.is_empty() || bytes.len() >= NAME_LEN || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{table:?} is not a table name"),
        ));
    }
    let mut name = [0; NAME_LEN];
    name[..bytes.len()].copy_from_slice(bytes);
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_before_the_kernel_is_asked() {
        for bad in ["", "a\0b", &"x".repeat(NAME_LEN)] {
            let err = table_info(Family::V4, bad).expect_err("refused");
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }
        assert_eq!(&table_name("nat").expect("valid")[..4], b"nat\0");
    }

    #[test]
    fn the_struct_is_the_kernels() {
        // 32 + 4 + 5 * 4 + 5 * 4 + 4 + 4, no padding.
        assert_eq!(std::mem::size_of::<GetInfo>(), 84);
    }
}
