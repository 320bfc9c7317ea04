/* host_memory.h: how much host memory this process may still take. */
#ifndef MOE_COMMON_HOST_MEMORY_H
#define MOE_COMMON_HOST_MEMORY_H

#include <stddef.h>
#include <stdint.h>

/* The memory available now and the most there could ever be (bytes, -1
 * when nothing says) and, in words for an error message ("more than the
 * 2.00 GB <bound_by>"), whose bound each is. */
typedef struct moe_host_memory {
    int64_t available;
    char bound_by[160];
    int64_t total;
    char total_by[160];
    int64_t resident; /* this process's resident bytes (proc/self/statm), -1 unknown */
} moe_host_memory;

/* available: the smaller of the kernel's MemAvailable and the room left
 * under the memory limit of every cgroup holding this process (v2's
 * memory.max or v1's memory.limit_in_bytes, each less the usage that
 * cannot be reclaimed); total: the smaller of MemTotal and those limits. A
 * container sees the whole machine's MemAvailable; only its cgroup's limit
 * says when the kernel would kill it. `root` is prepended to /proc and
 * /sys/fs/cgroup: "" for this machine, a folder laid out alike in tests. */
moe_host_memory moe_host_memory_available(const char *root);

/* Which pool of memory m is: a hash of this machine's host name and of
 * what bounds m's total (the machine's, or a cgroup's, by its name).
 * Processes that give the same key take from one pool. */
uint64_t moe_host_memory_pool(const moe_host_memory *m);

#endif /* MOE_COMMON_HOST_MEMORY_H */
