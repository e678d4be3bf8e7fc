// SPDX-License-Identifier: GPL-2.0-only OR BSD-2-Clause
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
#include <linux/in6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

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

// The endpoint for the IPv4 Service port `key` (chosen uniformly, or the client's pin),
// recorded in kp_reverse under the socket's cookie so the Service address can be shown
// back; NULL to leave the address alone (not a Service port, or a slot mid-update, where
// nftables mode's rules still serve it). Sets *refuse when the port has no endpoints.
static __always_inline struct kp_endpoint *kp_decide4(struct bpf_sock_addr *ctx,
						       struct kp_service_key *key, int *refuse)
{
	struct kp_slot_key slot = {};
	struct kp_service *service = bpf_map_lookup_elem(&kp_services, key);
	if (!kp_pick(service, &slot, refuse))
		return 0;
	struct kp_endpoint *endpoint = kp_sticky4(ctx, service, key, &slot);
	if (!endpoint)
		return 0;
	struct kp_reverse_key reverse = {
		.cookie = bpf_get_socket_cookie(ctx),
		.addr = endpoint->addr,
		.port = endpoint->port,
	};
	struct kp_endpoint original = { .addr = key->addr, .port = key->port };
	bpf_map_update_elem(&kp_reverse, &reverse, &original, BPF_ANY);
	return endpoint;
}

// 1 to let the call go on (translated or not), 0 to refuse it (ECONNREFUSED).
static __always_inline int kp_verdict(int refuse)
{
	if (refuse)
		bpf_set_retval(-KP_ECONNREFUSED);
	return !refuse;
}

// The socket's destination if it is a Service port with endpoints (rewritten to one of
// them); 1 to let the call go on (translated or not), 0 to refuse it.
static __always_inline int kp_translate4(struct bpf_sock_addr *ctx)
{
	struct kp_service_key key = {
		.addr = ctx->user_ip4,
		.port = (__u16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	int refuse = 0;
	struct kp_endpoint *endpoint = kp_decide4(ctx, &key, &refuse);
	if (!endpoint)
		return kp_verdict(refuse);
	ctx->user_ip4 = endpoint->addr;
	ctx->user_port = endpoint->port;
	return 1;
}

// Whether an IPv6 socket's address is IPv4-mapped (::ffff:a.b.c.d): a dual-stack socket
// reaching an IPv4 address, which the kernel sends as IPv4.
static __always_inline int kp_mapped(struct bpf_sock_addr *ctx)
{
	return ctx->user_ip6[0] == 0 && ctx->user_ip6[1] == 0 &&
	       ctx->user_ip6[2] == bpf_htonl(0xffff);
}

// kp_translate4 for a dual-stack socket's IPv4-mapped destination: the IPv4 Service's
// decision, written back as ::ffff:<endpoint> (only the last word changes).
static __always_inline int kp_translate_mapped(struct bpf_sock_addr *ctx)
{
	struct kp_service_key key = {
		.addr = ctx->user_ip6[3],
		.port = (__u16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	int refuse = 0;
	struct kp_endpoint *endpoint = kp_decide4(ctx, &key, &refuse);
	if (!endpoint)
		return kp_verdict(refuse);
	ctx->user_ip6[3] = endpoint->addr;
	ctx->user_port = endpoint->port;
	return 1;
}

// kp_translate4 for IPv6 sockets (user_ip6 is read and written a word at a time); an
// IPv4-mapped destination takes the IPv4 maps' decision.
static __always_inline int kp_translate6(struct bpf_sock_addr *ctx)
{
	if (kp_mapped(ctx))
		return kp_translate_mapped(ctx);
	struct kp_service_key6 key = {
		.addr = { ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3] },
		.port = (__u16)ctx->user_port,
		.proto = (__u8)ctx->protocol,
	};
	struct kp_slot_key slot = {};
	int refuse = 0;
	struct kp_service *service = bpf_map_lookup_elem(&kp_services6, &key);
	if (!kp_pick(service, &slot, &refuse))
		return kp_verdict(refuse);
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

// The Service address `cookie`'s socket was translated from to the IPv4 endpoint
// addr:port, if any.
static __always_inline struct kp_endpoint *kp_original4(__u64 cookie, __u32 addr, __u16 port)
{
	struct kp_reverse_key reverse = { .cookie = cookie, .addr = addr, .port = port };
	return bpf_map_lookup_elem(&kp_reverse, &reverse);
}

// The peer address an application reads: back to the Service address if this socket was
// translated to it.
static __always_inline void kp_restore4(struct bpf_sock_addr *ctx)
{
	struct kp_endpoint *original =
		kp_original4(bpf_get_socket_cookie(ctx), ctx->user_ip4, (__u16)ctx->user_port);
	if (!original)
		return;
	ctx->user_ip4 = original->addr;
	ctx->user_port = original->port;
}

// kp_restore4 for an IPv4-mapped peer of a dual-stack socket: ::ffff:<Service address>.
// The kernel runs recvmsg6 for IPv4 datagrams to such a socket, after sendmsg4 translated
// its unconnected sends (udpv6_sendmsg hands mapped destinations to udp_sendmsg).
static __always_inline void kp_restore_mapped(struct bpf_sock_addr *ctx)
{
	struct kp_endpoint *original =
		kp_original4(bpf_get_socket_cookie(ctx), ctx->user_ip6[3], (__u16)ctx->user_port);
	if (!original)
		return;
	ctx->user_ip6[3] = original->addr;
	ctx->user_port = original->port;
}

// kp_restore4 for IPv6 sockets.
static __always_inline void kp_restore6(struct bpf_sock_addr *ctx)
{
	if (kp_mapped(ctx)) {
		kp_restore_mapped(ctx);
		return;
	}
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

// Sockets connected to removed endpoints (issue 36 item 3): socket iterators the proxy runs
// in each network namespace after a sync removed endpoints. A socket is destroyed when the
// programs above translated it (its cookie and peer are in kp_reverse) and its (Service
// port, endpoint) pair is in kp_destroy, which the proxy fills before the run and empties
// after. TCP sockets are reset (ECONNABORTED), connected UDP sockets get ECONNABORTED and
// are disconnected, so the application reconnects and is translated again.

struct kp_destroy_key {
	__u32 service_addr;
	__u16 service_port;
	__u8 proto;
	__u8 pad;
	__u32 endpoint_addr;
	__u16 endpoint_port;
	__u16 pad2;
};

struct kp_destroy_key6 {
	__u32 service_addr[4];
	__u16 service_port;
	__u8 proto;
	__u8 pad;
	__u32 endpoint_addr[4];
	__u16 endpoint_port;
	__u16 pad2;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct kp_destroy_key);
	__type(value, __u8);
} kp_destroy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, struct kp_destroy_key6);
	__type(value, __u8);
} kp_destroy6 SEC(".maps");

// The few kernel fields read, relocated against the running kernel's BTF (CO-RE).
struct sock_common {
	__u32 skc_daddr;
	__u16 skc_dport;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	struct in6_addr skc_v6_daddr;
} __attribute__((preserve_access_index));

struct seq_file;
struct udp_sock;

// The iterators' contexts: pointers of 8 bytes each (__bpf_md_ptr), a stable layout.
struct bpf_iter_meta {
	struct seq_file *seq;
};

struct bpf_iter__tcp {
	struct bpf_iter_meta *meta;
	struct sock_common *sk_common;
};

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
};

#define KP_AF_INET 2
#define KP_AF_INET6 10
#define KP_TCP_TIME_WAIT 6
#define KP_TCP_NEW_SYN_RECV 12

// The call instruction's immediate until the loader (src/destroy.rs) patches it into a
// kfunc call to bpf_sock_destroy (its BTF id in this kernel): aya 0.14 does not resolve
// kfunc externs, so the call is written in assembly with a marker the loader finds.
#define KP_SOCK_DESTROY_MARKER "0x4b505344"

// bpf_sock_destroy(sk): the kernel's diag_destroy for TCP and UDP, with ECONNABORTED.
static __always_inline long kp_sock_destroy(void *sk)
{
	register void *r1 asm("r1") = sk;
	register long r0 asm("r0");
	asm volatile("call " KP_SOCK_DESTROY_MARKER
		     : "=r"(r0), "+r"(r1)
		     :
		     : "r2", "r3", "r4", "r5", "memory");
	return r0;
}

// Whether `sk` was translated by the programs above to an endpoint since removed from its
// Service port.
static __always_inline int kp_doomed4(struct sock_common *sk, __u8 proto)
{
	struct kp_reverse_key reverse = {
		.cookie = bpf_get_socket_cookie(sk),
		.addr = sk->skc_daddr,
		.port = sk->skc_dport,
	};
	struct kp_endpoint *service = bpf_map_lookup_elem(&kp_reverse, &reverse);
	if (!service)
		return 0;
	struct kp_destroy_key key = {
		.service_addr = service->addr,
		.service_port = service->port,
		.proto = proto,
		.endpoint_addr = reverse.addr,
		.endpoint_port = reverse.port,
	};
	return bpf_map_lookup_elem(&kp_destroy, &key) != 0;
}

// kp_doomed4 for IPv6 sockets.
static __always_inline int kp_doomed6(struct sock_common *sk, __u8 proto)
{
	struct in6_addr peer = sk->skc_v6_daddr;
	struct kp_reverse_key6 reverse = {
		.cookie = bpf_get_socket_cookie(sk),
		.port = sk->skc_dport,
	};
	for (int i = 0; i < 4; i++)
		reverse.addr[i] = peer.in6_u.u6_addr32[i];
	struct kp_endpoint6 *service = bpf_map_lookup_elem(&kp_reverse6, &reverse);
	if (!service)
		return 0;
	struct kp_destroy_key6 key = {
		.service_port = service->port,
		.proto = proto,
		.endpoint_port = reverse.port,
	};
	for (int i = 0; i < 4; i++) {
		key.service_addr[i] = service->addr[i];
		key.endpoint_addr[i] = reverse.addr[i];
	}
	return bpf_map_lookup_elem(&kp_destroy6, &key) != 0;
}

// Whether an IPv6 socket's peer is IPv4-mapped: it was translated by the IPv4 maps, and
// skc_daddr holds its IPv4 peer.
static __always_inline int kp_peer_mapped(struct sock_common *sk)
{
	struct in6_addr peer = sk->skc_v6_daddr;
	return peer.in6_u.u6_addr32[0] == 0 && peer.in6_u.u6_addr32[1] == 0 &&
	       peer.in6_u.u6_addr32[2] == bpf_htonl(0xffff);
}

static __always_inline int kp_doomed(struct sock_common *sk, __u8 proto)
{
	if (sk->skc_family == KP_AF_INET)
		return kp_doomed4(sk, proto);
	if (sk->skc_family == KP_AF_INET6)
		return kp_peer_mapped(sk) ? kp_doomed4(sk, proto) : kp_doomed6(sk, proto);
	return 0;
}

// One byte of output per destroyed socket: the proxy counts what it reads.
static __always_inline void kp_destroyed(struct bpf_iter_meta *meta)
{
	char one = 'x';
	bpf_seq_write(meta->seq, &one, 1);
}

SEC("iter/tcp")
int kp_destroy_tcp(struct bpf_iter__tcp *ctx)
{
	struct sock_common *sk = ctx->sk_common;
	if (!sk)
		return 0;
	// Time-wait and request sockets are not full sockets: nothing to destroy.
	unsigned char state = sk->skc_state;
	if (state == KP_TCP_TIME_WAIT || state == KP_TCP_NEW_SYN_RECV)
		return 0;
	if (kp_doomed(sk, IPPROTO_TCP) && kp_sock_destroy(sk) == 0)
		kp_destroyed(ctx->meta);
	return 0;
}

SEC("iter/udp")
int kp_destroy_udp(struct bpf_iter__udp *ctx)
{
	struct sock_common *sk = (struct sock_common *)ctx->udp_sk;
	if (!sk)
		return 0;
	if (kp_doomed(sk, IPPROTO_UDP) && kp_sock_destroy(sk) == 0)
		kp_destroyed(ctx->meta);
	return 0;
}

// GPL-compatible, as kfuncs (bpf_sock_destroy) require; the source is dual licensed (SPDX
// line above).
char LICENSE[] SEC("license") = "Dual BSD/GPL";
