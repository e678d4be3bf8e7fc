//! kp-testbed's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-testbed --test testbed cleanup::`). They build clusters of network namespaces and need root (skipping without it, failing under `CI`).

mod cleanup;
mod flows;
