//! Builders for proxy states in tests (the `test-util` feature; this crate's integration
//! tests enable it). The model builders are kp-core's (`kp_core::testutil`); these are the
//! backends' conventions on top: one service port `p`, endpoints on another node, this node
//! at 192.168.0.2.

use std::collections::BTreeSet;

use kp_core::backend::{ApplyError, BackendError, SyncKind, SyncRequest};
use kp_core::model::{Endpoint, NodeInfo, Protocol, ServicePort};
use kp_core::testutil::{cluster_ip_port, node_with, state_on};
use kp_core::tracker::ProxyState;

pub use kp_core::testutil::{NODE, ip, port_name, service_name};

use crate::exec::ExecError;

/// A ClusterIP service port `ns/name:p`.
pub fn service(
    ns: &str,
    name: &str,
    protocol: Protocol,
    cluster_ip: &str,
    port: u16,
) -> ServicePort {
    cluster_ip_port(port_name(ns, name, "p", protocol), cluster_ip, port)
}

/// A ready endpoint on another node.
pub fn endpoint(address: &str, port: u16) -> Endpoint {
    kp_core::testutil::endpoint(address, port, false)
}

/// This node, at 192.168.0.2.
pub fn node() -> NodeInfo {
    node_with(&["192.168.0.2"])
}

/// A state on [`node`] holding `items`.
pub fn state(items: Vec<(ServicePort, Vec<Endpoint>)>) -> ProxyState {
    state_on(node(), items)
}

/// TCP services `ns/a` (10.96.0.1:80 -> 10.244.1.1:8080) and `ns/b` (10.96.0.2:80 ->
/// 10.244.1.2:8080), one endpoint each.
pub fn two_services() -> ProxyState {
    state(vec![
        (
            service("ns", "a", Protocol::Tcp, "10.96.0.1", 80),
            vec![endpoint("10.244.1.1", 8080)],
        ),
        (
            service("ns", "b", Protocol::Tcp, "10.96.0.2", 80),
            vec![endpoint("10.244.1.2", 8080)],
        ),
    ])
}

/// A sync request for `state`.
pub fn request<'a>(
    state: &'a ProxyState,
    kind: SyncKind,
    changed: &'a BTreeSet<kp_core::model::ServiceName>,
    conntrack: bool,
) -> SyncRequest<'a> {
    SyncRequest {
        state,
        kind,
        changed,
        conntrack_cleanup_required: conntrack,
    }
}

/// Run an async test body on a fresh current-thread runtime.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(future)
}

/// One sync of `kind` of `state` through `backend`, with `changed` services and no
/// conntrack cleanup, which must succeed (a fake's does).
pub async fn sync<B: kp_core::backend::Backend>(
    backend: &mut B,
    state: &ProxyState,
    kind: SyncKind,
    changed: &BTreeSet<kp_core::model::ServiceName>,
) {
    backend
        .sync(&request(state, kind, changed, false))
        .await
        .expect("the sync succeeds");
}

/// One full sync of `state` through `backend`, which must succeed (a fake's does).
pub async fn sync_full<B: kp_core::backend::Backend>(backend: &mut B, state: &ProxyState) {
    sync(backend, state, SyncKind::Full, &BTreeSet::new()).await;
}

/// The tool's error under `err` when running the tool for `what` failed; `None` for any other
/// error.
pub fn tool_error<'a>(err: &'a BackendError, what: &str) -> Option<&'a ExecError> {
    match err.apply()? {
        ApplyError::Tool { what: w, source } if w == what => source.downcast_ref(),
        _ => None,
    }
}
