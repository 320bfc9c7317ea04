/* topology.c: GPU-local cores and the nearest NIC, from the hwloc topology. */
#include "comm/topology.h"

#include <string.h>

#include "common/status.h"

const char *moe_link_distance_name(moe_link_distance d) {
    switch (d) {
    case MOE_LINK_NONE: return "none";
    case MOE_LINK_OTHER_PACKAGE: return "other-package";
    case MOE_LINK_SAME_CPUS: return "same-cpus";
    case MOE_LINK_SAME_HOST_BRIDGE: return "same-host-bridge";
    case MOE_LINK_SAME_SWITCH: return "same-switch";
    }
    return "unknown";
}

#ifdef MOE_HAVE_HWLOC

#include <errno.h>
#include <hwloc.h>
#include <stdio.h>
#include <stdlib.h>

struct moe_topology {
    hwloc_topology_t hw;
    bool this_machine; /* binding calls reach the OS */
    char *source;      /* "this machine" or the XML path, for messages */
};

void moe_topology_free(moe_topology *topo) {
    if (topo == NULL) return;
    if (topo->hw != NULL) hwloc_topology_destroy(topo->hw);
    free(topo->source);
    free(topo);
}

moe_status moe_topology_load(moe_topology **topo, const char *xml) {
    if (topo == NULL) return moe_error(MOE_ERR_INVALID_ARG, "moe_topology_load: topo is NULL");
    *topo = NULL;
    if (xml != NULL) {
        // A file that cannot be opened is MOE_ERR_IO, not a malformed topology.
        FILE *f = fopen(xml, "r");
        if (f == NULL) return moe_error(MOE_ERR_IO, "%s: cannot open topology: %s", xml, strerror(errno));
        fclose(f);
    }
    moe_topology *t = calloc(1, sizeof *t);
    if (t == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_topology_load: out of memory");
    const char *source = xml != NULL ? xml : "this machine";
    t->source = malloc(strlen(source) + 1);
    if (t->source == NULL || hwloc_topology_init(&t->hw) != 0) {
        t->hw = NULL;
        moe_topology_free(t);
        return moe_error(MOE_ERR_OUT_OF_MEMORY, "%s: out of memory for the topology", source);
    }
    strcpy(t->source, source);
    // I/O objects default to KEEP_NONE: without this there is no PCI tree at all.
    if (hwloc_topology_set_io_types_filter(t->hw, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0) {
        int err = errno;
        moe_topology_free(t);
        return moe_error(MOE_ERR_INTERNAL, "%s: hwloc refused the I/O filter: %s", source, strerror(err));
    }
    if (xml != NULL && hwloc_topology_set_xml(t->hw, xml) != 0) {
        int err = errno;
        moe_topology_free(t);
        return moe_error(MOE_ERR_FORMAT, "%s: hwloc cannot read it as an XML topology (%s)", xml,
                         err == EINVAL ? "malformed XML" : strerror(err));
    }
    if (hwloc_topology_load(t->hw) != 0) {
        int err = errno;
        moe_topology_free(t);
        if (xml != NULL) {
            return moe_error(MOE_ERR_FORMAT, "%s: hwloc cannot load this topology (%s)", xml, strerror(err));
        }
        return moe_error(MOE_ERR_IO, "hwloc cannot read this machine's topology: %s", strerror(err));
    }
    // HWLOC_XMLFILE in the environment turns a load with xml NULL into an XML
    // one too; is_thissystem sees it.
    t->this_machine = xml == NULL && hwloc_topology_is_thissystem(t->hw);
    *topo = t;
    return MOE_OK;
}

static moe_status find_pcidev(hwloc_obj_t *dev, const moe_topology *topo, const char *pci_busid) {
    *dev = hwloc_get_pcidev_by_busidstring(topo->hw, pci_busid);
    if (*dev == NULL) {
        return moe_error(MOE_ERR_INVALID_ARG,
                         "PCI bus id \"%s\": no such PCI device in the topology of %s "
                         "(expected domain:bus:device.function in hex, e.g. 0000:84:00.0)",
                         pci_busid, topo->source);
    }
    return MOE_OK;
}

/* hwloc 3.0 makes the OS device type a bitmask, and OpenFabrics devices are
 * also NETWORK there. */
#if HWLOC_API_VERSION >= 0x00030000
#define OSDEV_IS(obj, t) (((obj)->attr->osdev.types & (t)) != 0)
#else
#define OSDEV_IS(obj, t) ((obj)->attr->osdev.type == (t))
#endif

/* Edges from obj up to the root. I/O objects have negative hwloc depths, so
 * obj->depth cannot be used for this. */
static int tree_depth(const struct hwloc_obj *obj) {
    int depth = 0;
    for (; obj->parent != NULL; obj = obj->parent) depth++;
    return depth;
}

/* How close PCI devices a and b are, and the hops between them through their
 * lowest common ancestor. The walk is our own: hwloc_get_common_ancestor_obj
 * compares depths, which are negative for I/O objects, and can crash when
 * the common ancestor is a normal object. */
static moe_link_distance pci_distance(int *hops, hwloc_topology_t hw, hwloc_obj_t a, hwloc_obj_t b) {
    hwloc_obj_t x = a, y = b;
    int dx = tree_depth(x), dy = tree_depth(y);
    *hops = 0;
    for (; dx > dy; dx--, ++*hops) x = x->parent;
    for (; dy > dx; dy--, ++*hops) y = y->parent;
    while (x != y) {
        x = x->parent;
        y = y->parent;
        *hops += 2;
    }
    // A PCI device as the common ancestor means a and b are one device (a NIC
    // function on the GPU's own board): nothing is nearer.
    if (x->type == HWLOC_OBJ_PCI_DEVICE) return MOE_LINK_SAME_SWITCH;
    if (x->type == HWLOC_OBJ_BRIDGE) {
        return x->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI ? MOE_LINK_SAME_SWITCH
                                                                      : MOE_LINK_SAME_HOST_BRIDGE;
    }
    hwloc_obj_t ca = hwloc_get_non_io_ancestor_obj(hw, a), cb = hwloc_get_non_io_ancestor_obj(hw, b);
    return hwloc_bitmap_isequal(ca->cpuset, cb->cpuset) ? MOE_LINK_SAME_CPUS : MOE_LINK_OTHER_PACKAGE;
}

typedef struct nic_rank {
    moe_link_distance distance; /* larger is nearer */
    int hops;
    bool openfabrics;
    float linkspeed; /* GB/s of the NIC's PCI link, 0 when unknown */
    const char *name;
} nic_rank;

/* Whether NIC a is to be chosen over NIC b (see the header for the order). */
static bool nic_before(const nic_rank *a, const nic_rank *b) {
    if (a->distance != b->distance) return a->distance > b->distance;
    if (a->hops != b->hops) return a->hops < b->hops;
    if (a->openfabrics != b->openfabrics) return a->openfabrics;
    if (a->linkspeed != b->linkspeed) return a->linkspeed > b->linkspeed;
    return strcmp(a->name, b->name) < 0;
}

/* Writes into out[bytes] the nearest network device to the PCI device gpu. */
static moe_status nearest_nic(char *out, size_t bytes, moe_link_distance *distance, const moe_topology *topo,
                              hwloc_obj_t gpu, const char *pci_busid) {
    nic_rank best = {.distance = MOE_LINK_NONE, .name = ""};
    for (hwloc_obj_t dev = NULL; (dev = hwloc_get_next_osdev(topo->hw, dev)) != NULL;) {
        bool openfabrics = OSDEV_IS(dev, HWLOC_OBJ_OSDEV_OPENFABRICS);
        if (!openfabrics && !OSDEV_IS(dev, HWLOC_OBJ_OSDEV_NETWORK)) continue;
        hwloc_obj_t pci = dev->parent;
        if (pci == NULL || pci->type != HWLOC_OBJ_PCI_DEVICE || dev->name == NULL) continue;
        nic_rank r = {.openfabrics = openfabrics, .linkspeed = pci->attr->pcidev.linkspeed, .name = dev->name};
        r.distance = pci_distance(&r.hops, topo->hw, gpu, pci);
        if (best.distance == MOE_LINK_NONE || nic_before(&r, &best)) best = r;
    }
    int n = snprintf(out, bytes, "%s", best.name);
    if (n < 0 || (size_t)n >= bytes) {
        return moe_error(MOE_ERR_UNSUPPORTED, "%s in %s: nearest network device's name \"%s\" is longer than %zu bytes",
                         pci_busid, topo->source, best.name, bytes - 1);
    }
    *distance = best.distance;
    return MOE_OK;
}

moe_status moe_topology_gpu_placement(const moe_topology *topo, const char *pci_busid, moe_gpu_placement *out) {
    if (topo == NULL || pci_busid == NULL || out == NULL) {
        return moe_error(MOE_ERR_INVALID_ARG, "moe_topology_gpu_placement: NULL %s",
                         topo == NULL ? "topo" : pci_busid == NULL ? "pci_busid" : "out");
    }
    memset(out, 0, sizeof *out);
    hwloc_obj_t gpu;
    MOE_TRY(find_pcidev(&gpu, topo, pci_busid));
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo->hw, gpu);
    int n = hwloc_bitmap_list_snprintf(out->cpus, sizeof out->cpus, anc->cpuset);
    if (n < 0 || (size_t)n >= sizeof out->cpus) {
        return moe_error(MOE_ERR_UNSUPPORTED, "%s in %s: its PU list takes %d characters, more than %zu",
                         pci_busid, topo->source, n, sizeof out->cpus - 1);
    }
    snprintf(out->near, sizeof out->near, "%s:%u", hwloc_obj_type_string(anc->type), anc->logical_index);
    return nearest_nic(out->nic, sizeof out->nic, &out->nic_distance, topo, gpu, pci_busid);
}

static moe_status require_this_machine(const moe_topology *topo, const char *what) {
    if (!topo->this_machine) {
        return moe_error(MOE_ERR_STATE, "%s: the topology comes from %s, not from this machine (load it with xml NULL)",
                         what, topo->source);
    }
    return MOE_OK;
}

moe_status moe_topology_binding(const moe_topology *topo, char *out, size_t out_bytes) {
    if (topo == NULL || out == NULL || out_bytes == 0) {
        return moe_error(MOE_ERR_INVALID_ARG, "moe_topology_binding: NULL topo or empty output");
    }
    out[0] = '\0';
    MOE_TRY(require_this_machine(topo, "moe_topology_binding"));
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (set == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_topology_binding: out of memory");
    moe_status st = MOE_OK;
    if (hwloc_get_cpubind(topo->hw, set, HWLOC_CPUBIND_PROCESS) != 0) {
        st = moe_error(MOE_ERR_UNSUPPORTED, "cannot read this process's CPU binding: %s", strerror(errno));
    } else {
        int n = hwloc_bitmap_list_snprintf(out, out_bytes, set);
        if (n < 0 || (size_t)n >= out_bytes) {
            out[0] = '\0';
            st = moe_error(MOE_ERR_INVALID_ARG, "moe_topology_binding: the PU list needs %d bytes, out holds %zu",
                           n + 1, out_bytes);
        }
    }
    hwloc_bitmap_free(set);
    return st;
}

moe_status moe_topology_bind_near(moe_topology *topo, const char *pci_busid, bool *bound) {
    if (topo == NULL || pci_busid == NULL || bound == NULL) {
        return moe_error(MOE_ERR_INVALID_ARG, "moe_topology_bind_near: NULL %s",
                         topo == NULL ? "topo" : pci_busid == NULL ? "pci_busid" : "bound");
    }
    *bound = false;
    MOE_TRY(require_this_machine(topo, "moe_topology_bind_near"));
    hwloc_obj_t gpu;
    MOE_TRY(find_pcidev(&gpu, topo, pci_busid));
    hwloc_const_cpuset_t local = hwloc_get_non_io_ancestor_obj(topo->hw, gpu)->cpuset;
    if (hwloc_bitmap_iszero(local)) {
        return moe_error(MOE_ERR_UNSUPPORTED, "%s: none of its local PUs may be used by this process", pci_busid);
    }
    hwloc_bitmap_t now = hwloc_bitmap_alloc();
    if (now == NULL) return moe_error(MOE_ERR_OUT_OF_MEMORY, "moe_topology_bind_near: out of memory");
    moe_status st = MOE_OK;
    if (hwloc_get_cpubind(topo->hw, now, HWLOC_CPUBIND_PROCESS) != 0) {
        st = moe_error(MOE_ERR_UNSUPPORTED, "cannot read this process's CPU binding: %s", strerror(errno));
    } else if (hwloc_bitmap_iszero(now) || !hwloc_bitmap_isincluded(now, local)) {
        if (hwloc_set_cpubind(topo->hw, local, HWLOC_CPUBIND_PROCESS) != 0) {
            char list[MOE_TOPOLOGY_CPUS_BYTES];
            hwloc_bitmap_list_snprintf(list, sizeof list, local);
            st = moe_error(MOE_ERR_UNSUPPORTED, "cannot bind this process to PUs %s near %s: %s", list, pci_busid,
                           strerror(errno));
        } else {
            *bound = true;
        }
    }
    hwloc_bitmap_free(now);
    return st;
}

#else /* !MOE_HAVE_HWLOC */

#define MOE_NO_HWLOC "built without hwloc (apt-get install libhwloc-dev)"

moe_status moe_topology_load(moe_topology **topo, const char *xml) {
    if (topo != NULL) *topo = NULL;
    return moe_error(MOE_ERR_UNSUPPORTED, "%s: " MOE_NO_HWLOC, xml != NULL ? xml : "this machine's topology");
}

void moe_topology_free(moe_topology *topo) { (void)topo; }

moe_status moe_topology_gpu_placement(const moe_topology *topo, const char *pci_busid, moe_gpu_placement *out) {
    (void)topo;
    if (out != NULL) memset(out, 0, sizeof *out);
    return moe_error(MOE_ERR_UNSUPPORTED, "placement of %s: " MOE_NO_HWLOC, pci_busid != NULL ? pci_busid : "(NULL)");
}

moe_status moe_topology_binding(const moe_topology *topo, char *out, size_t out_bytes) {
    (void)topo;
    if (out != NULL && out_bytes > 0) out[0] = '\0';
    return moe_error(MOE_ERR_UNSUPPORTED, "CPU binding: " MOE_NO_HWLOC);
}

moe_status moe_topology_bind_near(moe_topology *topo, const char *pci_busid, bool *bound) {
    (void)topo;
    if (bound != NULL) *bound = false;
    return moe_error(MOE_ERR_UNSUPPORTED, "binding near %s: " MOE_NO_HWLOC, pci_busid != NULL ? pci_busid : "(NULL)");
}

#endif /* MOE_HAVE_HWLOC */
