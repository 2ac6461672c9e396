/* DLCP: table, register and counter sizes. */
#ifndef DLCP_SIZES_P4
#define DLCP_SIZES_P4

#define MAX_PORTS 512                 /* egress_spec is 9 bits */
#define PORT_QUEUES 4096              /* MAX_PORTS * NUM_QUEUES: one slot per port x priority */
#define IPV4_ROUTES 1024
#define ECMP_GROUPS 256
#define ECMP_MEMBERS 1024
#define DLCP_PRIORITIES 256           /* the header's priority field is 8 bits */
#define DSCP_VALUES 64
#define DROP_CLASSES 256              /* the header's drop_class field is 8 bits */

#endif
