#!/usr/bin/env bash
# Installs the tools the proxy, its demo and its tests exec, when a fresh Debian/Ubuntu machine
# lacks them (apt-get, only what is missing). README's first command and .ci/run call this;
# `--tests` adds what only the test suites need.
set -euo pipefail

# command -> Debian package providing it.
declare -A packages=(
  [iptables-restore]=iptables
  [nft]=nftables
  [conntrack]=conntrack
  [ip]=iproute2
  [ipset]=ipset
  [sysctl]=procps
  [kill]=procps
)
if [ "${1:-}" = "--tests" ]; then
  # The IPVS/SCTP suites boot Debian's kernel in QEMU (crates/kp-vm); the kernel package
  # itself is fetched by `apt-get download` on first use and cached.
  packages+=(
    [qemu-system-x86_64]=qemu-system-x86
    [depmod]=kmod
    [xz]=xz-utils
    [ipvsadm]=ipvsadm
  )
fi
missing=()
for cmd in "${!packages[@]}"; do
  # `type -P`: the program on PATH, not a shell builtin (kill is both; we exec the program).
  type -P "$cmd" >/dev/null 2>&1 || missing+=("${packages[$cmd]}")
done
# The VM's init is /bin/busybox and must be the static build.
if [ "${1:-}" = "--tests" ] && { [ ! -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; }; then
  missing+=(busybox-static)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  # One package may provide several missing commands.
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
