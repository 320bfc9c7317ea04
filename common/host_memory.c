#define _POSIX_C_SOURCE 200809L /* gethostname */
/* host_memory.c: MemAvailable and the memory cgroup's limits. */
#include "common/host_memory.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define PATH_BYTES 4096

/* v1 writes "no limit" as the largest page-aligned int64; v2 writes "max",
 * which reads as no number. */
#define NO_LIMIT ((int64_t)1 << 62)

/* The first integer in path, or -1 when the file is missing or holds none. */
static int64_t read_number(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int64_t v = -1;
    if (fscanf(f, "%" SCNd64, &v) != 1 || v < 0) v = -1;
    fclose(f);
    return v;
}

/* The value of the line "key value" in path (memory.stat), or -1. */
static int64_t read_keyed(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    const size_t n = strlen(key);
    int64_t v = -1;
    while (v < 0 && fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && line[n] == ' ' && sscanf(line + n, "%" SCNd64, &v) != 1) v = -1;
    fclose(f);
    return v;
}

/* /proc/meminfo's field in bytes ("MemAvailable", "MemTotal"), or -1. */
static int64_t meminfo(const char *root, const char *field) {
    char path[PATH_BYTES], line[128], name[64];
    snprintf(path, sizeof path, "%s/proc/meminfo", root);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long long kb = -1;
    while (kb < 0 && fgets(line, sizeof line, f))
        if (sscanf(line, "%63[^:]: %lld kB", name, &kb) != 2 || strcmp(name, field) != 0) kb = -1;
    fclose(f);
    return kb < 0 ? -1 : (int64_t)kb * 1024;
}

/* The files one cgroup version keeps its limit and usage in, where it is
 * mounted, and memory.stat's keys of the page cache the kernel reclaims
 * before it kills: the file pages, inactive and active alike (a file read
 * twice is active, and still dropped when the cgroup needs the room). */
typedef struct cgroup_files {
    const char *mount, *limit, *usage, *file[2];
} cgroup_files;

static const cgroup_files CGROUP_V2 = {"/sys/fs/cgroup", "memory.max", "memory.current",
                                       {"inactive_file", "active_file"}};
static const cgroup_files CGROUP_V1 = {"/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                                       {"total_inactive_file", "total_active_file"}};

/* This process's cgroup path under the hierarchy that holds the memory
 * controller, from /proc/self/cgroup: v1's "N:...,memory,...:/path" wins
 * over v2's "0::/path", which holds memory only when no v1 line does. */
static const cgroup_files *memory_cgroup(const char *root, char *cg, size_t cg_bytes) {
    char path[PATH_BYTES], line[PATH_BYTES];
    snprintf(path, sizeof path, "%s/proc/self/cgroup", root);
    FILE *f = fopen(path, "r");
    if (!f) return NULL;
    const cgroup_files *found = NULL;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *controllers = strchr(line, ':'), *at = controllers ? strchr(controllers + 1, ':') : NULL;
        if (!at) continue;
        *at++ = '\0';
        controllers++;
        char list[PATH_BYTES + 2];
        snprintf(list, sizeof list, ",%s,", controllers);
        const bool memory = strstr(list, ",memory,") != NULL;
        if (memory || (!*controllers && !found)) {
            snprintf(cg, cg_bytes, "%s", at);
            found = memory ? &CGROUP_V1 : &CGROUP_V2;
            if (memory) break;
        }
    }
    fclose(f);
    return found;
}

/* Walks from this process's cgroup up to the hierarchy's root, taking at
 * each limited level the room left: the limit less the usage the kernel
 * could not reclaim (usage less the file page cache). Inside a cgroup
 * namespace the mount's root is the process's own cgroup and the path that
 * /proc/self/cgroup gives is not found under it: the walk starts at the
 * root then. */
static void cgroup_room(moe_host_memory *m, const char *root) {
    char cg[PATH_BYTES], dir[2 * PATH_BYTES], file[2 * PATH_BYTES + 32];
    const cgroup_files *v = memory_cgroup(root, cg, sizeof cg);
    if (!v) return;
    const int written = snprintf(dir, sizeof dir, "%s%s", root, v->mount);
    if (written < 0 || (size_t)written >= sizeof dir) return;
    const size_t base = (size_t)written;
    struct stat st;
    snprintf(dir + base, sizeof dir - base, "%s", cg);
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) dir[base] = '\0';
    for (;;) {
        size_t len = strlen(dir);
        while (len > base && dir[len - 1] == '/') dir[--len] = '\0';
        snprintf(file, sizeof file, "%s/%s", dir, v->limit);
        const int64_t limit = read_number(file);
        if (limit >= 0 && limit < NO_LIMIT) {
            snprintf(file, sizeof file, "%s/%s", dir, v->usage);
            int64_t used = read_number(file);
            snprintf(file, sizeof file, "%s/memory.stat", dir);
            int64_t cache = 0;
            for (int k = 0; k < 2; k++) {
                const int64_t pages = read_keyed(file, v->file[k]);
                if (pages > 0) cache += pages;
            }
            if (used < 0) used = 0;
            used = cache < used ? used - cache : 0;
            const int64_t room = limit > used ? limit - used : 0;
            const char *name = len > base ? dir + base : "/";
            if (m->available < 0 || room < m->available) {
                m->available = room;
                snprintf(m->bound_by, sizeof m->bound_by, "the memory cgroup %s leaves under its %.2f GB limit",
                         name, (double)limit / 1e9);
            }
            if (m->total < 0 || limit < m->total) {
                m->total = limit;
                snprintf(m->total_by, sizeof m->total_by, "the memory cgroup %s allows", name);
            }
        }
        if (len == base) break;
        *strrchr(dir + base, '/') = '\0';
    }
}

uint64_t moe_host_memory_pool(const moe_host_memory *m) {
    char name[256] = "";
    if (gethostname(name, sizeof name - 1) != 0) name[0] = '\0';
    uint64_t h = 14695981039346656037ull; /* FNV-1a over both, a NUL between */
    const char *parts[] = {name, m->total_by};
    for (int p = 0; p < 2; p++)
        for (const char *c = parts[p];; c++) {
            h = (h ^ (unsigned char)*c) * 1099511628211ull;
            if (!*c) break;
        }
    return h;
}

/* This process's resident pages (statm's second number) in bytes, or -1. */
static int64_t resident(const char *root) {
    char path[PATH_BYTES];
    snprintf(path, sizeof path, "%s/proc/self/statm", root);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int64_t size, pages = -1;
    if (fscanf(f, "%" SCNd64 " %" SCNd64, &size, &pages) != 2 || pages < 0) pages = -1;
    fclose(f);
    const long page = sysconf(_SC_PAGESIZE);
    return pages >= 0 && page > 0 ? pages * page : -1;
}

moe_host_memory moe_host_memory_available(const char *root) {
    moe_host_memory m = {.available = meminfo(root, "MemAvailable"), .total = meminfo(root, "MemTotal"),
                         .resident = resident(root)};
    snprintf(m.bound_by, sizeof m.bound_by, "%s", m.available >= 0 ? "the machine has available" : "");
    snprintf(m.total_by, sizeof m.total_by, "%s", m.total >= 0 ? "the machine has" : "");
    cgroup_room(&m, root);
    return m;
}
