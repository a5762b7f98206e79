/* Internals of the hidden-state store and the training-sample stream. */
#ifndef DFLASH_HIDDEN_INTERNAL_H
#define DFLASH_HIDDEN_INTERNAL_H

#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/safetensors.h>

#include "core/internal.h"

#define DF_HIDDEN_FORMAT "dflash-hidden-1"
#define DF_HIDDEN_INDEX "hidden.safetensors.index.json"
#define DF_HIDDEN_MAX_ID 1024
/* The metadata key and value of a store whose samples carry the target's final state after
 * its final norm ("f/<id>", and for fp8 "fs/<id>"). */
#define DF_HIDDEN_FINAL_KEY "final_state"
#define DF_HIDDEN_FINAL_POST_NORM "post_norm"

const char *df_hidden_dtype_name(int32_t dtype);

/* The first of K layers that is all zeros in a sample [len, K*H] given as f32 or bf16 (one of
 * them), or -1 (sanity.c). */
int32_t df_hidden_zero_layer(const float *f32, const uint16_t *bf16, int64_t len, int32_t K,
                             int32_t H);
/* DFLASH_E_FORMAT naming the sample and the layer when one of its K layers is all zeros. */
DF_MUST_CHECK dflash_status df_hidden_check_sample(const char *id, const float *x, int64_t len,
                                                   int32_t K, int32_t H);


typedef struct pending {
  char *id;
  int64_t len;
  void *data;     /* bf16 or e4m3 codes */
  float *scales;  /* fp8 only: [len, K] */
  int32_t *tids;  /* the target's greedy tokens [len], or NULL */
  void *fdata;    /* final_state stores: the target's post-norm final state [len, H], codes */
  float *fscales; /* fp8 only: [len, 1] */
} pending;

struct dflash_storage;

/* What a store says its rows are (record.c; dflash_hidden_writer_options): n_layer_ids 0 and
 * tokenizer_hash NULL when it does not say. */
typedef struct df_hidden_record {
  int32_t n_layer_ids;
  int32_t *layer_ids;
  char *tokenizer_hash;
} df_hidden_record;

void df_hidden_record_free(df_hidden_record *r);
/* The writer options' record for a store of K layers, validated (DFLASH_E_INVALID_ARG). */
DF_MUST_CHECK dflash_status df_hidden_record_from_options(const dflash_hidden_writer_options *o,
                                                          int32_t K, df_hidden_record *out);
/* Into a shard's metadata ("target_layer_ids": "1,9,17", "tokenizer_hash"). */
DF_MUST_CHECK dflash_status df_hidden_record_write(const df_hidden_record *r,
                                                   dflash_safetensors_writer *sw);
/* From metadata values (NULL: absent) of a store of K layers; DFLASH_E_FORMAT naming `dir`. */
DF_MUST_CHECK dflash_status df_hidden_record_parse(const char *ids, const char *hash, int32_t K,
                                                   const char *dir, df_hidden_record *out);
/* "1,9,17" into buf (cap bytes): false when it does not fit. */
bool df_hidden_record_ids_csv(const df_hidden_record *r, char *buf, size_t cap);
/* "1, 9, 17" into buf (cap bytes), or "(not recorded)". */
void df_hidden_record_ids_text(const df_hidden_record *r, char *buf, size_t cap);
/* The record an open store carries (reader.c; vLLM's files: none). */
const df_hidden_record *df_hidden_record_of(const dflash_hidden *h);

struct dflash_hidden_writer {
  char *dir;    /* local directory: for an s3:// store, its mirror in the cache */
  char *remote; /* s3:// store: shards and index uploaded as they are written */
  struct dflash_storage *storage;
  int32_t K, H, dtype;
  bool final; /* every sample carries the target's post-norm final state (final_state) */
  uint64_t shard_bytes;
  df_strset ids;
  pending *buf;
  size_t n_buf, cap_buf;
  uint64_t buf_bytes;
  char **shards; /* file names, relative to dir */
  size_t n_shards;
  uint64_t zero_layer_samples; /* appended with an all-zero layer: training refuses them */
  bool finished;
  /* spool mode (spool.c): `dir` (or `remote`) is the spool */
  bool spool;
  uint64_t budget;
  double wait_s;
  int32_t epoch;          /* current epoch */
  uint64_t seq;           /* its next shard */
  uint64_t epoch_samples; /* ids taken in it */
  uint64_t present, high_water;
  df_hidden_record rec; /* written into every shard's metadata */
};

/* Write the writer's buffered samples as one safetensors shard at `path` (writer.c). */
DF_MUST_CHECK dflash_status df_hidden_write_shard(const dflash_hidden_writer *w, const char *path);
void df_hidden_writer_drop_buffer(dflash_hidden_writer *w);
/* Decode K layers of H values per token from bf16 or scaled e4m3 codes (reader.c). */
void df_hidden_decode(int32_t K, int32_t H, int32_t dtype, const void *codes, const void *scales,
                      float *out, int64_t len);

/* A sample's rows as stored (no decoding): codes [len, K*H] (bf16: 2 bytes each, fp8: 1)
 * and, for fp8, scales [len, K]. DFLASH_E_UNSUPPORTED for a vLLM store (reader.c). */
DF_MUST_CHECK dflash_status df_hidden_read_codes(const dflash_hidden *h, const char *sample_id,
                                                 int64_t len, void *codes, float *scales);
bool df_hidden_has_codes(const dflash_hidden *h);
/* df_hidden_check_sample on stored rows (bf16, or e4m3 codes with scales [len, K]). */
DF_MUST_CHECK dflash_status df_hidden_check_codes(const char *id, int32_t dtype, const void *codes,
                                                  const float *scales, int64_t len, int32_t K,
                                                  int32_t H);

/* Spool mode of the writer (spool.c): create (opts->spool_budget set), publish the buffered
 * samples as a shard (waiting up to wait_s, < 0 forever, for room), and the end marker. */
DF_MUST_CHECK dflash_status df_spool_writer_create(const char *dir, int32_t K, int32_t H,
                                                   const dflash_hidden_writer_options *o,
                                                   dflash_hidden_writer **out);
DF_MUST_CHECK dflash_status df_spool_publish(dflash_hidden_writer *w, double wait_s);
/* Whether dflash_spool_next decodes a spool's final state into dflash_sample.target_final (on
 * from open; a DFlash run turns it off, as df_sample_stream_set_final). The shards' final-state
 * tensors are checked either way. */
void df_spool_set_final(dflash_spool *sp, bool on);
/* Whether dflash_spool_next would return without waiting (a failed look counts as ready). */
bool df_spool_ready(dflash_spool *sp);
/* Bytes of the shards this consumer opened before (epoch, shard) and has not released (no
 * request), and the producer's budget (0: unknown; read after each release and while unknown). */
DF_MUST_CHECK dflash_status df_spool_pressure(dflash_spool *sp, int32_t epoch, uint64_t shard,
                                              uint64_t *used, uint64_t *budget);
/* The consumer's own accounting of a release another process (rank 0) made. */
void df_spool_forget(dflash_spool *sp, int32_t epoch, uint64_t shard);
/* dflash_spool_next without the sample's data (not read, decoded or checked): its id and
 * length, for a training process that leaves it to another rank. */
DF_MUST_CHECK dflash_status df_spool_pass(dflash_spool *sp, dflash_sample *out,
                                          int32_t *end_of_epoch);
/* Several consumers of one spool, each this one's share (the ranks of a training run): the
 * usable sample k of an epoch (counted from 0, in the producer's order) is this consumer's when
 * k mod global_batch is in [lo, hi). On S3 it then reads each shard's header and only its
 * samples' bytes (the next shard's on a thread), and any other sample when it is asked for;
 * `usable` must be thread-safe. Without it every shard is read whole. */
typedef bool (*df_spool_usable_fn)(void *ctx, const char *id);
void df_spool_share(dflash_spool *sp, df_spool_usable_fn usable, void *ctx, uint64_t global_batch,
                    uint64_t lo, uint64_t hi);
/* dflash_spool_seek, with the number of usable samples of the epoch before the position (for
 * df_spool_share; dflash_spool_seek's is unknown: the shard's samples are then read when
 * asked for). */
DF_MUST_CHECK dflash_status df_spool_seek_k(dflash_spool *sp, int32_t epoch, uint64_t shard,
                                            uint64_t offset, uint64_t k);
/* A sample's place in the spool (dflash_spool_seek's arguments). */
typedef struct df_spool_pos {
  int32_t epoch;
  uint64_t shard, offset;
} df_spool_pos;

/* A store on object storage, read with ranged GETs (remote_store.c). Tensor
 * views have data == NULL; df_rhidden_read fetches their bytes (thread-safe). */
typedef struct df_rhidden df_rhidden;
DF_MUST_CHECK dflash_status df_rhidden_open(const char *url, df_rhidden **out);
void df_rhidden_free(df_rhidden *r);
DF_MUST_CHECK dflash_status df_rhidden_meta(const df_rhidden *r, const char *key,
                                            const char **value);
size_t df_rhidden_count(const df_rhidden *r);
void df_rhidden_get(const df_rhidden *r, size_t i, dflash_tensor *t);
/* DFLASH_E_NOT_FOUND without a message when absent. */
DF_MUST_CHECK dflash_status df_rhidden_find(const df_rhidden *r, const char *name,
                                            dflash_tensor *t);
DF_MUST_CHECK dflash_status df_rhidden_read(df_rhidden *r, const char *name, void *buf, size_t len);

/* A folder of vLLM's hs_{idx}.safetensors (vllm.c): read-only, local. Its ids are the file
 * stems, and after df_vhidden_bind also the ids of the dataset samples whose token ids equal
 * a file's. */
typedef struct df_vhidden df_vhidden;
bool df_vhidden_is_layout(const char *dir);
DF_MUST_CHECK dflash_status df_vhidden_open(const char *dir, df_vhidden **out);
void df_vhidden_free(df_vhidden *v);
void df_vhidden_info(const df_vhidden *v, int32_t *K, int32_t *H, int32_t *dtype, size_t *n);
const char *df_vhidden_id(const df_vhidden *v, size_t i);
DF_MUST_CHECK dflash_status df_vhidden_bind(df_vhidden *v, const dflash_dataset *tokens);
DF_MUST_CHECK dflash_status df_vhidden_length(const df_vhidden *v, const char *id, int64_t *len);
DF_MUST_CHECK dflash_status df_vhidden_read(const df_vhidden *v, const char *id, float *out,
                                            int64_t len);
/* Its final layer (slot K) as [len, H]. */
DF_MUST_CHECK dflash_status df_vhidden_read_final(const df_vhidden *v, const char *id, float *out,
                                                  int64_t len);
/* Joins a vLLM store to the dataset by token ids (nothing to do for a libdflash store). */
DF_MUST_CHECK dflash_status df_hidden_bind_tokens(dflash_hidden *h, const dflash_dataset *tokens);

/* dflash_hidden_has_target_ids of the stream's store. */
dflash_hidden_target_ids df_sample_stream_has_target_ids(const dflash_sample_stream *s);

#endif
