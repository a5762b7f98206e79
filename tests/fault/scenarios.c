/* The paths the fault loop runs (fault_loop.h): the tokenizer loader, dataset build, the
 * hidden-store writer, the spool (producer and consumer), checkpoint save and resume of a
 * training run, and fetch's output files. Each is small, so the loop stays short. */
#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/tokenizer.h>
#include <dflash/train.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "fault_loop.h"
#include "fetch/fetch_internal.h"
#include "testutil.h"
#include "train/synth.h"

/* Paths inside an op are built on the stack: the harness's own allocations would count. */
enum { PATH_CAP = 4096 };
static char *at(char buf[PATH_CAP], const char *dir, const char *name) {
  snprintf(buf, PATH_CAP, "%s/%s", dir, name);
  return buf;
}

/* ---- a small byte-level BPE tokenizer.json ------------------------------------------ */

/* GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others
 * take the code points from U+0100 on, in byte order. */
static unsigned byte_char(unsigned b) {
  if ((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae) return b;
  unsigned n = 0;
  for (unsigned k = 0; k < b; k++)
    if (!((k >= 0x21 && k <= 0x7e) || (k >= 0xa1 && k <= 0xac) || k >= 0xae)) n++;
  return 0x100 + n;
}

static const char *const MERGES[] = {"h e", "l l", "he ll", "o n", "e r", "Ġ t", "i n", "Ġ a"};

static void tokenizer_json(const char *path) {
  df_buf b = {0};
  DF_IGNORE(df_buf_printf(&b, "{\"version\": \"1.0\", \"added_tokens\": ["));
  static const char *const added[] = {"<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                      "<|endoftext|>"};
  int next = 256 + (int)DF_ARRAY_LEN(MERGES);
  for (size_t i = 0; i < DF_ARRAY_LEN(added); i++)
    DF_IGNORE(df_buf_printf(&b,
                            "%s{\"id\": %d, \"content\": \"%s\", \"single_word\": false, "
                            "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, "
                            "\"special\": true}",
                            i ? ", " : "", next + (int)i, added[i]));
  DF_IGNORE(df_buf_printf(&b, "], \"normalizer\": null, \"pre_tokenizer\": {\"type\": "
                              "\"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true}, "
                              "\"decoder\": {\"type\": \"ByteLevel\"}, \"model\": {\"type\": "
                              "\"BPE\", \"vocab\": {"));
  for (unsigned i = 0; i < 256; i++) {
    unsigned c = byte_char(i);
    char u[4] = {(char)c, 0, 0, 0};
    if (c >= 0x80) u[0] = (char)(0xC0 | c >> 6), u[1] = (char)(0x80 | (c & 0x3F));
    DF_IGNORE(df_buf_printf(&b, "%s\"%s%s\": %u", i ? ", " : "", c == '"' || c == '\\' ? "\\" : "",
                            u, i));
  }
  for (size_t i = 0; i < DF_ARRAY_LEN(MERGES); i++) {
    char joined[16];
    size_t k = 0;
    for (const char *s = MERGES[i]; *s; s++)
      if (*s != ' ') joined[k++] = *s;
    joined[k] = 0;
    DF_IGNORE(df_buf_printf(&b, ", \"%s\": %zu", joined, 256 + i));
  }
  DF_IGNORE(df_buf_printf(&b, "}, \"merges\": ["));
  for (size_t i = 0; i < DF_ARRAY_LEN(MERGES); i++)
    DF_IGNORE(df_buf_printf(&b, "%s\"%s\"", i ? ", " : "", MERGES[i]));
  DF_IGNORE(df_buf_printf(&b, "]}}"));
  fault_write(path, b.data);
  df_buf_free(&b);
}

/* ---- tokenizer: load, encode, decode ------------------------------------------------- */

static void tok_prepare(const char *root) {
  char *p = fault_path(root, "tokenizer.json");
  tokenizer_json(p);
  free(p);
}

static dflash_status tok_op(const char *root, const char *out) {
  (void)out;
  char p[PATH_CAP];
  dflash_tokenizer *t = NULL;
  dflash_status st = dflash_tokenizer_load(at(p, root, "tokenizer.json"), NULL, &t);
  static const char text[] = "<|im_start|>hello there, in an other <think>world</think>";
  int32_t ids[128];
  size_t n = 0, len = 0;
  char back[256];
  if (!st) st = dflash_tokenizer_encode(t, text, sizeof text - 1, DFLASH_SPECIAL_ALL, ids, 128, &n);
  if (!st) st = dflash_tokenizer_decode(t, ids, n, back, sizeof back, &len);
  if (!st && (len != sizeof text - 1 || memcmp(back, text, sizeof text - 1)))
    st = df_error(DFLASH_E_INTERNAL, "tokenizer round trip changed the text");
  dflash_tokenizer_free(t);
  return st;
}

/* ---- dataset build ------------------------------------------------------------------- */

#define CONV(q, a)                                                                           \
  "{\"messages\": [{\"role\": \"user\", \"content\": \"" q "\"}, {\"role\": \"assistant\", " \
  "\"content\": \"" a "\"}]}\n"

static void build_prepare(const char *root) {
  tok_prepare(root);
  char *in = fault_path(root, "in.jsonl");
  fault_write(in, CONV("hello", "there")
                      CONV("one", "two") "\n{not json\n" CONV("three", "in an other world")
                          CONV("four", "hell on") CONV("five", "er"));
  free(in);
}

static dflash_status build_op(const char *root, const char *out) {
  char tok[PATH_CAP], in[PATH_CAP], dir[PATH_CAP];
  at(tok, root, "tokenizer.json"), at(in, root, "in.jsonl"), at(dir, out, "data");
  dflash_dataset_build_options o;
  dflash_dataset_build_options_default(&o);
  o.tokenizer_path = tok;
  o.template_name = "qwen3";
  o.allow_split_control_tokens = 1;
  o.max_reject_ratio = 1;
  o.threads = 1;
  o.batch_lines = 2;
  o.shard_tokens = 64;
  const char *inputs[] = {in};
  return dflash_dataset_build(inputs, 1, dir, &o, NULL);
}

/* The side files report the lines read so far, also when the build fails (its verdict points
 * to rejected.jsonl): whole lines, not the fault-free run's. */
static const char *const build_varying[] = {"rejected.jsonl", "sources.jsonl", NULL};

/* ---- hidden store: reopen an existing one and append, bf16 and fp8 with target ids --- */

enum { HK = 2, HH = 8, HS = 6 };

static void rows(float *h, int seed) {
  for (int i = 0; i < HS * HK * HH; i++) h[i] = (float)((i * 7 + seed * 13) % 23) / 11.0f - 1.0f;
}

static dflash_status append_some(dflash_hidden_writer *w, int from, int to, bool target) {
  float h[HS * HK * HH];
  int32_t ids[HS] = {1, 2, 3, 4, 5, 6};
  dflash_status st = DFLASH_OK;
  for (int i = from; !st && i < to; i++) {
    char id[16];
    snprintf(id, sizeof id, "s%d", i);
    rows(h, i);
    st = target ? df_test_hidden_add(w, id, h, ids, HS) : df_test_hidden_add(w, id, h, NULL, HS);
  }
  return st;
}

static dflash_status write_store(const char *dir, int dtype, int from, int to, bool target) {
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.dtype = dtype;
  o.shard_bytes = 300; /* a shard every sample or two */
  dflash_hidden_writer *w = NULL;
  dflash_status st = dflash_hidden_writer_create(dir, HK, HH, &o, &w);
  if (!st) st = append_some(w, from, to, target);
  if (!st) st = dflash_hidden_writer_commit(w);
  dflash_hidden_writer_free(w);
  return st;
}

static void hidden_prepare(const char *root) { (void)root; }

static void hidden_setup(const char *root, const char *out) {
  (void)root;
  char *a = fault_path(out, "bf16"), *b = fault_path(out, "fp8");
  dflash_status st = write_store(a, DFLASH_DTYPE_BF16, 0, 2, false);
  if (!st) st = write_store(b, DFLASH_DTYPE_F8_E4M3, 0, 2, true);
  if (st) fault_die("hidden set-up", st);
  free(a), free(b);
}

static dflash_status hidden_op(const char *root, const char *out) {
  (void)root;
  char a[PATH_CAP], b[PATH_CAP];
  dflash_status st = write_store(at(a, out, "bf16"), DFLASH_DTYPE_BF16, 2, 5, false);
  if (!st) st = write_store(at(b, out, "fp8"), DFLASH_DTYPE_F8_E4M3, 2, 5, true);
  return st;
}

/* The index is rewritten after each shard (hidden.h): any whole one will do. */
static const char *const hidden_varying[] = {"hidden.safetensors.index.json", NULL};

/* ---- spool: a producer publishes two epochs, a consumer reads and releases them ------ */

static dflash_status produce(const char *dir) {
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.shard_bytes = 300;
  o.spool_budget = 1 << 20;
  dflash_hidden_writer *w = NULL;
  dflash_status st = dflash_hidden_writer_create(dir, HK, HH, &o, &w);
  for (int e = 0; !st && e < 2; e++) {
    st = append_some(w, 0, 4, e == 1);
    if (!st) st = dflash_hidden_writer_end_epoch(w);
  }
  if (!st) st = dflash_hidden_writer_commit(w);
  dflash_hidden_writer_free(w);
  return st;
}

static dflash_status consume(const char *dir) {
  dflash_spool_options o;
  dflash_spool_options_default(&o);
  o.wait_s = 0;
  dflash_spool *sp = NULL;
  dflash_status st = dflash_spool_open(dir, &o, &sp);
  for (int epochs = 0; !st && epochs < 2;) {
    dflash_sample s = {.struct_size = sizeof s};
    int end = 0;
    st = dflash_spool_next(sp, &s, &end);
    if (!st && end) epochs++;
    if (!st && (end || s.offset == 0)) {
      int32_t e;
      uint64_t shard, off;
      st = dflash_spool_tell(sp, &e, &shard, &off);
      if (!st) st = dflash_spool_release(sp, e, shard);
    }
  }
  dflash_spool_free(sp);
  return st;
}

static dflash_status produce_op(const char *root, const char *out) {
  (void)root;
  char dir[PATH_CAP];
  return produce(at(dir, out, "spool"));
}

static void consume_setup(const char *root, const char *out) {
  (void)root;
  char dir[PATH_CAP];
  dflash_status st = produce(at(dir, out, "spool"));
  if (st) fault_die("spool set-up", st);
}

static dflash_status consume_op(const char *root, const char *out) {
  (void)root;
  char dir[PATH_CAP];
  return consume(at(dir, out, "spool"));
}

/* The consumer's mark moves on with every release: any whole one will do. */
static const char *const consume_varying[] = {"/consumed", NULL};

static const char *consumed_whole(const char *name, const char *text, size_t len) {
  (void)name;
  int e, k = 0;
  unsigned long long shard;
  if (sscanf(text, "epoch=%d shard=%llu\n%n", &e, &shard, &k) != 2 || (size_t)k != len)
    return "not a whole consumer mark";
  return NULL;
}

/* ---- a training run: save, then resume and save again ------------------------------- */

static void run_options(dflash_train_run_options *o, const char *root, const char *out,
                        int64_t steps) {
  synth_run_options(o, root, out);
  o->epochs = 1;
  o->max_steps = steps;
  o->schedule_steps = DFLASH_SCHEDULE_EPOCHS; /* the first two steps' run is resumed to 4 */
  o->save_every = 2;
  o->save_every_s = 0;
}

/* Made before the loop, for the two output folders the loop uses (fault_loop.c: ref for
 * the fault-free runs, out for the others): the harness's own allocations never count. */
static dflash_train_run_options g_resume[2];

static void train_prepare(const char *root) {
  synth_world(root, 8, 16, 3);
  for (int i = 0; i < 2; i++) {
    run_options(&g_resume[i], root, synth_at(root, i ? "out" : "ref"), 4);
    g_resume[i].resume = 1;
  }
}

/* The first two steps and their save, once: the resume starts from a copy. */
static void train_setup(const char *root, const char *out) {
  char *first = fault_path(root, "first");
  if (access(first, F_OK) != 0) {
    dflash_train_run_options o;
    run_options(&o, root, first, 2);
    dflash_status st = dflash_train_run(&o, NULL);
    if (st) fault_die("the first two steps", st);
  }
  df_test_rmtree(out);
  fault_copy_tree(first, out);
  free(first);
}

static dflash_status train_op(const char *root, const char *out) {
  (void)root;
  return dflash_train_run(&g_resume[strcmp(out, g_resume[0].out_dir) != 0], NULL);
}

/* The state holds the run's time; metrics.jsonl its speed. A sample the stream cannot read
 * (out of memory too) stops the run with the checkpoint and state saved as of the step
 * before it (run.h): a whole model.safetensors of another step. */
static const char *const train_varying[] = {"state.safetensors", "metrics.jsonl",
                                            "model.safetensors", NULL};

/* ---- fetch's output: repair a damaged completions file, then append ------------------ */

static json_t *g_records[3];

static void fetch_prepare(const char *root) {
  (void)root;
  for (int i = 0; i < 3; i++)
    if (!g_records[i])
      g_records[i] = json_pack("{s:s,s:i}", "id", (char[]){(char)('c' + i), 0}, "x", i);
}

static void fetch_setup(const char *root, const char *out) {
  (void)root;
  char *p = fault_path(out, "completions.jsonl");
  fault_write(p, "{\"id\":\"a\",\"x\":1}\n\x01\x02garbage\n{\"id\":\"b\",\"x\":2}\n{\"id\":\"c\",");
  free(p);
}

static dflash_status count_record(void *ctx, const char *id, uint64_t line, const char *text,
                                  size_t len) {
  (void)id, (void)line, (void)text, (void)len;
  ++*(int *)ctx;
  return DFLASH_OK;
}

static dflash_status fetch_op(const char *root, const char *out) {
  (void)root;
  char p[PATH_CAP];
  df_out o;
  int seen = 0;
  dflash_status st = df_out_open(at(p, out, "completions.jsonl"), count_record, &seen, &o);
  if (st) return st; /* closed by df_out_open */
  for (int i = 0; !st && i < 3; i++) st = df_out_append(&o, g_records[i]);
  if (!st) st = df_out_sync(&o, 0, df_now_seconds());
  df_out_close(&o);
  return st;
}

/* The file is append-only by design: a failed append leaves the records before it. */
static const char *const fetch_varying[] = {"completions.jsonl", "completions.jsonl.corrupt", NULL};

/* ---- fetch's requests: a conversation line parsed, its answer's and a probe's bodies ------ */

static const char REQ_LINE[] =
    "{\"id\": \"r1\", \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
    "{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": "
    "\"Hello\", \"reasoning\": \"greet\"}, {\"role\": \"user\", \"content\": \"2+2?\"}]}";

static void fetch_req_prepare(const char *root) { (void)root; }

static dflash_status write_body(const char *out, const char *name, const df_body_cfg *cfg,
                                json_t *msgs, bool probe) {
  char p[PATH_CAP], *body = NULL;
  size_t len = 0;
  dflash_status st = df_body_build(cfg, msgs, probe ? NULL : "r1-0", probe, &body, &len);
  if (!st) st = df_write_file_atomic(at(p, out, name), body, len);
  free(body);
  return st;
}

static dflash_status fetch_req_op(const char *root, const char *out) {
  (void)root;
  df_conv c;
  char *explicit_id = NULL;
  dflash_status st = df_conv_parse(REQ_LINE, sizeof REQ_LINE - 1, "in.jsonl", 1, &c, &explicit_id);
  free(explicit_id);
  if (st) return st;
  json_t *stop = json_pack("[s]", "</answer>"), *extra = json_pack("{s:i}", "n", 1);
  json_t *msgs = df_messages_for_server(c.messages);
  df_body_cfg cfg = {.model = "kimi-k2.6",
                     .family = DFLASH_FETCH_FAMILY_KIMI,
                     .thinking = 1,
                     .max_tokens = 64,
                     .top_k = 20,
                     .stream = 1,
                     .temperature = 1.0,
                     .top_p = 0.95,
                     .min_p = -1,
                     .seed = 7,
                     .stop = stop,
                     .extra = extra};
  if (!stop || !extra || !msgs) st = df_error_nomem("request scenario");
  if (!st) st = write_body(out, "body.json", &cfg, msgs, false);
  if (!st) st = write_body(out, "probe.json", &cfg, msgs, true);
  json_decref(stop), json_decref(extra), json_decref(msgs);
  df_conv_free(&c);
  return st;
}

const fault_scenario fault_scenarios[] = {
    {"tokenizer", tok_prepare, NULL, tok_op, NULL, NULL, NULL},
    {"dataset-build", build_prepare, NULL, build_op, build_varying, NULL, NULL},
    {"hidden-writer", hidden_prepare, hidden_setup, hidden_op, hidden_varying, NULL, NULL},
    {"spool-produce", hidden_prepare, NULL, produce_op, NULL, NULL, NULL},
    {"spool-consume", hidden_prepare, consume_setup, consume_op, consume_varying, consumed_whole,
     NULL},
    {"train-resume", train_prepare, train_setup, train_op, train_varying, NULL, NULL},
    {"fetch-output", fetch_prepare, fetch_setup, fetch_op, fetch_varying, NULL, NULL},
    {"fetch-request", fetch_req_prepare, NULL, fetch_req_op, NULL, NULL, NULL},
};
const int fault_n_scenarios = (int)DF_ARRAY_LEN(fault_scenarios);
