/* DLCP: parser, deparser and checksums.
 * Ethernet -> IPv4 -> UDP -> DLCP when the UDP destination port is in DLCP's block;
 * TCP (for the 5-tuple hash) and everything else pass through unparsed beyond L4. */
#ifndef DLCP_PARSER_P4
#define DLCP_PARSER_P4

#include "headers.p4"

parser DlcpParser(packet_in packet, out headers_t hdr, inout dlcp_metadata_t meta,
                  inout standard_metadata_t standard_metadata) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.protocol) {
            IP_PROTO_UDP: parse_udp;
            IP_PROTO_TCP: parse_tcp;
            default: accept;
        }
    }
    state parse_tcp {
        packet.extract(hdr.tcp);
        meta.l4_src_port = hdr.tcp.src_port;
        meta.l4_dst_port = hdr.tcp.dst_port;
        transition accept;
    }
    state parse_udp {
        packet.extract(hdr.udp);
        meta.l4_src_port = hdr.udp.src_port;
        meta.l4_dst_port = hdr.udp.dst_port;
        transition select(hdr.udp.dst_port) {
            DLCP_UDP_PORT_BLOCK &&& DLCP_UDP_PORT_MASK: parse_dlcp;
            default: accept;
        }
    }
    state parse_dlcp {
        packet.extract(hdr.dlcp);
        transition accept;
    }
}

control DlcpVerifyChecksum(inout headers_t hdr, inout dlcp_metadata_t meta) {
    apply { }
}

/* TTL and ECN change in ingress: recompute the IPv4 checksum. The UDP checksum covers
 * neither, so it stays valid. */
control DlcpComputeChecksum(inout headers_t hdr, inout dlcp_metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control DlcpDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.tcp);
        packet.emit(hdr.dlcp);
    }
}

#endif
