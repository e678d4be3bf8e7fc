//! The sans-I/O core of kube-proxy-rs.
//!
//! Data flows one way: **sources → model → change tracker → sync runner → backend → kernel**.
//! This crate owns everything between the sources and the kernel that can be computed
//! without touching the outside world:
//!
//! - [`event`]: the vocabulary sources speak (Kubernetes objects applied, deleted, synced).
//! - [`model`]: service ports and endpoints built from Services, EndpointSlices and the Node.
//! - [`topology`]: which endpoints a service port may use on this node (traffic policies,
//!   topology hints, terminating-endpoint fallback).
//! - [`tracker`]: change trackers that coalesce events into the proxy state and report which
//!   services changed (for partial syncs) and whether stale UDP conntrack entries need cleanup.
//! - [`runner`]: upstream's minSyncPeriod / syncPeriod timing, coalescing and retries.
//! - [`full_sync`]: which periodic runs are full syncs, per mode, as upstream.
//! - [`backend`]: the trait a proxy mode implements, and a fake backend for tests.
//! - [`foreign`]: changes other programs make to the proxy's rules, how the proxier backs off
//!   when one keeps making them, and what tells a watcher the proxier is writing.
//! - [`proxier`]: the loop tying events, trackers, the runner and a backend together.
//! - [`health`]: proxy health (for `/healthz` and `/livez`) and per-service health.
//! - [`metrics`]: Prometheus metric families with upstream's names.
//!
//! Nothing here does I/O or reads a clock other than `tokio::time`, so every behaviour is
//! testable with paused time and in-memory fakes.
//!
//! With the `test-util` feature (other crates' dev-dependencies enable it), `testutil`
//! (model builders, proptest strategies) and `fixtures` (Kubernetes objects and source
//! events as the API serves them) serve every crate's tests.

pub mod backend;
pub mod event;
#[cfg(any(test, feature = "test-util"))]
pub mod fixtures;
pub mod foreign;
pub mod full_sync;
pub mod health;
pub mod metrics;
pub mod model;
pub mod proxier;
pub mod report;
pub mod runner;
#[cfg(any(test, feature = "test-util"))]
pub mod testutil;
pub mod topology;
pub mod tracker;
