/* Classify: which switch queue (v1model priority, 7 served first) a packet goes to.
 * DLCP packets by their header priority (the policy's priority_map); other IPv4 traffic by
 * DSCP; anything unmapped is best effort (queue 0). Only classifies: the queue is acted on
 * by the virtual queue and the traffic manager. */
#ifndef DLCP_CLASSIFY_P4
#define DLCP_CLASSIFY_P4

control Classify(inout headers_t hdr, inout dlcp_metadata_t meta,
                 inout standard_metadata_t standard_metadata) {
    action set_queue(queue_t queue) {
        meta.queue = queue;
    }
    action best_effort() {
        meta.queue = 0;
    }
    table dlcp_priority {
        key = { hdr.dlcp.priority : exact @name("priority"); }
        actions = { set_queue; @defaultonly best_effort; }
        const default_action = best_effort();
        size = DLCP_PRIORITIES;
    }
    table dscp_queue {
        key = { hdr.ipv4.dscp : exact @name("dscp"); }
        actions = { set_queue; @defaultonly best_effort; }
        const default_action = best_effort();
        size = DSCP_VALUES;
    }
    apply {
        meta.is_dlcp_data = 0;
        if (hdr.dlcp.isValid()) {
            if (hdr.dlcp.ptype == DLCP_PTYPE_DATA && hdr.dlcp.version == DLCP_VERSION) {
                meta.is_dlcp_data = 1;
            }
            dlcp_priority.apply();
        } else if (hdr.ipv4.isValid()) {
            dscp_queue.apply();
        } else {
            best_effort();
        }
    }
}

#endif
