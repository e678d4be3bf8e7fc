//! `--debug-explain`: the `/debug/explain` answers of the metrics server, computed from the
//! state the proxier last published (the same pure `kp_rules::explain::explain` and text
//! rendering as `kube-proxy explain`). Runs on the admin runtime's blocking pool and only
//! clones an `Arc` of the state, so it never waits for, or holds up, a sync.

use std::sync::Arc;

use crate::modes::NodeAddressing;
use kp_config::KubeProxyConfiguration;
use kp_core::tracker::ProxyState;
use std::net::IpAddr;

use kp_rules::explain::dataplane::DataplaneObject;
use kp_rules::explain::{ExplainError, Explanation, Query, explain};
use kp_server::{ExplainFailure, Explained, Explainer};
use kp_userspace::{AffinityTables, PinLookup};
use tokio::sync::watch;

/// Explains queries against the proxier's published state.
pub(crate) struct StateExplainer {
    config: KubeProxyConfiguration,
    /// The node's addresses as resolved once at start-up, like the rules it explains.
    node: NodeAddressing,
    state: watch::Receiver<Arc<ProxyState>>,
    /// Userspace mode's ClientIP affinity tables: with a source in the query, the answer
    /// names the endpoint that client is pinned to.
    affinity: Option<AffinityTables>,
}

impl StateExplainer {
    /// `state` is the proxier's [`kp_core::proxier::Proxier::state`] channel. Subscribing
    /// costs one copy of the state per sync that changes it (the proxier cannot update a
    /// state a reader may hold in place), which is why this is off by default.
    pub(crate) fn new(
        config: KubeProxyConfiguration,
        node: NodeAddressing,
        state: watch::Receiver<Arc<ProxyState>>,
    ) -> Self {
        Self {
            config,
            node,
            state,
            affinity: None,
        }
    }

    /// Names clients' pins from these tables (userspace mode).
    pub(crate) fn with_affinity(mut self, affinity: Option<AffinityTables>) -> Self {
        self.affinity = affinity;
        self
    }
}

/// Adds, to every match with ClientIP affinity, what the relay's table says about `client`.
fn add_pins(explanation: &mut Explanation, tables: &AffinityTables, client: IpAddr) {
    for m in &mut explanation.matches {
        let Some(dataplane) = m.dataplane.as_mut() else {
            continue;
        };
        if m.session_affinity.is_none() {
            continue;
        }
        let label = kp_userspace::backend::service_port_label(&m.name);
        let detail = match tables.lookup(&label, client) {
            PinLookup::Pinned {
                endpoint,
                idle,
                timeout,
            } => format!(
                "client {client} pinned to {endpoint} (last used {}s ago, {}s timeout)",
                idle.as_secs(),
                timeout.as_secs()
            ),
            PinLookup::Unpinned { timeout } => format!(
                "client {client} has no live pin ({}s timeout): its next connection is \
                 balanced round robin and pins it",
                timeout.as_secs()
            ),
            PinLookup::NoAffinity => {
                "the relay has no frontend with affinity for this service port".to_owned()
            }
        };
        dataplane.objects.push(DataplaneObject {
            kind: "affinity pin",
            name: label,
            detail,
        });
    }
}

impl Explainer for StateExplainer {
    fn explain(&self, query: &Query) -> Result<Explained, ExplainFailure> {
        // Nothing is ever marked seen on this receiver, so "changed" means "published at
        // least once", i.e. the first sync has run.
        if !self.state.has_changed().unwrap_or(true) {
            return Err(ExplainFailure::Unavailable(
                "no state yet: the proxy has not completed its first sync".to_owned(),
            ));
        }
        let state = Arc::clone(&self.state.borrow());
        let render_config =
            crate::modes::render_config(&self.config, Some(&state.node.pod_cidrs), &self.node)
                .map_err(|error| {
                    ExplainFailure::Unavailable(kp_core::report::Chain(error.as_ref()).to_string())
                })?;
        let mut explanation =
            explain(&state, &render_config, query).map_err(|error| match error {
                ExplainError::FamilyMismatch { .. } => ExplainFailure::BadQuery(error.to_string()),
                other => ExplainFailure::Unavailable(other.to_string()),
            })?;
        crate::explain::annotate_mode(&mut explanation, &state, &render_config, &self.config)
            .map_err(|error| {
                ExplainFailure::Unavailable(kp_core::report::Chain(error.as_ref()).to_string())
            })?;
        if let (Some(tables), Some(client)) = (&self.affinity, query.source) {
            add_pins(&mut explanation, tables, client);
        }
        // Exactly what `kube-proxy explain` prints on stdout, with the configured mode's objects.
        let text = crate::explain::text::render(&explanation, None);
        let json = serde_json::to_value(&explanation)
            .map_err(|error| ExplainFailure::Unavailable(format!("encoding JSON: {error}")))?;
        Ok(Explained { text, json })
    }
}
