/* Priority queue: a strict-priority port of capacity R, modelled in registers.
 *
 * Why: BMv2 rate-limits each priority queue separately (set_queue_rate gives every priority
 * queue of a port its own R), so two backlogged priorities drain 2R in total, interleaved.
 * A port that serves priorities strictly at capacity R cannot be built from BMv2's queues.
 * So every bottleneck port keeps a virtual queue: one backlog per priority, in registers,
 * drained at R by the packets' own timestamps, the highest priority first, exactly as a
 * strict-priority server of rate R would drain its queues. A packet's fate is decided
 * against that model (see SelectiveDrop and EcnMark): the backlog *ahead of it* is what a
 * strict-priority port would have queued in front of it, i.e. the sum of the backlogs at
 * its priority and above; the port's whole backlog (every priority) is kept beside it for
 * EcnMark. Admitted packets join its backlog (VqAdmit).
 *
 * The real BMv2 queues of the port stay in place, each rate-limited to R and at least as
 * deep as the virtual buffer: packets still queue physically (delay that hosts see), and a
 * later high-priority packet waits only for the high-priority packets ahead of it, not for an
 * earlier low-priority backlog. Limits, against
 * a real strict-priority port: the admitted traffic never exceeds R*T + B in any interval T
 * (B = the virtual buffer), but while a lower-priority real queue still holds packets and a
 * higher one receives, both drain at R, so the wire can carry up to 2R for at most B packets.
 * The virtual model charges both to R, so later arrivals are refused correspondingly.
 *
 * Runs in ingress after Forwarding, Classify and Spray (it needs the egress port and the
 * queue); ports without a vq_config entry are not bottlenecks and skip it.
 */
#ifndef DLCP_PRIORITY_QUEUE_P4
#define DLCP_PRIORITY_QUEUE_P4

/* Per port: time of the last drain (us); per port x priority: backlog (packets << 24). */
register<bit<48>>(MAX_PORTS) vq_last_us;
register<bit<64>>(PORT_QUEUES) vq_backlog;

#define VQ_DRAIN(Q) \
    vq_backlog.read(backlog, base + Q); \
    if (backlog > budget) { backlog = backlog - budget; budget = 0; } \
    else { budget = budget - backlog; backlog = 0; } \
    vq_backlog.write(base + Q, backlog); \
    total = total + backlog; \
    if (meta.queue <= Q) { ahead = ahead + backlog; }

control VirtualQueue(inout headers_t hdr, inout dlcp_metadata_t meta,
                     inout standard_metadata_t standard_metadata) {
    bit<64> rate = 0;

    action set_vq(bit<32> rate_fp, bit<32> capacity) {
        meta.vq_on = 1;
        rate = (bit<64>)rate_fp;
        meta.vq_capacity = capacity;
    }
    action no_vq() {
        meta.vq_on = 0;
    }
    table vq_config {
        key = { standard_metadata.egress_spec : exact @name("port"); }
        actions = { set_vq; @defaultonly no_vq; }
        const default_action = no_vq();
        size = MAX_PORTS;
    }

    apply {
        meta.port_queue = ((bit<32>)standard_metadata.egress_spec << LOG2_NUM_QUEUES) + (bit<32>)meta.queue;
        if (meta.drop == 0 && vq_config.apply().hit) {
            bit<32> port = (bit<32>)standard_metadata.egress_spec;
            bit<32> base = port << LOG2_NUM_QUEUES;
            bit<48> last;
            vq_last_us.read(last, port);
            bit<48> now = standard_metadata.ingress_global_timestamp;
            vq_last_us.write(port, now);
            bit<64> elapsed = (bit<64>)(now - last);
            if (elapsed > VQ_MAX_ELAPSED_US) {
                elapsed = VQ_MAX_ELAPSED_US;
            }
            bit<64> budget = elapsed * rate;
            bit<64> backlog;
            bit<64> ahead = 0;
            bit<64> total = 0;
            VQ_DRAIN(7)
            VQ_DRAIN(6)
            VQ_DRAIN(5)
            VQ_DRAIN(4)
            VQ_DRAIN(3)
            VQ_DRAIN(2)
            VQ_DRAIN(1)
            VQ_DRAIN(0)
            meta.depth_ahead = (bit<32>)(ahead >> VQ_FRAC_BITS);
            meta.depth_port = (bit<32>)(total >> VQ_FRAC_BITS);
        }
    }
}

/* After the drop decision: an admitted packet joins its priority's virtual backlog. */
control VqAdmit(inout headers_t hdr, inout dlcp_metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    apply {
        if (meta.vq_on == 1 && meta.drop == 0) {
            bit<64> backlog;
            vq_backlog.read(backlog, meta.port_queue);
            vq_backlog.write(meta.port_queue, backlog + ((bit<64>)1 << VQ_FRAC_BITS));
        }
    }
}

#endif
