/*
 * safetensors files: reading (memory-mapped, zero-copy) and writing
 * (streaming, crash-safe), single files and sharded sets.
 *
 * Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON
 * mapping tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
 * (offsets relative to the byte after the header) plus an optional
 * "__metadata__" object of string values, then the raw little-endian data.
 * A sharded set is a directory with `model.safetensors.index.json`
 * ({"metadata": {...}, "weight_map": {tensor: shard file}}).
 *
 * An opened file or set is immutable and may be shared across threads.
 * Writers are single-owner.
 */
#ifndef DFLASH_SAFETENSORS_H
#define DFLASH_SAFETENSORS_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. Append only. */
typedef enum dflash_dtype {
  DFLASH_DTYPE_F64 = 0,
  DFLASH_DTYPE_F32 = 1,
  DFLASH_DTYPE_F16 = 2,
  DFLASH_DTYPE_BF16 = 3,
  DFLASH_DTYPE_F8_E4M3 = 4,
  DFLASH_DTYPE_F8_E5M2 = 5,
  DFLASH_DTYPE_I64 = 6,
  DFLASH_DTYPE_I32 = 7,
  DFLASH_DTYPE_I16 = 8,
  DFLASH_DTYPE_I8 = 9,
  DFLASH_DTYPE_U8 = 10,
  DFLASH_DTYPE_BOOL = 11,
  DFLASH_DTYPE_U16 = 12,
  DFLASH_DTYPE_U32 = 13,
  DFLASH_DTYPE_U64 = 14
} dflash_dtype;

/* The safetensors spelling ("BF16"); NULL for an unknown value. */
DFLASH_API const char *dflash_dtype_name(dflash_dtype dtype);
/* Bytes per element; 0 for an unknown value. */
DFLASH_API size_t dflash_dtype_size(dflash_dtype dtype);
/* Parse a safetensors dtype name; DFLASH_E_DTYPE when unknown. */
DFLASH_API dflash_status dflash_dtype_from_name(const char *name, dflash_dtype *out);

/* A view of one tensor; every pointer is borrowed from the open file/set. */
typedef struct dflash_tensor {
  size_t struct_size; /* set by the caller: sizeof(dflash_tensor) */
  const char *name;
  int32_t dtype; /* dflash_dtype */
  uint32_t ndim;
  const int64_t *shape; /* ndim entries */
  const void *data;     /* nbytes of mapped file memory, read-only */
  uint64_t nbytes;
  const char *file; /* the file that holds it */
} dflash_tensor;

typedef struct dflash_safetensors dflash_safetensors;

/*
 * Open a .safetensors file, a `*.safetensors.index.json`, or a directory
 * (its index when present, else its single .safetensors file, else every
 * `*.safetensors` in it as one set). Every file is validated before this
 * returns: header size and JSON, dtypes, shapes, offsets (in range, no
 * overlap, no hole), duplicate names across shards, shards named by the
 * index but missing.
 */
DFLASH_API dflash_status dflash_safetensors_open(const char *path, dflash_safetensors **out);
DFLASH_API void dflash_safetensors_free(dflash_safetensors *sf);

/* Number of tensors; tensors are ordered by name. */
DFLASH_API size_t dflash_safetensors_count(const dflash_safetensors *sf);
DFLASH_API dflash_status dflash_safetensors_get(const dflash_safetensors *sf, size_t index,
                                                dflash_tensor *out);
/* DFLASH_E_NOT_FOUND when no tensor has that name. */
DFLASH_API dflash_status dflash_safetensors_find(const dflash_safetensors *sf, const char *name,
                                                 dflash_tensor *out);

/* `__metadata__` entries (of the first file, or the index's "metadata"),
 * ordered by key. */
DFLASH_API size_t dflash_safetensors_metadata_count(const dflash_safetensors *sf);
DFLASH_API dflash_status dflash_safetensors_metadata_get(const dflash_safetensors *sf, size_t index,
                                                         const char **key, const char **value);
/* DFLASH_E_NOT_FOUND when absent. */
DFLASH_API dflash_status dflash_safetensors_metadata_find(const dflash_safetensors *sf,
                                                          const char *key, const char **value);
/* Number of files in the set (1 for a single file). */
DFLASH_API size_t dflash_safetensors_file_count(const dflash_safetensors *sf);

/*
 * Streaming writer. Declare every tensor first (name, dtype, shape), then
 * stream their bytes in declaration order with dflash_safetensors_writer_write (any
 * chunking), then dflash_safetensors_writer_commit. Bytes go to `<path>.tmp.<pid>`;
 * commit checks every declared byte arrived, fsyncs and renames onto `path`.
 * Freeing an uncommitted writer removes the temporary file, so a reader never
 * sees a partial file.
 */
typedef struct dflash_safetensors_writer dflash_safetensors_writer;

DFLASH_API dflash_status dflash_safetensors_writer_create(const char *path,
                                                          dflash_safetensors_writer **out);
/* Add a `__metadata__` string entry (before the first write). */
DFLASH_API dflash_status dflash_safetensors_writer_metadata(dflash_safetensors_writer *w,
                                                            const char *key, const char *value);
/* Declare a tensor (before the first write). Names must be unique. */
DFLASH_API dflash_status dflash_safetensors_writer_declare(dflash_safetensors_writer *w,
                                                           const char *name, dflash_dtype dtype,
                                                           uint32_t ndim, const int64_t *shape);
/* Stream `n` bytes of tensor data; more than declared is DFLASH_E_RANGE. */
DFLASH_API dflash_status dflash_safetensors_writer_write(dflash_safetensors_writer *w,
                                                         const void *data, size_t n);
DFLASH_API dflash_status dflash_safetensors_writer_commit(dflash_safetensors_writer *w);
DFLASH_API void dflash_safetensors_writer_free(dflash_safetensors_writer *w);

/*
 * Write `model.safetensors.index.json`-style index `path` for shards already
 * written: for every shard file (paths relative to the index's directory),
 * its tensors go into "weight_map"; "metadata" gets "total_size" (sum of
 * tensor bytes) plus the given string pairs (`n_meta` keys and values).
 * Written atomically.
 */
DFLASH_API dflash_status dflash_safetensors_write_index(const char *path, size_t n_shards,
                                                        const char *const *shard_files,
                                                        size_t n_meta, const char *const *meta_keys,
                                                        const char *const *meta_values);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_SAFETENSORS_H */
