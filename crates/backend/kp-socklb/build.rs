//! Compiles the BPF programs (bpf/socklb.bpf.c) with clang into `$OUT_DIR/socklb.bpf.o`,
//! which the crate embeds. No object is committed: a fresh machine builds it from source
//! with Debian's `clang` and `libbpf-dev` (setup.sh installs both).

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "bpf/socklb.bpf.c";
/// The C compiler; `KP_SOCKLB_CLANG` overrides it (e.g. `clang-16`).
const CLANG_ENV: &str = "KP_SOCKLB_CLANG";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-env-changed={CLANG_ENV}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let clang = std::env::var(CLANG_ENV).unwrap_or_else(|_| "clang".to_owned());
    let mut command = Command::new(&clang);
    command
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .args(multiarch_include())
        .args(["-c", SOURCE, "-o"])
        .arg(out.join("socklb.bpf.o"));
    let status = command.status().unwrap_or_else(|error| {
        panic!(
            "kp-socklb: cannot run `{clang}` ({error}): the socket load balancer's BPF \
             programs are C compiled by clang; run ./setup.sh (it installs clang and \
             libbpf-dev) or set {CLANG_ENV}"
        )
    });
    assert!(
        status.success(),
        "kp-socklb: `{clang}` failed to compile {SOURCE} ({status}); it needs the kernel \
         headers (linux-libc-dev) and libbpf's (libbpf-dev): run ./setup.sh"
    );
}

/// `-target bpf` drops the host's multiarch include directory, where Debian keeps
/// `asm/types.h` (which `linux/bpf.h` includes): add it back for the host being built for.
fn multiarch_include() -> Vec<String> {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let triple = match arch.as_str() {
        "x86_64" => "x86_64-linux-gnu",
        "aarch64" => "aarch64-linux-gnu",
        _ => return Vec::new(),
    };
    let dir = Path::new("/usr/include").join(triple);
    if dir.is_dir() {
        vec![format!("-I{}", dir.display())]
    } else {
        Vec::new()
    }
}
