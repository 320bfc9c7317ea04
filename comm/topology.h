/* topology.h: where a GPU sits in the machine, from hwloc, for placing ranks.
 *
 * A rank that drives one GPU wants its threads on the cores next to that GPU
 * and its traffic on the NIC nearest to it. hwloc knows the PCI tree; this
 * module answers those two questions for a GPU named by its PCI bus id
 * ("0000:84:00.0", from cudaDeviceGetPCIBusId or nvidia-smi), so the code
 * needs no CUDA and runs on exported topologies (lstopo file.xml) as well as
 * on this machine.
 *
 * Built without hwloc, every function returns MOE_ERR_UNSUPPORTED (free does
 * nothing), so callers need no #ifdefs.
 */
#ifndef MOE_COMM_TOPOLOGY_H
#define MOE_COMM_TOPOLOGY_H

#include <stdbool.h>
#include <stddef.h>

#include "moe.h"

typedef struct moe_topology moe_topology;

/* Loads this machine's topology (xml NULL) or an exported one, with its PCI
 * devices, bridges and network devices. Errors name the XML file. */
moe_status moe_topology_load(moe_topology **topo, const char *xml);
void moe_topology_free(moe_topology *topo);

/* How close two PCI devices are, nearest last, so a larger value is nearer. */
typedef enum moe_link_distance {
    MOE_LINK_NONE = 0,         /* no such device */
    MOE_LINK_OTHER_PACKAGE,    /* different packages / NUMA: through the CPU interconnect */
    MOE_LINK_SAME_CPUS,        /* different PCIe roots under the same package (same cpuset) */
    MOE_LINK_SAME_HOST_BRIDGE, /* same PCIe root */
    MOE_LINK_SAME_SWITCH,      /* below a common PCIe switch (a PCI-to-PCI bridge) */
} moe_link_distance;

/* "none", "other-package", "same-cpus", "same-host-bridge", "same-switch". */
const char *moe_link_distance_name(moe_link_distance d);

/* Room for hwloc's list of any set of PUs numbered below 8192, Linux's
 * largest NR_CPUS, so that every machine's fits: the longest such list,
 * pairs with gaps ("0-1,3-4,..."), takes 26,568 characters. Numbering
 * interleaved between packages is common and long already: a 2 x 64-core
 * SMT machine's package lists every other PU, 456 characters. */
#define MOE_TOPOLOGY_CPUS_BYTES 26624
#define MOE_TOPOLOGY_NAME_BYTES 64

typedef struct moe_gpu_placement {
    /* The GPU's local PUs as an hwloc list, "8-15,24-31" or "0,2,4,...":
     * those of the nearest non-I/O object above it. */
    char cpus[MOE_TOPOLOGY_CPUS_BYTES];
    /* That object as type:logical index, "Package:1" (or "Group:3", "Machine:0"). */
    char near[MOE_TOPOLOGY_NAME_BYTES];
    /* The nearest network device ("mlx5_0"), "" when the machine has none. */
    char nic[MOE_TOPOLOGY_NAME_BYTES];
    moe_link_distance nic_distance; /* MOE_LINK_NONE when nic is "" */
} moe_gpu_placement;

/* The placement of the PCI device at pci_busid (domain:bus:dev.func, hex).
 *
 * The NIC is chosen among the OpenFabrics and network OS devices that hang
 * below a PCI device (virtual ones without a PCI parent are skipped): the
 * largest moe_link_distance from the GPU's PCI device, then the fewest hops
 * through the tree to their common ancestor, then OpenFabrics before a plain
 * network device (on one adapter, the verbs device before its netdev), then
 * the faster PCI link, then the smaller name, so the choice is the same on
 * every rank. MOE_ERR_INVALID_ARG naming the bus id when the topology has no
 * such PCI device. */
moe_status moe_topology_gpu_placement(const moe_topology *topo, const char *pci_busid,
                                      moe_gpu_placement *out);

/* This process's CPU binding as a PU list ("0-1"), for reports. Only on a
 * topology of this machine (loaded with xml NULL); MOE_ERR_STATE otherwise. */
moe_status moe_topology_binding(const moe_topology *topo, char *out, size_t out_bytes);

/* Binds this process (all its threads) to the local PUs of the PCI device at
 * pci_busid, unless it is already bound to a subset of them (a launcher's
 * finer binding wins); *bound says whether the binding changed. Only on a
 * topology of this machine; MOE_ERR_STATE otherwise. */
moe_status moe_topology_bind_near(moe_topology *topo, const char *pci_busid, bool *bound);

#endif /* MOE_COMM_TOPOLOGY_H */
