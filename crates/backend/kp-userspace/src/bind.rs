//! Binding the relay's own listening sockets (winuserspace portals, localhost NodePorts):
//! IPv6 sockets IPv6 only and TCP ports reusable at once after a restart.

use std::net::SocketAddr;

use kp_core::model::Protocol;
use socket2::{Domain, Socket, Type};

/// A bound portal socket.
pub(crate) enum Bound {
    Tcp(tokio::net::TcpListener),
    Udp(tokio::net::UdpSocket),
}

/// Binds a portal socket. IPv6 sockets are IPv6 only (Windows' default), so a NodePort's
/// `0.0.0.0` and `[::]` portals can coexist on Linux too.
pub(crate) fn bind(protocol: Protocol, addr: SocketAddr) -> std::io::Result<Bound> {
    let (kind, proto) = match protocol {
        Protocol::Tcp => (Type::STREAM, socket2::Protocol::TCP),
        Protocol::Udp => (Type::DGRAM, socket2::Protocol::UDP),
        Protocol::Sctp => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "the relay has no SCTP",
            ));
        }
    };
    let socket = Socket::new(Domain::for_address(addr), kind, Some(proto))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // After a restart, connections in TIME_WAIT must not keep the port. (On Windows the
    // option would let another program take the port over: not there.)
    #[cfg(unix)]
    if protocol == Protocol::Tcp {
        socket.set_reuse_address(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    if protocol == Protocol::Tcp {
        socket.listen(1024)?;
        return tokio::net::TcpListener::from_std(socket.into()).map(Bound::Tcp);
    }
    tokio::net::UdpSocket::from_std(socket.into()).map(Bound::Udp)
}

/// A listening TCP socket on `addr` (as [`bind`] makes it).
pub(crate) fn tcp_listener(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    match bind(Protocol::Tcp, addr)? {
        Bound::Tcp(listener) => Ok(listener),
        Bound::Udp(_) => Err(std::io::Error::other("bound UDP for TCP")),
    }
}
