//! The echo server and flow prober run inside the namespaces with `ip netns exec`: the body
//! of the `kp-echo` binary, kept in the library so that another binary can serve the same
//! role through a subcommand (the `kube-proxy demo` runs itself as the echo server, so a
//! fresh `cargo run` needs no second binary). Every answer and every outcome is one line of
//! JSON on standard output.
//!
//! SCTP uses one-to-one style sockets (`SOCK_STREAM`, `IPPROTO_SCTP`), which behave like
//! TCP's: socket2 creates and connects them, and they are then handed to std's TCP types,
//! whose calls (accept, read, write, peer and local address) are the same system calls.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use crate::{Outcome, PeerReport, Protocol, Ready, Reply};
use clap::{Parser, Subcommand, ValueEnum};
use socket2::{Domain, Protocol as SocketProtocol, Socket, Type};

/// The largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;

/// IANA's protocol number for SCTP (`IPPROTO_SCTP`).
const IPPROTO_SCTP: i32 = 132;

/// Listen backlog for SCTP sockets (std's TCP listeners use 128 too).
const SCTP_BACKLOG: i32 = 128;

/// What the prober sends in a UDP datagram (the server echoes it back).
const UDP_PROBE_PAYLOAD: &[u8] = b"probe";

#[derive(Debug, Parser)]
#[command(name = "kp-echo", about = "Echo server and flow prober for kp-testbed")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Greets each TCP connection and answers each line on it and each UDP datagram with a
    /// JSON reply naming this server and the peer address it saw; runs until stdin closes.
    Serve {
        /// The name to report (the pod's name).
        #[arg(long)]
        name: String,
        /// A TCP port to answer on (all addresses, IPv6 and IPv4); repeatable.
        #[arg(long)]
        tcp: Vec<u16>,
        /// A UDP port to answer on; repeatable.
        #[arg(long)]
        udp: Vec<u16>,
        /// An SCTP port to answer on (all addresses), like TCP; repeatable.
        #[arg(long)]
        sctp: Vec<u16>,
        /// Bind UDP to this address instead of the wildcard, so replies leave from the
        /// address the datagram arrived on; repeatable.
        #[arg(long = "udp-bind")]
        udp_bind: Vec<IpAddr>,
    },
    /// Runs flows one after another and prints one outcome per flow.
    Probe {
        /// The protocol.
        #[arg(long, value_enum)]
        proto: ProbeProtocol,
        /// The destination address and port.
        #[arg(long)]
        to: SocketAddr,
        /// How long to wait for a connection and then for a reply.
        #[arg(long = "timeout-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
        /// How many flows, each from a new socket.
        #[arg(long, default_value_t = 1)]
        count: usize,
        /// UDP only: send from this source port (with SO_REUSEADDR, so flows in a row may
        /// reuse it), keeping the 5-tuple, and thus the conntrack entry, of earlier flows.
        #[arg(long = "source-port")]
        source_port: Option<u16>,
        /// A pause between flows, for a steady load over time.
        #[arg(long = "interval-ms", default_value_t = 0)]
        interval_ms: u64,
    },
    /// One flow, printing its outcome and the address the socket reports for the other
    /// side: `getpeername()` after a TCP connect, or the source `recvfrom()` gives for the
    /// answer to a datagram sent with `sendto()` on an unconnected UDP socket.
    Peer {
        /// The protocol (tcp or udp).
        #[arg(long, value_enum)]
        proto: ProbeProtocol,
        /// The destination address and port.
        #[arg(long)]
        to: SocketAddr,
        /// How long to wait for a connection and then for a reply.
        #[arg(long = "timeout-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
    },
    /// Holds one TCP connection (or a connected UDP socket): prints the greeting's outcome,
    /// then for each line on stdin sends it and prints the reply's outcome. A UDP socket
    /// whose call fails is connected again, as an application would (its error is printed).
    Session {
        /// The destination address and port.
        #[arg(long)]
        to: SocketAddr,
        /// tcp (the default) or udp; for UDP the greeting is the answer to a first datagram.
        #[arg(long, value_enum, default_value = "tcp")]
        proto: ProbeProtocol,
        /// How long to wait for the connection and for each reply.
        #[arg(long = "timeout-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
    },
    /// Resolver-like UDP queries: `sockets` unconnected sockets, each sending `per-socket`
    /// queries two at a time with `sendto()` and reading both answers with `recvfrom()`;
    /// prints one [`BurstReport`].
    Burst {
        /// The Service address and port queried.
        #[arg(long)]
        to: SocketAddr,
        /// How many sockets (one thread each).
        #[arg(long, default_value_t = 20)]
        sockets: usize,
        /// Queries per socket (rounded up to pairs).
        #[arg(long = "per-socket", default_value_t = 100)]
        per_socket: usize,
        /// How long to wait for each answer.
        #[arg(long = "timeout-ms", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
        timeout_ms: u64,
    },
    /// Serves a fake Kubernetes API server (list/watch of Services, EndpointSlices, Nodes,
    /// ServiceCIDRs) fed with objects on stdin; see [`crate::apiserver::serve_commands`].
    Apiserver {
        /// The address to listen on.
        #[arg(long)]
        listen: SocketAddr,
        /// Where the server's history starts: watches from older versions get 410 Gone.
        #[arg(long = "first-resource-version", default_value_t = 1)]
        first_resource_version: u64,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ProbeProtocol {
    Tcp,
    Udp,
    Sctp,
}

/// Runs the tool with command-line `args`, the first being the program name as in
/// `std::env::args_os()`: `serve`, `probe`, `peer`, `session`, `burst` or `apiserver` and their flags. Bad arguments
/// print clap's usage and exit the process (status 2), as a binary's `main` would.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = Cli::parse_from(args);
    let result = match cli.command {
        Command::Serve {
            name,
            tcp,
            udp,
            sctp,
            udp_bind,
        } => serve(name, &tcp, &udp, &sctp, &udp_bind),
        Command::Probe {
            proto,
            to,
            timeout_ms,
            count,
            source_port,
            interval_ms,
        } => {
            let timeout = Duration::from_millis(timeout_ms);
            let interval = Duration::from_millis(interval_ms);
            if source_port.is_some() && !matches!(proto, ProbeProtocol::Udp) {
                eprintln!("kp-echo: --source-port is for UDP probes only");
                return ExitCode::FAILURE;
            }
            (0..count).try_for_each(|n| {
                if n > 0 && !interval.is_zero() {
                    std::thread::sleep(interval);
                }
                emit(&match proto {
                    ProbeProtocol::Tcp => probe_tcp(to, timeout),
                    ProbeProtocol::Udp => probe_udp(to, timeout, source_port.unwrap_or(0)),
                    ProbeProtocol::Sctp => probe_sctp(to, timeout),
                })
            })
        }
        Command::Peer {
            proto,
            to,
            timeout_ms,
        } => emit(&peer(proto, to, Duration::from_millis(timeout_ms))),
        Command::Session {
            to,
            proto: ProbeProtocol::Udp,
            timeout_ms,
        } => udp_session(to, Duration::from_millis(timeout_ms)),
        Command::Session { to, timeout_ms, .. } => session(to, Duration::from_millis(timeout_ms)),
        Command::Burst {
            to,
            sockets,
            per_socket,
            timeout_ms,
        } => emit(&crate::burst::run(
            to,
            sockets,
            per_socket,
            Duration::from_millis(timeout_ms),
        )),
        Command::Apiserver {
            listen,
            first_resource_version,
        } => crate::apiserver::serve_commands(listen, first_resource_version),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kp-echo: {error}");
            ExitCode::FAILURE
        }
    }
}

/// IPv4 peers of dual-stack sockets show up as `::ffff:a.b.c.d`; report them as IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// One line of JSON on standard output (an [`Outcome`], or a [`PeerReport`]).
fn emit<T: serde::Serialize>(value: &T) -> io::Result<()> {
    let line = serde_json::to_string(value).map_err(io::Error::other)?;
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

fn serve(
    name: String,
    tcp: &[u16],
    udp: &[u16],
    sctp: &[u16],
    udp_bind: &[IpAddr],
) -> io::Result<()> {
    if tcp.is_empty() && udp.is_empty() && sctp.is_empty() {
        return Err(io::Error::other(
            "give at least one --tcp, --udp or --sctp port",
        ));
    }
    let mut listeners = tcp
        .iter()
        .map(|port| Ok((Protocol::Tcp, bind_wildcard(*port, TcpListener::bind)?)))
        .collect::<io::Result<Vec<_>>>()?;
    for port in sctp {
        listeners.push((Protocol::Sctp, bind_wildcard(*port, sctp_listener)?));
    }
    let mut sockets = Vec::new();
    for port in udp {
        if udp_bind.is_empty() {
            sockets.push(bind_wildcard(*port, UdpSocket::bind)?);
        } else {
            for addr in udp_bind {
                sockets.push(UdpSocket::bind((*addr, *port))?);
            }
        }
    }
    let name: Arc<str> = name.into();
    for (proto, listener) in listeners {
        let name = Arc::clone(&name);
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let name = Arc::clone(&name);
                thread::spawn(move || answer_stream(stream, proto, &name));
            }
        });
    }
    for socket in sockets {
        let name = Arc::clone(&name);
        thread::spawn(move || answer_udp(&socket, &name));
    }
    let ready = serde_json::to_string(&Ready {
        ready: name.to_string(),
    })
    .map_err(io::Error::other)?;
    {
        let mut out = io::stdout().lock();
        writeln!(out, "{ready}")?;
        out.flush()?;
    }
    // Stdin is the lifeline: when the harness exits, its end closes and so do we.
    io::copy(&mut io::stdin().lock(), &mut io::sink())?;
    Ok(())
}

/// Binds the dual-stack wildcard `[::]`, or `0.0.0.0` where IPv6 is unavailable.
fn bind_wildcard<T>(port: u16, bind: fn(SocketAddr) -> io::Result<T>) -> io::Result<T> {
    match bind(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port)) {
        Err(error) if error.kind() != io::ErrorKind::AddrInUse => {
            bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
        }
        other => other,
    }
}

fn reply_line(
    name: &str,
    proto: Protocol,
    seen: SocketAddr,
    local: SocketAddr,
    echo: Option<String>,
) -> io::Result<String> {
    let reply = Reply {
        pod: name.to_owned(),
        proto,
        seen: canonical(seen),
        local: canonical(local),
        echo,
    };
    serde_json::to_string(&reply).map_err(io::Error::other)
}

/// An SCTP socket of `to`'s family (one-to-one style); fails with "protocol not
/// supported" on a kernel without SCTP.
fn sctp_socket(to: &SocketAddr) -> io::Result<Socket> {
    Socket::new(
        Domain::for_address(*to),
        Type::STREAM,
        Some(SocketProtocol::from(IPPROTO_SCTP)),
    )
}

/// Whether this kernel offers SCTP sockets (network namespaces share the answer).
pub(crate) fn sctp_supported() -> bool {
    sctp_socket(&SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).is_ok()
}

/// A listening SCTP socket on `addr`; an IPv6 wildcard also accepts IPv4 peers.
fn sctp_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = sctp_socket(&addr)?;
    if addr.is_ipv6() {
        socket.set_only_v6(false)?;
    }
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(SCTP_BACKLOG)?;
    Ok(socket.into())
}

/// Greets the connection (TCP) or association (SCTP), then answers each line until the
/// peer closes it.
fn answer_stream(stream: TcpStream, proto: Protocol, name: &str) {
    let run = || -> io::Result<()> {
        let (seen, local) = (stream.peer_addr()?, stream.local_addr()?);
        let mut writer = stream.try_clone()?;
        writeln!(writer, "{}", reply_line(name, proto, seen, local, None)?)?;
        for line in BufReader::new(&stream).lines() {
            let line = line?;
            writeln!(
                writer,
                "{}",
                reply_line(name, proto, seen, local, Some(line))?
            )?;
        }
        Ok(())
    };
    // A peer that resets or vanishes only ends its own connection.
    let _ = run();
}

fn answer_udp(socket: &UdpSocket, name: &str) {
    let Ok(local) = socket.local_addr() else {
        return;
    };
    let mut buffer = vec![0_u8; MAX_DATAGRAM];
    loop {
        // ICMP errors from earlier replies surface here; they concern only that peer.
        let Ok((len, peer)) = socket.recv_from(&mut buffer) else {
            continue;
        };
        let payload = buffer.get(..len).unwrap_or_default();
        let echo = String::from_utf8_lossy(payload).trim_end().to_owned();
        if let Ok(line) = reply_line(name, Protocol::Udp, peer, local, Some(echo)) {
            let _ = socket.send_to(line.as_bytes(), peer);
        }
    }
}

/// Maps a socket error to the outcome it means for the flow.
fn classify(error: &io::Error) -> Outcome {
    use io::ErrorKind;
    match error.kind() {
        ErrorKind::ConnectionRefused => Outcome::Refused,
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Outcome::TimedOut,
        ErrorKind::NetworkUnreachable => Outcome::NoRoute,
        ErrorKind::HostUnreachable => Outcome::Unreachable,
        ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::BrokenPipe
        | ErrorKind::UnexpectedEof => Outcome::Closed,
        _ => Outcome::Failed {
            detail: error.to_string(),
        },
    }
}

/// Turns an echo server's line into `Answered`, checking it echoes `expect` when given.
fn answered(line: &str, client: SocketAddr, expect: Option<&str>) -> Outcome {
    match serde_json::from_str::<Reply>(line.trim_end()) {
        Ok(reply) if expect.is_some() && reply.echo.as_deref() != expect => Outcome::Failed {
            detail: format!("reply {:?} does not answer {expect:?}", reply.echo),
        },
        Ok(reply) => Outcome::Answered {
            pod: reply.pod,
            seen_source: reply.seen,
            client: canonical(client),
            server: reply.local,
        },
        Err(error) => Outcome::Failed {
            detail: format!("not an echo reply ({error}): {line:?}"),
        },
    }
}

/// Reads one reply line: `Closed` at end of stream.
fn read_reply<R: BufRead>(reader: &mut R, client: SocketAddr, expect: Option<&str>) -> Outcome {
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) => Outcome::Closed,
        Ok(_) => answered(&line, client, expect),
        Err(error) => classify(&error),
    }
}

fn connect(to: SocketAddr, timeout: Duration) -> Result<(TcpStream, SocketAddr), Outcome> {
    let stream = TcpStream::connect_timeout(&to, timeout).map_err(|e| classify(&e))?;
    let client = stream.local_addr().map_err(|e| classify(&e))?;
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| classify(&e))?;
    Ok((stream, client))
}

fn probe_tcp(to: SocketAddr, timeout: Duration) -> Outcome {
    match connect(to, timeout) {
        Ok((stream, client)) => read_reply(&mut BufReader::new(stream), client, None),
        Err(outcome) => outcome,
    }
}

/// One SCTP association: `Answered` once the server's greeting arrives. An ABORT in
/// answer to the INIT (no listener, or a REJECT rule) surfaces as "connection refused".
fn probe_sctp(to: SocketAddr, timeout: Duration) -> Outcome {
    let connected = || -> io::Result<(TcpStream, SocketAddr)> {
        let socket = sctp_socket(&to)?;
        socket.connect_timeout(&to.into(), timeout)?;
        let stream = TcpStream::from(socket);
        stream.set_read_timeout(Some(timeout))?;
        let client = stream.local_addr()?;
        Ok((stream, client))
    };
    match connected() {
        Ok((stream, client)) => read_reply(&mut BufReader::new(stream), client, None),
        Err(error) => classify(&error),
    }
}

/// One datagram from source port `source_port` (0: any) and its answer.
fn probe_udp(to: SocketAddr, timeout: Duration, source_port: u16) -> Outcome {
    let unspecified = if to.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let exchange = || -> io::Result<(Vec<u8>, SocketAddr)> {
        let socket = Socket::new(Domain::for_address(to), Type::DGRAM, None)?;
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::new(unspecified, source_port).into())?;
        let socket = UdpSocket::from(socket);
        socket.connect(to)?;
        socket.set_read_timeout(Some(timeout))?;
        socket.send(UDP_PROBE_PAYLOAD)?;
        let client = socket.local_addr()?;
        let mut buffer = vec![0_u8; MAX_DATAGRAM];
        let len = socket.recv(&mut buffer)?;
        buffer.truncate(len);
        Ok((buffer, client))
    };
    match exchange() {
        Ok((payload, client)) => answered(
            &String::from_utf8_lossy(&payload),
            client,
            std::str::from_utf8(UDP_PROBE_PAYLOAD).ok(),
        ),
        Err(error) => classify(&error),
    }
}

fn peer(proto: ProbeProtocol, to: SocketAddr, timeout: Duration) -> PeerReport {
    let result = match proto {
        ProbeProtocol::Tcp => peer_tcp(to, timeout),
        ProbeProtocol::Udp => peer_udp(to, timeout),
        ProbeProtocol::Sctp => Err(Outcome::Failed {
            detail: "kp-echo peer: tcp or udp only".to_owned(),
        }),
    };
    match result {
        // As the application read it: a dual-stack socket's IPv4 peer stays `::ffff:a.b.c.d`.
        Ok((outcome, peer)) => PeerReport {
            outcome,
            peer: Some(peer),
        },
        Err(outcome) => PeerReport {
            outcome,
            peer: None,
        },
    }
}

fn peer_tcp(to: SocketAddr, timeout: Duration) -> Result<(Outcome, SocketAddr), Outcome> {
    let (stream, client) = connect(to, timeout)?;
    let peer = stream.peer_addr().map_err(|e| classify(&e))?;
    let outcome = read_reply(&mut BufReader::new(stream), client, None);
    Ok((outcome, peer))
}

fn peer_udp(to: SocketAddr, timeout: Duration) -> Result<(Outcome, SocketAddr), Outcome> {
    let unspecified = if to.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let exchange = || -> io::Result<(Vec<u8>, SocketAddr, SocketAddr)> {
        let socket = UdpSocket::bind(SocketAddr::new(unspecified, 0))?;
        socket.set_read_timeout(Some(timeout))?;
        socket.send_to(UDP_PROBE_PAYLOAD, to)?;
        let client = socket.local_addr()?;
        let mut buffer = vec![0_u8; MAX_DATAGRAM];
        let (len, from) = socket.recv_from(&mut buffer)?;
        buffer.truncate(len);
        Ok((buffer, client, from))
    };
    let (payload, client, from) = exchange().map_err(|e| classify(&e))?;
    let outcome = answered(
        &String::from_utf8_lossy(&payload),
        client,
        std::str::from_utf8(UDP_PROBE_PAYLOAD).ok(),
    );
    Ok((outcome, from))
}

fn session(to: SocketAddr, timeout: Duration) -> io::Result<()> {
    let (stream, client) = match connect(to, timeout) {
        Ok(connected) => connected,
        Err(outcome) => return emit(&outcome),
    };
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let greeting = read_reply(&mut reader, client, None);
    emit(&greeting)?;
    if greeting.pod().is_none() {
        return Ok(());
    }
    for line in io::stdin().lock().lines() {
        let line = line?;
        let outcome = match writeln!(writer, "{line}").and_then(|()| writer.flush()) {
            Ok(()) => read_reply(&mut reader, client, Some(&line)),
            Err(error) => classify(&error),
        };
        emit(&outcome)?;
    }
    Ok(())
}

/// A connected UDP socket to `to`, with the read timeout.
fn udp_connected(to: SocketAddr, timeout: Duration) -> io::Result<(UdpSocket, SocketAddr)> {
    let unspecified = if to.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let socket = UdpSocket::bind(SocketAddr::new(unspecified, 0))?;
    socket.connect(to)?;
    socket.set_read_timeout(Some(timeout))?;
    let client = socket.local_addr()?;
    Ok((socket, client))
}

/// One datagram `line` on the connected `socket` and its answer.
fn udp_exchange(socket: &UdpSocket, client: SocketAddr, line: &str) -> io::Result<Outcome> {
    socket.send(line.as_bytes())?;
    let mut buffer = vec![0_u8; MAX_DATAGRAM];
    let len = socket.recv(&mut buffer)?;
    let payload = String::from_utf8_lossy(buffer.get(..len).unwrap_or_default()).into_owned();
    Ok(answered(&payload, client, Some(line)))
}

/// `session --proto udp`: the socket stays connected across lines; after an error (e.g.
/// ECONNABORTED when the socket load balancer destroyed it) it is connected again, its
/// pending error taken first, and the error's outcome is printed.
fn udp_session(to: SocketAddr, timeout: Duration) -> io::Result<()> {
    let (socket, mut client) = match udp_connected(to, timeout) {
        Ok(connected) => connected,
        Err(error) => return emit(&classify(&error)),
    };
    let greeting = udp_exchange(&socket, client, "greeting").unwrap_or_else(|e| classify(&e));
    emit(&greeting)?;
    if greeting.pod().is_none() {
        return Ok(());
    }
    for line in io::stdin().lock().lines() {
        let line = line?;
        let outcome = match udp_exchange(&socket, client, &line) {
            Ok(outcome) => outcome,
            Err(error) => {
                let _ = socket.take_error();
                socket.connect(to)?;
                // A disconnected socket bound to port 0 loses its port: connecting binds anew.
                client = socket.local_addr()?;
                classify(&error)
            }
        };
        emit(&outcome)?;
    }
    Ok(())
}
