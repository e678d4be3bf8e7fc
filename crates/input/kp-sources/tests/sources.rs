//! kp-sources's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-sources --test sources api::`). The API source's suites run against an in-process fake API server; none needs root.

mod api;
mod events;
mod fuzz_manifests;
mod hostile;
mod manifests;
mod node_status;
