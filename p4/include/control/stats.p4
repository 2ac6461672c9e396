/* Stats: what the switch did, per egress port x queue (index port * 8 + queue), readable
 * through P4Runtime: admitted (ingress let it through to the buffer), forwarded (egress, so
 * only packets that really left), selectively dropped, tail dropped, ECN-marked; plus drops by
 * reason and selective drops by drop class. Between quiet moments, admitted minus forwarded is
 * what BMv2's real queue dropped silently (full while the egress thread waited for CPU).
 *
 * Frames the pipeline received, per ingress port (``received``): set beside the kernel's
 * count of frames the port's interface received, the difference is what BMv2 lost before its
 * pipeline (its libpcap capture ring overflowed: the switch process was starved of CPU), a
 * loss no other counter sees. A testbed run reports it and is invalid when it is not ~0.
 *
 * Service rate while backlogged, per egress port (registers; read over Thrift): when a packet
 * leaves while its queue still holds others (deq_qdepth > 0), the next departure from that
 * port is a pure service interval, so busy_gaps counts such intervals and busy_gap_us sums
 * their length. busy_gaps / busy_gap_us is the rate BMv2's egress achieved while it had work.
 * A bottleneck's queue is in its scheduler behind the switch (PriorityQueue), so BMv2's own
 * queues there hardly fill: these registers are a diagnostic of BMv2, and the testbed judges
 * a bottleneck by its scheduler's counters (topologies/validity.py). */
#ifndef DLCP_STATS_P4
#define DLCP_STATS_P4

counter(PORT_QUEUES, CounterType.packets_and_bytes) admitted;
counter(PORT_QUEUES, CounterType.packets_and_bytes) forwarded;
counter(PORT_QUEUES, CounterType.packets_and_bytes) selective_dropped;
counter(PORT_QUEUES, CounterType.packets_and_bytes) tail_dropped;
counter(PORT_QUEUES, CounterType.packets_and_bytes) ecn_marked;
counter(NUM_DROP_REASONS, CounterType.packets) drop_reason;
counter(DROP_CLASSES, CounterType.packets_and_bytes) selective_dropped_class;
counter(MAX_PORTS, CounterType.packets) received;
register<bit<48>>(MAX_PORTS) dep_last_us;
register<bit<8>>(MAX_PORTS) dep_last_busy;
register<bit<64>>(MAX_PORTS) busy_gaps;
register<bit<64>>(MAX_PORTS) busy_gap_us;

control IngressStats(inout headers_t hdr, inout dlcp_metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    apply {
        received.count((bit<32>)standard_metadata.ingress_port);
        if (meta.drop == 1) {
            drop_reason.count((bit<32>)meta.drop_reason);
            if (meta.drop_reason == DROP_SELECTIVE) {
                selective_dropped.count(meta.port_queue);
                selective_dropped_class.count((bit<32>)hdr.dlcp.drop_class);
            } else if (meta.drop_reason == DROP_TAIL) {
                tail_dropped.count(meta.port_queue);
            }
        } else {
            admitted.count(meta.port_queue);
            if (meta.ecn_marked == 1) {
                ecn_marked.count(meta.port_queue);
            }
        }
    }
}

control EgressStats(inout headers_t hdr, inout dlcp_metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    apply {
        forwarded.count(((bit<32>)standard_metadata.egress_port << LOG2_NUM_QUEUES) + (bit<32>)meta.queue);
        bit<32> port = (bit<32>)standard_metadata.egress_port;
        bit<48> now = standard_metadata.egress_global_timestamp;
        bit<8> was_busy;
        dep_last_busy.read(was_busy, port);
        if (was_busy == 1) {
            bit<48> last;
            dep_last_us.read(last, port);
            bit<64> gaps;
            busy_gaps.read(gaps, port);
            busy_gaps.write(port, gaps + 1);
            bit<64> us;
            busy_gap_us.read(us, port);
            busy_gap_us.write(port, us + (bit<64>)(now - last));
        }
        dep_last_us.write(port, now);
        if (standard_metadata.deq_qdepth > 0) {
            dep_last_busy.write(port, 1);
        } else {
            dep_last_busy.write(port, 0);
        }
    }
}

#endif
