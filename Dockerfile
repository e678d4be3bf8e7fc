# kube-proxy-rs container image: build with `docker build -t kube-proxy-rs .` from the
# repository root. The binary lands at /usr/local/bin/kube-proxy, where deploy/daemonset.yaml
# (and kubeadm's DaemonSet) run it. It is built with the default features, which leave the demo
# out: its test bed has no place on a node (`kube-proxy demo` then says this build has none).

FROM rust:1-bookworm AS builder
# kp-socklb's build.rs compiles the socket load balancer's BPF programs with clang and
# libbpf's headers (docs/socket-lb.md); nothing links libbpf, so the runtime image needs neither.
RUN apt-get update \
    && apt-get install -y --no-install-recommends clang libbpf-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kube-proxy \
    && install -D -m 0755 target/release/kube-proxy /out/kube-proxy

FROM debian:bookworm-slim
# The userspace tools kube-proxy drives on the node: deploy/image/packages.txt, the one list the
# image test (crates/kube-proxy/tests/image.rs) also builds its root file system from. util-linux's
# `unshare`, which isolates a failing iptables restore in a throwaway network namespace, is in
# the base image.
COPY deploy/image/packages.txt /tmp/packages.txt
RUN apt-get update \
    && apt-get install -y --no-install-recommends $(sed 's/#.*//' /tmp/packages.txt) \
    && rm -rf /var/lib/apt/lists/* /tmp/packages.txt
COPY --from=builder /out/kube-proxy /usr/local/bin/kube-proxy
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
