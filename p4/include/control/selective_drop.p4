/* Selective drop: under pressure, drop the least important gradients first.
 * Decided in ingress against the virtual queue (PriorityQueue), not against BMv2's
 * enq_qdepth: the virtual backlog ahead of a packet is per priority and per port at rate R,
 * while enq_qdepth exists only in egress, after the buffer, summed over a port's priority
 * queues. Dropping in ingress also keeps a doomed packet out of the buffer.
 *   - buffer full (depth ahead >= capacity): tail drop, whatever the class;
 *   - a DLCP data packet of drop class k >= 1: dropped when the depth ahead of it exceeds
 *     the class's threshold (set by the controller from Policy.drop_thresholds).
 * Class 0, control packets and non-DLCP traffic are never dropped selectively. */
#ifndef DLCP_SELECTIVE_DROP_P4
#define DLCP_SELECTIVE_DROP_P4

control SelectiveDrop(inout headers_t hdr, inout dlcp_metadata_t meta,
                      inout standard_metadata_t standard_metadata) {
    bit<32> threshold = 0;

    action set_threshold(bit<32> depth) {
        threshold = depth;
    }
    action never_drop() {
        threshold = 0xFFFFFFFF;
    }
    table drop_threshold {
        key = { hdr.dlcp.drop_class : exact @name("drop_class"); }
        actions = { set_threshold; @defaultonly never_drop; }
        const default_action = never_drop();
        size = DROP_CLASSES;
    }
    apply {
        if (meta.vq_on == 1 && meta.drop == 0) {
            if (meta.depth_ahead >= meta.vq_capacity) {
                meta.drop = 1;
                meta.drop_reason = DROP_TAIL;
            } else if (meta.is_dlcp_data == 1 && hdr.dlcp.drop_class != 0) {
                drop_threshold.apply();
                if (meta.depth_ahead > threshold) {
                    meta.drop = 1;
                    meta.drop_reason = DROP_SELECTIVE;
                }
            }
        }
    }
}

#endif
