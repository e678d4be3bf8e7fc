//! How a probed flow ended, and the wire format shared by the harness and `kp-echo`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// The transport protocol of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// TCP: a connection, answered with one line per connection and per line sent.
    Tcp,
    /// UDP: one datagram, answered with one datagram.
    Udp,
    /// SCTP over one-to-one style sockets, answered like TCP;
    /// [`crate::TestbedError::SctpUnsupported`] on a kernel without SCTP sockets.
    Sctp,
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Sctp => "sctp",
        })
    }
}

/// How one flow (a TCP connection, a UDP exchange, or one line on a long-lived connection)
/// ended, as seen by the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// An echo server answered.
    Answered {
        /// The name of the echo server (the pod) that answered.
        pod: String,
        /// The client address as the echo server saw it (after any SNAT/masquerade).
        seen_source: SocketAddr,
        /// The client's own socket address (its source before any NAT).
        client: SocketAddr,
        /// The address the echo server received on (after any DNAT), e.g. `podIP:targetPort`.
        server: SocketAddr,
    },
    /// Actively refused: a TCP RST to the SYN, or ICMP port unreachable (also what
    /// `REJECT` sends by default).
    Refused,
    /// Nothing came back within the probe timeout: the flow was dropped somewhere.
    TimedOut,
    /// No route to the destination network (locally, or ICMP network unreachable).
    NoRoute,
    /// ICMP host unreachable or administratively prohibited came back.
    Unreachable,
    /// An established connection was reset or closed by the other side.
    Closed,
    /// Anything else, e.g. a reply that was not from an echo server.
    Failed {
        /// What happened.
        detail: String,
    },
}

impl Outcome {
    /// The answering pod's name, if an echo server answered.
    pub fn pod(&self) -> Option<&str> {
        match self {
            Self::Answered { pod, .. } => Some(pod),
            _ => None,
        }
    }

    /// Whether `pod` answered.
    pub fn answered_by(&self, pod: &str) -> bool {
        self.pod() == Some(pod)
    }

    /// The source address the echo server saw, if it answered.
    pub fn seen_source(&self) -> Option<SocketAddr> {
        match self {
            Self::Answered { seen_source, .. } => Some(*seen_source),
            _ => None,
        }
    }

    /// Whether the source IP was rewritten on the way (SNAT/masquerade): the server saw a
    /// different IP than the client sent from. `None` unless an echo server answered, so a
    /// failed flow never passes as "not masqueraded".
    pub fn masqueraded(&self) -> Option<bool> {
        match self {
            Self::Answered {
                seen_source,
                client,
                ..
            } => Some(seen_source.ip() != client.ip()),
            _ => None,
        }
    }
}

/// The outcomes of repeated flows, with the distribution of the pods that answered (for
/// load-balancing and session-affinity tests).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Tally {
    outcomes: Vec<Outcome>,
}

impl Tally {
    pub(crate) fn new(outcomes: Vec<Outcome>) -> Self {
        Self { outcomes }
    }

    /// Every outcome, in the order the flows ran.
    pub fn outcomes(&self) -> &[Outcome] {
        &self.outcomes
    }

    /// How many flows ran.
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// Whether no flow ran.
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// How many flows each pod answered.
    pub fn by_pod(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for pod in self.outcomes.iter().filter_map(Outcome::pod) {
            *counts.entry(pod.to_owned()).or_insert(0) += 1;
        }
        counts
    }

    /// How many flows `pod` answered.
    pub fn count(&self, pod: &str) -> usize {
        self.outcomes.iter().filter(|o| o.answered_by(pod)).count()
    }

    /// How many flows were answered by any pod.
    pub fn answered(&self) -> usize {
        self.outcomes.iter().filter(|o| o.pod().is_some()).count()
    }

    /// Whether every flow was answered (and at least one ran).
    pub fn all_answered(&self) -> bool {
        !self.outcomes.is_empty() && self.answered() == self.outcomes.len()
    }

    /// The distinct source IPs the echo servers saw (one means no per-flow SNAT variation).
    pub fn seen_source_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = self
            .outcomes
            .iter()
            .filter_map(|o| o.seen_source().map(|s| s.ip()))
            .collect();
        ips.sort();
        ips.dedup();
        ips
    }
}

/// What an echo server sends back for each TCP connection, TCP line and UDP datagram.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The echo server's name (its pod).
    pub pod: String,
    /// `tcp` or `udp`.
    pub proto: Protocol,
    /// The peer address the server saw.
    pub seen: SocketAddr,
    /// The server socket's own address (for wildcard listeners: the address the flow hit).
    pub local: SocketAddr,
    /// The line or datagram being answered; absent in the greeting of a new TCP connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub echo: Option<String>,
}

/// What `kp-echo peer` prints: a flow's outcome and the address its socket reports for
/// the other side (what an application sees; `None` where the flow failed first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerReport {
    /// How the flow ended.
    pub outcome: Outcome,
    /// TCP: `getpeername()`; UDP: the answer's source from `recvfrom()`.
    pub peer: Option<SocketAddr>,
}

/// What `kp-echo burst` prints: resolver-like UDP queries from many sockets of one client,
/// each answer checked for its source (a resolver drops an answer from another address).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BurstReport {
    /// Queries sent (`sockets` × `per_socket`, two at a time on each socket, as a stub
    /// resolver sends its A and AAAA queries).
    pub sent: usize,
    /// Queries answered by an echo server within the timeout.
    pub answered: usize,
    /// Answers whose `recvfrom()` source was not the address queried.
    pub wrong_source: usize,
    /// Queries with no answer within the timeout.
    pub timed_out: usize,
    /// Other socket errors, one line each (at most 10 kept).
    pub errors: Vec<String>,
    /// The slowest answer, in milliseconds.
    pub slowest_ms: u64,
    /// Answers per pod.
    pub pods: std::collections::BTreeMap<String, usize>,
}

/// The first line `kp-echo serve` prints once every socket is bound and listening.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    /// The echo server's name.
    pub ready: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(pod: &str, seen: &str, client: &str) -> Outcome {
        Outcome::Answered {
            pod: pod.to_owned(),
            seen_source: seen.parse().expect("test address"),
            client: client.parse().expect("test address"),
            server: "10.244.1.3:8080".parse().expect("test address"),
        }
    }

    #[test]
    fn masquerade_compares_ips_only_and_only_for_answers() {
        assert_eq!(
            answered("a", "10.0.0.1:5", "10.0.0.1:6").masqueraded(),
            Some(false)
        );
        assert_eq!(
            answered("a", "10.0.0.9:5", "10.0.0.1:5").masqueraded(),
            Some(true)
        );
        assert_eq!(Outcome::TimedOut.masqueraded(), None);
    }

    #[test]
    fn outcomes_round_trip_as_tagged_json() {
        let outcome = answered("a", "10.0.0.1:5", "10.0.0.1:5");
        let text = serde_json::to_string(&outcome).expect("serializable");
        assert!(text.contains(r#""outcome":"answered""#), "{text}");
        let back: Outcome = serde_json::from_str(&text).expect("parsable");
        assert_eq!(back, outcome);
        let refused: Outcome = serde_json::from_str(r#"{"outcome":"refused"}"#).expect("parsable");
        assert_eq!(refused, Outcome::Refused);
    }

    #[test]
    fn tally_counts_pods_and_failures() {
        let tally = Tally::new(vec![
            answered("a", "10.0.0.1:1", "10.0.0.1:1"),
            answered("b", "10.0.0.1:2", "10.0.0.1:2"),
            answered("a", "10.0.0.1:3", "10.0.0.1:3"),
            Outcome::TimedOut,
        ]);
        assert_eq!(tally.count("a"), 2);
        assert_eq!(tally.by_pod().get("b"), Some(&1));
        assert_eq!(tally.answered(), 3);
        assert!(!tally.all_answered());
        assert_eq!(tally.seen_source_ips().len(), 1);
    }
}
