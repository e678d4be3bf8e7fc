//! kp-config's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-config --test config corpus::`). None needs root.

mod corpus;
mod fuzz;
