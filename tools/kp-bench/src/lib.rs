//! Benchmarks of the proxy, shared by the binaries in `src/bin/`: `kp-scale` (first and
//! partial syncs and peak RSS for N Services × M endpoints, per mode), `kp-connect`
//! (connection set-up latency through a ClusterIP), `kp-datapath` (throughput and latency:
//! direct, iptables mode, userspace relay), `kp-conntrack` (stale-entry cleanup), `kp-mem`
//! (control-plane memory by phase), `kp-churn` (programming latency under EndpointSlice churn
//! through the fake API server), `kp-soak` (RSS and fds over minutes of churn), `kp-ipvs-sync`
//! (the ipvs backend's syncs in the test VM) and `kp-report` (all of them per mode and size,
//! into `bench/REPORT.md`). `tools/kp-bench/README.md` says how to run them.
//!
//! [`generate`] writes N Services × M endpoints as manifests, [`state`] builds the proxy
//! state from them in-process (to render and restore without the proxy), [`logs`] reads the
//! figures out of the proxy's `-v=2` log, [`split`] cuts one restore into several
//! transactions, [`sys`] holds the namespace and `/proc` plumbing, [`topology`] the
//! namespaces of the data-path benchmarks, [`connect`] `kp-connect`'s manifests and latency
//! statistics, [`probe`] the helpers of the kernel probes in `examples/`, [`report`] prints
//! markdown, [`soak`] summarises the churn soak's samples, and [`summary`]
//! with [`svg`] turns the runs' tables into `bench/REPORT.md` and its plots, keeping the
//! points in [`points`] and judging the [`targets`] on them; [`changes`] reads and reports
//! `kp-scale --changes`' per-kind partial syncs against issue 33's targets, [`listing`] its
//! `--list-ruleset` table. Nothing here asserts on timings:
//! these are measurements, not tests.

pub mod changes;
pub mod connect;
pub mod datapath;
pub mod generate;
pub mod listing;
pub mod logs;
pub mod points;
pub mod probe;
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
