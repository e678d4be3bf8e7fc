//! The proxy state for generated manifests, built in-process the way the proxy builds it:
//! the manifests source's parser (with the API server's defaults) and the change tracker.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context as _, bail};
use kp_core::event::{ObjectEvent, SourceEvent};
use kp_core::model::ServiceName;
use kp_core::tracker::{ChangeTracker, ProxyState};
use kp_sources::manifests::{Object, parse_manifests};

use crate::generate::{Manifests, NODE_NAME};

/// A proxy state and the tracker that built it, so edits can be applied as the proxy would.
#[derive(Debug)]
pub struct Loaded {
    /// The tracker (for node [`NODE_NAME`]).
    pub tracker: ChangeTracker,
    /// The state after the last [`Loaded::update`].
    pub state: ProxyState,
}

/// Parse one file; any skipped document is an error (generated manifests must be valid).
pub fn parse_file(name: &str, text: &str) -> anyhow::Result<Vec<Object>> {
    let (objects, errors) = parse_manifests(text, Path::new(name));
    if let Some(error) = errors.first() {
        bail!("{name}: {} invalid documents, first: {error}", errors.len());
    }
    Ok(objects)
}

impl Loaded {
    /// Parse every file and apply everything, as the proxy's first sync sees it.
    pub fn new(manifests: &Manifests) -> anyhow::Result<Self> {
        let mut tracker = ChangeTracker::new(NODE_NAME);
        for (name, text) in &manifests.files {
            for object in parse_file(name, text)? {
                tracker.record(object.applied());
            }
        }
        tracker.record(SourceEvent::Service(ObjectEvent::Synced));
        tracker.record(SourceEvent::EndpointSlice(ObjectEvent::Synced));
        tracker.record(SourceEvent::Node(ObjectEvent::Synced));
        let mut state = ProxyState::default();
        let result = tracker.apply(&mut state);
        if let Some(invalid) = result.invalid.first() {
            bail!("{} invalid objects, first: {invalid}", result.invalid.len());
        }
        Ok(Self { tracker, state })
    }

    /// Re-record the objects of a rewritten file and apply them: the services that changed.
    pub fn update(&mut self, name: &str, text: &str) -> anyhow::Result<BTreeSet<ServiceName>> {
        for object in parse_file(name, text).context("parsing the edited file")? {
            self.tracker.record(object.applied());
        }
        Ok(self.tracker.apply(&mut self.state).changed)
    }

    /// Endpoints across all service ports.
    pub fn endpoints(&self) -> usize {
        self.state.endpoints.values().map(Vec::len).sum()
    }
}
