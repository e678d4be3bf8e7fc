//! `kp-echo burst`: what a node's stub resolvers do to a DNS Service, without DNS. Each
//! socket sends two queries back to back with `sendto()` (glibc sends A and AAAA so, from
//! one socket: the pattern behind conntrack's insertion race and the well-known 5-second
//! lookups) and reads both answers with `recvfrom()`, checking each answer's source is the
//! address queried, as a resolver does before it accepts an answer.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::{BurstReport, Reply};

/// Errors kept in the report (the rest are counted in `timed_out` or dropped).
const KEPT_ERRORS: usize = 10;

/// Runs `sockets` sockets of `per_socket` queries each (in pairs) against `to`.
pub(crate) fn run(
    to: SocketAddr,
    sockets: usize,
    per_socket: usize,
    timeout: Duration,
) -> BurstReport {
    let pairs = per_socket.div_ceil(2);
    let reports: Vec<BurstReport> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..sockets)
            .map(|i| scope.spawn(move || one_socket(to, i, pairs, timeout)))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| failed("a worker panicked")))
            .collect()
    });
    reports.into_iter().fold(empty(), merge)
}

fn empty() -> BurstReport {
    BurstReport {
        sent: 0,
        answered: 0,
        wrong_source: 0,
        timed_out: 0,
        errors: Vec::new(),
        slowest_ms: 0,
        pods: BTreeMap::new(),
    }
}

fn failed(error: &str) -> BurstReport {
    let mut report = empty();
    report.errors.push(error.to_owned());
    report
}

fn merge(mut all: BurstReport, one: BurstReport) -> BurstReport {
    all.sent += one.sent;
    all.answered += one.answered;
    all.wrong_source += one.wrong_source;
    all.timed_out += one.timed_out;
    all.slowest_ms = all.slowest_ms.max(one.slowest_ms);
    for error in one.errors {
        if all.errors.len() < KEPT_ERRORS {
            all.errors.push(error);
        }
    }
    for (pod, n) in one.pods {
        *all.pods.entry(pod).or_default() += n;
    }
    all
}

fn one_socket(to: SocketAddr, index: usize, pairs: usize, timeout: Duration) -> BurstReport {
    let unspecified = if to.is_ipv4() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    };
    let socket = match UdpSocket::bind(SocketAddr::new(unspecified, 0))
        .and_then(|s| s.set_read_timeout(Some(timeout)).map(|()| s))
    {
        Ok(socket) => socket,
        Err(error) => return failed(&error.to_string()),
    };
    let mut report = empty();
    for pair in 0..pairs {
        let queries = [
            format!("q{index}-{pair}-a"),
            format!("q{index}-{pair}-aaaa"),
        ];
        let started = Instant::now();
        for query in &queries {
            match socket.send_to(query.as_bytes(), to) {
                Ok(_) => report.sent += 1,
                Err(error) => keep(&mut report, &error),
            }
        }
        for _ in &queries {
            receive(&socket, to, &mut report);
        }
        let took = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        report.slowest_ms = report.slowest_ms.max(took);
    }
    report
}

/// One answer (whichever of the pair comes first).
fn receive(socket: &UdpSocket, to: SocketAddr, report: &mut BurstReport) {
    let mut buffer = [0_u8; 2048];
    match socket.recv_from(&mut buffer) {
        Ok((len, from)) => {
            if from != to {
                report.wrong_source += 1;
            }
            let payload = buffer.get(..len).unwrap_or_default();
            match serde_json::from_slice::<Reply>(payload) {
                Ok(reply) => {
                    report.answered += 1;
                    *report.pods.entry(reply.pod).or_default() += 1;
                }
                Err(error) => keep(report, &io::Error::other(error)),
            }
        }
        Err(error)
            if matches!(
                error.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            report.timed_out += 1;
        }
        Err(error) => keep(report, &error),
    }
}

fn keep(report: &mut BurstReport, error: &io::Error) {
    if report.errors.len() < KEPT_ERRORS {
        report.errors.push(error.to_string());
    }
}
