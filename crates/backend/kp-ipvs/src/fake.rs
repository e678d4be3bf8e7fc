//! [`FakeIpvs`]: an in-memory IPVS table with the kernel's errors, and a log of every change,
//! so sync logic can be tested for what it changes (and what it leaves alone).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::types::{ListedRealServer, RealServer, Scheduler, ServiceKey, Timeouts, VirtualServer};
use crate::{Ipvs, IpvsError};

const ESRCH: i32 = 3;
const ENOENT: i32 = 2;
const EEXIST: i32 = 17;
const EIO: i32 = 5;

/// One change the fake was asked to make.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A virtual server was added.
    AddService(ServiceKey),
    /// A virtual server was changed in place.
    UpdateService(ServiceKey),
    /// A virtual server was deleted.
    DeleteService(ServiceKey),
    /// A real server was added.
    AddDest(ServiceKey, IpAddr, u16),
    /// A real server was changed in place (its new weight).
    UpdateDest(ServiceKey, IpAddr, u16, u32),
    /// A real server was removed.
    DeleteDest(ServiceKey, IpAddr, u16),
    /// Timeouts were set.
    SetTimeouts(Timeouts),
    /// Everything was flushed.
    Flush,
}

/// A service's real servers by (address, port).
type Dests = BTreeMap<(IpAddr, u16), ListedRealServer>;

#[derive(Debug, Default)]
struct Table {
    services: BTreeMap<ServiceKey, (VirtualServer, Dests)>,
    timeouts: Timeouts,
    log: Vec<Op>,
    fail: Vec<Op>,
    destination_lists: usize,
    requests: usize,
}

/// An in-memory [`Ipvs`]. Clones share one table.
#[derive(Clone, Debug, Default)]
pub struct FakeIpvs {
    table: Arc<Mutex<Table>>,
}

impl FakeIpvs {
    /// An empty table with the kernel's default timeouts (900 s, 120 s, 300 s).
    pub fn new() -> Self {
        let fake = Self::default();
        fake.lock().timeouts = Timeouts {
            tcp: 900,
            tcp_fin: 120,
            udp: 300,
        };
        fake
    }

    /// Every change since the last [`FakeIpvs::take_log`].
    pub fn take_log(&self) -> Vec<Op> {
        std::mem::take(&mut self.lock().log)
    }

    /// How many times a service's destinations were listed (the per-service read a sync
    /// should skip for unchanged services).
    pub fn destination_lists(&self) -> usize {
        self.lock().destination_lists
    }

    /// How many requests were made (each one netlink request to a kernel: a listing, a read
    /// or a change), to show what a sync costs.
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// Makes the first request equal to `op` fail with EIO (once).
    pub fn fail_on(&self, op: Op) {
        self.lock().fail.push(op);
    }

    /// Sets a real server's connection counters, as traffic would.
    pub fn set_connections(
        &self,
        key: &ServiceKey,
        address: IpAddr,
        port: u16,
        active: u32,
        inactive: u32,
    ) {
        if let Some(d) = self
            .lock()
            .services
            .get_mut(key)
            .and_then(|(_, dests)| dests.get_mut(&(address, port)))
        {
            d.active_connections = active;
            d.inactive_connections = inactive;
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn change(
        &self,
        op: Op,
        apply: impl FnOnce(&mut Table) -> Result<(), i32>,
    ) -> Result<(), IpvsError> {
        let mut table = self.lock();
        table.requests += 1;
        let describe = format!("{op:?}");
        if let Some(i) = table.fail.iter().position(|f| *f == op) {
            table.fail.remove(i);
            return Err(kernel(&describe, EIO));
        }
        apply(&mut table).map_err(|code| kernel(&describe, code))?;
        table.log.push(op);
        Ok(())
    }
}

fn kernel(op: &str, errno: i32) -> IpvsError {
    IpvsError::Kernel {
        op: op.to_owned(),
        source: std::io::Error::from_raw_os_error(errno),
    }
}

fn check_scheduler(vs: &VirtualServer) -> Result<(), i32> {
    vs.scheduler
        .parse::<Scheduler>()
        .map(drop)
        .map_err(|_| ENOENT)
}

impl Ipvs for FakeIpvs {
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        let mut table = self.lock();
        table.requests += 1;
        Ok(table.services.values().map(|(vs, _)| vs.clone()).collect())
    }

    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.change(Op::AddService(vs.key), |t| {
            check_scheduler(vs)?;
            if t.services.contains_key(&vs.key) {
                return Err(EEXIST);
            }
            t.services.insert(vs.key, (vs.clone(), BTreeMap::new()));
            Ok(())
        })
    }

    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.change(Op::UpdateService(vs.key), |t| {
            check_scheduler(vs)?;
            let (current, _) = t.services.get_mut(&vs.key).ok_or(ESRCH)?;
            *current = vs.clone();
            Ok(())
        })
    }

    fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError> {
        self.change(Op::DeleteService(*key), |t| {
            t.services.remove(key).map(drop).ok_or(ESRCH)
        })
    }

    fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<ListedRealServer>, IpvsError> {
        // As the kernel's dump: a missing service has no destinations, not an error.
        let mut table = self.lock();
        table.destination_lists += 1;
        table.requests += 1;
        Ok(table
            .services
            .get(key)
            .map(|(_, dests)| dests.values().cloned().collect())
            .unwrap_or_default())
    }

    fn add_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.change(Op::AddDest(*key, rs.address, rs.port), |t| {
            let (_, dests) = t.services.get_mut(key).ok_or(ESRCH)?;
            if dests.contains_key(&(rs.address, rs.port)) {
                return Err(EEXIST);
            }
            dests.insert(
                (rs.address, rs.port),
                ListedRealServer {
                    server: rs.clone(),
                    active_connections: 0,
                    inactive_connections: 0,
                },
            );
            Ok(())
        })
    }

    fn update_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.change(Op::UpdateDest(*key, rs.address, rs.port, rs.weight), |t| {
            let (_, dests) = t.services.get_mut(key).ok_or(ESRCH)?;
            let d = dests.get_mut(&(rs.address, rs.port)).ok_or(ENOENT)?;
            d.server = rs.clone();
            Ok(())
        })
    }

    fn delete_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.change(Op::DeleteDest(*key, rs.address, rs.port), |t| {
            let (_, dests) = t.services.get_mut(key).ok_or(ESRCH)?;
            dests.remove(&(rs.address, rs.port)).map(drop).ok_or(ENOENT)
        })
    }

    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let mut table = self.lock();
        table.requests += 1;
        Ok(table.timeouts)
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        self.change(Op::SetTimeouts(*t), |table| {
            let cur = &mut table.timeouts;
            for (new, old) in [
                (t.tcp, &mut cur.tcp),
                (t.tcp_fin, &mut cur.tcp_fin),
                (t.udp, &mut cur.udp),
            ] {
                if new != 0 {
                    *old = new;
                }
            }
            Ok(())
        })
    }

    fn flush(&mut self) -> Result<(), IpvsError> {
        self.change(Op::Flush, |t| {
            t.services.clear();
            Ok(())
        })
    }
}
