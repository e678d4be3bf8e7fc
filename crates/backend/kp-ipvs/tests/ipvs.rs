//! kp-ipvs's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-ipvs --test ipvs codec::`). The kernel suite runs in the test VM (tools/kp-vm).

mod codec;
mod kernel;
