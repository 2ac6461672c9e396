/* ECN: mark CE on ECN-capable packets that find more than the marking threshold ahead of
 * them in the virtual queue; the receiving agent echoes the marks and the sender's rate
 * control backs off. Runs after SelectiveDrop (a dropped packet is not marked). */
#ifndef DLCP_ECN_P4
#define DLCP_ECN_P4

#define ECN_NOT_ECT 0
#define ECN_CE 3

control EcnMark(inout headers_t hdr, inout dlcp_metadata_t meta,
                inout standard_metadata_t standard_metadata) {
    bit<32> threshold = 0xFFFFFFFF;

    action set_ecn_threshold(bit<32> depth) {
        threshold = depth;
    }
    /* Keyless: the controller writes the threshold into the default action. */
    table ecn_threshold {
        actions = { set_ecn_threshold; }
        default_action = set_ecn_threshold(0xFFFFFFFF);
        size = 1;
    }
    apply {
        meta.ecn_marked = 0;
        if (meta.vq_on == 1 && meta.drop == 0 && hdr.ipv4.isValid() && hdr.ipv4.ecn != ECN_NOT_ECT) {
            ecn_threshold.apply();
            if (meta.depth_ahead > threshold) {
                hdr.ipv4.ecn = ECN_CE;
                meta.ecn_marked = 1;
            }
        }
    }
}

#endif
