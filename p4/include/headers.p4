/* DLCP: packet headers and the per-packet metadata the controls share. */
#ifndef DLCP_HEADERS_P4
#define DLCP_HEADERS_P4

#include "defines.p4"

header ethernet_t {
    mac_t dst_addr;
    mac_t src_addr;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4> version;
    bit<4> ihl;
    bit<6> dscp;
    bit<2> ecn;
    bit<16> total_len;
    bit<16> identification;
    bit<3> flags;
    bit<13> frag_offset;
    bit<8> ttl;
    bit<8> protocol;
    bit<16> hdr_checksum;
    ipv4_addr_t src_addr;
    ipv4_addr_t dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> length;
    bit<16> checksum;
}

header tcp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<32> seq_no;
    bit<32> ack_no;
    bit<4> data_offset;
    bit<4> res;
    bit<8> flags;
    bit<16> window;
    bit<16> checksum;
    bit<16> urgent_ptr;
}

/* The DLCP header: field for field hostagent/wire.py FIELDS (tests/test_p4_artifacts.py
 * compares this header in the compiled JSON with it). Network byte order, 44 bytes. */
header dlcp_t {
    bit<8> version;
    bit<8> ptype;
    bit<8> flags;
    bit<8> priority;
    bit<8> drop_class;
    bit<8> dtype;
    bit<16> sender_rank;
    bit<32> job_id;
    bit<32> message_id;
    bit<32> token;
    bit<32> iteration;
    bit<32> tensor_id;
    bit<16> layer;
    bit<16> elem_count;
    bit<32> seq;
    bit<32> total_pkts;
    bit<32> elem_offset;
}

struct headers_t {
    ethernet_t ethernet;
    ipv4_t ipv4;
    udp_t udp;
    tcp_t tcp;
    dlcp_t dlcp;
}

struct dlcp_metadata_t {
    bit<1> is_dlcp_data;      /* a DLCP DATA packet: sprayed, droppable by class */
    bit<16> l4_src_port;      /* for the 5-tuple hash of non-DLCP flows */
    bit<16> l4_dst_port;
    queue_t queue;            /* switch queue (v1model priority) chosen by Classify */
    bit<1> has_group;         /* the route points at an ECMP group */
    bit<16> ecmp_group;
    bit<16> ecmp_size;
    bit<2> ecmp_mode;
    bit<16> ecmp_member;
    bit<1> vq_on;             /* the egress port has a virtual queue (a bottleneck) */
    bit<32> vq_capacity;      /* its buffer, full-size frames (slots) */
    bit<64> vq_cost;          /* what this packet costs the port: slots << VQ_FRAC_BITS */
    bit<32> depth_ahead;      /* slots queued ahead of this one under strict priority */
    bit<32> depth_port;       /* slots queued at the port, every priority */
    bit<32> port_queue;       /* egress port * NUM_QUEUES + queue: counter index */
    bit<1> drop;
    bit<8> drop_reason;
    bit<1> ecn_marked;
}

#endif
