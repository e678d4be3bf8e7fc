//! The proxy's HTTP servers, as upstream kube-proxy exposes them:
//!
//! - [`health::serve_health`]: `/healthz` and `/livez` (default `0.0.0.0:10256`), used by
//!   load balancers and liveness probes.
//! - [`metrics::serve_metrics`]: `/metrics`, `/healthz`, `/proxyMode` and `/configz`
//!   (default `127.0.0.1:10249`), and with [`metrics::serve_metrics_with_explain`] the
//!   opt-in `/debug/explain` ([`explain`]).
//! - [`service_health::ServiceHealthServers`]: one listener per health-check node port of
//!   `externalTrafficPolicy: Local` services, reconciled from the proxier's published map.
//!
//! Every server takes an already bound [`tokio::net::TcpListener`] and a
//! [`CancellationToken`]: the caller owns binding (and
//! upstream's retry-every-5-s or hard-fail policy for the proxy health port), tests run the
//! servers on `127.0.0.1:0`, and cancelling the token stops accepting at once and lets
//! in-flight requests finish for at most [`DEFAULT_SHUTDOWN_GRACE`].
//!
//! # Staying responsive under data-plane load
//!
//! A slow `/healthz` makes load balancers drain the node and liveness probes restart the
//! proxy, so these endpoints must answer even while a large sync (thousands of rules) keeps
//! the main runtime busy. The binary therefore runs all of these servers on their own small
//! Tokio runtime on a dedicated thread. Handlers here only take a short lock (a health
//! snapshot, a `watch` borrow) or encode the metrics registry; none of them blocks or waits
//! on the proxier.

pub mod explain;
pub mod health;
pub mod metrics;
pub mod protobuf;
pub mod service_health;
pub mod zpages;

use kp_core::report::ErrorChain as _;
use std::future::IntoFuture;
use std::io;
use std::time::Duration;

use axum::Router;
use axum::http::header::{CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use explain::{ExplainFailure, Explained, Explainer};
pub use health::{HealthMetrics, serve_health};
pub use metrics::{MetricsInfo, serve_metrics, serve_metrics_with_explain};
pub use service_health::ServiceHealthServers;

/// How long a server waits for open connections after shutdown before giving up on them.
/// Every response here is produced instantly, so only a stuck or malicious client takes
/// longer, and it must not hold up process exit.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Why a server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The HTTP server failed while accepting or serving connections.
    #[error("{server} server failed")]
    Serve {
        /// Which server.
        server: &'static str,
        /// The underlying error.
        source: io::Error,
    },
    /// The `/configz` document could not be encoded as JSON.
    #[error("cannot encode the /configz document")]
    Configz(#[source] serde_json::Error),
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then waits at most
/// [`DEFAULT_SHUTDOWN_GRACE`] for open connections.
pub(crate) async fn serve_router(
    server: &'static str,
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> Result<(), ServerError> {
    match listener.local_addr() {
        Ok(addr) => tracing::debug!(server, %addr, "serving"),
        Err(error) => tracing::debug!(server, error = %error.chain(), "serving (address unknown)"),
    }
    let serving = axum::serve(listener, router)
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .into_future();
    let grace_expired = async {
        shutdown.cancelled().await;
        tokio::time::sleep(DEFAULT_SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        result = serving => {
            tracing::debug!(server, "stopped");
            result.map_err(|source| ServerError::Serve { server, source })
        }
        () = grace_expired => {
            tracing::warn!(server, grace = ?DEFAULT_SHUTDOWN_GRACE, "connections still open after shutdown; abandoning them");
            Ok(())
        }
    }
}

/// A JSON response with upstream's headers (`application/json`, `nosniff`).
pub(crate) fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            status,
            [
                (CONTENT_TYPE, HeaderValue::from_static("application/json")),
                (X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
            ],
            bytes,
        )
            .into_response(),
        Err(error) => {
            tracing::error!(error = %error.chain(), "cannot encode a JSON response");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
