/* The one rule for versioned structs (core/internal.h, df_opts_*), through the public
 * functions that take them: an options struct 8 bytes smaller than the library's (an older
 * caller: its missing tail means the defaults) is accepted, 8 bytes larger only when those
 * bytes are zero (a newer caller that left its new fields unset); an output struct and the
 * _init functions write up to the caller's struct_size and no further. */
#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/fetch.h>
#include <dflash/hidden.h>
#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
#include <dflash/train.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

#define CANARY 0xab
#define SLACK 64

/* What a case needs: a folder for files, and the objects an output struct is read from. */
typedef struct ctx {
  char *dir;
  dflash_fetch *fetch;
} ctx;

typedef struct opts_case {
  const char *name;
  size_t size; /* the library's sizeof */
  void (*init)(void *o, size_t size);
  /* A public call taking the struct as input (options) or writing it (output). */
  dflash_status (*call)(void *o, ctx *c);
  bool output;
} opts_case;

/* ---- the _init functions ------------------------------------------------- */

static void init_tokenizer(void *o, size_t n) { dflash_tokenizer_options_init(o, n); }
static void init_chat(void *o, size_t n) { dflash_chat_options_init(o, n); }
static void init_storage(void *o, size_t n) { dflash_storage_options_init(o, n); }
static void init_chunk(void *o, size_t n) { dflash_chunk_writer_options_init(o, n); }
static void init_fetch(void *o, size_t n) { dflash_fetch_options_init(o, n); }
static void init_trainer(void *o, size_t n) { dflash_trainer_options_init(o, n); }
static void init_plan_opts(void *o, size_t n) { dflash_train_plan_options_init(o, n); }
static void init_propose(void *o, size_t n) { dflash_propose_options_init(o, n); }
static void init_dataset_writer(void *o, size_t n) { dflash_dataset_writer_options_init(o, n); }
static void init_hidden_writer(void *o, size_t n) { dflash_hidden_writer_options_init(o, n); }
static void init_spool(void *o, size_t n) { dflash_spool_options_init(o, n); }
static void init_stream(void *o, size_t n) { dflash_sample_stream_options_init(o, n); }
static void init_run(void *o, size_t n) { dflash_train_run_options_init(o, n); }
static void init_eval_walk(void *o, size_t n) { dflash_eval_walk_init(o, n); }
static void init_eval(void *o, size_t n) { dflash_eval_init(o, n); }
static void init_build(void *o, size_t n) { dflash_dataset_build_options_init(o, n); }
static void init_rows(void *o, size_t n) { dflash_hidden_rows_init(o, n); }

/* Output structs have no _init: the caller zeroes them and sets the size. */
static void init_zero(void *o, size_t n) {
  memset(o, 0, n);
  memcpy(o, &n, sizeof n);
}

/* ---- calls ---------------------------------------------------------------- */

static dflash_status call_tokenizer(void *o, ctx *c) {
  char *path = df_path_join(c->dir, "cl100k_ranks.tiktoken" /* its name gives the pattern */);
  df_buf b = {0};
  static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (int i = 0; i < 256; i++) /* every byte alone, base64 of one byte */
    ck_assert_ok(df_buf_printf(&b, "%c%c== %d\n", B64[i >> 2], B64[(i & 3) << 4], i));
  ck_assert(df_test_write(path, b.data, b.len));
  df_buf_free(&b);
  dflash_tokenizer *t = NULL;
  dflash_status st = dflash_tokenizer_load(path, o, &t);
  dflash_tokenizer_free(t);
  free(path);
  return st;
}

static dflash_status call_chat(void *o, ctx *c) {
  (void)c;
  dflash_chat_template *tmpl;
  ck_assert_ok(dflash_chat_template_create(dflash_chat_template_name_at(0), &tmpl));
  static const char conv[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
  dflash_chat_rendered *r = NULL;
  dflash_status st = dflash_chat_render_json(tmpl, conv, sizeof conv - 1, o, &r);
  dflash_chat_rendered_free(r);
  dflash_chat_template_free(tmpl);
  return st;
}

static dflash_status call_storage(void *o, ctx *c) {
  (void)c;
  dflash_storage *st = NULL;
  dflash_status s = dflash_storage_create(o, &st);
  dflash_storage_free(st);
  return s;
}

static dflash_status call_chunk(void *o, ctx *c) {
  dflash_storage *st;
  ck_assert_ok(dflash_storage_create(NULL, &st));
  dflash_chunk_writer *w = NULL;
  dflash_status s = dflash_chunk_writer_open(st, c->dir, "w", o, &w);
  dflash_chunk_writer_free(w);
  dflash_storage_free(st);
  return s;
}

/* Fetch options complete enough to create a fetcher (nothing is sent before run). */
static void fill_fetch(dflash_fetch_options *o) {
  static const char *servers[] = {"http://127.0.0.1:9/v1"};
  o->servers = servers;
  o->n_servers = 1;
  o->model = "m";
}

static dflash_status call_fetch(void *o, ctx *c) {
  fill_fetch(o);
  char *in = df_path_join(c->dir, "in.jsonl");
  char *out = df_path_join(c->dir, "fetch-out");
  static const char line[] =
      "{\"id\":\"a\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}\n";
  ck_assert(df_test_write(in, line, sizeof line - 1));
  dflash_fetch *f = NULL;
  dflash_status st = dflash_fetch_create(o, in, out, &f);
  dflash_fetch_free(f);
  free(in);
  free(out);
  return st;
}

static dflash_status call_fetch_stats(void *o, ctx *c) {
  return dflash_fetch_get_stats(c->fetch, o);
}
static dflash_status call_server_stats(void *o, ctx *c) {
  return dflash_fetch_get_server_stats(c->fetch, 0, o);
}

static dflash_status call_storage_info(void *o, ctx *c) {
  char *path = df_path_join(c->dir, "object");
  ck_assert(df_test_write(path, "12345", 5));
  dflash_storage *st;
  ck_assert_ok(dflash_storage_create(NULL, &st));
  dflash_status s = dflash_storage_stat(st, path, o);
  dflash_storage_free(st);
  free(path);
  return s;
}

static dflash_status call_tensor(void *o, ctx *c) {
  char *path = df_path_join(c->dir, "t.safetensors");
  static const char header[] = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  unsigned char file[8 + sizeof header - 1 + 4] = {sizeof header - 1};
  memcpy(file + 8, header, sizeof header - 1);
  ck_assert(df_test_write(path, file, sizeof file));
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(path, &st));
  dflash_status s = dflash_safetensors_get(st, 0, o);
  dflash_safetensors_free(st);
  free(path);
  return s;
}

/* A small drafter: 2 layers, hidden 64, vocabulary 1000. */
static dflash_status parse_small(dflash_drafter_config *c) {
  static const char json[] =
      "{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2, "
      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, "
      "\"vocab_size\": 1000, \"num_target_layers\": 36, \"block_size\": 4, "
      "\"dflash_config\": {\"mask_token_id\": 1}}";
  return dflash_drafter_config_parse(json, sizeof json - 1, "small.json", c);
}
static void small_drafter(dflash_drafter_config *c) { ck_assert_ok(parse_small(c)); }

/* A trainer of the small drafter, its embedding and head zero (kept for the process). */
static dflash_status small_trainer(const dflash_trainer_options *o, dflash_trainer **t) {
  static float *embed;
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  small_drafter(&cfg);
  if (!embed) embed = calloc((size_t)cfg.vocab_size * (size_t)cfg.hidden_size, sizeof *embed);
  ck_assert_ptr_nonnull(embed);
  *t = NULL;
  return dflash_trainer_create(&cfg, embed, embed, o, t);
}

static dflash_status call_trainer(void *o, ctx *c) {
  (void)c;
  dflash_trainer *t;
  dflash_status st = small_trainer(o, &t);
  dflash_trainer_free(t);
  return st;
}

static dflash_status call_plan_opts(void *o, ctx *c) {
  (void)c;
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  small_drafter(&cfg);
  dflash_train_plan p = {.struct_size = sizeof p};
  return dflash_train_plan_compute(&cfg, o, &p);
}

static dflash_status call_plan(void *o, ctx *c) {
  (void)c;
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  small_drafter(&cfg);
  dflash_train_plan_options po;
  dflash_train_plan_options_default(&po);
  return dflash_train_plan_compute(&cfg, &po, o);
}

/* dflash_trainer_propose of 8 tokens at one anchor with `o` as its options or, `outputs`,
 * as its outputs (all NULL: nothing asked beyond the tokens). */
static dflash_status propose_with(void *o, bool outputs) {
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  small_drafter(&cfg);
  dflash_trainer *t;
  ck_assert_ok(small_trainer(NULL, &t));
  int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12}, anchor = 2, pred[8];
  float *hidden = calloc(8 * (size_t)cfg.n_target_layer_ids * (size_t)cfg.hidden_size,
                         sizeof *hidden);
  ck_assert_ptr_nonnull(hidden);
  dflash_sample s = {.struct_size = sizeof s,
                     .len = 8,
                     .input_ids = ids,
                     .hidden = hidden,
                     .anchors = &anchor,
                     .n_anchors = 1};
  dflash_status st = dflash_trainer_propose(t, &s, outputs ? NULL : o, pred, outputs ? o : NULL);
  free(hidden);
  dflash_trainer_free(t);
  return st;
}

static dflash_status call_propose(void *o, ctx *c) {
  (void)c;
  return propose_with(o, false);
}

static dflash_status call_propose_outputs(void *o, ctx *c) {
  (void)c;
  return propose_with(o, true);
}

static dflash_status call_dataset_writer(void *o, ctx *c) {
  char *dir = df_path_join(c->dir, "dataset");
  df_test_rmtree(dir); /* each call writes a fresh one */
  dflash_dataset_writer *w = NULL;
  dflash_status st = dflash_dataset_writer_create(dir, o, &w);
  dflash_dataset_writer_free(w);
  free(dir);
  return st;
}

/* A finished store of one sample (K 1, H 4, 3 tokens) at dir/NAME, written with `o`. */
static dflash_status write_store(const char *dir, const char *name,
                                 const dflash_hidden_writer_options *o) {
  char *path = df_path_join(dir, name);
  df_test_rmtree(path);
  static const float rows[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  dflash_hidden_writer *w = NULL;
  dflash_status st = dflash_hidden_writer_create(path, 1, 4, o, &w);
  if (!st) st = df_test_hidden_add(w, "s0", rows, NULL, 3);
  if (!st) st = dflash_hidden_writer_commit(w);
  dflash_hidden_writer_free(w);
  free(path);
  return st;
}

static dflash_status call_hidden_writer(void *o, ctx *c) { return write_store(c->dir, "hw", o); }

static dflash_status call_spool(void *o, ctx *c) {
  char *path = df_path_join(c->dir, "spool");
  dflash_hidden_writer_options wo;
  dflash_hidden_writer_options_default(&wo);
  wo.spool_budget = 1 << 20;
  wo.shard_bytes = 1 << 16;
  ck_assert_ok(write_store(c->dir, "spool", &wo));
  dflash_spool *sp = NULL;
  dflash_status st = dflash_spool_open(path, o, &sp);
  dflash_spool_free(sp);
  free(path);
  return st;
}

/* A dataset of one sample (3 tokens) in c->dir/NAME-data and its hidden store in NAME-hs; the
 * two paths returned are the caller's to free. */
static void one_sample_set(ctx *c, const char *name, char **data, char **hidden) {
  char dname[64], hname[64];
  snprintf(dname, sizeof dname, "%s-data", name);
  snprintf(hname, sizeof hname, "%s-hs", name);
  *data = df_path_join(c->dir, dname), *hidden = df_path_join(c->dir, hname);
  df_test_rmtree(*data);
  static const int32_t ids[3] = {5, 6, 7};
  static const uint8_t mask[3] = {0, 1, 1};
  dflash_dataset_writer *dw;
  ck_assert_ok(dflash_dataset_writer_create(*data, NULL, &dw));
  ck_assert_ok(dflash_dataset_writer_add(dw, "s0", ids, mask, 3));
  ck_assert_ok(dflash_dataset_writer_commit(dw));
  dflash_dataset_writer_free(dw);
  ck_assert_ok(write_store(c->dir, hname, NULL));
}

static dflash_status call_stream(void *o, ctx *c) {
  char *data, *hidden;
  one_sample_set(c, "stream", &data, &hidden);
  dflash_sample_stream *s = NULL;
  dflash_status st = dflash_sample_stream_open(data, hidden, o, &s);
  dflash_sample_stream_free(s);
  free(data), free(hidden);
  return st;
}

/* dflash_train_run reads its options before any file: with paths that do not exist, a struct it
 * accepts fails at the config (DFLASH_E_IO / _NOT_FOUND), one it refuses at the struct. */
static dflash_status call_run(void *o, ctx *c) {
  dflash_train_run_options *r = o;
  char *missing = df_path_join(c->dir, "missing");
  r->config_path = r->target_path = r->data_dir = r->hidden_dir = r->out_dir = missing;
  dflash_status st = dflash_train_run(r, NULL);
  free(missing);
  bool accepted = st != DFLASH_E_INVALID_ARG && st != DFLASH_E_UNSUPPORTED;
  return accepted ? DFLASH_OK : st;
}

/* The run's stats, written on failure too: a run that fails at the missing config. */
static dflash_status call_train_stats(void *o, ctx *c) {
  dflash_train_run_options r;
  dflash_train_run_options_default(&r);
  char *missing = df_path_join(c->dir, "missing");
  r.config_path = r.target_path = r.data_dir = r.hidden_dir = r.out_dir = missing;
  dflash_status st = dflash_train_run(&r, o);
  free(missing);
  if (st == DFLASH_E_INVALID_ARG || st == DFLASH_E_UNSUPPORTED) return st;
  ck_assert_int_eq(((dflash_train_stats *)o)->step, 0);
  return DFLASH_OK;
}

/* In and out: a struct it accepts fails at the missing folders, one it refuses at the struct. */
static dflash_status call_eval_walk(void *o, ctx *c) {
  dflash_trainer *t;
  ck_assert_ok(small_trainer(NULL, &t));
  char *missing = df_path_join(c->dir, "missing");
  dflash_status st = dflash_trainer_eval_walk(t, missing, missing, o);
  free(missing);
  dflash_trainer_free(t);
  bool accepted = st != DFLASH_E_INVALID_ARG && st != DFLASH_E_UNSUPPORTED;
  return accepted ? DFLASH_OK : st;
}

/* dflash_trainer_eval over a missing dataset, as call_eval_walk. */
static dflash_status call_eval(void *o, ctx *c) {
  dflash_trainer *t;
  ck_assert_ok(small_trainer(NULL, &t));
  char *missing = df_path_join(c->dir, "missing");
  dflash_status st = dflash_trainer_eval(t, missing, missing, o);
  free(missing);
  dflash_trainer_free(t);
  bool accepted = st != DFLASH_E_INVALID_ARG && st != DFLASH_E_UNSUPPORTED;
  return accepted ? DFLASH_OK : st;
}

/* dflash_dataset_build with a missing input: a struct it accepts fails there
 * (DFLASH_E_NOT_FOUND), one it refuses at the struct. `o` is its options or its stats. */
static dflash_status build_missing(dflash_dataset_build_options *opts,
                                   dflash_dataset_build_stats *stats, ctx *c) {
  char *missing = df_path_join(c->dir, "missing.jsonl"), *out = df_path_join(c->dir, "build");
  dflash_dataset_build_options d;
  if (!opts) dflash_dataset_build_options_default(opts = &d);
  opts->tokenizer_path = missing;
  opts->template_name = "qwen3";
  const char *inputs[1] = {missing};
  dflash_status st = dflash_dataset_build(inputs, 1, out, opts, stats);
  free(missing), free(out);
  return st == DFLASH_E_NOT_FOUND ? DFLASH_OK : st;
}
static dflash_status call_build(void *o, ctx *c) { return build_missing(o, NULL, c); }

/* The library's struct's fields past struct_size into the caller's `o` of its own size. */
static void copy_fields(void *o, const void *full, size_t size) {
  size_t n;
  memcpy(&n, o, sizeof n);
  if (n <= sizeof n) return; /* not a struct: the call refuses it */
  memcpy((char *)o + sizeof n, (const char *)full + sizeof n, (n < size ? n : size) - sizeof n);
}

static void init_config(void *o, size_t n) { dflash_drafter_config_init(o, n); }

/* A config as input: the small drafter in the caller's struct, validated. */
static dflash_status call_config_in(void *o, ctx *c) {
  (void)c;
  dflash_drafter_config full;
  dflash_drafter_config_default(&full);
  small_drafter(&full);
  copy_fields(o, &full, sizeof full);
  return dflash_drafter_config_validate(o);
}

/* ... and as output: parsed into the caller's struct. */
static dflash_status call_config_out(void *o, ctx *c) {
  (void)c;
  return parse_small(o);
}

static dflash_status call_span(void *o, ctx *c) {
  (void)c;
  dflash_chat_template *tmpl;
  ck_assert_ok(dflash_chat_template_create("qwen3", &tmpl));
  static const char conv[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
  dflash_chat_rendered *r = NULL;
  ck_assert_ok(dflash_chat_render_json(tmpl, conv, sizeof conv - 1, NULL, &r));
  dflash_status st = dflash_chat_rendered_span(r, 0, o);
  dflash_chat_rendered_free(r);
  dflash_chat_template_free(tmpl);
  return st;
}

/* A sample stream over one sample (3 tokens), started. */
static dflash_sample_stream *one_sample_stream(ctx *c) {
  char *data, *hidden;
  one_sample_set(c, "smp", &data, &hidden);
  dflash_sample_stream *s;
  ck_assert_ok(dflash_sample_stream_open(data, hidden, NULL, &s));
  static const uint64_t order[1] = {0};
  ck_assert_ok(dflash_sample_stream_start(s, order, 1));
  free(data), free(hidden);
  return s;
}

static dflash_status call_train_sample(void *o, ctx *c) {
  dflash_sample_stream *s = one_sample_stream(c);
  int done = -1;
  dflash_status st = dflash_sample_stream_next(s, o, &done);
  if (!st) ck_assert_int_eq(done, 0);
  if (!st) ck_assert_uint_eq(((dflash_sample *)o)->len, 3);
  dflash_sample_stream_free(s);
  return st;
}

/* A sample as input: 8 tokens of the small drafter (zero hidden states), one anchor. */
static dflash_status call_train_sample_in(void *o, ctx *c) {
  (void)c;
  dflash_drafter_config cfg;
  dflash_drafter_config_default(&cfg);
  small_drafter(&cfg);
  dflash_trainer *t;
  ck_assert_ok(small_trainer(NULL, &t));
  static const int32_t ids[8] = {5, 6, 7, 8, 9, 10, 11, 12};
  static const uint8_t mask[8] = {0, 0, 1, 1, 1, 1, 1, 1};
  float *hidden = calloc(8 * (size_t)cfg.n_target_layer_ids * (size_t)cfg.hidden_size,
                         sizeof *hidden);
  ck_assert_ptr_nonnull(hidden);
  dflash_sample full = {.struct_size = sizeof full,
                        .id = "s0",
                        .len = 8,
                        .input_ids = ids,
                        .loss_mask = mask,
                        .hidden = hidden};
  int32_t anchor = 2;
  full.anchors = &anchor, full.n_anchors = 1;
  copy_fields(o, &full, sizeof full);
  dflash_status st = dflash_trainer_accumulate(t, o, 1.0);
  free(hidden);
  dflash_trainer_free(t);
  return st;
}

static dflash_status call_spool_sample(void *o, ctx *c) {
  char *path = df_path_join(c->dir, "smp-spool");
  dflash_hidden_writer_options wo;
  dflash_hidden_writer_options_default(&wo);
  wo.spool_budget = 1 << 20;
  wo.shard_bytes = 1 << 16;
  ck_assert_ok(write_store(c->dir, "smp-spool", &wo));
  dflash_spool *sp;
  ck_assert_ok(dflash_spool_open(path, NULL, &sp));
  int end = -1;
  dflash_status st = dflash_spool_next(sp, o, &end);
  if (!st) ck_assert_int_eq(end, 0);
  if (!st) ck_assert_uint_eq(((dflash_sample *)o)->len, 3);
  dflash_spool_free(sp);
  free(path);
  return st;
}
static dflash_status call_build_stats(void *o, ctx *c) { return build_missing(NULL, o, c); }

/* What a store of one sample (K 1, H 4) holds. */
static dflash_status call_hidden_info(void *o, ctx *c) {
  ck_assert_ok(write_store(c->dir, "info-hs", NULL));
  char *path = df_path_join(c->dir, "info-hs");
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(path, &h));
  dflash_status st = dflash_hidden_get_info(h, o);
  if (!st) ck_assert_int_eq(((dflash_hidden_info *)o)->num_layers, 1);
  dflash_hidden_free(h);
  free(path);
  return st;
}

static dflash_status call_spool_info(void *o, ctx *c) {
  dflash_hidden_writer_options wo;
  dflash_hidden_writer_options_default(&wo);
  wo.spool_budget = 1 << 20;
  wo.shard_bytes = 1 << 16;
  ck_assert_ok(write_store(c->dir, "info-spool", &wo));
  char *path = df_path_join(c->dir, "info-spool");
  dflash_spool *sp;
  ck_assert_ok(dflash_spool_open(path, NULL, &sp));
  dflash_status st = dflash_spool_get_info(sp, o);
  if (!st) ck_assert_int_eq(((dflash_spool_info *)o)->hidden_size, 4);
  dflash_spool_free(sp);
  free(path);
  return st;
}

/* A spool writer that has taken one sample (3 tokens of K 1, H 4). */
static dflash_status call_spool_status(void *o, ctx *c) {
  static const float rows[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  dflash_hidden_writer_options wo;
  dflash_hidden_writer_options_default(&wo);
  wo.spool_budget = 1 << 20;
  wo.shard_bytes = 1 << 16;
  char *path = df_path_join(c->dir, "status-spool");
  df_test_rmtree(path);
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(path, 1, 4, &wo, &w));
  ck_assert_ok(df_test_hidden_add(w, "s0", rows, NULL, 3));
  dflash_status st = dflash_hidden_writer_get_spool_status(w, o);
  if (!st) ck_assert_uint_eq(((dflash_hidden_writer_spool_status *)o)->samples, 1);
  dflash_hidden_writer_free(w);
  free(path);
  return st;
}

/* A sample's rows as input: 3 tokens of K 1, H 4 added to a fresh store. */
static dflash_status call_rows(void *o, ctx *c) {
  static const float x[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  dflash_hidden_rows full;
  dflash_hidden_rows_default(&full);
  full.len = 3;
  full.states = x;
  copy_fields(o, &full, sizeof full);
  char *path = df_path_join(c->dir, "rows");
  df_test_rmtree(path);
  dflash_hidden_writer *w = NULL;
  dflash_status st = dflash_hidden_writer_create(path, 1, 4, NULL, &w);
  if (!st) st = dflash_hidden_writer_add(w, "s0", o);
  dflash_hidden_writer_free(w);
  free(path);
  return st;
}

static const opts_case CASES[] = {
    {"dflash_tokenizer_options", sizeof(dflash_tokenizer_options), init_tokenizer, call_tokenizer,
     false},
    {"dflash_chat_options", sizeof(dflash_chat_options), init_chat, call_chat, false},
    {"dflash_storage_options", sizeof(dflash_storage_options), init_storage, call_storage, false},
    {"dflash_chunk_writer_options", sizeof(dflash_chunk_writer_options), init_chunk, call_chunk,
     false},
    {"dflash_fetch_options", sizeof(dflash_fetch_options), init_fetch, call_fetch, false},
    {"dflash_fetch_stats", sizeof(dflash_fetch_stats), init_zero, call_fetch_stats, true},
    {"dflash_fetch_server_stats", sizeof(dflash_fetch_server_stats), init_zero, call_server_stats,
     true},
    {"dflash_storage_info", sizeof(dflash_storage_info), init_zero, call_storage_info, true},
    {"dflash_tensor", sizeof(dflash_tensor), init_zero, call_tensor, true},
    {"dflash_trainer_options", sizeof(dflash_trainer_options), init_trainer, call_trainer, false},
    {"dflash_train_plan_options", sizeof(dflash_train_plan_options), init_plan_opts, call_plan_opts,
     false},
    {"dflash_train_plan", sizeof(dflash_train_plan), init_zero, call_plan, true},
    {"dflash_propose_options", sizeof(dflash_propose_options), init_propose, call_propose, false},
    {"dflash_propose_outputs", sizeof(dflash_propose_outputs), init_zero, call_propose_outputs,
     false},
    {"dflash_dataset_writer_options", sizeof(dflash_dataset_writer_options), init_dataset_writer,
     call_dataset_writer, false},
    {"dflash_hidden_writer_options", sizeof(dflash_hidden_writer_options), init_hidden_writer,
     call_hidden_writer, false},
    {"dflash_spool_options", sizeof(dflash_spool_options), init_spool, call_spool, false},
    {"dflash_sample_stream_options", sizeof(dflash_sample_stream_options), init_stream, call_stream,
     false},
    {"dflash_train_run_options", sizeof(dflash_train_run_options), init_run, call_run, false},
    {"dflash_eval_walk", sizeof(dflash_eval_walk), init_eval_walk, call_eval_walk, false},
    {"dflash_eval", sizeof(dflash_eval), init_eval, call_eval, false},
    {"dflash_dataset_build_options", sizeof(dflash_dataset_build_options), init_build, call_build,
     false},
    {"dflash_dataset_build_stats", sizeof(dflash_dataset_build_stats), init_zero, call_build_stats,
     true},
    {"dflash_drafter_config", sizeof(dflash_drafter_config), init_config, call_config_in, false},
    {"dflash_drafter_config", sizeof(dflash_drafter_config), init_config, call_config_out, true},
    {"dflash_chat_span", sizeof(dflash_chat_span), init_zero, call_span, true},
    {"dflash_sample", sizeof(dflash_sample), init_zero, call_train_sample, true},
    {"dflash_sample", sizeof(dflash_sample), init_zero, call_train_sample_in, false},
    {"dflash_sample", sizeof(dflash_sample), init_zero, call_spool_sample, true},
    {"dflash_hidden_rows", sizeof(dflash_hidden_rows), init_rows, call_rows, false},
    {"dflash_train_stats", sizeof(dflash_train_stats), init_zero, call_train_stats, true},
    {"dflash_hidden_info", sizeof(dflash_hidden_info), init_zero, call_hidden_info, true},
    {"dflash_spool_info", sizeof(dflash_spool_info), init_zero, call_spool_info, true},
    {"dflash_hidden_writer_spool_status", sizeof(dflash_hidden_writer_spool_status), init_zero,
     call_spool_status, true},
};

/* ---- harness -------------------------------------------------------------- */

static ctx *open_ctx(void) {
  static ctx c;
  c.dir = df_test_tmpdir();
  dflash_fetch_options o;
  dflash_fetch_options_default(&o);
  ck_assert_ok(call_fetch(&o, &c)); /* the fetcher below reuses its files */
  fill_fetch(&o);
  char *in = df_path_join(c.dir, "in.jsonl");
  char *out = df_path_join(c.dir, "fetch-ctx");
  ck_assert_ok(dflash_fetch_create(&o, in, out, &c.fetch));
  free(in);
  free(out);
  return &c;
}

static void close_ctx(ctx *c) {
  dflash_fetch_free(c->fetch);
  df_test_rmtree(c->dir);
  free(c->dir);
}

static size_t size_of(const unsigned char *buf) {
  size_t n;
  memcpy(&n, buf, sizeof n);
  return n;
}

static void expect_canary(const unsigned char *buf, size_t from, size_t to, const char *what) {
  for (size_t i = from; i < to; i++)
    ck_assert_msg(buf[i] == CANARY, "%s: byte %zu written (past the caller's struct)", what, i);
}

static void expect_zero(const unsigned char *buf, size_t from, size_t to, const char *what) {
  for (size_t i = from; i < to; i++)
    ck_assert_msg(buf[i] == 0, "%s: byte %zu, a field newer than the library's, not zeroed", what,
                  i);
}

/* The struct of `n` bytes a caller built with another header would pass; canaries after it. */
static void caller_struct(const opts_case *k, unsigned char *buf, size_t n) {
  memset(buf, CANARY, k->size + SLACK);
  k->init(buf, n);
}

START_TEST(init_writes_up_to_the_callers_size) {
  const opts_case *k = &CASES[_i];
  if (k->init == init_zero) return; /* no _init function to check */
  unsigned char buf[1024];
  ck_assert_uint_le(k->size + SLACK, sizeof buf);
  caller_struct(k, buf, k->size - 8);
  ck_assert_uint_eq(size_of(buf), k->size - 8);
  expect_canary(buf, k->size - 8, k->size + SLACK, k->name);
  caller_struct(k, buf, k->size + 8);
  ck_assert_uint_eq(size_of(buf), k->size + 8);
  expect_zero(buf, k->size, k->size + 8, k->name);
  expect_canary(buf, k->size + 8, k->size + SLACK, k->name);
}
END_TEST

START_TEST(smaller_and_larger_structs_follow_the_rule) {
  const opts_case *k = &CASES[_i];
  ctx *c = open_ctx();
  unsigned char buf[1024];
  /* The library's own size, then an older caller's (8 bytes short). */
  for (size_t n = k->size; n >= k->size - 8; n -= 8) {
    caller_struct(k, buf, n);
    ck_assert_msg(k->call(buf, c) == DFLASH_OK, "%s at %zu bytes: %s", k->name, n,
                  dflash_last_error());
    ck_assert_uint_eq(size_of(buf), n);
    if (k->output) expect_canary(buf, n, k->size + SLACK, k->name);
  }
  /* A newer caller's, its unknown tail zero. */
  caller_struct(k, buf, k->size + 8);
  ck_assert_msg(k->call(buf, c) == DFLASH_OK, "%s at %zu bytes, zero tail: %s", k->name,
                k->size + 8, dflash_last_error());
  if (k->output) {
    expect_zero(buf, k->size, k->size + 8, k->name);
    expect_canary(buf, k->size + 8, k->size + SLACK, k->name);
  } else {
    /* ... and with a field set there: options this library cannot honour. */
    caller_struct(k, buf, k->size + 8);
    buf[k->size + 3] = 1;
    ck_assert_status(k->call(buf, c), DFLASH_E_UNSUPPORTED, k->name);
  }
  /* Not a struct size at all. */
  caller_struct(k, buf, k->size);
  size_t bad = 3;
  memcpy(buf, &bad, sizeof bad);
  ck_assert_status(k->call(buf, c), DFLASH_E_INVALID_ARG, "struct_size");
  close_ctx(c);
}
END_TEST

Suite *df_test_suite(void) {
  Suite *s = suite_create("opts");
  TCase *tc = tcase_create("rule");
  tcase_set_timeout(tc, 60);
  int n = (int)DF_ARRAY_LEN(CASES);
  tcase_add_loop_test(tc, init_writes_up_to_the_callers_size, 0, n);
  tcase_add_loop_test(tc, smaller_and_larger_structs_follow_the_rule, 0, n);
  suite_add_tcase(s, tc);
  return s;
}
