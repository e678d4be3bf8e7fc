//! `--proxy-mode fake`: a backend that programs nothing and logs what it would program.
//!
//! It lets an operator (or a test) run the whole pipeline (sources, model, tracker, runner,
//! servers) on any machine without privileges, and see each sync's outcome in the log.

use kp_core::backend::{Backend, BackendError, SyncReport, SyncRequest};

use super::{Input, Mode};

/// fake mode.
#[derive(Debug)]
pub struct Fake;

impl Mode for Fake {
    type Backend = DryRun;

    fn build(_input: Input<'_>) -> anyhow::Result<Self::Backend> {
        tracing::info!("Using the fake proxier: nothing is programmed, every sync is logged");
        Ok(DryRun)
    }
}

/// Logs every sync. Unlike the tests' recording fake it keeps nothing, so it can run for
/// as long as the proxy does.
#[derive(Debug, Default)]
pub struct DryRun;

impl Backend for DryRun {
    fn mode(&self) -> &'static str {
        "fake"
    }

    async fn sync(&mut self, request: &SyncRequest<'_>) -> Result<SyncReport, BackendError> {
        let endpoints: usize = request.state.endpoints.values().map(Vec::len).sum();
        let changed: Vec<String> = request.changed.iter().map(ToString::to_string).collect();
        tracing::info!(
            kind = ?request.kind,
            service_ports = request.state.services.len(),
            endpoints,
            changed = changed.join(","),
            conntrack_cleanup = request.conntrack_cleanup_required,
            "Dry-run sync (programs nothing)"
        );
        Ok(SyncReport::new(request.kind))
    }

    async fn cleanup(&mut self) -> Result<(), BackendError> {
        tracing::info!("Dry-run cleanup: nothing was ever installed");
        Ok(())
    }
}
