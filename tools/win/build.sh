#!/usr/bin/env bash
# Builds the Windows binary (x86_64-pc-windows-gnu) with rustup's standard library for that
# target and Debian's MinGW-w64 cross toolchain, plus the bcryptprimitives.dll that lets it
# start under Wine 8.0 (processprng.c). Prints the directory holding kube-proxy.exe and the DLL.
#
#   tools/win/build.sh [--release]        (TARGET_DIR: default target-win in the checkout)
#
# `setup.sh --tests` installs the cross toolchain and Wine; the target's standard library
# comes from `rustup target add` (here, once, then cached in the toolchain).
set -euo pipefail
cd "$(dirname "$0")/../.."

target=x86_64-pc-windows-gnu
target_dir="${TARGET_DIR:-$PWD/target-win}"
profile=debug
args=()
if [ "${1:-}" = "--release" ]; then
  profile=release
  args+=(--release)
fi
gcc=x86_64-w64-mingw32-gcc-posix
for tool in "$gcc" x86_64-w64-mingw32-ar; do
  command -v "$tool" >/dev/null || {
    echo "tools/win/build.sh: $tool is missing; run ./setup.sh --tests" >&2
    exit 1
  }
done
if ! rustc --print target-libdir --target "$target" 2>/dev/null | xargs test -d; then
  rustup target add "$target" >&2
fi

export CARGO_TARGET_X86_64_PC_WINDOWS_GNU_LINKER="$gcc"
export CC_x86_64_pc_windows_gnu="$gcc" AR_x86_64_pc_windows_gnu=x86_64-w64-mingw32-ar
# The demo (network namespaces) is Linux-only: the Windows binary is built without it.
cargo build --locked --target "$target" --target-dir "$target_dir" -p kube-proxy \
  --no-default-features "${args[@]}" >&2

out="$target_dir/$target/$profile"
dll="$out/bcryptprimitives.dll"
if [ ! -e "$dll" ] || [ tools/win/processprng.c -nt "$dll" ]; then
  "$gcc" -O2 -shared -o "$dll" tools/win/processprng.c -ladvapi32 -Wl,--kill-at
fi
echo "$out"
