/*
 * Internal helpers shared by every module. Nothing here is exported: the
 * library is built with hidden visibility and only DFLASH_API symbols leave it.
 * Internal names use the df_ prefix.
 */
#ifndef DFLASH_CORE_INTERNAL_H
#define DFLASH_CORE_INTERNAL_H

#include <dflash/dflash.h>

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define DF_PRINTF(fmt_idx, arg_idx) __attribute__((format(printf, fmt_idx, arg_idx)))
#define DF_UNUSED __attribute__((unused))
#define DF_MUST_CHECK __attribute__((warn_unused_result))
#else
#define DF_PRINTF(fmt_idx, arg_idx)
#define DF_UNUSED
#define DF_MUST_CHECK
#endif
/* DF_MUST_CHECK marks a function whose dflash_status must be looked at: the compiler warns
 * (an error under -Werror) where a call drops it. A call whose failure really does not
 * matter says why and uses DF_IGNORE(call) (gcc does not take a (void) cast for it). */
#define DF_IGNORE(call) \
  do {                  \
    if (call) {         \
    }                   \
  } while (0)

#define DF_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- errors (error.c) ---------------------------------------------------- */

/* The df_error family is not DF_MUST_CHECK: it returns its `status` for convenience, and a
 * call for the message alone is fine. */
/* Record a formatted message as this thread's last error and return `status`,
 * so a failing path reads `return df_error(DFLASH_E_FORMAT, "%s: ...", path);` */
dflash_status df_error(dflash_status status, const char *fmt, ...) DF_PRINTF(2, 3);
/* Same, appending ": strerror(errnum)". */
dflash_status df_error_errno(dflash_status status, int errnum, const char *fmt, ...)
    DF_PRINTF(3, 4);
/* Prefix the current last error with more context ("while loading X: ..."). */
dflash_status df_error_wrap(dflash_status status, const char *fmt, ...) DF_PRINTF(2, 3);
/* Shorthand for allocation failures. */
dflash_status df_error_nomem(const char *what);

/* Checked sizes: a NULL/guard argument check that records a message. */
#define DF_CHECK_ARG(cond)                                                                \
  do {                                                                                    \
    if (!(cond))                                                                          \
      return df_error(DFLASH_E_INVALID_ARG, "%s: invalid argument: %s", __func__, #cond); \
  } while (0)

/* ---- versioned structs (opts.c) ----------------------------------------- */

/*
 * Every options and output struct starts with `size_t struct_size`: the size of the
 * caller's struct, i.e. of the header it was built with. One rule for all of them
 * (libbpf's OPTS_VALID): a smaller caller struct is accepted and its missing tail means
 * the defaults; a larger one only when the bytes this library does not know are zero;
 * an output struct is written up to the caller's size and no further.
 */
/* Copy the caller's `src` (NULL: keep the defaults) over `dst`, which holds the defaults at
 * the library's `size`; dst's struct_size stays `size`. `what` names the struct in errors. */
DF_MUST_CHECK dflash_status df_opts_in(void *dst, const void *src, size_t size, const char *what);
/* Write the library's `src` (`size` bytes) into the caller's `dst` up to dst's struct_size,
 * zeroing fields newer than the library's; dst keeps its struct_size. */
DF_MUST_CHECK dflash_status df_opts_out(void *dst, const void *src, size_t size, const char *what);
/* The _init(opts, caller_size) functions: the defaults up to the caller's size. */
void df_opts_fill(void *dst, size_t caller_size, const void *defaults, size_t size);
/* The public `T_init(T *o, size_t size)` of a versioned struct T, written once (libgit2's
 * GIT_INIT_STRUCTURE_FROM_TEMPLATE): `defaults(&d)` fills the library's struct, df_opts_fill
 * copies it up to the caller's size. */
#define DF_DEFINE_INIT(T, defaults)             \
  DFLASH_API void T##_init(T *o, size_t size) { \
    T d_;                                       \
    defaults(&d_);                              \
    df_opts_fill(o, size, &d_, sizeof d_);      \
  }

/* ---- logging (error.c) --------------------------------------------------- */

void df_log(dflash_log_level level, const char *fmt, ...) DF_PRINTF(2, 3);

/* ---- arithmetic ---------------------------------------------------------- */

static inline bool df_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return !__builtin_mul_overflow(a, b, out);
}
static inline bool df_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
  return !__builtin_add_overflow(a, b, out);
}

/* ---- strings and memory (util.c) ----------------------------------------- */

char *df_strdup(const char *s);
char *df_strndup(const char *s, size_t n);
/* malloc'd printf; NULL on failure. */
char *df_asprintf(const char *fmt, ...) DF_PRINTF(1, 2);
/* Join a directory and a file name with one '/'; malloc'd. */
char *df_path_join(const char *dir, const char *name);
/* Directory part of a path ("." when there is none); malloc'd. */
char *df_path_dirname(const char *path);
bool df_str_ends_with(const char *s, const char *suffix);
/* Whether `len` bytes at `s` are valid UTF-8 (no surrogates, no overlongs). */
bool df_utf8_valid(const char *s, size_t len);
/* Code point `cp` as UTF-8 at `o` (room for 4 bytes); the bytes written, 0 for a surrogate
 * or a value above U+10FFFF. Inline: the tokenizer's scanner calls it per code point. */
static inline size_t df_utf8_put(char *o, uint32_t cp) {
  if (cp < 0x80) return o[0] = (char)cp, 1;
  if (cp < 0x800) return o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3F)), 2;
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | (cp >> 6 & 0x3F));
    return o[2] = (char)(0x80 | (cp & 0x3F)), 3;
  }
  if (cp > 0x10FFFF) return 0;
  o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | (cp >> 12 & 0x3F));
  o[2] = (char)(0x80 | (cp >> 6 & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}
/* True when `len` bytes of UTF-8 are certainly unchanged by NFC (every code
 * point a starter that neither decomposes nor composes); false means "run
 * the full normalisation", not "not NFC". */
bool df_utf8_quick_nfc(const char *s, size_t len);

/* A growable byte buffer. Not DF_MUST_CHECK: most calls build a message, where a failed
 * (out of memory) append only shortens it; a caller whose bytes matter checks the status. */
typedef struct df_buf {
  char *data;
  size_t len;
  size_t cap;
} df_buf;
/* NFC of UTF-8 text into out (nfc.c): *changed=false (out untouched) when NFC leaves it as it
 * is; DFLASH_E_UTF8 for a sequence utf8proc cannot read (callers repair first). */
DF_MUST_CHECK dflash_status df_nfc(const char *s, size_t len, df_buf *out, bool *changed);
dflash_status df_buf_reserve(df_buf *b, size_t extra);
dflash_status df_buf_append(df_buf *b, const void *data, size_t n);
dflash_status df_buf_printf(df_buf *b, const char *fmt, ...) DF_PRINTF(2, 3);
void df_buf_free(df_buf *b);

/* ---- durable files (fileio.c) -------------------------------------------- */

/* Read a whole file into a malloc'd, NUL-terminated buffer. */
DF_MUST_CHECK dflash_status df_read_file(const char *path, char **out, size_t *out_len);

/*
 * A file written under a temporary name next to its destination and renamed
 * into place by df_atomic_commit() after fsync of the file and its directory,
 * so a reader sees either the old file or the complete new one, never a
 * partial write, whatever happens to the process.
 */
typedef struct df_atomic_file {
  int fd;
  char *path;     /* final name */
  char *tmp_path; /* where the bytes go until commit */
} df_atomic_file;
DF_MUST_CHECK dflash_status df_atomic_open(const char *path, df_atomic_file *f);
DF_MUST_CHECK dflash_status df_atomic_write(df_atomic_file *f, const void *data, size_t n);
DF_MUST_CHECK dflash_status df_atomic_commit(df_atomic_file *f);
/* Remove the temporary file; safe after commit or on a zeroed struct. */
void df_atomic_abort(df_atomic_file *f);
/* Write all `n` bytes to `fd` (retrying short writes and EINTR). */
DF_MUST_CHECK dflash_status df_write_all(int fd, const void *data, size_t n, const char *path);
/* fsync the directory holding `path`, making a rename or create durable. */
DF_MUST_CHECK dflash_status df_fsync_parent(const char *path);
/* Create a directory and any missing parents (mkdir -p); new levels are
 * fsynced into their parents. DFLASH_E_EXISTS when a level is a file. */
DF_MUST_CHECK dflash_status df_mkdir_p(const char *path);
/* Map a regular file read-only; an empty file gives base NULL and size 0.
 * Release with df_unmap_file. */
DF_MUST_CHECK dflash_status df_map_file(const char *path, const uint8_t **base, uint64_t *size);
void df_unmap_file(const uint8_t *base, uint64_t size);
/* Write a whole file atomically. */
DF_MUST_CHECK dflash_status df_write_file_atomic(const char *path, const void *data, size_t n);

/* ---- JSON (json.c), over jansson ----------------------------------------- */

struct json_t;
/* Parse JSON text; errors name `what` (a file name) with line and column.
 * Rejects duplicate object keys. */
DF_MUST_CHECK dflash_status df_json_parse(const char *text, size_t len, const char *what,
                                          struct json_t **out);
DF_MUST_CHECK dflash_status df_json_load_file(const char *path, struct json_t **out);
/* Serialise compactly (or indented when indent > 0) into a malloc'd string. */
DF_MUST_CHECK dflash_status df_json_dump(const struct json_t *json, int indent, char **out);

/* ---- thread pool (threadpool.c) ------------------------------------------ */

typedef struct df_pool df_pool;
/* n_threads <= 0: one per online CPU. */
DF_MUST_CHECK dflash_status df_pool_create(int n_threads, df_pool **out);
void df_pool_free(df_pool *pool);
int df_pool_size(const df_pool *pool);
/*
 * Run fn(ctx, begin, end, worker) over [0, n) split into chunks of at most
 * `grain` items, on all workers plus the calling thread; returns when every
 * chunk is done. Not reentrant on one pool. A NULL pool runs inline.
 */
typedef void (*df_range_fn)(void *ctx, size_t begin, size_t end, int worker);
void df_pool_for(df_pool *pool, size_t n, size_t grain, df_range_fn fn, void *ctx);

/* ---- the BLAS (blas.c) --------------------------------------------------- */

/* What the CPU's vector units can run, as OpenBLAS's kernel sets need it. */
enum {
  DF_CPU_AVX2 = 1u,  /* AVX2 and FMA: Haswell's kernels */
  DF_CPU_AVX512 = 2u /* AVX-512 F, BW, VL and DQ: SkylakeX's */
};
unsigned df_blas_cpu(void);
/* The OPENBLAS_CORETYPE a CPU with `cpu` runs faster than OpenBLAS's set
 * `core`, or NULL (core fits, or is a name this file does not know). */
const char *df_blas_coretype_for(const char *core, unsigned cpu);
/* One BLAS thread (process-wide; the trainer's pool splits the products) and
 * a warning, once, through the log callback, when its kernels are older than
 * the CPU. */
void df_blas_setup(void);

/* ---- string set (strset.c): ids already seen, up to millions ------------- */

typedef struct df_strset {
  char **slots;
  size_t cap; /* power of two */
  size_t count;
} df_strset;

/* 1 when added, 0 when already present, negative on allocation failure. */
int df_strset_add(df_strset *s, const char *key);
bool df_strset_has(const df_strset *s, const char *key);
void df_strset_free(df_strset *s);

/* ---- hashing (hash.c, OpenSSL libcrypto) --------------------------------- */
void df_sha256(const void *data, size_t len, uint8_t out[32]);
/* Lower-case hex digest, NUL-terminated. */
void df_sha256_hex(const void *data, size_t len, char out[65]);

/* ---- retries (backoff.c) ------------------------------------------------- */
/* Uniform double in [0, 1) from a xorshift64* state (jitter only, not crypto). */
double df_rand01(uint64_t *state);
/* Full-jitter exponential backoff before retry `attempt` (1-based): uniform in
 * [0, min(max_s, base_s * 2^(attempt-1))), raised to the server's Retry-After
 * (capped at retry_after_max_s) when it asked for longer. */
double df_backoff_s(uint64_t *rng, unsigned attempt, double base_s, double max_s,
                    double retry_after_s, double retry_after_max_s);
/* Seconds from a Retry-After value (delta seconds or HTTP date) or a
 * Retry-After-Ms value; -1 when unparseable. */
double df_parse_retry_after(const char *value, bool milliseconds);

/* ---- time ---------------------------------------------------------------- */
double df_now_seconds(void); /* monotonic */

#endif /* DFLASH_CORE_INTERNAL_H */
