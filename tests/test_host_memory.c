/* test_host_memory.c: the memory a process may still take, from
 * MemAvailable and the limits of its memory cgroups, on fake /proc and
 * /sys/fs/cgroup trees laid out as v1 and v2 kernels lay them out. */
#define _XOPEN_SOURCE 700
#define TEST_TMPDIR_TEMPLATE "/tmp/moe_test_host_memory_XXXXXX"
#include <string.h>

#include "common/host_memory.h"
#include "test_files.h"

#define GB ((int64_t)1000000000)

static void put(const char *relative, const char *text) {
    char path[768];
    snprintf(path, sizeof path, "%s/%s", tmpdir, relative);
    for (char *slash = strchr(path + strlen(tmpdir) + 1, '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = '\0';
        mkdir(path, 0755);
        *slash = '/';
    }
    write_bytes(path, text, strlen(text));
}

/* MemAvailable of 16 GB. */
static void machine_with_16gb(void) {
    make_tmpdir();
    put("proc/meminfo", "MemTotal:       32000000 kB\nMemFree:         1000000 kB\n"
                        "MemAvailable:   15625000 kB\nBuffers:           1000 kB\n");
}

TestSuite(host_memory, .init = machine_with_16gb, .fini = remove_tmpdir);

static moe_host_memory available(void) { return moe_host_memory_available(tmpdir); }

Test(host_memory, without_cgroups_it_is_mem_available) {
    const moe_host_memory m = available();
    cr_expect_eq(m.available, 16 * GB);
    cr_expect_str_eq(m.bound_by, "the machine has available");
    cr_expect_eq(m.total, 32768000000);
    cr_expect_str_eq(m.total_by, "the machine has");
}

Test(host_memory, nothing_to_read_is_minus_one) {
    remove_tmpdir();
    make_tmpdir();
    cr_expect_eq(available().available, -1);
}

/* v2: the tightest limit on the way up counts, less the usage that is not
 * file page cache; "max" is no limit. */
Test(host_memory, v2_takes_the_tightest_limit_above) {
    put("proc/self/cgroup", "0::/user.slice/job\n");
    put("sys/fs/cgroup/user.slice/memory.max", "4000000000\n");
    put("sys/fs/cgroup/user.slice/memory.current", "1500000000\n");
    put("sys/fs/cgroup/user.slice/memory.stat",
        "anon 1000000000\nfile 500000000\nactive_anon 900000000\ninactive_file 400000000\nactive_file 100000000\n");
    put("sys/fs/cgroup/user.slice/job/memory.max", "max\n");
    put("sys/fs/cgroup/user.slice/job/memory.current", "1000000000\n");
    const moe_host_memory m = available();
    cr_expect_eq(m.available, 4 * GB - (1500000000 - 500000000), "the file pages, active and inactive, reclaim");
    cr_expect(strstr(m.bound_by, "the memory cgroup /user.slice leaves under its 4.00 GB limit"), "%s", m.bound_by);
    cr_expect_eq(m.total, 4 * GB);
    cr_expect_str_eq(m.total_by, "the memory cgroup /user.slice allows");

    put("sys/fs/cgroup/user.slice/job/memory.max", "2500000000\n");
    cr_expect_eq(available().available, 1500000000, "the job's own limit is now the tighter");
    cr_expect(strstr(available().bound_by, "/user.slice/job"), "%s", available().bound_by);
}

/* A cgroup over its limit has no room; a limit looser than the machine
 * leaves MemAvailable in charge. */
Test(host_memory, full_cgroup_and_loose_limit) {
    put("proc/self/cgroup", "0::/job\n");
    put("sys/fs/cgroup/job/memory.max", "2000000000\n");
    put("sys/fs/cgroup/job/memory.current", "2100000000\n");
    cr_expect_eq(available().available, 0);
    put("sys/fs/cgroup/job/memory.max", "64000000000\n");
    put("sys/fs/cgroup/job/memory.current", "0\n");
    cr_expect_eq(available().available, 16 * GB);
    cr_expect_str_eq(available().bound_by, "the machine has available");
}

/* v1 (alone or beside a v2 line, as hybrid systems write it): the memory
 * controller's line names the cgroup, and its largest-page "no limit" is
 * none. */
Test(host_memory, v1_memory_controller_line) {
    put("proc/self/cgroup", "5:cpu,cpuacct:/elsewhere\n4:memory:/docker/abc\n0::/\n");
    put("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
    put("sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
    put("sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "3000000000\n");
    put("sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "1000000000\n");
    put("sys/fs/cgroup/memory/docker/abc/memory.stat",
        "cache 300000000\ninactive_file 1\nactive_file 2\ntotal_inactive_file 250000000\n"
        "total_active_file 50000000\n");
    put("sys/fs/cgroup/memory.max", "1\n"); /* a v2 file where v1 is mounted: not read */
    const moe_host_memory m = available();
    cr_expect_eq(m.available, 3 * GB - (1000000000 - 300000000), "the hierarchy's file pages (total_*)");
    cr_expect(strstr(m.bound_by, "/docker/abc"), "%s", m.bound_by);
}

/* Inside a cgroup namespace the path named is not under the mount, whose
 * root is then the process's own cgroup. */
Test(host_memory, namespaced_path_starts_at_the_mount) {
    put("proc/self/cgroup", "0::/../../host/side/path\n");
    put("sys/fs/cgroup/memory.max", "1000000000\n");
    put("sys/fs/cgroup/memory.current", "200000000\n");
    const moe_host_memory m = available();
    cr_expect_eq(m.available, 800000000);
    cr_expect(strstr(m.bound_by, "the memory cgroup / leaves"), "%s", m.bound_by);
}

Test(host_memory, this_machine_says_something) {
    const moe_host_memory m = moe_host_memory_available("");
    cr_expect_gt(m.available, 0, "MemAvailable is in every Linux /proc/meminfo since 3.14");
    cr_expect_neq(m.bound_by[0], '\0');
}
