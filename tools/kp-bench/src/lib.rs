//! Scale benchmarks of the iptables mode (the `kp-scale` binary).
//!
//! [`generate`] writes N Services × M endpoints as manifests, [`state`] builds the proxy
//! state from them in-process (to render and restore without the proxy), [`logs`] reads the
//! figures out of the proxy's `-v=2` log, [`split`] cuts one restore into several
//! transactions, [`sys`] holds the namespace and `/proc` plumbing, [`report`] prints
//! markdown, [`soak`] summarises the churn soak's samples (the `kp-soak` binary), and
//! [`summary`] with [`svg`] turns the runs' tables into `bench/REPORT.md` and
//! its plots (the `kp-report` binary), keeping the points in [`points`] and judging
//! issue 16's [`targets`] on them. Nothing here asserts on timings: these are measurements, not tests.

pub mod connect;
pub mod generate;
pub mod logs;
pub mod points;
pub mod report;
pub mod soak;
pub mod split;
pub mod state;
pub mod summary;
pub mod svg;
pub mod sys;
pub mod targets;
pub mod topology;

#[cfg(test)]
mod tests;
