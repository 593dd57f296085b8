// Pin the threads of the OpenMP team: thread t of a team of n runs only on the cores of row t of
// `sets` (n rows of `width` core numbers, -1 padding). libgomp reuses its pool's threads in the
// same team slots for every later non-nested parallel region started from this thread, so the
// pinning holds for the GEMMs and torch's own parallel loops alike. Returns the number of threads
// pinned (n when every call succeeded).
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>

int pin_team(int64_t n, const int64_t *sets, int64_t width) {
    int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
    {
        int t = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        int any = 0;
        for (int64_t i = 0; i < width; i++) {
            int64_t c = sets[t * width + i];
            if (c >= 0 && c < CPU_SETSIZE) {
                CPU_SET((int)c, &set);
                any = 1;
            }
        }
        pinned += omp_get_num_threads() == n && any && sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return pinned;
}
