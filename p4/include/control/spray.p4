/* Spray: pick a member of the route's ECMP group.
 * DLCP data packets are placed by offset at the receiver, so each packet may take any path:
 * round-robin (a register per group) or uniform random, as the controller sets per group;
 * mode LB_FLOW hashes them like any flow (the baseline without spraying).
 * Every other packet hashes its 5-tuple, so a TCP flow stays on one path. */
#ifndef DLCP_SPRAY_P4
#define DLCP_SPRAY_P4

control Spray(inout headers_t hdr, inout dlcp_metadata_t meta,
              inout standard_metadata_t standard_metadata) {
    register<bit<16>>(ECMP_GROUPS) rr_next;

    action set_group(bit<16> size, bit<2> mode) {
        meta.ecmp_size = size;
        meta.ecmp_mode = mode;
    }
    action drop_no_group() {
        meta.drop = 1;
        meta.drop_reason = DROP_NO_GROUP;
    }
    table ecmp_group {
        key = { meta.ecmp_group : exact @name("group_id"); }
        actions = { set_group; @defaultonly drop_no_group; }
        const default_action = drop_no_group();
        size = ECMP_GROUPS;
    }

    action set_member(port_t port, mac_t smac, mac_t dmac) {
        standard_metadata.egress_spec = port;
        hdr.ethernet.src_addr = smac;
        hdr.ethernet.dst_addr = dmac;
    }
    table ecmp_member {
        key = {
            meta.ecmp_group : exact @name("group_id");
            meta.ecmp_member : exact @name("member");
        }
        actions = { set_member; @defaultonly drop_no_group; }
        const default_action = drop_no_group();
        size = ECMP_MEMBERS;
    }

    apply {
        if (meta.has_group == 1 && meta.drop == 0) {
            if (ecmp_group.apply().hit && meta.ecmp_size > 0) {
                if (meta.is_dlcp_data == 1 && meta.ecmp_mode == LB_ROUND_ROBIN) {
                    bit<16> member;
                    rr_next.read(member, (bit<32>)meta.ecmp_group);
                    if (member >= meta.ecmp_size) {
                        member = 0;
                    }
                    bit<16> next = member + 1;
                    if (next >= meta.ecmp_size) {
                        next = 0;
                    }
                    rr_next.write((bit<32>)meta.ecmp_group, next);
                    meta.ecmp_member = member;
                } else if (meta.is_dlcp_data == 1 && meta.ecmp_mode == LB_RANDOM) {
                    random(meta.ecmp_member, (bit<16>)0, meta.ecmp_size - 1);
                } else {
                    hash(meta.ecmp_member, HashAlgorithm.crc16, (bit<16>)0,
                         { hdr.ipv4.src_addr, hdr.ipv4.dst_addr, hdr.ipv4.protocol,
                           meta.l4_src_port, meta.l4_dst_port },
                         (bit<32>)meta.ecmp_size);
                }
                ecmp_member.apply();
            } else {
                meta.drop = 1;
                meta.drop_reason = DROP_NO_GROUP;
            }
        }
    }
}

#endif
