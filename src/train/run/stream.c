/*
 * Training samples in a given order: a background thread decodes the hidden
 * states of the next `prefetch` samples into a ring of buffers while the
 * trainer works on the current one. Problems (missing id, length mismatch,
 * NaN/Inf) are carried to the consumer with the sample id. With stored_rows
 * the thread copies the codes instead (no decoding, no NaN/Inf scan: the CUDA
 * trainer does both on the device).
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stream.h"

typedef struct slot {
  float *buf;
  size_t cap;
  int32_t *tids; /* the target's greedy tokens, [tcap] */
  float *fin;    /* vLLM: the final layer [len, H], for them */
  size_t tcap;
  bool has_tids;
  float *final; /* the target's post-norm final state [len, H] (a store with final_state) */
  size_t final_cap;
  void *codes; /* stored_rows: the codes and (fp8) scales */
  float *scales;
  size_t codes_cap, scales_cap;
  uint64_t index;
  dflash_status st;
  char msg[512];
} slot;

struct dflash_sample_stream {
  dflash_dataset *tokens;
  dflash_hidden *hidden;
  dflash_hidden_target_ids has_tids;
  const float *norm_w, *head; /* vLLM's final layer -> ids (df_sample_stream_set_head) */
  float eps;
  int32_t V;
  int32_t K, H, dtype; /* layers, hidden size and dtype of the store */
  bool stored;         /* samples carry codes (stored_rows on a libdflash store) */
  bool final; /* samples carry the store's target final state (df_sample_stream_set_final) */
  int64_t width;
  int depth;
  slot *slots;
  uint64_t *order;
  size_t n;
  /* producer/consumer state, guarded by mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pthread_t thread;
  bool running, stop, holding;
  size_t produced, released, taken;
};

static void sample_stream_options_defaults(dflash_sample_stream_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->prefetch = 4;
}

DF_DEFINE_INIT(dflash_sample_stream_options, sample_stream_options_defaults)

dflash_status dflash_sample_stream_open(const char *data_dir, const char *hidden_dir,
                                        const dflash_sample_stream_options *opts,
                                        dflash_sample_stream **out) {
  DF_CHECK_ARG(data_dir && hidden_dir && out);
  *out = NULL;
  dflash_sample_stream_options o;
  dflash_sample_stream_options_default(&o);
  dflash_status ost = df_opts_in(&o, opts, sizeof o, "dflash_sample_stream_options");
  if (ost) return ost;
  dflash_sample_stream *s = calloc(1, sizeof *s);
  if (!s) return df_error_nomem("sample stream");
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->depth = o.prefetch > 0 ? o.prefetch : 1;
  s->slots = calloc((size_t)s->depth, sizeof *s->slots);
  dflash_status st = s->slots ? DFLASH_OK : df_error_nomem("sample stream");
  if (!st) st = dflash_dataset_open(data_dir, &s->tokens);
  if (!st) st = dflash_hidden_open(hidden_dir, &s->hidden);
  if (!st) st = df_hidden_bind_tokens(s->hidden, s->tokens);
  if (st) {
    dflash_sample_stream_free(s);
    return st;
  }
  dflash_hidden_info info = {.struct_size = sizeof info};
  /* Cannot fail on an open store and a struct of this library's size. */
  DF_IGNORE(dflash_hidden_get_info(s->hidden, &info));
  s->K = info.num_layers;
  s->H = info.hidden_size;
  s->dtype = info.dtype;
  s->has_tids = dflash_hidden_has_target_ids(s->hidden);
  s->width = (int64_t)s->K * s->H;
  s->stored = o.stored_rows && df_hidden_has_codes(s->hidden);
  s->final = info.final_state != 0;
  *out = s;
  return DFLASH_OK;
}

static void stop_thread(dflash_sample_stream *s) {
  if (!s->running) return;
  pthread_mutex_lock(&s->mu);
  s->stop = true;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  s->running = false;
}

void dflash_sample_stream_free(dflash_sample_stream *s) {
  if (!s) return;
  stop_thread(s);
  for (int i = 0; s->slots && i < s->depth; i++)
    free(s->slots[i].buf), free(s->slots[i].tids), free(s->slots[i].fin), free(s->slots[i].codes),
        free(s->slots[i].scales), free(s->slots[i].final);
  free(s->slots);
  free(s->order);
  dflash_dataset_free(s->tokens);
  dflash_hidden_free(s->hidden);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

size_t dflash_sample_stream_count(const dflash_sample_stream *s) {
  return s ? dflash_dataset_count(s->tokens) : 0;
}

const df_hidden_record *df_sample_stream_record(const dflash_sample_stream *s) {
  return df_hidden_record_of(s->hidden);
}

int64_t dflash_sample_stream_width(const dflash_sample_stream *s) { return s ? s->width : 0; }

dflash_status dflash_sample_stream_check(const dflash_sample_stream *s, size_t *n_bad) {
  DF_CHECK_ARG(s);
  dflash_status first = DFLASH_OK;
  char msg[512] = "";
  size_t bad = 0;
  for (size_t i = 0; i < dflash_dataset_count(s->tokens); i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t hl;
    size_t n_ids;
    dflash_status st = dflash_dataset_sample(s->tokens, i, &ids, &mask, &n_ids, &id);
    int64_t len = (int64_t)n_ids;
    if (!st) st = dflash_hidden_length(s->hidden, id, &hl);
    if (!st && hl != len)
      st = df_error(DFLASH_E_MISMATCH, "sample %s: %lld tokens but %lld rows of hidden states", id,
                    (long long)len, (long long)hl);
    if (st) {
      bad++;
      if (!first) first = st, snprintf(msg, sizeof msg, "%s", dflash_last_error());
    }
  }
  if (n_bad) *n_bad = bad;
  if (first) return df_error(first, "%s (%zu sample(s) affected)", msg, bad);
  return DFLASH_OK;
}

void df_sample_stream_set_head(dflash_sample_stream *s, const float *norm_w, float eps,
                               const float *head, int32_t V) {
  stop_thread(s); /* the prefetcher reads them; the next start picks them up */
  s->norm_w = norm_w, s->eps = eps, s->head = head, s->V = V;
}

/* The sample's target ids into the slot: stored ones, or from vLLM's final layer through the
 * head when the stream has one; none (has_tids false) otherwise. */
static dflash_status produce_tids(dflash_sample_stream *s, slot *sl, const char *id, int64_t len) {
  sl->has_tids = false;
  bool vllm = s->has_tids == DFLASH_HIDDEN_TARGET_IDS_VLLM && s->head;
  if (!(s->has_tids == DFLASH_HIDDEN_TARGET_IDS_STORED || vllm)) return DFLASH_OK;
  if ((size_t)len > sl->tcap) {
    free(sl->tids), free(sl->fin);
    sl->tids = malloc((size_t)len * sizeof *sl->tids);
    sl->fin = malloc((size_t)len * (size_t)s->H * sizeof *sl->fin);
    sl->tcap = sl->tids && sl->fin ? (size_t)len : 0;
    if (!sl->tcap) return df_error_nomem("target ids");
  }
  dflash_status st = vllm ? dflash_hidden_read_final(s->hidden, id, sl->fin, len)
                          : dflash_hidden_read_target_ids(s->hidden, id, sl->tids, len);
  if (st == DFLASH_E_NOT_FOUND && !vllm) return dflash_clear_error(), DFLASH_OK;
  if (!st && vllm)
    st = df_greedy_tokens(sl->fin, len, s->H, s->norm_w, s->eps, s->head, s->V, sl->tids);
  sl->has_tids = !st;
  return st;
}

bool df_sample_stream_has_final(const dflash_sample_stream *s) {
  dflash_hidden_info info = {.struct_size = sizeof info};
  return !dflash_hidden_get_info(s->hidden, &info) && info.final_state;
}

void df_sample_stream_set_final(dflash_sample_stream *s, bool on) {
  stop_thread(s); /* the prefetcher reads it; the next start picks it up */
  s->final = on && df_sample_stream_has_final(s);
}

/* Grow *p to `bytes` (its capacity in *cap). */
static dflash_status grow(void **p, size_t *cap, size_t bytes) {
  if (bytes <= *cap) return DFLASH_OK;
  free(*p);
  *p = malloc(bytes + 1);
  *cap = *p ? bytes : 0;
  return *p ? DFLASH_OK : df_error_nomem("hidden states");
}

/* The sample's codes as stored into its slot, and its all-zero-layer check. */
static dflash_status produce_codes(dflash_sample_stream *s, slot *sl, const char *id, int64_t len) {
  size_t n = (size_t)len * (size_t)s->width;
  bool fp8 = s->dtype == DFLASH_DTYPE_F8_E4M3;
  dflash_status st = grow(&sl->codes, &sl->codes_cap, fp8 ? n : 2 * n);
  if (!st && fp8) st = grow((void **)&sl->scales, &sl->scales_cap, 4 * (size_t)len * s->K);
  if (!st) st = df_hidden_read_codes(s->hidden, id, len, sl->codes, sl->scales);
  if (!st) st = df_hidden_check_codes(id, s->dtype, sl->codes, sl->scales, len, s->K, s->H);
  return st;
}

/* The sample's target final state into its slot, checked finite (it sets DSpark's target
 * distribution), when the stream gives it. */
static dflash_status produce_final(dflash_sample_stream *s, slot *sl, const char *id, int64_t len) {
  if (!s->final) return DFLASH_OK;
  size_t n = (size_t)len * (size_t)s->H;
  dflash_status st = grow((void **)&sl->final, &sl->final_cap, n * sizeof(float));
  if (!st) st = dflash_hidden_read_final_state(s->hidden, id, sl->final, len);
  for (size_t i = 0; !st && i < n; i++)
    if (!isfinite(sl->final[i]))
      st = df_error(DFLASH_E_FORMAT,
                    "sample %s: target final state at token %zu, column %zu is "
                    "not finite",
                    id, i / (size_t)s->H, i % (size_t)s->H);
  return st;
}

/* Decode one sample into its slot (called without the lock). */
static void produce(dflash_sample_stream *s, slot *sl, uint64_t index) {
  const char *id;
  const int32_t *ids;
  const uint8_t *mask;
  size_t n_ids;
  sl->index = index;
  /* index < count (the stream's order): the one failure, an index out of range, never comes. */
  sl->st = dflash_dataset_sample(s->tokens, (size_t)index, &ids, &mask, &n_ids, &id);
  if (sl->st) {
    snprintf(sl->msg, sizeof sl->msg, "%s", dflash_last_error());
    return;
  }
  int64_t len = (int64_t)n_ids;
  if (s->stored) {
    sl->st = produce_codes(s, sl, id, len);
    if (!sl->st) sl->st = produce_tids(s, sl, id, len);
    if (!sl->st) sl->st = produce_final(s, sl, id, len);
    if (sl->st) snprintf(sl->msg, sizeof sl->msg, "%s", dflash_last_error());
    return;
  }
  size_t need = (size_t)len * (size_t)s->width;
  if (need > sl->cap) {
    free(sl->buf);
    sl->buf = malloc(need * sizeof(float) + 1);
    sl->cap = sl->buf ? need : 0;
    if (!sl->buf) sl->st = df_error_nomem("decoded hidden states");
  }
  if (!sl->st) sl->st = dflash_hidden_read(s->hidden, id, sl->buf, len);
  for (size_t i = 0; !sl->st && i < need; i++)
    if (!isfinite(sl->buf[i]))
      sl->st = df_error(DFLASH_E_FORMAT,
                        "sample %s: hidden state at token %zu, column %zu is "
                        "not finite",
                        id, i / (size_t)s->width, i % (size_t)s->width);
  if (!sl->st) sl->st = df_hidden_check_sample(id, sl->buf, len, s->K, s->H);
  if (!sl->st) sl->st = produce_tids(s, sl, id, len);
  if (!sl->st) sl->st = produce_final(s, sl, id, len);
  if (sl->st) snprintf(sl->msg, sizeof sl->msg, "%s", dflash_last_error());
}

static void *producer(void *arg) {
  dflash_sample_stream *s = arg;
  pthread_mutex_lock(&s->mu);
  while (!s->stop && s->produced < s->n) {
    if (s->produced >= s->released + (size_t)s->depth) {
      pthread_cond_wait(&s->cv, &s->mu);
      continue;
    }
    size_t k = s->produced;
    pthread_mutex_unlock(&s->mu);
    produce(s, &s->slots[k % (size_t)s->depth], s->order[k]);
    pthread_mutex_lock(&s->mu);
    s->produced++;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

dflash_status dflash_sample_stream_start(dflash_sample_stream *s, const uint64_t *order, size_t n) {
  DF_CHECK_ARG(s && (order || n == 0));
  stop_thread(s);
  size_t count = dflash_dataset_count(s->tokens);
  for (size_t i = 0; i < n; i++)
    if (order[i] >= count)
      return df_error(DFLASH_E_RANGE,
                      "sample order[%zu] = %llu is outside the dataset's %zu "
                      "samples",
                      i, (unsigned long long)order[i], count);
  uint64_t *copy = malloc((n ? n : 1) * sizeof *copy);
  if (!copy) return df_error_nomem("sample order");
  if (n) memcpy(copy, order, n * sizeof *copy);
  free(s->order);
  s->order = copy;
  s->n = n;
  s->produced = s->released = s->taken = 0;
  s->stop = s->holding = false;
  if (pthread_create(&s->thread, NULL, producer, s) != 0)
    return df_error(DFLASH_E_IO, "sample stream: cannot start the prefetch thread");
  s->running = true;
  return DFLASH_OK;
}

/* The next sample into the library's struct `out` (zeroed, at this library's size). */
static dflash_status stream_next(dflash_sample_stream *s, dflash_sample *out, int32_t *done) {
  if (!s->running) return df_error(DFLASH_E_STATE, "sample stream: call start first");
  pthread_mutex_lock(&s->mu);
  if (s->holding) {
    s->released++;
    s->holding = false;
    pthread_cond_broadcast(&s->cv);
  }
  if (s->taken >= s->n) {
    pthread_mutex_unlock(&s->mu);
    *done = 1;
    return DFLASH_OK;
  }
  while (s->produced <= s->taken) pthread_cond_wait(&s->cv, &s->mu);
  size_t k = s->taken++;
  s->holding = true;
  pthread_mutex_unlock(&s->mu);
  *done = 0;
  slot *sl = &s->slots[k % (size_t)s->depth];
  if (sl->st) return df_error(sl->st, "%s", sl->msg);
  const char *id;
  out->index = sl->index;
  size_t n_ids;
  dflash_status st = dflash_dataset_sample(s->tokens, (size_t)sl->index, &out->input_ids,
                                           &out->loss_mask, &n_ids, &id);
  if (st) return st;
  out->len = (int64_t)n_ids;
  out->id = id;
  out->target_ids = sl->has_tids ? sl->tids : NULL;
  out->target_final = s->final ? sl->final : NULL;
  out->hidden = s->stored ? NULL : sl->buf;
  if (!s->stored) return DFLASH_OK;
  out->hidden_dtype = s->dtype;
  out->hidden_codes = sl->codes;
  out->hidden_scales = s->dtype == DFLASH_DTYPE_F8_E4M3 ? sl->scales : NULL;
  return DFLASH_OK;
}

dflash_status dflash_sample_stream_next(dflash_sample_stream *s, dflash_sample *out,
                                        int32_t *done) {
  DF_CHECK_ARG(s && out && done);
  dflash_sample v = {.struct_size = sizeof v};
  /* The caller's struct_size is checked (and its struct cleared) before a sample is taken. */
  dflash_status st = df_opts_out(out, &v, sizeof v, "dflash_sample");
  if (!st) st = stream_next(s, &v, done);
  if (!st && !*done) st = df_opts_out(out, &v, sizeof v, "dflash_sample");
  return st;
}

dflash_hidden_target_ids df_sample_stream_has_target_ids(const dflash_sample_stream *s) {
  return s->has_tids;
}

const dflash_dataset *df_sample_stream_tokens(const dflash_sample_stream *s) { return s->tokens; }
