/* Internals of the hidden-state store and the training-sample stream. */
#ifndef DFLASH_HIDDEN_INTERNAL_H
#define DFLASH_HIDDEN_INTERNAL_H

#include <dflash/hidden.h>
#include <dflash/safetensors.h>

#include "core/internal.h"

#define DF_HIDDEN_FORMAT "dflash-hidden-1"
#define DF_HIDDEN_INDEX "hidden.safetensors.index.json"
#define DF_HIDDEN_MAX_ID 1024

const char *df_hidden_dtype_name(int32_t dtype);

/* The first of K layers that is all zeros in a sample [len, K*H] given as f32 or bf16 (one of
 * them), or -1 (sanity.c). */
int32_t df_hidden_zero_layer(const float *f32, const uint16_t *bf16, int64_t len, int32_t K,
                             int32_t H);
/* DFLASH_E_FORMAT naming the sample and the layer when one of its K layers is all zeros. */
dflash_status df_hidden_check_sample(const char *id, const float *x, int64_t len, int32_t K,
                                     int32_t H);


/* A store on object storage, read with ranged GETs (remote.c). Tensor
 * views have data == NULL; df_rhidden_read fetches their bytes (thread-safe). */
typedef struct df_rhidden df_rhidden;
dflash_status df_rhidden_open(const char *url, df_rhidden **out);
void df_rhidden_free(df_rhidden *r);
dflash_status df_rhidden_meta(const df_rhidden *r, const char *key, const char **value);
size_t df_rhidden_count(const df_rhidden *r);
void df_rhidden_get(const df_rhidden *r, size_t i, dflash_tensor *t);
/* DFLASH_E_NOT_FOUND without a message when absent. */
dflash_status df_rhidden_find(const df_rhidden *r, const char *name, dflash_tensor *t);
dflash_status df_rhidden_read(df_rhidden *r, const char *name, void *buf, size_t len);

/* The tokenized dataset (a dflash_dataset, include/dflash/dataset.h). */
typedef struct df_tokens df_tokens;

/* A folder of vLLM's hs_{idx}.safetensors (vllm.c): read-only, local. Its ids are the file
 * stems, and after df_vhidden_bind also the ids of the dataset samples whose token ids equal
 * a file's. */
typedef struct df_vhidden df_vhidden;
bool df_vhidden_is_layout(const char *dir);
dflash_status df_vhidden_open(const char *dir, df_vhidden **out);
void df_vhidden_free(df_vhidden *v);
void df_vhidden_info(const df_vhidden *v, int32_t *K, int32_t *H, int32_t *dtype, size_t *n);
const char *df_vhidden_id(const df_vhidden *v, size_t i);
dflash_status df_vhidden_bind(df_vhidden *v, const df_tokens *tokens);
dflash_status df_vhidden_length(const df_vhidden *v, const char *id, int64_t *len);
dflash_status df_vhidden_read(const df_vhidden *v, const char *id, float *out, int64_t len);
/* Joins a vLLM store to the dataset by token ids (nothing to do for a libdflash store). */
dflash_status df_hidden_bind_tokens(dflash_hidden *h, const df_tokens *tokens);
dflash_status df_tokens_open(const char *dir, df_tokens **out);
void df_tokens_free(df_tokens *t);
size_t df_tokens_count(const df_tokens *t);
/* Borrowed views of sample i. */
void df_tokens_get(const df_tokens *t, size_t i, const char **id, const int32_t **ids,
                   const uint8_t **mask, int64_t *len);

/* The dataset behind a stream (borrowed). */
const df_tokens *df_sample_stream_tokens(const dflash_sample_stream *s);

#endif
