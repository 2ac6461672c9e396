"""``dlcp sim``: DLCP's policy on an ns-3 leaf-spine, beyond what one machine's BMv2 testbed holds.

The switches (:file:`ns3/dlcp-switch.h`, forwarding below IP; the admission rule in
:file:`ns3/dlcp-port.h`) and the host transport (:file:`ns3/dlcp-host.h`) are ns-3 components in
C++, compiled once against the ns-3 wheel (:mod:`dlcp_sim.build`); Python only writes the
scenario from the same policy, schemes and workload the testbed uses (:mod:`dlcp_sim.scenario`)
and reads the report (:mod:`dlcp_sim.run`).
"""
