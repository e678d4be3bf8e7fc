//! The start-up wait for this node's Node object, as upstream's node manager does it before
//! the proxier is built: poll for the Node every [`DEFAULT_NODE_POLL_INTERVAL`] until it exists
//! and lists an IP (`InternalIP`/`ExternalIP`), for at most [`DEFAULT_NODE_IPS_TIMEOUT`] from
//! the server's first answer (before it, upstream waits for its Node cache to sync).
//! Running out of time is not fatal (upstream kept going for backward compatibility): the
//! caller falls back to `bindAddress` or loopback. This is separate from the watchers in
//! [`crate::api`], which keep reporting the Node afterwards.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kp_core::model::{host_ips, node_info};
use kube::Api;
use tokio_util::sync::CancellationToken;

use crate::decoded::Decoded;

/// Upstream polls its Node informer's cache once a second.
pub const DEFAULT_NODE_POLL_INTERVAL: Duration = Duration::from_secs(1);
/// Upstream gives up waiting for the Node's IPs after 30 seconds and starts anyway.
pub const DEFAULT_NODE_IPS_TIMEOUT: Duration = Duration::from_secs(30);
/// While the API server cannot be read, one failure in this many is logged (about one line
/// every half minute at the poll interval).
const LOG_EVERY_FAILURES: u32 = 30;

/// What the wait ended with.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeWait {
    /// The Node, with at least one IP.
    Found(Node),
    /// The Node exists but lists no IP (the time ran out, or shutdown).
    WithoutIps(Node),
    /// No Node of that name was seen (the time ran out, or shutdown).
    Missing,
}

impl NodeWait {
    /// The Node, if one was seen.
    pub fn node(&self) -> Option<&Node> {
        match self {
            NodeWait::Found(node) | NodeWait::WithoutIps(node) => Some(node),
            NodeWait::Missing => None,
        }
    }
}

/// Whether `node` lists an IP kube-proxy can use as node IP.
pub fn has_ips(node: &Node) -> bool {
    !host_ips(&node_info(node).addresses).is_empty()
}

/// Polls `fetch` until it returns a Node with an IP, every `interval`, until `shutdown`. As
/// upstream's informer, the server must answer once first (a failed request, `Err`, is
/// retried without limit: upstream waits for its Node cache to sync); from that answer on,
/// the wait lasts at most `timeout`. `Ok(None)` means no such Node (yet). The first poll is
/// immediate. Logs upstream's lines when the time runs out.
pub async fn wait_for_node<F, Fut, E>(
    node_name: &str,
    mut fetch: F,
    interval: Duration,
    timeout: Duration,
    shutdown: &CancellationToken,
) -> NodeWait
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<Node>, E>>,
    E: std::fmt::Display,
{
    let mut deadline = None;
    let mut last = None;
    let mut failures: u32 = 0;
    loop {
        match fetch().await {
            Ok(node) => {
                let now = tokio::time::Instant::now();
                deadline.get_or_insert(now + timeout);
                if let Some(node) = node {
                    if has_ips(&node) {
                        return NodeWait::Found(node);
                    }
                    last = Some(node);
                }
            }
            Err(error) => {
                // The first failure and then one in a while, not one line a second.
                if failures.is_multiple_of(LOG_EVERY_FAILURES) {
                    tracing::warn!(%error, node = node_name, "cannot read this node's Node yet; retrying");
                }
                failures = failures.saturating_add(1);
            }
        }
        let next = tokio::time::Instant::now() + interval;
        if deadline.is_some_and(|deadline| next > deadline) {
            break;
        }
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = shutdown.cancelled() => break,
        }
    }
    match last {
        None => {
            tracing::error!(node = node_name, "Timed out waiting for node to exist");
            NodeWait::Missing
        }
        Some(node) => {
            tracing::error!(
                node = node_name,
                "Timed out waiting for node to be assigned IPs"
            );
            NodeWait::WithoutIps(node)
        }
    }
}

/// [`wait_for_node`] against the API server: `GET /api/v1/nodes/NAME` (404: no Node yet; any
/// other failure: the server is not answering yet). A Node whose read fields do not decode
/// ([`Decoded::Unusable`]) counts as none yet; the Node watch logs its problem.
pub async fn wait_for_api_node(
    client: kube::Client,
    node_name: &str,
    interval: Duration,
    timeout: Duration,
    shutdown: &CancellationToken,
) -> NodeWait {
    let nodes: Api<Decoded<Node>> = Api::all(client);
    let fetch = || {
        let nodes = nodes.clone();
        async move {
            let node = nodes.get_opt(node_name).await?;
            Ok::<_, kube::Error>(node.and_then(|decoded| match decoded {
                Decoded::Usable(node) => Some(node),
                Decoded::Unusable(_) => None,
            }))
        }
    };
    wait_for_node(node_name, fetch, interval, timeout, shutdown).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::core::v1::{NodeAddress, NodeStatus};
    use kube::api::ObjectMeta;

    use super::*;

    fn node(addresses: &[(&str, &str)]) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                ..ObjectMeta::default()
            },
            status: Some(NodeStatus {
                addresses: Some(
                    addresses
                        .iter()
                        .map(|(kind, address)| NodeAddress {
                            type_: (*kind).into(),
                            address: (*address).into(),
                        })
                        .collect(),
                ),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    /// Runs the wait with upstream's timing against `answer(poll number)`; returns what it
    /// ended with, how many polls it made and how long it took.
    async fn scripted(
        answer: impl Fn(usize) -> Result<Option<Node>, String>,
    ) -> (NodeWait, usize, Duration) {
        let calls = AtomicUsize::new(0);
        let started = tokio::time::Instant::now();
        let wait = wait_for_node(
            "n1",
            || {
                let result = answer(calls.fetch_add(1, Ordering::SeqCst));
                async move { result }
            },
            DEFAULT_NODE_POLL_INTERVAL,
            DEFAULT_NODE_IPS_TIMEOUT,
            &CancellationToken::new(),
        )
        .await;
        (wait, calls.load(Ordering::SeqCst), started.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn waits_until_the_node_has_an_ip() {
        let (wait, calls, took) = scripted(|call| {
            Ok(match call {
                0 => None,
                1 | 2 => Some(node(&[("Hostname", "n1")])),
                _ => Some(node(&[("InternalIP", "10.0.0.5")])),
            })
        })
        .await;
        assert_eq!(wait, NodeWait::Found(node(&[("InternalIP", "10.0.0.5")])));
        assert_eq!(calls, 4);
        assert_eq!(took, DEFAULT_NODE_POLL_INTERVAL * 3);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_the_timeout() {
        let (missing, _, took) = scripted(|_| Ok(None)).await;
        assert_eq!(missing, NodeWait::Missing);
        assert_eq!(took, DEFAULT_NODE_IPS_TIMEOUT);

        let bare = node(&[("Hostname", "n1")]);
        let (without, _, _) = scripted(|_| Ok(Some(node(&[("Hostname", "n1")])))).await;
        assert_eq!(without, NodeWait::WithoutIps(bare));
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeout_starts_once_the_server_answers() {
        // Unreachable for two minutes, then no such Node: 120 s + upstream's 30 s.
        let (wait, _, took) = scripted(|call| {
            if call < 120 {
                Err("connection refused".to_owned())
            } else {
                Ok(None)
            }
        })
        .await;
        assert_eq!(wait, NodeWait::Missing);
        assert_eq!(took, Duration::from_secs(120) + DEFAULT_NODE_IPS_TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_ends_the_wait() {
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let started = tokio::time::Instant::now();
        let wait = wait_for_node(
            "n1",
            || async { Ok::<_, String>(None) },
            DEFAULT_NODE_POLL_INTERVAL,
            DEFAULT_NODE_IPS_TIMEOUT,
            &shutdown,
        )
        .await;
        assert_eq!(wait, NodeWait::Missing);
        assert!(started.elapsed() < DEFAULT_NODE_POLL_INTERVAL);
    }
}
