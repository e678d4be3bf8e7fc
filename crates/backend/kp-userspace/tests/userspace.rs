//! kp-userspace's integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-userspace --test userspace backend::`). Those that relay real traffic run on loopback or in network namespaces; the Windows suite builds the Windows binary and runs it under Wine.

mod support;

mod backend;
mod localhost;
mod relay;
mod winuserspace;
