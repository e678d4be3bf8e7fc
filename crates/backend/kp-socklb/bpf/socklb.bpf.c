// SPDX-License-Identifier: Apache-2.0
//
// Socket-level load balancing for kube-proxy-rs: cgroup sock_addr programs that rewrite a
// socket's Service address into one of its endpoints when the socket connects (TCP, UDP) or
// sends an unconnected UDP datagram, and show the Service address again where the
// application reads its peer (getpeername, recvfrom). Packets then carry the endpoint's
// address from the start: no per-packet NAT, no conntrack NAT entry.
//
// The maps' layouts are mirrored byte for byte by src/maps.rs (which writes them); change
// both together. Addresses and ports are in network byte order, counters in host order.

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#define KP_ECONNREFUSED 111

// A Service port: ClusterIP (or external/load balancer IP), port, IP protocol.
struct kp_service_key {
	__u32 addr;
	__u16 port;
	__u8 proto;
	__u8 pad;
};

// Where a Service port's endpoints are: slots 0..count-1 of `id` in kp_slots. count 0 means
// the Service port exists but has no usable endpoint: refuse, as nftables mode rejects.
// affinity_ms is ClientIP affinity's timeout (0: none): a client keeps its endpoint while it
// connects again within that long of its last connect (kp_affinity).
struct kp_service {
	__u32 id;
	__u32 count;
	__u32 affinity_ms;
};

struct kp_slot_key {
	__u32 id;
	__u32 slot;
};

struct kp_endpoint {
	__u32 addr;
	__u16 port;
	__u16 pad;
};

// What one socket was translated to (its cookie and the endpoint), so the Service address
// can be shown back: one entry a connected socket, one a (socket, endpoint) pair for
// unconnected UDP.
struct kp_reverse_key {
	__u64 cookie;
	__u32 addr;
	__u16 port;
	__u16 pad;
};

// The IPv6 forms: the same fields with 16-byte addresses. Service ids are shared by both
// families; each family has its own slots.
struct kp_service_key6 {
	__u32 addr[4];
	__u16 port;
	__u8 proto;
	__u8 pad;
};

struct kp_endpoint6 {
	__u32 addr[4];
	__u16 port;
	__u16 pad;
};

struct kp_reverse_key6 {
	__u64 cookie;
	__u32 addr[4];
	__u16 port;
	__u16 pad;
	__u32 pad2;
};

// ClientIP affinity: a client (its network namespace, i.e. its pod; the node's own
// processes share the host's) and a Service port -> the endpoint it is pinned to, and when
// it last connected (bpf_ktime_get_ns). The proxy deletes a pin when its endpoint leaves
// the Service's list; LRU, so under pressure the oldest pins go (those clients pick anew).
struct kp_affinity_key {
	__u64 netns;
	struct kp_service_key service;
};

struct kp_affinity {
	__u64 used_ns;
	struct kp_endpoint endpoint;
};

struct kp_affinity_key6 {
	__u64 netns;
	struct kp_service_key6 service;
	__u32 pad;
};

struct kp_affinity6 {
	__u64 used_ns;
	struct kp_endpoint6 endpoint;
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 262144);
	__type(key, struct kp_service_key);
	__type(value, struct kp_service);
} kp_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1048576);
	__type(key, struct kp_slot_key);
	__type(value, struct kp_endpoint);
} kp_slots SEC(".maps");

// LRU: entries of closed sockets age out without a socket release hook.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_reverse_key);
	__type(value, struct kp_endpoint);
} kp_reverse SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 262144);
	__type(key, struct kp_service_key6);
	__type(value, struct kp_service);
} kp_services6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 1048576);
	__type(key, struct kp_slot_key);
	__type(value, struct kp_endpoint6);
} kp_slots6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_reverse_key6);
	__type(value, struct kp_endpoint6);
} kp_reverse6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_affinity_key);
	__type(value, struct kp_affinity);
} kp_affinity SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct kp_affinity_key6);
	__type(value, struct kp_affinity6);
} kp_affinity6 SEC(".maps");

// Whether a pin last used at used_ns still holds at now (within the Service's timeout).
static __always_inline int kp_pin_is_live(struct kp_service *service, __u64 used_ns, __u64 now)
{
	return service->affinity_ms && now - used_ns <= (__u64)service->affinity_ms * 1000000;
}

// The slot a Service port's connection goes to, chosen uniformly; NULL (leave the address
// alone) when the Service port is unknown. Sets *refuse when it has no endpoints.
static __always_inline struct kp_slot_key *kp_pick(struct kp_service *service,
						     struct kp_slot_key *slot, int *refuse)
{
	if (!service)
		return 0;
	if (service->count == 0) {
		*refuse = 1;
		return 0;
	}
	slot->id = service->id;
	slot->slot = bpf_get_prandom_u32() % service->count;
	return slot;
}

// The endpoint for `slot` (the random pick), or with ClientIP affinity the one this client
// is pinned to while its pin is live; a new pick is pinned. NULL: the slot is mid-update.
static __always_inline struct kp_endpoint *kp_sticky4(struct bpf_sock_addr *ctx,
						       struct kp_service *service,
						       struct kp_service_key *key,
						       struct kp_slot_key *slot)
{
	if (!service->affinity_ms)
		return bpf_map_lookup_elem(&kp_slots, slot);
	struct kp_affinity_key client = { .netns = bpf_get_netns_cookie(ctx), .service = *key };
	__u64 now = bpf_ktime_get_ns();
	struct kp_affinity *pin = bpf_map_lookup_elem(&kp_affinity, &client);
	if (pin && kp_pin_is_live(service, pin->used_ns, now)) {
		pin->used_ns = now;
		return &pin->endpoint;
	}
	struct kp_endpoint *endpoint = bpf_map_lookup_elem(&kp_slots, slot);
	if (!endpoint)
		return 0;
	struct kp_affinity fresh = { .used_ns = now, .endpoint = *endpoint };
	bpf_map_update_elem(&kp_affinity, &client, &fresh, BPF_ANY);
	return endpoint;
}

// kp_sticky4 for IPv6 sockets.
static __always_inline struct kp_endpoint6 *kp_sticky6(struct bpf_sock_addr *ctx,
							struct kp_service *service,
							struct kp_service_key6 *key,
							struct kp_slot_key *slot)
{
	if (!service->affinity_ms)
		return bpf_map_lookup_elem(&kp_slots6, slot);
	struct kp_affinity_key6 client = { .netns = bpf_get_netns_cookie(ctx), .service = *key };
	__u64 now = bpf_ktime_get_ns();
	struct kp_affinity6 *pin = bpf_map_lookup_elem(&kp_affinity6, &client);
	if (pin && kp_pin_is_live(service, pin->used_ns, now)) {
		pin->used_ns = now;
		return &pin->endpoint;
	}
	struct kp_endpoint6 *endpoint = bpf_map_lookup_elem(&kp_slots6, slot);
	if (!endpoint)
		return 0;
	struct kp_affinity6 fresh = { .used_ns = now, .endpoint = *endpoint };
	bpf_map_update_elem(&kp_affinity6, &client, &fresh, BPF_ANY);
	return endpoint;
}

// The socket's destination if it is a Service port with endpoints (rewritten to one of
// them, chosen uniformly); 1 to let the call go on (translated or not), 0 to refuse it.
static __always_inline int kp_translate4(struct bpf_sock_addr *ctx)
{
	struct kp_service_key key = {
		.addr = ctx->user_ip4,
		.port = (__u16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	struct kp_slot_key slot = {};
	int refuse = 0;
	struct kp_service *service = bpf_map_lookup_elem(&kp_services, &key);
	if (!kp_pick(service, &slot, &refuse)) {
		if (refuse)
			bpf_set_retval(-KP_ECONNREFUSED);
		return !refuse;
	}
	struct kp_endpoint *endpoint = kp_sticky4(ctx, service, &key, &slot);
	// A slot mid-update: leave the address as it is, nftables mode's rules still serve it.
	if (!endpoint)
		return 1;
	struct kp_reverse_key reverse = {
		.cookie = bpf_get_socket_cookie(ctx),
		.addr = endpoint->addr,
		.port = endpoint->port,
	};
	struct kp_endpoint original = { .addr = key.addr, .port = key.port };
	bpf_map_update_elem(&kp_reverse, &reverse, &original, BPF_ANY);
	ctx->user_ip4 = endpoint->addr;
	ctx->user_port = endpoint->port;
	return 1;
}

// kp_translate4 for IPv6 sockets (user_ip6 is read and written a word at a time).
static __always_inline int kp_translate6(struct bpf_sock_addr *ctx)
{
	struct kp_service_key6 key = {
		.addr = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] },
		.port = (__u16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	struct kp_slot_key slot = {};
	int refuse = 0;
	struct kp_service *service = bpf_map_lookup_elem(&kp_services6, &key);
	if (!kp_pick(service, &slot, &refuse)) {
		if (refuse)
			bpf_set_retval(-KP_ECONNREFUSED);
		return !refuse;
	}
	struct kp_endpoint6 *endpoint = kp_sticky6(ctx, service, &key, &slot);
	if (!endpoint)
		return 1;
	struct kp_reverse_key6 reverse = {
		.cookie = bpf_get_socket_cookie(ctx),
		.port = endpoint->port,
	};
	struct kp_endpoint6 original = { .port = key.port };
	for (int i = 0; i < 4; i++) {
		reverse.addr[i] = endpoint->addr[i];
		original.addr[i] = key.addr[i];
	}
	bpf_map_update_elem(&kp_reverse6, &reverse, &original, BPF_ANY);
	ctx->user_ip6[0] = endpoint->addr[0];
	ctx->user_ip6[1] = endpoint->addr[1];
	ctx->user_ip6[2] = endpoint->addr[2];
	ctx->user_ip6[3] = endpoint->addr[3];
	ctx->user_port = endpoint->port;
	return 1;
}

// The peer address an application reads: back to the Service address if this socket was
// translated to it.
static __always_inline void kp_restore4(struct bpf_sock_addr *ctx)
{
	struct kp_reverse_key reverse = {
		.cookie = bpf_get_socket_cookie(ctx),
		.addr = ctx->user_ip4,
		.port = (__u16)ctx->user_port,
	};
	struct kp_endpoint *original = bpf_map_lookup_elem(&kp_reverse, &reverse);
	if (!original)
		return;
	ctx->user_ip4 = original->addr;
	ctx->user_port = original->port;
}

// kp_restore4 for IPv6 sockets.
static __always_inline void kp_restore6(struct bpf_sock_addr *ctx)
{
	struct kp_reverse_key6 reverse = {
		.cookie = bpf_get_socket_cookie(ctx),
		.addr = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] },
		.port = (__u16)ctx->user_port,
	};
	struct kp_endpoint6 *original = bpf_map_lookup_elem(&kp_reverse6, &reverse);
	if (!original)
		return;
	ctx->user_ip6[0] = original->addr[0];
	ctx->user_ip6[1] = original->addr[1];
	ctx->user_ip6[2] = original->addr[2];
	ctx->user_ip6[3] = original->addr[3];
	ctx->user_port = original->port;
}

SEC("cgroup/connect4")
int kp_connect4(struct bpf_sock_addr *ctx)
{
	return kp_translate4(ctx);
}

SEC("cgroup/sendmsg4")
int kp_sendmsg4(struct bpf_sock_addr *ctx)
{
	return kp_translate4(ctx);
}

SEC("cgroup/recvmsg4")
int kp_recvmsg4(struct bpf_sock_addr *ctx)
{
	kp_restore4(ctx);
	return 1;
}

SEC("cgroup/getpeername4")
int kp_getpeername4(struct bpf_sock_addr *ctx)
{
	kp_restore4(ctx);
	return 1;
}

SEC("cgroup/connect6")
int kp_connect6(struct bpf_sock_addr *ctx)
{
	return kp_translate6(ctx);
}

SEC("cgroup/sendmsg6")
int kp_sendmsg6(struct bpf_sock_addr *ctx)
{
	return kp_translate6(ctx);
}

SEC("cgroup/recvmsg6")
int kp_recvmsg6(struct bpf_sock_addr *ctx)
{
	kp_restore6(ctx);
	return 1;
}

SEC("cgroup/getpeername6")
int kp_getpeername6(struct bpf_sock_addr *ctx)
{
	kp_restore6(ctx);
	return 1;
}

char LICENSE[] SEC("license") = "Apache-2.0";
