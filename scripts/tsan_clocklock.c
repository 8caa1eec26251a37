/* For ThreadSanitizer runs only (docs/development.md, "Sanitizers"). GCC 12's libtsan
   intercepts pthread_mutex_timedlock but not pthread_mutex_clocklock, which libstdc++'s
   timed mutexes call (RunningLock::try_lock_for): TSan then misses those acquisitions
   and reports races and foreign unlocks that are not there. Preloaded after libtsan,
   this turns each clocklock into a timedlock, which TSan sees. */
#define _GNU_SOURCE
#include <pthread.h>
#include <time.h>
int pthread_mutex_clocklock(pthread_mutex_t *m, clockid_t clock, const struct timespec *at) {
  struct timespec on_clock, real, deadline;
  clock_gettime(clock, &on_clock);
  clock_gettime(CLOCK_REALTIME, &real);
  long long ns = (long long)(at->tv_sec - on_clock.tv_sec) * 1000000000LL +
                 (at->tv_nsec - on_clock.tv_nsec) + real.tv_sec * 1000000000LL + real.tv_nsec;
  deadline.tv_sec = ns / 1000000000LL;
  deadline.tv_nsec = ns % 1000000000LL;
  return pthread_mutex_timedlock(m, &deadline);
}
