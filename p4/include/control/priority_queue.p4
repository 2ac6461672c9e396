/* Priority queue: what a strict-priority port of capacity R would queue ahead of each packet.
 *
 * Where the queue is: not in BMv2. BMv2 rate-limits each priority queue on its own
 * (set_queue_rate gives every priority queue of a port its own R: two backlogged priorities
 * drain 2R), so a bottleneck port's BMv2 queues are left unlimited and the port's scheduler
 * is an HTB tree on its egress interface, installed by the controller (controller/scheduler.py):
 * one class at the port's capacity R, eight leaves that borrow from it in strict priority
 * order, a FIFO each. It plays the part of a hardware switch's traffic manager behind its
 * pipeline; the pipeline tells it each admitted packet's queue in the frame (VqAdmit).
 *
 * What the pipeline decides against: the scheduler's depth is not visible to ingress, so every
 * bottleneck port keeps a virtual copy of it here: one backlog per priority, in registers,
 * drained at R by the packets' own timestamps, the highest priority first, exactly as the
 * scheduler drains its leaves, and charged per packet what the scheduler charges
 * (max(length + overhead, mpu) bytes: one slot per frame for a capacity in packets, the
 * frame's bytes on the wire for one in bits). Backlogs are in slots (full-size frames, 8.24
 * fixed point). The backlog *ahead of* a packet is the sum at its priority and above; the
 * port's whole backlog is kept beside it for EcnMark. SelectiveDrop and EcnMark decide
 * against them, and only what they admit reaches the scheduler, so the real queue holds what
 * the virtual one says, give or take the packets in flight inside the switch.
 *
 * Runs in ingress after Forwarding, Classify and Spray (it needs the egress port and the
 * queue); ports without a vq_config entry are not bottlenecks and skip it.
 */
#ifndef DLCP_PRIORITY_QUEUE_P4
#define DLCP_PRIORITY_QUEUE_P4

/* Per port: time of the last drain (us); per port x priority: backlog (slots << VQ_FRAC_BITS). */
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
    bit<64> overhead = 0;
    bit<64> mpu = 0;
    bit<64> unit = 0;

    /* rate_fp: slots per microsecond (8.24); capacity: buffer, slots; overhead, mpu, unit_fp:
     * the scheduler's charge per packet (see VQ_UNIT_SHIFT). */
    action set_vq(bit<32> rate_fp, bit<32> capacity, bit<16> overhead_bytes, bit<16> mpu_bytes, bit<32> unit_fp) {
        meta.vq_on = 1;
        rate = (bit<64>)rate_fp;
        meta.vq_capacity = capacity;
        overhead = (bit<64>)overhead_bytes;
        mpu = (bit<64>)mpu_bytes;
        unit = (bit<64>)unit_fp;
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
            bit<64> charged = (bit<64>)standard_metadata.packet_length + overhead;
            if (charged < mpu) {
                charged = mpu;
            }
            meta.vq_cost = (charged * unit) >> VQ_UNIT_SHIFT;
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

/* After the drop decision: an admitted packet joins its priority's virtual backlog, and its
 * frame carries its queue to the port's scheduler (TM_TAG_BITS low bits of the source MAC,
 * which Forwarding has just set to the port's own). */
control VqAdmit(inout headers_t hdr, inout dlcp_metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    apply {
        if (meta.vq_on == 1 && meta.drop == 0) {
            bit<64> backlog;
            vq_backlog.read(backlog, meta.port_queue);
            vq_backlog.write(meta.port_queue, backlog + meta.vq_cost);
            hdr.ethernet.src_addr[TM_TAG_BITS - 1:0] = meta.queue;
        }
    }
}

#endif
