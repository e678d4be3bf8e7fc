//! The embedded programs: loaded into the kernel, attached to a cgroup v2 directory,
//! detached when [`SocketPrograms`] is dropped (the kernel also detaches them when the
//! process exits, so a crashed proxy leaves no translation behind: nftables mode's rules,
//! which stay fully programmed, serve the sockets meanwhile).

use std::fs::File;
use std::path::{Path, PathBuf};

use aya::maps::HashMap as BpfHashMap;
use aya::programs::{CgroupAttachMode, CgroupSockAddr, CgroupSockAddrAttachType, Program};
use aya::{Btf, Ebpf, EbpfLoader};

use crate::destroy::{DestroyUnavailable, Destroyer, prepare_object};
use crate::error::{
    AttachError, CGROUP2_SUPER_MAGIC, LoadError, Unavailable, kernel_is_recent, permission_denied,
};
use crate::layout::{SERVICES_MAP, SERVICES6_MAP, SLOTS_MAP, SLOTS6_MAP};
use crate::maps::{ByteMap, KernelMaps};

/// `bpf/socklb.bpf.c`, compiled by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/socklb.bpf.o"));

/// The embedded object, as compiled (before [`prepare_object`] patches it).
#[cfg(test)]
pub(crate) fn object() -> &'static [u8] {
    OBJECT
}

/// Each program's function name and hook.
pub const PROGRAMS: [(&str, CgroupSockAddrAttachType); 8] = [
    ("kp_connect4", CgroupSockAddrAttachType::Connect4),
    ("kp_sendmsg4", CgroupSockAddrAttachType::UDPSendMsg4),
    ("kp_recvmsg4", CgroupSockAddrAttachType::UDPRecvMsg4),
    ("kp_getpeername4", CgroupSockAddrAttachType::GetPeerName4),
    ("kp_connect6", CgroupSockAddrAttachType::Connect6),
    ("kp_sendmsg6", CgroupSockAddrAttachType::UDPSendMsg6),
    ("kp_recvmsg6", CgroupSockAddrAttachType::UDPRecvMsg6),
    ("kp_getpeername6", CgroupSockAddrAttachType::GetPeerName6),
];

/// The programs, loaded; attached to at most one cgroup.
#[derive(Debug)]
pub struct SocketPrograms {
    pub(crate) ebpf: Ebpf,
    attached: Option<PathBuf>,
    /// The socket iterators that destroy sockets of removed endpoints, or why this kernel
    /// cannot run them (`destroy.rs`).
    pub(crate) destroyer: Result<Destroyer, DestroyUnavailable>,
}

impl SocketPrograms {
    /// Loads the programs and their maps (empty: nothing is translated yet).
    pub fn load() -> Result<(Self, KernelMaps), LoadError> {
        check_kernel()?;
        let btf = Btf::from_sys_fs();
        let object = prepare_object(OBJECT, btf.as_ref());
        let mut ebpf = EbpfLoader::new()
            .btf(btf.as_ref().ok())
            .load(object.bytes())
            .map_err(|error| classify(error, LoadError::Object))?;
        for (name, _) in PROGRAMS {
            program(&mut ebpf, name)?
                .load()
                .map_err(|source| classify(source, |source| LoadError::Program { name, source }))?;
        }
        let maps = KernelMaps {
            services: take_map(&mut ebpf, SERVICES_MAP)?,
            slots: take_map(&mut ebpf, SLOTS_MAP)?,
            services6: take_map(&mut ebpf, SERVICES6_MAP)?,
            slots6: take_map(&mut ebpf, SLOTS6_MAP)?,
        };
        let destroyer = Destroyer::load_if(object.kfunc, &mut ebpf, btf.as_ref());
        Ok((
            Self {
                ebpf,
                attached: None,
                destroyer,
            },
            maps,
        ))
    }

    /// Attaches every program to `cgroup`, a cgroup v2 directory: sockets created by
    /// processes in it or below it are then translated.
    pub fn attach(&mut self, cgroup: &Path) -> Result<(), AttachError> {
        check_cgroup2(cgroup)?;
        let open = |source| AttachError::Open {
            path: cgroup.to_owned(),
            source,
        };
        let dir = File::open(cgroup).map_err(open)?;
        for (name, _) in PROGRAMS {
            let attach = |source| AttachError::Attach {
                name,
                path: cgroup.to_owned(),
                source,
            };
            let program = program(&mut self.ebpf, name)
                .map_err(|_| attach(aya::programs::ProgramError::NotLoaded))?;
            // `Single` is flags 0, which a cgroup bpf_link needs (EINVAL otherwise); a link
            // still runs beside other programs attached to the cgroup, as with ALLOW_MULTI.
            program
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(attach)?;
        }
        self.attached = Some(cgroup.to_owned());
        Ok(())
    }

    /// The cgroup the programs are attached to.
    pub fn attached(&self) -> Option<&Path> {
        self.attached.as_deref()
    }

    /// The kernel's ids of the loaded programs (as `bpftool prog` lists them).
    pub fn program_ids(&self) -> Vec<u32> {
        self.ebpf
            .programs()
            .filter_map(|(_, program)| program.info().ok())
            .map(|info| info.id())
            .collect()
    }
}

/// [`Unavailable::NotPermitted`] if the kernel said EPERM anywhere in `error`, else `other`.
fn classify<E>(error: E, other: impl FnOnce(E) -> LoadError) -> LoadError
where
    E: std::error::Error + 'static,
{
    match permission_denied(&error) {
        Some(source) => Unavailable::NotPermitted { source }.into(),
        None => other(error),
    }
}

fn check_kernel() -> Result<(), Unavailable> {
    let release = rustix::system::uname()
        .release()
        .to_string_lossy()
        .into_owned();
    match kernel_is_recent(&release) {
        Some(false) => Err(Unavailable::KernelTooOld { release }),
        // An unparsable release: let the kernel's own answers decide.
        Some(true) | None => Ok(()),
    }
}

/// Whether `path` is in a cgroup v2 hierarchy.
pub fn check_cgroup2(path: &Path) -> Result<(), Unavailable> {
    let not = || Unavailable::NotCgroup2 {
        path: path.to_owned(),
    };
    let stat = rustix::fs::statfs(path).map_err(|_| not())?;
    // `f_type`'s integer type differs between targets.
    #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
    let magic = stat.f_type as u64;
    if magic == CGROUP2_SUPER_MAGIC {
        Ok(())
    } else {
        Err(not())
    }
}

fn program<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut CgroupSockAddr, LoadError> {
    let missing = LoadError::Missing {
        what: "program",
        name,
    };
    match ebpf.program_mut(name) {
        Some(Program::CgroupSockAddr(program)) => Ok(program),
        _ => Err(missing),
    }
}

fn take_map<const K: usize, const V: usize>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<ByteMap<K, V>, LoadError> {
    let map = ebpf
        .take_map(name)
        .ok_or(LoadError::Missing { what: "map", name })?;
    BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name, source })
}
