//! The real [`Ipvs`]: a blocking `NETLINK_GENERIC` socket. One request is in flight at a
//! time; every reply (data, ACK, error, end of dump) is read before the next request.

use std::net::IpAddr;

use netlink_packet_generic::GenlMessage;
use netlink_packet_generic::ctrl::GenlCtrl;
use netlink_sys::protocols::NETLINK_GENERIC;
use netlink_sys::{Socket, SocketAddr};

use crate::codec::{self, IpvsMessage, Reply};
use crate::types::{ListedRealServer, RealServer, ServiceKey, Timeouts, VirtualServer};
use crate::{Ipvs, IpvsError};

/// `ENOENT`: the controller knows no family by that name.
const ENOENT: i32 = 2;

/// IPVS over a netlink socket in the calling thread's network namespace.
#[derive(Debug)]
pub struct NetlinkIpvs {
    socket: Socket,
    family: u16,
    seq: u32,
}

impl NetlinkIpvs {
    /// Opens a socket and resolves the `IPVS` family. [`IpvsError::Unavailable`] when the
    /// kernel has no IPVS.
    pub fn open() -> Result<Self, IpvsError> {
        let mut socket = Socket::new(NETLINK_GENERIC).map_err(IpvsError::Socket)?;
        socket.bind_auto().map_err(IpvsError::Socket)?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(IpvsError::Socket)?;
        let mut this = Self {
            socket,
            family: 0,
            seq: 0,
        };
        this.seq += 1;
        let seq = this.seq;
        this.send(&codec::encode_family_request(seq))?;
        loop {
            for (s, reply) in this.receive::<GenlMessage<GenlCtrl>>()? {
                if s != seq {
                    continue;
                }
                match reply {
                    Reply::Data(msg) => {
                        this.family = codec::family_id(&msg).ok_or_else(|| {
                            IpvsError::Decode("family reply without an id".into())
                        })?;
                    }
                    Reply::Ack | Reply::Done if this.family != 0 => return Ok(this),
                    Reply::Ack | Reply::Done => {
                        return Err(IpvsError::Decode("no family id in the reply".into()));
                    }
                    Reply::Error(code) if -code == ENOENT => {
                        return Err(IpvsError::Unavailable(
                            "the generic netlink family IPVS does not exist (module ip_vs not loaded?)"
                                .into(),
                        ));
                    }
                    Reply::Error(code) => {
                        return Err(kernel_error("resolve the IPVS family", code));
                    }
                }
            }
        }
    }

    /// The family id the kernel assigned to `IPVS`.
    pub fn family_id(&self) -> u16 {
        self.family
    }

    fn send(&self, buf: &[u8]) -> Result<(), IpvsError> {
        self.socket.send(buf, 0).map_err(IpvsError::Socket)?;
        Ok(())
    }

    fn receive<T>(&self) -> Result<Vec<codec::Sequenced<T>>, IpvsError>
    where
        T: netlink_packet_core::NetlinkDeserializable + std::fmt::Debug,
    {
        let (buf, _) = self.socket.recv_from_full().map_err(IpvsError::Socket)?;
        codec::decode::<T>(&buf).map_err(|e| IpvsError::Decode(e.to_string()))
    }

    /// Sends `msg` and collects its data replies until the ACK or the end of the dump.
    fn request(
        &mut self,
        msg: IpvsMessage,
        op: impl Fn() -> String,
    ) -> Result<Vec<IpvsMessage>, IpvsError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        self.send(&codec::encode(msg, self.family, seq))?;
        let mut data = Vec::new();
        loop {
            for (s, reply) in self.receive::<GenlMessage<IpvsMessage>>()? {
                if s != seq {
                    continue; // a late reply to an earlier request
                }
                match reply {
                    Reply::Data(m) => data.push(m.payload),
                    Reply::Ack | Reply::Done => return Ok(data),
                    Reply::Error(code) => return Err(kernel_error(&op(), code)),
                }
            }
        }
    }
}

fn kernel_error(op: &str, code: i32) -> IpvsError {
    IpvsError::Kernel {
        op: op.to_owned(),
        source: std::io::Error::from_raw_os_error(-code),
    }
}

fn decode_err(e: codec::ParseError) -> IpvsError {
    IpvsError::Decode(e.to_string())
}

impl Ipvs for NetlinkIpvs {
    fn services(&mut self) -> Result<Vec<VirtualServer>, IpvsError> {
        let replies = self.request(codec::get_services(), || "list services".into())?;
        let mut out = Vec::new();
        for m in &replies {
            if let Some(vs) = codec::service_of(m).map_err(decode_err)? {
                out.push(vs);
            }
        }
        Ok(out)
    }

    fn add_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.request(codec::new_service(vs), || format!("add service {}", vs.key))
            .map(drop)
    }

    fn update_service(&mut self, vs: &VirtualServer) -> Result<(), IpvsError> {
        self.request(codec::set_service(vs), || {
            format!("update service {}", vs.key)
        })
        .map(drop)
    }

    fn delete_service(&mut self, key: &ServiceKey) -> Result<(), IpvsError> {
        self.request(codec::del_service(key), || format!("delete service {key}"))
            .map(drop)
    }

    fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<ListedRealServer>, IpvsError> {
        let replies = self.request(codec::get_dests(key), || {
            format!("list destinations of {key}")
        })?;
        replies
            .iter()
            .map(|m| codec::dest_of(m, key.address).map_err(decode_err))
            .collect()
    }

    fn add_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.request(codec::new_dest(key, rs), || {
            format!("add destination {} to {key}", endpoint(rs.address, rs.port))
        })
        .map(drop)
    }

    fn update_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.request(codec::set_dest(key, rs), || {
            format!(
                "update destination {} of {key}",
                endpoint(rs.address, rs.port)
            )
        })
        .map(drop)
    }

    fn delete_destination(&mut self, key: &ServiceKey, rs: &RealServer) -> Result<(), IpvsError> {
        self.request(codec::del_dest(key, rs.address, rs.port), || {
            format!(
                "delete destination {} of {key}",
                endpoint(rs.address, rs.port)
            )
        })
        .map(drop)
    }

    fn timeouts(&mut self) -> Result<Timeouts, IpvsError> {
        let replies = self.request(codec::get_config(), || "get timeouts".into())?;
        replies
            .first()
            .map(codec::timeouts_of)
            .ok_or_else(|| IpvsError::Decode("GET_CONFIG returned nothing".into()))
    }

    fn set_timeouts(&mut self, t: &Timeouts) -> Result<(), IpvsError> {
        if *t == Timeouts::default() {
            return Ok(());
        }
        self.request(codec::set_config(t), || "set timeouts".into())
            .map(drop)
    }

    fn flush(&mut self) -> Result<(), IpvsError> {
        self.request(codec::flush(), || "flush".into()).map(drop)
    }
}

/// `addr:port`, bracketed for IPv6.
pub(crate) fn endpoint(address: IpAddr, port: u16) -> String {
    match address {
        IpAddr::V4(a) => format!("{a}:{port}"),
        IpAddr::V6(a) => format!("[{a}]:{port}"),
    }
}
