//! Destroying the sockets connected to endpoints a sync removed (issue 36 item 3), as
//! conntrack flushing does for nftables mode's UDP flows.
//!
//! A socket the programs translated keeps its endpoint for life: nothing re-translates a
//! connected socket when its endpoint goes. After a sync that removed endpoints, the proxy
//! writes each removed (Service port, endpoint) pair to `kp_destroy(6)` and runs the
//! socket iterators `kp_destroy_tcp` and `kp_destroy_udp` (`iter/tcp`, `iter/udp`) in every
//! network namespace of the node (a socket iterator walks the sockets of the namespace that
//! creates it). They destroy, with the kfunc `bpf_sock_destroy` (kernel 6.5), each socket
//! whose cookie and peer are in `kp_reverse(6)` (so the programs translated it, which only
//! happens in the attached cgroup's reach) and whose pair was removed: TCP gets a reset and
//! `ECONNABORTED`, a connected UDP socket `ECONNABORTED` and is disconnected, so the
//! application reconnects and is translated to a remaining endpoint.
//!
//! aya 0.14 does not resolve kfunc externs, so the C writes the call in assembly with a
//! marker immediate that `prepare_object` patches into a kfunc call to this kernel's BTF
//! id of `bpf_sock_destroy` before the object is loaded. Where the kernel lacks the kfunc
//! or the iterators, [`DestroyUnavailable`] says why, and the proxy leaves UDP Service
//! ports to nftables mode (DNAT and its conntrack flush).

use std::collections::HashSet;
use std::fs::File;
use std::io::Read as _;
use std::net::SocketAddr;
use std::os::fd::AsFd as _;
use std::os::unix::fs::MetadataExt as _;

use aya::maps::{HashMap as BpfHashMap, MapData, MapError};
use aya::programs::{Iter, Program, ProgramError};
use aya::{Btf, BtfError, Ebpf};
use aya_obj::btf::BtfKind;

use crate::layout::{ServiceKey, ip_protocol};
use crate::program::SocketPrograms;

/// `call 0x4b505344` ("KPSD"), as `bpf/socklb.bpf.c`'s `kp_sock_destroy` writes it:
/// opcode, registers (src and dst 0), offset 0, immediate (little-endian).
const MARKER: [u8; 8] = [0x85, 0x00, 0x00, 0x00, 0x44, 0x53, 0x50, 0x4b];
/// The registers byte of a kfunc call: src_reg BPF_PSEUDO_KFUNC_CALL (2), dst_reg 0.
const KFUNC_CALL_REGS: u8 = 0x20;
/// The kfunc the iterators call.
const KFUNC: &str = "bpf_sock_destroy";
/// The iterator programs: function name and iterator target.
const ITERATORS: [(&str, &str); 2] = [("kp_destroy_tcp", "tcp"), ("kp_destroy_udp", "udp")];
/// `kp_destroy`: (IPv4 Service port, endpoint) pairs removed.
pub const DESTROY_MAP: &str = "kp_destroy";
/// `kp_destroy6`: the IPv6 pairs.
pub const DESTROY6_MAP: &str = "kp_destroy6";
/// The ELF object's alignment the parser expects (as `include_bytes_aligned!` gives).
const ALIGN: usize = 32;

/// Why sockets of removed endpoints cannot be destroyed on this node.
#[derive(Debug, thiserror::Error)]
pub enum DestroyUnavailable {
    /// The kernel's BTF (`/sys/kernel/btf/vmlinux`) cannot be read: iterators and kfuncs
    /// need it.
    #[error("the kernel's BTF is unavailable (socket iterators need CONFIG_DEBUG_INFO_BTF)")]
    NoBtf(#[source] BtfError),
    /// The kernel has no `bpf_sock_destroy` (before 6.5).
    #[error("the kernel has no bpf_sock_destroy kfunc (Linux 6.5 or later has it)")]
    NoKfunc,
    /// The embedded object lacks the marked call (a build mismatch).
    #[error("the embedded BPF object has no marked bpf_sock_destroy call")]
    NoMarker,
    /// An iterator program was refused.
    #[error("the kernel refused socket iterator program {name}")]
    Iterator {
        /// The program's function name.
        name: &'static str,
        /// The kernel's answer (with the verifier's log).
        #[source]
        source: ProgramError,
    },
    /// An iterator program or map is missing from the object (a build mismatch).
    #[error("the embedded BPF object has no {0}")]
    Missing(&'static str),
    /// A destroy map is not as this crate writes it.
    #[error("BPF map {name} is not as the crate expects")]
    Map {
        /// Its name.
        name: &'static str,
        /// What aya found.
        #[source]
        source: MapError,
    },
}

/// A pass that could not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum DestroyError {
    /// This node cannot destroy sockets (said once when the programs were loaded).
    #[error("sockets of removed endpoints cannot be destroyed here")]
    Unavailable,
    /// A removed pair could not be written to the destroy map.
    #[error("cannot write removed endpoint {endpoint} of {} to {DESTROY_MAP}", key.addr)]
    Write {
        /// The Service port.
        key: ServiceKey,
        /// The endpoint.
        endpoint: SocketAddr,
        /// The kernel's answer.
        #[source]
        source: Box<MapError>,
    },
    /// The node's network namespaces could not be listed.
    #[error("cannot list the network namespaces in /proc")]
    Namespaces(#[source] std::io::Error),
    /// An iterator could not be created or read.
    #[error("cannot run socket iterator {name}")]
    Run {
        /// The program's function name.
        name: &'static str,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// What a pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DestroyReport {
    /// Network namespaces walked.
    pub namespaces: usize,
    /// Namespaces gone or not enterable before they were walked.
    pub skipped: usize,
    /// Sockets destroyed.
    pub destroyed: usize,
}

/// The embedded object, copied so its kfunc call can be patched, and whether it was.
#[derive(Debug)]
pub(crate) struct PreparedObject {
    buffer: Vec<u8>,
    start: usize,
    len: usize,
    /// Whether the iterators can be loaded.
    pub(crate) kfunc: Result<(), DestroyUnavailable>,
}

impl PreparedObject {
    /// The object's bytes, aligned as the ELF parser expects.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buffer[self.start..self.start + self.len]
    }
}

/// `object` with its marked calls turned into kfunc calls to this kernel's
/// `bpf_sock_destroy`; unpatched (the iterators then stay unloaded) when the kernel lacks
/// it.
pub(crate) fn prepare_object(object: &[u8], btf: Result<&Btf, &BtfError>) -> PreparedObject {
    let mut buffer = vec![0u8; object.len() + ALIGN];
    let start = (ALIGN - buffer.as_ptr() as usize % ALIGN) % ALIGN;
    buffer[start..start + object.len()].copy_from_slice(object);
    let kfunc = match btf {
        #[cfg(feature = "test-util")]
        Ok(_) if fault::no_kfunc() => Err(DestroyUnavailable::NoKfunc),
        Ok(btf) => kfunc_id(btf).and_then(|id| {
            patch_calls(&mut buffer[start..start + object.len()], id)
                .then_some(())
                .ok_or(DestroyUnavailable::NoMarker)
        }),
        Err(error) => Err(DestroyUnavailable::NoBtf(error_copy(error))),
    };
    PreparedObject {
        buffer,
        start,
        len: object.len(),
        kfunc,
    }
}

/// `BtfError` is not `Clone`: its message is kept (the loader keeps the original).
fn error_copy(error: &BtfError) -> BtfError {
    BtfError::FileError {
        path: "/sys/kernel/btf/vmlinux".into(),
        error: std::io::Error::other(error.to_string()),
    }
}

fn kfunc_id(btf: &Btf) -> Result<u32, DestroyUnavailable> {
    btf.id_by_type_name_kind(KFUNC, BtfKind::Func)
        .map_err(|_| DestroyUnavailable::NoKfunc)
}

/// Rewrites every 8-byte-aligned [`MARKER`] in `text` into a kfunc call to `id`; whether
/// there was one.
fn patch_calls(text: &mut [u8], id: u32) -> bool {
    let mut patched = false;
    for insn in text.chunks_exact_mut(8) {
        if insn == MARKER {
            insn[1] = KFUNC_CALL_REGS;
            insn[4..].copy_from_slice(&id.to_le_bytes());
            patched = true;
        }
    }
    patched
}

/// `struct kp_destroy_key(6)`: the Service port's address, port, IP protocol, padding, then
/// the endpoint's address, port, padding (addresses and ports in network byte order).
pub fn destroy_key(key: ServiceKey, endpoint: SocketAddr) -> Option<DestroyKey> {
    let mut bytes = Vec::with_capacity(40);
    push_addr(&mut bytes, key.addr);
    bytes.extend_from_slice(&[ip_protocol(key.protocol), 0]);
    push_addr(&mut bytes, endpoint);
    bytes.extend_from_slice(&[0, 0]);
    match (key.addr, endpoint) {
        (SocketAddr::V4(_), SocketAddr::V4(_)) => bytes.try_into().ok().map(DestroyKey::V4),
        (SocketAddr::V6(_), SocketAddr::V6(_)) => bytes.try_into().ok().map(DestroyKey::V6),
        _ => None,
    }
}

fn push_addr(bytes: &mut Vec<u8>, addr: SocketAddr) {
    match addr {
        SocketAddr::V4(a) => bytes.extend_from_slice(&a.ip().octets()),
        SocketAddr::V6(a) => bytes.extend_from_slice(&a.ip().octets()),
    }
    bytes.extend_from_slice(&addr.port().to_be_bytes());
}

/// A `kp_destroy` (IPv4) or `kp_destroy6` key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DestroyKey {
    /// 16 bytes.
    V4([u8; 16]),
    /// 40 bytes.
    V6([u8; 40]),
}

/// The iterators, loaded, and their maps.
#[derive(Debug)]
pub(crate) struct Destroyer {
    four: BpfHashMap<MapData, [u8; 16], u8>,
    six: BpfHashMap<MapData, [u8; 40], u8>,
}

impl Destroyer {
    /// [`Self::load`] where `kfunc` (the object's patching) succeeded.
    pub(crate) fn load_if(
        kfunc: Result<(), DestroyUnavailable>,
        ebpf: &mut Ebpf,
        btf: Result<&Btf, &BtfError>,
    ) -> Result<Self, DestroyUnavailable> {
        kfunc?;
        let btf = btf.map_err(|error| DestroyUnavailable::NoBtf(error_copy(error)))?;
        Self::load(ebpf, btf)
    }

    /// Loads the iterators of `ebpf` (loaded from a [`PreparedObject`] whose `kfunc` is
    /// Ok) and takes their maps.
    pub(crate) fn load(ebpf: &mut Ebpf, btf: &Btf) -> Result<Self, DestroyUnavailable> {
        for (name, target) in ITERATORS {
            iterator(ebpf, name)?
                .load(target, btf)
                .map_err(|source| DestroyUnavailable::Iterator { name, source })?;
        }
        Ok(Self {
            four: take(ebpf, DESTROY_MAP)?,
            six: take(ebpf, DESTROY6_MAP)?,
        })
    }

    /// Destroys the translated sockets connected to `removed`'s endpoints, in every
    /// network namespace of the node.
    pub(crate) fn run(
        &mut self,
        ebpf: &mut Ebpf,
        removed: &[(ServiceKey, SocketAddr)],
    ) -> Result<DestroyReport, DestroyError> {
        let written = self.mark(removed);
        let result = written.and_then(|()| {
            let namespaces = network_namespaces().map_err(DestroyError::Namespaces)?;
            std::thread::scope(|scope| {
                let walk = scope.spawn(|| walk_namespaces(ebpf, &namespaces));
                walk.join().unwrap_or_else(|_| {
                    Err(DestroyError::Run {
                        name: "kp_destroy_tcp",
                        source: "the walking thread panicked".into(),
                    })
                })
            })
        });
        self.unmark(removed);
        result
    }

    fn mark(&mut self, removed: &[(ServiceKey, SocketAddr)]) -> Result<(), DestroyError> {
        for &(key, endpoint) in removed {
            let written = match destroy_key(key, endpoint) {
                Some(DestroyKey::V4(bytes)) => self.four.insert(bytes, 1, 0),
                Some(DestroyKey::V6(bytes)) => self.six.insert(bytes, 1, 0),
                None => continue,
            };
            written.map_err(|source| DestroyError::Write {
                key,
                endpoint,
                source: Box::new(source),
            })?;
        }
        Ok(())
    }

    /// Empties the destroy maps of `removed` (best effort: a pair left behind only makes a
    /// later pass destroy a socket still connected to that removed endpoint).
    fn unmark(&mut self, removed: &[(ServiceKey, SocketAddr)]) {
        for &(key, endpoint) in removed {
            let _ = match destroy_key(key, endpoint) {
                Some(DestroyKey::V4(bytes)) => self.four.remove(&bytes),
                Some(DestroyKey::V6(bytes)) => self.six.remove(&bytes),
                None => continue,
            };
        }
    }
}

impl SocketPrograms {
    /// Why sockets of removed endpoints cannot be destroyed here, if they cannot.
    pub fn destroy_unavailable(&self) -> Option<&DestroyUnavailable> {
        self.destroyer.as_ref().err()
    }

    /// Destroys the sockets the programs translated to endpoints `removed` took out of
    /// their Service ports (TCP: reset, ECONNABORTED; connected UDP: ECONNABORTED and
    /// disconnected), in every network namespace of the node.
    pub fn destroy_sockets(
        &mut self,
        removed: &[(ServiceKey, SocketAddr)],
    ) -> Result<DestroyReport, DestroyError> {
        match &mut self.destroyer {
            Ok(destroyer) => destroyer.run(&mut self.ebpf, removed),
            Err(_) => Err(DestroyError::Unavailable),
        }
    }
}

/// One open `/proc/PID/ns/net` per network namespace of the node.
fn network_namespaces() -> std::io::Result<Vec<File>> {
    let mut seen = HashSet::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let name = entry?.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let path = std::path::Path::new("/proc").join(name).join("ns/net");
        // Processes come and go: one that exited is simply not walked.
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        if seen.insert((meta.dev(), meta.ino()))
            && let Ok(file) = File::open(&path)
        {
            files.push(file);
        }
    }
    Ok(files)
}

/// Runs on a thread of its own: it enters each namespace in turn (a thread's network
/// namespace is its own), so the proxy's other threads stay where they are.
fn walk_namespaces(ebpf: &mut Ebpf, namespaces: &[File]) -> Result<DestroyReport, DestroyError> {
    let mut report = DestroyReport::default();
    for namespace in namespaces {
        let entered = rustix::thread::move_into_link_name_space(
            namespace.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        );
        if entered.is_err() {
            report.skipped += 1;
            continue;
        }
        for (name, _) in ITERATORS {
            report.destroyed += run_iterator(ebpf, name)?;
        }
        report.namespaces += 1;
    }
    Ok(report)
}

/// Creates an iterator of `name` in this thread's network namespace and reads it to the
/// end: the number of bytes is the number of sockets destroyed.
fn run_iterator(ebpf: &mut Ebpf, name: &'static str) -> Result<usize, DestroyError> {
    let failed =
        |source: Box<dyn std::error::Error + Send + Sync>| DestroyError::Run { name, source };
    let program = iterator(ebpf, name).map_err(|e| failed(e.into()))?;
    let link = program.attach().map_err(|e| failed(e.into()))?;
    let link = program.take_link(link).map_err(|e| failed(e.into()))?;
    let mut file = link.into_file().map_err(|e| failed(e.into()))?;
    let mut out = Vec::new();
    file.read_to_end(&mut out).map_err(|e| failed(e.into()))?;
    Ok(out.len())
}

fn iterator<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut Iter, DestroyUnavailable> {
    match ebpf.program_mut(name) {
        Some(Program::Iter(program)) => Ok(program),
        _ => Err(DestroyUnavailable::Missing(name)),
    }
}

fn take<const K: usize>(
    ebpf: &mut Ebpf,
    name: &'static str,
) -> Result<BpfHashMap<MapData, [u8; K], u8>, DestroyUnavailable> {
    let map = ebpf
        .take_map(name)
        .ok_or(DestroyUnavailable::Missing(name))?;
    BpfHashMap::try_from(map).map_err(|source| DestroyUnavailable::Map { name, source })
}

/// The test build's fault hook: with the `test-util` feature (the suites'), setting
/// [`fault::NO_KFUNC_ENV`] makes the loader believe this kernel has no `bpf_sock_destroy`,
/// as before 6.5, so the fallback to nftables mode for UDP runs on any kernel. The product
/// binary is built without the feature.
#[cfg(feature = "test-util")]
pub mod fault {
    /// Set (to anything): the kfunc is "missing".
    pub const NO_KFUNC_ENV: &str = "KP_TEST_SOCKLB_NO_SOCK_DESTROY";

    /// Whether the variable asks.
    pub(super) fn no_kfunc() -> bool {
        std::env::var_os(NO_KFUNC_ENV).is_some()
    }
}

#[cfg(test)]
mod tests {
    use kp_core::model::Protocol;

    use super::*;

    #[test]
    fn marked_calls_become_kfunc_calls_and_nothing_else_changes() {
        let mut text = [
            0xb7, 0x01, 0, 0, 0, 0, 0, 0, // r1 = 0
            0x85, 0x00, 0, 0, 0x44, 0x53, 0x50, 0x4b, // the marker
            0x85, 0x00, 0, 0, 0x01, 0, 0, 0, // call 1 (a helper)
        ];
        assert!(patch_calls(&mut text, 0x0001_e240));
        assert_eq!(&text[8..16], &[0x85, 0x20, 0, 0, 0x40, 0xe2, 0x01, 0x00]);
        assert_eq!(&text[..8], &[0xb7, 0x01, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&text[16..], &[0x85, 0x00, 0, 0, 0x01, 0, 0, 0]);
        assert!(!patch_calls(&mut text, 1), "nothing left to patch");
    }

    #[test]
    fn the_embedded_object_carries_the_marker_on_instruction_boundaries() {
        let object = crate::program::object();
        let calls = object
            .windows(8)
            .enumerate()
            .filter(|(_, w)| *w == MARKER)
            .map(|(at, _)| at)
            .collect::<Vec<_>>();
        assert_eq!(calls.len(), 2, "one call in each iterator");
        assert!(calls.iter().all(|at| at % 8 == 0), "{calls:?}");
    }

    #[test]
    fn destroy_keys_are_laid_out_as_the_c_declares_them() {
        let key = ServiceKey::new("10.96.0.10:53".parse().expect("literal"), Protocol::Udp);
        let endpoint = "10.0.0.1:5353".parse().expect("literal");
        let Some(DestroyKey::V4(bytes)) = destroy_key(key, endpoint) else {
            panic!("an IPv4 key");
        };
        assert_eq!(
            bytes,
            [10, 96, 0, 10, 0, 53, 17, 0, 10, 0, 0, 1, 0x14, 0xe9, 0, 0]
        );
        let six = ServiceKey::new("[fd00::10]:80".parse().expect("literal"), Protocol::Tcp);
        let Some(DestroyKey::V6(bytes)) = destroy_key(six, "[fd00::1]:8080".parse().expect("x"))
        else {
            panic!("an IPv6 key");
        };
        assert_eq!((bytes[16], bytes[17], bytes[18]), (0, 80, 6));
        assert_eq!(&bytes[36..], &[0x1f, 0x90, 0, 0]);
        assert_eq!(destroy_key(key, "[fd00::1]:1".parse().expect("x")), None);
    }
}
