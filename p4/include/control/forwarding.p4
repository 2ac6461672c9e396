/* Forwarding: IPv4 longest-prefix match to a next hop (port and MACs) or to an ECMP group.
 * Runs first in ingress; everything after it needs egress_spec (or the group). */
#ifndef DLCP_FORWARDING_P4
#define DLCP_FORWARDING_P4

control Forwarding(inout headers_t hdr, inout dlcp_metadata_t meta,
                   inout standard_metadata_t standard_metadata) {
    action set_nexthop(port_t port, mac_t smac, mac_t dmac) {
        standard_metadata.egress_spec = port;
        hdr.ethernet.src_addr = smac;
        hdr.ethernet.dst_addr = dmac;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
    }
    action set_ecmp_group(bit<16> group_id) {
        meta.has_group = 1;
        meta.ecmp_group = group_id;
        hdr.ipv4.ttl = hdr.ipv4.ttl - 1;
    }
    action drop_no_route() {
        meta.drop = 1;
        meta.drop_reason = DROP_NO_ROUTE;
    }
    table ipv4_lpm {
        key = { hdr.ipv4.dst_addr : lpm @name("dst_addr"); }
        actions = { set_nexthop; set_ecmp_group; @defaultonly drop_no_route; }
        const default_action = drop_no_route();
        size = IPV4_ROUTES;
    }
    apply {
        if (!hdr.ipv4.isValid()) {
            meta.drop = 1;
            meta.drop_reason = DROP_NOT_IPV4;
        } else if (hdr.ipv4.ttl <= 1) {
            meta.drop = 1;
            meta.drop_reason = DROP_TTL_EXPIRED;
        } else {
            ipv4_lpm.apply();
        }
    }
}

#endif
