// SPDX-License-Identifier: MIT OR GPL-2.0-only
//
// DCTCP (RFC 8257) as a BPF TCP congestion control, "dlcp_dctcp", for kernels built without
// CONFIG_TCP_CONG_DCTCP: the `gloo-dctcp` testbed scheme (topologies/bpf_dctcp.py builds and
// registers it). It follows Linux's own DCTCP (net/ipv4/tcp_dctcp.c) rule for rule, so gloo over
// it reacts to the switches' marks as gloo over the kernel's DCTCP would:
//
// - the sender keeps alpha, an average of the fraction of its bytes marked CE, updated once per
//   window of data (g = 1/16), starting at 1 (alpha is in 1/1024ths);
// - at a mark (TCP's CWR state) the window is cut to cwnd * (1 - alpha / 2), at a loss halved,
//   once per window; between cuts it grows as Reno does;
// - the receiver echoes CE exactly: when the CE state of what arrives changes, it sends an ACK at
//   once (first the one it was delaying, with the old state), so the sender sees each mark;
// - connections ask for ECN by themselves (TCP_CONG_NEEDS_ECN), whatever net.ipv4.tcp_ecn says.
//
// The license string is one the kernel accepts for the helpers a congestion control uses.
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define MAX_ALPHA 1024U  // alpha = 1
#define SHIFT_G 4U       // g = 1/16
#define TCP_ECN_OK 1
#define TCP_ECN_DEMAND_CWR 4
#define TCP_CONG_NEEDS_ECN 0x2

extern void tcp_reno_cong_avoid(struct sock *sk, __u32 ack, __u32 acked) __ksym;

struct dctcp {  // in the socket's congestion-control area (inet_csk_ca)
    __u32 old_delivered;
    __u32 old_delivered_ce;
    __u32 prior_rcv_nxt;
    __u32 alpha;
    __u32 next_seq;
    __u32 ce_state;
    __u32 loss_cwnd;
};

static inline struct dctcp *ca_of(struct sock *sk) {
    return (struct dctcp *)((struct inet_connection_sock *)sk)->icsk_ca_priv;
}

static inline struct tcp_sock *tcp_of(struct sock *sk) { return (struct tcp_sock *)sk; }

static inline __u32 max_u32(__u32 a, __u32 b) { return a > b ? a : b; }

static inline void start_window(struct tcp_sock *tp, struct dctcp *ca) {
    ca->next_seq = tp->snd_nxt;
    ca->old_delivered = tp->delivered;
    ca->old_delivered_ce = tp->delivered_ce;
}

SEC("struct_ops/dlcp_dctcp_init")
void BPF_PROG(dlcp_dctcp_init, struct sock *sk) {
    struct tcp_sock *tp = tcp_of(sk);
    struct dctcp *ca = ca_of(sk);
    ca->prior_rcv_nxt = tp->rcv_nxt;
    ca->alpha = MAX_ALPHA;
    ca->loss_cwnd = 0;
    ca->ce_state = 0;
    start_window(tp, ca);
}

SEC("struct_ops/dlcp_dctcp_ssthresh")
__u32 BPF_PROG(dlcp_dctcp_ssthresh, struct sock *sk) {
    struct tcp_sock *tp = tcp_of(sk);
    struct dctcp *ca = ca_of(sk);
    ca->loss_cwnd = tp->snd_cwnd;
    return max_u32(tp->snd_cwnd - ((tp->snd_cwnd * ca->alpha) >> 11U), 2U);
}

SEC("struct_ops/dlcp_dctcp_update_alpha")
void BPF_PROG(dlcp_dctcp_update_alpha, struct sock *sk, __u32 flags) {
    struct tcp_sock *tp = tcp_of(sk);
    struct dctcp *ca = ca_of(sk);
    if ((__s32)(tp->snd_una - ca->next_seq) < 0) return;  // the window is not over yet
    __u32 delivered = tp->delivered - ca->old_delivered;
    __u32 delivered_ce = tp->delivered_ce - ca->old_delivered_ce;
    __u32 alpha = ca->alpha;
    // alpha = (1 - g) alpha + g F, F the window's fraction of packets delivered CE-marked
    __u32 decay = alpha >> SHIFT_G;
    alpha -= decay ? decay : alpha;  // (what is below 1/16 of a unit decays to 0)
    if (delivered_ce) {
        delivered_ce <<= (10U - SHIFT_G);
        delivered_ce /= delivered ? delivered : 1U;
        alpha = alpha + delivered_ce < MAX_ALPHA ? alpha + delivered_ce : MAX_ALPHA;
    }
    ca->alpha = alpha;
    start_window(tp, ca);
}

static inline void react_to_loss(struct sock *sk) {
    struct tcp_sock *tp = tcp_of(sk);
    ca_of(sk)->loss_cwnd = tp->snd_cwnd;
    tp->snd_ssthresh = max_u32(tp->snd_cwnd >> 1U, 2U);
}

SEC("struct_ops/dlcp_dctcp_state")
void BPF_PROG(dlcp_dctcp_state, struct sock *sk, __u8 new_state) {
    // a loss found by fast retransmit halves the window, once; an RTO is CA_EVENT_LOSS below
    if (new_state == TCP_CA_Recovery && new_state != ((struct inet_connection_sock *)sk)->icsk_ca_state)
        react_to_loss(sk);
}

static inline void echo_ce_state(struct tcp_sock *tp, __u32 ce_state) {
    if (ce_state == 1)
        tp->ecn_flags |= TCP_ECN_DEMAND_CWR;
    else
        tp->ecn_flags &= ~TCP_ECN_DEMAND_CWR;
}

SEC("struct_ops/dlcp_dctcp_cwnd_event")
void BPF_PROG(dlcp_dctcp_cwnd_event, struct sock *sk, enum tcp_ca_event ev) {
    struct dctcp *ca = ca_of(sk);
    if (ev == CA_EVENT_ECN_IS_CE || ev == CA_EVENT_ECN_NO_CE) {
        struct tcp_sock *tp = tcp_of(sk);
        struct inet_connection_sock *icsk = (struct inet_connection_sock *)sk;
        __u32 new_state = ev == CA_EVENT_ECN_IS_CE ? 1 : 0;
        if (ca->ce_state != new_state) {
            // the CE state changed: ACK at once, after the delayed ACK of the old state
            if (icsk->icsk_ack.pending & ICSK_ACK_TIMER) {
                echo_ce_state(tp, ca->ce_state);
                bpf_tcp_send_ack(tp, ca->prior_rcv_nxt);
            }
            icsk->icsk_ack.pending |= ICSK_ACK_NOW;
        }
        ca->prior_rcv_nxt = tp->rcv_nxt;
        ca->ce_state = new_state;
        echo_ce_state(tp, new_state);
    } else if (ev == CA_EVENT_LOSS) {
        react_to_loss(sk);
    }
}

SEC("struct_ops/dlcp_dctcp_cong_avoid")
void BPF_PROG(dlcp_dctcp_cong_avoid, struct sock *sk, __u32 ack, __u32 acked) {
    tcp_reno_cong_avoid(sk, ack, acked);
}

SEC("struct_ops/dlcp_dctcp_undo_cwnd")
__u32 BPF_PROG(dlcp_dctcp_undo_cwnd, struct sock *sk) {
    return max_u32(tcp_of(sk)->snd_cwnd, ca_of(sk)->loss_cwnd);
}

SEC(".struct_ops")
struct tcp_congestion_ops dlcp_dctcp = {
    .init = (void *)dlcp_dctcp_init,
    .in_ack_event = (void *)dlcp_dctcp_update_alpha,
    .cwnd_event = (void *)dlcp_dctcp_cwnd_event,
    .ssthresh = (void *)dlcp_dctcp_ssthresh,
    .cong_avoid = (void *)dlcp_dctcp_cong_avoid,
    .undo_cwnd = (void *)dlcp_dctcp_undo_cwnd,
    .set_state = (void *)dlcp_dctcp_state,
    .flags = TCP_CONG_NEEDS_ECN,
    .name = "dlcp_dctcp",
};
