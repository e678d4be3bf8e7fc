//! kp-server's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-server --test server explain::`). Each serves on a loopback port of its own.

mod common;

mod explain;
mod health;
mod metrics;
mod service_health;
