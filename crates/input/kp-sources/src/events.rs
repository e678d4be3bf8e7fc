//! Events about this node's Node, posted as upstream's recorder posts them
//! (`k8s.io/client-go/tools/events`, `events.k8s.io/v1`): what an operator sees in
//! `kubectl get events` and `kubectl describe node` when the proxy has something to say
//! (a deprecated mode, a defaulted one).
//!
//! The shape follows upstream: the Event lives in namespace `default` (a Node has none), is
//! named `<node>.<unix nanoseconds in hex>`, regards `v1 Node <node>`, and is reported by
//! controller `kube-proxy`, instance `kube-proxy-<host name>`. A post that cannot reach the
//! server is retried (upstream: 12 tries, about 10 s apart); one the server answers with an
//! error status is not.
//! Upstream's series (repeated events patched into one) are not needed for the once-per-start
//! events the proxy posts.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kp_core::report::ErrorChain as _;
use kube::api::{Api, PostParams};
use tracing::{debug, warn};

/// Upstream's reporting controller name for kube-proxy.
pub const REPORTING_CONTROLLER: &str = "kube-proxy";

/// The action of the events posted at start-up, as upstream names it.
pub const ACTION_START: &str = "StartKubeProxy";

/// Where events about cluster-scoped objects go, as upstream's recorder puts them.
pub const EVENT_NAMESPACE: &str = "default";

/// Upstream's tries per event before giving up.
pub const DEFAULT_TRIES: u32 = 12;

/// Upstream's pause between tries (jittered by up to a quarter there; not needed for a
/// handful of events per start).
pub const DEFAULT_RETRY_DELAY: Duration = Duration::from_secs(10);

/// `Normal` or `Warning`, the two types the API accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something the operator should look at.
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// One event about the Node: what happened, in upstream's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    /// `Normal` or `Warning`.
    pub kind: EventType,
    /// A machine-readable reason (`IPVSDeprecation`).
    pub reason: &'static str,
    /// What the proxy was doing ([`ACTION_START`]).
    pub action: &'static str,
    /// The human-readable note.
    pub note: String,
}

/// Why posting an event failed.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    /// The server refused the event (not retried).
    #[error("the API server refused the event")]
    Refused(#[source] kube::Error),
    /// The server could not be reached in any of the tries.
    #[error("the API server could not be reached in {tries} tries")]
    Unreachable {
        /// How many posts were tried.
        tries: u32,
        /// The last failure.
        #[source]
        source: kube::Error,
    },
}

/// Posts events about one Node.
#[derive(Clone)]
pub struct NodeEvents {
    api: Api<Event>,
    node_name: String,
    reporting_instance: String,
    tries: u32,
    retry_delay: Duration,
}

impl NodeEvents {
    /// Events about `node_name`, reported from `host_name` (upstream uses the host name, not
    /// the node name, for the reporting instance).
    pub fn new(client: kube::Client, node_name: &str, host_name: &str) -> Self {
        Self {
            api: Api::namespaced(client, EVENT_NAMESPACE),
            node_name: node_name.to_owned(),
            reporting_instance: format!("{REPORTING_CONTROLLER}-{host_name}"),
            tries: DEFAULT_TRIES,
            retry_delay: DEFAULT_RETRY_DELAY,
        }
    }

    /// Tries per event and the pause between them (tests shorten them).
    pub fn retry(mut self, tries: u32, delay: Duration) -> Self {
        self.tries = tries.max(1);
        self.retry_delay = delay;
        self
    }

    /// The Event object for `event` at `now`.
    pub fn object(&self, event: &NodeEvent, now: SystemTime) -> Event {
        let nanos = now
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{}.{nanos:x}", self.node_name)),
                namespace: Some(EVENT_NAMESPACE.to_owned()),
                ..ObjectMeta::default()
            },
            event_time: k8s_openapi::jiff::Timestamp::try_from(now)
                .ok()
                .map(MicroTime),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(self.reporting_instance.clone()),
            action: Some(event.action.to_owned()),
            reason: Some(event.reason.to_owned()),
            regarding: Some(ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(self.node_name.clone()),
                ..ObjectReference::default()
            }),
            note: Some(event.note.clone()),
            type_: Some(event.kind.as_str().to_owned()),
            ..Event::default()
        }
    }

    /// Posts `event`, retrying while the server cannot be reached.
    pub async fn post(&self, event: &NodeEvent) -> Result<(), EventError> {
        let object = self.object(event, SystemTime::now());
        let mut tried = 0;
        loop {
            tried += 1;
            match self.api.create(&PostParams::default(), &object).await {
                Ok(_) => {
                    debug!(reason = event.reason, "posted an event about this node");
                    return Ok(());
                }
                // As client-go: an answer from the server is final; only a server that did not
                // answer is tried again.
                Err(error @ kube::Error::Api(_)) => return Err(EventError::Refused(error)),
                Err(source) if tried >= self.tries => {
                    return Err(EventError::Unreachable {
                        tries: tried,
                        source,
                    });
                }
                Err(error) => {
                    debug!(%error, tried, "posting an event failed; retrying");
                    tokio::time::sleep(self.retry_delay).await;
                }
            }
        }
    }

    /// Posts `event` in the background, logging a failure (events never hold up the proxy).
    pub fn spawn(&self, event: NodeEvent) {
        let this = self.clone();
        tokio::spawn(async move {
            if let Err(error) = this.post(&event).await {
                warn!(error = %error.chain(), reason = event.reason, "could not post an event about this node");
            }
        });
    }
}
