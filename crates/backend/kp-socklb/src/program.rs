//! The embedded programs: loaded into the kernel, attached to a cgroup v2 directory.
//!
//! Loaded with [`SocketPrograms::load`], they are detached when [`SocketPrograms`] is
//! dropped (or the process exits): nftables mode's rules, which stay fully programmed, serve
//! the sockets then. Loaded with [`SocketPrograms::load_pinned`], their maps and links are
//! pinned in bpffs ([`crate::pin`]) and outlive the process: a new process adopts the maps
//! and replaces each link after attaching its own, so some program translates at every
//! moment. [`SocketPrograms::verify`] finds pins someone else removed (a removed link pin
//! detaches the program: this process keeps no link of its own) and pinned links someone
//! detached (`crate::link`), and [`SocketPrograms::repair`] puts them back.

use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, MapData, MapInfo};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{CgroupAttachMode, CgroupSockAddr, CgroupSockAddrAttachType, Program};
use aya::{Btf, Ebpf, EbpfLoader};

use crate::destroy::{DestroyUnavailable, Destroyer, prepare_object};
use crate::error::{
    AttachError, CGROUP2_SUPER_MAGIC, LoadError, Unavailable, kernel_is_recent, permission_denied,
};
use crate::layout::{
    AFFINITY_MAP, AFFINITY6_MAP, REVERSE_MAP, REVERSE6_MAP, SERVICES_MAP, SERVICES6_MAP, SLOTS_MAP,
    SLOTS6_MAP,
};
use crate::maps::{ByteMap, KernelMaps};
use crate::pin::{link_pin, map_pin};

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

/// Every map, as the object names them (the pinned ones).
pub const MAPS: [&str; 8] = [
    SERVICES_MAP,
    SLOTS_MAP,
    REVERSE_MAP,
    AFFINITY_MAP,
    SERVICES6_MAP,
    SLOTS6_MAP,
    REVERSE6_MAP,
    AFFINITY6_MAP,
];

/// A pin [`SocketPrograms::verify`] found missing (or not ours).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MissingPin {
    /// A program's link: the program is not attached any more.
    Link(&'static str),
    /// A program's link is pinned but detached from the cgroup (someone ran
    /// `BPF_LINK_DETACH` on it, as `bpftool link detach` does): the program does not run.
    Detached(&'static str),
    /// A map's pin: the map lives on (the programs hold it), but a new process would not
    /// adopt it.
    Map(&'static str),
}

/// The programs, loaded; attached to at most one cgroup.
#[derive(Debug)]
pub struct SocketPrograms {
    pub(crate) ebpf: Ebpf,
    attached: Option<PathBuf>,
    /// The kernel's id of the attached cgroup (its directory's inode number), which each
    /// link's fdinfo must show while it is attached.
    cgroup_id: u64,
    /// Where the links and maps are pinned ([`Self::load_pinned`]).
    pins: Option<PathBuf>,
    /// The kernel's id of each map, to pin it again.
    map_ids: Vec<(&'static str, u32)>,
    /// The socket iterators that destroy sockets of removed endpoints, or why this kernel
    /// cannot run them (`destroy.rs`).
    pub(crate) destroyer: Result<Destroyer, DestroyUnavailable>,
}

impl SocketPrograms {
    /// Loads the programs and their maps (empty: nothing is translated yet).
    pub fn load() -> Result<(Self, KernelMaps), LoadError> {
        Self::load_with(None)
    }

    /// Loads the programs with their maps pinned in `dir` (on a bpffs, see
    /// [`crate::pin::prepare`]): maps pinned there already are adopted with what they hold
    /// (read it with [`KernelMaps::read_back`]), the others are created and pinned.
    pub fn load_pinned(dir: &Path) -> Result<(Self, KernelMaps), LoadError> {
        Self::load_with(Some(dir.to_owned()))
    }

    /// Loads the programs, with the maps pinned in `pins` when given.
    fn load_with(pins: Option<PathBuf>) -> Result<(Self, KernelMaps), LoadError> {
        check_kernel()?;
        let btf = Btf::from_sys_fs();
        let object = prepare_object(OBJECT, btf.as_ref());
        let mut loader = EbpfLoader::new();
        if let Some(dir) = &pins {
            for name in MAPS {
                loader.map_pin_path(name, map_pin(dir, name));
            }
        }
        let mut ebpf = loader
            .btf(btf.as_ref().ok())
            .load(object.bytes())
            .map_err(|error| classify(error, LoadError::Object))?;
        for (name, _) in PROGRAMS {
            program(&mut ebpf, name)?
                .load()
                .map_err(|source| classify(source, |source| LoadError::Program { name, source }))?;
        }
        let map_ids = map_ids(&ebpf);
        let maps = KernelMaps {
            services: take_map(&mut ebpf, SERVICES_MAP)?,
            slots: take_map(&mut ebpf, SLOTS_MAP)?,
            services6: take_map(&mut ebpf, SERVICES6_MAP)?,
            slots6: take_map(&mut ebpf, SLOTS6_MAP)?,
            affinity: take_map(&mut ebpf, AFFINITY_MAP)?,
            affinity6: take_map(&mut ebpf, AFFINITY6_MAP)?,
        };
        let destroyer = Destroyer::load_if(object.kfunc, &mut ebpf, btf.as_ref());
        Ok((
            Self {
                ebpf,
                attached: None,
                cgroup_id: 0,
                pins,
                map_ids,
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
        let cgroup_id = dir.metadata().map_err(open)?.ino();
        for (name, _) in PROGRAMS {
            self.attach_one(name, &dir, cgroup)?;
        }
        self.attached = Some(cgroup.to_owned());
        self.cgroup_id = cgroup_id;
        Ok(())
    }

    /// Attaches `name` to `dir` (`path`); when pinned, replaces the previous link's pin by
    /// the new link's, after the new one is attached, and keeps no link of its own.
    fn attach_one(
        &mut self,
        name: &'static str,
        dir: &File,
        path: &Path,
    ) -> Result<(), AttachError> {
        let attach = |source| AttachError::Attach {
            name,
            path: path.to_owned(),
            source,
        };
        let program = program(&mut self.ebpf, name)
            .map_err(|_| attach(aya::programs::ProgramError::NotLoaded))?;
        // `Single` is flags 0, which a cgroup bpf_link needs (EINVAL otherwise); a link
        // still runs beside other programs attached to the cgroup, as with ALLOW_MULTI.
        let id = program
            .attach(dir, CgroupAttachMode::Single)
            .map_err(attach)?;
        let Some(pins) = &self.pins else {
            return Ok(());
        };
        let pin = link_pin(pins, name);
        let failed = |source: Box<dyn std::error::Error + Send + Sync>| AttachError::Pin {
            name,
            path: pin.clone(),
            source,
        };
        let link = program.take_link(id).map_err(|e| failed(e.into()))?;
        let link = FdLink::try_from(link).map_err(|e| failed(e.into()))?;
        // The old link (a previous process's) detaches once its pin goes; ours runs already.
        match std::fs::remove_file(&pin) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(failed(error.into()));
            }
            _ => {}
        }
        link.pin(&pin).map_err(|e| failed(e.into()))?;
        Ok(())
    }

    /// The pins that are missing or hold something else than this process's links and maps,
    /// and the pinned links someone detached from the cgroup (none when not pinned or not
    /// attached).
    pub fn verify(&self) -> Vec<MissingPin> {
        let (Some(pins), Some(_)) = (&self.pins, &self.attached) else {
            return Vec::new();
        };
        let ids = self.program_ids_by_name();
        // Held open while their fdinfo is read.
        let opened: Vec<(&'static str, Option<FdLink>)> = PROGRAMS
            .into_iter()
            .map(|(name, _)| (name, open_link(&link_pin(pins, name))))
            .collect();
        let cgroups = crate::link::attached_cgroups();
        let links = opened.iter().filter_map(|(name, link)| {
            let ours = ids.iter().find(|(n, _)| n == name).map(|(_, id)| *id);
            let info = link.as_ref().and_then(|link| link.info().ok());
            match info {
                Some(info) if ours == Some(info.program_id()) => cgroups
                    .get(&info.id())
                    .is_some_and(|&cgroup| cgroup != self.cgroup_id)
                    .then_some(MissingPin::Detached(name)),
                _ => Some(MissingPin::Link(name)),
            }
        });
        let maps = self.map_ids.iter().filter_map(|&(name, id)| {
            let pinned = MapData::from_pin(map_pin(pins, name))
                .ok()
                .and_then(|map| map.info().ok())
                .map(|info| info.id());
            (pinned != Some(id)).then_some(MissingPin::Map(name))
        });
        links.chain(maps).collect()
    }

    /// Puts back what [`Self::verify`] found missing: attaches a new link (pinned) for each
    /// missing link, pins each map again.
    pub fn repair(&mut self, missing: &[MissingPin]) -> Result<(), AttachError> {
        let (Some(pins), Some(cgroup)) = (self.pins.clone(), self.attached.clone()) else {
            return Ok(());
        };
        let dir = File::open(&cgroup).map_err(|source| AttachError::Open {
            path: cgroup.clone(),
            source,
        })?;
        for what in missing {
            match *what {
                MissingPin::Link(name) | MissingPin::Detached(name) => {
                    self.attach_one(name, &dir, &cgroup)?;
                }
                MissingPin::Map(name) => self.pin_map(&pins, name)?,
            }
        }
        Ok(())
    }

    fn pin_map(&self, pins: &Path, name: &'static str) -> Result<(), AttachError> {
        let path = map_pin(pins, name);
        let failed = |source: Box<dyn std::error::Error + Send + Sync>| AttachError::Pin {
            name,
            path: path.clone(),
            source,
        };
        let Some(&(_, id)) = self.map_ids.iter().find(|(n, _)| *n == name) else {
            return Ok(());
        };
        let map = MapData::from_id(id).map_err(|e| failed(e.into()))?;
        match std::fs::remove_file(&path) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                return Err(failed(error.into()));
            }
            _ => {}
        }
        map.pin(&path).map_err(|e| failed(e.into()))
    }

    fn program_ids_by_name(&self) -> Vec<(&str, u32)> {
        self.ebpf
            .programs()
            .filter_map(|(name, program)| Some((name, program.info().ok()?.id())))
            .collect()
    }

    /// A second handle on the loaded programs' Service, slot and affinity maps (the same
    /// kernel maps, opened by id), for reading them back on another thread.
    pub fn map_reader(&self) -> Result<KernelMaps, LoadError> {
        Ok(KernelMaps {
            services: self.reopen(SERVICES_MAP)?,
            slots: self.reopen(SLOTS_MAP)?,
            services6: self.reopen(SERVICES6_MAP)?,
            slots6: self.reopen(SLOTS6_MAP)?,
            affinity: self.reopen(AFFINITY_MAP)?,
            affinity6: self.reopen(AFFINITY6_MAP)?,
        })
    }

    fn reopen<const K: usize, const V: usize>(
        &self,
        name: &'static str,
    ) -> Result<ByteMap<K, V>, LoadError> {
        let &(_, id) = self
            .map_ids
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or(LoadError::Missing { what: "map", name })?;
        let map = MapData::from_id(id)
            .and_then(aya::maps::Map::from_map_data)
            .map_err(|source| LoadError::Reopen { name, source })?;
        BpfHashMap::try_from(map).map_err(|source| LoadError::Map { name, source })
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

/// The kernel's id of each of [`MAPS`], from the maps the loaded programs use (names alone
/// could be another process's maps).
fn map_ids(ebpf: &Ebpf) -> Vec<(&'static str, u32)> {
    let mut used: Vec<u32> = ebpf
        .programs()
        .filter_map(|(_, program)| program.info().ok()?.map_ids().ok().flatten())
        .flatten()
        .collect();
    used.sort_unstable();
    used.dedup();
    used.into_iter()
        .filter_map(|id| {
            let info = MapInfo::from_id(id).ok()?;
            let name = MAPS.into_iter().find(|n| info.name_as_str() == Some(n))?;
            Some((name, id))
        })
        .collect()
}

/// The link pinned at `path`, if there is one.
fn open_link(path: &Path) -> Option<FdLink> {
    PinnedLink::from_pin(path).ok().map(FdLink::from)
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
