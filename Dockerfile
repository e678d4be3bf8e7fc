# kube-proxy-rs container image: build with `docker build -t kube-proxy-rs .` from the
# repository root. The binary lands at /usr/local/bin/kube-proxy, where deploy/daemonset.yaml
# (and kubeadm's DaemonSet) run it.

FROM rust:1-bookworm AS builder
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kube-proxy \
    && install -D -m 0755 target/release/kube-proxy /out/kube-proxy

FROM debian:bookworm-slim
# The userspace tools kube-proxy drives on the node (util-linux's `unshare`, which isolates a
# failing iptables restore in a throwaway network namespace, is in the base image).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        iptables nftables ipset conntrack iproute2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=builder /out/kube-proxy /usr/local/bin/kube-proxy
ENTRYPOINT ["/usr/local/bin/kube-proxy"]
