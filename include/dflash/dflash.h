/*
 * libdflash: data and training pipeline for DFlash block-diffusion drafters.
 *
 * This is the base header: version, status codes, error detail, logging.
 * Module headers (safetensors.h, tokenizer.h, ...) include it; libdflash.h
 * includes every stable header at once.
 *
 * Thread safety
 * -------------
 * Every function may be called from any thread. Objects follow two rules:
 *  - read-only objects once loaded (tokenizers, opened safetensors files) are
 *    immutable and may be shared by any number of threads without locking;
 *  - everything else (writers, fetchers, trainers) has a single owner: calls
 *    on one such object must not overlap; different objects are independent.
 * dflash_last_error() is per thread. The log callback is process-wide; set it
 * before starting other threads that use the library.
 *
 * Ownership
 * ---------
 * Objects returned through `T **out` belong to the caller and are released
 * with the matching dflash_T_free(), which accepts NULL. Pointers returned by
 * getters (names, shapes, tensor data) are borrowed from the object they came
 * from and stay valid until that object is freed. Bulk outputs are written to
 * buffers the caller provides; a buffer that is too small yields
 * DFLASH_E_BUFFER and the required size through the size out-parameter.
 *
 * Writers
 * -------
 * Every writer (dflash_dataset_writer, dflash_hidden_writer, dflash_safetensors_writer,
 * dflash_storage_writer, dflash_chunk_writer) has one life cycle: create or open, then add
 * (records, samples) or write (bytes), then commit, then free. Free without commit discards
 * what was not committed (a temporary file removed, an upload aborted, buffered records
 * dropped); free after commit only releases memory.
 *
 * Versioned structs
 * -----------------
 * Options and output structs carry their size in the first field, struct_size,
 * so fields can be appended without breaking the ABI. Fill options with the
 * module's dflash_X_options_default(&opts), a macro that passes sizeof opts to
 * dflash_X_options_init(). One rule for every struct (libbpf's): a caller's
 * smaller struct (built against an older header) is accepted and its missing
 * tail means the defaults; a larger one only if the bytes this library does not
 * know are zero (else DFLASH_E_UNSUPPORTED); an output struct, and the defaults,
 * are written up to the caller's struct_size and no further.
 */
#ifndef DFLASH_DFLASH_H
#define DFLASH_DFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(DFLASH_BUILDING)
#define DFLASH_API __declspec(dllexport)
#elif defined(__GNUC__) && defined(DFLASH_BUILDING)
#define DFLASH_API __attribute__((visibility("default")))
#else
#define DFLASH_API
#endif

/*
 * DFLASH_DEPRECATED("use dflash_x instead") marks a declaration that stays in the ABI but is
 * going away: the caller's compiler warns with the message (HACKING.md, "Deprecation", says
 * when a call may be marked and when it may go). Users who cannot move yet define
 * DFLASH_NO_DEPRECATION_WARNINGS before including a libdflash header.
 */
#if defined(DFLASH_BUILDING) || defined(DFLASH_NO_DEPRECATION_WARNINGS)
#define DFLASH_DEPRECATED(msg)
#elif defined(__GNUC__) || defined(__clang__)
#define DFLASH_DEPRECATED(msg) __attribute__((deprecated(msg)))
#elif defined(_MSC_VER)
#define DFLASH_DEPRECATED(msg) __declspec(deprecated(msg))
#else
#define DFLASH_DEPRECATED(msg)
#endif

#define DFLASH_VERSION_MAJOR 0
#define DFLASH_VERSION_MINOR 1
#define DFLASH_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, comparable with dflash_version_number(). */
#define DFLASH_VERSION_NUMBER \
  (DFLASH_VERSION_MAJOR * 10000 + DFLASH_VERSION_MINOR * 100 + DFLASH_VERSION_PATCH)
#define DFLASH_VERSION_STRING "0.1.0"

/*
 * Status codes. Append only: never renumber or remove a code, so values stay
 * meaningful across library versions (as curl does with CURLcode).
 */
typedef enum dflash_status {
  DFLASH_OK = 0,
  DFLASH_E_INVALID_ARG = 1,  /* a NULL or out-of-range argument from the caller */
  DFLASH_E_NOMEM = 2,        /* allocation failed */
  DFLASH_E_IO = 3,           /* open/read/write/fsync/rename/mmap failed */
  DFLASH_E_FORMAT = 4,       /* malformed input file or record */
  DFLASH_E_TRUNCATED = 5,    /* input ends before its declared size */
  DFLASH_E_RANGE = 6,        /* an offset, index or id outside its valid range */
  DFLASH_E_OVERFLOW = 7,     /* a size computation would overflow */
  DFLASH_E_DTYPE = 8,        /* unknown or unexpected element type */
  DFLASH_E_UTF8 = 9,         /* invalid UTF-8 */
  DFLASH_E_DUPLICATE = 10,   /* a key, name or id appears twice */
  DFLASH_E_NOT_FOUND = 11,   /* a named file, tensor, token or id does not exist */
  DFLASH_E_JSON = 12,        /* JSON that does not parse */
  DFLASH_E_BUFFER = 13,      /* caller buffer too small; required size returned */
  DFLASH_E_UNSUPPORTED = 14, /* valid input that this build does not handle */
  DFLASH_E_STATE = 15,       /* call not valid in the object's current state */
  DFLASH_E_CONFIG = 16,      /* inconsistent configuration */
  DFLASH_E_MISMATCH = 17,    /* two inputs that must agree do not */
  DFLASH_E_REGEX = 18,       /* a regular expression failed to compile or match */
  DFLASH_E_TEMPLATE = 19,    /* chat rendering failed */
  DFLASH_E_HTTP = 20,        /* an HTTP error response */
  DFLASH_E_NETWORK = 21,     /* connection, DNS, TLS or transfer failure */
  DFLASH_E_TIMEOUT = 22,     /* a deadline passed */
  DFLASH_E_CANCELLED = 23,   /* stopped on request */
  DFLASH_E_CUDA = 24,        /* a CUDA, cuBLAS or NCCL call failed */
  DFLASH_E_NO_DEVICE = 25,   /* no CUDA device or driver */
  DFLASH_E_INTERNAL = 26,    /* a bug in libdflash; please report */
  DFLASH_E_AUTH = 27,        /* missing or rejected credentials */
  DFLASH_E_EXISTS = 28       /* refusing to overwrite something that exists */
} dflash_status;

/* Runtime version: MAJOR*10000 + MINOR*100 + PATCH. */
DFLASH_API int dflash_version_number(void);
/* Runtime version as "MAJOR.MINOR.PATCH"; static storage. */
DFLASH_API const char *dflash_version_string(void);

/* Name of a status code ("DFLASH_E_IO"); static storage, never NULL. */
DFLASH_API const char *dflash_status_str(dflash_status status);

/*
 * The message that goes with the last failing call on this thread: what
 * failed and where (file, tensor, line of input, HTTP status...). Never NULL;
 * "" when nothing failed yet. Valid until the next libdflash call on this
 * thread.
 */
DFLASH_API const char *dflash_last_error(void);
/* Forget this thread's last error. */
DFLASH_API void dflash_clear_error(void);

typedef enum dflash_log_level {
  DFLASH_LOG_ERROR = 0,
  DFLASH_LOG_WARN = 1,
  DFLASH_LOG_INFO = 2,
  DFLASH_LOG_DEBUG = 3
} dflash_log_level;

typedef void (*dflash_log_fn)(dflash_log_level level, const char *message, void *user);

/*
 * Route library log messages to `fn` (NULL: discard, the default; the
 * library never prints on its own). Messages above `max_level` are dropped
 * before they are formatted.
 */
DFLASH_API void dflash_set_log_callback(dflash_log_fn fn, void *user, dflash_log_level max_level);

/*
 * Number of CUDA devices this process can use. DFLASH_E_NO_DEVICE (with the
 * driver's reason) when there is no device or driver, DFLASH_E_UNSUPPORTED
 * when the library was built without CUDA. The first CUDA call loads the CUDA
 * backend module (libdflash-cuda.so beside the library, or $DFLASH_CUDA_MODULE);
 * without it or its CUDA libraries, DFLASH_E_NO_DEVICE naming what is missing.
 */
DFLASH_API dflash_status dflash_cuda_device_count(int32_t *count);

/*
 * The kernel set the BLAS (OpenBLAS) chose when it was loaded, in OpenBLAS's
 * words ("SkylakeX", "Zen", "Prescott"); static storage, never NULL.
 */
DFLASH_API const char *dflash_blas_corename(void);
/*
 * The OPENBLAS_CORETYPE this CPU runs the trainer's matrix products faster
 * with: "SkylakeX" (AVX-512 F, BW, VL and DQ) or "Haswell" (AVX2 and FMA),
 * when OpenBLAS fell back to an older kernel set, as Debian 12's 0.3.21 does
 * on CPUs newer than its table; NULL when its kernels fit the CPU. OpenBLAS
 * reads the variable only when it is loaded: set it before the process starts
 * (`dflash train` and `dflash eval` re-execute themselves with it). Creating a
 * trainer logs this advice once as a warning.
 */
DFLASH_API const char *dflash_blas_coretype_advice(void);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_DFLASH_H */
