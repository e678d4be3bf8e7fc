//! Change tracking: coalesce source events into the proxy state and report what changed.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Endpoint, NodeInfo, ServicePort, ServicePortName};

/// The complete desired state handed to a backend.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ProxyState {
    /// Every valid service port, sorted (so renderers are deterministic).
    pub services: BTreeMap<ServicePortName, ServicePort>,
    /// Endpoints per service port, sorted; a service port without endpoints may be absent.
    pub endpoints: BTreeMap<ServicePortName, Vec<Endpoint>>,
    /// This node.
    pub node: NodeInfo,
}
