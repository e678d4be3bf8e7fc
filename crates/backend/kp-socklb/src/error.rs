//! Why the socket load balancer cannot run here, or could not load or attach.
//!
//! [`Unavailable`] is what an operator can act on (a kernel, a mount, a capability): the
//! proxy says it once and runs nftables mode alone. The other variants are bugs or
//! surprises, with the kernel's own error (and the verifier's log) as their source.

use std::path::PathBuf;

/// The oldest kernel with every hook and helper the programs use: connect (4.17), sendmsg
/// (4.18), recvmsg (5.2) and getpeername (5.8) hooks, and `bpf_set_retval` (5.18), which
/// makes a refused connect fail with ECONNREFUSED rather than EPERM.
pub const MIN_KERNEL: (u32, u32) = (5, 18);

/// The cgroup2 file system's magic number (`statfs`'s `f_type`).
pub(crate) const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;

/// Something this node lacks.
#[derive(Debug, thiserror::Error)]
pub enum Unavailable {
    /// The kernel predates a hook or helper ([`MIN_KERNEL`]).
    #[error(
        "kernel {release} is older than {}.{} (the socket load balancer needs the cgroup \
         getpeername hooks and bpf_set_retval)", MIN_KERNEL.0, MIN_KERNEL.1
    )]
    KernelTooOld {
        /// `uname -r`.
        release: String,
    },
    /// The bpf() syscall said EPERM: the process lacks CAP_BPF and CAP_NET_ADMIN (or
    /// CAP_SYS_ADMIN), or a security module forbids BPF.
    #[error(
        "not permitted to load BPF programs (needs CAP_BPF and CAP_NET_ADMIN, or \
         CAP_SYS_ADMIN)"
    )]
    NotPermitted {
        /// The syscall's error.
        #[source]
        source: std::io::Error,
    },
    /// The directory to attach to is not in a cgroup v2 hierarchy (a v1-only node, or a
    /// wrong path).
    #[error("{} is not a cgroup v2 directory (mount cgroup2 there, or choose another)", path.display())]
    NotCgroup2 {
        /// The directory.
        path: PathBuf,
    },
}

/// Loading the embedded programs failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// This node cannot run them.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The object or its maps were refused.
    #[error("cannot load the socket load balancer's BPF object")]
    Object(#[source] aya::EbpfError),
    /// A program was refused (the source carries the verifier's log).
    #[error("the kernel refused BPF program {name}")]
    Program {
        /// The program's function name.
        name: &'static str,
        /// The kernel's answer.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// The object lacks a program or map the crate expects (a build mismatch).
    #[error("the embedded BPF object has no {what} {name}")]
    Missing {
        /// "program" or "map".
        what: &'static str,
        /// Its name.
        name: &'static str,
    },
    /// A map is not of the type or sizes the crate writes.
    #[error("BPF map {name} is not as the crate expects")]
    Map {
        /// Its name.
        name: &'static str,
        /// What aya found.
        #[source]
        source: aya::maps::MapError,
    },
    /// A loaded map could not be opened again by its id.
    #[error("cannot open BPF map {name} again")]
    Reopen {
        /// Its name.
        name: &'static str,
        /// The kernel's answer.
        #[source]
        source: aya::maps::MapError,
    },
}

/// Attaching the programs to a cgroup failed.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The directory is not cgroup v2.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The directory could not be opened.
    #[error("cannot open cgroup directory {}", path.display())]
    Open {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused to attach a program there.
    #[error("cannot attach {name} to {}", path.display())]
    Attach {
        /// The program's function name.
        name: &'static str,
        /// The directory.
        path: PathBuf,
        /// The kernel's answer.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A link could not be pinned (or its predecessor's pin replaced) in bpffs.
    #[error("cannot pin the link of {name} at {}", path.display())]
    Pin {
        /// The program's function name.
        name: &'static str,
        /// The pin.
        path: PathBuf,
        /// The kernel's (or aya's) answer.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The first EPERM in `error`'s source chain, if there is one: the kernel's way of saying
/// "not permitted", whichever step met it.
pub(crate) fn permission_denied(
    error: &(dyn std::error::Error + 'static),
) -> Option<std::io::Error> {
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(io) = error.downcast_ref::<std::io::Error>()
            && io.raw_os_error() == Some(rustix::io::Errno::PERM.raw_os_error())
        {
            return Some(std::io::Error::from_raw_os_error(io.raw_os_error()?));
        }
        current = error.source();
    }
    None
}

/// Whether `release` (`uname -r`, e.g. `6.1.0-13-amd64`) is at least [`MIN_KERNEL`];
/// `None` when it does not start with `major.minor`.
pub(crate) fn kernel_is_recent(release: &str) -> Option<bool> {
    let mut parts = release.split(['.', '-']);
    let major: u32 = parts.next()?.parse().ok()?;
    let minor: u32 = parts.next()?.parse().ok()?;
    Some((major, minor) >= MIN_KERNEL)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases_compare_by_major_and_minor() {
        assert_eq!(kernel_is_recent("6.18.44-fc-v1045"), Some(true));
        assert_eq!(kernel_is_recent("5.18.0"), Some(true));
        assert_eq!(kernel_is_recent("5.10.0-26-amd64"), Some(false));
        assert_eq!(kernel_is_recent("4.19"), Some(false));
        assert_eq!(kernel_is_recent("garbage"), None);
    }

    #[test]
    fn eperm_is_found_anywhere_in_the_chain() {
        let eperm = std::io::Error::from_raw_os_error(1);
        let wrapped = AttachError::Open {
            path: "/x".into(),
            source: eperm,
        };
        assert!(permission_denied(&wrapped).is_some());
        let other = AttachError::Open {
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(2),
        };
        assert!(permission_denied(&other).is_none());
    }
}
