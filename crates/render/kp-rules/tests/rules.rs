//! kp-rules' integration tests, in one binary (one link, one run; issue 37): each module is one
//! suite, named as its file (`cargo test -p kp-rules --test rules explain::`). The suites that
//! apply rules in a throwaway network namespace skip their kernel half without root (failing
//! under `CI`).

mod common;
mod nft_common;
mod nft_layout_common;

mod explain;
mod explain_localhost;
mod explain_modes;
mod fuzz_render;
mod ipvs;
mod kernel;
mod nft_hostile;
mod nft_kernel;
mod nft_layout_affinity;
mod nft_layout_balance;
mod nft_ops;
mod nft_snapshots;
mod options;
mod partial;
mod relaxed_names;
mod snapshots;
mod userspace;
