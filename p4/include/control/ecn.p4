/* ECN: mark CE on ECN-capable packets that find more than the marking threshold queued at the
 * port, and the receiving agent echoes the marks so the sender's rate control backs off.
 * Runs after SelectiveDrop (a dropped packet is not marked).
 *
 * Which backlog is compared is the policy's ecn_backlog, chosen by the action the controller
 * writes into the default entry:
 *   - mark_on_backlog_ahead (the default): the backlog at the packet's priority and above, what
 *     a strict-priority port serves before it. Lower-priority traffic, responsive or not,
 *     does not slow it down, but in an incast a sender on a high priority sees few marks
 *     while the low priorities behind it overflow;
 *   - mark_on_port_backlog: the port's whole backlog, every priority. Every sender backs off
 *     for the port's congestion, whatever its priority and whoever caused it. */
#ifndef DLCP_ECN_P4
#define DLCP_ECN_P4

#define ECN_NOT_ECT 0
#define ECN_CE 3

control EcnMark(inout headers_t hdr, inout dlcp_metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    bit<32> threshold = 0xFFFFFFFF;
    bool whole_port = false;

    action mark_on_port_backlog(bit<32> depth) {
        threshold = depth;
        whole_port = true;
    }
    action mark_on_backlog_ahead(bit<32> depth) {
        threshold = depth;
        whole_port = false;
    }
    /* Keyless: the controller writes the rule and its threshold into the default action. */
    table ecn_threshold {
        actions = { mark_on_backlog_ahead; mark_on_port_backlog; }
        default_action = mark_on_backlog_ahead(0xFFFFFFFF);
        size = 1;
    }
    apply {
        meta.ecn_marked = 0;
        if (meta.vq_on == 1 && meta.drop == 0 && hdr.ipv4.isValid() && hdr.ipv4.ecn != ECN_NOT_ECT) {
            ecn_threshold.apply();
            bit<32> depth = meta.depth_ahead;
            if (whole_port) {
                depth = meta.depth_port;
            }
            if (depth > threshold) {
                hdr.ipv4.ecn = ECN_CE;
                meta.ecn_marked = 1;
            }
        }
    }
}

#endif
