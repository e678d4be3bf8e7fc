//! What the demo prints about each scenario, and what it counts as unexpected. Pure: tested
//! on made-up answers.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::net::SocketAddr;

use kp_testbed::Outcome;

/// How one connection went, as the demo shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Answer {
    /// A pod's echo server answered.
    Pod {
        /// The pod's name.
        pod: String,
        /// Where the connection arrived (pod IP and target port, after DNAT).
        server: SocketAddr,
        /// The source address the pod saw.
        seen: SocketAddr,
        /// The client's own source address.
        client: SocketAddr,
    },
    /// Nothing or something else came back (refused, timed out, ...).
    Failed(String),
}

impl Answer {
    pub(super) fn from_outcome(outcome: &Outcome) -> Self {
        match outcome {
            Outcome::Answered {
                pod,
                seen_source,
                client,
                server,
            } => Self::Pod {
                pod: pod.clone(),
                server: *server,
                seen: *seen_source,
                client: *client,
            },
            other => Self::Failed(format!("{other:?}")),
        }
    }

    fn pod(&self) -> Option<&str> {
        match self {
            Self::Pod { pod, .. } => Some(pod),
            Self::Failed(_) => None,
        }
    }
}

/// One scenario's connections.
#[derive(Debug)]
pub(super) struct Scenario {
    title: String,
    answers: Vec<Answer>,
}

impl Scenario {
    pub(super) fn new(title: String, answers: Vec<Answer>) -> Self {
        Self { title, answers }
    }

    /// Prints every connection and the spread over pods; returns how many failed.
    pub(super) fn print_balancing(&self, out: &mut impl Write) -> io::Result<usize> {
        let failed = self.print_requests(out)?;
        writeln!(
            out,
            "   spread: {} (each new connection picks a ready endpoint at random)",
            self.spread()
        )?;
        Ok(failed)
    }

    /// Prints every connection and whether they all reached one pod; returns how many failed
    /// or went elsewhere than the first.
    pub(super) fn print_affinity(&self, out: &mut impl Write) -> io::Result<usize> {
        let failed = self.print_requests(out)?;
        let first = self.answers.iter().find_map(Answer::pod);
        let strays = self
            .answers
            .iter()
            .filter_map(Answer::pod)
            .filter(|pod| Some(*pod) != first)
            .count();
        match first {
            Some(pod) if strays == 0 => writeln!(
                out,
                "   affinity held: every answered connection went to {pod} (the first pick is remembered per client IP)"
            )?,
            Some(pod) => writeln!(
                out,
                "   UNEXPECTED: affinity broken, {strays} connection(s) went elsewhere than {pod}: {}",
                self.spread()
            )?,
            None => writeln!(out, "   UNEXPECTED: no connection was answered")?,
        }
        Ok(failed + strays)
    }

    /// Prints every connection, the spread and whether the source was masqueraded; returns
    /// how many failed.
    pub(super) fn print_node_port(&self, out: &mut impl Write) -> io::Result<usize> {
        let failed = self.print_requests(out)?;
        let masqueraded = self
            .answers
            .iter()
            .filter(|a| matches!(a, Answer::Pod { seen, client, .. } if seen.ip() != client.ip()))
            .count();
        let answered = self.answers.len() - failed;
        writeln!(
            out,
            "   spread: {}; {masqueraded} of {answered} answered connections were masqueraded \
             (externalTrafficPolicy Cluster: the node rewrites the source so replies come back through it)",
            self.spread()
        )?;
        Ok(failed)
    }

    /// The title and one line per connection; returns how many failed.
    fn print_requests(&self, out: &mut impl Write) -> io::Result<usize> {
        writeln!(out, "\n{}", self.title)?;
        let mut failed = 0;
        for (index, answer) in self.answers.iter().enumerate() {
            let n = index + 1;
            match answer {
                Answer::Pod {
                    pod,
                    server,
                    seen,
                    client,
                } => {
                    let source = if seen.ip() == client.ip() {
                        format!("source {} kept", seen.ip())
                    } else {
                        format!("source {} seen as {} (masqueraded)", client.ip(), seen.ip())
                    };
                    writeln!(
                        out,
                        "   request {n:>2} -> {pod:<6} answered from {server}, {source}"
                    )?;
                }
                Answer::Failed(what) => {
                    failed += 1;
                    writeln!(out, "   request {n:>2} -> UNEXPECTED: {what}")?;
                }
            }
        }
        Ok(failed)
    }

    /// `web-a 3, web-b 4, web-c 2` (and `no answer 1` when some failed).
    fn spread(&self) -> String {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for answer in &self.answers {
            *counts
                .entry(answer.pod().unwrap_or("no answer"))
                .or_default() += 1;
        }
        counts
            .iter()
            .map(|(pod, n)| format!("{pod} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, masqueraded: bool) -> Answer {
        let client: SocketAddr = "10.244.1.2:40000".parse().expect("literal");
        Answer::Pod {
            pod: name.to_owned(),
            server: "10.244.1.3:8080".parse().expect("literal"),
            seen: if masqueraded {
                "10.244.1.1:40000".parse().expect("literal")
            } else {
                client
            },
            client,
        }
    }

    fn printed(print: impl FnOnce(&mut Vec<u8>) -> io::Result<usize>) -> (String, usize) {
        let mut out = Vec::new();
        let unexpected = print(&mut out).expect("writing to a Vec");
        (String::from_utf8(out).expect("utf-8"), unexpected)
    }

    #[test]
    fn balancing_names_every_answering_pod_and_counts_failures() {
        let scenario = Scenario::new(
            "t".to_owned(),
            vec![
                pod("web-a", false),
                pod("web-b", false),
                Answer::Failed("TimedOut".to_owned()),
                pod("web-a", false),
            ],
        );
        let (text, unexpected) = printed(|out| scenario.print_balancing(out));
        assert_eq!(unexpected, 1);
        assert!(text.contains("request  1 -> web-a "), "{text}");
        assert!(
            text.contains("request  3 -> UNEXPECTED: TimedOut"),
            "{text}"
        );
        assert!(
            text.contains("spread: no answer 1, web-a 2, web-b 1"),
            "{text}"
        );
    }

    #[test]
    fn affinity_reports_strays() {
        let held = Scenario::new("t".to_owned(), vec![pod("web-b", false); 3]);
        let (text, unexpected) = printed(|out| held.print_affinity(out));
        assert_eq!(unexpected, 0);
        assert!(text.contains("affinity held"), "{text}");

        let broken = Scenario::new(
            "t".to_owned(),
            vec![
                pod("web-b", false),
                pod("web-a", false),
                pod("web-c", false),
            ],
        );
        let (text, unexpected) = printed(|out| broken.print_affinity(out));
        assert_eq!(unexpected, 2);
        assert!(text.contains("affinity broken"), "{text}");

        let silent = Scenario::new("t".to_owned(), vec![Answer::Failed("Refused".to_owned())]);
        let (text, unexpected) = printed(|out| silent.print_affinity(out));
        assert_eq!(unexpected, 1);
        assert!(text.contains("no connection was answered"), "{text}");
    }

    #[test]
    fn node_port_counts_masqueraded_sources() {
        let scenario = Scenario::new(
            "t".to_owned(),
            vec![pod("web-a", true), pod("web-c", true), pod("web-b", false)],
        );
        let (text, unexpected) = printed(|out| scenario.print_node_port(out));
        assert_eq!(unexpected, 0);
        assert!(
            text.contains("2 of 3 answered connections were masqueraded"),
            "{text}"
        );
        assert!(text.contains("seen as 10.244.1.1 (masqueraded)"), "{text}");
    }
}
