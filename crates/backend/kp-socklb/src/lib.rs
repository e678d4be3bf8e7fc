//! Socket-level load balancing: Service traffic from the node's own sockets translated once,
//! when the socket connects, instead of per packet.
//!
//! cgroup `sock_addr` BPF programs (`bpf/socklb.bpf.c`, C compiled by clang in build.rs and
//! embedded; why in docs/socket-lb.md) run on `connect()` and unconnected UDP `sendmsg()`
//! of every socket created in a cgroup v2 directory (or below it). When the destination is a
//! Service port in the maps, they rewrite it to one of its endpoints, so packets carry the
//! endpoint's address from the start and conntrack holds no NAT entry; `getpeername()` and
//! `recvmsg()` show the Service address back. With ClientIP affinity, a client's network
//! namespace keeps its endpoint while it reconnects within the timeout (an LRU map of pins,
//! cleared by the proxy when the endpoint leaves). A Service port without endpoints is refused
//! (ECONNREFUSED), as nftables mode rejects it. Anything the maps do not know keeps its
//! address and meets nftables mode's rules, which stay fully programmed.
//!
//! - [`desired`](mod@desired): what the maps should hold for a proxy state, from the plan nftables
//!   mode renders (so both dataplanes make one decision);
//! - [`layout`]: the maps' keys and values as bytes (no `unsafe`, mirrored by the C);
//! - [`table`]: which map writes a change needs, in a safe order (sans I/O);
//! - [`maps`]: applying them to the kernel ([`KernelMaps`]) or a [`FakeMaps`];
//! - [`Balancer`]: the two in step; [`ServiceLb`]: the balancer driven Service by Service
//!   by the proxy's full and partial syncs;
//! - [`cgroup`]: the cgroup v2 directory to attach to (chosen, the v2 root, or a private
//!   cgroup2 mount on a v1-only node);
//! - [`program`]: loading, attaching to a cgroup, detaching on drop, or pinned in bpffs
//!   ([`pin`]) to outlive the process, with a check that the pins are still there and
//!   their links still attached (`link`: this process's links' fdinfo);
//! - [`destroy`]: socket iterators destroying the sockets of endpoints a sync removed
//!   (`bpf_sock_destroy`, kernel 6.5), or why this kernel cannot;
//! - [`error`]: what this node lacks ([`Unavailable`]: kernel, capability, cgroup v2), said
//!   exactly.
//!
//! Both families: connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6.

mod balancer;
pub mod cgroup;
pub mod desired;
pub mod destroy;
pub mod error;
pub mod layout;
mod link;
pub mod maps;
pub mod pin;
pub mod program;
mod services;
pub mod table;

pub use balancer::{Balancer, SetError, SyncReport};
pub use cgroup::{CgroupError, CgroupTarget};
pub use desired::{Target, Targets, desired, desired_service};
pub use destroy::{DestroyError, DestroyReport, DestroyUnavailable};
pub use error::{AttachError, LoadError, Unavailable};
pub use layout::ServiceKey;
pub use maps::{FakeMaps, Held, KernelMaps, MapWriter, Verdict, WriteError};
pub use program::{MissingPin, SocketPrograms, check_cgroup2};
pub use services::ServiceLb;
