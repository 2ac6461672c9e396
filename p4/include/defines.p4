/* DLCP: constants and types shared by every control. No control holds a magic number. */
#ifndef DLCP_DEFINES_P4
#define DLCP_DEFINES_P4

#define ETHERTYPE_IPV4 0x0800
#define IP_PROTO_TCP 6
#define IP_PROTO_UDP 17

/* UDP destination ports that mark DLCP: the aligned block of 16 holding the default port
 * (17648-17663), so ranks sharing an address each have one; hostagent/wire.py DLCP_UDP_PORT,
 * DLCP_UDP_PORT_BLOCK, DLCP_UDP_PORT_MASK (a test checks). */
#define DLCP_UDP_PORT 17649
#define DLCP_UDP_PORT_BLOCK 17648
#define DLCP_UDP_PORT_MASK 0xFFF0
#define DLCP_VERSION 5
#define DLCP_PTYPE_DATA 1

/* v1model priority is 3 bits: 8 queues, 7 served first. */
#define NUM_QUEUES 8
#define LOG2_NUM_QUEUES 3

/* Virtual queue arithmetic: backlogs are packets << VQ_FRAC_BITS; the drain rate is packets
 * per microsecond in the same fixed point (controller: rate_pps * 2^24 / 10^6). */
#define VQ_FRAC_BITS 24
/* A packet's cost in slots is max(length + overhead, mpu) * unit_fp >> VQ_UNIT_SHIFT, with
 * unit_fp = ceil(2^32 / slot bytes) from the controller: the same charge the port's scheduler
 * (HTB's overhead and mpu) makes, in the virtual queue's 8.24 fixed point. */
#define VQ_UNIT_SHIFT 8
/* Longest idle gap credited at once (us): keeps elapsed * rate inside 64 bits. */
#define VQ_MAX_ELAPSED_US 0xFFFFFFFF

/* The queue an admitted packet goes to, told to the port's scheduler (an HTB tree on the
 * egress interface, which classifies on it): the low bits of the Ethernet source address,
 * which the switch itself writes on every hop and no receiver reads. */
#define TM_TAG_BITS 3

/* Load-balancing modes of an ECMP group for DLCP data packets. */
#define LB_ROUND_ROBIN 0
#define LB_RANDOM 1
#define LB_FLOW 2      /* DLCP data hashed like any flow: no spraying (the baseline) */

/* Why a packet was dropped (index of the drop_reason counter). */
#define DROP_NONE 0
#define DROP_NO_ROUTE 1
#define DROP_TTL_EXPIRED 2
#define DROP_NOT_IPV4 3
#define DROP_TAIL 4
#define DROP_SELECTIVE 5
#define DROP_NO_GROUP 6
#define NUM_DROP_REASONS 8

typedef bit<9> port_t;
typedef bit<48> mac_t;
typedef bit<32> ipv4_addr_t;
typedef bit<3> queue_t;

#endif
