/* Stats: what the switch did, per egress port x queue (index port * 8 + queue), readable
 * through P4Runtime: forwarded (egress, so only packets that really left), selectively
 * dropped, tail dropped, ECN-marked; plus drops by reason and selective drops by drop class. */
#ifndef DLCP_STATS_P4
#define DLCP_STATS_P4

counter(PORT_QUEUES, CounterType.packets_and_bytes) forwarded;
counter(PORT_QUEUES, CounterType.packets_and_bytes) selective_dropped;
counter(PORT_QUEUES, CounterType.packets_and_bytes) tail_dropped;
counter(PORT_QUEUES, CounterType.packets_and_bytes) ecn_marked;
counter(NUM_DROP_REASONS, CounterType.packets) drop_reason;
counter(DROP_CLASSES, CounterType.packets_and_bytes) selective_dropped_class;

control IngressStats(inout headers_t hdr, inout dlcp_metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    apply {
        if (meta.drop == 1) {
            drop_reason.count((bit<32>)meta.drop_reason);
            if (meta.drop_reason == DROP_SELECTIVE) {
                selective_dropped.count(meta.port_queue);
                selective_dropped_class.count((bit<32>)hdr.dlcp.drop_class);
            } else if (meta.drop_reason == DROP_TAIL) {
                tail_dropped.count(meta.port_queue);
            }
        } else if (meta.ecn_marked == 1) {
            ecn_marked.count(meta.port_queue);
        }
    }
}

control EgressStats(inout headers_t hdr, inout dlcp_metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    apply {
        forwarded.count(((bit<32>)standard_metadata.egress_port << LOG2_NUM_QUEUES) + (bit<32>)meta.queue);
    }
}

#endif
