/*
 * Staging between s3:// "directories" and local ones, for the pipeline stages
 * whose file formats are written or memory-mapped locally (dataset shards,
 * checkpoints, training state). Internal to the library; every module may use
 * it. Outputs: write into a local temporary directory, then upload file by
 * file (the file that makes a directory usable last). Inputs: mirror the
 * objects under a prefix into the cache directory and open them there.
 *
 * Cache directory: $DFLASH_CACHE_DIR, else $TMPDIR/dflash-cache-<uid>, else
 * /tmp/dflash-cache-<uid>. A remote object s3://B/K is cached at
 * <cache>/s3/B/K; a cached file whose size equals the object's is reused (the
 * formats staged this way are written once and never changed in place).
 */
#ifndef DFLASH_STORAGE_STAGE_H
#define DFLASH_STORAGE_STAGE_H

#include <dflash/storage.h>

#include "core/internal.h"

/* The cache directory (malloc'd, not created). */
char *df_cache_dir(void);

/* Where the remote location `remote` is mirrored in the cache (malloc'd):
 * <cache>/s3/<bucket>/<key without trailing '/'>. */
DF_MUST_CHECK dflash_status df_stage_cache_path(const char *remote, char **out);

/* `dir` + '/' + `name`, for a local path or an s3:// prefix (one '/' between). */
char *df_stage_join(const char *dir, const char *name);

/* Mirror every object below the remote "directory" `remote` (a '/' is added
 * when missing) into `local_dir`, keeping the relative names; files already
 * there with the object's size are not fetched again. *n_files (may be NULL)
 * gets the number of objects found; an empty prefix is DFLASH_E_NOT_FOUND
 * naming the URL. */
DF_MUST_CHECK dflash_status df_stage_in(dflash_storage *st, const char *remote,
                                        const char *local_dir, size_t *n_files);

/* Same into the cache: *local (malloc'd) is the mirrored directory. */
DF_MUST_CHECK dflash_status df_stage_in_cached(dflash_storage *st, const char *remote,
                                               char **local);

/* Upload local_dir/name to remote/name (atomically: multipart when large). */
DF_MUST_CHECK dflash_status df_stage_out(dflash_storage *st, const char *local_dir,
                                         const char *remote, const char *name);

/* A new empty local directory under the cache directory for staging an
 * output; `tag` goes into its name. */
DF_MUST_CHECK dflash_status df_stage_tmpdir(const char *tag, char **out);

/* Remove a local directory tree (best effort; used on staging directories). */
void df_stage_rmtree(const char *dir);


/* A local stand-in for the remote safetensors object `remote` of `size`
 * bytes: its header, then a hole up to the object's size (a sparse file, so
 * it costs the header's blocks). Readers of the header (listings of tensors,
 * indexes) work on it; tensor bytes read as zeros. Written atomically. */
DF_MUST_CHECK dflash_status df_stage_st_stub(dflash_storage *st, const char *remote, uint64_t size,
                                             const char *local);

/* Give back the data blocks of the local safetensors file `path`, keeping
 * its header and size (after its bytes were uploaded). Best effort: where
 * the file system cannot punch holes the file stays whole. */
void df_stage_st_hollow(const char *path);

/* A memory buffer that whole objects are read into, one after another (the spool consumer's
 * S3 shards): it grows when an object does not fit and is otherwise reused, so that a stream
 * of shards costs no allocation, no page faults after the first and no local file. */
typedef struct df_stage_buf {
  uint8_t *data;
  size_t len; /* the last object's bytes */
  size_t cap;
} df_stage_buf;

/* Read the object `location` of `size` bytes (from a listing or stat) whole into b: one GET of
 * its bytes straight into b->data. An object of another size (changed since, or cut short) is
 * DFLASH_E_TRUNCATED / DFLASH_E_MISMATCH naming it; a missing one DFLASH_E_NOT_FOUND. */
dflash_status df_stage_read_object(dflash_storage *st, const char *location, uint64_t size,
                                   df_stage_buf *b);
/* Only the safetensors header of the object `location` of `size` bytes, into b at offset 0
 * (two ranged GETs: its length, then the header); b->len is `size`, the bytes after the header
 * are not read (a caller fetches the tensors it needs with dflash_storage_read_range at their
 * offsets, e.g. the spool's ranks, each for its samples). */
DF_MUST_CHECK dflash_status df_stage_read_header(dflash_storage *st, const char *location,
                                                 uint64_t size, df_stage_buf *b);
void df_stage_buf_free(df_stage_buf *b);

/* A safetensors object whole in memory: an s3:// object read into `b` by
 * df_stage_read_object (no local file), a local one mapped; validated by the same df_st_parse
 * as dflash_safetensors_open. Tensor views have `data` set, into b or the mapping: they are
 * valid until df_stage_st_free and, for s3://, the next read into b. `size` is the object's
 * (from a stat or listing). */
typedef struct df_stage_st df_stage_st;
dflash_status df_stage_st_load(dflash_storage *st, const char *location, uint64_t size,
                               df_stage_buf *b, df_stage_st **out);
/* The same over the bytes already in `b` (read by df_stage_read_object, e.g. ahead of time). */
dflash_status df_stage_st_parse(const char *location, const df_stage_buf *b, df_stage_st **out);
void df_stage_st_free(df_stage_st *f);
size_t df_stage_st_count(const df_stage_st *f);
/* Tensor `index` in file order (ascending data offsets). */
dflash_status df_stage_st_get(const df_stage_st *f, size_t index, dflash_tensor *out);
/* DFLASH_E_NOT_FOUND, with no message set, when there is no tensor `name`. */
dflash_status df_stage_st_find(const df_stage_st *f, const char *name, dflash_tensor *out);
/* `__metadata__` value (borrowed); DFLASH_E_NOT_FOUND, with no message, when absent. */
dflash_status df_stage_st_metadata_find(const df_stage_st *f, const char *key, const char **value);

/* mkdir -p `dir`. */
DF_MUST_CHECK dflash_status df_stage_mkdirs(const char *dir);

#endif
