#!/usr/bin/env bash
# Builds the runtime image's root file system without a container engine, or reuses a cached
# one, and prints its path: Debian bookworm from debootstrap's minbase variant (what
# debian:bookworm-slim is made from), then the packages of packages.txt installed the way the
# Dockerfile installs them (apt-get install --no-install-recommends, then the package lists
# removed). The binary is not in it: the image test mounts it at /usr/local/bin/kube-proxy.
#
# Cached in $KP_IMAGE_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/kube-proxy-rs/image-rootfs),
# one directory per hash of packages.txt and this script, so an unchanged list is built once.
# Needs root, debootstrap (./setup.sh --tests installs it) and Debian's package mirror: the
# first `deb`/`URIs:` entry of this machine's APT sources that serves Debian, else
# deb.debian.org ($KP_IMAGE_MIRROR overrides it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
list="$here/packages.txt"
suite=bookworm
cache="${KP_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-proxy-rs/image-rootfs}"
key="$(cat "$list" "$0" | sha256sum | cut -c1-16)"
dest="$cache/$suite-$key"

if [ -e "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "rootfs.sh: debootstrap is missing (./setup.sh --tests installs it)" >&2
  exit 1
}
mkdir -p "$cache"
# One build at a time (parallel test binaries); the loser of the race reuses the result.
exec 9>"$cache/.lock"
flock 9
if [ -e "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi

# The Debian mirror this machine's APT uses (one-line or deb822 sources), not its security
# or updates suites' hosts.
mirror="${KP_IMAGE_MIRROR:-}"
if [ -z "$mirror" ]; then
  mirror="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | sed -n -e 's/^deb \(\[[^]]*\] \)\{0,1\}\(https\{0,1\}:[^ ]*\) .*/\2/p' -e 's/^URIs: *\(https\{0,1\}:[^ ]*\).*/\1/p' \
    | grep -v -e security -e '-updates' | grep -m1 debian || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"
# The security suite's host, if this machine has one (the slim image has it too).
security="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
  | sed -n -e 's/^deb \(\[[^]]*\] \)\{0,1\}\(https\{0,1\}:[^ ]*security[^ ]*\) .*/\2/p' -e 's/^URIs: *\(https\{0,1\}:[^ ]*security[^ ]*\).*/\1/p' \
  | head -n1 || true)"

work="$(mktemp -d "$cache/.build-XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
echo "rootfs.sh: debootstrap --variant=minbase $suite from $mirror" >&2
debootstrap --variant=minbase "$suite" "$work" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
  tail -n 20 "$cache/debootstrap.log" >&2
  exit 1
}
{
  echo "deb $mirror $suite main"
  echo "deb $mirror $suite-updates main"
  [ -z "$security" ] || echo "deb $security $suite-security main"
} >"$work/etc/apt/sources.list"
# The same package list and apt-get flags as the Dockerfile's RUN.
packages="$(sed 's/#.*//' "$list")"
# shellcheck disable=SC2086 # one word per package
chroot "$work" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
  sh -c 'apt-get update -q && apt-get install -y -q --no-install-recommends "$@" && apt-get clean && rm -rf /var/lib/apt/lists/*' \
  sh $packages >"$cache/apt.log" 2>&1 || {
  tail -n 20 "$cache/apt.log" >&2
  exit 1
}
touch "$work/.complete"
mv "$work" "$dest"
trap - EXIT
echo "rootfs.sh: built $dest in $(($(date +%s) - start)) s" >&2
echo "$dest"
