/*
 * What a hidden-state store says its rows are: the target layers they hold and the target
 * tokenizer's hash, kept in every shard's metadata, so that a drafter config that reads other
 * layers is refused instead of training on the wrong features (dflash_hidden_writer_options).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"

enum { MAX_HASH = 256 };

void df_hidden_record_free(df_hidden_record *r) {
  free(r->layer_ids);
  free(r->tokenizer_hash);
  *r = (df_hidden_record){0};
}

/* A hash is written into JSON metadata and printed: printable ASCII, no quote or backslash. */
static bool plain_text(const char *s) {
  for (; *s; s++)
    if (*s <= ' ' || *s > '~' || *s == '"' || *s == '\\') return false;
  return true;
}

dflash_status df_hidden_record_from_options(const dflash_hidden_writer_options *o, int32_t K,
                                            df_hidden_record *out) {
  *out = (df_hidden_record){0};
  const char *hash = o->tokenizer_hash;
  if (hash && (!*hash || strlen(hash) > MAX_HASH || !plain_text(hash)))
    return df_error(DFLASH_E_INVALID_ARG,
                    "hidden writer: tokenizer_hash must be 1..%d printable characters without "
                    "spaces or quotes (dflash_dataset_tokenizer_hash's \"sha256:...\")",
                    MAX_HASH);
  for (int32_t k = 0; o->target_layer_ids && k < K; k++)
    if (o->target_layer_ids[k] < 0)
      return df_error(DFLASH_E_INVALID_ARG, "hidden writer: target_layer_ids[%d] = %d is negative",
                      k, o->target_layer_ids[k]);
  if (o->target_layer_ids) {
    if (!(out->layer_ids = malloc((size_t)K * sizeof *out->layer_ids)))
      return df_error_nomem("target layer ids");
    memcpy(out->layer_ids, o->target_layer_ids, (size_t)K * sizeof *out->layer_ids);
    out->n_layer_ids = K;
  }
  if (hash && !(out->tokenizer_hash = df_strdup(hash))) {
    df_hidden_record_free(out);
    return df_error_nomem("tokenizer hash");
  }
  return DFLASH_OK;
}

bool df_hidden_record_ids_csv(const df_hidden_record *r, char *buf, size_t cap) {
  size_t n = 0;
  if (cap) buf[0] = 0;
  for (int32_t k = 0; k < r->n_layer_ids && n < cap; k++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%d", k ? "," : "", r->layer_ids[k]);
  return n < cap;
}

dflash_status df_hidden_record_write(const df_hidden_record *r, dflash_safetensors_writer *sw) {
  dflash_status st = DFLASH_OK;
  if (r->n_layer_ids) {
    char text[12 * 256 + 1];
    if (!df_hidden_record_ids_csv(r, text, sizeof text))
      return df_error(DFLASH_E_INVALID_ARG, "hidden writer: %d target layer ids are too many",
                      r->n_layer_ids);
    st = dflash_safetensors_writer_metadata(sw, "target_layer_ids", text);
  }
  if (!st && r->tokenizer_hash)
    st = dflash_safetensors_writer_metadata(sw, "tokenizer_hash", r->tokenizer_hash);
  return st;
}

/* "1,9,17": exactly K non-negative integers. */
static bool parse_ids(const char *s, int32_t K, int32_t *out) {
  for (int32_t k = 0; k < K; k++) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || v < 0 || v > INT32_MAX || (*end != ',' && *end)) return false;
    if ((*end == ',') != (k + 1 < K)) return false;
    out[k] = (int32_t)v;
    s = *end ? end + 1 : end;
  }
  return true;
}

dflash_status df_hidden_record_parse(const char *ids, const char *hash, int32_t K, const char *dir,
                                     df_hidden_record *out) {
  *out = (df_hidden_record){0};
  if (ids) {
    if (!(out->layer_ids = malloc((size_t)K * sizeof *out->layer_ids)))
      return df_error_nomem("target layer ids");
    out->n_layer_ids = K;
    if (!parse_ids(ids, K, out->layer_ids)) {
      df_hidden_record_free(out);
      return df_error(DFLASH_E_FORMAT,
                      "%s: metadata target_layer_ids = \"%s\" is not %d comma-separated layer "
                      "numbers",
                      dir, ids, K);
    }
  }
  if (hash && !(out->tokenizer_hash = df_strdup(hash))) {
    df_hidden_record_free(out);
    return df_error_nomem("tokenizer hash");
  }
  return DFLASH_OK;
}

void df_hidden_record_ids_text(const df_hidden_record *r, char *buf, size_t cap) {
  if (!cap) return;
  if (!r || !r->n_layer_ids) {
    snprintf(buf, cap, "(not recorded)");
    return;
  }
  size_t n = 0;
  buf[0] = 0;
  for (int32_t k = 0; k < r->n_layer_ids && n < cap; k++)
    n += (size_t)snprintf(buf + n, cap - n, "%s%d", k ? ", " : "", r->layer_ids[k]);
}
