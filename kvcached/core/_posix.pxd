# The POSIX declarations of the compiled core, declared once for every module of kvcached.core.
# Declarations only (no module is built from this file), plus the one monotonic clock helper.

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_trylock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_condattr_init(pthread_condattr_t*)
    int pthread_condattr_setclock(pthread_condattr_t*, int)
    int pthread_condattr_destroy(pthread_condattr_t*)
    int pthread_cond_init(pthread_cond_t*, pthread_condattr_t*)
    int pthread_cond_destroy(pthread_cond_t*)
    int pthread_cond_signal(pthread_cond_t*)
    int pthread_cond_broadcast(pthread_cond_t*)
    int pthread_cond_wait(pthread_cond_t*, pthread_mutex_t*)
    int pthread_cond_timedwait(pthread_cond_t*, pthread_mutex_t*, const void*)
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

cdef extern from "<time.h>" nogil:
    cdef struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int, timespec*)
    int CLOCK_MONOTONIC

cdef extern from "<unistd.h>" nogil:
    int getpid()
    int usleep(unsigned int usec)
    int ftruncate(int fd, long length)
    int close(int fd)

cdef extern from "<errno.h>" nogil:
    int errno
    int ENOMEM, ENOSPC, EIO

cdef extern from "<sys/mman.h>" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int mprotect(void* addr, size_t length, int prot)
    int memfd_create(const char* name, unsigned int flags)
    void* MAP_FAILED
    int PROT_NONE, PROT_READ, PROT_WRITE
    int MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE
    unsigned int MFD_CLOEXEC

cdef extern from "<fcntl.h>" nogil:
    int fallocate(int fd, int mode, long offset, long length)

cdef extern from "<linux/falloc.h>" nogil:
    int FALLOC_FL_PUNCH_HOLE, FALLOC_FL_KEEP_SIZE


cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    int sem_init(sem_t*, int pshared, unsigned int value)
    int sem_destroy(sem_t*)
    int sem_post(sem_t*)
    int sem_trywait(sem_t*)
    int sem_clockwait(sem_t*, int clock, const timespec* abstime)

cdef extern from "<errno.h>" nogil:
    int EINTR, ETIMEDOUT, EAGAIN

cdef extern from "<sys/stat.h>" nogil:
    cdef struct stat:
        long st_size
    int fstat(int fd, stat* buf)


cdef inline double _now() noexcept nogil:
    """Monotonic seconds (CLOCK_MONOTONIC): the refill policy's clock and the benchmark hooks'."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9
