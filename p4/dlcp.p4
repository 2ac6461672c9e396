/* DLCP switch program for v1model (BMv2 simple_switch_grpc --priority-queues 8).
 * This file only includes the concerns and orders them; each lives in its own control:
 *   Forwarding -> Classify -> Spray -> VirtualQueue -> SelectiveDrop -> EcnMark -> VqAdmit
 * then the drop itself, the queue choice and the counters. See p4/README.md. */
#include <core.p4>
#include <v1model.p4>

#include "include/defines.p4"
#include "include/sizes.p4"
#include "include/headers.p4"
#include "include/parser.p4"
#include "include/control/forwarding.p4"
#include "include/control/classify.p4"
#include "include/control/spray.p4"
#include "include/control/priority_queue.p4"
#include "include/control/selective_drop.p4"
#include "include/control/ecn.p4"
#include "include/control/stats.p4"

control DlcpIngress(inout headers_t hdr, inout dlcp_metadata_t meta,
                    inout standard_metadata_t standard_metadata) {
    Forwarding() forwarding;
    Classify() classify;
    Spray() spray;
    VirtualQueue() virtual_queue;
    SelectiveDrop() selective_drop;
    EcnMark() ecn;
    VqAdmit() vq_admit;
    IngressStats() stats;

    apply {
        meta.drop = 0;
        meta.drop_reason = DROP_NONE;
        forwarding.apply(hdr, meta, standard_metadata);
        classify.apply(hdr, meta, standard_metadata);
        spray.apply(hdr, meta, standard_metadata);
        virtual_queue.apply(hdr, meta, standard_metadata);
        selective_drop.apply(hdr, meta, standard_metadata);
        ecn.apply(hdr, meta, standard_metadata);
        vq_admit.apply(hdr, meta, standard_metadata);
        stats.apply(hdr, meta, standard_metadata);
        if (meta.drop == 1) {
            mark_to_drop(standard_metadata);
        } else {
            standard_metadata.priority = meta.queue;
        }
    }
}

control DlcpEgress(inout headers_t hdr, inout dlcp_metadata_t meta,
                   inout standard_metadata_t standard_metadata) {
    EgressStats() stats;
    apply {
        stats.apply(hdr, meta, standard_metadata);
    }
}

V1Switch(DlcpParser(), DlcpVerifyChecksum(), DlcpIngress(), DlcpEgress(),
         DlcpComputeChecksum(), DlcpDeparser()) main;
