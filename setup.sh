#!/usr/bin/env bash
# Installs the tools the proxy, its demo and its tests exec, when a fresh Debian/Ubuntu machine
# lacks them (apt-get, only what is missing). README's first command calls this; `--tests`
# (README's test command, which .ci/run runs) adds what only the test suites need.
set -euo pipefail

# The Rust toolchain is not a Debian package we can use (bookworm's is too old): say so early.
if ! command -v cargo >/dev/null 2>&1; then
  echo "setup.sh: cargo is missing; install the Rust toolchain first (rustup), then run this again" >&2
  exit 1
fi

# command -> Debian package providing it.
declare -A packages=(
  [iptables-restore]=iptables
  [nft]=nftables
  [conntrack]=conntrack
  [ip]=iproute2
  [ipset]=ipset
  [sysctl]=procps
  [kill]=procps
  # Building: the linker, and the C compiler and libc headers `ring` needs.
  [cc]=build-essential
  # kp-socklb's build.rs compiles its BPF programs (C) with clang (-target bpf).
  [clang]=clang
)
if [ "${1:-}" = "--tests" ]; then
  # The IPVS/SCTP suites boot Debian's kernel in QEMU (tools/kp-vm); the kernel package
  # itself is fetched by `apt-get download` on first use and cached.
  packages+=(
    [qemu-system-x86_64]=qemu-system-x86
    [depmod]=kmod
    [xz]=xz-utils
    [ipvsadm]=ipvsadm
    # The image test builds the runtime image's root file system (deploy/image/rootfs.sh).
    [debootstrap]=debootstrap
    # The winuserspace test builds the Windows binary (tools/win/build.sh) with MinGW-w64
    # and runs it under Wine (wine64 is the loader `wine` runs on amd64).
    [x86_64-w64-mingw32-gcc-posix]=gcc-mingw-w64-x86-64-posix
    [x86_64-w64-mingw32-ar]=binutils-mingw-w64-x86-64
    [wine]=wine
    # kp-bench's data-path benchmark (kp-datapath) measures throughput with iperf3; it
    # starts its own servers, so the package's daemon stays off (preseeded below).
    [iperf3]=iperf3
  )
fi
missing=()
for cmd in "${!packages[@]}"; do
  # `type -P`: the program on PATH, not a shell builtin (kill is both; we exec the program).
  type -P "$cmd" >/dev/null 2>&1 || missing+=("${packages[$cmd]}")
done
# The BPF programs include libbpf's helper definitions (headers only; nothing links libbpf).
[ -e /usr/include/bpf/bpf_helpers.h ] || missing+=(libbpf-dev)
# The VM's init is /bin/busybox and must be the static build.
if [ "${1:-}" = "--tests" ] && { [ ! -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; }; then
  missing+=(busybox-static)
fi
if [ "${1:-}" = "--tests" ]; then
  [ -e /usr/x86_64-w64-mingw32/include/windows.h ] || missing+=(mingw-w64-x86-64-dev)
  [ -x /usr/lib/wine/wine64 ] || missing+=(wine64)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # One package may provide several missing commands.
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  export DEBIAN_FRONTEND=noninteractive
  # iperf3 asks whether to start its daemon: answer no before it is installed.
  echo "iperf3 iperf3/start_daemon boolean false" | $sudo debconf-set-selections
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# CI's gates beyond the tests (docs/testing.md, "What CI runs"): rustup's formatter and
# linter, and cargo-deny from crates.io, built once (a few minutes) when missing.
if [ "${1:-}" = "--tests" ]; then
  for component in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$component" || rustup component add "$component"
  done
  command -v cargo-deny >/dev/null 2>&1 || cargo install --locked cargo-deny
fi
# The Windows binary's standard library: rustup's, for the one target the test builds.
if [ "${1:-}" = "--tests" ] && ! rustc --print target-libdir --target x86_64-pc-windows-gnu 2>/dev/null | xargs test -d; then
  rustup target add x86_64-pc-windows-gnu
fi
