/* test_topology.c: GPU placement on hand-written hwloc XML machines
 * (tests/data/topology_*.xml, each described in its header comment), the
 * load errors, and CPU binding on this machine checked against
 * sched_getaffinity. */
#define _GNU_SOURCE /* sched_getaffinity, pthread_getaffinity_np */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm/topology.h"
#include "test_expect.h"

#ifndef MOE_TEST_DATA_DIR
#error "CMakeLists.txt defines MOE_TEST_DATA_DIR for test_topology"
#endif

static const char *fixture(const char *name) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", MOE_TEST_DATA_DIR, name);
    return path;
}


Test(topology, distance_names) {
    cr_expect_str_eq(moe_link_distance_name(MOE_LINK_NONE), "none");
    cr_expect_str_eq(moe_link_distance_name(MOE_LINK_OTHER_PACKAGE), "other-package");
    cr_expect_str_eq(moe_link_distance_name(MOE_LINK_SAME_CPUS), "same-cpus");
    cr_expect_str_eq(moe_link_distance_name(MOE_LINK_SAME_HOST_BRIDGE), "same-host-bridge");
    cr_expect_str_eq(moe_link_distance_name(MOE_LINK_SAME_SWITCH), "same-switch");
    cr_expect_str_eq(moe_link_distance_name((moe_link_distance)99), "unknown");
}

#ifdef MOE_HAVE_HWLOC

static moe_topology *load_fixture(const char *name) {
    moe_topology *topo = NULL;
    moe_status st = moe_topology_load(&topo, fixture(name));
    cr_assert_eq(st, MOE_OK, "loading %s: %s", name, moe_last_error());
    cr_assert_not_null(topo);
    return topo;
}

typedef struct placement_case {
    const char *busid;
    const char *cpus, *near, *nic;
    moe_link_distance distance;
    const char *why; /* the rule the case checks */
} placement_case;

static void check_placements(const char *xml, const placement_case *cases, int n) {
    moe_topology *topo = load_fixture(xml);
    for (int i = 0; i < n; i++) {
        const placement_case *c = &cases[i];
        moe_gpu_placement p;
        moe_status st = moe_topology_gpu_placement(topo, c->busid, &p);
        cr_expect_eq(st, MOE_OK, "%s %s: %s", xml, c->busid, moe_last_error());
        if (st != MOE_OK) continue;
        cr_expect_str_eq(p.cpus, c->cpus, "%s %s: cpus \"%s\", expected \"%s\"", xml, c->busid, p.cpus, c->cpus);
        cr_expect_str_eq(p.near, c->near, "%s %s: near \"%s\", expected \"%s\"", xml, c->busid, p.near, c->near);
        cr_expect_str_eq(p.nic, c->nic, "%s %s (%s): nic \"%s\", expected \"%s\"", xml, c->busid, c->why, p.nic,
                         c->nic);
        cr_expect_eq(p.nic_distance, c->distance, "%s %s (%s): distance %s, expected %s", xml, c->busid, c->why,
                     moe_link_distance_name(p.nic_distance), moe_link_distance_name(c->distance));
    }
    moe_topology_free(topo);
}

Test(topology, two_packages) {
    const placement_case cases[] = {
        {"0000:83:00.0", "4-7,12-15", "Package:1", "mlx5_0", MOE_LINK_SAME_SWITCH,
         "NIC behind the same switch; verbs device before its netdev ib0"},
        {"0000:00:04.0", "0-3,8-11", "Package:0", "mlx5_1", MOE_LINK_SAME_HOST_BRIDGE,
         "same host bridge; OpenFabrics before a faster ethernet at equal hops"},
        {"0000:11:00.0", "0-3,8-11", "Package:0", "mlx5_1", MOE_LINK_SAME_CPUS,
         "no NIC on its host bridge, nearest in the same package"},
        // The spellings nvidia-smi (8-digit domain) and lspci (no domain) print.
        {"00000000:83:00.0", "4-7,12-15", "Package:1", "mlx5_0", MOE_LINK_SAME_SWITCH, "8-digit domain"},
        {"00:04.0", "0-3,8-11", "Package:0", "mlx5_1", MOE_LINK_SAME_HOST_BRIDGE, "no domain"},
    };
    check_placements("topology_2pkg.xml", cases, (int)(sizeof cases / sizeof cases[0]));
}

Test(topology, nic_ties) {
    const placement_case cases[] = {
        {"0000:00:01.0", "0-1", "Package:0", "eth_near", MOE_LINK_SAME_HOST_BRIDGE,
         "fewer hops before OpenFabrics and link speed"},
        {"0000:10:00.0", "0-1", "Package:0", "eth_b", MOE_LINK_SAME_HOST_BRIDGE, "faster link before name order"},
        {"0000:20:00.0", "0-1", "Package:0", "mlx5_2", MOE_LINK_SAME_HOST_BRIDGE,
         "name order, not bus order or its reverse"},
        {"0000:40:00.0", "2-3", "Package:1", "mlx5_2", MOE_LINK_OTHER_PACKAGE,
         "veth0 without a PCI parent skipped; all NICs in the other package"},
    };
    check_placements("topology_ties.xml", cases, (int)(sizeof cases / sizeof cases[0]));
}

Test(topology, no_nic) {
    const placement_case cases[] = {
        {"0000:00:01.0", "0-1", "Package:0", "", MOE_LINK_NONE, "no network device at all"},
    };
    check_placements("topology_no_nic.xml", cases, 1);
}

/* Each package's PUs are every other PU: a 456-character list, past the
 * 256 bytes the list once had. */
Test(topology, interleaved_numbering) {
    char even[1024] = "", odd[1024] = "";
    for (int pu = 0; pu < 256; pu++) {
        char *list = pu % 2 == 0 ? even : odd;
        snprintf(list + strlen(list), sizeof even - strlen(list), "%s%d", list[0] ? "," : "", pu);
    }
    cr_assert_eq(strlen(even), 456, "the reference list has %zu characters", strlen(even));
    const placement_case cases[] = {
        {"0000:10:00.0", even, "Package:0", "mlx5_0", MOE_LINK_SAME_HOST_BRIDGE, "even PUs, NIC on its host bridge"},
        {"0000:90:00.0", odd, "Package:1", "mlx5_1", MOE_LINK_SAME_HOST_BRIDGE, "odd PUs, NIC on its host bridge"},
    };
    check_placements("topology_interleaved.xml", cases, (int)(sizeof cases / sizeof cases[0]));
}

Test(topology, unknown_bus_id) {
    moe_topology *topo = load_fixture("topology_2pkg.xml");
    moe_gpu_placement p;
    EXPECT_FAIL(moe_topology_gpu_placement(topo, "0000:99:00.0", &p), MOE_ERR_INVALID_ARG, "0000:99:00.0");
    cr_expect(strstr(moe_last_error(), "topology_2pkg.xml") != NULL, "message '%s' lacks the file",
              moe_last_error());
    EXPECT_FAIL(moe_topology_gpu_placement(topo, "gpu0", &p), MOE_ERR_INVALID_ARG, "\"gpu0\"");
    EXPECT_FAIL(moe_topology_gpu_placement(topo, NULL, &p), MOE_ERR_INVALID_ARG, "pci_busid");
    moe_topology_free(topo);
}

/* hwloc's XML parser must stay quiet: the library never prints. */
Test(topology, load_errors, .init = cr_redirect_stderr) {
    moe_topology *topo = (moe_topology *)&topo; // any non-NULL value: a failure must clear it
    const char *missing = fixture("no_such_topology.xml");
    EXPECT_FAIL(moe_topology_load(&topo, missing), MOE_ERR_IO, missing);
    cr_expect_null(topo);
    topo = (moe_topology *)&topo;
    const char *malformed = fixture("topology_malformed.xml");
    EXPECT_FAIL(moe_topology_load(&topo, malformed), MOE_ERR_FORMAT, malformed);
    cr_expect_null(topo);
    EXPECT_FAIL(moe_topology_load(NULL, NULL), MOE_ERR_INVALID_ARG, "topo");
    fflush(stderr);
    cr_expect_stderr_eq_str("", "loading bad topologies wrote to stderr");
}

Test(topology, xml_topology_cannot_bind) {
    moe_topology *topo = load_fixture("topology_2pkg.xml");
    bool bound = true;
    EXPECT_FAIL(moe_topology_bind_near(topo, "0000:83:00.0", &bound), MOE_ERR_STATE, "topology_2pkg.xml");
    cr_expect(!bound);
    char list[64];
    EXPECT_FAIL(moe_topology_binding(topo, list, sizeof list), MOE_ERR_STATE, "topology_2pkg.xml");
    moe_topology_free(topo);
}

/* ---- this machine --------------------------------------------------------- */

/* Parses an hwloc PU list ("0-3,8,10-11") into a set; false when malformed. */
static bool parse_pu_list(cpu_set_t *set, const char *list) {
    CPU_ZERO(set);
    const char *s = list;
    while (*s != '\0') {
        char *end;
        long lo = strtol(s, &end, 10), hi = lo;
        if (end == s || lo < 0) return false;
        s = end;
        if (*s == '-') {
            hi = strtol(s + 1, &end, 10);
            if (end == s + 1 || hi < lo) return false;
            s = end;
        }
        if (hi >= CPU_SETSIZE) return false;
        for (long c = lo; c <= hi; c++) CPU_SET((int)c, set);
        if (*s == ',') s++;
        else if (*s != '\0') return false;
    }
    return true;
}

static cpu_set_t current_affinity(void) {
    cpu_set_t set;
    cr_assert_eq(sched_getaffinity(0, sizeof set, &set), 0, "sched_getaffinity failed");
    return set;
}

/* hwloc's PCI plugin unloads libpciaccess when the topology goes, and the
 * library's globals still point at memory it never freed: LeakSanitizer
 * would report that as lost in every test that reads this machine. Our own
 * reference keeps the library, so the memory stays reachable. */
static void keep_libpciaccess_loaded(void) { (void)dlopen("libpciaccess.so.0", RTLD_LAZY | RTLD_NODELETE); }

static moe_topology *load_this_machine(void) {
    keep_libpciaccess_loaded();
    moe_topology *topo = NULL;
    moe_status st = moe_topology_load(&topo, NULL);
    cr_assert_eq(st, MOE_OK, "loading this machine: %s", moe_last_error());
    return topo;
}

Test(topology, binding_matches_affinity) {
    moe_topology *topo = load_this_machine();
    char list[MOE_TOPOLOGY_CPUS_BYTES];
    cr_assert_eq(moe_topology_binding(topo, list, sizeof list), MOE_OK, "%s", moe_last_error());
    cpu_set_t got, want = current_affinity();
    cr_assert(parse_pu_list(&got, list), "binding \"%s\" is not a PU list", list);
    cr_expect_gt(CPU_COUNT(&got), 0, "empty binding");
    cr_expect(CPU_EQUAL(&got, &want), "binding \"%s\" differs from sched_getaffinity (%d PUs)", list,
              CPU_COUNT(&want));
    EXPECT_FAIL(moe_topology_binding(topo, list, 1), MOE_ERR_INVALID_ARG, "bytes");
    moe_topology_free(topo);
}

/* The first PCI device of this machine that hwloc keeps (with only_smaller,
 * the first local to fewer PUs than this process may use); false if none. */
static bool find_local_device(char busid[256], moe_gpu_placement *p, const moe_topology *topo, bool only_smaller) {
    DIR *dir = opendir("/sys/bus/pci/devices");
    if (dir == NULL) return false;
    cpu_set_t all = current_affinity();
    bool found = false;
    for (struct dirent *e; !found && (e = readdir(dir)) != NULL;) {
        if (e->d_name[0] == '.' || moe_topology_gpu_placement(topo, e->d_name, p) != MOE_OK) continue;
        cpu_set_t local;
        cr_assert(parse_pu_list(&local, p->cpus), "%s: cpus \"%s\" is not a PU list", e->d_name, p->cpus);
        CPU_AND(&local, &local, &all);
        found = !only_smaller || !CPU_EQUAL(&local, &all);
        if (found) snprintf(busid, 256, "%s", e->d_name);
    }
    closedir(dir);
    return found;
}

Test(topology, bind_near_keeps_finer_binding) {
    moe_topology *topo = load_this_machine();
    char busid[256];
    moe_gpu_placement p;
    if (!find_local_device(busid, &p, topo, false)) {
        moe_topology_free(topo);
        cr_skip_test("no PCI device that hwloc reports on this machine (no /sys/bus/pci, or a container)");
    }
    cpu_set_t local, one, allowed = current_affinity();
    cr_assert(parse_pu_list(&local, p.cpus));
    CPU_AND(&local, &local, &allowed);
    cr_assert_gt(CPU_COUNT(&local), 0, "%s: none of its PUs %s is allowed here", busid, p.cpus);
    int first = 0;
    while (!CPU_ISSET(first, &local)) first++;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0, "cannot bind to PU %d", first);
    bool bound = true;
    cr_assert_eq(moe_topology_bind_near(topo, busid, &bound), MOE_OK, "%s: %s", busid, moe_last_error());
    cr_expect(!bound, "%s: bound to PU %d, inside its PUs %s: must be left alone", busid, first, p.cpus);
    cpu_set_t now = current_affinity();
    cr_expect(CPU_EQUAL(&now, &one), "%s: the binding to PU %d changed (%d PUs now)", busid, first, CPU_COUNT(&now));
    moe_topology_free(topo);
}

static pthread_barrier_t barrier;

static void *wait_twice(void *set) {
    pthread_barrier_wait(&barrier); // the main thread binds the process here
    pthread_barrier_wait(&barrier);
    pthread_getaffinity_np(pthread_self(), sizeof(cpu_set_t), set);
    return NULL;
}

Test(topology, bind_near_binds_all_threads) {
    moe_topology *topo = load_this_machine();
    char busid[256];
    moe_gpu_placement p;
    if (!find_local_device(busid, &p, topo, true)) {
        moe_topology_free(topo);
        cpu_set_t allowed = current_affinity();
        cr_skip_test("every PCI device here is local to all %d allowed PUs: binding near one changes nothing",
                     CPU_COUNT(&allowed));
    }
    cpu_set_t local, thread_set;
    cr_assert(parse_pu_list(&local, p.cpus));
    pthread_t thread;
    cr_assert_eq(pthread_barrier_init(&barrier, NULL, 2), 0);
    cr_assert_eq(pthread_create(&thread, NULL, wait_twice, &thread_set), 0);
    pthread_barrier_wait(&barrier);
    bool bound = false;
    moe_status st = moe_topology_bind_near(topo, busid, &bound);
    pthread_barrier_wait(&barrier);
    pthread_join(thread, NULL);
    pthread_barrier_destroy(&barrier);
    cr_assert_eq(st, MOE_OK, "%s: %s", busid, moe_last_error());
    cr_expect(bound, "%s: the process ran on more than its PUs %s, so it must be bound", busid, p.cpus);
    cpu_set_t now = current_affinity();
    cr_expect(CPU_EQUAL(&now, &local), "%s: main thread on %d PUs, expected %s", busid, CPU_COUNT(&now), p.cpus);
    cr_expect(CPU_EQUAL(&thread_set, &local), "%s: other thread on %d PUs, expected %s", busid,
              CPU_COUNT(&thread_set), p.cpus);
    moe_topology_free(topo);
}

#else /* !MOE_HAVE_HWLOC */

/* Built without hwloc every call must say so rather than pretend. */
Test(topology, built_without_hwloc) {
    moe_topology *topo = (moe_topology *)&topo;
    EXPECT_FAIL(moe_topology_load(&topo, fixture("topology_2pkg.xml")), MOE_ERR_UNSUPPORTED, "built without hwloc");
    cr_expect_null(topo);
    EXPECT_FAIL(moe_topology_load(&topo, NULL), MOE_ERR_UNSUPPORTED, "libhwloc-dev");
    moe_gpu_placement p;
    EXPECT_FAIL(moe_topology_gpu_placement(NULL, "0000:83:00.0", &p), MOE_ERR_UNSUPPORTED, "built without hwloc");
    char list[16] = "x";
    EXPECT_FAIL(moe_topology_binding(NULL, list, sizeof list), MOE_ERR_UNSUPPORTED, "built without hwloc");
    cr_expect_str_eq(list, "");
    bool bound = true;
    EXPECT_FAIL(moe_topology_bind_near(NULL, "0000:83:00.0", &bound), MOE_ERR_UNSUPPORTED, "built without hwloc");
    cr_expect(!bound);
    moe_topology_free(NULL);
}

#endif /* MOE_HAVE_HWLOC */
