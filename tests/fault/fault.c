/* The wrapped functions of fault.h: ld's --wrap=F sends the library's calls of F to
 * __wrap_F, and __real_F is the real one. */
#include "fault.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
char *__real_strdup(const char *s);
char *__real_strndup(const char *s, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
ssize_t __real_write(int fd, const void *buf, size_t n);
int __real_rename(const char *from, const char *to);

void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
char *__wrap_strdup(const char *s);
char *__wrap_strndup(const char *s, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);
int __wrap_posix_memalign(void **p, size_t align, size_t n);
ssize_t __wrap_write(int fd, const void *buf, size_t n);
int __wrap_fsync(int fd);
int __wrap_fdatasync(int fd);
int __wrap_rename(const char *from, const char *to);

/* Shared by every thread of the code under test (the pools allocate too): atomics. */
static int g_active;
static int g_kind;
static uint64_t g_fail_at;
static uint64_t g_count[FAULT_KINDS];
static int g_fired;

/* Counts the call; true when it is the one to fail. */
static bool hit(fault_kind kind) {
  if (!__atomic_load_n(&g_active, __ATOMIC_ACQUIRE)) return false;
  uint64_t n = __atomic_add_fetch(&g_count[kind], 1, __ATOMIC_ACQ_REL);
  if ((int)kind != g_kind || n != g_fail_at) return false;
  __atomic_store_n(&g_fired, 1, __ATOMIC_RELEASE);
  return true;
}

static void *fail_alloc(void) {
  errno = ENOMEM;
  return NULL;
}

void *__wrap_malloc(size_t n) { return hit(FAULT_ALLOC) ? fail_alloc() : __real_malloc(n); }
void *__wrap_calloc(size_t n, size_t size) {
  return hit(FAULT_ALLOC) ? fail_alloc() : __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n) {
  return hit(FAULT_ALLOC) ? fail_alloc() : __real_realloc(p, n);
}
char *__wrap_strdup(const char *s) { return hit(FAULT_ALLOC) ? fail_alloc() : __real_strdup(s); }
char *__wrap_strndup(const char *s, size_t n) {
  return hit(FAULT_ALLOC) ? fail_alloc() : __real_strndup(s, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n) {
  return hit(FAULT_ALLOC) ? fail_alloc() : __real_aligned_alloc(align, n);
}
int __wrap_posix_memalign(void **p, size_t align, size_t n) {
  return hit(FAULT_ALLOC) ? ENOMEM : __real_posix_memalign(p, align, n);
}

/* Only writes to regular files: a wake-up pipe or a socket failing is another story. */
ssize_t __wrap_write(int fd, const void *buf, size_t n) {
  struct stat sb;
  if (fstat(fd, &sb) == 0 && S_ISREG(sb.st_mode) && hit(FAULT_WRITE)) {
    errno = ENOSPC;
    return -1;
  }
  return __real_write(fd, buf, n);
}
/* A successful fsync does nothing here: the loop tests what a failure leaves, not
 * durability, and thousands of real ones would take most of its time. */
int __wrap_fsync(int fd) {
  (void)fd;
  if (hit(FAULT_FSYNC)) return errno = EIO, -1;
  return 0;
}
int __wrap_fdatasync(int fd) {
  (void)fd;
  if (hit(FAULT_FSYNC)) return errno = EIO, -1;
  return 0;
}
int __wrap_rename(const char *from, const char *to) {
  if (hit(FAULT_RENAME)) return errno = EIO, -1;
  return __real_rename(from, to);
}

/* Inside jansson's parser and serialiser its allocations are neither failed nor counted:
 * jansson 2.14 reports a failed copy of a string while parsing as a syntax error ("string
 * or '}' expected"), which no caller can tell from a malformed input, and its json_dumps
 * ignores a failed append of an object key (dump.c: dump_string's result) and returns
 * `"":value` as if it had succeeded. The values the library builds and reads are failed. */
static __thread int t_in_codec;

#define CODEC_WRAP(ret, name, params, args) \
  ret __real_##name params;                 \
  ret __wrap_##name params;                 \
  ret __wrap_##name params {                \
    t_in_codec++;                           \
    ret r = __real_##name args;             \
    t_in_codec--;                           \
    return r;                               \
  }
CODEC_WRAP(char *, json_dumps, (const json_t *json, size_t flags), (json, flags))
CODEC_WRAP(json_t *, json_loadb, (const char *b, size_t n, size_t flags, json_error_t *e),
           (b, n, flags, e))
CODEC_WRAP(json_t *, json_loads, (const char *s, size_t flags, json_error_t *e), (s, flags, e))
CODEC_WRAP(json_t *, json_load_file, (const char *p, size_t flags, json_error_t *e), (p, flags, e))

static void *json_alloc(size_t n) {
  if (t_in_codec) return __real_malloc(n);
  return __wrap_malloc(n);
}

void fault_init(void) { json_set_alloc_funcs(json_alloc, free); }

void fault_start(fault_kind kind, uint64_t n) {
  fault_stop();
  for (int k = 0; k < FAULT_KINDS; k++) __atomic_store_n(&g_count[k], 0, __ATOMIC_RELAXED);
  g_kind = (int)kind;
  g_fail_at = n;
  __atomic_store_n(&g_fired, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&g_active, 1, __ATOMIC_RELEASE);
}

void fault_stop(void) { __atomic_store_n(&g_active, 0, __ATOMIC_RELEASE); }

uint64_t fault_count(fault_kind kind) { return __atomic_load_n(&g_count[kind], __ATOMIC_ACQUIRE); }

bool fault_fired(void) { return __atomic_load_n(&g_fired, __ATOMIC_ACQUIRE); }

const char *fault_kind_name(fault_kind kind) {
  static const char *const names[] = {"alloc", "write", "fsync", "rename"};
  return names[kind];
}
