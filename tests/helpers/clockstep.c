/* A test-only LD_PRELOAD shim: the wall clock (CLOCK_REALTIME, gettimeofday) of the
 * process it is loaded into, shifted by the microseconds written in $CLOCKSTEP_FILE
 * (read at every call, so a test steps a running redis-server's clock by rewriting the
 * file). The monotonic clocks are left alone. System calls, not libc or dlsym: these
 * run while the allocator initialises (libfaketime's recursion aborts redis-server). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_us(void) {
    const char *path = getenv("CLOCKSTEP_FILE");
    char buf[32];
    long n;
    int fd;
    if (!path || (fd = (int)syscall(SYS_open, path, O_RDONLY)) < 0) return 0;
    n = syscall(SYS_read, fd, buf, sizeof buf - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return strtoll(buf, NULL, 10);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    long r = syscall(SYS_clock_gettime, id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_us() * 1000LL;
        ts->tv_sec = ns / 1000000000LL;
        ts->tv_nsec = ns % 1000000000LL;
    }
    return (int)r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    clock_gettime(CLOCK_REALTIME, &ts);
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
    return 0;
}

time_t time(time_t *t) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (t) *t = ts.tv_sec;
    return ts.tv_sec;
}
